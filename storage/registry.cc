#include "dcp/storage/registry.h"

#include <dlfcn.h>

#include <algorithm>
#include <map>
#include <mutex>

#include "dcp/proto/error.h"
#include "dcp/storage/file_store.h"
#include "dcp/storage/mem_store.h"
#ifdef DCP_HAVE_S3
#include "dcp/storage/s3/s3_store.h"
#endif
#include "dcp/storage/store_checkpoint.h"

namespace dcp {

std::string Store::ReadAll(const std::string& name) {
  auto obj = Open(name);
  std::string out(obj->size(), '\0');
  obj->ReadAt(0, out.data(), out.size());
  return out;
}

// No conditional create by default: the writer lock is the exclusion (store.h).
void Store::PublishNew(const std::string& name, std::string_view bytes) {
  PublishAtomically(name, bytes);
}

// No primitive by default: the writer then runs without exclusion (documented in store.h).
std::unique_ptr<StoreLock> Store::TryLock(const std::string&) { return nullptr; }

namespace {

struct Registry {
  std::mutex mu;
  std::map<std::string, StorageBackend> backends;
  std::map<std::string, std::function<std::shared_ptr<Store>(const std::string&)>> stores;
};

void RegisterInto(Registry& reg, StorageBackend backend, bool replace) {
  if (backend.scheme.empty() || !backend.make_writer || !backend.make_reader) {
    throw InvalidArgumentError("storage backend '" + backend.scheme +
                               "' needs a scheme, a writer factory and a reader factory");
  }
  if (!replace && reg.backends.count(backend.scheme)) {
    throw AlreadyExistsError("storage scheme '" + backend.scheme + "' is already registered");
  }
  reg.backends[backend.scheme] = std::move(backend);
}

void RegisterStoreInto(Registry& reg, const std::string& scheme,
                       std::function<std::shared_ptr<Store>(const std::string&)> open,
                       bool replace) {
  StorageBackend b;
  b.scheme = scheme;
  b.make_writer = [open](const std::string& loc, const StorageOptions& o) {
    return MakeStoreWriter(open(loc), o);
  };
  b.make_reader = [open](const std::string& loc, const StorageOptions& o) {
    return MakeStoreReader(open(loc), o);
  };
  RegisterInto(reg, std::move(b), replace);
  reg.stores[scheme] = std::move(open);
}

// Built-ins are registered on first use rather than by static initialisers, so they exist
// whatever the link order and however the library is loaded.
Registry& GetRegistry() {
  static Registry* reg = [] {
    auto* r = new Registry();
    RegisterStoreInto(
        *r, "file", [](const std::string& loc) { return MakeFileStore(loc); }, false);
    RegisterStoreInto(
        *r, "mem", [](const std::string& loc) { return MakeMemStore(loc); }, false);
#ifdef DCP_HAVE_S3
    // s3://bucket/prefix (storage/s3/s3_store.h); configured from the AWS_* environment.
    RegisterStoreInto(
        *r, "s3", [](const std::string& loc) { return MakeS3Store(loc); }, false);
#endif
    // PyTorch DCP directories: written in torch's layout (2.x, or 1.13 for old torch); read
    // like any directory (file:// recognises them too).
    for (const auto& [scheme, format] :
         {std::pair{"torchdcp", CheckpointFormat::kTorchDcp},
          std::pair{"torchdcp113", CheckpointFormat::kTorchDcp113}}) {
      StorageBackend b;
      b.scheme = scheme;
      b.make_writer = [format = format](const std::string& loc, const StorageOptions& o) {
        return MakeStoreWriter(MakeFileStore(loc), o, format);
      };
      b.make_reader = [](const std::string& loc, const StorageOptions& o) {
        return MakeStoreReader(MakeFileStore(loc), o);
      };
      RegisterInto(*r, std::move(b), false);
      r->stores[scheme] = [](const std::string& loc) { return MakeFileStore(loc); };
    }
    return r;
  }();
  return *reg;
}

std::string KnownSchemes(Registry& reg) {
  std::string s;
  for (const auto& [name, b] : reg.backends) s += (s.empty() ? "" : ", ") + name + "://";
  return s;
}

}  // namespace

void RegisterStorageBackend(StorageBackend backend, bool replace) {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.stores.erase(backend.scheme);
  RegisterInto(reg, std::move(backend), replace);
}

void RegisterStoreBackend(const std::string& scheme,
                          std::function<std::shared_ptr<Store>(const std::string& location)> open,
                          bool replace) {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  RegisterStoreInto(reg, scheme, std::move(open), replace);
}

std::vector<std::string> RegisteredSchemes() {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::vector<std::string> out;
  for (const auto& [name, b] : reg.backends) out.push_back(name);
  return out;
}

std::pair<std::string, std::string> SplitUri(const std::string& uri) {
  const size_t pos = uri.find("://");
  if (pos == std::string::npos) return {"file", uri};
  std::string scheme = uri.substr(0, pos);
  std::transform(scheme.begin(), scheme.end(), scheme.begin(), ::tolower);
  return {scheme, uri.substr(pos + 3)};
}

std::unique_ptr<StorageWriter> OpenStorageWriter(const std::string& uri,
                                                 const StorageOptions& options) {
  auto [scheme, location] = SplitUri(uri);
  Registry& reg = GetRegistry();
  StorageBackend backend;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.backends.find(scheme);
    if (it == reg.backends.end()) {
      throw InvalidArgumentError("no storage backend for '" + uri +
                                 "' (registered: " + KnownSchemes(reg) + ")");
    }
    backend = it->second;
  }
  return backend.make_writer(location, options);
}

std::unique_ptr<StorageReader> OpenStorageReader(const std::string& uri,
                                                 const StorageOptions& options) {
  auto [scheme, location] = SplitUri(uri);
  Registry& reg = GetRegistry();
  StorageBackend backend;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.backends.find(scheme);
    if (it == reg.backends.end()) {
      throw InvalidArgumentError("no storage backend for '" + uri +
                                 "' (registered: " + KnownSchemes(reg) + ")");
    }
    backend = it->second;
  }
  return backend.make_reader(location, options);
}

std::shared_ptr<Store> OpenStore(const std::string& uri) {
  auto [scheme, location] = SplitUri(uri);
  Registry& reg = GetRegistry();
  std::function<std::shared_ptr<Store>(const std::string&)> open;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.stores.find(scheme);
    if (it == reg.stores.end()) {
      throw InvalidArgumentError("'" + uri + "' is not served by a Store-based backend");
    }
    open = it->second;
  }
  return open(location);
}

void LoadStoragePlugin(const std::string& library_path) {
  GetRegistry();  // built-ins first, so a plugin cannot silently take their schemes
  void* handle = ::dlopen(library_path.c_str(), RTLD_NOW | RTLD_GLOBAL);
  if (handle == nullptr) {
    const char* err = ::dlerror();
    throw IoError("cannot load storage plugin '" + library_path + "': " + (err ? err : "?"), false);
  }
  using RegisterFn = void (*)();
  if (auto fn = reinterpret_cast<RegisterFn>(::dlsym(handle, "dcp_register_storage"))) fn();
}

}  // namespace dcp
