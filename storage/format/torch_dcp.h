// PyTorch DCP (torch.distributed.checkpoint) directories, read and written without Python.
//
// Layout of such a directory (what torch's FileSystemWriter writes):
//   .metadata            the commit marker: a pickled torch...checkpoint.metadata.Metadata
//   __<rank>_<n>.distcp  records, concatenated; `.metadata` places each (file, offset, length)
// A tensor record is one torch.save archive of the tensor (a zip: archive/data.pkl, a small
// pickle naming dtype, sizes, strides and storage offset, and archive/data/<key>, the stored
// storage bytes); a byte entry's record is torch.save(obj) of a Python object.
//
// dcp reads both torch 2.x metadata (torch.distributed.checkpoint.*) and torch 1.13's
// (torch.distributed._shard.checkpoint.*) through a restricted unpickler (storage/format/pickle.h)
// with an explicit allow-list of the classes DCP metadata uses, and maps it onto dcp's Metadata:
// tensor records get the transform "torch.save" (resolved into plain byte ranges when a load
// reads them, the layout's ItemDecoder: storage/format/torch_dcp_layout.cc), byte entries are
// raw blobs holding the torch.save bytes unchanged. Any Store-based backend (file://, mem://,
// plugins) loads such a directory, detected by its `.metadata`; `torchdcp://` writes one (see
// MakeStoreWriter's format).
//
// Everything read is untrusted: bounded pickles, archives located inside their record's range,
// sizes checked against the record before anything is allocated; failures are CorruptionError
// or UnsupportedError naming the source (file and offset, or entry).
//
// Implemented in torch_metadata.cc (the `.metadata` pickle), torch_record.cc (records),
// torch_save_file.cc (whole torch.save files) and torch_zip.{h,cc} (the zip archives), which
// share torch_internal.h.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/proto/plan.h"
#include "dcp/proto/tensor.h"
#include "dcp/storage/format/pickle.h"
#include "dcp/storage/store.h"

namespace dcp {

inline constexpr char kTorchDcpMetadataName[] = ".metadata";
/// Transform name of a tensor record that is a torch.save archive.
inline constexpr char kTorchSaveTransform[] = "torch.save";

/// Which torch writes or reads a directory: 2.x (torch.distributed.checkpoint, the default) or
/// 1.13 (torch.distributed._shard.checkpoint, no storage_meta/version/planner_data).
enum class TorchDcpFlavor : uint8_t { kTorch2 = 2, kTorch113 = 1 };

/// Decode and validate a `.metadata` pickle into dcp's Metadata. `source` names it in errors.
Metadata DecodeTorchDcpMetadata(std::string_view bytes, std::string_view source);
/// Encode dcp Metadata whose items were written as torch records (MakeTorchDcpWriter) as a
/// `.metadata` pickle of `flavor`. `checkpoint_id` is recorded in storage_meta (2.x).
/// UnsupportedError for a dtype the flavor's torch lacks.
std::string EncodeTorchDcpMetadata(const Metadata& md, TorchDcpFlavor flavor,
                                   const std::string& checkpoint_id);

/// Where the values of one tensor record lie, from its archive (read with libzip).
struct TorchTensorRecord {
  DType dtype = DType::kFloat32;
  Shape sizes;
  Shape strides;               // elements
  int64_t storage_offset = 0;  // elements
  uint64_t storage_begin = 0;  // absolute offset of the storage bytes in the file
  uint64_t storage_bytes = 0;
  uint32_t zip_crc32 = 0;  // of the storage bytes (zip CRC-32)
  /// Bytes from element 0 to one past the last element the view reaches (0 when it has no
  /// elements); checked to lie inside the storage. What a strided reader reads, from
  /// values_begin().
  uint64_t span_bytes = 0;
  /// True when the values are the row-major bytes [storage_begin + storage_offset * esize,
  /// + numel * esize).
  bool row_major() const;
  /// The absolute offset of element 0 (inside the storage, checked).
  uint64_t values_begin() const;
  /// True when the values are the whole storage, row-major: a plain read of the values then reads
  /// exactly the bytes the zip CRC-32 covers, and can check it as it streams.
  bool covers_storage() const;
};

/// The whole storage of `rec`, read from `in` and checked against its zip CRC-32 when `verify`
/// (CorruptionError naming `what`). For records whose values are not the whole storage, row-major:
/// their values are then viewed at values_begin() - storage_begin in the returned bytes. The
/// buffer is at most the record's length, which the caller has bounded by the file.
std::vector<char> ReadTorchRecordStorage(ReadableObject& in, const TorchTensorRecord& rec,
                                         const std::string& what, bool verify);

/// Locate the tensor in the torch.save archive at [offset, offset + length) of `in`. `what`
/// names the record in errors. Reads the archive's directories and its small pickle only.
TorchTensorRecord ResolveTorchTensorRecord(ReadableObject& in, uint64_t offset, uint64_t length,
                                           const std::string& what);

/// Read every entry of the archive at [offset, offset + length) and check each entry's CRC-32
/// and that it holds the bytes it claims (CorruptionError naming `what` and the entry
/// otherwise); zip64 sizes and offsets are read. For verify. With `record`, the archive is also
/// resolved as a tensor record into it from the same read of its directory
/// (ResolveTorchTensorRecord's checks).
void CheckTorchArchiveCrcs(ReadableObject& in, uint64_t offset, uint64_t length,
                           const std::string& what, TorchTensorRecord* record = nullptr);
/// The same for an archive held in memory (a PyTorch DCP byte entry, read whole).
void CheckTorchArchiveCrcs(std::string_view archive, const std::string& what);

/// True when `bytes` look like a torch.save archive (a zip starting with a local header).
bool IsTorchSaveArchive(std::string_view bytes);
/// The torch.save archive of the Python `bytes` object `payload` (what dcp writes for a blob
/// that is not itself a torch.save archive, so torch.load returns the blob as bytes).
std::string TorchSaveOfBytes(std::string_view payload);
/// If `record` is a torch.save archive of a Python bytes object (TorchSaveOfBytes), its payload.
bool TorchSaveBytesPayload(std::string_view record, std::string* payload);
/// The torch.save archive of the Python object pickled in `pickle` (e.g. pickle::Dump of a
/// float, a tuple, a list of str): torch.load returns that object, and dcp writes such a blob to
/// a torchdcp:// checkpoint unchanged (a byte entry as torch writes one).
std::string TorchSaveOfPickle(std::string_view pickle);
/// The Python object a byte entry holds: the object pickled in a torch.save archive's data.pkl
/// (what torch writes for any non-tensor value), or a bare pickle. Plain data only: no global
/// is allowed, except the ones a pickled bytes object uses (which comes back as kBytes).
/// CorruptionError for a malformed archive or pickle, UnsupportedError for a pickle that refers
/// to other globals (a class instance) or uses an opcode the reader lacks, InvalidArgumentError
/// when `bytes` is neither an archive nor a pickle; each names `what`.
pickle::ValuePtr TorchSaveObject(std::string_view bytes, const std::string& what);

/// One value of a torch.save file (ReadTorchSaveFile).
struct TorchSaveLeaf {
  std::string fqn;  // the dict keys from the root down, joined with '.' (int keys in decimal)
  std::optional<TorchTensorRecord> tensor;  // a tensor or nn.Parameter: where its values lie
  bool is_bytes = false;                    // a Python bytes object, whose payload is `bytes`
  std::string bytes;
  /// Any other value (an int, a string, a list of numbers...): a torch.save archive of it
  /// alone, as PyTorch DCP stores such a value (torch.load returns the value).
  std::string record;
  pickle::ValuePtr value;  // that value, as read (null for a tensor or bytes)
};

/// The values of the torch.save file in `in` (`length` bytes from offset 0), read without
/// LibTorch: its root must be a dict or OrderedDict (what torch.save(model.state_dict()) and
/// torch.save({...}) write), nested dicts are flattened into dotted names, and each leaf is a
/// tensor (located, not read: its storage entry, offset, sizes and strides, checked to lie in
/// the storage as ResolveTorchTensorRecord checks), bytes, or another value kept as a record.
/// Tensors may share storages (views, tied weights). Untrusted input: the archive's entries
/// (at most 2^20), directories (256 MiB) and pickle (256 MiB) are bounded, and no code runs.
/// CorruptionError naming `what` (and the tensor) for a malformed file; UnsupportedError for a
/// root that is not a dict, a key that is neither a string nor an int, a list or other
/// container holding tensors, or a global the reader does not know.
std::vector<TorchSaveLeaf> ReadTorchSaveFile(ReadableObject& in, uint64_t length,
                                             const std::string& what);

/// Append one torch.save archive of `view` (host or device, any strides; stored row-major) to
/// `out`, computing the data's CRC-32 as it streams (a zip data descriptor carries it). Returns
/// the record's length. `torch2`: a record as torch 2.x writes it (any dtype, with
/// .format_version, .storage_alignment, byteorder and .data/serialization_id); otherwise one
/// torch 1.13 reads (UnsupportedError for a dtype 1.13 lacks). The zip's top folder is "archive".
uint64_t AppendTorchTensorRecord(WritableObject& out, const TensorView& view, bool torch2);

/// True for record file names the torchdcp writer creates ("__<rank>_<n>....distcp").
bool IsTorchDcpDataName(const std::string& name);

}  // namespace dcp
