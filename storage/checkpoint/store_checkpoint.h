// The checkpoint protocol over any Store: atomic commit, overwrite, clean-up.
//
// How a checkpoint's files are named and encoded is its layout's (storage/format/layout.h; dcp's
// own: format/dcp_layout.h, docs/FORMAT.md). Data files carry the save id, so a new save never
// touches the files of the checkpoint it replaces: the old checkpoint stays loadable until the new
// metadata is renamed over it, and its files are removed only afterwards.
#pragma once

#include <memory>

#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"

namespace dcp {

/// Independent store requests a checkpoint operation makes at once (the metadata check's size
/// queries, the clean-up's removals): each is a round trip on an object store.
inline constexpr size_t kStoreRequestsInFlight = 16;

/// The checkpoint protocol over `store`, writing the layout `options.format` names
/// (storage/format/layout.h). A PyTorch DCP writer keeps the protocol (lock, atomic commit of
/// `.metadata` last, clean-up) and writes torch's layout: `__<rank>_<n>.<save>.distcp` files of
/// torch.save records; it refuses compression (torch cannot read it). Every writer refuses a
/// location that holds a checkpoint of another format (AlreadyExistsError).
std::unique_ptr<StorageWriter> MakeStoreWriter(std::shared_ptr<Store> store,
                                               const StorageOptions& options);
/// The reader of every layout: it detects the format from the metadata file it finds.
std::unique_ptr<StorageReader> MakeStoreReader(std::shared_ptr<Store> store,
                                               const StorageOptions& options);

}  // namespace dcp
