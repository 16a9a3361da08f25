// The checkpoint lifecycle: a CheckpointManager for step-numbered checkpoints under one root
// (Lightning-style CheckpointIO is in dcp/async_checkpointer.h).
//
// Under the root (any Store location): <root>/step-0000000100/ holds a step's checkpoint,
// <root>/step-0000000100.step indexes it (for backends that cannot list sub-locations), and
// <root>/latest names the newest complete step, for tools; the manager itself trusts only the
// metadata it finds. Retention keeps the newest `keep_last` complete steps and every step
// divisible by `keep_every`, and removes only what is provably not a checkpoint and not in
// flight: a step whose metadata cannot be read is kept and reported (unreadable_steps()), so a
// transient error or an older dcp never deletes a committed checkpoint. Retention failures are
// counted and logged (retention_failures(), last_retention_error()); they never fail a save.
// Save(step) refuses, on every rank, a step older than one found in the store, and replacing a
// step unless ManagerOptions::allow_replacing_steps. The step states and the full rules:
// docs/PROTOCOL.md, "CheckpointManager: what retention may remove".
//
// Preemption (opt-in, HandlePreemption; needs the memory tier): on SIGTERM, or a call of
// NotifyPreemption, a thread of the manager's own (on a communicator of its own, so a rank that
// is inside a collective of the job is never waited for) stops the tier from committing more
// steps, agrees with every rank on the newest step the tier committed (no commit can start after
// the notice, and one under way is waited for), and copies it from memory to the root, committed
// there as any durable step, within PreemptionOptions::grace_period. Rank 0 says on stderr how
// long it took and how much of the window was left; preemption_report() says the same on every
// rank. Saves the job starts after the notice fail on every rank alike with PreemptedError
// (at Save, or at Wait and the next Save when asynchronous) and leave no step: the job stops. Every
// rank must be notified (schedulers signal every process; mpirun and torchrun forward SIGTERM): a
// rank that is not is named when the window runs out.
//
// All ranks construct the manager and call its methods in the same order (SPMD); decisions
// (which step is latest) are made by rank 0 and broadcast; files are removed by rank 0 only.
// Every collective of the manager names its step, and every save passes it as SaveOptions::step,
// so ranks that disagree about the step (one skipped a save) fail instead of pairing.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "dcp/async_checkpointer.h"
#include "dcp/checkpoint.h"
#include "dcp/communicator.h"
#include "dcp/memory_tier.h"
#include "dcp/options.h"

namespace dcp {

/// Starts the preemption drain of every CheckpointManager of this process that handles
/// preemption, as SIGTERM does. Async-signal-safe: call it from your own signal handler.
void NotifyPreemption() noexcept;

/// What a manager's preemption handler did (CheckpointManager::preemption_report).
struct PreemptionReport {
  bool noticed = false;      // a notice arrived
  bool done = false;         // the handler ended (see error)
  int64_t step = -1;         // the step agreed on; -1: the tier committed none in this process
  bool drained = false;      // the handler copied it to the root (false: it was durable already)
  std::string where;         // the step's durable location ("" when step is -1)
  uint64_t bytes = 0;        // bytes this rank copied
  double seconds = 0;        // from the notice to the end
  double window_left_s = 0;  // what was left of the grace period at the end
  std::string error;         // why it failed; "" when it did not
};

class PreemptionWatcher;
struct PreemptionWatcherDeleter {
  void operator()(PreemptionWatcher* watcher) const noexcept;
};

class CheckpointManager {
 public:
  /// `comm`: the job's communicator. `background_comm`: when given, saves are asynchronous and
  /// run on it; when null, saves are synchronous. InvalidArgumentError for a root whose scheme
  /// is not a registered Store backend.
  CheckpointManager(std::string root, Communicator& comm,
                    std::unique_ptr<Communicator> background_comm = nullptr,
                    ManagerOptions options = {});
  ~CheckpointManager();

  /// Save `state` as `step` (asynchronously if configured). Steps must increase, also across
  /// restarts (see the header comment: a step older than one in the store is refused with a
  /// CollectiveError whose failure has code kInvalidArgument; a step already complete there, with
  /// kAlreadyExists unless allow_replacing_steps). Before
  /// starting, waits for the previous save (raising its error, if it failed, before this one
  /// starts), records it as latest, applies retention (whose failures are only reported, see
  /// above), and records the step's index entry (a failure to write it fails this call on
  /// every rank before anything is written). Returns the handle of the save (already done when
  /// synchronous).
  std::shared_ptr<AsyncSave> Save(int64_t step, const StateDict& state);
  /// Wait for the save in flight (if any), record it, apply retention; raises the save's error
  /// (never a retention error).
  void Wait();
  /// Newest complete step, agreed by all ranks; nullopt when there is none.
  std::optional<int64_t> LatestStep();
  /// Complete steps, ascending (rank 0's view, broadcast), with the memory tier's complete steps
  /// when there is one (after waiting for the save in flight, whose error it raises): the
  /// steps Restore may load.
  std::vector<int64_t> CompleteSteps();
  /// Load the newest step that loads into `state` and return it; nullopt when the store holds
  /// no step. Candidates are the complete and unreadable steps, newest first: when one fails
  /// to load (a CollectiveError on every rank alike), the next older one is tried, and the
  /// fallback is said on stderr and in restore_fallbacks(). Throws the newest candidate's error
  /// when none loads, and at once when the communicator is poisoned (every later candidate
  /// would fail the same way). After a failed candidate the state's tensors may be partly
  /// written; the step that loaded overwrites every entry it holds.
  std::optional<int64_t> Restore(StateDict& state, const LoadOptions& options = {});
  /// The candidates the last Restore skipped, as "step N: <why it did not load>" lines.
  const std::vector<std::string>& restore_fallbacks() const { return restore_fallbacks_; }
  /// Where the last Restore loaded from: "memory" (the tier), "durable" (the root) or "" (none).
  const std::string& restore_source() const { return restore_source_; }
  /// The memory tier (ManagerOptions::memory_tier), or nullptr: its figures (last_stats) and
  /// steps. Valid until Close or ReplaceCommunicator.
  MemoryTier* memory_tier() const { return tier_.get(); }
  /// Go on with fresh communicators after one was poisoned (a timeout, a mismatch: see
  /// dcp/communicator.h). Collective over the new `comm`. `background_comm` replaces the
  /// asynchronous saver's (required when the manager saves asynchronously, ignored otherwise);
  /// the old saver is closed first (its error, if it was never reported, is raised after the
  /// replacement is done). A preemption handler ends (call HandlePreemption again with a
  /// communicator of the new group). `comm` must outlive the manager. InvalidArgumentError when
  /// closed.
  void ReplaceCommunicator(Communicator& comm, std::unique_ptr<Communicator> background_comm = {});
  /// Directory of a step.
  std::string PathFor(int64_t step) const;
  /// Save on preemption (see the header comment). `comm`: a communicator over the same ranks
  /// that nothing else uses (another MpiCommunicator of the job's; TorchrunGroup's background
  /// is taken); the handler's thread owns it. Not collective. InvalidArgumentError without a
  /// memory tier, when the root's storage options are not what a copy of the tier's files is
  /// (MemoryTier::DrainCopies: the dcp format, uncompressed), when called twice, or when the
  /// grace period is not positive.
  void HandlePreemption(std::unique_ptr<Communicator> comm, PreemptionOptions options = {});
  /// Whether a preemption notice reached this rank's handler.
  bool preempted() const;
  /// Waits up to `timeout` for the handler to end and returns its report (done says whether it
  /// ended). Thread-safe.
  PreemptionReport WaitForPreemption(std::chrono::milliseconds timeout);
  /// Wait for the last save and stop, for the exit path: never throws. Returns true when
  /// everything ended cleanly; otherwise prints the error on stderr, keeps it in close_error()
  /// and returns false. Idempotent (later calls return the first outcome). The destructor
  /// calls it.
  bool Close() noexcept;
  /// Close() that raises the last save's error (or the background thread's) instead.
  /// Idempotent: only the first call can raise.
  void CloseOrThrow();
  /// Why Close() returned false; empty otherwise.
  const std::string& close_error() const { return close_error_; }

  /// Retention passes that failed since construction (same count on every rank).
  int retention_failures() const { return retention_failures_; }
  /// The message of the latest failed retention pass; empty when none failed.
  const std::string& last_retention_error() const { return last_retention_error_; }
  /// Steps the latest retention pass found unreadable and kept (same on every rank).
  const std::vector<int64_t>& unreadable_steps() const { return unreadable_steps_; }

 private:
  struct StepScan;
  std::vector<int64_t> KnownSteps() const;  // rank 0 only: index entries and step dirs
  StepScan ScanSteps() const;               // rank 0 only
  StepScan Scan();                          // collective: rank 0's scan, broadcast
  // rank 0 only; `shared`: files of the step that kept (incremental) steps share
  void RemoveStep(int64_t step, bool only_if_uncommitted, const std::set<std::string>& shared);
  // Collective: checks the step, writes the index entry; returns the incremental base's name
  // (ManagerOptions::incremental: the newest complete step before it; "" when none or off).
  std::string BeginStep(int64_t step);
  std::string BeginStepOnCoordinator(int64_t step);
  // Rank 0: by step name, the data files of it that `steps` share (their incremental references).
  std::map<std::string, std::set<std::string>> SharedFiles(const std::vector<int64_t>& steps) const;
  std::shared_ptr<AsyncSave> SaveThroughTier(int64_t step, const StateDict& state);
  std::shared_ptr<AsyncSave> SaveToRoot(int64_t step, const StateDict& state);
  // The saver of asynchronous saves to the root: the manager's, or the tier's (a tier that
  // cannot save, see SaveThroughTier); nullptr when saves are synchronous.
  AsyncCheckpointer* background_saver() const;
  void AfterSaveEnded(int64_t step);  // latest + retention, rank 0 acting; never throws an Error
  void Retain(int64_t step);
  friend class PreemptionWatcher;
  // The handler's work after a notice, on its thread and communicator.
  void DrainOnPreemption(Communicator& comm, std::chrono::steady_clock::time_point commits_until,
                         std::chrono::steady_clock::time_point deadline, PreemptionReport& report);
  void StopPreemptionHandler() noexcept;
  std::string root_;
  Communicator* comm_;
  ManagerOptions options_;
  std::unique_ptr<AsyncCheckpointer> saver_;
  std::shared_ptr<AsyncSave> in_flight_;
  int64_t in_flight_step_ = -1;
  int64_t last_step_ = -1;
  bool closed_ = false;
  std::string close_error_;
  int retention_failures_ = 0;
  std::string last_retention_error_;
  std::vector<int64_t> unreadable_steps_;
  std::vector<std::string> restore_fallbacks_;
  std::string restore_source_;
  std::unique_ptr<MemoryTier> tier_;
  bool in_flight_in_tier_ = false;  // in_flight_ is the tier's (its step is in_flight_step_)
  bool told_tier_refusal_ = false;  // the tier cannot save here, and that was said
  // Last: stopped (in Close) before the tier it drains from.
  std::unique_ptr<PreemptionWatcher, PreemptionWatcherDeleter> preemption_;
};

}  // namespace dcp
