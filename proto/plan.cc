#include "dcp/proto/plan.h"

#include <algorithm>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"

namespace dcp {

std::string MetadataIndex::ToString() const {
  return offset.empty() ? "'" + fqn + "'" : "'" + fqn + "' at " + ShapeToString(offset);
}

uint64_t Metadata::TotalStoredBytes() const {
  uint64_t total = 0;
  if (!files.empty()) {
    for (const auto& f : files) total += f.index_offset;
    return total;
  }
  for (const auto& [index, info] : storage) total += info.length;
  return total;
}

std::set<std::string> Metadata::DataFileNames() const {
  std::set<std::string> names;
  for (const auto& f : files) names.insert(f.name);
  const std::string* last = nullptr;
  for (const auto& [index, info] : storage) {
    if (last == nullptr || *last != info.relative_path) {
      names.insert(info.relative_path);
      last = &info.relative_path;
    }
  }
  return names;
}

std::pair<int64_t, int64_t> RegularSlice(int64_t extent, int64_t rank, int64_t world,
                                         RegularRule rule) {
  if (rule == kRuleCeil) {
    const int64_t c = (extent + world - 1) / world;
    const int64_t b = std::min<int64_t>(extent, c * rank);
    return {b, std::min<int64_t>(extent, b + c)};
  }
  const int64_t base = extent / world, extra = extent % world;
  const int64_t b = rank * base + std::min<int64_t>(rank, extra);
  return {b, b + base + (rank < extra ? 1 : 0)};
}

namespace {

// The ordinal of the slice that holds unit `u` (0 <= u < extent) under the rule.
int64_t SliceHolding(int64_t extent, int64_t world, RegularRule rule, int64_t u) {
  if (rule == kRuleCeil) return u / ((extent + world - 1) / world);
  const int64_t base = extent / world, extra = extent % world;
  const int64_t head = extra * (base + 1);  // units in the first `extra` (longer) slices
  if (u < head) return u / (base + 1);
  return extra + (u - head) / base;  // base > 0 here: u >= head means extent > extra
}

}  // namespace

size_t ChunkCount(const TensorMetadata& t) {
  if (!t.regular) return t.chunks.size();
  const int64_t extent = t.shape[static_cast<size_t>(t.regular->dim)];
  return static_cast<size_t>(std::min<int64_t>(extent, t.regular->world));
}

ChunkMeta ChunkAt(const TensorMetadata& t, size_t k) {
  if (!t.regular) return t.chunks[k];
  const size_t d = static_cast<size_t>(t.regular->dim);
  auto [b, e] =
      RegularSlice(t.shape[d], static_cast<int64_t>(k), t.regular->world, t.regular->rule);
  ChunkMeta c{Shape(t.shape.size(), 0), t.shape};
  c.offsets[d] = b;
  c.sizes[d] = e - b;
  return c;
}

std::optional<size_t> ChunkOrdinal(const TensorMetadata& t, const Shape& offsets,
                                   std::optional<int32_t> hint) {
  if (t.regular) {
    if (offsets.size() != t.shape.size()) return std::nullopt;
    const size_t d = static_cast<size_t>(t.regular->dim);
    for (size_t i = 0; i < offsets.size(); ++i) {
      if (i != d && offsets[i] != 0) return std::nullopt;
    }
    if (offsets[d] < 0 || offsets[d] >= t.shape[d]) return std::nullopt;
    const int64_t k = SliceHolding(t.shape[d], t.regular->world, t.regular->rule, offsets[d]);
    if (static_cast<size_t>(k) >= ChunkCount(t)) return std::nullopt;
    if (RegularSlice(t.shape[d], k, t.regular->world, t.regular->rule).first != offsets[d]) {
      return std::nullopt;
    }
    return static_cast<size_t>(k);
  }
  if (hint && *hint >= 0 && static_cast<size_t>(*hint) < t.chunks.size() &&
      t.chunks[static_cast<size_t>(*hint)].offsets == offsets) {
    return static_cast<size_t>(*hint);
  }
  for (size_t k = 0; k < t.chunks.size(); ++k) {
    if (t.chunks[k].offsets == offsets) return k;
  }
  return std::nullopt;
}

int32_t ChunkWriter(const TensorMetadata& t, size_t k) {
  if (t.regular) return static_cast<int32_t>(k);
  return k < t.chunk_writers.size() ? t.chunk_writers[k] : -1;
}

std::pair<size_t, size_t> RegularChunkRange(const TensorMetadata& t, int64_t begin, int64_t end) {
  const int64_t extent = t.shape[static_cast<size_t>(t.regular->dim)];
  begin = std::max<int64_t>(begin, 0);
  end = std::min<int64_t>(end, extent);
  if (begin >= end) return {0, 0};
  const int64_t first = SliceHolding(extent, t.regular->world, t.regular->rule, begin);
  const int64_t last = SliceHolding(extent, t.regular->world, t.regular->rule, end - 1);
  return {static_cast<size_t>(first), static_cast<size_t>(last) + 1};
}

TensorMetadata WithListedChunks(const TensorMetadata& t) {
  if (!t.regular) return t;
  TensorMetadata out{t.dtype, t.shape, {}};
  const size_t n = ChunkCount(t);
  out.chunks.reserve(n);
  for (size_t k = 0; k < n; ++k) out.chunks.push_back(ChunkAt(t, k));
  return out;
}

void FillStorage(Metadata& md, const std::vector<std::vector<WriteResult>>& results) {
  std::vector<const WriteResult*> order;
  size_t n = 0;
  for (const auto& rank_results : results) n += rank_results.size();
  order.reserve(n);
  for (const auto& rank_results : results) {
    for (const auto& r : rank_results) order.push_back(&r);
  }
  std::sort(order.begin(), order.end(),
            [](const WriteResult* a, const WriteResult* b) { return a->index < b->index; });
  md.storage.clear();
  for (size_t i = 0; i < order.size(); ++i) {
    if (i > 0 && order[i]->index == order[i - 1]->index) {
      throw InternalError("item " + order[i]->index.ToString() + " was written twice");
    }
    md.storage.emplace_hint(md.storage.end(), order[i]->index, order[i]->storage);
  }
}

std::optional<uint32_t> StoredCrc(const StorageInfo& info) {
  return info.zip_crc32 ? info.zip_crc32 : info.crc32c;
}

uint32_t ItemCrc(const StorageInfo& info, uint32_t crc, const void* data, size_t n) {
  return info.zip_crc32 ? Crc32(crc, data, n) : Crc32c(crc, data, n);
}

std::string ClippedName(const std::string& name) {
  if (name.size() <= 200) return "'" + name + "'";
  return "'" + name.substr(0, 120) + "...' (" + std::to_string(name.size()) + " bytes)";
}

}  // namespace dcp
