#include "dcp/planner/compact_plan.h"

#include <algorithm>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "dcp/planner/default_planner.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"

namespace dcp {

namespace {

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetU64(std::string_view s) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[static_cast<size_t>(i)]);
  return v;
}

// The rules (bits) a slice [begin, begin + size) of `extent` matches for `rank` of `world`.
uint8_t MatchingRules(int64_t begin, int64_t size, int64_t extent, int rank, int world) {
  uint8_t rules = 0;
  for (RegularRule rule : {kRuleBalanced, kRuleCeil}) {
    if (rule == kRuleCeil) {
      const int64_t c = (extent + world - 1) / world;
      if ((world - 1) * c >= extent) continue;  // some rank's slice would be empty
    }
    auto [b, e] = RegularSlice(extent, rank, world, rule);
    if (b == begin && e - b == size) rules |= rule;
  }
  return rules;
}

// Order-dependent combination of the shard hashes (the splitmix64 finalizer over the sum).
uint64_t FoldHash(uint64_t h, uint64_t shard) {
  uint64_t z = h + shard + 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Whether rank `rank` holds a non-empty slice of a regular shard (see the header).
bool Holds(const PlanSplit::Regular& reg, int rank) { return rank < reg.extent; }

// Hash of what must be the same on every rank about a tensor: its fqn, dtype, global shape and
// key path, and for a regular shard the dimension it is split along (-1: a declaration).
uint64_t DescriptionHash(const SavePlan& local, const std::string& fqn, DType dtype,
                         const Shape& shape, int dim) {
  std::string desc = fqn;
  desc.push_back('\0');
  desc.push_back(static_cast<char>(dtype));
  desc.push_back(static_cast<char>(dim));
  PutU64(desc, shape.size());
  for (int64_t s : shape) PutU64(desc, static_cast<uint64_t>(s));
  if (auto p = local.key_paths.find(fqn); p != local.key_paths.end()) {
    PutU64(desc, p->second.size());
    for (const auto& part : p->second) {
      PutU64(desc, part.size());
      desc.append(part);
    }
  } else {
    PutU64(desc, ~uint64_t{0});
  }
  const uint64_t a = Crc32c(0, desc.data(), desc.size());
  const uint64_t b = Crc32c(0x9E3779B9u, desc.data(), desc.size());
  return ((a << 32) | b) ^ (static_cast<uint64_t>(desc.size()) * 0x9E3779B97F4A7C15ull);
}

}  // namespace

PlanSplit SplitRegularShards(const SavePlan& local, int rank, int world, bool hash_declarations) {
  PlanSplit split;
  split.residual.storage_data = local.storage_data;
  split.residual.planner_data = local.planner_data;
  std::vector<char> regular(local.items.size(), 0);
  if (world >= 2) {
    // An fqn with several items on this rank is not regular (its chunks would be split between
    // the regular description and the residual).
    std::unordered_map<std::string_view, uint32_t> count;
    count.reserve(local.items.size());
    for (const auto& item : local.items) ++count[item.index.fqn];
    for (size_t i = 0; i < local.items.size(); ++i) {
      const WriteItem& it = local.items[i];
      const size_t ndim = it.global_shape.size();
      if (it.type != WriteItemType::kShard || count[it.index.fqn] != 1 || ndim == 0 ||
          it.chunk.offsets.size() != ndim || it.chunk.sizes.size() != ndim ||
          it.index.offset != it.chunk.offsets) {
        continue;
      }
      int dim = -1;
      bool ok = true;
      for (size_t d = 0; d < ndim && ok; ++d) {
        if (it.chunk.offsets[d] == 0 && it.chunk.sizes[d] == it.global_shape[d]) continue;
        ok = dim < 0;
        dim = static_cast<int>(d);
      }
      if (!ok || dim < 0 || it.chunk.sizes[dim] <= 0) continue;
      const uint8_t rules = MatchingRules(it.chunk.offsets[dim], it.chunk.sizes[dim],
                                          it.global_shape[dim], rank, world);
      if (rules == 0) continue;
      regular[i] = 1;
      PlanSplit::Regular reg;
      reg.item = static_cast<uint32_t>(i);
      reg.dim = dim;
      reg.rules = rules;
      reg.extent = it.global_shape[dim];
      reg.hash = DescriptionHash(local, it.index.fqn, it.dtype, it.global_shape, dim);
      reg.declared_hash = DescriptionHash(local, it.index.fqn, it.dtype, it.global_shape, -1);
      split.hash = FoldHash(split.hash, reg.hash);
      split.regular.push_back(reg);
    }
  }
  // Declarations that may be this rank's empty slices of short regular tensors (some dimension
  // of at most `rank` units, and elements to hold) go into declared_hash, with their key paths.
  split.declarations_hashed = hash_declarations && world >= 2;
  std::vector<SaveDeclaration> hashed;
  if (split.declarations_hashed && !local.planner_data.empty()) {
    std::string rest;
    for (SaveDeclaration& d : DecodeSaveDeclarations(local.planner_data)) {
      const bool may_be_short =
          NumElements(d.shape) > 0 &&
          std::any_of(d.shape.begin(), d.shape.end(), [&](int64_t n) { return n <= rank; });
      if (may_be_short) {
        split.declared_hash =
            FoldHash(split.declared_hash, DescriptionHash(local, d.fqn, d.dtype, d.shape, -1));
        hashed.push_back(std::move(d));
      } else {
        rest += EncodeSaveDeclaration(d.fqn, d.dtype, d.shape);
      }
    }
    split.residual.planner_data = std::move(rest);
  }

  split.residual.items.reserve(local.items.size() - split.regular.size());
  for (size_t i = 0; i < local.items.size(); ++i) {
    if (!regular[i]) split.residual.items.push_back(local.items[i]);
  }
  // Key paths of regular and hashed fqns are covered by the hashes (the coordinator uses its
  // own).
  std::unordered_set<std::string_view> covered;
  for (const auto& reg : split.regular) covered.insert(local.items[reg.item].index.fqn);
  for (const auto& d : hashed) covered.insert(d.fqn);
  for (const auto& [fqn, path] : local.key_paths) {
    if (!covered.count(fqn)) {
      split.residual.key_paths.emplace_hint(split.residual.key_paths.end(), fqn, path);
    }
  }
  return split;
}

std::string EncodeCompactSavePlan(const PlanSplit& split) {
  std::string out;
  PutU64(out, split.hash);
  out.push_back(split.declarations_hashed ? 1 : 0);
  PutU64(out, split.declared_hash);
  PutU64(out, split.regular.size());
  for (const auto& reg : split.regular) out.push_back(static_cast<char>(reg.rules));
  out += EncodeSavePlan(split.residual);
  return out;
}

CompactSavePlan DecodeCompactSavePlan(std::string_view bytes, int rank) {
  auto corrupt = [&] {
    return CorruptionError("rank " + std::to_string(rank) + " sent a malformed compact save plan");
  };
  constexpr size_t kHeader = 8 + 1 + 8 + 8;
  if (bytes.size() < kHeader || static_cast<uint8_t>(bytes[8]) > 1) throw corrupt();
  CompactSavePlan out;
  out.hash = GetU64(bytes);
  out.declarations_hashed = bytes[8] == 1;
  out.declared_hash = GetU64(bytes.substr(9));
  const uint64_t n = GetU64(bytes.substr(17));
  if (n > bytes.size() - kHeader) throw corrupt();
  const auto rules = bytes.substr(kHeader, n);
  out.rules.assign(rules.begin(), rules.end());
  out.residual = DecodeSavePlan(bytes.substr(kHeader + n));
  return out;
}

RegularAgreement AgreeOnRegularShards(const SavePlan& local, const PlanSplit& mine,
                                      const std::vector<CompactSavePlan>& got) {
  RegularAgreement differ;
  const int world = static_cast<int>(got.size());
  // The ranks fall into few classes by which shards they hold (all, for ranks beyond the
  // largest extent below the world): each class's expected hashes are computed once.
  std::vector<int64_t> cuts;  // the distinct extents < world, ascending
  for (const auto& reg : mine.regular) {
    if (reg.extent < world) cuts.push_back(reg.extent);
  }
  std::sort(cuts.begin(), cuts.end());
  cuts.erase(std::unique(cuts.begin(), cuts.end()), cuts.end());
  struct Expected {
    uint64_t held = 0, declared = 0;
  };
  std::vector<std::optional<Expected>> expected(cuts.size() + 1);
  std::vector<uint8_t> common(mine.regular.size(), kRuleBalanced | kRuleCeil);
  bool declarations_differ = false;
  for (int r = 0; r < world; ++r) {
    const auto cls =
        static_cast<size_t>(std::upper_bound(cuts.begin(), cuts.end(), r) - cuts.begin());
    if (!expected[cls]) {
      Expected e;
      for (const auto& reg : mine.regular) {
        if (Holds(reg, r)) {
          e.held = FoldHash(e.held, reg.hash);
        } else {
          e.declared = FoldHash(e.declared, reg.declared_hash);
        }
      }
      expected[cls] = e;
    }
    const CompactSavePlan& p = got[static_cast<size_t>(r)];
    if (p.hash != expected[cls]->held) return differ;
    if (p.declarations_hashed && p.declared_hash != expected[cls]->declared) {
      declarations_differ = true;
    }
    size_t next = 0;
    for (size_t i = 0; i < common.size(); ++i) {
      if (!Holds(mine.regular[i], r)) continue;
      if (next == p.rules.size()) return differ;
      common[i] &= p.rules[next++];
    }
    if (next != p.rules.size()) return differ;
  }
  // A rank that holds a regular fqn describes it as regular or its hash differs (a second item
  // of that fqn makes neither regular), so only ranks beyond a short tensor's extent can name a
  // regular fqn in their residual: a copy of some unit, which full planning deduplicates.
  if (!cuts.empty()) {
    std::unordered_set<std::string_view> short_fqns;
    for (const auto& reg : mine.regular) {
      if (reg.extent < world) short_fqns.insert(local.items[reg.item].index.fqn);
    }
    for (size_t r = static_cast<size_t>(cuts.front()); r < got.size(); ++r) {
      for (const auto& item : got[r].residual.items) {
        if (short_fqns.count(item.index.fqn)) return differ;
      }
    }
  }
  RegularAgreement out;
  out.rules.resize(common.size());
  for (size_t i = 0; i < common.size(); ++i) {
    if (common[i] & kRuleBalanced) {
      out.rules[i] = kRuleBalanced;
    } else if (common[i] & kRuleCeil) {
      out.rules[i] = kRuleCeil;
    } else {
      return differ;
    }
  }
  out.outcome =
      declarations_differ ? RegularAgreement::kDeclarationsDiffer : RegularAgreement::kAgreed;
  return out;
}

std::vector<uint64_t> RegularBytesPerRank(const SavePlan& local, const PlanSplit& split,
                                          const std::vector<RegularRule>& rules, int world) {
  std::vector<uint64_t> bytes(static_cast<size_t>(world), 0);
  for (size_t k = 0; k < split.regular.size(); ++k) {
    const auto& reg = split.regular[k];
    const WriteItem& it = local.items[reg.item];
    const int64_t extent = it.global_shape[reg.dim];
    // Bytes of one unit along the split dimension.
    const uint64_t unit =
        static_cast<uint64_t>(NumElements(it.global_shape) / extent) * ElementSize(it.dtype);
    for (int r = 0; r < world; ++r) {
      auto [b, e] = RegularSlice(extent, r, world, rules[k]);
      bytes[static_cast<size_t>(r)] += static_cast<uint64_t>(e - b) * unit;
    }
  }
  return bytes;
}

void AddRegularEntries(const SavePlan& local, const PlanSplit& split,
                       const std::vector<RegularRule>& rules, int world, Metadata& md) {
  for (size_t k = 0; k < split.regular.size(); ++k) {
    const auto& reg = split.regular[k];
    const WriteItem& it = local.items[reg.item];
    TensorMetadata t{it.dtype, it.global_shape, {}};
    t.regular = RegularLayout{reg.dim, rules[k], world};
    if (!md.entries.emplace(it.index.fqn, std::move(t)).second) {
      throw InternalError("'" + it.index.fqn + "' is both a regular shard and in a residual plan");
    }
    if (auto p = local.key_paths.find(it.index.fqn); p != local.key_paths.end()) {
      md.key_paths[it.index.fqn] = p->second;
    }
  }
}

void MergeRegularEntries(Metadata regular, Metadata& md) {
  md.entries.merge(regular.entries);
  if (!regular.entries.empty()) {
    throw InternalError("'" + regular.entries.begin()->first +
                        "' is both a regular shard and in a residual plan");
  }
  for (auto& [fqn, path] : regular.key_paths) md.key_paths.insert_or_assign(fqn, std::move(path));
}

CompactMerge MergeCompactPlans(DefaultSavePlanner& planner, const SavePlan& local,
                               const PlanSplit& mine, std::vector<CompactSavePlan> got) {
  CompactMerge out;
  RegularAgreement agreed = AgreeOnRegularShards(local, mine, got);
  out.outcome = agreed.outcome;
  if (out.outcome != RegularAgreement::kAgreed) return out;
  const int world = static_cast<int>(got.size());
  std::vector<SavePlan> residuals(got.size());
  for (size_t r = 0; r < got.size(); ++r) residuals[r] = std::move(got[r].residual);
  got.clear();
  // The regular entries exist before the merge so that declarations are checked against them.
  Metadata regular;
  AddRegularEntries(local, mine, agreed.rules, world, regular);
  auto [plans, md] = planner.CreateGlobalPlan(
      std::move(residuals), RegularBytesPerRank(local, mine, agreed.rules, world), &regular);
  MergeRegularEntries(std::move(regular), md);
  out.rules = std::move(agreed.rules);
  out.plans = std::move(plans);
  out.md = std::move(md);
  return out;
}

SavePlan RebuildGlobalPlan(const SavePlan& local, const PlanSplit& split, SavePlan residual_global,
                           int rank) {
  SavePlan out;
  out.storage_data = std::move(residual_global.storage_data);
  out.planner_data = std::move(residual_global.planner_data);
  out.items.reserve(local.items.size());
  size_t next_regular = 0, next_kept = 0;
  auto& kept = residual_global.items;
  for (size_t i = 0; i < local.items.size(); ++i) {
    if (next_regular < split.regular.size() && split.regular[next_regular].item == i) {
      ++next_regular;
      out.items.push_back(local.items[i]);
      out.items.back().index.index = rank;
    } else if (next_kept < kept.size() && kept[next_kept].index == local.items[i].index) {
      out.items.push_back(std::move(kept[next_kept++]));
    }
  }
  if (next_kept != kept.size()) {
    throw InternalError("the coordinator's plan for rank " + std::to_string(rank) + " names " +
                        kept[next_kept].index.ToString() +
                        ", which is not in this rank's local plan (in that order)");
  }
  return out;
}

}  // namespace dcp
