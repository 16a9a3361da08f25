// Store: the byte-level object interface under the generic checkpoint writer and reader.
//
// A backend that implements Store (a directory, memory, an archive, a key-value service) gets
// the whole checkpoint protocol (file layout, checksums, atomic metadata commit, overwrite
// handling) from MakeStoreWriter/MakeStoreReader; see docs and storage/mem_store.cc, the
// tutorial backend. Names are relative ("metadata.dcp", "data-....data"), without "/" prefix.
//
// Thread safety: a Store may be used from several threads at once (different objects). One
// WritableObject or ReadableObject is used by one thread at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dcp {

/// An object being written. It becomes visible under its name at Close() at the latest;
/// destroying it without Close() discards it (nothing partial remains under the name).
class WritableObject {
 public:
  virtual ~WritableObject() = default;
  virtual void Append(const void* data, size_t n) = 0;
  /// Make everything appended so far durable.
  virtual void Sync() = 0;
  virtual void Close() = 0;
  virtual uint64_t size() const = 0;
};

class ReadableObject {
 public:
  virtual ~ReadableObject() = default;
  /// Read exactly n bytes at offset into dst; CorruptionError (naming the object) when the
  /// object is shorter, IoError when the device fails.
  virtual void ReadAt(uint64_t offset, void* dst, size_t n) = 0;
  virtual uint64_t size() const = 0;
  /// A hint that [offset, offset + n) will be read soon: a backend may start fetching it in
  /// large requests (file://: posix_fadvise WILLNEED), so that the ReadAt calls that follow in
  /// smaller steps find it arriving. Never fails; the default does nothing.
  virtual void Prefetch(uint64_t /*offset*/, uint64_t /*n*/) noexcept {}
};

class Store {
 public:
  virtual ~Store() = default;
  /// The store's URI, e.g. "file:///ckpt/step100" or "mem://test", for messages.
  virtual std::string uri() const = 0;
  /// Make sure the container exists (idempotent).
  virtual void CreateRoot() = 0;
  /// Start a new object, replacing any previous one of that name when closed.
  virtual std::unique_ptr<WritableObject> Create(const std::string& name) = 0;
  /// Open an existing object; NotFoundError when absent.
  virtual std::unique_ptr<ReadableObject> Open(const std::string& name) = 0;
  /// Size of an object, or nullopt when it does not exist.
  virtual std::optional<uint64_t> Size(const std::string& name) = 0;
  /// Write `bytes` under `name` so that readers see either the previous object or all of the new
  /// one, never a mix, and the result is durable when this returns (for a directory: write a
  /// temporary file, fsync, rename, fsync the directory).
  virtual void PublishAtomically(const std::string& name, std::string_view bytes) = 0;
  /// Names of all objects (no particular order).
  virtual std::vector<std::string> List() = 0;
  /// Remove an object; removing an absent one is not an error.
  virtual void Remove(const std::string& name) = 0;

  /// Read a whole object.
  std::string ReadAll(const std::string& name);
};

}  // namespace dcp
