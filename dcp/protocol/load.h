// Internal to dcp/ (not installed): one rank's part of one load, the load protocol of
// docs/PROTOCOL.md (metadata, plan, read). Load and LoadAll (dcp/checkpoint.h) state the
// contract; this is it for checked options and a state dict without bindings.
#pragma once

#include "dcp/checkpoint.h"

namespace dcp::protocol {

// `load_all`: the state dict is replaced by every entry of the checkpoint (LoadAll).
LoadResult RunLoad(StateDict& state_dict, StorageReader& reader, Communicator& comm,
                   const LoadOptions& options, bool load_all);

}  // namespace dcp::protocol
