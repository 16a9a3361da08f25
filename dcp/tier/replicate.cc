// MemoryTier::Replicator: a save's replication overlapped with its write.
//
// The save writes each rank's data as MemoryTierOptions::overlap_files files, one after another
// (SaveOn). As each is closed, the replicator's thread sends it to the rank's partners on the
// tier's duplicate communicator, in lockstep rounds: every rank waits until it has a closed
// file not sent yet or its write has ended, says which (an AllGather), and then every rank
// moves what it has through TransferFiles, which opens, maps, votes on and moves the files as
// the replication after a write does. The rounds end once every rank's write has ended and its
// last files went. So a file's replicas are written while the rank writes its next file, and
// what is left when the write ends is the last file's transfer.
//
// A round waits for the slowest rank's next file; a rank with nothing to send still takes part
// (it receives its sources' files). A failure ends the rounds on every rank alike (the
// transfers' votes) or poisons the duplicate communicator (a timeout, a lost peer); either
// way SaveOn carries it into the commit vote on the job's communicator, so every rank fails
// the save, and a poisoned duplicate is not used again (SaveOn's prepare vote).
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dcp/memory_tier.h"
#include "dcp/tier/replicator.h"
#include "dcp/tier/tier_internal.h"

namespace dcp {

using namespace tier_detail;

MemoryTier::Replicator::Replicator(MemoryTier& tier, Communicator& comm, int64_t step)
    : tier_(tier), comm_(comm), step_(step), closed_(std::make_shared<Closed>()) {
  thread_ = std::thread([this] { Run(); });
}

MemoryTier::Replicator::~Replicator() { Finish(); }

std::function<void(const std::string&)> MemoryTier::Replicator::Notifier() const {
  return [closed = closed_](const std::string& name) {
    {
      std::lock_guard<std::mutex> lock(closed->mu);
      closed->names.push_back(name);
    }
    closed->cv.notify_one();
  };
}

void MemoryTier::Replicator::Finish() {
  {
    std::lock_guard<std::mutex> lock(closed_->mu);
    closed_->ended = true;
  }
  closed_->cv.notify_one();
  if (thread_.joinable()) thread_.join();
}

void MemoryTier::Replicator::Run() {
  try {
    const Pairs pairs{tier_.partners_, tier_.replica_sources_};
    for (bool all_ended = false; !all_ended;) {
      std::vector<std::string> batch;
      bool ended = false;
      {
        std::unique_lock<std::mutex> lock(closed_->mu);
        closed_->cv.wait(lock, [&] { return !closed_->names.empty() || closed_->ended; });
        batch.swap(closed_->names);
        ended = closed_->ended;  // then every file of the write is in this batch or sent
      }
      all_ended = true;
      for (const auto& r : comm_.AllGather(ended ? "E" : "W", "tier/replicate-overlap/round")) {
        all_ended = all_ended && r == "E";
      }
      std::vector<Transfer> outgoing;
      for (int partner : tier_.partners_) {
        for (const auto& name : batch) outgoing.push_back({partner, name});
      }
      const uint64_t sent_before = stats_.bytes_sent;
      tier_.TransferFiles(comm_, step_, outgoing, "tier/replicate-overlap", nullptr, &pairs,
                          nullptr, &stats_);
      if (!ended) stats_.bytes_sent_while_writing += stats_.bytes_sent - sent_before;
      sent_.insert(batch.begin(), batch.end());
    }
  } catch (const std::exception& e) {
    error_ = ErrorText(e);
    comm_.NotifyPeersOfPoison();  // peers still in a round fail now, not at their deadline
  } catch (...) {
    error_ = IoText("memory tier: the replication of step " + std::to_string(step_) +
                    " failed with an unknown exception");
    comm_.NotifyPeersOfPoison();
  }
}

}  // namespace dcp
