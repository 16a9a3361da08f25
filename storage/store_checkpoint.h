// The checkpoint protocol over any Store: layout, checksums, atomic commit, overwrite.
//
// Layout of a checkpoint root (docs/FORMAT.md has the details):
//   metadata.dcp                          the commit marker: checksummed protobuf Metadata
//   data-<save_id>-r<rank>-b<bucket>.data raw item bytes, concatenated; located by the metadata
// Data files carry the save id, so a new save never touches the files of the checkpoint it
// replaces: the old checkpoint stays loadable until the new metadata is renamed over it, and its
// files are removed only afterwards.
#pragma once

#include <memory>

#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"

namespace dcp {

inline constexpr char kMetadataName[] = "metadata.dcp";

std::unique_ptr<StorageWriter> MakeStoreWriter(std::shared_ptr<Store> store,
                                               const StorageOptions& options);
std::unique_ptr<StorageReader> MakeStoreReader(std::shared_ptr<Store> store,
                                               const StorageOptions& options);

/// True for names the writer creates for data (so tools and clean-up never touch user files).
bool IsDataObjectName(const std::string& name);

}  // namespace dcp
