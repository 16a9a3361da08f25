// How a checkpoint is laid out in a store: its metadata file, its data file names, and how one
// item becomes bytes in a data file. The checkpoint protocol
// (storage/checkpoint/store_writer.cc: lock, overwrite, commit, clean-up) is the same for every
// layout and runs over any Store, so every format can be written to every store. (safetensors,
// whose files hold whole tensors assembled across ranks, keeps the protocol and replaces only its
// per-rank data path: WrapWriter, format/safetensors_writer.cc.) Internal: not installed.
//
// The read side: most items are raw bytes, which the reader (storage/checkpoint/store_reader.cc)
// reads itself; an item a layout stores transformed (StorageInfo::transforms: zstd, torch.save)
// is read by that layout's ItemDecoder.
//
// Layouts are stateless and shared; they are thread-safe. An ItemEncoder serves one data file
// on one thread. An ItemDecoder serves one load: Prepare on one thread, then Read on any.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/planner/planner.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/staging.h"
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

/// What a load reads with, fixed from SetUp to the end of its reads.
struct LoadContext {
  Store& store;
  const Metadata& metadata;
  const StorageOptions& options;
};

/// One transformed item to read, and what a read thread reads it with.
struct ItemRead {
  LoadPlanner& planner;
  const ReadItem& item;
  const StorageInfo& info;  // as the metadata states it
  ReadableObject& in;       // its data file, open
  const std::string& file;  // that file's name
  HostBuffer& scratch;      // the thread's; at most ScratchLimit(options) bytes
  /// Stored items whose checksum a partial read on this thread has checked (checked once).
  std::set<MetadataIndex>& verified;
};

/// Reads the items a layout stores transformed, each into its destination
/// (planner.CommitTensor, planner.LoadBytes), every checksum they carry checked when
/// options.verify_checksums. Errors: CorruptionError naming the item and its file.
class ItemDecoder {
 public:
  virtual ~ItemDecoder() = default;
  /// True when this decoder reads items stored as `info` says (by its transforms).
  virtual bool Decodes(const StorageInfo& info) const = 0;
  /// True when a read of the item streams [offset, offset + length) front to back, so that a
  /// store may fetch it with its neighbours (ReadableObject::PrefetchRanges).
  virtual bool ReadsStoredRange() const { return true; }
  /// Before a load's reads: what the items of `plan` that this decoder reads need first. An
  /// item whose values turn out to be one plain byte range goes into `plain` (its index -> that
  /// range, with the checksum it carries, StoredCrcKind): the reader reads it as a raw item and
  /// never hands it to Read. Items already in `plain` are skipped.
  virtual void Prepare(const LoadPlan& plan, std::map<MetadataIndex, StorageInfo>& plain);
  /// Read one item (Decodes(r.info)) into its destination.
  virtual void Read(const ItemRead& r) = 0;
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
  /// The decoder of the transformed items this layout stores, for one load of `ctx` (which
  /// outlives it); nullptr when it stores none (default).
  virtual std::unique_ptr<ItemDecoder> NewItemDecoder(const LoadContext& ctx) const;
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
  /// Attach to each of `partial` (stored items already in `out`, to be read in part) the CRCs of
  /// its blocks (StorageInfo::blocks) where its data file has a block table, so that the partial
  /// read verifies only the blocks it touches. CorruptionError naming the file for a damaged
  /// table or one whose blocks disagree with an item's crc32c. The default attaches none.
  virtual void ResolveBlocks(const std::vector<MetadataIndex>& /*partial*/,
                             std::map<MetadataIndex, StorageInfo>& /*out*/) {}
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
/// The decoders of every layout a reader recognises (AllLayouts), for one load of `ctx`. An
/// item is read by the first that Decodes it.
std::vector<std::unique_ptr<ItemDecoder>> NewItemDecoders(const LoadContext& ctx);

/// The kind of checksum `info` stores (StoredCrc): CRC-32 for the storage of a torch.save record
/// read as a plain item (a decoder's Prepare), else CRC32C.
ChecksumKind StoredCrcKind(const StorageInfo& info);
/// How messages name the checksum `info` stores: "zip CRC-32" or "crc32c".
std::string_view StoredCrcName(const StorageInfo& info);

/// The tensor entry a read item belongs to.
const TensorMetadata& StoredEntry(const Metadata& md, const ReadItem& item);
/// The stored chunk a read item reads from (CorruptionError naming `uri` when there is none).
ChunkMeta StoredChunk(const Metadata& md, const ReadItem& item, const std::string& uri);
/// The planner's destination for a tensor item, checked against its stored entry
/// (InternalError otherwise).
TensorView CheckedDestination(LoadPlanner& planner, const ReadItem& item,
                              const TensorMetadata& entry);
/// The most scratch memory one read thread uses (StorageOptions::max_scratch_bytes, at least 64).
size_t ScratchLimit(const StorageOptions& options);

/// A tensor must still have the dtype and shape it was planned with (InvalidArgumentError).
void CheckUnchanged(const WriteItem& item, const ResolvedData& data);

// ---- Incremental saves (StorageOptions::incremental_base, docs/FORMAT.md section 5b): which
// items of a rank's save plan its base checkpoint holds, and where, so that the writer keeps them
// there instead of writing them again (format/incremental.cc). One per rank's save; read-only
// once built (Find and Frozen may be called from the writer threads).

/// True when a dcp-format save with `options` records content hashes (format version 3):
/// metadata version 2 with content_hashes or an incremental_base.
bool WritesContentHashes(const StorageOptions& options);

/// An item of the base: where it lies, named from the new checkpoint ("../<checkpoint>/<file>",
/// StorageInfo::relative_path), with its content hash, and that file as the new checkpoint's
/// file table will reference it (its size, and where its index and block table lie).
struct BaseItem {
  StorageInfo info;
  DataFileReference reference;
  /// The CRC32C of the item's first `head_bytes` bytes (its first block, from the base's block
  /// table), when the base has one: an item whose head differs changed, known after reading
  /// one block instead of hashing the whole item. head_bytes 0: none.
  uint32_t head_crc32c = 0;
  uint64_t head_bytes = 0;
};

class IncrementalBase {
 public:
  /// The base of a save into `store` (a SiblingStore, registry.h) with `options`, for the items
  /// of `plan`. Never throws for the base's state: a base that is absent, unreadable, damaged,
  /// or saved without content hashes keeps nothing, and `why_not` says why (the save then
  /// writes every item).
  IncrementalBase(Store& store, const StorageOptions& options, const SavePlan& plan);

  /// The base's copy of plan item `i` when it may be kept (same entry, chunk, dtype and raw
  /// size; raw unless compression is on; with a content hash), else nullptr.
  const BaseItem* Find(size_t i) const {
    return i < items_.size() && items_[i] ? &*items_[i] : nullptr;
  }
  /// True when `fqn` is under one of StorageOptions::frozen_prefixes: kept without hashing.
  bool Frozen(const std::string& fqn) const;
  /// Whether plan item `i` (Find(i) not null; `data` its bytes) is unchanged: frozen, or its
  /// bytes hash as the base's. When it changed, `hash` receives its content hash if it was
  /// computed on the way (the encoder then does not compute it again). A head that differs
  /// (BaseItem::head_crc32c) answers without hashing.
  bool Unchanged(size_t i, const WriteItem& item, const ResolvedData& data,
                 std::optional<ContentHash>& hash) const;
  /// Why nothing is kept ("" when the base was read).
  const std::string& why_not() const { return why_not_; }

 private:
  void Read(Store& store, const StorageOptions& options, const SavePlan& plan);
  std::vector<std::optional<BaseItem>> items_;  // by plan item
  std::vector<std::string> frozen_;
  std::string why_not_;
};

/// XXH3-128 of an item's raw bytes (a tensor's elements in row-major order, any device or
/// strides; a blob's bytes), as the encoder records it.
ContentHash HashItemBytes(const WriteItem& item, const ResolvedData& data);

}  // namespace dcp
