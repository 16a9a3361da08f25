// Asynchronous save: training blocks only for a point-in-time copy of its state.
//
//   dcp::AsyncCheckpointer ckpt(std::make_unique<dcp::MpiCommunicator>());  // its own communicator
//   for (step...) {
//     train();
//     if (step % 100 == 0) ckpt.Save(state, root + "/step-" + std::to_string(step));
//     // state may be modified at once: the checkpoint holds the values at the call
//   }
//   ckpt.Close();  // waits for the last save; throws if it failed or did not finish
//
// Save() copies every tensor and blob of the state dict into staging buffers owned by the
// checkpointer (allocated on the first save, reused afterwards, page-locked where the system
// allows), returns a handle, and writes the copy through the normal protocol (dcp::Save) on a
// background thread. At most one save is in flight: Save() first waits for the previous one.
// A background failure is raised by the next Save(), Wait() or Close() (or by the handle's
// Wait()), exactly once, never lost.
//
// Device tensors (e.g. CUDA, see proto/device/device.h): Save() blocks only for their
// device-to-host copy into staging, which is page-locked with the device runtime so the copy runs
// at DMA speed; all device copies are queued before the host copies start, so they overlap.
//
// Collectives: the background thread uses the communicator given at construction, which must
// be distinct from the one the training job uses (with MPI: a separate MpiCommunicator, and MPI
// initialised with MPI_THREAD_MULTIPLE, as dcp::InitMpi does). All ranks must call Save() in the
// same order.
//
// Thread safety: Save/Wait/Close are called from one thread (the training loop). Handles may be
// waited on from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "dcp/checkpoint.h"
#include "dcp/communicator.h"
#include "dcp/options.h"

namespace dcp {

/// What one asynchronous save cost and did. Seconds are wall-clock.
struct SaveMetrics {
  std::string uri;
  double wait_previous_s = 0;  // blocked waiting for the previous save to finish
  double staging_s = 0;        // blocked copying the state into staging buffers
  double blocking_s = 0;       // total time Save() blocked the caller
  uint64_t staged_bytes = 0;
  uint64_t device_bytes = 0;       // part of staged_bytes copied from device memory (e.g. CUDA)
  double staging_gbps = 0;         // staged_bytes / staging_s / 1e9
  size_t staging_allocations = 0;  // buffers (re)allocated by this save (0 after the first)
  double background_s = 0;         // time of the background write (plan, write, commit)
  uint64_t bytes_written = 0;      // stored bytes of the committed checkpoint (all ranks)
  /// Estimated training time saved against a synchronous save of the same state:
  /// background_s (what a synchronous save would have blocked) minus blocking_s.
  double training_time_saved_s = 0;
  bool succeeded = false;
  std::string error;  // the failure's message when !succeeded
  std::string ToString() const;
};

/// The result of one asynchronous save.
class AsyncSave {
 public:
  /// True once the background write has ended (either way).
  bool done() const;
  /// Wait for the save; returns its Metadata or throws its error (a CollectiveError on
  /// failure). Waiting on a failed save marks its error as reported.
  Metadata Wait();
  /// Wait until done or the timeout; true if done.
  bool WaitFor(std::chrono::milliseconds timeout) const;
  /// Metrics; background fields are filled once done().
  SaveMetrics metrics() const;

  /// A handle for a save that already ended successfully (e.g. a synchronous one).
  static std::shared_ptr<AsyncSave> Completed(Metadata metadata, SaveMetrics metrics);

  struct State;
  explicit AsyncSave(std::shared_ptr<State> s) : state_(std::move(s)) {}

 private:
  std::shared_ptr<State> state_;
};

class AsyncCheckpointer {
 public:
  /// `background_comm`: the communicator the background saves use (not the training job's).
  explicit AsyncCheckpointer(std::unique_ptr<Communicator> background_comm,
                             AsyncOptions options = {});
  /// Close(options.close_timeout) without throwing: an unfinished or failed save is reported on
  /// stderr (never as done).
  ~AsyncCheckpointer();
  AsyncCheckpointer(const AsyncCheckpointer&) = delete;
  AsyncCheckpointer& operator=(const AsyncCheckpointer&) = delete;

  /// Snapshot `state` and start saving it to `uri` in the background. Throws the previous
  /// save's unreported error instead of starting (then the next call starts normally).
  /// `options` is copied: the caller may change or destroy it at once.
  std::shared_ptr<AsyncSave> Save(const StateDict& state, const std::string& uri,
                                  const SaveOptions& options = {});
  /// What the background runs on the snapshot in place of dcp::Save to a URI, for a destination
  /// that is not one (the memory tier, dcp/memory_tier.h): it gets the staged copy, the
  /// background communicator and the options (whose planner is replaced, when this rank's
  /// snapshot failed, by one that fails the save on every rank), and returns the committed
  /// metadata or throws. It runs on the background thread; it must make the same collective
  /// calls on every rank.
  using SaveRunner = std::function<Metadata(const StateDict& snapshot, Communicator& comm,
                                            const SaveOptions& options)>;
  /// Save() with `run` in place of dcp::Save; `label` names the save in its metrics (uri).
  std::shared_ptr<AsyncSave> SaveWith(const StateDict& state, const std::string& label,
                                      const SaveOptions& options, SaveRunner run);
  /// Wait for the in-flight save, if any; returns its Metadata, throws its unreported error.
  std::optional<Metadata> Wait();
  /// Wait up to `timeout` for the in-flight save, then stop the background thread. Throws the
  /// save's unreported error, or an Error saying the checkpoint is unfinished if it did not end
  /// in time. Idempotent; no Save() is accepted afterwards. Once it returns, the background
  /// thread makes no call into the communicator's transport (MPI, NCCL) nor any device call,
  /// even when a save stuck in storage ends later and the thread then destroys what it owns:
  /// the application may finalise MPI at once.
  void Close(std::chrono::milliseconds timeout = std::chrono::minutes(10));

  /// For a caller that knows this rank takes no part in the saves its peers run next (its own
  /// collectives found it out of step, e.g. a CheckpointManager on another step than rank 0):
  /// poison the background communicator with `reason` and tell the peers' background savers
  /// (a poison notice, dcp/communicator.h), so that a save they run without this rank fails at
  /// once, naming it and `reason`, instead of at its deadline. Meant for when no save is in
  /// flight (e.g. after Wait()): one that is fails on the poison, but sends no notice. Later
  /// saves fail at once; the remedy is a new checkpointer on a new communicator. Never throws.
  void Abandon(const std::string& reason) noexcept;

  /// Bytes of staging memory held, and buffers allocated since construction.
  uint64_t staging_bytes() const;
  size_t staging_allocations() const;

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

// ---------------------------------------------------------------------------------------------
// Lightning-style checkpoint I/O (PyTorch Lightning's CheckpointIO and AsyncCheckpointIO), as
// thin wrappers over dcp::Save, dcp::Load, dcp::LoadAll and the AsyncCheckpointer: a trainer
// framework that speaks CheckpointIO plugs dcp in without learning its API.
//
// Every call is collective (all ranks, same order) like the functions it wraps, and raises what
// they raise (a CollectiveError on every rank alike). Not thread-safe: one call at a time.

/// Lightning's CheckpointIO, synchronously: every call completes before it returns.
class CheckpointIO {
 public:
  /// `comm` must outlive this object.
  explicit CheckpointIO(Communicator& comm) : comm_(comm) {}
  virtual ~CheckpointIO() = default;
  virtual void SaveCheckpoint(const StateDict& state, const std::string& path,
                              const SaveOptions& options = {});
  /// Load into `state` in place (Lightning's `strict` is !options.allow_partial_load).
  virtual void LoadCheckpoint(const std::string& path, StateDict& state,
                              const LoadOptions& options = {});
  /// Load the whole checkpoint into a new state dict (dcp::LoadAll) on `map_location`. Only host
  /// memory is supported here: another device is refused with UnsupportedError (the LibTorch
  /// adapter's LoadAllTensors moves tensors to a device).
  StateDict LoadCheckpoint(const std::string& path, const LoadOptions& options = {},
                           const Device& map_location = {});
  /// Remove a checkpoint (metadata first, so it stops being a checkpoint at once). Collective;
  /// rank 0 removes, holding the location's writer lock (a CollectiveError carrying the
  /// LockedError's message when another job is writing there). Removing an absent checkpoint
  /// is not an error.
  virtual void RemoveCheckpoint(const std::string& path);
  virtual void Teardown() {}

 protected:
  Communicator& comm_;
};

/// Lightning's AsyncCheckpointIO: SaveCheckpoint returns after the snapshot; every other call
/// first waits for the save in flight (and raises its error).
class AsyncCheckpointIO : public CheckpointIO {
 public:
  AsyncCheckpointIO(Communicator& comm, std::unique_ptr<Communicator> background_comm,
                    AsyncOptions options = {});
  void SaveCheckpoint(const StateDict& state, const std::string& path,
                      const SaveOptions& options = {}) override;
  void LoadCheckpoint(const std::string& path, StateDict& state,
                      const LoadOptions& options = {}) override;
  /// Waits for the save in flight, then loads into a new state dict.
  StateDict LoadCheckpoint(const std::string& path, const LoadOptions& options = {},
                           const Device& map_location = {});
  void RemoveCheckpoint(const std::string& path) override;
  /// Wait for the last save and stop the background thread; raises its error.
  void Teardown() override;
  AsyncCheckpointer& checkpointer() { return saver_; }

 private:
  AsyncCheckpointer saver_;
};

}  // namespace dcp
