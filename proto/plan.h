// Plans, items and checkpoint metadata: what planners produce, what storage consumes, and what a
// checkpoint records. Plain value types; thread-compatible (no internal synchronisation).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "dcp/proto/tensor.h"

namespace dcp {

/// Names one stored item: a tensor chunk (fqn + the chunk's offsets in the global shape) or a
/// byte entry (fqn, no offsets). `index` is a lookup hint (position in TensorMetadata::chunks)
/// and takes no part in comparisons.
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
struct ReadItem {
  ReadItemType type = ReadItemType::kTensor;
  MetadataIndex dest_index;
  Shape dest_offsets;
  MetadataIndex storage_index;
  Shape storage_offsets;
  Shape lengths;
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
};

/// The checksum `info` stores for its bytes: the zip CRC-32 of a torch.save record's storage, else
/// its crc32c (nullopt: none).
std::optional<uint32_t> StoredCrc(const StorageInfo& info);
/// Extend the running checksum `crc` (0 to start) of `info`'s bytes by [data, data + n): CRC-32
/// when `info` carries a zip CRC-32, else CRC32C.
uint32_t ItemCrc(const StorageInfo& info, uint32_t crc, const void* data, size_t n);

struct WriteResult {
  MetadataIndex index;
  uint64_t size_in_bytes = 0;
  StorageInfo storage;
};

struct TensorMetadata {
  DType dtype = DType::kFloat32;
  Shape shape;
  std::vector<ChunkMeta> chunks;
};
struct BytesMetadata {};
using EntryMetadata = std::variant<TensorMetadata, BytesMetadata>;

/// The deepest nesting a checkpoint's entries may have (key path length, or dots + 1 of an fqn
/// without one): a load rebuilds one nested state dict per level.
inline constexpr size_t kMaxKeyPathDepth = 256;

/// `name` quoted for an error message, its middle elided past 200 bytes (names come from files).
std::string ClippedName(const std::string& name);

/// Current on-disk format version written by this library (see docs/FORMAT.md).
inline constexpr uint32_t kFormatVersion = 1;

/// Everything a checkpoint records about itself. The checkpoint exists exactly when its
/// metadata does.
struct Metadata {
  uint32_t format_version = kFormatVersion;
  std::string checkpoint_id;
  std::string save_id;
  int32_t world_size = 0;
  int64_t created_unix_ns = 0;
  std::string library_version;
  std::map<std::string, EntryMetadata> entries;  // by fqn
  std::map<MetadataIndex, StorageInfo> storage;  // by stored item
  std::map<std::string, KeyPath> key_paths;      // fqn -> nesting
  std::map<std::string, std::string> planner_data;

  /// Total stored bytes over all items.
  uint64_t TotalStoredBytes() const;
};

/// Replace md.storage with the stored items of every rank's write results. The results are
/// sorted first and appended in order (a tree walk per item is the slow part at millions of
/// items). InternalError naming the item when one was written twice.
void FillStorage(Metadata& md, const std::vector<std::vector<WriteResult>>& results);

}  // namespace dcp
