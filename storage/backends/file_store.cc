#include "dcp/storage/backends/file_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>

#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/random_name.h"
#include "dcp/proto/staging.h"
#include "dcp/storage/builtin.h"

namespace dcp {

namespace {

// Close on scope exit; close errors on a read-only fd carry no information.
struct Fd {
  int fd = -1;
  explicit Fd(int f) : fd(f) {}
  Fd(const Fd&) = delete;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

void FsyncDirectory(const std::string& dir) {
  Fd fd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (fd.fd < 0) throw MakeIoError("open directory", dir, errno);
  if (::fsync(fd.fd) != 0) throw MakeIoError("fsync directory", dir, errno);
}

void WriteFully(int fd, const char* p, size_t n, uint64_t offset, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::pwrite(fd, p, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw MakeIoError("write", path, errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

constexpr size_t kAlign = 4096;                  // O_DIRECT offset, length and memory alignment
constexpr size_t kDirectBufferBytes = 16 << 20;  // each of the two staging buffers

bool IsAligned(const void* p, uint64_t n) {
  return (reinterpret_cast<uintptr_t>(p) % kAlign) == 0 && n % kAlign == 0;
}

// Writes go to the final name directly: data files are only meaningful once the metadata that
// names them is committed, so a partial one is harmless, and the destructor removes it when the
// object is abandoned.
//
// With direct I/O (the default where the filesystem accepts O_DIRECT) appends are gathered in
// two 16 MiB aligned buffers: while one is written by a background thread, the caller fills the
// other. Whole aligned blocks go out with O_DIRECT; the final partial block is written through
// the page cache (O_DIRECT dropped with fcntl for that write) at Sync/Close, so the file has
// exactly size() bytes. After a Sync the partial block stays buffered and is rewritten, with
// O_DIRECT, once more data completes it. Appends of aligned memory larger than a buffer, at an
// aligned file offset, are written straight from the caller's memory (all whole blocks of it;
// the rest is staged).
class FileWritable : public WritableObject {
 public:
  FileWritable(std::string path, bool direct) : path_(std::move(path)) {
    const int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
    if (direct) {
      fd_ = ::open(path_.c_str(), flags | O_DIRECT, 0644);
      if (fd_ >= 0) {
        direct_ = true;
      } else if (errno != EINVAL) {
        throw MakeIoError("create", path_, errno);
      }
    }
    if (fd_ < 0) fd_ = ::open(path_.c_str(), flags, 0644);
    if (fd_ < 0) throw MakeIoError("create", path_, errno);
  }
  ~FileWritable() override {
    WaitPending(/*rethrow=*/false);
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(path_.c_str());
    }
  }
  void Append(const void* data, size_t n) override {
    if (!direct_) {
      WriteFully(fd_, static_cast<const char*>(data), n, size_, path_);
      size_ += n;
      return;
    }
    const char* p = static_cast<const char*>(data);
    if (n > 0) tail_written_ = false;
    const size_t whole = n / kAlign * kAlign;
    if (fill_ == 0 && whole >= kDirectBufferBytes && IsAligned(p, whole)) {
      WaitPending(true);  // keep at most one write in flight
      WriteDirect(p, whole, flushed_);
      flushed_ += whole;
      size_ += whole;
      p += whole;
      n -= whole;
    }
    while (n > 0) {
      // From the process-wide pool (4 KiB-aligned, reused by the next save); back at destruction.
      buf_[cur_].Reserve(kDirectBufferBytes);
      const size_t take = std::min(n, kDirectBufferBytes - fill_);
      std::memcpy(buf_[cur_].data() + fill_, p, take);
      fill_ += take;
      p += take;
      n -= take;
      size_ += take;
      if (fill_ == kDirectBufferBytes) Submit();
    }
  }
  void Sync() override {
    FlushTail();
    if (::fdatasync(fd_) != 0) throw MakeIoError("fdatasync", path_, errno);
  }
  void Close() override {
    FlushTail();
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw MakeIoError("close", path_, errno);
  }
  uint64_t size() const override { return size_; }

  bool direct() const { return direct_; }

 private:
  // Hand the full current buffer to the background writer and switch to the other one.
  void Submit() {
    WaitPending(true);
    char* b = buf_[cur_].data();
    const size_t n = fill_;
    const uint64_t off = flushed_;
    pending_ = Spawn([this, b, n, off] { WriteDirect(b, n, off); });
    flushed_ += n;
    fill_ = 0;
    cur_ ^= 1;
  }
  void WaitPending(bool rethrow) {
    if (!pending_.valid()) return;
    if (rethrow) {
      pending_.get();
    } else {
      try {
        pending_.get();
      } catch (...) {
        // The object is being abandoned; the error was or will be reported elsewhere.
      }
    }
  }
  // Write everything buffered: whole blocks with O_DIRECT, the partial last block buffered. The
  // partial block is kept (at the start of the buffer) so later appends can complete it.
  void FlushTail() {
    if (!direct_) return;
    WaitPending(true);
    if (fill_ == 0) return;
    char* b = buf_[cur_].data();
    const size_t whole = fill_ / kAlign * kAlign;
    if (whole > 0) {
      WriteDirect(b, whole, flushed_);
      flushed_ += whole;
      fill_ -= whole;
      std::memmove(b, b + whole, fill_);
    }
    if (fill_ > 0 && !tail_written_) {
      SetDirect(false);
      WriteFully(fd_, b, fill_, flushed_, path_);
      SetDirect(true);
      tail_written_ = true;
    }
  }
  void SetDirect(bool on) {
    const int fl = ::fcntl(fd_, F_GETFL);
    if (fl < 0) throw MakeIoError("fcntl F_GETFL", path_, errno);
    if (::fcntl(fd_, F_SETFL, on ? (fl | O_DIRECT) : (fl & ~O_DIRECT)) != 0) {
      throw MakeIoError("fcntl F_SETFL", path_, errno);
    }
  }
  // pwrite of aligned memory at an aligned offset through O_DIRECT. A filesystem that accepts
  // the open but refuses the alignment (EINVAL) gets the same bytes through the page cache.
  void WriteDirect(const char* p, size_t n, uint64_t offset) {
    while (n > 0) {
      const ssize_t w = ::pwrite(fd_, p, n, static_cast<off_t>(offset));
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno == EINVAL) {
          SetDirect(false);
          WriteFully(fd_, p, n, offset, path_);
          SetDirect(true);
          return;
        }
        throw MakeIoError("write", path_, errno);
      }
      p += w;
      n -= static_cast<size_t>(w);
      offset += static_cast<uint64_t>(w);
    }
  }

  std::string path_;
  int fd_ = -1;
  bool direct_ = false;
  uint64_t size_ = 0;     // bytes appended
  uint64_t flushed_ = 0;  // bytes handed to whole-block writes (a multiple of kAlign)
  HostBuffer buf_[2];
  int cur_ = 0;
  size_t fill_ = 0;            // bytes in buf_[cur_]
  bool tail_written_ = false;  // the partial block in buf_[cur_] is already in the file
  Task<void> pending_;
};

class FileReadable : public ReadableObject {
 public:
  // Checkpoints hold regular files only: a FIFO or device in a checkpoint would block or never
  // end, and a symbolic link may point anywhere outside it. O_NONBLOCK keeps the open of a FIFO
  // from waiting for a writer; O_NOFOLLOW refuses a link as the object itself (the directory
  // path above it may contain links). DCP_FOLLOW_SYMLINKS=1 follows links (still regular files).
  explicit FileReadable(std::string path) : path_(std::move(path)) {
    static const bool follow = [] {
      const char* env = std::getenv("DCP_FOLLOW_SYMLINKS");
      return env != nullptr && std::string_view(env) == "1";
    }();
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK | (follow ? 0 : O_NOFOLLOW));
    if (fd_ < 0) {
      if (errno == ENOENT) throw NotFoundError("file '" + path_ + "' does not exist");
      if (errno == ELOOP) {
        throw CorruptionError("'" + path_ +
                              "' is a symbolic link: a checkpoint holds regular files only "
                              "(set DCP_FOLLOW_SYMLINKS=1 to follow links)");
      }
      throw MakeIoError("open", path_, errno);
    }
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
      const int e = errno;
      ::close(fd_);
      throw MakeIoError("stat", path_, e);
    }
    if (!S_ISREG(st.st_mode)) {
      ::close(fd_);
      throw CorruptionError("'" + path_ +
                            "' is not a regular file (a FIFO, device, socket or directory): a "
                            "checkpoint holds regular files only");
    }
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~FileReadable() override { ::close(fd_); }
  // The hint widens the kernel's readahead window for this open file (POSIX_FADV_SEQUENTIAL
  // doubles it) instead of forcing the range in with POSIX_FADV_WILLNEED: WILLNEED fills the page
  // cache with 4 KiB folios, and a later warm load of those bytes pays per folio (on ext4, a
  // warm load after a WILLNEED cold load is about 20% slower than after a plain sequential one,
  // at equal cold speed). Normal readahead builds large folios. It costs
  // only a flag on the open file; a failure only loses the hint.
  void Prefetch(uint64_t offset, uint64_t n) noexcept override {
    (void)::posix_fadvise(fd_, static_cast<off_t>(offset), static_cast<off_t>(n),
                          POSIX_FADV_SEQUENTIAL);
  }
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    if (offset > size_ || n > size_ - offset) {
      throw CorruptionError("file '" + path_ + "' is truncated: need " + std::to_string(n) +
                            " bytes at offset " + std::to_string(offset) + " but it has " +
                            std::to_string(size_) + " bytes");
    }
    char* p = static_cast<char*>(dst);
    while (n > 0) {
      const ssize_t r = ::pread(fd_, p, n, static_cast<off_t>(offset));
      if (r < 0) {
        if (errno == EINTR) continue;
        throw MakeIoError("read", path_, errno);
      }
      if (r == 0) {
        throw CorruptionError("file '" + path_ + "' ended early at offset " +
                              std::to_string(offset));
      }
      p += r;
      n -= static_cast<size_t>(r);
      offset += static_cast<uint64_t>(r);
    }
  }
  uint64_t size() const override { return size_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

// The writer lock of a directory: flock(LOCK_EX) on <dir>/.dcp.lock. flock, not fcntl: fcntl
// locks belong to the process, so two jobs (or two test "jobs") in one process would not
// exclude each other, and closing any descriptor of the file would drop them. The kernel
// releases the lock when the holder dies, so a crash can never leave the location stuck.
// Release unlinks the file while still holding the lock, so a clean directory keeps no lock
// file; a contender that opened the unlinked inode notices (the path no longer names the inode it
// locked) and retries on the current file.
class FileLock : public StoreLock {
 public:
  FileLock(std::string path, int fd, std::string holder)
      : path_(std::move(path)), fd_(fd), holder_(std::move(holder)) {}
  ~FileLock() override {
    try {
      Release();
    } catch (const Error&) {
      // Only the unlink can fail; the flock itself is released by close() regardless.
    }
  }
  void Release() override {
    if (fd_ < 0) return;
    int e = 0;
    if (::unlink(path_.c_str()) != 0 && errno != ENOENT) e = errno;
    ::close(fd_);  // drops the flock
    fd_ = -1;
    if (e != 0) throw MakeIoError("remove lock file", path_, e);
  }
  std::string holder() const override { return holder_; }

 private:
  std::string path_;
  int fd_;
  std::string holder_;
};

class FileStore : public Store {
 public:
  FileStore(std::string dir, FileStoreOptions options) : dir_(std::move(dir)), options_(options) {
    if (dir_.empty()) throw InvalidArgumentError("empty checkpoint directory");
    while (dir_.size() > 1 && dir_.back() == '/') dir_.pop_back();
  }
  std::string uri() const override {
    return "file://" + std::filesystem::absolute(dir_).lexically_normal().string();
  }
  void CreateRoot() override {
    std::error_code ec;
    std::filesystem::create_directories(dir_, ec);
    if (ec) throw MakeIoError("create directory", dir_, ec.value());
  }
  std::unique_ptr<WritableObject> Create(const std::string& name) override {
    return std::make_unique<FileWritable>(Path(name), options_.direct_io);
  }
  std::unique_ptr<ReadableObject> Open(const std::string& name) override {
    return std::make_unique<FileReadable>(Path(name));
  }
  std::optional<uint64_t> Size(const std::string& name) override {
    struct stat st;
    if (::stat(Path(name).c_str(), &st) != 0) {
      if (errno == ENOENT || errno == ENOTDIR) return std::nullopt;
      throw MakeIoError("stat", Path(name), errno);
    }
    if (!S_ISREG(st.st_mode)) {  // see FileReadable: objects are regular files
      throw CorruptionError("'" + Path(name) +
                            "' is not a regular file (a FIFO, device, socket or directory): a "
                            "checkpoint holds regular files only");
    }
    return static_cast<uint64_t>(st.st_size);
  }
  void PublishAtomically(const std::string& name, std::string_view bytes) override {
    const std::string final_path = Path(name);
    const std::string tmp = final_path + ".tmp." + RandomHex(8);
    {
      Fd fd(::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644));
      if (fd.fd < 0) throw MakeIoError("create", tmp, errno);
      try {
        WriteFully(fd.fd, bytes.data(), bytes.size(), 0, tmp);
        if (::fsync(fd.fd) != 0) throw MakeIoError("fsync", tmp, errno);
      } catch (...) {
        ::unlink(tmp.c_str());
        throw;
      }
    }
    if (::rename(tmp.c_str(), final_path.c_str()) != 0) {
      const int e = errno;
      ::unlink(tmp.c_str());
      throw MakeIoError("rename to", final_path, e);
    }
    FsyncDirectory(dir_);
  }
  std::vector<std::string> List() override {
    std::vector<std::string> names;
    DIR* d = ::opendir(dir_.c_str());
    if (d == nullptr) {
      if (errno == ENOENT) return names;
      throw MakeIoError("list directory", dir_, errno);
    }
    while (dirent* e = ::readdir(d)) {
      const std::string n = e->d_name;
      if (n != "." && n != "..") names.push_back(n);
    }
    ::closedir(d);
    return names;
  }
  void Remove(const std::string& name) override {
    if (::unlink(Path(name).c_str()) != 0 && errno != ENOENT) {
      throw MakeIoError("remove", Path(name), errno);
    }
  }
  std::unique_ptr<StoreLock> TryLock(const std::string& holder) override {
    CreateRoot();
    const std::string path = Path(kLockObjectName);
    if (const std::string why = NodeLocalLockReason(dir_); !why.empty()) {
      const char* accept = std::getenv("DCP_FILE_LOCK");
      if (accept == nullptr || std::string_view(accept) != "node-local") {
        throw UnsupportedError(
            uri() + ": its writer lock (flock on " + path +
            ") cannot exclude jobs on other machines: " + why +
            ". Mount it with local_lock=none (NFS) or -o flock (Lustre), or set "
            "DCP_FILE_LOCK=node-local if every job writing there runs on this machine");
      }
    }
    // Each retry means a holder released (and unlinked) the file between our open and flock;
    // a bounded number of them keeps a pathological churn from spinning forever.
    for (int attempt = 0; attempt < 64; ++attempt) {
      Fd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644));
      if (fd.fd < 0) throw MakeIoError("open lock file", path, errno);
      if (::flock(fd.fd, LOCK_EX | LOCK_NB) != 0) {
        const int e = errno;
        if (e == EINTR) continue;
        if (e == EWOULDBLOCK) {
          char buf[512];
          const ssize_t n = ::pread(fd.fd, buf, sizeof(buf), 0);
          std::string who = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
          while (!who.empty() && (who.back() == '\n' || who.back() == '\0')) who.pop_back();
          throw LockedError(uri(), who);
        }
        if (e == ENOLCK || e == EOPNOTSUPP || e == ENOSYS || e == EINVAL) {
          // A filesystem without flock (e.g. Lustre without -o flock): no exclusion, said once.
          static std::once_flag warned;
          std::call_once(warned, [&] {
            std::fprintf(stderr,
                         "dcp: %s has no flock (%s): saves there run without a writer lock, so "
                         "two jobs saving to one location are not excluded\n",
                         dir_.c_str(), std::strerror(e));
          });
          return nullptr;
        }
        throw MakeIoError("lock", path, e);
      }
      struct stat held, named;
      if (::fstat(fd.fd, &held) != 0) throw MakeIoError("stat lock file", path, errno);
      if (::stat(path.c_str(), &named) != 0) {
        if (errno == ENOENT) continue;
        throw MakeIoError("stat lock file", path, errno);
      }
      if (named.st_ino != held.st_ino || named.st_dev != held.st_dev) continue;
      // Who holds it, for contenders' messages: informational, so neither fsynced nor checked
      // beyond the write itself.
      if (::ftruncate(fd.fd, 0) != 0) throw MakeIoError("truncate lock file", path, errno);
      WriteFully(fd.fd, holder.data(), holder.size(), 0, path);
      const int kept = fd.fd;
      fd.fd = -1;
      return std::make_unique<FileLock>(path, kept, holder);
    }
    throw IoError("could not take the lock " + path + ": it was released and re-created 64 times",
                  /*retryable=*/true, EAGAIN);
  }

 private:
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
  FileStoreOptions options_;
};

}  // namespace

std::string NodeLocalLockReason(std::string_view fs_type, std::string_view options) {
  auto has = [&](std::string_view option) {
    for (size_t p = 0; p <= options.size();) {
      size_t c = options.find(',', p);
      if (c == std::string_view::npos) c = options.size();
      if (options.substr(p, c - p) == option) return true;
      p = c + 1;
    }
    return false;
  };
  const std::string type(fs_type);
  if (type == "nfs" || type == "nfs4") {
    for (const char* o : {"local_lock=flock", "local_lock=all", "nolock"}) {
      if (has(o)) return type + " mounted with " + o + " keeps flock locks on this client only";
    }
  }
  if (type == "lustre" && has("localflock")) {
    return "lustre mounted with localflock keeps flock locks on this client only";
  }
  return {};
}

std::string NodeLocalLockReason(const std::string& directory) {
  try {
    std::error_code ec;
    std::string path = std::filesystem::weakly_canonical(directory, ec).string();
    if (ec) path = directory;
    // mountinfo: id parent major:minor root mount-point options [optional...] - type source
    // super-options. The deepest mount point that contains the path is the one that holds it.
    std::ifstream in("/proc/self/mountinfo");
    std::string line, best_type, best_options;
    size_t best_len = 0;
    while (std::getline(in, line)) {
      std::istringstream fields(line);
      std::string id, parent, dev, root, mount_point, mount_options, f;
      if (!(fields >> id >> parent >> dev >> root >> mount_point >> mount_options)) continue;
      while (fields >> f && f != "-") {
      }
      std::string type, source, super_options;
      if (!(fields >> type >> source >> super_options)) continue;
      const bool contains = path == mount_point || mount_point == "/" ||
                            (path.rfind(mount_point, 0) == 0 && path.size() > mount_point.size() &&
                             path[mount_point.size()] == '/');
      if (contains && mount_point.size() >= best_len) {
        best_len = mount_point.size();
        best_type = type;
        best_options = mount_options + "," + super_options;
      }
    }
    return NodeLocalLockReason(best_type, best_options);
  } catch (...) {
    return {};  // no mount table to read: nothing says the lock is node-local
  }
}

std::shared_ptr<Store> MakeFileStore(const std::string& directory) {
  FileStoreOptions options;
  const char* env = std::getenv("DCP_DIRECT_IO");
  if (env != nullptr && std::string_view(env) == "0") options.direct_io = false;
  return MakeFileStore(directory, options);
}

std::shared_ptr<Store> MakeFileStore(const std::string& directory, FileStoreOptions options) {
  return std::make_shared<FileStore>(directory, options);
}

std::shared_ptr<Store> OpenFileBackend(const std::string& location, const BackendOptionMap& options) {
  BackendOptionReader reader("file://", options);
  const auto direct_io = reader.Bool("direct_io");
  reader.Done();
  if (!direct_io) return MakeFileStore(location);  // DCP_DIRECT_IO decides
  FileStoreOptions o;
  o.direct_io = *direct_io;
  return MakeFileStore(location, o);
}


}  // namespace dcp
