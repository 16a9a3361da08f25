// The checkpoint lifecycle: Lightning-style CheckpointIO, and a CheckpointManager for
// step-numbered checkpoints under one root directory.
//
// CheckpointManager layout (root is a directory, file:// or a plain path):
//   <root>/step-0000000100/   one checkpoint per step (metadata.dcp + data files)
//   <root>/latest             the newest *complete* step, as text; written atomically, and only
//                             after that step's metadata is committed. A convenience for tools:
//                             the manager itself trusts only the metadata it finds.
// A step counts as complete exactly when its metadata exists and validates; a crash mid-save
// leaves a step directory without metadata, which is never chosen and is removed by the next
// clean-up. Retention keeps the newest `keep_last` complete steps and every step divisible by
// `keep_every`; it never removes the newest complete step or a step being written.
//
// All ranks construct the manager and call its methods in the same order (SPMD); decisions
// (which step is latest) are made by rank 0 and broadcast; files are removed by rank 0 only.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "dcp/async_checkpointer.h"
#include "dcp/checkpoint.h"
#include "dcp/communicator.h"

namespace dcp {

struct LoadCheckpointOptions {
  /// Where loaded tensors should live. Only host memory is supported by this build; a CUDA
  /// device is refused with UnsupportedError.
  Device map_location;
  /// Load tensors only; byte blobs in the state dict are left untouched.
  bool weights_only = false;
  /// Fail on keys the checkpoint lacks (else skip them).
  bool strict = true;
  StorageOptions storage;
};

/// Lightning's CheckpointIO, synchronously: every call completes before it returns.
class CheckpointIO {
 public:
  explicit CheckpointIO(Communicator& comm) : comm_(comm) {}
  virtual ~CheckpointIO() = default;
  virtual void SaveCheckpoint(const StateDict& state, const std::string& path,
                              const StorageOptions& options = {});
  /// Load into `state` in place.
  virtual void LoadCheckpoint(const std::string& path, StateDict& state,
                              const LoadCheckpointOptions& options = {});
  /// Load the whole checkpoint into a new state dict allocated from its metadata (every rank
  /// gets every entry; with weights_only, blobs are left out).
  StateDict LoadCheckpoint(const std::string& path, const LoadCheckpointOptions& options = {});
  /// Remove a checkpoint (metadata first, so it stops being a checkpoint at once). Collective;
  /// rank 0 removes. Removing an absent checkpoint is not an error.
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
                      const StorageOptions& options = {}) override;
  void LoadCheckpoint(const std::string& path, StateDict& state,
                      const LoadCheckpointOptions& options = {}) override;
  /// Waits for the save in flight, then loads into a new state dict.
  StateDict LoadCheckpoint(const std::string& path, const LoadCheckpointOptions& options = {});
  void RemoveCheckpoint(const std::string& path) override;
  /// Wait for the last save and stop the background thread; raises its error.
  void Teardown() override;
  AsyncCheckpointer& checkpointer() { return saver_; }

 private:
  AsyncCheckpointer saver_;
};

struct ManagerOptions {
  int keep_last = 3;   // newest complete checkpoints kept (at least 1)
  int keep_every = 0;  // also keep steps divisible by this (0: none)
  SaveOptions save;    // per-save options (storage options, planner)
  AsyncOptions async;  // used when the manager has a background communicator
};

class CheckpointManager {
 public:
  /// `comm`: the job's communicator. `background_comm`: when given, saves are asynchronous and
  /// run on it; when null, saves are synchronous.
  CheckpointManager(std::string root, Communicator& comm,
                    std::unique_ptr<Communicator> background_comm = nullptr,
                    ManagerOptions options = {});
  ~CheckpointManager();

  /// Save `state` as `step` (asynchronously if configured). Steps must increase. Before
  /// starting, waits for the previous save, records it as latest, applies retention.
  /// Returns the handle of the save (already done when synchronous).
  std::shared_ptr<AsyncSave> Save(int64_t step, const StateDict& state);
  /// Wait for the save in flight (if any), record it, apply retention; raises its error.
  void Wait();
  /// Newest complete step, agreed by all ranks; nullopt when there is none.
  std::optional<int64_t> LatestStep();
  /// Complete steps, ascending (rank 0's view, broadcast).
  std::vector<int64_t> CompleteSteps();
  /// Load the newest complete step into `state`; returns it, or nullopt if there is none.
  std::optional<int64_t> Restore(StateDict& state, const LoadOptions& options = {});
  /// Directory of a step.
  std::string PathFor(int64_t step) const;
  /// Wait for the last save and stop; raises its error. Idempotent.
  void Close();

 private:
  std::vector<int64_t> ScanCompleteSteps() const;  // rank 0 only
  void AfterSaveEnded();                           // latest + retention, rank 0 acting
  std::string root_;
  Communicator& comm_;
  ManagerOptions options_;
  std::unique_ptr<AsyncCheckpointer> saver_;
  std::shared_ptr<AsyncSave> in_flight_;
  int64_t in_flight_step_ = -1;
  int64_t last_step_ = -1;
  bool closed_ = false;
};

}  // namespace dcp
