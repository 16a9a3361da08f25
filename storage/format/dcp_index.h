// Version-2 checkpoints of the dcp layout (docs/FORMAT.md) keep where each stored item lies in an
// index at the end of each data file, written by the rank that wrote the file; the metadata holds
// the file table and, per chunk, the rank that wrote it. A reader resolves the items it needs
// from the indexes of those ranks' files only. Internal (not installed).
//
// A resolver serves one load on one thread; it reads each index at most once. AppendFileIndex
// serves one data file on one thread.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "dcp/proto/plan.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"

namespace dcp {

class FileIndexResolver : public ItemLocator {
 public:
  /// `md` (a validated version-2 metadata) and `store` must outlive the resolver.
  FileIndexResolver(Store& store, const Metadata& md);

  /// Add to `out` where each of `wanted` (stored items: fqn + chunk offsets) lies, from the
  /// indexes of its writer's files, the first time they are needed: the metadata's copy of an
  /// index where it has one (DataFile::index_copy), else read from the file (in parallel);
  /// either is checked against the file table's CRC32C. Items already in `out` are skipped.
  /// CorruptionError naming the entry, the chunk and the files searched when no index holds
  /// an item, or when an index is damaged or records the wrong size for it; NotFoundError for
  /// a missing file; UnsupportedError... never (the flags are checked when decoding).
  void Resolve(const std::vector<MetadataIndex>& wanted,
               std::map<MetadataIndex, StorageInfo>& out) override;
  /// ItemLocator::ResolveBlocks: each block table is read at most once (in parallel), checked
  /// against the file table's CRC32C, its count against the items its file's index lists, and
  /// an item's blocks against its crc32c (the CRCs combine to it) before they are attached.
  /// Version 3: an item that lies in a sibling's file (a reference recording where that file's
  /// index and block table lie) takes its blocks from that file's table, after that file's
  /// index (checked against the reference's CRC32C) is found to hold the item exactly where,
  /// and with the crc32c, this checkpoint's index records; CorruptionError naming the sibling's
  /// file otherwise.
  void ResolveBlocks(const std::vector<MetadataIndex>& partial,
                     std::map<MetadataIndex, StorageInfo>& out) override;

  /// Every item of `md`, into md.storage (dcp verify, inspect, diff, convert): every index (and
  /// block table, ResolveBlocks's checks applied to every item) is read from its file, even
  /// where the metadata has a copy, so that a damaged one is found, and
  /// a copy that differs from its file's index is a CorruptionError (loads resolve through the
  /// copy: what this accepts, a load reads alike). Also
  /// reports items an index lists that the metadata has no chunk for (CorruptionError).
  static void ResolveAll(Store& store, Metadata& md);

  /// ResolveAll for tools that report damage item by item (dcp verify): a data file that is
  /// missing or shorter than the file table records loses its index, so each item its writer
  /// wrote that no other index of that writer lists is placed in it past its recorded end
  /// (offset = the recorded size, no checksum): every read of it then fails as missing or
  /// truncated, naming the item. Any other damage (a bad index checksum, a malformed index, an
  /// item no index holds) throws as ResolveAll does.
  static void ResolveAvailable(Store& store, Metadata& md);

 private:
  static void Resolve(Store& store, Metadata& md, bool tolerate_lost_files);
  FileIndexResolver(Store& store, const Metadata& md, bool use_copies);
  struct Located {
    const DataFile* file;
    FileIndexItem item;
  };
  void LoadWriters(const std::vector<int32_t>& writers, bool tolerate_lost_files = false);
  StorageInfo InfoFor(const MetadataIndex& index, const std::string& fqn,
                      const EntryMetadata& entry);

  Store& store_;
  const Metadata& md_;
  const bool use_copies_;  // take the metadata's index copies (loads) or read every file
  std::unordered_map<int32_t, std::vector<const DataFile*>> files_by_writer_;
  std::unordered_map<int32_t, bool> loaded_;
  std::unordered_map<int32_t, const DataFile*> lost_;  // a missing or truncated file per writer
  const Located* Find(uint64_t hash, uint32_t chunk) const;
  // Every entry of every index read so far, sorted by (fqn hash, chunk).
  std::vector<Located> items_;
  // The block tables read so far (dcp_blocks.cc), by file; StorageInfo::blocks point into them.
  void LoadBlockTables(const std::vector<const DataFile*>& files);
  // Every block table of the files not lost, each item's blocks against its crc32c (ResolveAll).
  void CheckBlockTables();
  std::unordered_map<const DataFile*, BlockTable> tables_;
  std::unordered_map<std::string, const DataFile*> by_name_;
  // Version 3: the sibling files that references point at, read for their block tables
  // (dcp_blocks.cc): each one's index (first_block set) and table, by reference name.
  struct ReferencedFile {
    std::vector<FileIndexItem> items;
    BlockTable table;
  };
  void LoadReferencedFiles(const std::vector<const DataFileReference*>& references);
  std::unordered_map<std::string, const DataFileReference*> references_by_name_;
  std::unordered_map<std::string, ReferencedFile> referenced_;
};

/// Version 2: where the items of data file `f` end: its block table's start (or its index's,
/// without a table). Its index lists no item past it (DecodeFileIndex checks this).
uint64_t DataEnd(const DataFile& f);

/// Version 2: read and decode the index of data file `f` of a checkpoint of `format_version`
/// in `store`, checking its CRC32C.
std::vector<FileIndexItem> ReadFileIndex(Store& store, const DataFile& f, uint32_t format_version);
/// Version 3: a sibling's data file as reference `r` records it (its name, size, and where its
/// index and block table lie; no writer, no references).
DataFile ReferencedDataFile(const DataFileReference& r);
/// Version 3: a reference named `name` ("../<checkpoint>/<file>") to data file `f` of a sibling,
/// recording where its index and block table lie when it has a table.
DataFileReference ReferenceTo(const std::string& name, const DataFile& f);
/// Version 3: read and decode the index of a sibling's data file `f` (ReferencedDataFile),
/// checking its CRC32C; its own references are unknown here (DecodeFileIndex's
/// references_unknown).
std::vector<FileIndexItem> ReadReferencedIndex(Store& store, const DataFile& f);
/// Version 3: the sizes of `f`'s references, in order (DecodeFileIndex's bounds).
std::vector<uint64_t> ReferenceSizes(const DataFile& f);

/// Version 2: append the index of data file `name` to `out`, after the file's last item, so that
/// it is in the file when the file appears; `results` describe the file's items (each needs its
/// chunk ordinal, MetadataIndex::index, which the coordinator's plan gives). With `block_bytes`
/// (a power of two, StorageOptions::checksum_block_bytes) the file's block table goes first,
/// from the items' StorageInfo::block_crc32c. Returns the file's entry for the metadata's file
/// table: written by `rank`, its size, where its block table and index lie, and the index bytes
/// as index_copy. `format_version` 3 writes the version-3 index: every item with its
/// StorageInfo::content_hash, and an item whose relative_path is not `name` (a sibling
/// reference, "../<checkpoint>/<file>", recorded as WriteResult::reference) pointing at the
/// file's reference to it. InvalidArgumentError for an item without a chunk ordinal;
/// InternalError for a transform an index cannot record (anything but one zstd), an item whose
/// block CRCs do not fit its length, or a reference version 2 (or the name) cannot hold.
DataFile AppendFileIndex(WritableObject& out, const std::string& name,
                         const std::vector<WriteResult>& results, int32_t rank,
                         uint64_t block_bytes, uint32_t format_version = 2);

}  // namespace dcp
