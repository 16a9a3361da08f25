// The checkpoint protocol over any Store: atomic commit, overwrite, clean-up. Its entry points,
// MakeStoreWriter and MakeStoreReader, are declared in storage/builtin.h for the registry.
//
// How a checkpoint's files are named and encoded is its layout's (storage/format/layout.h; dcp's
// own: format/dcp_layout.h, docs/FORMAT.md). Data files carry the save id, so a new save never
// touches the files of the checkpoint it replaces: the old checkpoint stays loadable until the new
// metadata is renamed over it, and its files are removed only afterwards.
#pragma once

#include <memory>

#include "dcp/storage/builtin.h"
#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"

namespace dcp {

/// Independent store requests a checkpoint operation makes at once (the metadata check's size
/// queries, the clean-up's removals): each is a round trip on an object store.
inline constexpr size_t kStoreRequestsInFlight = 16;

}  // namespace dcp
