#include "dcp/planner/rule_reads.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <tuple>
#include <unordered_map>
#include <unordered_set>

namespace dcp {

namespace {

uint64_t SatMul(uint64_t a, uint64_t b) {
  return b != 0 && a > UINT64_MAX / b ? UINT64_MAX : a * b;
}

// Order-dependent fold (the splitmix64 finalizer over the sum).
uint64_t Fold(uint64_t h, uint64_t v) {
  uint64_t z = h + v + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Whether every rank of `world` holds a non-empty slice of `extent` under `rule`, so that every
// rank reads the tensor and finds it (the coordinator compares tables).
bool EverySliceHolds(int64_t extent, int64_t world, RegularRule rule) {
  if (extent < world) return false;
  if (rule == kRuleBalanced) return true;
  const int64_t c = (extent + world - 1) / world;
  return (world - 1) * c < extent;
}

// Whether a partial read of a chunk cut along `d` is one contiguous range of it for a box cut
// along `d` too: no dimension before d has more than one unit.
bool LeadingUnits(const Shape& shape, size_t d) {
  for (size_t j = 0; j < d; ++j) {
    if (shape[j] != 1) return false;
  }
  return true;
}

// The dimension along which the box [lo, lo + len) is not the whole tensor, if exactly one.
std::optional<size_t> OnlyCutDimension(const Shape& shape, const Shape& lo, const Shape& len) {
  std::optional<size_t> cut;
  for (size_t j = 0; j < shape.size(); ++j) {
    if (lo[j] == 0 && len[j] == shape[j]) continue;
    if (cut) return std::nullopt;
    cut = j;
  }
  return cut;
}

}  // namespace

std::optional<RegularRule> RuleExchangeOrder(const std::vector<ReadRequestSummary>& summaries) {
  auto all_equal = [&](uint64_t ReadRequestSummary::*hash) {
    const uint64_t h = summaries.empty() ? 0 : summaries[0].*hash;
    return summaries.size() >= 2 && h != 0 &&
           std::all_of(summaries.begin(), summaries.end(),
                       [&](const ReadRequestSummary& s) { return s.can_share && s.*hash == h; });
  };
  if (all_equal(&ReadRequestSummary::rule_hash)) return kRuleBalanced;
  if (all_equal(&ReadRequestSummary::rule_hash_ceil_first)) return kRuleCeil;
  return std::nullopt;
}

LoadPlan WithoutItems(const LoadPlan& plan, const std::vector<char>& served) {
  LoadPlan rest;
  rest.storage_data = plan.storage_data;
  rest.planner_data = plan.planner_data;
  for (size_t i = 0; i < plan.items.size(); ++i) {
    if (i >= served.size() || served[i] == 0) rest.items.push_back(plan.items[i]);
  }
  return rest;
}

RuleSlicer RuleSlicer::Of(int64_t extent, int64_t world, RegularRule rule) {
  RuleSlicer s;
  s.extent = extent;
  s.world = std::max<int64_t>(world, 1);
  s.rule = rule;
  s.base = extent / s.world;
  s.extra = extent % s.world;
  s.ceil = (extent + s.world - 1) / s.world;
  return s;
}

int64_t RuleSlicer::Holding(int64_t u) const {
  if (rule == kRuleCeil) return ceil > 0 ? u / ceil : 0;
  const int64_t head = extra * (base + 1);  // units in the first `extra` (longer) slices
  if (u < head) return u / (base + 1);
  return base > 0 ? extra + (u - head) / base : extra;
}

RuleRead MakeRuleRead(uint32_t item, uint32_t entry, const std::string& fqn,
                      const TensorMetadata& saved, RegularLayout load) {
  RuleRead read;
  read.item = item;
  read.entry = entry;
  read.fqn = &fqn;
  read.saved = &saved;
  read.load = load;
  read.esize = ElementSize(saved.dtype);
  const auto ds = static_cast<size_t>(saved.regular->dim);
  const auto dl = static_cast<size_t>(load.dim);
  read.cross_elems = 1;
  for (size_t j = 0; j < saved.shape.size(); ++j) {
    if (j != ds && j != dl) read.cross_elems *= static_cast<uint64_t>(saved.shape[j]);
  }
  read.stored = RuleSlicer::Of(saved.shape[ds], saved.regular->world, saved.regular->rule);
  read.loaded = RuleSlicer::Of(saved.shape[dl], load.world, load.rule);
  read.chunks = static_cast<int64_t>(ChunkCount(saved));
  const size_t a = std::min(ds, dl), b = std::max(ds, dl);
  for (size_t j = 0; j < saved.shape.size(); ++j) {
    const auto v = static_cast<uint64_t>(saved.shape[j]);
    if (j < a) {
      read.outer *= v;
    } else if (j > a && j < b) {
      read.middle *= v;
    } else if (j > b) {
      read.inner *= v;
    }
  }
  return read;
}

RuleOwnerMap::RuleOwnerMap(int64_t saved_world, int world) : first_(world + 1) {
  for (int o = 0; o <= world; ++o) first_[o] = (o * saved_world + world - 1) / world;
}

uint64_t RuleOwnerBoundBytes(const RuleRead& read, int64_t saved_world, int world) {
  const TensorMetadata& t = *read.saved;
  const auto ds = static_cast<size_t>(t.regular->dim);
  const auto [lo, hi] = RegularSlice(t.shape[ds], 0, t.regular->world, t.regular->rule);
  const int64_t writers = (saved_world + world - 1) / world;
  const auto units = static_cast<uint64_t>(std::min(t.shape[ds], (hi - lo) * writers));
  uint64_t unit_bytes = read.esize;
  for (size_t j = 0; j < t.shape.size(); ++j) {
    if (j != ds) unit_bytes = SatMul(unit_bytes, static_cast<uint64_t>(t.shape[j]));
  }
  return SatMul(units, unit_bytes);
}

RuleReadTable FindRuleReads(const LoadPlan& plan, const Metadata& md, int rank, int world,
                            uint64_t round_bytes, RegularRule first) {
  RuleReadTable table;
  if (md.format_version < 2 || world < 2 || md.world_size <= 0) return table;
  std::unordered_map<std::string_view, uint32_t> ordinal;
  ordinal.reserve(md.entries.size());
  for (const auto& [fqn, entry] : md.entries) {
    ordinal.emplace(fqn, static_cast<uint32_t>(ordinal.size()));
  }
  std::unordered_set<uint32_t> seen;
  for (size_t i = 0; i < plan.items.size(); ++i) {
    const ReadItem& item = plan.items[i];
    if (item.type != ReadItemType::kTensor) continue;
    const auto e = md.entries.find(item.storage_index.fqn);
    if (e == md.entries.end()) continue;
    const auto* t = std::get_if<TensorMetadata>(&e->second);
    const size_t n = t == nullptr ? 0 : t->shape.size();
    if (t == nullptr || !t->regular || n == 0 || item.lengths.size() != n ||
        item.storage_offsets.size() != n || item.storage_index.offset.size() != n) {
      continue;
    }
    Shape lo(n);
    for (size_t j = 0; j < n; ++j) lo[j] = item.storage_index.offset[j] + item.storage_offsets[j];
    const std::optional<size_t> d = OnlyCutDimension(t->shape, lo, item.lengths);
    if (!d) continue;
    std::optional<RegularRule> rule;
    const RegularRule second = first == kRuleBalanced ? kRuleCeil : kRuleBalanced;
    for (RegularRule r : {first, second}) {
      if (EverySliceHolds(t->shape[*d], world, r) &&
          RegularSlice(t->shape[*d], rank, world, r) ==
              std::make_pair(lo[*d], lo[*d] + item.lengths[*d])) {
        rule = r;
        break;
      }
    }
    if (!rule) continue;
    // Where both rules cut every rank alike (the extent divides, or leaves one short slice), the
    // table says kRuleBalanced whichever was checked first: the two tables then hash alike.
    const int64_t extra = t->shape[*d] % world;
    if (extra == 0 || extra == world - 1) rule = kRuleBalanced;
    const RegularLayout load{static_cast<int32_t>(*d), *rule, world};
    const auto ds = static_cast<size_t>(t->regular->dim);
    if (load == *t->regular || (ds == *d && LeadingUnits(t->shape, ds))) continue;
    const RuleRead read =
        MakeRuleRead(static_cast<uint32_t>(i), ordinal.at(e->first), e->first, *t, load);
    if (RuleOwnerBoundBytes(read, md.world_size, world) > round_bytes) continue;
    if (!seen.insert(read.entry).second) continue;
    table.reads.push_back(read);
  }
  std::sort(table.reads.begin(), table.reads.end(),
            [](const RuleRead& a, const RuleRead& b) { return a.entry < b.entry; });
  if (table.reads.empty()) return table;
  uint64_t h = Fold(Fold(Fold(0, static_cast<uint64_t>(world)), round_bytes),
                    static_cast<uint64_t>(md.world_size));
  for (const RuleRead& r : table.reads) {
    h = Fold(h, (uint64_t{r.entry} << 16) | (static_cast<uint64_t>(r.load.dim) << 8) | r.load.rule);
  }
  table.hash = h == 0 ? 1 : h;
  return table;
}

std::vector<size_t> RuleRounds(const std::vector<RuleRead>& reads, int64_t saved_world, int world,
                               uint64_t round_bytes) {
  std::vector<size_t> starts;
  uint64_t used = 0;
  for (size_t i = 0; i < reads.size(); ++i) {
    const uint64_t b = RuleOwnerBoundBytes(reads[i], saved_world, world);
    if (starts.empty() || used > round_bytes - std::min(b, round_bytes)) {
      starts.push_back(i);
      used = 0;
    }
    used += std::min(b, round_bytes);
  }
  return starts;
}

std::vector<uint64_t> RuleMessageBytes(const std::vector<RuleRead>& reads, size_t b, size_t e,
                                       const RuleOwnerMap& owners, int owner, int64_t f,
                                       int world) {
  // Geometry -> (a read of it, how many reads share it).
  using Key = std::tuple<std::vector<int64_t>, int32_t, int32_t, int32_t, int32_t, int32_t, size_t>;
  std::map<Key, std::pair<const RuleRead*, uint64_t>> kinds;
  for (size_t i = b; i < e; ++i) {
    const RuleRead& r = reads[i];
    const RegularLayout& s = *r.saved->regular;
    auto [it, fresh] = kinds.try_emplace(
        Key{r.saved->shape, s.dim, s.rule, s.world, r.load.dim, r.load.rule, r.esize}, &r, 0);
    it->second.second += 1;
  }
  std::vector<uint64_t> bytes(world, 0);
  for (const auto& [key, kind] : kinds) {
    const auto& [read, times] = kind;
    if (f >= 0) {
      for (int o = 0; o < world; ++o) {
        ForEachRulePiece(*read, owners, o, f,
                         [&](const RulePiece& p) { bytes[o] += p.bytes * times; });
      }
    } else {
      ForEachRulePiece(*read, owners, owner, -1,
                       [&](const RulePiece& p) { bytes[p.f] += p.bytes * times; });
    }
  }
  return bytes;
}

RulePiece RulePieceOf(const RuleRead& read, int64_t w, int64_t f) {
  RulePiece p;
  p.w = w;
  p.f = f;
  std::tie(p.chunk_lo, p.chunk_hi) = read.stored.Slice(w);
  std::tie(p.slice_lo, p.slice_hi) = read.loaded.Slice(f);
  p.bytes = RulePieceBytes(read, p);
  return p;
}

void RulePieceBox(const RuleRead& read, const RulePiece& piece, bool holder_is_chunk, Shape& off,
                  Shape& len) {
  const auto ds = static_cast<size_t>(read.saved->regular->dim);
  const auto dl = static_cast<size_t>(read.load.dim);
  off.assign(read.saved->shape.size(), 0);
  len = read.saved->shape;
  if (ds == dl) {
    const int64_t lo = std::max(piece.chunk_lo, piece.slice_lo);
    const int64_t hi = std::min(piece.chunk_hi, piece.slice_hi);
    off[ds] = lo - (holder_is_chunk ? piece.chunk_lo : piece.slice_lo);
    len[ds] = hi - lo;
    return;
  }
  off[ds] = holder_is_chunk ? 0 : piece.chunk_lo;
  len[ds] = piece.chunk_hi - piece.chunk_lo;
  off[dl] = holder_is_chunk ? piece.slice_lo : 0;
  len[dl] = piece.slice_hi - piece.slice_lo;
}

void CopyRulePiece(const RuleRead& read, const RulePiece& piece, char* holder, bool holder_is_chunk,
                   char* packed, bool to_packed) {
  const int64_t ds = read.saved->regular->dim, dl = read.load.dim;
  const size_t a_dim = static_cast<size_t>(std::min(ds, dl));
  const Shape& shape = read.saved->shape;
  // The piece along the stored and the load dimension, in tensor coordinates, and where the
  // holder starts along each (it is cut along the stored one if a chunk, the load one if a slice).
  int64_t s_lo = piece.chunk_lo, s_hi = piece.chunk_hi;
  int64_t l_lo = piece.slice_lo, l_hi = piece.slice_hi;
  if (ds == dl) {
    s_lo = l_lo = std::max(piece.chunk_lo, piece.slice_lo);
    s_hi = l_hi = std::min(piece.chunk_hi, piece.slice_hi);
  }
  const int64_t origin_s = holder_is_chunk ? piece.chunk_lo : (ds == dl ? piece.slice_lo : 0);
  const int64_t origin_l = holder_is_chunk ? (ds == dl ? piece.chunk_lo : 0) : piece.slice_lo;
  const int64_t extent_s = holder_is_chunk ? piece.chunk_hi - piece.chunk_lo
                                           : (ds == dl ? piece.slice_hi - piece.slice_lo
                                                       : shape[static_cast<size_t>(ds)]);
  const int64_t extent_l = holder_is_chunk ? (ds == dl ? extent_s : shape[static_cast<size_t>(dl)])
                                           : piece.slice_hi - piece.slice_lo;
  // [outer, A, middle, B, inner] in the holder, the box [a_off, +a_len) x [b_off, +b_len).
  const bool a_is_s = static_cast<size_t>(ds) == a_dim;
  const auto ha = static_cast<uint64_t>(a_is_s ? extent_s : extent_l);
  const auto hb = static_cast<uint64_t>(ds == dl ? 1 : (a_is_s ? extent_l : extent_s));
  const auto a_off = static_cast<uint64_t>(a_is_s ? s_lo - origin_s : l_lo - origin_l);
  const auto a_len = static_cast<uint64_t>(a_is_s ? s_hi - s_lo : l_hi - l_lo);
  const auto b_off =
      static_cast<uint64_t>(ds == dl ? 0 : (a_is_s ? l_lo - origin_l : s_lo - origin_s));
  const auto b_len = static_cast<uint64_t>(ds == dl ? 1 : (a_is_s ? l_hi - l_lo : s_hi - s_lo));
  const uint64_t es = read.esize, in = read.inner, mid = read.middle;
  // Runs of b_len x inner elements; consecutive ones merge where the box holds B and middle whole.
  uint64_t run = b_len * in * es;
  uint64_t runs_per_a = mid;
  if (b_len == hb) {
    run *= mid;
    runs_per_a = 1;
  }
  const bool whole_a = b_len == hb && a_len == ha;
  for (uint64_t o = 0; o < read.outer; ++o) {
    if (whole_a) {  // the outer index's whole block
      const uint64_t at = o * ha * mid * hb * in * es;
      const uint64_t n = ha * mid * hb * in * es;
      to_packed ? std::memcpy(packed, holder + at, n) : std::memcpy(holder + at, packed, n);
      packed += n;
      continue;
    }
    for (uint64_t a = a_off; a < a_off + a_len; ++a) {
      if (runs_per_a == 1) {
        const uint64_t at = ((o * ha + a) * mid * hb + b_off) * in * es;
        if (b_len == hb) {  // middle and B whole: one run per index of A, merged below
          const uint64_t n = a_len * run;
          to_packed ? std::memcpy(packed, holder + at, n) : std::memcpy(holder + at, packed, n);
          packed += n;
          break;
        }
        to_packed ? std::memcpy(packed, holder + at, run) : std::memcpy(holder + at, packed, run);
        packed += run;
        continue;
      }
      for (uint64_t m = 0; m < mid; ++m) {
        const uint64_t at = (((o * ha + a) * mid + m) * hb + b_off) * in * es;
        to_packed ? std::memcpy(packed, holder + at, run) : std::memcpy(holder + at, packed, run);
        packed += run;
      }
    }
  }
}

}  // namespace dcp
