// Read-once on load: which rank reads the stored bytes that several ranks ask for, and how the
// others receive them (SharedReadBatch in proto/plan.h; executed by dcp::Load).
//
// Replicated state (a model every data-parallel rank holds, an optimizer's step counters, a
// tokenizer blob) is read N times by N ranks when each reads what it asked for. Two read items
// of different ranks that name the same stored item and the same box ask for the same bytes;
// one of them is read, by the least-loaded of the ranks that asked, and broadcast to the others.
#pragma once

#include <cstdint>
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

}  // namespace dcp
