// Internal to dcp/ (not installed): read-once on load (planner/read_sharing.h). The root of a
// batch reads its items through a planner that copies each one's bytes out as it is committed;
// one Broadcast per batch delivers them; receivers place them as a read would have
// (ResolveTensor, copy, CommitTensor).
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "dcp/checkpoint.h"  // LoadStats

namespace dcp::protocol {

// This rank's part of the "load/read" phase when some reads are shared: read its own items (and,
// within the memory budget, those it reads for others), then take part in every batch's
// broadcast in order. An error does not stop the broadcasts (the others would wait for this
// rank); the first one is rethrown at the end.
// `served` (may be empty): plain items a cooperative read already served, which it does not read;
// `served_items` (may be empty): a flag per item of `plan` that rule exchange served.
void ReadWithSharing(const LoadPlan& plan, const Metadata& md,
                     const std::vector<SharedReadBatch>& batches, StorageReader& reader,
                     LoadPlanner& planner, Communicator& comm, uint64_t budget, LoadStats& stats,
                     const std::function<bool(const ReadItem&)>& served = {},
                     const std::vector<char>& served_items = {});

}  // namespace dcp::protocol
