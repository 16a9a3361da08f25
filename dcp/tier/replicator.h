// MemoryTier::Replicator (not installed): sends a save's data files to the rank's partners as
// they are closed, on a thread of its own, while the save writes the next ones
// (MemoryTierOptions::overlap_files; how, and how failures travel: dcp/tier/replicate.cc).
//
// Made and finished by the thread running MemoryTier::SaveOn; Notifier()'s function is
// thread-safe (the save's writer threads call it). Collective: every rank makes one for the
// same save, over the same duplicate communicator, and finishes it.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dcp/memory_tier.h"

namespace dcp {

class MemoryTier::Replicator {
 public:
  // Starts the thread, replicating step `step`'s files over `comm` (both outlive it).
  Replicator(MemoryTier& tier, Communicator& comm, int64_t step);
  ~Replicator();  // Finish()
  Replicator(const Replicator&) = delete;
  Replicator& operator=(const Replicator&) = delete;

  // Tells the thread of a data file the save has completed (TierStepStore::NotifyClosed). May
  // outlive the replicator; a call after Finish is ignored.
  std::function<void(const std::string&)> Notifier() const;
  // This rank's write has ended (each file it wrote was notified): waits until every rank's
  // rounds have ended. Idempotent.
  void Finish();
  // After Finish: the files sent, the failure met (as ErrorText; "" for none), the transfers'
  // figures.
  const std::set<std::string>& sent() const { return sent_; }
  const std::string& error() const { return error_; }
  const TierStats& stats() const { return stats_; }

 private:
  struct Closed {
    std::mutex mu;
    std::condition_variable cv;
    std::vector<std::string> names;  // closed, not yet taken by a round
    bool ended = false;              // the write has ended
  };
  void Run();

  MemoryTier& tier_;
  Communicator& comm_;
  const int64_t step_;
  std::shared_ptr<Closed> closed_;
  std::set<std::string> sent_;
  std::string error_;
  TierStats stats_;
  std::thread thread_;  // last: started once the members above exist
};

}  // namespace dcp
