// Compact save plans: regular shardings described once, not once per rank.
//
// In an FSDP/TP-like state every rank holds one slice of each sharded tensor, cut the same way
// on every rank: along one dimension, the rank's share of an even split of the world. The items
// of such "regular" shards differ between ranks only by the rank, so a first save at thousands
// of ranks used to gather, merge and scatter millions of items that carry no information beyond
// the first rank's. Here each rank splits its local plan into
//   - its regular shards: described by a hash of (fqn, dtype, global shape, dimension, key path)
//     over all of them, plus one byte per shard saying which splitting rules its slice matches;
//   - the residual: every other item (replicated tensors, blobs, irregular shards) in full.
// The coordinator checks that every rank's hash equals its own, expands its own regular shards
// into every rank's chunks (by construction these tile each tensor), and merges only the residual
// plans; each rank rebuilds its global plan from its local plan and the residual reply. The
// metadata is the same, byte for byte, as with full plans. Any difference between ranks
// (another hash, a slice no rule explains on some rank) makes the coordinator answer "plan in
// full", and the save plans as before.
//
// Splitting rules (along the dimension d of extent n, world w, rank r; every slice non-empty):
//   kBalanced: the first n % w ranks get n / w + 1, the others n / w (numpy.array_split);
//   kCeil:     every rank gets c = ceil(n / w), the last what remains (torch.chunk, FSDP2's
//              Shard(0)); regular only when (w - 1) * c < n, so that no rank's slice is empty.
//
// All functions are pure and thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/proto/plan.h"

namespace dcp {

/// Which splitting rules a regular shard's slice matches (a bit set).
enum RegularRule : uint8_t { kRuleBalanced = 1, kRuleCeil = 2 };

/// The part [begin, end) of `extent` that rank `rank` of `world` holds under `rule`.
std::pair<int64_t, int64_t> RegularSlice(int64_t extent, int rank, int world, RegularRule rule);

/// A rank's local plan split into regular shards and the residual.
struct PlanSplit {
  struct Regular {
    uint32_t item = 0;  // index into the local plan's items
    int32_t dim = 0;    // the dimension the tensor is split along
    uint8_t rules = 0;  // RegularRule bits this rank's slice matches (never 0)
  };
  std::vector<Regular> regular;  // in local-plan order
  /// Hash of the rank-independent description of `regular` (fqns, dtypes, shapes, dims, key
  /// paths, in order): equal on every rank exactly when they all describe the same tensors.
  uint64_t hash = 0;
  /// The other items in full (local-plan order), the key paths of their fqns and the plan's
  /// planner_data and storage_data.
  SavePlan residual;
};

/// Split `local` (this rank's local plan, as given to the coordinator) for rank `rank` of
/// `world`. A shard is regular when it is its fqn's only item on this rank, is cut along exactly
/// one dimension d with global_shape[d] >= world, and matches at least one rule. With world < 2
/// nothing is regular.
PlanSplit SplitRegularShards(const SavePlan& local, int rank, int world);

/// The message a rank sends in compact planning: its hash, its rule bytes and its residual.
std::string EncodeCompactSavePlan(const PlanSplit& split);
struct CompactSavePlan {
  uint64_t hash = 0;
  std::vector<uint8_t> rules;  // one per regular shard
  SavePlan residual;
};
/// CorruptionError naming `rank` when `bytes` is not such a message.
CompactSavePlan DecodeCompactSavePlan(std::string_view bytes, int rank);

/// Coordinator: the splitting rule of each of its regular shards that every rank's slice
/// matches (kBalanced preferred), from every rank's rule bytes; empty when some shard has no
/// common rule (then the save must plan in full). InvalidArgumentError for a rank whose rule
/// bytes do not have one entry per regular shard.
std::vector<RegularRule> CommonRules(const PlanSplit& mine,
                                     const std::vector<std::vector<uint8_t>>& rules_by_rank);

/// Bytes each rank writes for the regular shards (what the dedup of replicated items balances
/// against, as when they were part of the merge).
std::vector<uint64_t> RegularBytesPerRank(const SavePlan& local, const PlanSplit& split,
                                          const std::vector<RegularRule>& rules, int world);

/// Add the regular shards' tensors to `md`: each with one chunk per rank, in rank order, and its
/// key path. InternalError when an entry of that name already exists (the residual plans named
/// it, which equal hashes rule out).
void AddRegularEntries(const SavePlan& local, const PlanSplit& split,
                       const std::vector<RegularRule>& rules, int world, Metadata& md);

/// This rank's global plan, rebuilt from its local plan, its split and the coordinator's reply
/// for its residual (`residual_global`: the residual items kept, in order, with their index
/// hints; storage_data and planner_data): the items of `local` in order, regular shards with
/// index hint `rank` (their chunk's position in the metadata), residual ones as the reply has
/// them, dropped ones left out. InternalError when the reply is not a subsequence of the
/// residual.
SavePlan RebuildGlobalPlan(const SavePlan& local, const PlanSplit& split, SavePlan residual_global,
                           int rank);

}  // namespace dcp
