// How a checkpoint is laid out in a store: its metadata file, its data file names, and how one
// item becomes bytes in a data file. The checkpoint protocol
// (storage/checkpoint/store_writer.cc: lock, overwrite, commit, clean-up) is the same for every
// layout and runs over any Store, so every format can be written to every store. (safetensors,
// whose files hold whole tensors assembled across ranks, keeps the protocol and replaces only its
// per-rank data path: WrapWriter, format/safetensors_writer.cc.) Internal: not installed.
//
// Layouts are stateless and shared; they are thread-safe. An ItemEncoder serves one data file
// on one thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/planner/planner.h"
#include "dcp/storage/builtin.h"
#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"

namespace dcp {


/// Appends items to one data file, each at the file's current end.
class ItemEncoder {
 public:
  virtual ~ItemEncoder() = default;
  /// Append `item` (bytes from `data`) to `out` and describe it in `info`: length, raw_length,
  /// transforms and checksum. The caller sets info.relative_path and info.offset.
  virtual void Append(WritableObject& out, const WriteItem& item, const ResolvedData& data,
                      StorageInfo& info) = 0;
};

class CheckpointLayout {
 public:
  virtual ~CheckpointLayout() = default;
  virtual CheckpointFormat format() const = 0;
  /// For messages: "dcp", "PyTorch DCP".
  virtual std::string_view display_name() const = 0;
  /// The commit marker: the file whose atomic appearance makes the checkpoint exist.
  virtual const std::string& metadata_name() const = 0;
  /// InvalidArgumentError naming `uri` for options this layout cannot honour.
  virtual void CheckWriteOptions(const StorageOptions& options, const std::string& uri) const;
  /// The prefix of rank `rank`'s data file names in save `save_id` (a plan's storage_data).
  virtual std::string FilePrefix(const std::string& save_id, size_t rank) const = 0;
  /// Data file `bucket` of a rank whose prefix is `prefix`.
  virtual std::string DataFileName(const std::string& prefix, size_t bucket) const = 0;
  /// True for names this layout's writer creates for data (clean-up never touches others).
  virtual bool IsDataFile(const std::string& name) const = 0;
  /// The committed metadata's bytes. `uri` names the checkpoint in errors.
  virtual std::string EncodeMetadata(const Metadata& md, const std::string& uri) const = 0;
  /// True when `store` holds a checkpoint of this layout (its commit marker exists). Default:
  /// metadata_name() exists.
  virtual bool Detect(Store& store) const;
  /// Read and decode the metadata file of `store` (untrusted: bounded, validated). When
  /// `encoded` is given, it receives the metadata's wire encoding (EncodeMetadata) if the file
  /// holds it as read (the dcp format: its payload), and is cleared otherwise.
  virtual Metadata ReadMetadata(Store& store, std::string* encoded) const = 0;
  Metadata ReadMetadata(Store& store) const { return ReadMetadata(store, nullptr); }
  /// The encoder of one data file of the protocol's per-rank data path. Default: nullptr, for a
  /// layout whose WrapWriter replaces that path (the protocol then never asks).
  virtual std::unique_ptr<ItemEncoder> NewItemEncoder(const StorageOptions& options) const;
  /// The writer a save in this layout uses: `protocol` (the checkpoint protocol over `store`,
  /// writing this layout: storage/checkpoint/store_checkpoint.h) or a writer that keeps it for
  /// the lock, the commit and the clean-up and replaces its data path (safetensors: whole
  /// tensors assembled across ranks, format/safetensors_writer.cc). Default: `protocol`.
  virtual std::unique_ptr<StorageWriter> WrapWriter(std::unique_ptr<StorageWriter> protocol,
                                                    std::shared_ptr<Store> store,
                                                    const StorageOptions& options) const;
  /// The store a reader of `location` (of scheme `scheme`) reads when `location` names one
  /// object that is a checkpoint of this layout by itself (a `*.safetensors` file): a read-only
  /// view of its parent, opened with `open`, holding only that object. Default: nullptr (not
  /// such an object; the reader opens the store at `location`). Never throws for a location
  /// `open` cannot open as a parent (nullptr).
  virtual std::shared_ptr<Store> OpenSingleObject(const StoreOpenFn& open,
                                                  const std::string& scheme,
                                                  const std::string& location) const;
  /// The checks every writer of this layout makes before it writes anything: the compression
  /// options (format/zstd_transform.h), then CheckWriteOptions. InvalidArgumentError.
  void ValidateWriteOptions(const StorageOptions& options, const std::string& uri) const;
  /// True when a save with `options` ends each data file with an index and records the files in
  /// the metadata's file table (StorageWriter::WritesFileIndexes; dcp's version 2:
  /// format/dcp_index.h). Default: false.
  virtual bool WritesFileIndexes(const StorageOptions& options) const;
  /// After the last item of data file `name` (open in `out`; `results` describe its items in
  /// file order), written by rank `rank`: with WritesFileIndexes, append the file's index and
  /// return the file's entry for the file table; otherwise append nothing and return nullopt
  /// (the default). Errors as AppendFileIndex's (format/dcp_index.h).
  virtual std::optional<DataFile> FinishDataFile(WritableObject& out, const std::string& name,
                                                 const std::vector<WriteResult>& results,
                                                 const StorageOptions& options, int32_t rank) const;
};

/// The layout a writer of `format` writes (static lifetime).
const CheckpointLayout& LayoutFor(CheckpointFormat format);
/// Every layout a reader recognises, in detection order (dcp, PyTorch DCP, safetensors).
const std::vector<const CheckpointLayout*>& AllLayouts();
/// The layout of the checkpoint committed in `store`, or nullptr when there is none.
const CheckpointLayout* DetectLayout(Store& store);
/// True when some layout's writer would create `name` for data.
bool IsAnyDataFile(const std::string& name);

/// Finds where a load's stored items lie when the metadata does not list them (dcp's version-2
/// per-file indexes), reading what it needs the first time it is needed. Not thread-safe.
class ItemLocator {
 public:
  virtual ~ItemLocator() = default;
  /// Add to `out` where each of `wanted` lies, skipping those already there. CorruptionError
  /// naming the entry and chunk when no index holds one or an index is damaged; NotFoundError
  /// for a missing data file.
  virtual void Resolve(const std::vector<MetadataIndex>& wanted,
                       std::map<MetadataIndex, StorageInfo>& out) = 0;
};
/// The locator of `md`'s stored items in `store` (both must outlive it), or nullptr when `md`
/// lists them itself.
std::unique_ptr<ItemLocator> NewItemLocator(Store& store, const Metadata& md);
/// Every stored item of `md` into md.storage, with every data file's index read and checked (a
/// copy in the metadata that differs from its file's is a CorruptionError): what verify,
/// inspect, diff and convert read. Nothing to do when `md` lists its items.
void ReadAllStoredItems(Store& store, Metadata& md);

/// The plain Python value held in `bytes`, a torch.save archive or a bare pickle (PyTorch DCP's
/// non-tensor entries), read by the restricted unpickler (dcp::PythonValue's contract; `what`
/// names the entry in errors).
PyValuePtr ReadPythonValue(std::string_view bytes, const std::string& what);

/// A tensor must still have the dtype and shape it was planned with (InvalidArgumentError).
void CheckUnchanged(const WriteItem& item, const ResolvedData& data);

}  // namespace dcp
