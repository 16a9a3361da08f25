#include "dcp/storage/registry.h"

#include <dlfcn.h>

#include <algorithm>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string_view>

#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/storage/builtin.h"
#include "dcp/storage/sibling_store.h"

namespace dcp {

namespace {

// A scheme that is another scheme's store written in a given format (torchdcp:// = file:// with
// format=torchdcp), kept for the URIs users already have.
struct FormatAlias {
  std::string scheme;
  CheckpointFormat format;
};

struct Registry {
  std::mutex mu;
  std::map<std::string, StorageBackend> backends;
  std::map<std::string, StoreOpener> stores;
  std::map<std::string, FormatAlias> aliases;
};

void RegisterInto(Registry& reg, StorageBackend backend, bool replace) {
  if (backend.scheme.empty() || !backend.make_writer || !backend.make_reader) {
    throw InvalidArgumentError("storage backend '" + backend.scheme +
                               "' needs a scheme, a writer factory and a reader factory");
  }
  if (!replace && (reg.backends.count(backend.scheme) || reg.aliases.count(backend.scheme))) {
    throw AlreadyExistsError("storage scheme '" + backend.scheme + "' is already registered");
  }
  reg.aliases.erase(backend.scheme);
  reg.backends[backend.scheme] = std::move(backend);
}

// The store a reader of `location` reads: a location naming one object that is a checkpoint by
// itself is a read-only view of its parent holding only that object (the layout decides:
// CheckpointLayout::OpenSingleObject); anything else is the store at `location`.
// The store at `location`, reaching the checkpoints beside it (version 3's sibling references,
// storage/sibling_store.h) through the same opener and options.
std::shared_ptr<Store> OpenWithSiblings(const StoreOpener& open, const std::string& location,
                                        const BackendOptionMap& options) {
  return std::make_shared<SiblingStore>(open(location, options),
                                        [open, location, options](const std::string& name) {
                                          return open(SiblingLocation(location, name), options);
                                        });
}

std::shared_ptr<Store> OpenForReading(const StoreOpener& open, const std::string& scheme,
                                      const std::string& location,
                                      const BackendOptionMap& options) {
  auto open_at = [&](const std::string& where) { return open(where, options); };
  if (auto view = OpenSingleObjectCheckpoint(open_at, scheme, location)) return view;
  return OpenWithSiblings(open, location, options);
}

void RegisterStoreInto(Registry& reg, const std::string& scheme, StoreOpener open, bool replace) {
  StorageBackend b;
  b.scheme = scheme;
  b.make_writer = [open](const std::string& loc, const StorageOptions& o) {
    return MakeStoreWriter(OpenWithSiblings(open, loc, o.backend), o);
  };
  b.make_reader = [open, scheme](const std::string& loc, const StorageOptions& o) {
    return MakeStoreReader(OpenForReading(open, scheme, loc, o.backend), o);
  };
  RegisterInto(reg, std::move(b), replace);
  reg.stores[scheme] = std::move(open);
}

// Built-ins are registered on first use rather than by static initialisers, so they exist
// whatever the link order and however the library is loaded.
Registry& GetRegistry() {
  static Registry* reg = [] {
    auto* r = new Registry();
    RegisterStoreInto(*r, "file", OpenFileBackend, false);
    RegisterStoreInto(*r, "mem", OpenMemBackend, false);
#ifdef DCP_HAVE_S3
    // s3://bucket/prefix (storage/backends/s3/s3_store.h); configured from the AWS_* environment
    // and the URI's options.
    RegisterStoreInto(*r, "s3", OpenS3Backend, false);
#endif
    r->aliases["torchdcp"] = {"file", CheckpointFormat::kTorchDcp};
    r->aliases["torchdcp113"] = {"file", CheckpointFormat::kTorchDcp113};
    return r;
  }();
  return *reg;
}

// Called with reg.mu held.
std::string KnownSchemes(const Registry& reg) {
  std::set<std::string> names;
  for (const auto& [name, b] : reg.backends) names.insert(name);
  for (const auto& [name, a] : reg.aliases) names.insert(name);
  std::string s;
  for (const auto& name : names) s += (s.empty() ? "" : ", ") + name + "://";
  return s;
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

std::string PercentDecode(std::string_view s, const std::string& uri) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] != '%') {
      out += s[i];
      continue;
    }
    if (i + 2 >= s.size() || HexDigit(s[i + 1]) < 0 || HexDigit(s[i + 2]) < 0) {
      throw InvalidArgumentError("malformed %-escape in the query of '" + uri + "'");
    }
    out += static_cast<char>(HexDigit(s[i + 1]) * 16 + HexDigit(s[i + 2]));
    i += 2;
  }
  return out;
}

// What opening `uri` with `options` means: the backend's scheme, its location, and the options
// with the URI's query and the alias's format applied.
struct Resolved {
  std::string scheme;
  std::string location;
  StorageOptions options;
};

Resolved Resolve(Registry& reg, const std::string& uri, const StorageOptions& given) {
  ParsedUri parsed = ParseUri(uri);
  Resolved r{std::move(parsed.scheme), std::move(parsed.location), given};
  std::optional<CheckpointFormat> format;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    auto alias = reg.aliases.find(r.scheme);
    if (alias != reg.aliases.end()) {
      r.scheme = alias->second.scheme;
      format = alias->second.format;
    }
  }
  for (auto& [key, value] : parsed.query) {
    if (key == "format") {
      const CheckpointFormat f = ParseCheckpointFormat(value);
      if (format && *format != f) {
        throw InvalidArgumentError("'" + uri + "' names two formats");
      }
      format = f;
      continue;
    }
    auto [it, fresh] = r.options.backend.emplace(key, value);
    if (!fresh && it->second != value) {
      throw InvalidArgumentError("backend option " + key + " is '" + it->second +
                                 "' in the options and '" + value + "' in '" + uri + "'");
    }
  }
  if (format) {
    if (given.format != CheckpointFormat::kDcp && given.format != *format) {
      throw InvalidArgumentError(
          "'" + uri + "' asks for format " + std::string(CheckpointFormatName(*format)) +
          " and the options for " + std::string(CheckpointFormatName(given.format)));
    }
    r.options.format = *format;
  }
  return r;
}

StorageBackend FindBackend(Registry& reg, const std::string& scheme, const std::string& uri) {
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.backends.find(scheme);
  if (it == reg.backends.end()) {
    throw InvalidArgumentError("no storage backend for '" + uri +
                               "' (registered: " + KnownSchemes(reg) + ")");
  }
  return it->second;
}

}  // namespace

void RegisterBackend(StorageBackend backend, bool replace) {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.stores.erase(backend.scheme);
  RegisterInto(reg, std::move(backend), replace);
}

void RegisterBackend(const std::string& scheme, StoreOpener open, bool replace) {
  Registry& reg = GetRegistry();
  std::lock_guard<std::mutex> lock(reg.mu);
  RegisterStoreInto(reg, scheme, std::move(open), replace);
}

void RegisterBackend(const std::string& scheme,
                     std::function<std::shared_ptr<Store>(const std::string& location)> open,
                     bool replace) {
  RegisterBackend(scheme,
                  StoreOpener([open = std::move(open), scheme](const std::string& location,
                                                               const BackendOptionMap& options) {
                    BackendOptionReader(scheme + "://", options).Done();
                    return open(location);
                  }),
                  replace);
}

std::vector<std::string> RegisteredSchemes() {
  Registry& reg = GetRegistry();
  std::vector<std::string> out;
  {
    std::lock_guard<std::mutex> lock(reg.mu);
    for (const auto& [name, b] : reg.backends) out.push_back(name);
    for (const auto& [name, a] : reg.aliases) out.push_back(name);
  }
  std::sort(out.begin(), out.end());
  return out;
}

ParsedUri ParseUri(const std::string& uri) {
  ParsedUri p;
  const size_t pos = uri.find("://");
  // A plain path is file://'s location: its query, from the first '?', is parsed alike (before,
  // '?' was part of the path, and "/x/hf?format=safetensors" named a directory of that name).
  const size_t from = pos == std::string::npos ? 0 : pos + 3;
  if (pos == std::string::npos) {
    p.scheme = "file";
  } else {
    p.scheme = uri.substr(0, pos);
    std::transform(p.scheme.begin(), p.scheme.end(), p.scheme.begin(), ::tolower);
  }
  const size_t q = uri.find('?', from);
  p.location = uri.substr(from, q == std::string::npos ? std::string::npos : q - from);
  if (q == std::string::npos) return p;
  std::string_view query(uri);
  query.remove_prefix(q + 1);
  while (!query.empty()) {
    const size_t amp = query.find('&');
    const std::string_view param = query.substr(0, amp);
    query = amp == std::string_view::npos ? std::string_view() : query.substr(amp + 1);
    if (param.empty()) continue;
    const size_t eq = param.find('=');
    if (eq == std::string_view::npos || eq == 0) {
      throw InvalidArgumentError("query parameter '" + std::string(param) + "' of '" + uri +
                                 "' is not key=value (in a URI and in a plain path alike, as in "
                                 "file://DIR?direct_io=0, '?' starts the query: a location cannot "
                                 "hold '?')");
    }
    std::string key = PercentDecode(param.substr(0, eq), uri);
    if (p.query.count(key)) {
      throw InvalidArgumentError("query parameter '" + key + "' appears twice in '" + uri + "'");
    }
    p.query[std::move(key)] = PercentDecode(param.substr(eq + 1), uri);
  }
  return p;
}

std::pair<std::string, std::string> SplitUri(const std::string& uri) {
  ParsedUri p = ParseUri(uri);
  return {std::move(p.scheme), std::move(p.location)};
}

std::string JoinUri(const std::string& uri, const std::string& child) {
  const size_t pos = uri.find("://");
  const size_t q = uri.find('?', pos == std::string::npos ? 0 : pos + 3);
  if (q == std::string::npos) return uri + "/" + child;
  return uri.substr(0, q) + "/" + child + uri.substr(q);
}

std::unique_ptr<StorageWriter> OpenStorageWriter(const std::string& uri,
                                                 const StorageOptions& options) {
  Registry& reg = GetRegistry();
  Resolved r = Resolve(reg, uri, options);
  return FindBackend(reg, r.scheme, uri).make_writer(r.location, r.options);
}

std::unique_ptr<StorageReader> OpenStorageReader(const std::string& uri,
                                                 const StorageOptions& options) {
  Registry& reg = GetRegistry();
  Resolved r = Resolve(reg, uri, options);
  return FindBackend(reg, r.scheme, uri).make_reader(r.location, r.options);
}

namespace {

// The Store opener serving `uri` and what it is to open (InvalidArgumentError for a scheme
// whose backend is a writer/reader pair, not a Store).
std::pair<Resolved, StoreOpener> StoreOpenerFor(const std::string& uri,
                                                const BackendOptionMap& options) {
  Registry& reg = GetRegistry();
  StorageOptions given;
  given.backend = options;
  Resolved r = Resolve(reg, uri, given);
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.stores.find(r.scheme);
  if (it == reg.stores.end()) {
    throw InvalidArgumentError("'" + uri + "' is not served by a Store-based backend");
  }
  return {std::move(r), it->second};
}

}  // namespace

std::shared_ptr<Store> OpenStore(const std::string& uri, const BackendOptionMap& options) {
  auto [r, open] = StoreOpenerFor(uri, options);
  return OpenWithSiblings(open, r.location, r.options.backend);
}

std::shared_ptr<Store> OpenStoreForReading(const std::string& uri,
                                           const BackendOptionMap& options) {
  auto [r, open] = StoreOpenerFor(uri, options);
  return OpenForReading(open, r.scheme, r.location, r.options.backend);
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
