#include "kv_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <optional>
#include <random>

#include "dcp/proto/error.h"
#include "dcp/storage/registry.h"

namespace dcp_kv {

namespace {

using dcp::CorruptionError;
using dcp::MakeIoError;
using dcp::NotFoundError;

std::string Shard(const std::string& key) {
  uint32_t h = 2166136261u;  // FNV-1a
  for (unsigned char c : key) h = (h ^ c) * 16777619u;
  char buf[3];
  std::snprintf(buf, sizeof buf, "%02x", h & 0xff);
  return buf;
}

void MakeDir(const std::string& path) {
  if (::mkdir(path.c_str(), 0755) != 0 && errno != EEXIST) throw MakeIoError("mkdir", path, errno);
}

void SyncDir(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) throw MakeIoError("open", path, errno);
  const int rc = ::fsync(fd);
  const int e = errno;
  ::close(fd);
  if (rc != 0) throw MakeIoError("fsync", path, e);
}

std::string UniqueSuffix() {
  static std::atomic<uint64_t> counter{0};
  static const uint64_t salt = std::random_device{}();
  return std::to_string(::getpid()) + "-" + std::to_string(salt % 100000) + "-" +
         std::to_string(counter++);
}

class KvWritable : public dcp::WritableObject {
 public:
  KvWritable(std::string root, std::string key) : root_(std::move(root)), key_(std::move(key)) {
    MakeDir(root_ + "/.staging");
    staging_ = root_ + "/.staging/" + key_ + "." + UniqueSuffix();
    fd_ = ::open(staging_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw MakeIoError("create", staging_, errno);
  }
  ~KvWritable() override {
    if (fd_ >= 0) {  // never closed: discard
      ::close(fd_);
      ::unlink(staging_.c_str());
    }
  }
  void Append(const void* data, size_t n) override {
    auto* p = static_cast<const char*>(data);
    while (n > 0) {
      const ssize_t w = ::write(fd_, p, n);
      if (w < 0) {
        if (errno == EINTR) continue;
        throw MakeIoError("write", staging_, errno);
      }
      p += w;
      n -= static_cast<size_t>(w);
      size_ += static_cast<uint64_t>(w);
    }
  }
  void Sync() override {
    if (::fsync(fd_) != 0) throw MakeIoError("fsync", staging_, errno);
  }
  void Close() override {
    Sync();  // the object must be durable before it becomes visible under its key
    const int rc = ::close(fd_);
    fd_ = -1;
    if (rc != 0) throw MakeIoError("close", staging_, errno);
    const std::string dir = root_ + "/" + Shard(key_);
    MakeDir(dir);
    const std::string final_path = dir + "/" + key_;
    if (::rename(staging_.c_str(), final_path.c_str()) != 0) {
      const int e = errno;
      ::unlink(staging_.c_str());
      throw MakeIoError("rename", final_path, e);
    }
    SyncDir(dir);
  }
  uint64_t size() const override { return size_; }

 private:
  std::string root_, key_, staging_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

class KvReadable : public dcp::ReadableObject {
 public:
  KvReadable(std::string path, int fd, uint64_t size)
      : path_(std::move(path)), fd_(fd), size_(size) {}
  ~KvReadable() override { ::close(fd_); }
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    if (offset > size_ || n > size_ - offset) {
      throw CorruptionError("object '" + path_ + "' is truncated: need " + std::to_string(n) +
                            " bytes at offset " + std::to_string(offset) + " but it has " +
                            std::to_string(size_));
    }
    auto* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0) {
        if (errno == EINTR) continue;
        throw MakeIoError("read", path_, errno);
      }
      if (r == 0) throw CorruptionError("object '" + path_ + "' shrank while being read");
      p += r;
      n -= static_cast<size_t>(r);
      offset += static_cast<uint64_t>(r);
    }
  }
  uint64_t size() const override { return size_; }

 private:
  std::string path_;
  int fd_;
  uint64_t size_;
};

// The writer lock, mapped the way an object store maps it: a lock object created only if absent
// (S3: PUT with If-None-Match: *) that carries a lease; a contender may replace it once the
// lease has expired (S3: PUT with If-Match: <etag of the expired lock>), and the holder deletes
// it on release only if it is still its own (If-Match again). A crashed holder's lock therefore
// blocks others for at most one lease. The service's atomic conditional write is emulated here
// by an flock on <root>/.dcp.lock.cas around read-compare-write; nothing else uses flock.
// The lease (DCP_KV_LOCK_LEASE_MS, default one day) must exceed the longest save, as the lock
// is not renewed while held.
int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

int64_t LeaseMs() {
  const char* env = std::getenv("DCP_KV_LOCK_LEASE_MS");
  if (env != nullptr && *env != '\0') return std::strtoll(env, nullptr, 10);
  return int64_t{24} * 3600 * 1000;
}

// Read a whole small file; nullopt when absent.
std::optional<std::string> ReadSmall(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) return std::nullopt;
    throw MakeIoError("open", path, errno);
  }
  std::string out;
  char buf[512];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
  const int e = errno;
  ::close(fd);
  if (n < 0) throw MakeIoError("read", path, e);
  return out;
}

// Run fn while holding the emulated service's conditional-write atomicity.
template <typename Fn>
auto Conditionally(const std::string& root, Fn fn) {
  const std::string cas = root + "/.dcp.lock.cas";
  const int fd = ::open(cas.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) throw MakeIoError("open", cas, errno);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }  // also drops the flock
  } closer{fd};
  while (::flock(fd, LOCK_EX) != 0) {
    if (errno != EINTR) throw MakeIoError("flock", cas, errno);
  }
  return fn();
}

// "<expiry ms>\n<holder>" of a lock object.
struct LockRecord {
  int64_t expires_ms = 0;
  std::string holder;
  static LockRecord Parse(const std::string& s) {
    LockRecord r;
    const size_t nl = s.find('\n');
    r.expires_ms = std::strtoll(s.substr(0, nl).c_str(), nullptr, 10);
    if (nl != std::string::npos) r.holder = s.substr(nl + 1);
    return r;
  }
};

void WriteDurably(const std::string& dir, const std::string& path, const std::string& bytes) {
  const std::string tmp = path + ".tmp." + UniqueSuffix();
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw MakeIoError("create", tmp, errno);
  const bool ok = ::write(fd, bytes.data(), bytes.size()) == static_cast<ssize_t>(bytes.size()) &&
                  ::fsync(fd) == 0;
  const int e = errno;
  ::close(fd);
  if (!ok || ::rename(tmp.c_str(), path.c_str()) != 0) {
    const int e2 = ok ? errno : e;
    ::unlink(tmp.c_str());
    throw MakeIoError("write", path, e2);
  }
  SyncDir(dir);
}

class KvLock : public dcp::StoreLock {
 public:
  KvLock(std::string root, std::string record, std::string holder)
      : root_(std::move(root)), record_(std::move(record)), holder_(std::move(holder)) {}
  ~KvLock() override {
    try {
      Release();
    } catch (const dcp::Error&) {
      // The lease frees it.
    }
  }
  void Release() override {
    if (released_) return;
    released_ = true;
    const std::string path = root_ + "/" + dcp::kLockObjectName;
    Conditionally(root_, [&] {
      const auto current = ReadSmall(path);
      // Delete only our own lock: after our lease expired someone else may hold it.
      if (current && *current == record_ && ::unlink(path.c_str()) != 0 && errno != ENOENT) {
        throw MakeIoError("unlink", path, errno);
      }
      return 0;
    });
  }
  std::string holder() const override { return holder_; }

 private:
  std::string root_, record_, holder_;
  bool released_ = false;
};

class KvStore : public dcp::Store {
 public:
  explicit KvStore(std::string root) : root_(std::move(root)) {
    while (root_.size() > 1 && root_.back() == '/') root_.pop_back();
  }
  std::string uri() const override { return "kv://" + root_; }
  void CreateRoot() override { MakeDir(root_); }
  std::unique_ptr<dcp::WritableObject> Create(const std::string& key) override {
    CheckKey(key);
    return std::make_unique<KvWritable>(root_, key);
  }
  std::unique_ptr<dcp::ReadableObject> Open(const std::string& key) override {
    CheckKey(key);
    const std::string path = Path(key);
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
      if (errno == ENOENT) throw NotFoundError("object '" + uri() + "/" + key + "' does not exist");
      throw MakeIoError("open", path, errno);
    }
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
      const int e = errno;
      ::close(fd);
      throw MakeIoError("stat", path, e);
    }
    return std::make_unique<KvReadable>(uri() + "/" + key, fd, static_cast<uint64_t>(st.st_size));
  }
  std::optional<uint64_t> Size(const std::string& key) override {
    CheckKey(key);
    struct stat st {};
    if (::stat(Path(key).c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return std::nullopt;
      throw MakeIoError("stat", Path(key), errno);
    }
    return static_cast<uint64_t>(st.st_size);
  }
  void PublishAtomically(const std::string& key, std::string_view bytes) override {
    auto w = Create(key);  // staged, fsynced, renamed, directory fsynced: all or nothing
    w->Append(bytes.data(), bytes.size());
    w->Close();
  }
  std::vector<std::string> List() override {
    std::vector<std::string> keys;
    DIR* top = ::opendir(root_.c_str());
    if (!top) {
      if (errno == ENOENT) return keys;
      throw MakeIoError("opendir", root_, errno);
    }
    while (dirent* d = ::readdir(top)) {
      const std::string shard = d->d_name;
      if (shard.size() != 2 || !std::isxdigit(shard[0]) || !std::isxdigit(shard[1])) continue;
      DIR* sub = ::opendir((root_ + "/" + shard).c_str());
      if (!sub) continue;
      while (dirent* e = ::readdir(sub)) {
        const std::string key = e->d_name;
        if (key != "." && key != "..") keys.push_back(key);
      }
      ::closedir(sub);
    }
    ::closedir(top);
    return keys;
  }
  void Remove(const std::string& key) override {
    CheckKey(key);
    if (::unlink(Path(key).c_str()) != 0 && errno != ENOENT) {
      throw MakeIoError("unlink", Path(key), errno);
    }
  }
  std::unique_ptr<dcp::StoreLock> TryLock(const std::string& holder) override {
    CreateRoot();
    const std::string path = root_ + "/" + dcp::kLockObjectName;
    // A unique record (the suffix) so that Release recognises its own lock.
    const std::string record =
        std::to_string(NowMs() + LeaseMs()) + "\n" + holder + " lock=" + UniqueSuffix();
    Conditionally(root_, [&] {
      if (const auto current = ReadSmall(path)) {
        const LockRecord r = LockRecord::Parse(*current);
        if (r.expires_ms > NowMs()) throw dcp::LockedError(uri(), r.holder);
      }
      WriteDurably(root_, path, record);  // absent or expired: ours now
      return 0;
    });
    return std::make_unique<KvLock>(root_, record, holder);
  }

 private:
  static void CheckKey(const std::string& key) {
    if (key.empty() || key.find('/') != std::string::npos || key == "." || key == "..") {
      throw dcp::InvalidArgumentError("invalid kv:// key '" + key + "'");
    }
  }
  std::string Path(const std::string& key) const { return root_ + "/" + Shard(key) + "/" + key; }

  std::string root_;
};

}  // namespace

std::shared_ptr<dcp::Store> MakeKvStore(const std::string& root) {
  return std::make_shared<KvStore>(root);
}

void RegisterKvStore() {
  const auto schemes = dcp::RegisteredSchemes();
  if (std::find(schemes.begin(), schemes.end(), "kv") != schemes.end()) return;
  dcp::RegisterBackend("kv", [](const std::string& location) { return MakeKvStore(location); });
}

}  // namespace dcp_kv

extern "C" void dcp_register_storage() { dcp_kv::RegisterKvStore(); }
