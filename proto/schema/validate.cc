// ValidateMetadata: every check of decoded (untrusted) metadata before anything uses it.
#include <algorithm>
#include <limits>
#include <map>
#include <optional>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "dcp/proto/checksum.h"
#include "dcp/proto/chunks.h"
#include "dcp/proto/schema/codec.h"

namespace dcp {

namespace {

[[noreturn]] void FailValidation(const std::string& src, const std::string& what) {
  throw CorruptionError(src + ": " + what);
}

// The elements of a tensor's shape. A single entry may not describe more than 2^50 elements:
// far beyond any real model, and a guard against allocation attacks by tools that materialise
// tensors from metadata.
int64_t CheckedVolume(const std::string& fqn, const TensorMetadata& t, const std::string& src) {
  constexpr int64_t kMaxElements = int64_t{1} << 50;
  int64_t volume = 1;
  for (int64_t d : t.shape) {
    if (d < 0 || (d > 0 && volume > kMaxElements / d)) {
      FailValidation(
          src, "tensor '" + fqn + "' has an invalid or absurd shape " + ShapeToString(t.shape));
    }
    volume *= d;
  }
  return volume;
}

// A chunk lies inside its tensor; returns its elements (version 2: nothing stored to check).
int64_t CheckChunkBox(const std::string& fqn, const TensorMetadata& t, const ChunkMeta& c,
                      const std::string& src) {
  if (c.offsets.size() != t.shape.size() || c.sizes.size() != t.shape.size()) {
    FailValidation(src, "tensor '" + fqn + "' chunk " + c.ToString() +
                            " does not match rank of shape " + ShapeToString(t.shape));
  }
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (c.offsets[i] < 0 || c.sizes[i] < 0 || c.offsets[i] > t.shape[i] - c.sizes[i]) {
      FailValidation(src, "tensor '" + fqn + "' chunk " + c.ToString() +
                              " lies outside its shape " + ShapeToString(t.shape));
    }
  }
  return NumElements(c.sizes);
}

// A chunk lies inside its tensor and has a stored item of its size; returns its elements.
int64_t CheckChunk(const Metadata& md, const std::string& fqn, const TensorMetadata& t,
                   const ChunkMeta& c, const std::string& src) {
  const int64_t n = CheckChunkBox(fqn, t, c, src);
  auto it = md.storage.find(MetadataIndex{fqn, c.offsets, {}});
  if (it == md.storage.end()) {
    FailValidation(src, "tensor '" + fqn + "' chunk " + c.ToString() + " has no stored item");
  }
  const uint64_t raw = static_cast<uint64_t>(n) * ElementSize(t.dtype);
  if (it->second.raw_length != raw) {
    FailValidation(src, "tensor '" + fqn + "' chunk " + c.ToString() + " should hold " +
                            std::to_string(raw) + " bytes but its stored item records " +
                            std::to_string(it->second.raw_length));
  }
  if (it->second.transforms.empty() && it->second.length != raw) {
    FailValidation(src, "tensor '" + fqn + "' chunk " + c.ToString() + " stored length " +
                            std::to_string(it->second.length) + " != " + std::to_string(raw));
  }
  return n;
}

// A rule is checked without expanding it: what a rule claims costs the same however many
// chunks it names.
void ValidateRegularLayout(const Metadata& md, const std::string& fqn, const TensorMetadata& t,
                           const std::string& src) {
  const RegularLayout& reg = *t.regular;
  if (!t.chunks.empty() || !t.chunk_writers.empty()) {
    FailValidation(src, "tensor '" + fqn + "' has both a sharding rule and listed chunks");
  }
  if (reg.dim < 0 || static_cast<size_t>(reg.dim) >= t.shape.size()) {
    FailValidation(src, "tensor '" + fqn + "' is split along dimension " + std::to_string(reg.dim) +
                            " of a shape " + ShapeToString(t.shape));
  }
  if (reg.rule != kRuleBalanced && reg.rule != kRuleCeil) {
    FailValidation(src, "tensor '" + fqn + "' has an unknown sharding rule " +
                            std::to_string(static_cast<int>(reg.rule)));
  }
  if (reg.world < 1 || reg.world != md.world_size) {
    FailValidation(src, "tensor '" + fqn + "' is split over " + std::to_string(reg.world) +
                            " ranks in a checkpoint saved by " + std::to_string(md.world_size));
  }
  const int64_t n = t.shape[static_cast<size_t>(reg.dim)];
  if (n < 1) {
    FailValidation(src, "tensor '" + fqn + "' is split along an empty dimension");
  }
  if (reg.rule == kRuleCeil && n >= reg.world) {
    // Every rank's slice is non-empty, so that chunk k is rank k's.
    const int64_t c = (n + reg.world - 1) / reg.world;
    if ((reg.world - 1) * c >= n) {
      FailValidation(src, "tensor '" + fqn + "': the ceil rule leaves a rank of " +
                              std::to_string(reg.world) + " without rows of " + std::to_string(n));
    }
  }
}

// Version 2: who wrote each chunk (its data files hold it) must be a rank of the save.
void ValidateWriters(const Metadata& md, const std::string& fqn, const TensorMetadata& t,
                     const std::string& src) {
  if (t.regular) return;
  if (t.chunk_writers.size() != t.chunks.size()) {
    FailValidation(src, "tensor '" + fqn + "' lists " + std::to_string(t.chunks.size()) +
                            " chunks and " + std::to_string(t.chunk_writers.size()) + " writers");
  }
  for (int32_t w : t.chunk_writers) {
    if (w < 0 || w >= md.world_size) {
      FailValidation(src, "tensor '" + fqn + "' names writer rank " + std::to_string(w) +
                              " in a checkpoint saved by " + std::to_string(md.world_size));
    }
  }
}

// A tensor's chunks lie inside it, are stored, and cover it exactly once.
void ValidateTensorEntry(const Metadata& md, const std::string& fqn, const TensorMetadata& t,
                         const std::string& src) {
  const int64_t volume = CheckedVolume(fqn, t, src);
  const bool v2 = md.format_version >= 2;
  if (t.regular) {
    ValidateRegularLayout(md, fqn, t, src);
    // A rule tiles its tensor by construction; version 1 (in memory, before encoding) still
    // needs every chunk stored.
    if (!v2) ForEachChunk(t, [&](size_t, const ChunkMeta& c) { CheckChunk(md, fqn, t, c, src); });
    return;
  }
  if (v2) ValidateWriters(md, fqn, t, src);
  int64_t covered = 0;
  for (const auto& c : t.chunks) {
    covered += v2 ? CheckChunkBox(fqn, t, c, src) : CheckChunk(md, fqn, t, c, src);
  }
  // Disjoint chunks whose sizes add up to the volume cover it exactly; overlapping ones may
  // add up to it too while leaving a gap.
  std::optional<std::pair<size_t, size_t>> overlap;
  try {
    overlap = FindOverlap(t.chunks, t.shape);
  } catch (const InvalidArgumentError& e) {
    FailValidation(src, "tensor '" + fqn + "': " + e.what());
  }
  if (overlap) {
    FailValidation(src, "tensor '" + fqn + "' chunks " + t.chunks[overlap->first].ToString() +
                            " and " + t.chunks[overlap->second].ToString() + " overlap");
  }
  if (covered != volume) {
    FailValidation(src, "tensor '" + fqn + "' chunks cover " + std::to_string(covered) + " of " +
                            std::to_string(volume) + " elements");
  }
}

// The chunk offsets of each tensor, sorted once, so that finding a stored item's chunk is a
// binary search (a scan of every chunk per item would be quadratic in the chunks of a tensor).
class ChunkOffsetIndex {
 public:
  bool Contains(const std::string& fqn, const TensorMetadata& t, const Shape& offset) {
    auto [it, fresh] = sorted_.try_emplace(fqn);
    auto& sorted = it->second;
    if (t.regular) return ChunkOrdinal(t, offset).has_value();
    if (fresh) {
      sorted.reserve(t.chunks.size());
      for (const auto& c : t.chunks) sorted.push_back(&c.offsets);
      std::sort(sorted.begin(), sorted.end(), Less);
    }
    return std::binary_search(sorted.begin(), sorted.end(), &offset, Less);
  }

 private:
  static bool Less(const Shape* a, const Shape* b) { return *a < *b; }
  std::map<std::string_view, std::vector<const Shape*>> sorted_;
};

// Where a stored item lies and what it may expand to.
void CheckStoredBytes(const MetadataIndex& index, const StorageInfo& info, const std::string& src,
                      bool allow_references) {
  // The format is flat (docs/FORMAT.md): a data object is a plain name in the root, or in
  // version 3 one in a sibling checkpoint ("../<checkpoint>/<file>").
  const std::string& p = info.relative_path;
  if (!IsPlainObjectName(p) && !(allow_references && IsSiblingReference(p))) {
    FailValidation(src, "stored item " + index.ToString() + " has an invalid path '" + p +
                            "' (a data file is a plain name in the checkpoint's root)");
  }
  if (info.offset > std::numeric_limits<uint64_t>::max() - info.length ||
      info.offset + info.length > (uint64_t{1} << 62)) {
    FailValidation(src, "stored item " + index.ToString() + " has an overflowing offset/length");
  }
  // What a reader may be asked to allocate must be backed by stored bytes: a raw item is its
  // stored bytes; a zstd frame cannot expand by more than kMaxZstdExpansion (one 4-byte RLE
  // block per 128 KiB of output), so a claim beyond that is a lie, refused before any
  // allocation.
  if (info.transforms.empty() && info.raw_length != info.length) {
    FailValidation(src, "stored item " + index.ToString() + " is raw but records " +
                            std::to_string(info.raw_length) + " raw bytes for " +
                            std::to_string(info.length) + " stored");
  }
  if (info.transforms.size() == 1 && info.transforms[0] == "zstd" &&
      info.raw_length / kMaxZstdExpansion > info.length) {
    FailValidation(src, "stored item " + index.ToString() + " claims " +
                            std::to_string(info.raw_length) + " raw bytes from a " +
                            std::to_string(info.length) +
                            "-byte zstd frame (more than zstd can expand)");
  }
}

// Each stored item must belong to an entry (to a chunk, for a tensor) and lie in a plain file.
void ValidateStoredItems(const Metadata& md, const std::string& src) {
  ChunkOffsetIndex chunk_offsets;
  for (const auto& [index, info] : md.storage) {
    auto entry = md.entries.find(index.fqn);
    if (entry == md.entries.end()) {
      FailValidation(src, "stored item " + index.ToString() + " has no entry");
    }
    if (const auto* t = std::get_if<TensorMetadata>(&entry->second)) {
      if (!chunk_offsets.Contains(entry->first, *t, index.offset)) {
        FailValidation(src, "stored item " + index.ToString() + " matches no chunk of its tensor");
      }
    } else if (!index.offset.empty()) {
      FailValidation(src, "stored item " + index.ToString() + " of a byte entry has chunk offsets");
    }
    CheckStoredBytes(index, info, src, md.format_version >= 3);
  }
}

// A data file's index and block table as the metadata records them (a file table row, or a
// sibling's file that a reference points at); `what` names it in messages.
struct FileGeometry {
  std::string what;
  uint64_t size, index_offset, index_length, block_table_offset, block_table_length;
  uint32_t block_table_crc32c;
};

// The index lies inside the file and is a whole number of items of `format_version`; the block
// table lies just before the index, so it is outside every item, which DecodeFileIndex keeps
// below the table's start.
void CheckFileGeometry(const FileGeometry& g, uint32_t format_version, const std::string& src) {
  if (g.size > (uint64_t{1} << 62) || g.index_offset > g.size ||
      g.index_length > g.size - g.index_offset) {
    FailValidation(src, g.what + ": its index [" + std::to_string(g.index_offset) + ", +" +
                            std::to_string(g.index_length) + ") lies outside its " +
                            std::to_string(g.size) + " bytes");
  }
  if (g.index_length < kFileIndexHeaderBytes ||
      (g.index_length - kFileIndexHeaderBytes) % FileIndexItemBytes(format_version) != 0) {
    FailValidation(src, g.what + ": an index of " + std::to_string(g.index_length) +
                            " bytes is no whole number of items");
  }
  if (g.block_table_length == 0) {
    if (g.block_table_offset != 0 || g.block_table_crc32c != 0) {
      FailValidation(src, g.what + ": an empty block table with an offset or checksum");
    }
  } else if (g.block_table_length > g.index_offset ||
             g.block_table_offset != g.index_offset - g.block_table_length ||
             g.block_table_length < kBlockTableHeaderBytes ||
             (g.block_table_length - kBlockTableHeaderBytes) % 4 != 0) {
    FailValidation(src, g.what + ": its block table [" + std::to_string(g.block_table_offset) +
                            ", +" + std::to_string(g.block_table_length) +
                            ") is not a whole table ending where its index starts (" +
                            std::to_string(g.index_offset) + ")");
  }
}

// Version 2: the file table. A row's index lies inside its file and its length is what its item
// count takes (storage/format/dcp_index.h), so an index claims no more items than its bytes
// hold; names are plain and distinct; writers are ranks of the save.
void ValidateFileTable(const Metadata& md, const std::string& src) {
  std::unordered_set<std::string_view> names;
  names.reserve(md.files.size());
  for (const auto& f : md.files) {
    const std::string& p = f.name;
    if (!IsPlainObjectName(p)) {
      FailValidation(
          src, "data file " + ClippedName(p) + " is not a plain name in the checkpoint's root");
    }
    if (!f.references.empty() && md.format_version < 3) {
      FailValidation(src, "data file '" + p + "' has references, which need format version 3");
    }
    for (const DataFileReference& r : f.references) {
      if (!IsSiblingReference(r.name) || r.size > (uint64_t{1} << 62)) {
        FailValidation(src, "data file '" + p + "': reference " + ClippedName(r.name) +
                                " is not \"../<checkpoint>/<file>\" of plain names with a size");
      }
      // Where the sibling file's index and block table lie: recorded together or not at all.
      if (r.block_table_length != 0) {
        CheckFileGeometry(
            {"data file '" + p + "': reference '" + r.name + "'", r.size, r.index_offset,
             r.index_length, r.block_table_offset, r.block_table_length, r.block_table_crc32c},
            3, src);
      } else if (r.index_offset != 0 || r.index_length != 0 || r.index_crc32c != 0 ||
                 r.block_table_offset != 0 || r.block_table_crc32c != 0) {
        FailValidation(src, "data file '" + p + "': reference '" + r.name +
                                "' records where its index lies but no block table");
      }
    }
    if (!names.insert(p).second) FailValidation(src, "data file '" + p + "' is listed twice");
    if (f.writer < 0 || f.writer >= md.world_size) {
      FailValidation(src, "data file '" + p + "' names writer rank " + std::to_string(f.writer) +
                              " in a checkpoint saved by " + std::to_string(md.world_size));
    }
    CheckFileGeometry({"data file '" + p + "'", f.size, f.index_offset, f.index_length,
                       f.block_table_offset, f.block_table_length, f.block_table_crc32c},
                      md.format_version, src);
    if (!f.index_copy.empty() &&
        (f.index_copy.size() != f.index_length ||
         Crc32c(0, f.index_copy.data(), f.index_copy.size()) != f.index_crc32c)) {
      FailValidation(src, "data file '" + p +
                              "': the metadata's copy of its index does not match the index's "
                              "recorded length and checksum");
    }
  }
}

// Version 2: the items each rank's indexes list are the items the metadata attributes to it
// (chunk k of a rule by rank k, an explicit chunk or a byte entry by its writer); the commit
// checks this per rank. Checked from the counts alone (O(entries + files), no rule expanded), so
// that neither an index (whose length is read and allocated) nor a load plan (one read item per
// chunk) can claim more than the other side holds: a 189-byte document claiming 2^31 chunks
// needs 2^31 rows of data files here, and a file's index_length is bounded by its writer's items.
void ValidateItemCounts(const Metadata& md, const std::string& src) {
  std::unordered_map<int32_t, uint64_t> stored;  // rank -> items its files' indexes hold
  std::unordered_map<int32_t, std::vector<const DataFile*>> file_of;
  stored.reserve(md.files.size());
  for (const DataFile& f : md.files) {
    const uint64_t n =
        (f.index_length - kFileIndexHeaderBytes) / FileIndexItemBytes(md.format_version);
    if (n == 0) {
      // A writer creates a file for items only; a row that holds none is referenced by nothing
      // (and would cost a size query per row).
      FailValidation(src, "data file '" + f.name + "' holds no item (its index is empty)");
    }
    stored[f.writer] += n;
    file_of[f.writer].push_back(&f);
  }
  std::unordered_map<int32_t, std::pair<uint64_t, const std::string*>> listed;  // explicit
  std::vector<std::pair<size_t, const std::string*>> rules;  // chunk count, tensor
  for (const auto& [fqn, entry] : md.entries) {
    if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
      if (t->regular) {
        rules.emplace_back(ChunkCount(*t), &fqn);
      } else {
        for (int32_t w : t->chunk_writers) {
          auto& a = listed.try_emplace(w, 0, &fqn).first->second;
          ++a.first;
        }
      }
    } else {
      auto& a = listed.try_emplace(std::get<BytesMetadata>(entry).writer, 0, &fqn).first->second;
      ++a.first;
    }
  }
  std::sort(rules.begin(), rules.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  const size_t max_chunks = rules.empty() ? 0 : rules.back().first;
  // Chunk k of a rule is rank k's: every rank below the longest rule's chunk count needs files.
  if (max_chunks > stored.size()) {
    FailValidation(src, "tensor " + ClippedName(*rules.back().second) + " claims " +
                            std::to_string(max_chunks) + " stored chunks (one per rank) but only " +
                            std::to_string(stored.size()) +
                            " ranks have data files: its chunks exceed what is stored");
  }
  std::vector<int32_t> ranks;
  ranks.reserve(stored.size() + listed.size() + max_chunks);
  for (const auto& [r, n] : stored) ranks.push_back(r);
  for (const auto& [r, a] : listed) ranks.push_back(r);
  for (size_t r = 0; r < max_chunks; ++r) ranks.push_back(static_cast<int32_t>(r));
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::vector<size_t> counts(rules.size());
  for (size_t i = 0; i < rules.size(); ++i) counts[i] = rules[i].first;
  for (int32_t r : ranks) {
    // Rules with more than r chunks each have one item of rank r.
    const auto longer = static_cast<uint64_t>(
        counts.end() - std::upper_bound(counts.begin(), counts.end(), static_cast<size_t>(r)));
    auto l = listed.find(r);
    const uint64_t expected = longer + (l == listed.end() ? 0 : l->second.first);
    auto s = stored.find(r);
    const uint64_t held = s == stored.end() ? 0 : s->second;
    if (held == expected) continue;
    const std::string* example =
        l != listed.end() ? l->second.second : (longer > 0 ? rules.back().second : nullptr);
    std::string names;
    auto f = file_of.find(r);
    if (f == file_of.end()) {
      names = "it has none";
    } else {
      constexpr size_t kNamed = 4;
      for (size_t i = 0; i < f->second.size() && i < kNamed; ++i) {
        names += (i ? ", '" : "'") + f->second[i]->name + "'";
      }
      if (f->second.size() > kNamed) {
        names += " and " + std::to_string(f->second.size() - kNamed) + " more";
      }
    }
    FailValidation(src, "the indexes of rank " + std::to_string(r) + "'s data files (" + names +
                            ") claim " + std::to_string(held) + " items, the metadata attributes " +
                            std::to_string(expected) + " to it" +
                            (example ? " (e.g. of " + ClippedName(*example) + ")" : std::string()));
  }
}

std::string JoinKeys(const KeyPath& path) {
  std::string s;
  for (size_t i = 0; i < path.size(); ++i) s += (i ? "." : "") + path[i];
  return s;
}

// Key paths rebuild the nesting of a loaded state dict, so they must agree with the fqns and
// form a tree: no empty path or key, no two entries at one path, no entry below another.
void ValidateKeyPaths(const Metadata& md, const std::string& src) {
  auto fail = [&](const std::string& what) { throw CorruptionError(src + ": " + what); };
  // A load rebuilds one nested state dict per level (and a flatten walks them recursively): a
  // path as deep as a crafted 8 MiB name has dots would exhaust the stack and cost O(depth^2).
  auto check_depth = [&](const std::string& fqn, size_t depth) {
    if (depth > kMaxKeyPathDepth) {
      fail("entry " + ClippedName(fqn) + " is nested " + std::to_string(depth) +
           " levels deep (limit " + std::to_string(kMaxKeyPathDepth) + ")");
    }
  };
  for (const auto& [fqn, path] : md.key_paths) {
    check_depth(fqn, path.size());
    if (!md.entries.count(fqn)) fail("key path of '" + fqn + "' names no entry");
    if (path.empty()) fail("entry '" + fqn + "' has an empty key path");
    for (const auto& k : path) {
      if (k.empty()) fail("entry '" + fqn + "' has an empty key in its key path");
    }
    if (JoinKeys(path) != fqn) {
      fail("entry '" + fqn + "' has key path [" + JoinKeys(path) +
           "] that does not join to its fqn");
    }
  }
  // The path each entry is loaded at: its key path, or its fqn split at dots.
  std::vector<std::pair<KeyPath, const std::string*>> paths;
  paths.reserve(md.entries.size());
  for (const auto& [fqn, entry] : md.entries) {
    if (auto it = md.key_paths.find(fqn); it != md.key_paths.end()) {
      paths.emplace_back(it->second, &fqn);
      continue;
    }
    check_depth(fqn, static_cast<size_t>(std::count(fqn.begin(), fqn.end(), '.')) + 1);
    KeyPath path;
    for (size_t pos = 0;;) {
      const size_t dot = fqn.find('.', pos);
      path.push_back(fqn.substr(pos, dot == std::string::npos ? dot : dot - pos));
      if (dot == std::string::npos) break;
      pos = dot + 1;
    }
    paths.emplace_back(std::move(path), &fqn);
  }
  // Sorted, an entry nested below another follows it directly or after others below it.
  std::sort(paths.begin(), paths.end());
  for (size_t i = 1; i < paths.size(); ++i) {
    const KeyPath& a = paths[i - 1].first;
    const KeyPath& b = paths[i].first;
    if (a.size() <= b.size() && std::equal(a.begin(), a.end(), b.begin())) {
      fail(a.size() == b.size() ? "entries '" + *paths[i - 1].second + "' and '" +
                                      *paths[i].second + "' have the same key path"
                                : "entry '" + *paths[i].second + "' is nested under entry '" +
                                      *paths[i - 1].second + "', which is not a dict");
    }
  }
}

}  // namespace

void ValidateMetadata(const Metadata& md, std::string_view source) {
  const std::string src(source);
  const bool v2 = md.format_version >= 2;
  if (!v2 && !md.files.empty()) {
    FailValidation(src, "version-1 metadata has a file table (a version-2 field)");
  }
  for (const auto& [fqn, entry] : md.entries) {
    if (fqn.empty()) FailValidation(src, "entry with an empty fqn");
    if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
      ValidateTensorEntry(md, fqn, *t, src);
    } else if (v2) {
      const int32_t w = std::get<BytesMetadata>(entry).writer;
      if (w < 0 || w >= md.world_size) {
        FailValidation(src, "byte entry '" + fqn + "' names writer rank " + std::to_string(w) +
                                " in a checkpoint saved by " + std::to_string(md.world_size));
      }
    } else if (!md.storage.count(MetadataIndex{fqn, {}, {}})) {
      FailValidation(src, "byte entry '" + fqn + "' has no stored item");
    }
  }
  if (v2) {
    ValidateFileTable(md, src);
    ValidateItemCounts(md, src);
    // Indexes key items by FqnHash: two entries with one hash could not be told apart.
    std::unordered_map<uint64_t, const std::string*> hashes;
    hashes.reserve(md.entries.size());
    for (const auto& [fqn, entry] : md.entries) {
      auto [it, fresh] = hashes.emplace(FqnHash(fqn), &fqn);
      if (!fresh) {
        FailValidation(src, "entries '" + *it->second + "' and '" + fqn +
                                "' share an index key (FqnHash); rename one, or save with "
                                "metadata_version 1");
      }
    }
  }
  ValidateStoredItems(md, src);
  ValidateKeyPaths(md, src);
}

}  // namespace dcp
