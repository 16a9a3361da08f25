// Storage backends by URI scheme.
//
//   file:///abs/path, or a plain path   a directory on a POSIX filesystem (built in)
//   mem://name                          process-local memory, shared by every rank in the process
//                                       (built in; for tests, tools, and as the tutorial)
//   s3://bucket/prefix                  S3 or an S3-compatible server (built in when libcurl and
//                                       OpenSSL are found; storage/backends/s3/s3_store.h)
//   torchdcp://path, torchdcp113://path file:// writing the PyTorch DCP format (aliases of
//                                       file://path?format=torchdcp and ...=torchdcp113)
// User code registers more with RegisterBackend, the one registration verb: given a Store opener
// (the checkpoint protocol and every format come for free), or a full StorageWriter/Reader pair.
// LoadStoragePlugin dlopen()s a shared library whose initialiser registers backends.
//
// A URI may carry a query: `scheme://location?key=value&key=value` (values %-escaped where
// needed), and so may a plain path, exactly as its file:// form (`/ckpt/hf?format=safetensors`
// is `file:///ckpt/hf?format=safetensors`): the first '?' starts the query, so no location, path
// or not, holds a '?'. `format` (dcp, torchdcp, torchdcp113, safetensors) chooses
// the layout a writer writes, on any Store-based backend; every other key is a backend option
// (StorageOptions::backend gives the same from code):
//   file://   direct_io=0|1 (default: on, or DCP_DIRECT_IO)
//   s3://     endpoint, region, target_gbps, max_connections, part_size_mib, parts_in_flight,
//             read_ahead_parts, max_retries,
//             lock_lease_s, sign_payload, request_timeout_s (defaults: the DCP_S3_* / AWS_*
//             environment, storage/backends/s3/s3_store.h); credentials only from the environment
//   mem://    none
// A key the backend does not know is an InvalidArgumentError naming it, and so is a query that
// is not key=value pairs (`/data/run?1`).
//
// Thread-safe: registration and lookup may happen from any thread.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dcp/storage/storage.h"
#include "dcp/storage/store.h"

namespace dcp {

/// A backend's settings as key -> value strings (BackendOptionReader reads them).
using BackendOptionMap = std::map<std::string, std::string>;

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
void RegisterBackend(StorageBackend backend, bool replace = false);
/// Opens the store at `location` with the backend options (from the URI's query and
/// StorageOptions::backend). It reads them through a BackendOptionReader and calls Done(), so
/// an unknown key is refused.
using StoreOpener = std::function<std::shared_ptr<Store>(const std::string& location,
                                                         const BackendOptionMap& options)>;
/// Register a Store-based backend: `open` returns the store for a location; every format can
/// then be written there.
void RegisterBackend(const std::string& scheme, StoreOpener open, bool replace = false);
/// The same for a backend without options (any option given is refused).
void RegisterBackend(const std::string& scheme,
                     std::function<std::shared_ptr<Store>(const std::string& location)> open,
                     bool replace = false);
/// Schemes currently registered (aliases included), sorted.
std::vector<std::string> RegisteredSchemes();

struct ParsedUri {
  std::string scheme;  // lowercase; "file" for a plain path
  std::string location;
  BackendOptionMap query;  // decoded
};
/// Split "scheme://location?query"; a string without "://" is a file path with an optional
/// query ("file", path, query), as its file:// form. InvalidArgumentError for a malformed query.
ParsedUri ParseUri(const std::string& uri);
/// ParseUri's scheme and location (the query dropped).
std::pair<std::string, std::string> SplitUri(const std::string& uri);
/// `uri` with `child` appended to its location, its query kept: JoinUri("s3://b/x?a=1", "y") is
/// "s3://b/x/y?a=1", and JoinUri("/d/x?a=1", "y") is "/d/x/y?a=1".
std::string JoinUri(const std::string& uri, const std::string& child);

/// Writer/reader for a URI. InvalidArgumentError for an unknown scheme (the message lists the
/// registered ones).
std::unique_ptr<StorageWriter> OpenStorageWriter(const std::string& uri,
                                                 const StorageOptions& options = {});
std::unique_ptr<StorageReader> OpenStorageReader(const std::string& uri,
                                                 const StorageOptions& options = {});
/// The Store behind a Store-based URI (file://, mem://, or one registered with
/// RegisterBackend), with the URI's query and `options` as backend options (`format` is
/// accepted and has no effect on a store); InvalidArgumentError for schemes registered as full
/// backends.
std::shared_ptr<Store> OpenStore(const std::string& uri, const BackendOptionMap& options = {});
/// OpenStore for reading a checkpoint, as OpenStorageReader opens it: a URI whose location
/// names an existing `*.safetensors` object (file:///m/model-00001-of-00002.safetensors,
/// s3://b/m/model.safetensors) is a read-only view of its parent in which only that object
/// exists, so that one Hugging Face safetensors file loads by its own name (docs/SAFETENSORS.md).
std::shared_ptr<Store> OpenStoreForReading(const std::string& uri,
                                           const BackendOptionMap& options = {});

/// Load a shared library that registers backends from a static initialiser or from an
/// exported `extern "C" void dcp_register_storage()`. IoError naming the library on failure.
void LoadStoragePlugin(const std::string& library_path);

// ---------------------------------------------------------------------------------------------
// Settings of one storage backend as strings: from a URI's query
// (`s3://bucket/ckpt?part_size_mib=16&parts_in_flight=8`) or StorageOptions::backend. A backend
// reads the keys it knows through BackendOptionReader and calls Done(), which refuses every key
// it did not read: a misspelt option fails instead of being ignored.
//
// Not thread-safe; used while a backend is opened.

class BackendOptionReader {
 public:
  /// `backend` names the backend in messages ("s3://").
  BackendOptionReader(std::string backend, const BackendOptionMap& options);

  std::optional<std::string> String(const std::string& key);
  /// "1", "true", "yes", "on" / "0", "false", "no", "off"; InvalidArgumentError otherwise.
  std::optional<bool> Bool(const std::string& key);
  /// A decimal integer in [min, max]; InvalidArgumentError naming the key otherwise.
  std::optional<int64_t> Int(const std::string& key, int64_t min, int64_t max);
  /// InvalidArgumentError naming every key that was not read, and the keys that were asked for.
  void Done() const;

 private:
  std::optional<std::string> Take(const std::string& key);
  std::string backend_;
  const BackendOptionMap& options_;
  std::set<std::string> asked_;
};

}  // namespace dcp
