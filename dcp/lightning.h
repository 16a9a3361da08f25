// Lightning-style checkpoint I/O (PyTorch Lightning's CheckpointIO and AsyncCheckpointIO), as
// thin wrappers over dcp::Save, dcp::Load, dcp::LoadAll and the AsyncCheckpointer: a trainer
// framework that speaks CheckpointIO plugs dcp in without learning its API.
//
// Every call is collective (all ranks, same order) like the functions it wraps, and raises what
// they raise (a CollectiveError on every rank alike). Not thread-safe: one call at a time.
#pragma once

#include <memory>
#include <string>

#include "dcp/async_checkpointer.h"
#include "dcp/checkpoint.h"
#include "dcp/communicator.h"
#include "dcp/options.h"

namespace dcp {

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
