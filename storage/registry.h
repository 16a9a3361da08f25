// Storage backends by URI scheme.
//
//   file:///abs/path, or a plain path   a directory on a POSIX filesystem (built in)
//   mem://name                          process-local memory, shared by every rank in the process
//                                       (built in; for tests, tools, and as the tutorial)
// User code registers more with RegisterStorageBackend (a full StorageWriter/Reader) or
// RegisterStoreBackend (a Store; the checkpoint protocol comes for free). LoadStoragePlugin
// dlopen()s a shared library whose initialiser registers backends.
//
// Thread-safe: registration and lookup may happen from any thread.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"

namespace dcp {

struct StorageBackend {
  std::string scheme;  // "s3", "mem", ... (lowercase, no "://")
  std::function<std::unique_ptr<StorageWriter>(const std::string& location,
                                               const StorageOptions& options)>
      make_writer;
  std::function<std::unique_ptr<StorageReader>(const std::string& location,
                                               const StorageOptions& options)>
      make_reader;
};

/// Register a backend. AlreadyExistsError when the scheme is taken, unless `replace`.
void RegisterStorageBackend(StorageBackend backend, bool replace = false);
/// Register a Store-based backend: `open(location)` returns the store for a location.
void RegisterStoreBackend(const std::string& scheme,
                          std::function<std::shared_ptr<Store>(const std::string& location)> open,
                          bool replace = false);
/// Schemes currently registered, sorted.
std::vector<std::string> RegisteredSchemes();

/// Split "scheme://location"; a string without "://" is a file path ("file", path).
std::pair<std::string, std::string> SplitUri(const std::string& uri);

/// Writer/reader for a URI. InvalidArgumentError for an unknown scheme (the message lists the
/// registered ones).
std::unique_ptr<StorageWriter> OpenStorageWriter(const std::string& uri,
                                                 const StorageOptions& options = {});
std::unique_ptr<StorageReader> OpenStorageReader(const std::string& uri,
                                                 const StorageOptions& options = {});
/// The Store behind a Store-based URI (file://, mem://, or one registered with
/// RegisterStoreBackend); InvalidArgumentError for schemes registered as full backends.
std::shared_ptr<Store> OpenStore(const std::string& uri);

/// Load a shared library that registers backends from a static initialiser or from an
/// exported `extern "C" void dcp_register_storage()`. IoError naming the library on failure.
void LoadStoragePlugin(const std::string& library_path);

}  // namespace dcp
