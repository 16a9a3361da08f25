// Internal to dcp/ (not installed): what the CheckpointManager and the Lightning adapters share.
#pragma once

#include <functional>
#include <set>
#include <string>

#include "dcp/communicator.h"

namespace dcp {

// Remove a checkpoint's files: metadata first (it stops being a checkpoint), then the rest.
// Under the location's writer lock, so a checkpoint another job is writing right now (a step
// without metadata yet, e.g. a requeued job overlapping its predecessor) is never taken for
// dead: LockedError instead. With `only_if_uncommitted`, the metadata's absence is checked again
// under the lock (a save may have committed since the caller looked). Objects named in `keep`
// stay (data files that later incremental checkpoints share). Returns whether the location is
// now empty.
bool RemoveCheckpointFiles(const std::string& uri, bool only_if_uncommitted = false,
                           const std::set<std::string>& keep = {});

// Run `fn` on rank 0 and broadcast its result or its error, so every rank agrees. The error
// keeps its code (a refused step is kInvalidArgument or kAlreadyExists on every rank). A rank
// whose broadcast fails poisoned (`what` names the step and this rank is on another one) sends
// its peers a poison notice (Communicator::NotifyPeersOfPoison) before it throws.
std::string OnCoordinator(Communicator& comm, const std::string& what,
                          const std::function<std::string()>& fn);

}  // namespace dcp
