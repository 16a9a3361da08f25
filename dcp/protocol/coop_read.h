// Internal to dcp/ (not installed): cooperative reads on load (read-and-scatter,
// planner/coop_reads.h). Each rank asks the owners of the stored items it reads partially for
// its boxes; an owner that scatters an item reads it once through its reader's ItemStreamer,
// verifying it, and sends each rank its rows in rounds of ExchangeBytes bounded by the memory
// budget. Runs inside the "load/read" phase, before the reads each rank makes itself.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <unordered_set>
#include <vector>

#include "dcp/checkpoint.h"  // LoadStats
#include "dcp/proto/staging.h"
#include "dcp/storage/storage.h"

namespace dcp::protocol {

/// What a cooperative read leaves to the rank's own reads.
struct CoopReadResult {
  /// The plain read items (CoopItemKey) served by an owner: the rank's own reads skip them.
  std::unordered_set<std::string> served;
  /// The first error of this rank's part (its own read as an owner, an owner's failure reported
  /// to it, a malformed message). The collectives were all joined regardless; the caller rethrows
  /// it once its own reads (and their collectives) are done. Nothing unverified was committed.
  std::exception_ptr error;
};

/// What a failed bulk exchange (Communicator::ExchangeBytes) may still touch, kept for the life
/// of the process: its staging buffers and status words.
void KeepForever(HostBuffer in, HostBuffer out, std::vector<uint64_t> status);

/// The identity of a plain read item: its destination and its box in the stored item.
std::string CoopItemKey(const ReadItem& item);

/// This rank's part of a cooperative load: every rank of `comm` calls it, in the same order,
/// with the plan FinishPlan returned. Joins 3 + R collectives ("load/coop-request",
/// "load/coop-grant", "load/coop-rounds", then R rounds of "load/coop-data"), also after an
/// error. Never throws: errors go to the result.
CoopReadResult ReadCooperatively(const LoadPlan& plan, const Metadata& md, StorageReader& reader,
                                 LoadPlanner& planner, Communicator& comm,
                                 const StorageOptions& options, LoadStats& stats);

}  // namespace dcp::protocol
