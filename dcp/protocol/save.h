// Internal to dcp/ (not installed): one rank's part of one save, the save protocol of
// docs/PROTOCOL.md (plan cache, plan, write and commit). Save (dcp/checkpoint.h) states the
// contract; this is it for a state dict without bindings.
#pragma once

#include "dcp/checkpoint.h"

namespace dcp::protocol {

SaveResult RunSave(const StateDict& state_dict, StorageWriter& writer, Communicator& comm,
                   const SaveOptions& options);

}  // namespace dcp::protocol
