// Read-once on load: which rank reads the stored bytes that several ranks ask for, and how the
// others receive them (SharedReadBatch in proto/plan.h; executed by dcp::Load).
//
// Replicated state (a model every data-parallel rank holds, an optimizer's step counters, a
// tokenizer blob) is read N times by N ranks when each reads what it asked for. Two read items
// of different ranks that name the same stored item and the same box ask for the same bytes;
// one of them is read, by the least-loaded of the ranks that asked, and broadcast to the others.
//
// Two ways to find them, one scheduler:
//   - rank-local planning (dcp::Load with the default planner and a reader whose global step
//     changes nothing): no rank sends its plan. The candidates are the stored items that are
//     their entry's whole value (a tensor stored as one chunk covering its shape, a byte
//     entry), listed alike by every rank from the metadata; each rank sends one bit per
//     candidate (ReadRequestSummary), the coordinator schedules them (ScheduleCandidates) and
//     broadcasts one schedule, and each rank derives its part (BatchesFor). The coordinator
//     handles O(ranks x candidates) bits, never a plan.
//   - full planning (a custom planner or reader with a global step): the coordinator has every
//     plan and shares any identical box (PlanSharedReads).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/proto/plan.h"

namespace dcp {

/// Coordinator only. `plans[r]` is rank r's load plan (after the global planning step),
/// `can_share[r]` whether rank r takes part (ranks that do not read all of their own items),
/// `metadata` the checkpoint's (it sizes the items). Items whose bytes exceed `max_batch_bytes`
/// (the memory one broadcast may hold: a root holds one batch, a receiver one message) and
/// empty items are not shared. Returns each rank's batches: the same sequence of roots on every
/// rank, each batch at most `max_batch_bytes`, assigned so that the bytes every rank reads from
/// storage are balanced (largest items first, to the least-loaded rank that asked for them).
/// Deterministic; pure (no I/O). Plans that share nothing give no batches.
std::vector<std::vector<SharedReadBatch>> PlanSharedReads(const std::vector<LoadPlan>& plans,
                                                          const Metadata& metadata,
                                                          const std::vector<bool>& can_share,
                                                          uint64_t max_batch_bytes);

/// Bytes a read item delivers to its destination: a tensor box's elements, or a blob's raw
/// length. 0 when the metadata does not describe the item.
uint64_t ReadItemBytes(const ReadItem& item, const Metadata& metadata);

/// The stored items any rank may read whole in the same form, in metadata (fqn) order: each
/// tensor stored as one chunk covering its whole shape, each byte entry. O(entries).
std::vector<MetadataIndex> ShareCandidates(const Metadata& metadata);

/// For each candidate, the index of the first item of `plan` that reads it whole (the whole
/// stored chunk, or the blob), or -1. O(items of the plan + candidates).
std::vector<int32_t> CandidateItems(const LoadPlan& plan,
                                    const std::vector<MetadataIndex>& candidates,
                                    const Metadata& metadata);

/// What a rank sends in rank-local load planning instead of its plan.
struct ReadRequestSummary {
  bool can_share = false;   // it may read for others and receive from them
  uint64_t plan_bytes = 0;  // bytes its plan reads (all items, ReadItemBytes)
  std::vector<bool> reads;  // per candidate: its plan reads it whole
  /// Cooperative reads (coop_reads.h): the bytes its partial reads would fetch beyond their
  /// boxes, over the items worth a request (0: it does not take part in cooperative reads).
  uint64_t coop_waste = 0;
  /// Rule exchange (rule_reads.h): the hash of its rule-read table (0: none), found checking
  /// kRuleBalanced first, and found checking kRuleCeil first.
  uint64_t rule_hash = 0;
  uint64_t rule_hash_ceil_first = 0;
};
/// A rank's summary: `items` from CandidateItems, the sizes from the metadata.
ReadRequestSummary SummarizeRequest(const LoadPlan& plan, const std::vector<int32_t>& items,
                                    const Metadata& metadata, bool can_share);
/// Compact encoding (a bitmap, or one flag when every candidate is read). Decode throws
/// CorruptionError naming `rank` for a malformed message or one whose bitmap is not of
/// `candidates` bits.
std::string EncodeReadRequestSummary(const ReadRequestSummary& summary);
ReadRequestSummary DecodeReadRequestSummary(std::string_view bytes, size_t candidates, int rank);

/// The shared reads of a load, the same for every rank: batches in broadcast order, each a root
/// and the candidates (indices into ShareCandidates) whose bytes its message carries, in order.
struct ShareSchedule {
  struct Batch {
    int32_t root = 0;
    std::vector<int32_t> candidates;
    uint64_t bytes = 0;
  };
  std::vector<Batch> batches;
  /// The load reads cooperatively (coop_reads.h, ShouldCooperate): every rank runs its
  /// collectives; otherwise none does.
  bool cooperative = false;
  /// The load exchanges its rule reads (rule_reads.h): every rank that may share found the same
  /// non-empty table.
  bool rule_exchange = false;
  bool rule_ceil_first = false;  // by the table found checking kRuleCeil first
};
/// Coordinator: share each candidate that at least two sharing ranks read (its bytes,
/// `candidate_bytes`, non-zero and at most `max_batch_bytes`), with the same roots and batches
/// PlanSharedReads would choose for those items. Deterministic; pure.
ShareSchedule ScheduleCandidates(const std::vector<ReadRequestSummary>& summaries,
                                 const std::vector<uint64_t>& candidate_bytes,
                                 uint64_t max_batch_bytes);
/// The bytes of each candidate (ReadItemBytes of its whole read).
std::vector<uint64_t> CandidateBytes(const std::vector<MetadataIndex>& candidates,
                                     const Metadata& metadata);
std::string EncodeShareSchedule(const ShareSchedule& schedule);
/// CorruptionError for a malformed message or a candidate index >= `candidates`.
ShareSchedule DecodeShareSchedule(std::string_view bytes, size_t candidates);

/// Rank `rank`'s part of `schedule` (its summary was `mine`, its CandidateItems `items`): one
/// SharedReadBatch per scheduled batch, as PlanSharedReads gives it. InternalError when the
/// schedule makes it the root of a candidate its plan does not read.
std::vector<SharedReadBatch> BatchesFor(const ShareSchedule& schedule,
                                        const ReadRequestSummary& mine,
                                        const std::vector<int32_t>& items, int rank);

}  // namespace dcp
