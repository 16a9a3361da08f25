#include "dcp/proto/plan.h"

#include <algorithm>
#include <tuple>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/span_pieces.h"

namespace dcp {

std::string MetadataIndex::ToString() const {
  return offset.empty() ? "'" + fqn + "'" : "'" + fqn + "' at " + ShapeToString(offset);
}

uint64_t Metadata::TotalStoredBytes() const {
  uint64_t total = 0;
  if (!files.empty()) {
    for (const auto& f : files) total += f.index_offset - f.block_table_length;
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

namespace {

// The next item of `out` to write: an element left from an earlier part when there is one (its
// strings and shapes are assigned over, reusing their memory: a large reshard expands millions
// of pieces, and allocating each piece's six buffers afresh was most of the expansion's cost),
// else a new one. `used` counts the items written.
ReadItem& NextSlot(std::vector<ReadItem>& out, size_t& used, const ReadItem& value) {
  if (used < out.size()) {
    out[used] = value;
  } else {
    out.push_back(value);
  }
  return out[used++];
}

}  // namespace

void ForEachSpanChunk(const ReadItem& item, const TensorMetadata& saved,
                      const std::function<bool(const SpanChunk&)>& fn) {
  const std::string& fqn = item.storage_index.fqn;
  auto fail = [&](const std::string& why) {
    throw InvalidArgumentError("read of tensor " + ClippedName(fqn) + " across " +
                               std::to_string(item.chunk_span) + " stored chunks: " + why);
  };
  const size_t rank = saved.shape.size();
  if (item.type != ReadItemType::kTensor || !saved.regular) {
    fail("the tensor is not stored by a rule");
  }
  if (!item.storage_index.index || *item.storage_index.index < 0) fail("no first chunk");
  const auto first = static_cast<size_t>(*item.storage_index.index);
  const size_t count = ChunkCount(saved);
  if (first >= count || item.chunk_span > count - first) {
    fail("chunks " + std::to_string(first) + " to " + std::to_string(first + item.chunk_span - 1) +
         " of " + std::to_string(count));
  }
  if (item.dest_offsets.size() != rank || item.storage_offsets.size() != rank ||
      item.lengths.size() != rank || item.storage_index.offset.size() != rank) {
    fail("offsets or lengths of the wrong rank");
  }
  const auto d = static_cast<size_t>(saved.regular->dim);
  const int64_t extent = saved.shape[d];
  const int64_t world = saved.regular->world;
  const RegularRule rule = saved.regular->rule;
  const int64_t first_begin = RegularSlice(extent, static_cast<int64_t>(first), world, rule).first;
  const int64_t last_end =
      RegularSlice(extent, static_cast<int64_t>(first + item.chunk_span - 1), world, rule).second;
  for (size_t j = 0; j < rank; ++j) {
    const int64_t origin = j == d ? first_begin : 0;
    const int64_t limit = j == d ? last_end : saved.shape[j];
    if (item.storage_index.offset[j] != origin) fail("the first chunk does not start there");
    if (item.storage_offsets[j] < 0 || item.lengths[j] < 0 ||
        item.storage_offsets[j] > limit - origin - item.lengths[j]) {
      fail("the box lies outside its chunks");
    }
  }
  // The box along d, in the tensor's coordinates; each chunk gets its part of it.
  SpanChunk c;
  c.dim = d;
  c.box_begin = first_begin + item.storage_offsets[d];
  const int64_t end = c.box_begin + item.lengths[d];
  for (size_t k = first; k < first + item.chunk_span; ++k) {
    std::tie(c.chunk_begin, c.chunk_end) =
        RegularSlice(extent, static_cast<int64_t>(k), world, rule);
    c.lo = std::max(c.chunk_begin, c.box_begin);
    c.hi = std::min(c.chunk_end, end);
    if (c.lo >= c.hi) continue;
    c.k = k;
    if (!fn(c)) return;
  }
}

void WriteSpanPieces(const ReadItem& item, const TensorMetadata& saved, std::vector<ReadItem>& out,
                     size_t& used) {
  if (item.chunk_span <= 1) {
    NextSlot(out, used, item);
    return;
  }
  ForEachSpanChunk(item, saved, [&](const SpanChunk& c) {
    ReadItem& piece = NextSlot(out, used, item);
    piece.chunk_span = 1;
    piece.storage_index.offset[c.dim] = c.chunk_begin;
    piece.storage_index.index = static_cast<int32_t>(c.k);
    piece.storage_offsets[c.dim] = c.lo - c.chunk_begin;
    piece.dest_offsets[c.dim] += c.lo - c.box_begin;
    piece.lengths[c.dim] = c.hi - c.lo;
    return true;
  });
}

void AppendSpanPieces(const ReadItem& item, const TensorMetadata& saved,
                      std::vector<ReadItem>& out) {
  size_t used = out.size();
  WriteSpanPieces(item, saved, out, used);
}

namespace {

// The tensor a span reads, found once per run of items of one tensor.
class SpanTensors {
 public:
  explicit SpanTensors(const Metadata& md) : md_(md) {}
  const TensorMetadata& Of(const ReadItem& item) {
    if (last_fqn_ == nullptr || *last_fqn_ != item.storage_index.fqn) {
      auto it = md_.entries.find(item.storage_index.fqn);
      saved_ = it == md_.entries.end() ? nullptr : std::get_if<TensorMetadata>(&it->second);
      if (saved_ == nullptr) {
        throw InvalidArgumentError("read of " + ClippedName(item.storage_index.fqn) +
                                   " across stored chunks: the checkpoint has no such tensor");
      }
      last_fqn_ = &item.storage_index.fqn;
    }
    return *saved_;
  }

 private:
  const Metadata& md_;
  const std::string* last_fqn_ = nullptr;  // a tensor's items are usually adjacent
  const TensorMetadata* saved_ = nullptr;
};

}  // namespace

LoadPlan ExpandChunkSpans(LoadPlan plan, const Metadata& md) {
  if (std::none_of(plan.items.begin(), plan.items.end(),
                   [](const ReadItem& item) { return item.chunk_span > 1; })) {
    return plan;
  }
  std::vector<ReadItem> items;
  // Pieces at most: one per chunk of each span, and a rule has at most world_size chunks (a
  // span claiming more is refused below, after a reservation it cannot inflate).
  const auto max_span = static_cast<size_t>(std::max(md.world_size, 1));
  size_t bound = 0;
  for (const ReadItem& item : plan.items) {
    bound += std::clamp<size_t>(item.chunk_span, 1, max_span);
  }
  items.reserve(bound);
  SpanTensors tensors(md);
  for (ReadItem& item : plan.items) {
    if (item.chunk_span <= 1) {
      items.push_back(std::move(item));
    } else {
      AppendSpanPieces(item, tensors.Of(item), items);
    }
  }
  plan.items = std::move(items);
  return plan;
}

void ForEachExpandedPart(const LoadPlan& plan, const Metadata& md, size_t max_items,
                         const std::function<void(const LoadPlan&)>& read) {
  max_items = std::max<size_t>(max_items, 1);
  LoadPlan part;
  part.storage_data = plan.storage_data;
  part.planner_data = plan.planner_data;
  part.items.reserve(std::min(plan.items.size(), max_items));
  SpanTensors tensors(md);
  bool any = false;
  size_t used = 0;  // items of this part; part.items may hold more, left from the last part
  for (const ReadItem& item : plan.items) {
    if (item.chunk_span <= 1) {
      NextSlot(part.items, used, item);
    } else {
      WriteSpanPieces(item, tensors.Of(item), part.items, used);
    }
    if (used >= max_items) {
      part.items.resize(used);  // only a span's overshoot of the last part can be cut here
      read(part);
      used = 0;
      any = true;
    }
  }
  if (used > 0 || !any) {
    part.items.resize(used);
    read(part);
  }
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
