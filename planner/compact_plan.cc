#include "dcp/planner/compact_plan.h"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "dcp/proto/checksum.h"
#include "dcp/proto/codec.h"
#include "dcp/proto/error.h"

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

}  // namespace

std::pair<int64_t, int64_t> RegularSlice(int64_t extent, int rank, int world, RegularRule rule) {
  if (rule == kRuleCeil) {
    const int64_t c = (extent + world - 1) / world;
    const int64_t b = std::min<int64_t>(extent, c * rank);
    return {b, std::min<int64_t>(extent, b + c)};
  }
  const int64_t base = extent / world, extra = extent % world;
  const int64_t b = rank * base + std::min<int64_t>(rank, extra);
  return {b, b + base + (rank < extra ? 1 : 0)};
}

PlanSplit SplitRegularShards(const SavePlan& local, int rank, int world) {
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
      if (!ok || dim < 0 || it.global_shape[dim] < world) continue;
      const uint8_t rules = MatchingRules(it.chunk.offsets[dim], it.chunk.sizes[dim],
                                          it.global_shape[dim], rank, world);
      if (rules == 0) continue;
      regular[i] = 1;
      split.regular.push_back({static_cast<uint32_t>(i), dim, rules});
    }
  }
  // The hash covers everything about the regular shards that must be the same on every rank.
  std::string desc;
  for (const auto& reg : split.regular) {
    const WriteItem& it = local.items[reg.item];
    desc.append(it.index.fqn);
    desc.push_back('\0');
    desc.push_back(static_cast<char>(it.dtype));
    desc.push_back(static_cast<char>(reg.dim));
    PutU64(desc, it.global_shape.size());
    for (int64_t s : it.global_shape) PutU64(desc, static_cast<uint64_t>(s));
    if (auto p = local.key_paths.find(it.index.fqn); p != local.key_paths.end()) {
      PutU64(desc, p->second.size());
      for (const auto& part : p->second) {
        PutU64(desc, part.size());
        desc.append(part);
      }
    } else {
      PutU64(desc, ~uint64_t{0});
    }
  }
  const uint64_t a = Crc32c(0, desc.data(), desc.size());
  const uint64_t b = Crc32c(0x9E3779B9u, desc.data(), desc.size());
  split.hash = ((a << 32) | b) ^ (static_cast<uint64_t>(desc.size()) * 0x9E3779B97F4A7C15ull);

  split.residual.items.reserve(local.items.size() - split.regular.size());
  for (size_t i = 0; i < local.items.size(); ++i) {
    if (!regular[i]) split.residual.items.push_back(local.items[i]);
  }
  // Key paths of regular fqns are covered by the hash (the coordinator uses its own).
  std::unordered_set<std::string_view> regular_fqns;
  for (const auto& reg : split.regular) regular_fqns.insert(local.items[reg.item].index.fqn);
  for (const auto& [fqn, path] : local.key_paths) {
    if (!regular_fqns.count(fqn)) {
      split.residual.key_paths.emplace_hint(split.residual.key_paths.end(), fqn, path);
    }
  }
  return split;
}

std::string EncodeCompactSavePlan(const PlanSplit& split) {
  std::string out;
  PutU64(out, split.hash);
  PutU64(out, split.regular.size());
  for (const auto& reg : split.regular) out.push_back(static_cast<char>(reg.rules));
  out += EncodeSavePlan(split.residual);
  return out;
}

CompactSavePlan DecodeCompactSavePlan(std::string_view bytes, int rank) {
  auto corrupt = [&] {
    return CorruptionError("rank " + std::to_string(rank) + " sent a malformed compact save plan");
  };
  if (bytes.size() < 16) throw corrupt();
  CompactSavePlan out;
  out.hash = GetU64(bytes);
  const uint64_t n = GetU64(bytes.substr(8));
  if (n > bytes.size() - 16) throw corrupt();
  out.rules.assign(bytes.begin() + 16, bytes.begin() + 16 + static_cast<ptrdiff_t>(n));
  out.residual = DecodeSavePlan(bytes.substr(16 + n));
  return out;
}

std::vector<RegularRule> CommonRules(const PlanSplit& mine,
                                     const std::vector<std::vector<uint8_t>>& rules_by_rank) {
  std::vector<uint8_t> common(mine.regular.size(), kRuleBalanced | kRuleCeil);
  for (size_t r = 0; r < rules_by_rank.size(); ++r) {
    const auto& rules = rules_by_rank[r];
    if (rules.size() != common.size()) {
      throw InvalidArgumentError("rank " + std::to_string(r) + " described " +
                                 std::to_string(rules.size()) + " regular shards, rank 0 " +
                                 std::to_string(common.size()));
    }
    for (size_t i = 0; i < common.size(); ++i) common[i] &= rules[i];
  }
  std::vector<RegularRule> out(common.size());
  for (size_t i = 0; i < common.size(); ++i) {
    if (common[i] & kRuleBalanced) {
      out[i] = kRuleBalanced;
    } else if (common[i] & kRuleCeil) {
      out[i] = kRuleCeil;
    } else {
      return {};
    }
  }
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
    t.chunks.resize(static_cast<size_t>(world));
    const int64_t extent = it.global_shape[reg.dim];
    for (int r = 0; r < world; ++r) {
      auto [b, e] = RegularSlice(extent, r, world, rules[k]);
      ChunkMeta& c = t.chunks[static_cast<size_t>(r)];
      c.offsets.assign(it.global_shape.size(), 0);
      c.sizes = it.global_shape;
      c.offsets[reg.dim] = b;
      c.sizes[reg.dim] = e - b;
    }
    if (!md.entries.emplace(it.index.fqn, std::move(t)).second) {
      throw InternalError("'" + it.index.fqn + "' is both a regular shard and in a residual plan");
    }
    if (auto p = local.key_paths.find(it.index.fqn); p != local.key_paths.end()) {
      md.key_paths[it.index.fqn] = p->second;
    }
  }
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
