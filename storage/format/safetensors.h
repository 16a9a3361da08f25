// Hugging Face safetensors checkpoints, read as a checkpoint format (docs/SAFETENSORS.md).
//
// A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
//   {"<name>": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//    "__metadata__": {"<key>": "<value>", ...}}
// and then the tensors' raw row-major little-endian bytes; offsets count from the byte after the
// header. A checkpoint is a directory (or prefix) holding either
//   model.safetensors.index.json + the files its "weight_map" names (the Hub's sharded layout,
//     model-0000k-of-0000N.safetensors), or
//   model.safetensors (a single file),
// or is a URI naming one *.safetensors object itself (OpenStoreForReading, registry.h).
// Every tensor becomes one dcp entry with one chunk covering it, stored raw (no transform, no
// checksum) at [8 + N + begin, 8 + N + end) of its file, so the generic reader
// (storage/checkpoint/store_reader.cc) loads it into any layout and world size. Tensors named in
// `__metadata__["dcp.blobs"]` (a JSON list, what `dcp convert` writes for byte entries) that are
// 1-d U8 become byte entries; every other `__metadata__` entry is ignored.
//
// Everything read is untrusted: the header length is bounded (kMaxSafetensorsHeaderBytes), the
// JSON parsed by nlohmann-json, dtype names, shapes (overflow), offsets (inside the file, sized
// numel x itemsize, no overlap) and weight_map file names (plain names: no '/', no "..") checked.
// Failures are CorruptionError (UnsupportedError for a dtype dcp lacks, NotFoundError for a file
// the index names that is missing) naming the file and the tensor. dcp writes the format too
// (storage/format/safetensors_writer.cc, `?format=safetensors`).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "dcp/proto/plan.h"
#include "dcp/proto/tensor.h"
#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"

namespace dcp {

inline constexpr char kSafetensorsIndexName[] = "model.safetensors.index.json";
inline constexpr char kSafetensorsSingleName[] = "model.safetensors";
/// The `__metadata__` key listing byte entries (a JSON list of names, in a string).
inline constexpr char kSafetensorsBlobsKey[] = "dcp.blobs";
/// The largest header (and index file) read: real headers are a few MiB at most.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = uint64_t{100} << 20;

/// The safetensors name of `dtype` ("F32", "BF16", "F8_E4M3", ...); nullopt when it has none.
std::optional<std::string> SafetensorsDTypeName(DType dtype);
/// The dtype a safetensors name stands for; nullopt for names dcp does not know.
std::optional<DType> DTypeFromSafetensorsName(std::string_view name);

/// True for "*.safetensors" names.
bool IsSafetensorsName(std::string_view name);

/// The checkpoint's metadata from the safetensors files of `store` (the index and every file it
/// names, or the single file). NotFoundError when there is neither; CorruptionError or
/// UnsupportedError for a bad index or header (see above).
Metadata ReadSafetensorsMetadata(Store& store);

/// Add the tensors of one safetensors file, whose first bytes are `head` (at least its 8-byte
/// length and whole header when the file has them) and whose size is `file_size`, to `md` as
/// entries stored in `file`. Exposed for the fuzzer; ReadSafetensorsMetadata uses it.
/// `only`, when given, lists the tensors the index assigns to this file (others are an error).
void AddSafetensorsFile(std::string_view head, uint64_t file_size, const std::string& file,
                        const std::string& where, Metadata& md);

/// True for the data file names a safetensors save creates
/// (model-<5+ digits>-of-<5+ digits>-<hex save id>.safetensors); clean-up removes only these.
bool IsSafetensorsDataName(const std::string& name);

/// The safetensors save: `protocol` (MakeStoreWriter's generic writer of this format over the
/// same store) keeps the lock, the commit of the index and the clean-up; the returned writer
/// plans the files, exchanges shards through StorageContext::exchange (required for more than
/// one rank) and writes each file on its owner rank.
std::unique_ptr<StorageWriter> MakeSafetensorsWriter(std::unique_ptr<StorageWriter> protocol,
                                                     std::shared_ptr<Store> store,
                                                     const StorageOptions& options);

/// A read-only view of `dir` in which only the object `name` exists: what a URI naming one
/// `*.safetensors` file loads from (registry.cc). Writes are refused (UnsupportedError).
std::shared_ptr<Store> SafetensorsFileView(std::shared_ptr<Store> dir, const std::string& name);

}  // namespace dcp
