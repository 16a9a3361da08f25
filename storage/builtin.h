// What the URI registry (registry.cc) assembles, each part defined in the sub-folder that owns
// it: the built-in backends' openers (backends/), the checkpoint protocol over a Store
// (checkpoint/) and the layouts' single-object views (format/). Declared here, at the top of
// storage/, so that the registry includes none of its sub-folders: they include the top, never
// the other way (LevelDB's env.h declares what env_posix.cc defines). Internal, not installed.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "dcp/storage/registry.h"
#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"

namespace dcp {

// Built-in backends: their URI options are read with BackendOptionReader (a key the backend does
// not know is refused).
/// file:// and plain paths (backends/file_store.cc): `direct_io` (else DCP_DIRECT_IO decides).
std::shared_ptr<Store> OpenFileBackend(const std::string& location,
                                       const BackendOptionMap& options);
/// mem:// (backends/mem_store.cc): no options.
std::shared_ptr<Store> OpenMemBackend(const std::string& location,
                                      const BackendOptionMap& options);
/// s3://bucket/prefix (backends/s3/s3_store.cc; built with DCP_WITH_S3): configured from the
/// AWS_* environment and the options listed in registry.h; credentials are refused as options
/// (a URI ends up in logs and error messages).
std::shared_ptr<Store> OpenS3Backend(const std::string& location,
                                     const BackendOptionMap& options);

// The checkpoint protocol (checkpoint/).
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


// The layouts (format/).
/// Opens the store at a location of one scheme (the registry's opener, its options bound).
using StoreOpenFn = std::function<std::shared_ptr<Store>(const std::string& location)>;
/// The first layout's OpenSingleObject(open, scheme, location) that is not nullptr, else nullptr.
std::shared_ptr<Store> OpenSingleObjectCheckpoint(const StoreOpenFn& open,
                                                  const std::string& scheme,
                                                  const std::string& location);

}  // namespace dcp
