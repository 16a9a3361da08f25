// Compact save plans: regular shardings described once, not once per rank.
//
// In an FSDP/TP-like state every rank holds one slice of each sharded tensor, cut the same way
// on every rank: along one dimension, the rank's share of an even split of the world. The items
// of such "regular" shards differ between ranks only by the rank: gathering, merging and
// scattering them at thousands of ranks would move millions of items that carry no information
// beyond the first rank's. Here each rank splits its local plan into
//   - its regular shards: described by a hash of (fqn, dtype, global shape, dimension, key path)
//     over all of them, plus one byte per shard saying which splitting rules its slice matches;
//   - the residual: every other item (replicated tensors, blobs, irregular shards) in full.
// The coordinator checks that every rank's hash equals its own, expands its own regular shards
// into every rank's chunks (by construction these tile each tensor), and merges only the residual
// plans; each rank rebuilds its global plan from its local plan and the residual reply. The
// metadata is the same, byte for byte, as with full plans. Any difference between ranks
// (another hash, a slice no rule explains on some rank) makes the coordinator answer "plan in
// full", and the save plans with every rank's full plan.
//
// Splitting rules (along the dimension d of extent n, world w, rank r):
//   kBalanced: the first n % w ranks get n / w + 1, the others n / w (numpy.array_split);
//   kCeil:     every rank gets c = ceil(n / w), the last what remains (torch.chunk, FSDP2's
//              Shard(0)); regular only when (w - 1) * c < n, so that no rank's slice is empty.
// A tensor with fewer units than ranks (n < w: at 4,096 ranks, every 1,024-row key/value
// projection) is regular too: under both rules ranks r < n hold unit r and the others nothing.
// A rank describes only the shards it holds, so the coordinator expects from rank r the hash
// of its own regular shards less those rank r's slice of is empty; empty slices never become
// chunks, as in full planning. A rank that holds none of a sharded tensor declares it (dtype
// and shape, DefaultSavePlanner's planner_data) so that it is still checked: at 4,096 ranks
// that is 3,072 declarations of every key/value projection. A declaration that may be such an
// empty slice (its tensor has elements and some dimension of at most `rank` units) is sent
// as part of a second hash, of (fqn, dtype, shape, key path) over those declarations in order;
// the coordinator expects the hash of its regular shards that rank r holds none of. When only
// that hash differs (a rank declares a tensor that is not such a short regular one), the
// coordinator answers "declare in full": every rank sends its compact plan again with its
// declarations in the residual, where they are checked one by one.
//
// All functions are pure and thread-compatible.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/proto/plan.h"

namespace dcp {

class DefaultSavePlanner;

/// A rank's local plan split into regular shards and the residual.
struct PlanSplit {
  struct Regular {
    uint32_t item = 0;   // index into the local plan's items
    int32_t dim = 0;     // the dimension the tensor is split along
    uint8_t rules = 0;   // RegularRule bits this rank's slice matches (never 0)
    int64_t extent = 0;  // the global extent of `dim`; < world: ranks >= extent hold nothing
    uint64_t hash = 0;   // of this shard's rank-independent description
    uint64_t declared_hash = 0;  // of the declaration a rank that holds none of it makes
  };
  std::vector<Regular> regular;  // in local-plan order
  /// Hash of the rank-independent description of `regular` (fqns, dtypes, shapes, dims, key
  /// paths, in order): equal on every rank exactly when they all describe the same tensors.
  uint64_t hash = 0;
  /// Whether the declarations that may be empty slices of short regular tensors were taken out
  /// of the residual, and the hash of their descriptions (fqn, dtype, shape, key path, in order).
  bool declarations_hashed = false;
  uint64_t declared_hash = 0;
  /// The other items in full (local-plan order), the key paths of their fqns and the plan's
  /// planner_data and storage_data.
  SavePlan residual;
};

/// Split `local` (this rank's local plan, as given to the coordinator) for rank `rank` of
/// `world`. A shard is regular when it is its fqn's only item on this rank, is cut along exactly
/// one dimension to a non-empty slice, and matches at least one rule. With world < 2 nothing
/// is regular. With `hash_declarations`, the declarations in the plan's planner_data (the
/// default planner's, planner/default_planner.h) that may be empty slices of short regular
/// tensors leave the residual for `declared_hash`. CorruptionError for malformed declarations.
PlanSplit SplitRegularShards(const SavePlan& local, int rank, int world,
                             bool hash_declarations = true);

/// The message a rank sends in compact planning: its hash, its rule bytes and its residual.
std::string EncodeCompactSavePlan(const PlanSplit& split);
struct CompactSavePlan {
  uint64_t hash = 0;
  bool declarations_hashed = false;
  uint64_t declared_hash = 0;
  std::vector<uint8_t> rules;  // one per regular shard
  SavePlan residual;
};
/// CorruptionError naming `rank` when `bytes` is not such a message.
CompactSavePlan DecodeCompactSavePlan(std::string_view bytes, int rank);

/// Coordinator: whether every rank described the regular shards `mine` (rank 0's, of its local
/// plan `local`) describes, each rank those its slice of is non-empty, alike, and named none of
/// them in its residual (`got`: each rank's message); if so, the splitting rule of each shard
/// that every rank's slice matches (kBalanced preferred).
struct RegularAgreement {
  enum Outcome {
    kAgreed,              // `rules` holds one rule per regular shard
    kDeclarationsDiffer,  // only some rank's declared_hash differs: send declarations in full
    kDiffer,              // the ranks differ (or a shard has no common rule): plan in full
  };
  Outcome outcome = kDiffer;
  std::vector<RegularRule> rules;
};
RegularAgreement AgreeOnRegularShards(const SavePlan& local, const PlanSplit& mine,
                                      const std::vector<CompactSavePlan>& got);

/// Bytes each rank writes for the regular shards (what the dedup of replicated items balances
/// against, as when they were part of the merge).
std::vector<uint64_t> RegularBytesPerRank(const SavePlan& local, const PlanSplit& split,
                                          const std::vector<RegularRule>& rules, int world);

/// Add the regular shards' tensors to `md`: each with one chunk per rank that holds a non-empty
/// slice, in rank order, and its key path. InternalError when an entry of that name already
/// exists (a residual plan named it, which AgreeOnRegularShards rules out).
void AddRegularEntries(const SavePlan& local, const PlanSplit& split,
                       const std::vector<RegularRule>& rules, int world, Metadata& md);

/// Move the regular entries made by AddRegularEntries into `md`, the metadata of the merged
/// residual plans; their key paths replace any a rank's residual carried (rank 0's win, as in
/// full planning). InternalError when `md` already has one of the entries.
void MergeRegularEntries(Metadata regular, Metadata& md);

/// Coordinator: the whole compact merge of every rank's message (`got`, consumed): agree on
/// the regular shards (AgreeOnRegularShards), merge the residual plans with `planner` (each
/// rank's regular bytes as its starting load, every declaration checked against the regular
/// entries) and add the regular entries. `rules`, `plans` and `md` are set only when the
/// outcome is kAgreed. Throws what CreateGlobalPlan throws for invalid residual plans.
struct CompactMerge {
  RegularAgreement::Outcome outcome = RegularAgreement::kDiffer;
  std::vector<RegularRule> rules;  // one per regular shard of `mine`
  std::vector<SavePlan> plans;     // each rank's residual global plan
  Metadata md;                     // the whole metadata, regular entries included
};
CompactMerge MergeCompactPlans(DefaultSavePlanner& planner, const SavePlan& local,
                               const PlanSplit& mine, std::vector<CompactSavePlan> got);

/// This rank's global plan, rebuilt from its local plan, its split and the coordinator's reply
/// for its residual (`residual_global`: the residual items kept, in order, with their index
/// hints; storage_data and planner_data): the items of `local` in order, regular shards with
/// index hint `rank` (their chunk's position in the metadata), residual ones as the reply has
/// them, dropped ones left out. InternalError when the reply is not a subsequence of the
/// residual.
SavePlan RebuildGlobalPlan(const SavePlan& local, const PlanSplit& split, SavePlan residual_global,
                           int rank);

}  // namespace dcp
