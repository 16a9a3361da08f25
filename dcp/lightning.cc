#include "dcp/async_checkpointer.h"

#include "dcp/checkpoint_files.h"
#include "dcp/proto/error.h"

namespace dcp {

void CheckpointIO::SaveCheckpoint(const StateDict& state, const std::string& path,
                                  const SaveOptions& options) {
  dcp::Save(state, path, comm_, options);
}

void CheckpointIO::LoadCheckpoint(const std::string& path, StateDict& state,
                                  const LoadOptions& options) {
  dcp::Load(state, path, comm_, options);
}

StateDict CheckpointIO::LoadCheckpoint(const std::string& path, const LoadOptions& options,
                                       const Device& map_location) {
  if (!map_location.is_cpu()) {
    throw UnsupportedError("map_location " + map_location.ToString() +
                           " is not supported here (host memory only)");
  }
  return dcp::LoadAll(path, comm_, options);
}

void CheckpointIO::RemoveCheckpoint(const std::string& path) {
  OnCoordinator(comm_, "remove-checkpoint", [&] {
    RemoveCheckpointFiles(path);
    return std::string();
  });
}

AsyncCheckpointIO::AsyncCheckpointIO(Communicator& comm,
                                     std::unique_ptr<Communicator> background_comm,
                                     AsyncOptions options)
    : CheckpointIO(comm), saver_(std::move(background_comm), std::move(options)) {}

void AsyncCheckpointIO::SaveCheckpoint(const StateDict& state, const std::string& path,
                                       const SaveOptions& options) {
  saver_.Save(state, path, options);
}

void AsyncCheckpointIO::LoadCheckpoint(const std::string& path, StateDict& state,
                                       const LoadOptions& options) {
  saver_.Wait();
  CheckpointIO::LoadCheckpoint(path, state, options);
}

StateDict AsyncCheckpointIO::LoadCheckpoint(const std::string& path, const LoadOptions& options,
                                            const Device& map_location) {
  saver_.Wait();
  return CheckpointIO::LoadCheckpoint(path, options, map_location);
}

void AsyncCheckpointIO::RemoveCheckpoint(const std::string& path) {
  saver_.Wait();
  CheckpointIO::RemoveCheckpoint(path);
}

void AsyncCheckpointIO::Teardown() { saver_.Close(); }

}  // namespace dcp
