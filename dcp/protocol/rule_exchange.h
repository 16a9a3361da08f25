// Internal to dcp/ (not installed): rule exchange on load (planner/rule_reads.h). Each owner
// reads its saved chunks of the table's tensors whole, verified, through its reader's
// ItemStreamer, and sends every rank its pieces, packed by arithmetic both sides share; rounds
// of the memory budget's round size. Runs inside the "load/read" phase, before cooperative
// reads and the reads each rank makes itself.
#pragma once

#include <exception>
#include <vector>

#include "dcp/checkpoint.h"  // LoadStats
#include "dcp/planner/rule_reads.h"
#include "dcp/storage/storage.h"

namespace dcp::protocol {

struct RuleExchangeResult {
  /// Per item of the plan: 1 when rule exchange placed and committed it (the rank's own reads
  /// skip it). A read an owner could not serve (it failed to read, or cannot stream the item)
  /// stays 0 and is read by the rank itself, so a damaged chunk fails the load there, named.
  std::vector<char> served;
  /// A failed collective: the communicator is poisoned; the caller rethrows it after its own
  /// reads' collectives.
  std::exception_ptr error;
};

/// Whether this rank's reader can stream its own chunks of `table` (checked on the first one it
/// owns, as the owner will read them): not when the checkpoint's items are transformed (zstd),
/// nor when that chunk's index cannot be read. A rank that cannot reports no table, so that
/// the load reads as before instead of exchanging messages no owner could fill.
bool CanServeRuleReads(const RuleReadTable& table, ItemStreamer* streamer, int rank, int world,
                       int64_t saved_world);

/// This rank's part of a rule exchange: every rank of `comm` calls it, with tables the
/// coordinator found equal (same hash), joining RuleRounds(...).size() collectives
/// ("load/rule-data"). Never throws.
RuleExchangeResult ExchangeByRule(const LoadPlan& plan, const Metadata& md,
                                  const RuleReadTable& table, StorageReader& reader,
                                  LoadPlanner& planner, Communicator& comm,
                                  const StorageOptions& options, LoadStats& stats);

}  // namespace dcp::protocol
