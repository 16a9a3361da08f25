#include "dcp/protocol/phase.h"

#include <chrono>
#include <utility>

#include "dcp/proto/error.h"
#include "schema/dcp.pb.h"  // generated from proto/schema/dcp.proto

namespace dcp::protocol {

std::string TagString(Tag tag) { return std::string(1, static_cast<char>(tag)); }
bool HasTag(std::string_view message, Tag tag) {
  return !message.empty() && message[0] == static_cast<char>(tag);
}

pb::ErrorReport ToReport(const RankFailure& f) {
  pb::ErrorReport e;
  e.set_rank(f.rank);
  e.set_code(static_cast<int>(f.code));
  e.set_message(f.message);
  e.set_retryable(f.retryable);
  return e;
}

RankFailure FromReport(const pb::ErrorReport& e) {
  return {e.rank(), static_cast<ErrorCode>(e.code()), e.message(), e.retryable()};
}

namespace {

// A phase's failure on every rank: poisons the communicator when any rank timed out, since the
// ranks' collective sequences may now differ (docs/PROTOCOL.md, "Failure semantics").
[[noreturn]] void FailPhase(Communicator& comm, const std::string& phase,
                            std::vector<RankFailure> failures, Outcome outcome) {
  CollectiveError error(phase, std::move(failures), outcome);
  if (error.timed_out()) comm.Poison(error.what());
  throw error;
}

// Rank 0: gather every rank's outcome, run the global step when all succeeded, and encode the
// replies: the global step's, or the complete list of failures.
std::vector<std::string> CoordinatePhase(Communicator& comm, const std::string& phase,
                                         const pb::PhaseMessage& mine, const GlobalStep& global,
                                         bool same_reply) {
  const int size = comm.size();
  std::vector<RankFailure> failures;
  std::vector<std::string> payloads(size);
  Outcome outcome = Outcome::kFailed;
  try {
    auto gathered = comm.Gather(mine.SerializeAsString(), 0, phase);
    for (int r = 0; r < size; ++r) {
      pb::PhaseMessage m;
      if (!m.ParseFromString(gathered[r])) {
        failures.push_back({r, ErrorCode::kInternal, "unreadable phase message", false});
      } else if (m.has_error()) {
        failures.push_back(FromReport(m.error()));
      } else {
        payloads[r] = std::move(*m.mutable_payload());
      }
    }
  } catch (const CollectiveError& e) {  // some rank did not answer in time, or a mismatch
    failures = e.failures();
  }
  if (failures.empty()) {
    try {
      payloads = global(std::move(payloads));
      const size_t expected = same_reply ? 1 : static_cast<size_t>(size);
      if (payloads.size() != expected) {
        throw InternalError("global step of " + phase + " returned " +
                            std::to_string(payloads.size()) + " replies, expected " +
                            std::to_string(expected));
      }
    } catch (const CommitError& e) {
      failures.push_back(CurrentExceptionAsFailure(0));
      outcome = e.outcome();
    } catch (...) {
      failures.push_back(CurrentExceptionAsFailure(0));
    }
  }
  std::vector<std::string> replies(same_reply ? 1 : size);
  for (size_t r = 0; r < replies.size(); ++r) {
    pb::PhaseOutcome out;
    out.set_phase(phase);
    if (failures.empty()) {
      out.set_payload(std::move(payloads[r]));
    } else {
      for (const auto& f : failures) *out.add_failures() = ToReport(f);
      out.set_outcome(static_cast<int>(outcome));
    }
    replies[r] = out.SerializeAsString();
  }
  return replies;
}

// Every rank: deliver rank 0's replies (rank 0 sends them) and turn this rank's into its payload
// or the phase's CollectiveError.
std::string ReceiveVerdict(Communicator& comm, const std::string& phase,
                           std::vector<std::string> replies, bool unknown_if_lost,
                           bool same_reply) {
  auto deliver = [&](std::vector<std::string> r) {
    return same_reply ? comm.Broadcast(r.empty() ? std::string() : std::move(r[0]), 0, phase)
                      : comm.Scatter(std::move(r), 0, phase);
  };
  const Outcome if_lost = unknown_if_lost ? Outcome::kUnknown : Outcome::kFailed;
  std::string reply;
  if (comm.rank() == 0) {
    // Sends only: a communicator poisoned by this phase's gather still tells the peers.
    reply = deliver(std::move(replies));
  } else {
    // Rank 0 may itself wait up to one timeout for a slow peer before answering, so wait for
    // it longer than that: then a stalled peer is reported as such, not as rank 0.
    const auto saved = comm.timeout();
    comm.set_timeout(saved * 2 + std::chrono::seconds(5));
    try {
      reply = deliver({});
    } catch (const CollectiveError& e) {
      comm.set_timeout(saved);
      FailPhase(comm, e.phase(), e.failures(), if_lost);
    } catch (...) {
      comm.set_timeout(saved);
      throw;
    }
    comm.set_timeout(saved);
  }
  pb::PhaseOutcome out;
  if (!out.ParseFromString(reply)) {
    FailPhase(comm, phase, {{0, ErrorCode::kInternal, "unreadable reply from rank 0", false}},
              if_lost);
  }
  if (out.failures_size() > 0) {
    std::vector<RankFailure> failures;
    for (const auto& f : out.failures()) failures.push_back(FromReport(f));
    FailPhase(comm, phase, std::move(failures), static_cast<Outcome>(out.outcome()));
  }
  return std::move(*out.mutable_payload());
}

}  // namespace

std::string RunPhase(Communicator& comm, const std::string& phase, const LocalStep& local,
                     const GlobalStep& global, bool decides_commit, bool same_reply) {
  const int rank = comm.rank();
  pb::PhaseMessage mine;
  try {
    mine.set_payload(local());
  } catch (...) {
    *mine.mutable_error() = ToReport(CurrentExceptionAsFailure(rank));
  }
  // Having reported its writes, a rank that misses the verdict cannot tell whether rank 0
  // committed them.
  const bool unknown_if_lost = decides_commit && !mine.has_error();
  std::vector<std::string> replies;
  if (rank != 0) {
    try {
      comm.Gather(mine.SerializeAsString(), 0, phase);  // a send: never blocks
    } catch (const CollectiveError& e) {
      throw CollectiveError(e.phase(), e.failures());  // e.g. poisoned: nothing was reported
    }
  } else {
    replies = CoordinatePhase(comm, phase, mine, global, same_reply);
  }
  return ReceiveVerdict(comm, phase, std::move(replies), unknown_if_lost, same_reply);
}

}  // namespace dcp::protocol
