// Internal to dcp/ (not installed): the machinery every collective step of Save and Load uses
// (docs/PROTOCOL.md): the tag byte that opens a protocol message, a phase through rank 0
// (RunPhase), and the operation that tags a Save's or Load's messages (OperationScope).
// Thread safety: as the Communicator's; one phase at a time per communicator.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/communicator.h"

namespace dcp::pb {
class ErrorReport;
}  // namespace dcp::pb

namespace dcp::protocol {

// The first byte of a protocol message says what follows; each byte has one meaning.
enum class Tag : char {
  kCacheHit = 'H',        // plan cache: every rank's cached plan stands; its files follow
  kCacheMiss = 'M',       // plan cache: plan anew
  kCompactPlan = 'C',     // a compact save plan (planner/compact_plan.h), or the reply to one
  kFullPlan = 'P',        // a save plan item by item, or the reply to one
  kRetryFull = 'F',       // coordinator: the ranks did not agree; plan again, in full
  kRetryDeclared = 'D',   // coordinator: plan compactly again, every declaration in full
  kBatchFailed = 'X',     // read-once: the batch's reader failed; an ErrorReport follows
  kRequestSummary = 'R',  // load: a rank's request summary (planner/read_sharing.h)
  kShareSchedule = 'S',   // load: the coordinator's read-once schedule, the same for every rank
};
std::string TagString(Tag tag);
bool HasTag(std::string_view message, Tag tag);

// A rank's failure as a phase message reports it, and back.
pb::ErrorReport ToReport(const RankFailure& f);
RankFailure FromReport(const pb::ErrorReport& e);

using LocalStep = std::function<std::string()>;
using GlobalStep = std::function<std::vector<std::string>(std::vector<std::string>)>;

// One phase of the protocol: every rank runs `local`; the coordinator gathers the outcomes and,
// if all succeeded, runs `global` to produce one reply per rank; the replies (or the complete
// list of failures) are scattered back. Returns this rank's reply, or throws the same
// CollectiveError on every rank.
//
// `decides_commit` marks the phase whose global step commits a save (save/write). Its verdict
// defines the save's outcome: a rank that reported success and then cannot receive the verdict
// throws with Outcome::kUnknown (it must keep its data), and a global step that failed after
// the commit (CommitError) makes every rank throw with that outcome.
// `same_reply`: the global step returns one reply for every rank, which is broadcast from one
// buffer instead of scattered as one copy per rank (the metadata of a large job is big).
std::string RunPhase(Communicator& comm, const std::string& phase, const LocalStep& local,
                     const GlobalStep& global, bool decides_commit = false,
                     bool same_reply = false);

// Opens an operation on the communicator for the scope of one Save or Load; the id tags every
// message (see Communicator::OpenOperation).
class OperationScope {
 public:
  OperationScope(Communicator& comm, std::string_view name, std::string_view target)
      : comm_(comm), id_(comm.OpenOperation(name, target)) {}
  uint64_t id() const { return id_; }
  ~OperationScope() { comm_.EndOperation(); }
  OperationScope(const OperationScope&) = delete;
  OperationScope& operator=(const OperationScope&) = delete;

 private:
  Communicator& comm_;
  uint64_t id_;
};

}  // namespace dcp::protocol
