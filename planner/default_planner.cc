#include "dcp/planner/default_planner.h"

#include <algorithm>
#include <charconv>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <sstream>
#include <string_view>
#include <unordered_map>

#include "dcp/proto/chunks.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/dtype_cast.h"
#include "dcp/proto/error.h"

namespace dcp {

namespace {

// A device tensor is accepted when this process has a backend and the device
// (proto/device/device.h); checking here makes every rank refuse it during planning, before any
// byte is written.
void CheckTensorView(const std::string& fqn, const TensorView& v) {
  if (!v.device.is_cpu()) DeviceBackendFor(v.device, "tensor '" + fqn + "'");
  if (!v.strides.empty() && v.strides.size() != v.shape.size()) {
    throw InvalidArgumentError("tensor '" + fqn + "' has " + std::to_string(v.strides.size()) +
                               " strides for shape " + ShapeToString(v.shape));
  }
  if (v.data == nullptr && v.numel() > 0) {
    throw InvalidArgumentError("tensor '" + fqn + "' has no data pointer");
  }
}

const char* KindName(const StateValue& v) {
  if (std::holds_alternative<Blob>(v)) return "a byte blob";
  if (std::holds_alternative<ShardedTensor>(v)) return "a sharded tensor";
  return "a tensor";
}

std::string Describe(DType dtype, const Shape& shape) {
  return std::string(DTypeName(dtype)) + ShapeToString(shape);
}

}  // namespace

void ValidateChunks(const std::string& fqn, const Shape& shape,
                    const std::vector<PlacedChunk>& chunks) {
  std::vector<ChunkMeta> metas;
  std::vector<int> ranks;
  metas.reserve(chunks.size());
  ranks.reserve(chunks.size());
  for (const auto& pc : chunks) {
    metas.push_back(pc.chunk);
    ranks.push_back(pc.rank);
  }
  ValidateChunks(fqn, shape, metas, ranks);
}

void ValidateChunks(const std::string& fqn, const Shape& shape,
                    const std::vector<ChunkMeta>& chunks, const std::vector<int>& ranks) {
  const int64_t volume = NumElements(shape);
  auto where = [&](size_t i) {
    const int rank = i < ranks.size() ? ranks[i] : -1;
    return chunks[i].ToString() + (rank >= 0 ? " (rank " + std::to_string(rank) + ")" : "");
  };
  int64_t covered = 0;
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ChunkMeta& c = chunks[i];
    if (c.offsets.size() != shape.size() || c.sizes.size() != shape.size()) {
      throw InvalidArgumentError("tensor '" + fqn + "': chunk " + where(i) +
                                 " does not match the rank of shape " + ShapeToString(shape));
    }
    for (size_t d = 0; d < shape.size(); ++d) {
      if (c.offsets[d] < 0 || c.sizes[d] < 0 || c.offsets[d] > shape[d] - c.sizes[d]) {
        throw InvalidArgumentError("tensor '" + fqn + "': chunk " + where(i) +
                                   " lies outside shape " + ShapeToString(shape));
      }
    }
    covered += c.numel();
  }
  std::optional<std::pair<size_t, size_t>> overlap;
  try {
    overlap = FindOverlap(chunks, shape);
  } catch (const InvalidArgumentError& e) {
    throw InvalidArgumentError("tensor '" + fqn + "': " + e.what());
  }
  if (overlap) {
    throw InvalidArgumentError("tensor '" + fqn + "': chunks " + where(overlap->first) + " and " +
                               where(overlap->second) + " overlap");
  }
  if (covered != volume) {
    throw InvalidArgumentError("tensor '" + fqn + "' of shape " + ShapeToString(shape) +
                               ": its chunks cover " + std::to_string(covered) + " of " +
                               std::to_string(volume) + " elements (some part has no shard)");
  }
}

// ---------------------------------------------------------------------------------------------
// ChunkIndex

namespace {

// Intersect(a, b).has_value() without allocating.
bool Overlap(const ChunkMeta& a, const ChunkMeta& b) {
  const size_t n = a.offsets.size();
  if (b.offsets.size() != n || a.sizes.size() != n || b.sizes.size() != n) {
    return Intersect(a, b).has_value();
  }
  for (size_t d = 0; d < n; ++d) {
    if (a.sizes[d] <= 0 || b.sizes[d] <= 0) return false;
    if (std::max(a.offsets[d], b.offsets[d]) >=
        std::min(a.offsets[d] + a.sizes[d], b.offsets[d] + b.sizes[d])) {
      return false;
    }
  }
  return true;
}

}  // namespace

ChunkIndex::ChunkIndex(const std::vector<ChunkMeta>& chunks) : chunks_(&chunks) {
  const size_t rank = chunks.empty() ? 0 : chunks[0].offsets.size();
  if (rank > 0) {
    size_t best = 0;
    std::vector<int64_t> starts;
    for (size_t d = 0; d < rank; ++d) {
      starts.clear();
      for (const auto& c : chunks) {
        if (c.offsets.size() == rank) starts.push_back(c.offsets[d]);
      }
      std::sort(starts.begin(), starts.end());
      const size_t distinct = std::unique(starts.begin(), starts.end()) - starts.begin();
      if (distinct > best) best = distinct, dim_ = d;
    }
  }
  starts_.reserve(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i) {
    const ChunkMeta& c = chunks[i];
    if (rank == 0 || c.offsets.size() != rank || c.sizes.size() != rank) {
      starts_.emplace_back(0, i);  // malformed or 0-d: always a candidate
      max_extent_ = std::max<int64_t>(max_extent_, std::numeric_limits<int64_t>::max() / 4);
      continue;
    }
    starts_.emplace_back(c.offsets[dim_], i);
    max_extent_ = std::max(max_extent_, c.sizes[dim_]);
  }
  std::sort(starts_.begin(), starts_.end());
}

std::vector<size_t> ChunkIndex::Overlapping(const ChunkMeta& box) const {
  std::vector<size_t> out;
  if (starts_.empty()) return out;
  int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
  if (dim_ < box.offsets.size() && dim_ < box.sizes.size() && !box.offsets.empty()) {
    // A chunk [s, s + e) with e <= max_extent_ meets [b, b + n) only if b - max_extent_ < s <
    // b + n.
    const int64_t b = box.offsets[dim_], n = box.sizes[dim_];
    lo = b > std::numeric_limits<int64_t>::min() / 2 + max_extent_
             ? b - max_extent_ + 1
             : std::numeric_limits<int64_t>::min();
    hi = b + n;
  }
  auto first = std::lower_bound(starts_.begin(), starts_.end(), std::make_pair(lo, size_t{0}));
  for (auto it = first; it != starts_.end() && it->first < hi; ++it) {
    if (Overlap(box, (*chunks_)[it->second])) out.push_back(it->second);
  }
  std::sort(out.begin(), out.end());
  return out;
}

std::vector<size_t> OverlappingChunksNaive(const std::vector<ChunkMeta>& chunks,
                                           const ChunkMeta& box) {
  std::vector<size_t> out;
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (Intersect(box, chunks[i])) out.push_back(i);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// DefaultSavePlanner

void DefaultSavePlanner::SetUp(const StateDict& state_dict, const PlannerContext& ctx) {
  flat_ = FlattenStateDict(state_dict);
  ctx_ = ctx;
}

SavePlan DefaultSavePlanner::CreateLocalPlan() {
  SavePlan plan;
  for (const auto& [fqn, entry] : flat_) {
    plan.key_paths[fqn] = entry.path;
    const StateValue& value = *entry.value;
    if (const auto* t = std::get_if<TensorView>(&value)) {
      CheckTensorView(fqn, *t);
      WriteItem item;
      item.index = {fqn, Shape(t->shape.size(), 0), {}};
      item.type = WriteItemType::kTensor;
      item.dtype = t->dtype;
      item.global_shape = t->shape;
      item.chunk = {Shape(t->shape.size(), 0), t->shape};
      item.size_bytes = t->nbytes();
      plan.items.push_back(std::move(item));
    } else if (const auto* st = std::get_if<ShardedTensor>(&value)) {
      NumElements(st->global_shape);  // validates the shape
      std::set<Shape> seen;
      for (const auto& shard : st->local_shards) {
        CheckTensorView(fqn, shard.view);
        if (shard.view.dtype != st->dtype) {
          throw InvalidArgumentError("sharded tensor '" + fqn + "' is " +
                                     std::string(DTypeName(st->dtype)) + " but a local shard is " +
                                     std::string(DTypeName(shard.view.dtype)));
        }
        if (shard.offsets.size() != st->global_shape.size() ||
            shard.view.shape.size() != st->global_shape.size()) {
          throw InvalidArgumentError("sharded tensor '" + fqn + "' of shape " +
                                     ShapeToString(st->global_shape) + ": shard at " +
                                     ShapeToString(shard.offsets) + " with shape " +
                                     ShapeToString(shard.view.shape) + " has the wrong rank");
        }
        if (shard.view.numel() == 0) {
          // An empty shard holds nothing to store, and another rank's non-empty shard may start
          // at the same offsets (1-D [1000] split 1, 0, 499, ...): writing it would give two
          // different items one identity. Only its dtype and shape are checked (declared below).
          continue;
        }
        if (!seen.insert(shard.offsets).second) {
          throw InvalidArgumentError("sharded tensor '" + fqn + "' has two local shards at " +
                                     ShapeToString(shard.offsets));
        }
        WriteItem item;
        item.index = {fqn, shard.offsets, {}};
        item.type = WriteItemType::kShard;
        item.dtype = st->dtype;
        item.global_shape = st->global_shape;
        item.chunk = {shard.offsets, shard.view.shape};
        item.size_bytes = shard.view.nbytes();
        plan.items.push_back(std::move(item));
      }
      if (seen.empty()) {
        // This rank holds none of the tensor (or only empty shards): declare it so that its dtype
        // and shape are still checked, and so that a tensor nobody holds any part of (legal only
        // when it has no elements) still appears in the checkpoint.
        plan.planner_data += EncodeSaveDeclaration(fqn, st->dtype, st->global_shape);
      }
    } else if (const auto* b = std::get_if<Blob>(&value)) {
      WriteItem item;
      item.index = {fqn, {}, {}};
      item.type = WriteItemType::kBytes;
      item.size_bytes = b->bytes.size();
      plan.items.push_back(std::move(item));
    }
  }
  return plan;
}

std::string EncodeSaveDeclaration(const std::string& fqn, DType dtype, const Shape& shape) {
  if (fqn.find_first_of("\t\n") != std::string::npos) {
    throw InvalidArgumentError("sharded tensor name '" + fqn + "' contains a tab or newline");
  }
  // Appended piece by piece: g++ 12 at -O3 reports a false -Wrestrict for `std::string + char`.
  std::string line = fqn;
  line.append(1, '\t').append(DTypeName(dtype)).append(1, '\t');
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) line.append(1, ',');
    line.append(std::to_string(shape[i]));
  }
  line.append(1, '\n');
  return line;
}

std::vector<SaveDeclaration> DecodeSaveDeclarations(std::string_view data) {
  std::vector<SaveDeclaration> out;
  size_t pos = 0;
  while (pos < data.size()) {
    size_t nl = data.find('\n', pos);
    if (nl == std::string_view::npos) nl = data.size();
    const std::string_view line = data.substr(pos, nl - pos);
    pos = nl + 1;
    auto bad = [&] {
      return CorruptionError("malformed tensor declaration '" + std::string(line) + "'");
    };
    const size_t t1 = line.find('\t');
    const size_t t2 = t1 == std::string_view::npos ? t1 : line.find('\t', t1 + 1);
    if (t2 == std::string_view::npos) throw bad();
    SaveDeclaration d;
    d.fqn = std::string(line.substr(0, t1));
    auto dtype = DTypeFromName(std::string(line.substr(t1 + 1, t2 - t1 - 1)));
    if (!dtype) throw bad();
    d.dtype = *dtype;
    const std::string_view dims = line.substr(t2 + 1);
    size_t p = 0;
    while (p < dims.size()) {
      size_t c = dims.find(',', p);
      if (c == std::string_view::npos) c = dims.size();
      int64_t v = 0;
      auto [end, ec] = std::from_chars(dims.data() + p, dims.data() + c, v);
      if (ec != std::errc() || end != dims.data() + c || v < 0) throw bad();
      d.shape.push_back(v);
      p = c + 1;
    }
    out.push_back(std::move(d));
  }
  return out;
}

namespace {

// Cost grows with ranks x items (millions at thousands of ranks), so each item is looked at a
// few times through flat arrays: its fqn is hashed once into a dense id, and the items of one
// fqn are grouped by sorting their chunk offsets (no tree keyed by fqn and offsets).
struct ItemRef {
  int rank;
  uint32_t item;
};

struct ItemsByFqn {
  std::unordered_map<std::string, uint32_t> ids;  // owns its keys: items are moved below
  std::vector<std::vector<uint32_t>> item_ids;    // [rank][item] -> id
  std::vector<std::vector<ItemRef>> by_fqn;       // id -> its items, rank-major
};

// What the metadata step knows of one fqn.
struct EntryState {
  EntryMetadata* entry = nullptr;
  int first_rank = -1;
  std::vector<int> ranks;  // of each chunk, for validation messages
};

ItemsByFqn IndexItemsByFqn(const std::vector<SavePlan>& plans) {
  ItemsByFqn index;
  index.item_ids.resize(plans.size());
  for (size_t r = 0; r < plans.size(); ++r) {
    index.item_ids[r].reserve(plans[r].items.size());
    for (size_t i = 0; i < plans[r].items.size(); ++i) {
      const std::string& fqn = plans[r].items[i].index.fqn;
      auto [it, fresh] = index.ids.try_emplace(fqn, static_cast<uint32_t>(index.by_fqn.size()));
      if (fresh) index.by_fqn.emplace_back();
      index.item_ids[r].push_back(it->second);
      index.by_fqn[it->second].push_back({static_cast<int>(r), static_cast<uint32_t>(i)});
    }
  }
  return index;
}

// Throw unless the holders refs[b, e) of one stored item hold the same thing.
void CheckHoldersAgree(const std::vector<SavePlan>& plans, const std::vector<ItemRef>& refs,
                       size_t b, size_t e) {
  const WriteItem& first = plans[refs[b].rank].items[refs[b].item];
  for (size_t k = b + 1; k < e; ++k) {
    const WriteItem& other = plans[refs[k].rank].items[refs[k].item];
    if (other.type != first.type || other.dtype != first.dtype || other.chunk != first.chunk ||
        other.global_shape != first.global_shape) {
      throw InvalidArgumentError(
          "item " + first.index.ToString() + " differs between ranks: rank " +
          std::to_string(refs[b].rank) + " has " + Describe(first.dtype, first.chunk.sizes) +
          " of " + ShapeToString(first.global_shape) + ", rank " + std::to_string(refs[k].rank) +
          " has " + Describe(other.dtype, other.chunk.sizes) + " of " +
          ShapeToString(other.global_shape));
    }
  }
}

// Step 1: the holders of each stored item that several ranks hold. An item one rank holds
// alone adds to that rank's `load` here.
std::vector<std::vector<ItemRef>> GroupByStoredIdentity(const std::vector<SavePlan>& plans,
                                                        ItemsByFqn& index,
                                                        std::vector<uint64_t>& load) {
  auto item = [&](const ItemRef& ref) -> const WriteItem& {
    return plans[ref.rank].items[ref.item];
  };
  std::vector<std::vector<ItemRef>>& by_fqn = index.by_fqn;
  // Ids in fqn order: the order of the stored items, which decides ties below.
  std::vector<uint32_t> fqn_order(by_fqn.size());
  std::iota(fqn_order.begin(), fqn_order.end(), 0u);
  std::sort(fqn_order.begin(), fqn_order.end(), [&](uint32_t a, uint32_t b) {
    return item(by_fqn[a][0]).index.fqn < item(by_fqn[b][0]).index.fqn;
  });
  std::vector<std::vector<ItemRef>> replicated;  // each: the holders of one stored item
  for (uint32_t id : fqn_order) {
    std::vector<ItemRef>& refs = by_fqn[id];
    std::stable_sort(refs.begin(), refs.end(), [&](const ItemRef& a, const ItemRef& b) {
      return item(a).index.offset < item(b).index.offset;
    });
    for (size_t b = 0; b < refs.size();) {
      size_t e = b + 1;
      while (e < refs.size() && item(refs[e]).index.offset == item(refs[b]).index.offset) ++e;
      CheckHoldersAgree(plans, refs, b, e);
      if (e - b == 1) {
        load[refs[b].rank] += item(refs[b]).size_bytes;
      } else {
        replicated.emplace_back(refs.begin() + b, refs.begin() + e);
      }
      b = e;
    }
  }
  return replicated;
}

// Step 2: each replicated item, largest first, is kept by its least-loaded holder. Returns
// drop[rank][item]: 1 for each copy not kept.
std::vector<std::vector<char>> PickHolders(const std::vector<SavePlan>& plans,
                                           std::vector<std::vector<ItemRef>> replicated,
                                           std::vector<uint64_t>& load) {
  auto item = [&](const ItemRef& ref) -> const WriteItem& {
    return plans[ref.rank].items[ref.item];
  };
  std::stable_sort(replicated.begin(), replicated.end(), [&](const auto& a, const auto& b) {
    return item(a[0]).size_bytes > item(b[0]).size_bytes;
  });
  std::vector<std::vector<char>> drop(plans.size());
  for (size_t r = 0; r < plans.size(); ++r) drop[r].assign(plans[r].items.size(), 0);
  for (const auto& holders : replicated) {
    const ItemRef* best = &holders[0];
    for (const auto& h : holders) {
      if (load[h.rank] < load[best->rank]) best = &h;
    }
    load[best->rank] += item(*best).size_bytes;
    for (const auto& h : holders) {
      if (&h != best) drop[h.rank][h.item] = 1;
    }
  }
  return drop;
}

// Record rank r's kept item `it` in its entry `st` (made on first sight), checking that it
// agrees with the ranks before, and number it among the entry's chunks.
void AddItemToEntry(WriteItem& it, size_t r, EntryState& st, Metadata& md) {
  const std::string& fqn = it.index.fqn;
  if (st.entry == nullptr) {
    st.first_rank = static_cast<int>(r);
    EntryMetadata fresh = it.is_tensor()
                              ? EntryMetadata(TensorMetadata{it.dtype, it.global_shape, {}})
                              : EntryMetadata(BytesMetadata{});
    st.entry = &md.entries.emplace(fqn, std::move(fresh)).first->second;
  }
  auto* t = std::get_if<TensorMetadata>(st.entry);
  if ((t != nullptr) != it.is_tensor()) {
    throw InvalidArgumentError("'" + fqn + "' is a tensor on one rank and a byte blob on " +
                               "another (ranks " + std::to_string(st.first_rank) + " and " +
                               std::to_string(r) + ")");
  }
  if (t == nullptr) {
    it.index.index = 0;
    std::get<BytesMetadata>(*st.entry).writer = static_cast<int32_t>(r);
    std::get<BytesMetadata>(*st.entry).size = it.size_bytes;
    return;
  }
  if (t->dtype != it.dtype || t->shape != it.global_shape) {
    throw InvalidArgumentError("tensor '" + fqn + "' disagrees across ranks: rank " +
                               std::to_string(st.first_rank) + " has " +
                               Describe(t->dtype, t->shape) + ", rank " + std::to_string(r) +
                               " has " + Describe(it.dtype, it.global_shape));
  }
  it.index.index = static_cast<int32_t>(t->chunks.size());
  t->chunks.push_back(it.chunk);
  t->chunk_writers.push_back(static_cast<int32_t>(r));
  st.ranks.push_back(static_cast<int>(r));
}

// Step 3a: the metadata entries of the kept items; the dropped ones leave the plans. Each
// rank's scratch (drop, item ids) is freed once its plan is done.
std::vector<EntryState> AddKeptItems(std::vector<SavePlan>& plans, ItemsByFqn& index,
                                     std::vector<std::vector<char>>& drop, Metadata& md) {
  std::vector<EntryState> entries(index.by_fqn.size());
  index.by_fqn.clear();
  index.by_fqn.shrink_to_fit();
  for (size_t r = 0; r < plans.size(); ++r) {
    // try_emplace: every rank lists the same paths, and a node is made only for a new one.
    for (const auto& [fqn, path] : plans[r].key_paths) md.key_paths.try_emplace(fqn, path);
    plans[r].key_paths.clear();  // in the metadata now; the rank's reply need not carry them
    std::vector<WriteItem>& items = plans[r].items;
    size_t kept = 0;
    for (size_t i = 0; i < items.size(); ++i) {
      if (drop[r][i]) continue;
      AddItemToEntry(items[i], r, entries[index.item_ids[r][i]], md);
      if (kept != i) items[kept] = std::move(items[i]);
      ++kept;
    }
    items.resize(kept);
    std::vector<char>().swap(drop[r]);
    std::vector<uint32_t>().swap(index.item_ids[r]);
  }
  return entries;
}

// Step 3b: sharded tensors that some rank declared without holding a shard.
void AddDeclaredTensors(std::vector<SavePlan>& plans, const Metadata* planned,
                        const std::unordered_map<std::string, uint32_t>& ids,
                        const std::vector<EntryState>& entries, Metadata& md) {
  std::map<std::string, int> declared_by;
  for (size_t r = 0; r < plans.size(); ++r) {
    for (const auto& d : DecodeSaveDeclarations(plans[r].planner_data)) {
      if (planned != nullptr) {
        if (auto known = planned->entries.find(d.fqn); known != planned->entries.end()) {
          const auto* t = std::get_if<TensorMetadata>(&known->second);
          if (t == nullptr || t->dtype != d.dtype || t->shape != d.shape) {
            throw InvalidArgumentError(
                "tensor '" + d.fqn + "' disagrees across ranks: rank 0 has " +
                (t ? Describe(t->dtype, t->shape) : std::string("a byte blob")) + ", rank " +
                std::to_string(r) + " has " + Describe(d.dtype, d.shape));
          }
          continue;
        }
      }
      auto [it, inserted] = md.entries.emplace(d.fqn, TensorMetadata{d.dtype, d.shape, {}});
      int first = static_cast<int>(r);
      if (!inserted) {
        auto known = ids.find(d.fqn);
        first = known != ids.end() ? entries[known->second].first_rank
                                   : declared_by.emplace(d.fqn, static_cast<int>(r)).first->second;
      } else {
        declared_by.emplace(d.fqn, static_cast<int>(r));
      }
      const auto* t = std::get_if<TensorMetadata>(&it->second);
      if (t == nullptr || t->dtype != d.dtype || t->shape != d.shape) {
        throw InvalidArgumentError(
            "tensor '" + d.fqn + "' disagrees across ranks: rank " + std::to_string(first) +
            " has " + (t ? Describe(t->dtype, t->shape) : std::string("a byte blob")) + ", rank " +
            std::to_string(r) + " has " + Describe(d.dtype, d.shape));
      }
    }
    plans[r].planner_data.clear();
  }
}

// Step 4: every tensor must be tiled exactly by its chunks.
void ValidateAllChunks(const Metadata& md, const std::unordered_map<std::string, uint32_t>& ids,
                       const std::vector<EntryState>& entries) {
  static const std::vector<int> kNoRanks;
  for (const auto& [fqn, entry] : md.entries) {
    const auto* t = std::get_if<TensorMetadata>(&entry);
    if (t == nullptr) continue;
    auto known = ids.find(fqn);
    ValidateChunks(fqn, t->shape, t->chunks,
                   known != ids.end() ? entries[known->second].ranks : kNoRanks);
  }
}

}  // namespace

std::pair<std::vector<SavePlan>, Metadata> DefaultSavePlanner::CreateGlobalPlan(
    std::vector<SavePlan> plans) {
  return CreateGlobalPlan(std::move(plans), {});
}

std::pair<std::vector<SavePlan>, Metadata> DefaultSavePlanner::CreateGlobalPlan(
    std::vector<SavePlan> plans, std::vector<uint64_t> base_load, const Metadata* planned) {
  if (!base_load.empty() && base_load.size() != plans.size()) {
    throw InvalidArgumentError("base load for " + std::to_string(base_load.size()) +
                               " ranks, plans of " + std::to_string(plans.size()));
  }
  ItemsByFqn index = IndexItemsByFqn(plans);
  // 1. Group items by stored identity (fqn + chunk offsets) across ranks.
  // 2. Dedup: every replicated item is kept by exactly one holder. Unique items load their
  //    rank first; then replicated items, largest first, go to the least-loaded holder.
  std::vector<uint64_t> load = std::move(base_load);
  load.resize(plans.size(), 0);
  std::vector<std::vector<ItemRef>> replicated = GroupByStoredIdentity(plans, index, load);
  std::vector<std::vector<char>> drop = PickHolders(plans, std::move(replicated), load);
  // 3. Build the metadata; all ranks must agree on each fqn's kind, dtype and global shape.
  Metadata md;
  const std::vector<EntryState> entries = AddKeptItems(plans, index, drop, md);
  AddDeclaredTensors(plans, planned, index.ids, entries, md);
  // 4. Every tensor must be tiled exactly by its chunks.
  ValidateAllChunks(md, index.ids, entries);
  return {std::move(plans), std::move(md)};
}

SavePlan DefaultSavePlanner::FinishPlan(SavePlan central_plan) { return central_plan; }

ResolvedData DefaultSavePlanner::ResolveData(const WriteItem& item) const {
  auto it = flat_.find(item.index.fqn);
  if (it == flat_.end()) {
    throw InternalError("save plan names '" + item.index.fqn + "', which is not in the state dict");
  }
  const StateValue& value = *it->second.value;
  ResolvedData out;
  if (const auto* t = std::get_if<TensorView>(&value)) {
    out.tensor = *t;
  } else if (const auto* st = std::get_if<ShardedTensor>(&value)) {
    for (const auto& shard : st->local_shards) {
      if (shard.offsets == item.index.offset) {
        out.tensor = shard.view;
        return out;
      }
    }
    throw InternalError("no local shard of '" + item.index.fqn + "' at " +
                        ShapeToString(item.index.offset));
  } else if (const auto* b = std::get_if<Blob>(&value)) {
    out.bytes = b->bytes;
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// DefaultLoadPlanner

void DefaultLoadPlanner::SetUp(StateDict& state_dict, const Metadata& metadata,
                               const PlannerContext& ctx) {
  if (options_.load_all) state_dict = StateDictFromMetadata(metadata);
  flat_ = FlattenStateDict(state_dict);
  metadata_ = &metadata;
  ctx_ = ctx;
}

namespace {

// The chunks of one tensor that this rank wants, in the global coordinates of the tensor.
struct WantedChunks {
  DType dtype = DType::kFloat32;
  Shape global;
  std::vector<ChunkMeta> chunks;
};

// Throw if two of `local` start at the same offsets.
void CheckDistinctOffsets(const std::string& fqn, const std::vector<ChunkMeta>& local) {
  if (local.size() <= 1) return;
  std::vector<const Shape*> starts;
  starts.reserve(local.size());
  for (const auto& c : local) starts.push_back(&c.offsets);
  std::sort(starts.begin(), starts.end(), [](const Shape* a, const Shape* b) { return *a < *b; });
  for (size_t i = 1; i < starts.size(); ++i) {
    if (*starts[i] == *starts[i - 1]) {
      throw InvalidArgumentError("sharded tensor '" + fqn + "' has two local shards at " +
                                 ShapeToString(*starts[i]));
    }
  }
}

// The chunks a state dict tensor or sharded tensor asks for, each checked.
WantedChunks WantedChunksOf(const std::string& fqn, const StateValue& value) {
  WantedChunks want;
  if (const auto* t = std::get_if<TensorView>(&value)) {
    CheckTensorView(fqn, *t);
    want.dtype = t->dtype;
    want.global = t->shape;
    want.chunks.push_back({Shape(t->shape.size(), 0), t->shape});
    return want;
  }
  const auto& st = std::get<ShardedTensor>(value);
  want.dtype = st.dtype;
  want.global = st.global_shape;
  const Shape& global = want.global;
  for (const auto& shard : st.local_shards) {
    CheckTensorView(fqn, shard.view);
    if (shard.view.dtype != st.dtype || shard.offsets.size() != global.size() ||
        shard.view.shape.size() != global.size()) {
      throw InvalidArgumentError("sharded tensor '" + fqn + "': local shard at " +
                                 ShapeToString(shard.offsets) + " (" + shard.view.ToString() +
                                 ") does not match " + Describe(st.dtype, global));
    }
    // A shard outside the shape, or a second shard at the same offsets, would be left
    // partly or wholly unfilled (ResolveTensor finds shards by their offsets).
    for (size_t d = 0; d < global.size(); ++d) {
      if (shard.offsets[d] < 0 || shard.offsets[d] > global[d] - shard.view.shape[d]) {
        throw InvalidArgumentError("sharded tensor '" + fqn + "': local shard at " +
                                   ShapeToString(shard.offsets) + " (" + shard.view.ToString() +
                                   ") lies outside " + Describe(st.dtype, global));
      }
    }
    want.chunks.push_back({shard.offsets, shard.view.shape});
  }
  CheckDistinctOffsets(fqn, want.chunks);
  return want;
}

// One ReadItem for each overlap of a wanted chunk with a saved one.
void AddTensorReads(const std::string& fqn, const WantedChunks& want, const TensorMetadata& saved,
                    bool naive_overlaps, std::vector<ReadItem>& out) {
  const Shape& global = want.global;
  std::optional<ChunkIndex> index;
  // A handful of saved chunks is scanned directly (same result, no index to build). A rule
  // names the overlapping chunks itself: the range of slices the wanted box spans along its
  // dimension, never a walk over every rank's chunk.
  constexpr size_t kIndexFrom = 16;
  if (!saved.regular && !naive_overlaps && !want.chunks.empty() &&
      saved.chunks.size() >= kIndexFrom) {
    index.emplace(saved.chunks);
  }
  if (saved.regular) {
    // Chunk k spans the whole tensor but along the rule's dimension, so a wanted box overlaps
    // the range of chunks its extent there reaches: one read of them all (a span, expanded per
    // chunk only when read), so that a box across every rank's chunk costs one item, not N.
    const size_t d = static_cast<size_t>(saved.regular->dim);
    const int64_t extent = saved.shape[d];
    for (const auto& dst : want.chunks) {
      if (dst.numel() == 0) continue;
      const int64_t start = dst.offsets[d], end = start + dst.sizes[d];
      auto [first, last] = RegularChunkRange(saved, start, end);
      if (first >= last) continue;
      const int64_t b = RegularSlice(extent, static_cast<int64_t>(first), saved.regular->world,
                                     saved.regular->rule)
                            .first;
      ReadItem item;
      item.type = ReadItemType::kTensor;
      item.dest_index = {fqn, dst.offsets, {}};
      Shape src(global.size(), 0);
      src[d] = b;
      item.storage_index = {fqn, std::move(src), static_cast<int32_t>(first)};
      item.lengths = dst.sizes;
      item.dest_offsets.assign(global.size(), 0);
      item.storage_offsets = dst.offsets;
      item.storage_offsets[d] = start - b;
      item.chunk_span = static_cast<uint32_t>(last - first);
      out.push_back(std::move(item));
    }
    return;
  }
  std::vector<size_t> hits;
  for (const auto& dst : want.chunks) {
    hits = index ? index->Overlapping(dst) : OverlappingChunksNaive(saved.chunks, dst);
    for (size_t ci : hits) {
      const ChunkMeta& src = saved.chunks[ci];
      auto overlap = Intersect(dst, src);
      if (!overlap) continue;
      ReadItem item;
      item.type = ReadItemType::kTensor;
      item.dest_index = {fqn, dst.offsets, {}};
      item.storage_index = {fqn, src.offsets, static_cast<int32_t>(ci)};
      item.lengths = overlap->sizes;
      item.dest_offsets.resize(global.size());
      item.storage_offsets.resize(global.size());
      for (size_t d = 0; d < global.size(); ++d) {
        item.dest_offsets[d] = overlap->offsets[d] - dst.offsets[d];
        item.storage_offsets[d] = overlap->offsets[d] - src.offsets[d];
      }
      out.push_back(std::move(item));
    }
  }
}

// The reads of one state dict entry from its saved entry, which must be of the same kind,
// dtype and global shape.
void AddEntryReads(const std::string& fqn, const StateValue& value, const EntryMetadata& entry,
                   const LoadPlannerOptions& options, std::vector<ReadItem>& out) {
  const auto* saved = std::get_if<TensorMetadata>(&entry);
  const bool want_tensor = !std::holds_alternative<Blob>(value);
  if ((saved != nullptr) != want_tensor) {
    throw InvalidArgumentError("'" + fqn + "' is " + KindName(value) + " in the state dict but " +
                               (saved ? "a tensor" : "a byte blob") + " in the checkpoint");
  }
  if (!want_tensor) {
    ReadItem item;
    item.type = ReadItemType::kBytes;
    item.dest_index = {fqn, {}, {}};
    item.storage_index = {fqn, {}, {}};
    out.push_back(std::move(item));
    return;
  }
  const WantedChunks want = WantedChunksOf(fqn, value);
  const bool castable = options.cast_dtypes && CanCastDType(saved->dtype, want.dtype);
  if ((want.dtype != saved->dtype && !castable) || want.global != saved->shape) {
    std::string hint;
    if (want.global == saved->shape && !options.cast_dtypes &&
        CanCastDType(saved->dtype, want.dtype)) {
      hint = " (pass cast_dtypes to convert on load)";
    }
    throw InvalidArgumentError("tensor '" + fqn + "': the checkpoint has " +
                               Describe(saved->dtype, saved->shape) + ", the state dict asks for " +
                               Describe(want.dtype, want.global) + hint);
  }
  AddTensorReads(fqn, want, *saved, options.naive_overlaps, out);
}

[[noreturn]] void ThrowMissingKeys(const std::vector<std::string>& missing) {
  std::ostringstream os;
  os << missing.size() << " requested key" << (missing.size() == 1 ? " is" : "s are")
     << " not in the checkpoint:";
  for (size_t i = 0; i < missing.size() && i < 20; ++i) os << " '" << missing[i] << "'";
  if (missing.size() > 20) os << " ...";
  os << " (pass allow_partial_load to skip missing keys)";
  throw NotFoundError(os.str());
}

}  // namespace

LoadPlan DefaultLoadPlanner::CreateLocalPlan() {
  LoadPlan plan;
  std::vector<std::string> missing;
  for (auto& [fqn, entry] : flat_) {
    auto md_it = metadata_->entries.find(fqn);
    if (md_it == metadata_->entries.end()) {
      if (!options_.allow_partial_load) missing.push_back(fqn);
      continue;
    }
    AddEntryReads(fqn, *entry.value, md_it->second, options_, plan.items);
  }
  if (!missing.empty()) ThrowMissingKeys(missing);
  extra_keys_.clear();
  for (const auto& [fqn, entry] : metadata_->entries) {
    if (!flat_.count(fqn)) extra_keys_.push_back(fqn);
  }
  return plan;
}

std::vector<LoadPlan> DefaultLoadPlanner::CreateGlobalPlan(std::vector<LoadPlan> all_plans) {
  return all_plans;
}

LoadPlan DefaultLoadPlanner::FinishPlan(LoadPlan central_plan) { return central_plan; }

void DefaultLoadPlanner::LoadBytes(const ReadItem& item, std::string bytes) {
  auto it = flat_.find(item.dest_index.fqn);
  Blob* blob = it == flat_.end() ? nullptr : std::get_if<Blob>(it->second.value);
  if (blob == nullptr) throw InternalError("no blob named '" + item.dest_index.fqn + "'");
  blob->bytes = std::move(bytes);
}

TensorView DefaultLoadPlanner::Destination(const ReadItem& item) const {
  auto it = flat_.find(item.dest_index.fqn);
  if (it == flat_.end()) throw InternalError("no tensor named '" + item.dest_index.fqn + "'");
  const StateValue& value = *it->second.value;
  if (auto* t = std::get_if<TensorView>(&value)) return t->Narrow(item.dest_offsets, item.lengths);
  if (auto* st = std::get_if<ShardedTensor>(&value)) {
    for (const auto& shard : st->local_shards) {
      if (shard.offsets == item.dest_index.offset) {
        return shard.view.Narrow(item.dest_offsets, item.lengths);
      }
    }
  }
  throw InternalError("no local chunk " + item.dest_index.ToString());
}

// A destination of another dtype than the stored one (cast_dtypes) is read into host memory of
// the stored dtype, converted into the destination at CommitTensor.
TensorView DefaultLoadPlanner::ResolveTensor(const ReadItem& item) {
  TensorView dst = Destination(item);
  auto entry = metadata_->entries.find(item.storage_index.fqn);
  const auto* saved =
      entry == metadata_->entries.end() ? nullptr : std::get_if<TensorMetadata>(&entry->second);
  if (saved == nullptr || saved->dtype == dst.dtype) return dst;
  TensorView staged = TensorView::Allocate(saved->dtype, item.lengths);
  std::lock_guard<std::mutex> lock(casts_mu_);
  casts_[staged.data] = {staged, dst};
  return staged;
}

void DefaultLoadPlanner::CommitTensor(const ReadItem& item, const TensorView& tensor) {
  std::pair<TensorView, TensorView> cast;
  {
    std::lock_guard<std::mutex> lock(casts_mu_);
    auto it = casts_.find(tensor.data);
    if (it == casts_.end()) return;
    cast = std::move(it->second);
    casts_.erase(it);
  }
  try {
    CastTensor(cast.second, cast.first);
  } catch (const DeviceError& e) {
    throw DeviceError("tensor '" + item.dest_index.fqn + "': " + e.what());
  }
}

StateDict StateDictFromMetadata(const Metadata& metadata) {
  StateDict sd;
  for (const auto& [fqn, entry] : metadata.entries) {
    KeyPath path;
    if (auto it = metadata.key_paths.find(fqn); it != metadata.key_paths.end()) {
      path = it->second;
    } else {
      for (size_t pos = 0;;) {
        const size_t dot = fqn.find('.', pos);
        path.push_back(fqn.substr(pos, dot == std::string::npos ? dot : dot - pos));
        if (dot == std::string::npos) break;
        pos = dot + 1;
      }
    }
    if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
      // The data files were checked to hold what the metadata claims (StorageReader::
      // ReadMetadata), so this allocates only what the checkpoint backs; it may still exceed
      // this machine's memory, which is reported naming the entry, not as a bare bad_alloc.
      const uint64_t bytes = static_cast<uint64_t>(NumElements(t->shape)) * ElementSize(t->dtype);
      std::string where = "entry '" + fqn + "'";
      if (auto it = metadata.storage.lower_bound(MetadataIndex{fqn, {}, {}});
          it != metadata.storage.end() && it->first.fqn == fqn) {
        where += " (stored in '" + it->second.relative_path + "')";
      }
      InsertAtPath(
          sd, path,
          AllocateOrThrow([&] { return TensorView::Allocate(t->dtype, t->shape); }, where, bytes));
    } else {
      InsertAtPath(sd, path, Blob{});
    }
  }
  return sd;
}

}  // namespace dcp
