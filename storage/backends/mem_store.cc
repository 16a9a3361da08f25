// The in-memory backend, and the tutorial for writing a Store.
//
// A Store needs seven operations (see storage/store.h). This one keeps objects as strings in a
// map shared by every Store opened with the same mem:// name, so ranks running as threads of one
// process see one another's writes, as ranks on a shared filesystem do.
//
// Optional, an eighth: TryLock, the one-writer-per-location lock (here a flag in the bucket).
//
// Three rules every Store must keep, and how this one keeps them:
//  1. A written object is invisible until Close(): MemWritable appends to a private buffer and
//     inserts it into the map at Close(); destroying it earlier discards the buffer.
//  2. PublishAtomically is all-or-nothing: the map is swapped under a mutex, so a reader sees the
//     old object or the new one.
//  3. Errors are typed: a missing object is NotFoundError, a short object CorruptionError.
// Registering the scheme takes one call (see storage/registry.cc):
//   RegisterBackend("mem", [](const std::string& name) { return MakeMemStore(name); });
#include "dcp/storage/backends/mem_store.h"

#include <cstring>
#include <map>
#include <mutex>

#include "dcp/proto/error.h"
#include "dcp/storage/builtin.h"

namespace dcp {

namespace {

struct Bucket {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<const std::string>> objects;
  // The writer lock (Store::TryLock): in-process, so it dies with the process that holds it.
  bool locked = false;
  std::string holder;
};

class MemLock : public StoreLock {
 public:
  MemLock(std::shared_ptr<Bucket> bucket, std::string holder)
      : bucket_(std::move(bucket)), holder_(std::move(holder)) {}
  ~MemLock() override { Release(); }
  void Release() override {
    if (!bucket_) return;
    std::lock_guard<std::mutex> lock(bucket_->mu);
    bucket_->locked = false;
    bucket_->holder.clear();
    bucket_.reset();
  }
  std::string holder() const override { return holder_; }

 private:
  std::shared_ptr<Bucket> bucket_;
  std::string holder_;
};

std::mutex g_buckets_mu;
std::map<std::string, std::shared_ptr<Bucket>>& Buckets() {
  static auto* buckets = new std::map<std::string, std::shared_ptr<Bucket>>();
  return *buckets;
}

class MemWritable : public WritableObject {
 public:
  MemWritable(std::shared_ptr<Bucket> bucket, std::string name)
      : bucket_(std::move(bucket)), name_(std::move(name)) {}
  void Append(const void* data, size_t n) override {
    buffer_.append(static_cast<const char*>(data), n);
  }
  void Sync() override {}  // memory is as durable as it gets
  void Close() override {
    auto value = std::make_shared<const std::string>(std::move(buffer_));
    std::lock_guard<std::mutex> lock(bucket_->mu);
    bucket_->objects[name_] = std::move(value);
  }
  uint64_t size() const override { return buffer_.size(); }

 private:
  std::shared_ptr<Bucket> bucket_;
  std::string name_;
  std::string buffer_;
};

class MemReadable : public ReadableObject {
 public:
  MemReadable(std::string uri, std::shared_ptr<const std::string> data)
      : uri_(std::move(uri)), data_(std::move(data)) {}
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    if (offset > data_->size() || n > data_->size() - offset) {
      throw CorruptionError("object '" + uri_ + "' is truncated: need " + std::to_string(n) +
                            " bytes at offset " + std::to_string(offset) + " but it has " +
                            std::to_string(data_->size()));
    }
    std::memcpy(dst, data_->data() + offset, n);
  }
  uint64_t size() const override { return data_->size(); }

 private:
  std::string uri_;
  std::shared_ptr<const std::string> data_;  // a snapshot: later writes do not affect it
};

class MemStore : public Store {
 public:
  MemStore(std::string name, std::shared_ptr<Bucket> bucket)
      : name_(std::move(name)), bucket_(std::move(bucket)) {}
  std::string uri() const override { return "mem://" + name_; }
  void CreateRoot() override {}
  std::unique_ptr<WritableObject> Create(const std::string& name) override {
    return std::make_unique<MemWritable>(bucket_, name);
  }
  std::unique_ptr<ReadableObject> Open(const std::string& name) override {
    std::lock_guard<std::mutex> lock(bucket_->mu);
    auto it = bucket_->objects.find(name);
    if (it == bucket_->objects.end()) {
      throw NotFoundError("object '" + uri() + "/" + name + "' does not exist");
    }
    return std::make_unique<MemReadable>(uri() + "/" + name, it->second);
  }
  std::optional<uint64_t> Size(const std::string& name) override {
    std::lock_guard<std::mutex> lock(bucket_->mu);
    auto it = bucket_->objects.find(name);
    if (it == bucket_->objects.end()) return std::nullopt;
    return it->second->size();
  }
  void PublishAtomically(const std::string& name, std::string_view bytes) override {
    auto value = std::make_shared<const std::string>(bytes);
    std::lock_guard<std::mutex> lock(bucket_->mu);
    bucket_->objects[name] = std::move(value);
  }
  std::vector<std::string> List() override {
    std::lock_guard<std::mutex> lock(bucket_->mu);
    std::vector<std::string> names;
    for (const auto& [n, v] : bucket_->objects) names.push_back(n);
    return names;
  }
  void Remove(const std::string& name) override {
    std::lock_guard<std::mutex> lock(bucket_->mu);
    bucket_->objects.erase(name);
  }
  std::unique_ptr<StoreLock> TryLock(const std::string& holder) override {
    std::lock_guard<std::mutex> lock(bucket_->mu);
    if (bucket_->locked) throw LockedError(uri(), bucket_->holder);
    bucket_->locked = true;
    bucket_->holder = holder;
    return std::make_unique<MemLock>(bucket_, holder);
  }

 private:
  std::string name_;
  std::shared_ptr<Bucket> bucket_;
};

}  // namespace

std::shared_ptr<Store> MakeMemStore(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_buckets_mu);
  auto& bucket = Buckets()[name];
  if (!bucket) bucket = std::make_shared<Bucket>();
  return std::make_shared<MemStore>(name, bucket);
}

void ClearMemStore(const std::string& name) {
  std::lock_guard<std::mutex> lock(g_buckets_mu);
  Buckets().erase(name);
}

std::shared_ptr<Store> OpenMemBackend(const std::string& location,
                                      const BackendOptionMap& options) {
  BackendOptionReader("mem://", options).Done();
  return MakeMemStore(location);
}

}  // namespace dcp
