// Serialisation of dcp's vocabulary: plans and results as protobuf bytes for the wire, and the
// metadata file format (a checksummed envelope around a protobuf Metadata).
//
// Metadata read from storage is untrusted: DecodeMetadataFile checks the envelope and then
// ValidateMetadata checks every field before anything uses it. Both throw CorruptionError (or
// UnsupportedError for a newer format version) with a message that names `source`.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/proto/plan.h"

namespace dcp {

std::string EncodeSavePlan(const SavePlan& plan);
SavePlan DecodeSavePlan(std::string_view bytes);
std::string EncodeLoadPlan(const LoadPlan& plan);
LoadPlan DecodeLoadPlan(std::string_view bytes);
/// The "load/plan" messages of read-once loads (dcp::Load): a rank's local plan with whether it
/// takes part in sharing reads, and the coordinator's answer (the plan and its batches).
std::string EncodeLocalLoadPlan(const LoadPlan& plan, bool can_share);
std::pair<LoadPlan, bool> DecodeLocalLoadPlan(std::string_view bytes);
std::string EncodeLoadAssignment(const LoadPlan& plan, const std::vector<SharedReadBatch>& batches);
std::pair<LoadPlan, std::vector<SharedReadBatch>> DecodeLoadAssignment(std::string_view bytes);
std::string EncodeWriteResults(const std::vector<WriteResult>& results);
std::vector<WriteResult> DecodeWriteResults(std::string_view bytes);
/// Replace md.storage with the stored items of every rank's encoded write results
/// (encoded_results[r]: rank r's EncodeWriteResults), consuming them: each payload is parsed one
/// result at a time and freed once read, so the results are never held decoded beside the map
/// they fill (at thousands of ranks, decoded results would be most of the coordinator's
/// write-phase memory).
/// Results listed in stored-item order on each rank (as StoreWriter writes them) merge in
/// O(n log ranks); any order is accepted. CorruptionError naming the rank whose payload does not
/// parse; InternalError naming the item when one was written twice. On a throw, md.storage and
/// encoded_results are left partly consumed.
void FillStorageFromEncoded(Metadata& md, std::vector<std::string>& encoded_results);

/// Version 2's write-phase message: the data files one rank wrote. DecodeDataFiles throws
/// CorruptionError naming `rank` for a malformed message or a file of another writer.
std::string EncodeDataFiles(const std::vector<DataFile>& files);
std::vector<DataFile> DecodeDataFiles(std::string_view bytes, int rank);

/// Plain protobuf encoding of Metadata (no envelope); used on the wire.
std::string EncodeMetadata(const Metadata& md);
Metadata DecodeMetadata(std::string_view bytes, std::string_view source);

/// Refuse (InvalidArgumentError naming the size and `where`) a metadata payload of `bytes`
/// bytes that readers could not decode: protobuf, and so DecodeMetadata, stops at 2 GiB. A save
/// checks it before committing, so such a checkpoint fails instead of being committed unreadable.
void CheckMetadataPayloadSize(uint64_t bytes, std::string_view where);
/// The limit CheckMetadataPayloadSize enforces (INT_MAX bytes). Tests may lower it (0 restores
/// the default); not for production use.
uint64_t MetadataPayloadLimit();
void SetMetadataPayloadLimitForTesting(uint64_t bytes);

/// The metadata file: magic "DCPMETA1", u32 format version, u32 CRC32C of the payload, u64
/// payload length (all little-endian), then the protobuf payload. See docs/FORMAT.md.
std::string EncodeMetadataFile(const Metadata& md);
/// Decode and validate a metadata file. `source` names it in errors (a path or URI).
Metadata DecodeMetadataFile(std::string_view bytes, std::string_view source);
/// Bytes of the envelope header (what a reader needs before the payload length is known).
inline constexpr size_t kMetadataHeaderSize = 24;
/// Check a metadata file's envelope header (its first kMetadataHeaderSize bytes, fewer when the
/// file is shorter) against the file's size, before the payload is read: CorruptionError for a
/// bad magic or a payload length that does not match `file_size`, UnsupportedError for a newer
/// format version. A reader calls it first, so a huge or sparse file that is no metadata costs
/// one small read.
void CheckMetadataFileHeader(std::string_view head, uint64_t file_size, std::string_view source);

/// The most raw bytes one stored byte of a zstd frame can decompress to (a 4-byte RLE block
/// per 128 KiB of output); a zstd item claiming more raw bytes is refused by validation.
inline constexpr uint64_t kMaxZstdExpansion = 32768;

/// Version 2: the index at the end of each data file (docs/FORMAT.md). 16 header bytes (magic
/// "DCPIDX01", u32 item count, 4 zero bytes), then kFileIndexItemBytes per item, little-endian:
/// u64 FqnHash(fqn), u32 chunk ordinal (0 for a byte entry), u64 offset, u64 length,
/// u64 raw_length, u32 crc32c, u8 flags (bit 0: crc32c present; bit 1: zstd), sorted by
/// (hash, chunk) without repeats. Version 3 (magic "DCPIDX02", kFileIndexItemBytesV3 per item):
/// the same 41 bytes, then u32 reference (0: this file; k >= 1: the file's references[k - 1]),
/// u64 + u64 XXH3-128 of the item's raw bytes (low, high half).
inline constexpr uint64_t kFileIndexHeaderBytes = 16;
inline constexpr uint64_t kFileIndexItemBytes = 41;
inline constexpr uint64_t kFileIndexItemBytesV3 = 61;
/// The bytes per index item of a checkpoint of `format_version` (2 or 3).
inline constexpr uint64_t FileIndexItemBytes(uint32_t format_version) {
  return format_version >= 3 ? kFileIndexItemBytesV3 : kFileIndexItemBytes;
}

/// Version 2: the most bytes of index copies a metadata carries (DataFile::index_copy). Each of
/// a save's W ranks copies its files' indexes into the metadata only when they take at most
/// 1/W of this, so the copies stay within the budget at any world size: a load of a small
/// checkpoint reads no index (one round trip less on an object store), a large one reads them.
inline constexpr uint64_t kMetadataIndexCopyBytes = 256 << 10;

/// The 64-bit key of an fqn in a file index: FNV-1a over its bytes, then the splitmix64
/// finalizer. Stable across versions (it is on disk).
uint64_t FqnHash(std::string_view fqn);

/// A name of an object in a checkpoint's root: not empty, ".", "..", nor holding '/', '\\' or
/// NUL (the layout is flat).
bool IsPlainObjectName(std::string_view name);
/// Version 3: "../<checkpoint>/<file>", both plain names: a data file of a sibling checkpoint.
bool IsSiblingReference(std::string_view name);
/// The "../<checkpoint>/<file>" reference of `file` in sibling checkpoint `checkpoint`.
std::string SiblingReference(std::string_view checkpoint, std::string_view file);

struct FileIndexItem {
  uint64_t fqn_hash = 0;
  uint32_t chunk = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
  uint64_t raw_length = 0;
  std::optional<uint32_t> crc32c;
  bool zstd = false;
  /// Version 3: 0 when the bytes are in this file, k >= 1 when in the file's references[k - 1].
  uint32_t ref = 0;
  /// Version 3: XXH3-128 of the raw bytes.
  std::optional<ContentHash> hash;
  /// Where the item's CRCs start in its file's block table (set from the table, not the index).
  uint32_t first_block = 0;
};

/// Encode `items` (sorted here) as a file index of `format_version` (2: DCPIDX01; 3: DCPIDX02,
/// every item with its hash). InternalError for a repeated (hash, chunk): two items of one file
/// with one key; or, in version 2, an item with a reference.
std::string EncodeFileIndex(std::vector<FileIndexItem> items, uint32_t format_version = 2);
/// Decode and check an index read from `file` (untrusted), of a checkpoint of `format_version`:
/// magic (of that version), length, sorted unique keys, every item of this file inside
/// [0, index_offset) and no two of them overlapping, every referenced item inside its
/// reference (`reference_sizes[k - 1]`), raw items raw_length == length and zstd ones at most
/// kMaxZstdExpansion x length, no unknown flag. CorruptionError naming `file`.
/// `references_unknown`: the file's own references are not known to the caller (a sibling's file
/// read for its block table): its referenced items are decoded without bounds, and must not be
/// read through this index.
std::vector<FileIndexItem> DecodeFileIndex(std::string_view bytes, uint64_t index_offset,
                                           const std::string& file, uint32_t format_version = 2,
                                           const std::vector<uint64_t>& reference_sizes = {},
                                           bool references_unknown = false);

/// Version 2: the block table of a data file (docs/FORMAT.md), just before its index. 16 header
/// bytes (magic "DCPBLK01", u32 log2 of the block size, u32 block count), then a u32 CRC32C per
/// block, little-endian: for each item in index order (FileIndexItem key order) that is raw, has
/// a crc32c and is longer than one block, the CRCs of its blocks [j B, min((j + 1) B, length))
/// relative to the item's start. Block sizes are 2^kMinBlockLog2 to 2^kMaxBlockLog2 bytes.
inline constexpr uint64_t kBlockTableHeaderBytes = 16;
inline constexpr uint32_t kMinBlockLog2 = 12;
inline constexpr uint32_t kMaxBlockLog2 = 30;

struct BlockTable {
  uint32_t log2 = 0;
  std::vector<uint32_t> crcs;
};

/// The blocks of 2^log2 bytes the block table lists for `item`: ceil(length / 2^log2) for a raw
/// item of this file (no reference) with a crc32c longer than one block, else 0 (its crc32c is
/// its one block, or it lies in another file).
uint64_t TableBlocksOf(const FileIndexItem& item, uint32_t log2);
/// Encode a block table (crcs in the order above).
std::string EncodeBlockTable(uint32_t log2, const std::vector<uint32_t>& crcs);
/// Decode a block table read from `file` (untrusted): magic, log2 in range, length matching the
/// count. Whether the count fits the file's index is the caller's to check (TableBlocksOf).
/// CorruptionError naming `file`.
BlockTable DecodeBlockTable(std::string_view bytes, const std::string& file);

/// Check a decoded Metadata for internal consistency: paths are plain names in the root (the
/// format is flat), offsets and lengths do not overflow, chunks lie inside their tensors and do
/// not overlap, every tensor chunk has exactly one stored item of the right length, raw items
/// have raw_length = length and zstd items at most kMaxZstdExpansion x length, dtypes are
/// known, element counts are sane, key paths join to their fqns and form a tree (no empty,
/// colliding or nested-under-a-leaf path). Unknown transforms are left to readers
/// (UnsupportedError when an item is read). O(n log n) in the chunks of a tensor for tensors
/// split along at most two dimensions (and for grids of at most 2^24 cells beyond).
/// Throws CorruptionError naming `source` and the entry; thread-safe (reads `md` only).
void ValidateMetadata(const Metadata& md, std::string_view source);

}  // namespace dcp
