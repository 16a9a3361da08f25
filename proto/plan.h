// Plans, items and checkpoint metadata: what planners produce, what storage consumes, and what a
// checkpoint records. Plain value types; thread-compatible (no internal synchronisation).
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <variant>
#include <vector>

#include "dcp/proto/tensor.h"

namespace dcp {

/// Names one stored item: a tensor chunk (fqn + the chunk's offsets in the global shape) or a
/// byte entry (fqn, no offsets). `index` is a lookup hint (position in TensorMetadata::chunks)
/// and takes no part in comparisons.
/// A 128-bit content hash of an item's raw bytes (XXH3-128; version 3).
struct ContentHash {
  uint64_t low = 0;
  uint64_t high = 0;
  bool operator==(const ContentHash&) const = default;
};

struct MetadataIndex {
  std::string fqn;
  Shape offset;
  std::optional<int32_t> index;

  bool operator==(const MetadataIndex& o) const { return fqn == o.fqn && offset == o.offset; }
  bool operator<(const MetadataIndex& o) const {
    return fqn != o.fqn ? fqn < o.fqn : offset < o.offset;
  }
  std::string ToString() const;
};

enum class WriteItemType : uint8_t { kTensor = 1, kShard = 2, kBytes = 3 };

/// One unit of data a rank will write: a whole tensor, one shard (chunk) of a sharded tensor, or
/// a byte blob. For tensors, `chunk` places the data inside `global_shape`.
struct WriteItem {
  MetadataIndex index;
  WriteItemType type = WriteItemType::kTensor;
  DType dtype = DType::kFloat32;
  Shape global_shape;
  ChunkMeta chunk;
  uint64_t size_bytes = 0;  // bytes of the chunk or blob before any transform
  bool is_tensor() const { return type != WriteItemType::kBytes; }
};

/// Key path from the root of a nested state dict to an entry; lets a reader rebuild nesting.
using KeyPath = std::vector<std::string>;

struct SavePlan {
  std::vector<WriteItem> items;
  std::string storage_data;                  // opaque to everyone but the StorageWriter
  std::string planner_data;                  // opaque to everyone but the SavePlanner
  std::map<std::string, KeyPath> key_paths;  // fqn -> nesting, for entries this plan created
};

enum class ReadItemType : uint8_t { kTensor = 1, kBytes = 2 };

/// Copy the box [storage_offsets, +lengths) of the stored chunk `storage_index` into the box
/// [dest_offsets, +lengths) of the local chunk `dest_index`. Offsets are relative to each chunk.
///
/// A *span* (chunk_span > 1) reads from the chunks storage_index.index, ..., + chunk_span - 1 of
/// a tensor stored by a rule (TensorMetadata::regular) at once: storage_offsets are relative to
/// the first of them and the box may reach into the following ones along the rule's dimension.
/// Planners emit spans so that a load across many stored shards (an all-to-all reshard) plans
/// in O(tensors), not O(tensors x ranks); the load expands them into one plain item per chunk
/// (ExpandChunkSpans) just before StorageReader::ReadData, so readers and the planner's
/// ResolveTensor / CommitTensor only ever see plain items.
struct ReadItem {
  ReadItemType type = ReadItemType::kTensor;
  MetadataIndex dest_index;
  Shape dest_offsets;
  MetadataIndex storage_index;
  Shape storage_offsets;
  Shape lengths;
  uint32_t chunk_span = 1;
};

struct LoadPlan {
  std::vector<ReadItem> items;
  std::string storage_data;
  std::string planner_data;
};

/// Read-once on load: one broadcast, from `root`, of the stored bytes of read items that several
/// ranks ask for in identical form (same stored item, same box). The root reads them once and
/// every rank that asked receives them over the communicator instead of reading them again.
/// Every rank of a load holds the same sequence of batches (same roots, same order), each with
/// its own part: the root lists what it sends, a receiver what it takes.
struct SharedReadBatch {
  int32_t root = 0;
  /// Root only: indices into its load plan's items, in the order their bytes are packed.
  std::vector<int32_t> send_items;
  /// Receivers: segment k of the root's message fills item recv_items[k'] of this rank's plan
  /// where recv_segments[k'] == k (parallel vectors).
  std::vector<int32_t> recv_segments;
  std::vector<int32_t> recv_items;
  /// Bytes the root's message carries (all segments).
  uint64_t bytes = 0;
};

/// Where the bytes of one stored item live.
struct StorageInfo {
  std::string relative_path;            // relative to the checkpoint root
  uint64_t offset = 0;                  // of the stored (transformed) bytes in the file
  uint64_t length = 0;                  // stored length
  std::optional<uint32_t> crc32c;       // of the stored bytes
  std::vector<std::string> transforms;  // applied in order on save; empty = raw bytes
  uint64_t raw_length = 0;              // length before transforms
  /// Instead of crc32c, for a torch.save record's storage read as a plain item: the CRC-32 its
  /// zip entry stores (set by the reader, never encoded).
  std::optional<uint32_t> zip_crc32;
  /// Version 2, read side: the CRC32C of each block of 2^log2 bytes of a raw item (the last
  /// one may be shorter), from its data file's block table (set by the reader, never encoded).
  /// `crcs` points into the reader's storage, valid while its load lasts. log2 == 0: the item
  /// has no block CRCs; count == 0 with log2 set: the item is at most one block long and its
  /// crc32c is that block's.
  struct Blocks {
    const uint32_t* crcs = nullptr;
    uint32_t count = 0;
    uint8_t log2 = 0;
  } blocks;
  /// Write side: the CRC32C of each block of a raw item longer than one block, as the encoder
  /// computed them (never encoded; the data file's block table records them).
  std::vector<uint32_t> block_crc32c;
  /// Version 3: the XXH3-128 of the raw bytes, as the index records it (write side: computed by
  /// the encoder; read side: from the index).
  std::optional<ContentHash> content_hash = std::nullopt;
};

/// The checksum `info` stores for its bytes: the zip CRC-32 of a torch.save record's storage, else
/// its crc32c (nullopt: none).
std::optional<uint32_t> StoredCrc(const StorageInfo& info);
/// Extend the running checksum `crc` (0 to start) of `info`'s bytes by [data, data + n): CRC-32
/// when `info` carries a zip CRC-32, else CRC32C.
uint32_t ItemCrc(const StorageInfo& info, uint32_t crc, const void* data, size_t n);

/// Version 3: a data file of a sibling checkpoint (same parent location) that items of a file's
/// index point at. `name` is "../<checkpoint>/<file>", both plain names; `size` its length.
/// The other fields are where that file's index and block table lie (copied from the sibling's
/// own file table by the save that made the reference), so that a partial read of an item there
/// verifies only the blocks it touches; all 0 (references written before them, or a file
/// without a block table): such items are verified whole.
struct DataFileReference {
  std::string name;
  uint64_t size = 0;
  uint64_t index_offset = 0;
  uint64_t index_length = 0;
  uint32_t index_crc32c = 0;
  uint64_t block_table_offset = 0;
  uint64_t block_table_length = 0;
  uint32_t block_table_crc32c = 0;
  bool operator==(const DataFileReference&) const = default;
};

struct WriteResult {
  MetadataIndex index;
  uint64_t size_in_bytes = 0;
  StorageInfo storage;
  /// Version 3, write side: when the item was kept in a sibling checkpoint's file
  /// (storage.relative_path "../<checkpoint>/<file>"), that file (reference.name is the same
  /// name; never encoded here: the file table records it).
  DataFileReference reference = {};
};

/// Which splitting rule cuts a regularly sharded tensor (along dimension d of extent n, world w,
/// rank r); also a bit set where several may match.
///   kRuleBalanced: the first n % w ranks get n / w + 1, the others n / w (numpy.array_split);
///   kRuleCeil:     every rank gets c = ceil(n / w), the last what remains (torch.chunk).
enum RegularRule : uint8_t { kRuleBalanced = 1, kRuleCeil = 2 };

/// The part [begin, end) of `extent` that rank `rank` of `world` holds under `rule`.
std::pair<int64_t, int64_t> RegularSlice(int64_t extent, int64_t rank, int64_t world,
                                         RegularRule rule);

/// A tensor cut along one dimension by a rule (docs/FORMAT.md, version 2): chunk k is rank k's
/// slice along `dim` and the whole extent elsewhere, for every k whose slice is non-empty
/// (k < min(extent, world)); chunk k was written by rank k.
struct RegularLayout {
  int32_t dim = 0;
  RegularRule rule = kRuleBalanced;
  int32_t world = 1;
  bool operator==(const RegularLayout&) const = default;
};

/// A saved tensor: its chunks are either listed (`chunks`) or given by a rule (`regular`, and
/// then `chunks` is empty). Code that walks chunks uses ChunkCount / ChunkAt / ForEachChunk,
/// which serve both in O(1) per chunk.
struct TensorMetadata {
  TensorMetadata() = default;
  TensorMetadata(DType d, Shape s, std::vector<ChunkMeta> c = {})
      : dtype(d), shape(std::move(s)), chunks(std::move(c)) {}
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<ChunkMeta> chunks;
  std::optional<RegularLayout> regular;
  /// Version 2, listed chunks: the rank that wrote chunks[k] (whose data files hold it).
  /// Empty in version 1 and for a rule.
  std::vector<int32_t> chunk_writers;
};
struct BytesMetadata {
  /// Version 2: the rank that wrote the entry (-1: unknown, version 1).
  int32_t writer = -1;
  /// Version 2: the blob's size in bytes (its index records the same raw length).
  uint64_t size = 0;
};

/// Chunks of `t`: listed, or min(extent, world) for a rule.
size_t ChunkCount(const TensorMetadata& t);
/// Chunk k (< ChunkCount(t)).
ChunkMeta ChunkAt(const TensorMetadata& t, size_t k);
/// fn(k, chunk) for every chunk in order.
template <typename Fn>
void ForEachChunk(const TensorMetadata& t, Fn&& fn) {
  if (!t.regular) {
    for (size_t k = 0; k < t.chunks.size(); ++k) fn(k, t.chunks[k]);
    return;
  }
  const size_t n = ChunkCount(t);
  for (size_t k = 0; k < n; ++k) fn(k, ChunkAt(t, k));
}
/// The ordinal of the chunk of `t` that starts at `offsets`, if any. `hint`: a likely ordinal
/// (checked first). O(1) for a rule, O(chunks) for a list without a good hint.
std::optional<size_t> ChunkOrdinal(const TensorMetadata& t, const Shape& offsets,
                                   std::optional<int32_t> hint = std::nullopt);
/// The rank that wrote chunk k, or -1 when the metadata does not say (version 1).
int32_t ChunkWriter(const TensorMetadata& t, size_t k);
/// For a rule: the range [first, last) of chunk ordinals whose slice along the rule's dimension
/// overlaps [begin, end) (empty when begin >= end).
std::pair<size_t, size_t> RegularChunkRange(const TensorMetadata& t, int64_t begin, int64_t end);
/// `t` with its rule written out as listed chunks (unchanged when it has none).
TensorMetadata WithListedChunks(const TensorMetadata& t);
using EntryMetadata = std::variant<TensorMetadata, BytesMetadata>;

/// The deepest nesting a checkpoint's entries may have (key path length, or dots + 1 of an fqn
/// without one): a load rebuilds one nested state dict per level.
inline constexpr size_t kMaxKeyPathDepth = 256;

/// `name` quoted for an error message, its middle elided past 200 bytes (names come from files).
std::string ClippedName(const std::string& name);

/// The newest on-disk format version this library reads and writes (see docs/FORMAT.md):
/// 1 records every stored item in the metadata; 2 records rules, a file table and writer ranks,
/// and keeps where each item lies in an index at the end of each data file; 3 is version 2 whose
/// indexes record each item's content hash and may point items at data files of sibling
/// checkpoints (incremental saves, docs/FORMAT.md section 5b).
inline constexpr uint32_t kFormatVersion = 3;

/// Version 2: one data file of a checkpoint (Metadata::files). The items it holds are listed by
/// its index, written by the rank that wrote the file: bytes [index_offset, +index_length).
struct DataFile {
  std::string name;  // relative to the checkpoint root
  int32_t writer = 0;
  uint64_t size = 0;
  uint64_t index_offset = 0;
  uint64_t index_length = 0;
  uint32_t index_crc32c = 0;  // CRC32C of the index bytes
  /// The index's bytes when the metadata carries a copy (small checkpoints: a load then reads no
  /// index); empty: the index is read from the file. Validated against the two fields above.
  std::string index_copy;
  /// The block table (docs/FORMAT.md): [block_table_offset, +block_table_length), just before
  /// the index, with its CRC32C; length 0: the file has none (its items verify whole only).
  uint64_t block_table_offset = 0;
  uint64_t block_table_length = 0;
  uint32_t block_table_crc32c = 0;
  /// Version 3: the files of sibling checkpoints that items of this file's index lie in (an
  /// index item's reference k >= 1 is references[k - 1]).
  std::vector<DataFileReference> references = {};
  bool operator==(const DataFile&) const = default;
};

/// Everything a checkpoint records about itself. The checkpoint exists exactly when its
/// metadata does.
struct Metadata {
  uint32_t format_version = 1;  // 1: `storage` lists every item; 2: `files` + indexes
  std::string checkpoint_id;
  std::string save_id;
  int32_t world_size = 0;
  int64_t created_unix_ns = 0;
  std::string library_version;
  std::map<std::string, EntryMetadata> entries;  // by fqn
  /// By stored item. Version 1: every item, as decoded. Version 2: empty as decoded; readers
  /// fill what they need from the data files' indexes (storage/format/dcp_index.h).
  std::map<MetadataIndex, StorageInfo> storage;
  /// Version 2: every data file, by name (empty in version 1).
  std::vector<DataFile> files;
  std::map<std::string, KeyPath> key_paths;  // fqn -> nesting
  std::map<std::string, std::string> planner_data;

  /// Total stored bytes over all items (version 2: the data files' bytes before their block
  /// tables and indexes).
  uint64_t TotalStoredBytes() const;
  /// The names of the data files the checkpoint references.
  std::set<std::string> DataFileNames() const;
};

/// Append the plain items `item` stands for to `out`: the item itself when it is plain
/// (chunk_span 1), else one item per chunk of the span whose slice the box reaches, in chunk
/// order, each as a planner would have listed it. `saved` is the stored tensor the item reads.
/// InvalidArgumentError naming the tensor when a span does not fit `saved` (no rule, chunks past
/// the last, a box outside the span's chunks).
void AppendSpanPieces(const ReadItem& item, const TensorMetadata& saved,
                      std::vector<ReadItem>& out);
/// `plan` with every span replaced by its pieces (AppendSpanPieces), the other items kept in
/// order; returned as is when it has no span. InvalidArgumentError as AppendSpanPieces, and for
/// a span of an entry `md` does not hold as a tensor.
LoadPlan ExpandChunkSpans(LoadPlan plan, const Metadata& md);
/// ExpandChunkSpans a part at a time, as a load reads: `read` gets consecutive parts of `plan`
/// (its items in order, spans expanded; storage_data and planner_data copied), each ending at
/// the first item that brings it to `max_items` plain items or more (one span adds at most its
/// tensor's chunk count), and at least one part. What a load holds expanded at once is then
/// bounded by `max_items` and the document, whatever its spans reach. Errors as ExpandChunkSpans,
/// thrown before the part that holds the bad span is read.
void ForEachExpandedPart(const LoadPlan& plan, const Metadata& md, size_t max_items,
                         const std::function<void(const LoadPlan&)>& read);
/// The plain items a load expands at most at once (ForEachExpandedPart).
inline constexpr size_t kMaxExpandedItems = size_t{1} << 18;

/// Replace md.storage with the stored items of every rank's write results. The results are
/// sorted first and appended in order (a tree walk per item is the slow part at millions of
/// items). InternalError naming the item when one was written twice.
void FillStorage(Metadata& md, const std::vector<std::vector<WriteResult>>& results);

}  // namespace dcp
