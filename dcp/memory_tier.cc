#include "dcp/memory_tier.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <unordered_map>
#include <utility>

#include "dcp/async_checkpointer.h"
#include "dcp/planner/default_planner.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/file_store.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/forwarding_store.h"
#include "dcp/storage/registry.h"

namespace dcp {

namespace fs = std::filesystem;

namespace {

// I/O failures of the tier's own files (tmpfs): not retryable, with the errno of the call.
IoError TierIoError(const std::string& message) { return IoError(message, false, errno); }

// Write `n` bytes at `offset` of `fd`, naming `path` in the error.
void WriteAt(int fd, const char* data, size_t n, uint64_t offset, const std::string& path) {
  while (n > 0) {
    ssize_t w = ::pwrite(fd, data, n, static_cast<off_t>(offset));
    if (w < 0) {
      if (errno == EINTR) continue;
      throw TierIoError("memory tier: cannot write " + path + ": " + std::strerror(errno));
    }
    data += w;
    n -= static_cast<size_t>(w);
    offset += static_cast<uint64_t>(w);
  }
}

void ReadAt(int fd, char* data, size_t n, uint64_t offset, const std::string& path) {
  while (n > 0) {
    ssize_t r = ::pread(fd, data, n, static_cast<off_t>(offset));
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      throw TierIoError("memory tier: cannot read " + path + ": " +
                        (r < 0 ? std::strerror(errno) : "it ended early"));
    }
    data += r;
    n -= static_cast<size_t>(r);
    offset += static_cast<uint64_t>(r);
  }
}

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Little-endian fields for the tier's messages (reports, needs, file records).
void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void PutString(std::string& out, std::string_view s) {
  PutU64(out, s.size());
  out.append(s);
}

// Reads what Put* wrote; a peer's message that ends early or claims more than it holds is a
// CorruptionError naming `source` (a bug or a foreign sender, never trusted blindly).
class MessageReader {
 public:
  MessageReader(std::string_view bytes, std::string source)
      : bytes_(bytes), source_(std::move(source)) {}
  bool done() const { return at_ == bytes_.size(); }
  uint64_t U64() {
    Need(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i)
      v |= static_cast<uint64_t>(static_cast<uint8_t>(bytes_[at_ + i])) << (8 * i);
    at_ += 8;
    return v;
  }
  std::string_view Bytes(uint64_t n) {
    Need(n);
    std::string_view v = bytes_.substr(at_, n);
    at_ += n;
    return v;
  }
  std::string String() { return std::string(Bytes(U64())); }

 private:
  void Need(uint64_t n) const {
    if (n > bytes_.size() - at_) {
      throw CorruptionError("memory tier: a malformed message from " + source_ + " (it needs " +
                            std::to_string(n) + " more bytes at " + std::to_string(at_) + " of " +
                            std::to_string(bytes_.size()) + ")");
    }
  }
  std::string_view bytes_;
  std::string source_;
  size_t at_ = 0;
};

// A file name a peer may send: one plain path component, as the dcp layout names its files.
bool IsPlainName(std::string_view name) {
  return !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
         name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

std::string StepName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "step-%010lld", static_cast<long long>(step));
  return buf;
}

std::optional<int64_t> ParseStepName(const std::string& name) {
  if (name.size() != 15 || name.rfind("step-", 0) != 0) return std::nullopt;
  int64_t v = 0;
  for (size_t i = 5; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9') return std::nullopt;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

std::string HostIdentity() {
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown-host");
  std::string id = host;
  std::ifstream boot("/proc/sys/kernel/random/boot_id");
  std::string boot_id;
  if (boot && std::getline(boot, boot_id)) id += "/" + boot_id;
  return id;
}

// ---- The tier's directories: private to the user, never reached through a link.
//
// The tier keeps model weights under a directory every local user reaches (/dev/shm). Its
// anchor is <shm_root>/dcp-tier-u<uid>, created 0700 and used only while it is a real directory
// of this user that no one else may write; everything below it is created 0700/0600 and opened
// without following links, and only regular files are read. So another user can neither read
// a step nor plant or redirect one.

constexpr char kPrivateDirAdvice[] =
    "remove it (as its owner, or as root) or set MemoryTierOptions::shm_root to a directory of "
    "your own";

std::string OctalMode(mode_t mode) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%04o", static_cast<unsigned>(mode & 07777));
  return buf;
}

// `path` (whose parent exists) as a private directory: created 0700, or the one there if it is
// a real directory of this user that no one else may write (its group and other bits are then
// cleared). InvalidArgumentError, saying what to do, for anything else.
void MakePrivateDirectory(const std::string& path) {
  if (::mkdir(path.c_str(), 0700) != 0 && errno != EEXIST) {
    throw TierIoError("memory tier: cannot create " + path + ": " + std::strerror(errno));
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ELOOP || errno == ENOTDIR) {
      throw InvalidArgumentError("memory tier: " + path +
                                 " is a symbolic link or not a directory: the tier does not "
                                 "follow it; " +
                                 kPrivateDirAdvice);
    }
    const int err = errno;
    struct stat there {};
    if (err == EACCES && ::lstat(path.c_str(), &there) == 0 && there.st_uid != ::geteuid()) {
      throw InvalidArgumentError("memory tier: the directory " + path + " belongs to uid " +
                                 std::to_string(there.st_uid) + ", not to this process's uid " +
                                 std::to_string(::geteuid()) + "; " + kPrivateDirAdvice);
    }
    throw TierIoError("memory tier: cannot open " + path + ": " + std::strerror(err));
  }
  struct stat sb {};
  std::string problem;
  if (::fstat(fd, &sb) != 0) {
    problem = std::string("cannot stat it: ") + std::strerror(errno);
  } else if (sb.st_uid != ::geteuid()) {
    problem = "belongs to uid " + std::to_string(sb.st_uid) + ", not to this process's uid " +
              std::to_string(::geteuid()) + ": its owner could read the steps or plant one";
  } else if ((sb.st_mode & 022) != 0) {
    problem = "is writable by other users (mode " + OctalMode(sb.st_mode) +
              "): a step in it may have been planted";
  } else if ((sb.st_mode & 077) != 0 && ::fchmod(fd, 0700) != 0) {
    problem = std::string("cannot make it private (mode 0700): ") + std::strerror(errno);
  }
  ::close(fd);
  if (!problem.empty()) {
    throw InvalidArgumentError("memory tier: the directory " + path + " " + problem + "; " +
                               kPrivateDirAdvice);
  }
}

// shm_root must be a directory that no one else can rename the tier's directory out of: not
// writable by other users unless sticky (as /dev/shm and /tmp are).
void CheckSharedRoot(const std::string& shm_root) {
  struct stat sb {};
  if (::stat(shm_root.c_str(), &sb) != 0) {
    throw TierIoError("memory tier: shm_root " + shm_root + ": " + std::strerror(errno));
  }
  if (!S_ISDIR(sb.st_mode)) {
    throw InvalidArgumentError("memory tier: shm_root " + shm_root + " is not a directory");
  }
  if ((sb.st_mode & 022) != 0 && (sb.st_mode & S_ISVTX) == 0) {
    throw InvalidArgumentError("memory tier: shm_root " + shm_root + " (mode " +
                               OctalMode(sb.st_mode) +
                               ") is writable by other users without the sticky bit: they could "
                               "replace the tier's directory; use a tmpfs like /dev/shm (mode "
                               "1777) or a directory of your own");
  }
}

// The bytes of a regular file of the tier, at most `max_bytes`. A link, FIFO or device is
// refused (CorruptionError), never followed or waited on: O_NONBLOCK keeps the open of a FIFO
// from waiting for a writer. NotFoundError when absent.
std::string ReadTierFile(const std::string& path, uint64_t max_bytes) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) {
    if (errno == ENOENT) throw NotFoundError("memory tier: " + path + " does not exist");
    if (errno == ELOOP) {
      throw CorruptionError("memory tier: " + path + " is a symbolic link: refused");
    }
    throw TierIoError("memory tier: cannot open " + path + ": " + std::strerror(errno));
  }
  struct stat sb {};
  std::string out;
  try {
    if (::fstat(fd, &sb) != 0) {
      throw TierIoError("memory tier: cannot stat " + path + ": " + std::strerror(errno));
    }
    if (!S_ISREG(sb.st_mode)) {
      throw CorruptionError("memory tier: " + path +
                            " is not a regular file (a FIFO, device or directory): refused");
    }
    if (static_cast<uint64_t>(sb.st_size) > max_bytes) {
      throw CorruptionError("memory tier: " + path + " holds " + std::to_string(sb.st_size) +
                            " bytes, more than the " + std::to_string(max_bytes) + " allowed");
    }
    out.resize(static_cast<size_t>(sb.st_size));
    ReadAt(fd, out.data(), out.size(), 0, path);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return out;
}

// A tier file opened with `flags` (O_CREAT: created 0600 if absent): a regular file, never
// through a link; a FIFO or device is refused, never waited on.
int OpenTierFile(const std::string& path, int flags) {
  const int fd = ::open(path.c_str(), flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw TierIoError("memory tier: cannot open " + path + ": " +
                      (errno == ELOOP ? std::string("it is a symbolic link")
                                      : std::string(std::strerror(errno))));
  }
  struct stat sb {};
  if (::fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    ::close(fd);
    throw CorruptionError("memory tier: " + path + " is not a regular file: refused");
  }
  return fd;
}

// Whether `path` is a directory itself (a link to one does not count).
bool IsRealDirectory(const fs::path& path) {
  std::error_code ec;
  return fs::symlink_status(path, ec).type() == fs::file_type::directory;
}
bool IsRealFile(const fs::path& path) {
  std::error_code ec;
  return fs::symlink_status(path, ec).type() == fs::file_type::regular;
}

// The most a tier's metadata.dcp or job record may hold.
constexpr uint64_t kMaxTierMetadataBytes = uint64_t{1} << 30;

// The job record of a tier directory: the owner it was created for.
constexpr char kJobRecordName[] = "JOB";
// The lock file of a node's directory: flock()ed by the node's first rank while a tier object
// uses it, so two processes of one job never share a node's steps (a job started twice).
constexpr char kNodeLockName[] = "LOCK";

// A stable 64-bit hash (FNV-1a) of the owner, for the job directory's name.
std::string OwnerHash(const std::string& owner) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : owner) {
    h ^= c;
    h *= 1099511628211ull;
  }
  char buf[24];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// Records `owner` as the job of `job_dir` (created if absent: link(2) makes the first writer
// win atomically), or checks the record there. InvalidArgumentError when another job owns it.
void ClaimJobDirectory(const std::string& job_dir, const std::string& owner) {
  const std::string record = job_dir + "/" + kJobRecordName;
  const std::string text = "owner=" + owner + "\n";
  for (int attempt = 0; attempt < 2; ++attempt) {
    try {
      const std::string there = ReadTierFile(record, kMaxTierMetadataBytes);
      if (there == text) return;
      throw InvalidArgumentError(
          "memory tier: " + job_dir + " holds the steps of another job (" +
          ClippedName(there.substr(0, there.find('\n'))) + "), not of owner=" + owner +
          ": its steps are never restored or freed by this one; give this job its own "
          "MemoryTierOptions::name");
    } catch (const NotFoundError&) {
    }
    const std::string tmp = record + ".tmp." + std::to_string(::getpid()) + "." +
                            std::to_string(attempt) + "." + std::to_string(::gettid());
    const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
      throw TierIoError("memory tier: cannot create " + tmp + ": " + std::strerror(errno));
    try {
      WriteAt(fd, text.data(), text.size(), 0, tmp);
    } catch (...) {
      ::close(fd);
      ::unlink(tmp.c_str());
      throw;
    }
    ::close(fd);
    const bool linked = ::link(tmp.c_str(), record.c_str()) == 0;
    const int err = errno;
    ::unlink(tmp.c_str());
    if (linked) return;
    if (err != EEXIST) {
      throw TierIoError("memory tier: cannot record the job in " + record + ": " +
                        std::strerror(err));
    }
  }
  throw TierIoError("memory tier: cannot read or write the job record " + record);
}

// Takes the node directory's lock (flock: the kernel frees it when the process dies, so a
// crashed job's restart takes it at once) and records the holder in it. Returns the descriptor
// that holds it; LockedError naming the holder when another process of the job holds it.
int LockNodeDirectory(const std::string& node_dir, const std::string& name) {
  const std::string path = node_dir + "/" + kNodeLockName;
  const int fd = OpenTierFile(path, O_RDWR | O_CREAT);
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char holder[256] = {};
    const ssize_t n = ::pread(fd, holder, sizeof(holder) - 1, 0);
    ::close(fd);
    if (err != EWOULDBLOCK) {
      throw TierIoError("memory tier: cannot lock " + path + ": " + std::strerror(err));
    }
    throw LockedError(
        "memory tier '" + name + "' at " + node_dir,
        n > 0 ? ClippedName(std::string(holder, static_cast<size_t>(n))) : std::string());
  }
  char host[256] = {};
  if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown-host");
  const std::string holder = std::string("host=") + host + " pid=" + std::to_string(::getpid());
  if (::ftruncate(fd, 0) == 0) {
    ssize_t ignored = ::pwrite(fd, holder.data(), holder.size(), 0);  // for messages only
    (void)ignored;
  }
  return fd;
}

// The checkpoint's data files and, for each, the extent its items reach (a file shorter than
// that is torn).
std::map<std::string, uint64_t> ReferencedFiles(const Metadata& md) {
  std::map<std::string, uint64_t> files;
  for (const DataFile& f : md.files) files[f.name] = f.size;  // version 2
  for (const auto& [index, info] : md.storage) {
    uint64_t& end = files[info.relative_path];
    end = std::max(end, info.offset + info.length);
  }
  return files;
}

// Data files of freed steps wait in this directory of the node's tier to be written over by the
// next step: overwriting a tmpfs file's pages costs about half of faulting in fresh ones (and
// freeing them is not free either).
constexpr char kRecycleDir[] = "recycle";

void TruncateAndClose(int fd, uint64_t size, const std::string& path) {
  const bool ok = ::ftruncate(fd, static_cast<off_t>(size)) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) {
    errno = err;
    throw TierIoError("memory tier: cannot truncate " + path + ": " + std::strerror(err));
  }
}

}  // namespace

namespace tier_detail {

// A file's pages mapped shared (MAP_POPULATE: mapped in one pass, not faulted in one by one).
// Move-only; unmaps when destroyed unless Leak()ed.
class FileMapping {
 public:
  FileMapping() = default;
  FileMapping(int fd, uint64_t size, bool writable, const std::string& path) : size_(size) {
    if (size == 0) return;
    void* p = ::mmap(nullptr, size, PROT_READ | (writable ? PROT_WRITE : 0),
                     MAP_SHARED | MAP_POPULATE, fd, 0);
    if (p == MAP_FAILED) {
      throw TierIoError("memory tier: cannot map " + path + ": " + std::strerror(errno));
    }
    data_ = static_cast<char*>(p);
  }
  FileMapping(FileMapping&& o) noexcept
      : data_(std::exchange(o.data_, nullptr)), size_(std::exchange(o.size_, 0)) {}
  FileMapping& operator=(FileMapping&& o) noexcept {
    if (this != &o) {
      Reset();
      data_ = std::exchange(o.data_, nullptr);
      size_ = std::exchange(o.size_, 0);
    }
    return *this;
  }
  ~FileMapping() { Reset(); }
  char* data() const { return data_; }
  uint64_t size() const { return data_ != nullptr ? size_ : 0; }
  void Reset() {
    if (data_ != nullptr) ::munmap(data_, size_);
    data_ = nullptr;
  }
  // Forget the mapping without unmapping it: a transport that may still write into it must
  // never find it gone (or another mapping in its place).
  void Leak() { data_ = nullptr; }

 private:
  char* data_ = nullptr;
  uint64_t size_ = 0;
};

// The tier's files this rank wrote or received, kept mapped across saves. Freed steps' files
// are written over by later steps (kRecycleDir), so a file comes back with its pages and its
// mapping: a save in the steady state maps nothing, where populating a 512 MiB mapping costs
// 0.04-0.1 s per file on 2 cores. Keyed by inode; Prune drops the entries whose file is gone
// (no links left), so a deleted file's pages do not outlive the next Prune. Thread-safe.
class MappingPool {
 public:
  MappingPool() = default;
  MappingPool(const MappingPool&) = delete;
  MappingPool& operator=(const MappingPool&) = delete;
  ~MappingPool() { Clear(); }

  /// The first `size` bytes of the file open (read-write) at `fd`, mapped writable: the kept
  /// mapping when it covers them, else a new one, kept. Only for files whose `size` bytes are
  /// allocated (writing a hole through a mapping could meet a full tmpfs: SIGBUS). The pointer
  /// stays valid until Prune finds the file gone, Clear, or the pool's end.
  char* Map(int fd, uint64_t size, const std::string& path) {
    if (size == 0) return nullptr;
    struct stat sb {};
    if (::fstat(fd, &sb) != 0) {
      throw TierIoError("memory tier: cannot stat " + path + ": " + std::strerror(errno));
    }
    const Key key{sb.st_dev, sb.st_ino};
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = entries_.find(key); it != entries_.end()) {
      if (it->second.map.size() >= size) return it->second.map.data();
      Drop(it);
    }
    Entry e;
    e.map = FileMapping(fd, size, /*writable=*/true, path);
    e.fd = ::fcntl(fd, F_DUPFD_CLOEXEC, 0);  // to see the file's links later
    if (e.fd < 0) {
      throw TierIoError("memory tier: cannot keep " + path + " open: " + std::strerror(errno));
    }
    char* data = e.map.data();
    bytes_mapped_ += size;
    entries_.emplace(key, std::move(e));
    return data;
  }
  /// The kept mapping of the file open at `fd` when it covers `size` bytes, else null.
  char* Find(int fd, uint64_t size) {
    struct stat sb {};
    if (size == 0 || ::fstat(fd, &sb) != 0) return nullptr;
    std::lock_guard<std::mutex> lock(mu_);
    auto it = entries_.find(Key{sb.st_dev, sb.st_ino});
    return it != entries_.end() && it->second.map.size() >= size ? it->second.map.data() : nullptr;
  }
  /// Whether the file with this identity is kept mapped.
  bool Holds(dev_t dev, ino_t ino) const {
    std::lock_guard<std::mutex> lock(mu_);
    return entries_.count(Key{dev, ino}) > 0;
  }
  /// Bytes mapped anew so far (mappings the pool already held are not counted again).
  uint64_t bytes_mapped() const {
    std::lock_guard<std::mutex> lock(mu_);
    return bytes_mapped_;
  }
  /// Unmaps the files that no longer exist.
  void Prune() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto it = entries_.begin(); it != entries_.end();) {
      struct stat sb {};
      if (::fstat(it->second.fd, &sb) != 0 || sb.st_nlink == 0) {
        it = Drop(it);
      } else {
        ++it;
      }
    }
  }
  void Clear() {
    std::lock_guard<std::mutex> lock(mu_);
    while (!entries_.empty()) Drop(entries_.begin());
  }
  /// Forgets every mapping without unmapping it: a transport that may still write into one
  /// must never find it gone, or another mapping in its place.
  void Leak() {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, e] : entries_) {
      e.map.Leak();
      ::close(e.fd);
    }
    entries_.clear();
  }

 private:
  using Key = std::pair<dev_t, ino_t>;
  struct Entry {
    FileMapping map;
    int fd = -1;
  };
  std::map<Key, Entry>::iterator Drop(std::map<Key, Entry>::iterator it) {
    it->second.map.Reset();
    if (it->second.fd >= 0) ::close(it->second.fd);
    return entries_.erase(it);
  }
  mutable std::mutex mu_;
  std::map<Key, Entry> entries_;
  uint64_t bytes_mapped_ = 0;
};

}  // namespace tier_detail

namespace {

using tier_detail::FileMapping;
using tier_detail::MappingPool;

// A data file's name without its save id ("data-<save>-r<rank>-b<bucket>.data" gives
// "r<rank>-b<bucket>.data"): what a rank's file of one step shares with its file of the next.
std::string_view WithoutSaveId(std::string_view name) {
  if (name.substr(0, 5) != "data-") return name;
  const size_t dash = name.find('-', 5);
  return dash == std::string_view::npos ? name : name.substr(dash + 1);
}

// Opens `path` for writing from offset 0 without truncating, as a file taken from `recycle_dir`
// when there is one (renamed: atomic, and two ranks never get the same one), else a new one.
// The ranks of a node share the directory; each takes first the file that held the same data
// file of an earlier step (same name but for the save id: the same size, and the mapping this
// rank kept of it), then any file it keeps mapped, then any. So a save in the steady state
// writes over its own earlier files and maps nothing anew. The writer truncates the file to
// what it wrote when it closes.
int OpenForOverwrite(const std::string& recycle_dir, const std::string& path,
                     const MappingPool& pool) {
  const std::string name = fs::path(path).filename().native();
  const std::string_view want = WithoutSaveId(name);
  std::error_code ec;
  std::vector<std::pair<int, fs::path>> candidates;  // (preference, file)
  for (const auto& e : fs::directory_iterator(recycle_dir, ec)) {
    struct stat sb {};
    if (::lstat(e.path().c_str(), &sb) != 0 || !S_ISREG(sb.st_mode)) continue;  // files only
    const bool mapped = pool.Holds(sb.st_dev, sb.st_ino);
    const std::string other = e.path().filename().native();
    const bool same = WithoutSaveId(other) == want;
    candidates.emplace_back((same ? 0 : 2) + (mapped ? 0 : 1), e.path());
  }
  std::sort(candidates.begin(), candidates.end());
  for (const auto& [preference, file] : candidates) {
    if (::rename(file.c_str(), path.c_str()) == 0) break;
  }
  return OpenTierFile(path, O_RDWR | O_CREAT);  // RDWR: mmap needs it
}

// Makes the file at `fd` exactly `size` bytes with every page allocated, so that writing
// through a mapping cannot hit a full tmpfs (SIGBUS): that fails here, as an error naming it.
// File systems without fallocate keep the sparse size.
void ReserveExactly(int fd, uint64_t size, const std::string& path) {
  if (::ftruncate(fd, static_cast<off_t>(size)) != 0) {
    throw TierIoError("memory tier: cannot size " + path + ": " + std::strerror(errno));
  }
  struct stat sb {};
  const bool allocated =
      ::fstat(fd, &sb) == 0 && static_cast<uint64_t>(sb.st_blocks) * 512 >= size;  // recycled
  if (size > 0 && !allocated && ::fallocate(fd, 0, 0, static_cast<off_t>(size)) != 0 &&
      errno != EOPNOTSUPP) {
    throw TierIoError("memory tier: cannot reserve " + std::to_string(size) + " bytes for " + path +
                      ": " + std::strerror(errno));
  }
}

// A data file of a step being written: sequential writes over a possibly recycled file. The
// recycled file's pages are written through the pool's mapping (copies at memory speed,
// without pwrite's per-page lookups), which the replication then sends from. Bytes past those
// pages go through pwrite, where a full tmpfs is an error, not a SIGBUS.
class TierFileWriter : public WritableObject {
 public:
  TierFileWriter(int fd, std::string path, MappingPool& pool) : fd_(fd), path_(std::move(path)) {
    struct stat sb {};
    // Only a file whose every page exists is written through a mapping.
    if (::fstat(fd_, &sb) == 0 && sb.st_size > 0 &&
        static_cast<uint64_t>(sb.st_blocks) * 512 >= static_cast<uint64_t>(sb.st_size)) {
      try {
        mapped_ = pool.Map(fd_, static_cast<uint64_t>(sb.st_size), path_);
        mapped_size_ = static_cast<uint64_t>(sb.st_size);
      } catch (const Error&) {
        // Unmappable: every byte goes through pwrite.
      }
    }
  }
  ~TierFileWriter() override {
    if (fd_ >= 0) ::close(fd_);  // an abandoned write: the save's abort removes the file
  }
  void Append(const void* data, size_t n) override {
    const char* bytes = static_cast<const char*>(data);
    if (size_ < mapped_size_) {
      const size_t fits = static_cast<size_t>(std::min<uint64_t>(n, mapped_size_ - size_));
      std::memcpy(mapped_ + size_, bytes, fits);
      bytes += fits;
      n -= fits;
      size_ += fits;
    }
    if (n > 0) {
      WriteAt(fd_, bytes, n, size_, path_);
      size_ += n;
    }
  }
  void Sync() override {}  // tmpfs: nothing to make durable
  void Close() override {
    if (fd_ < 0) return;
    const int fd = fd_;
    fd_ = -1;
    TruncateAndClose(fd, size_, path_);  // the pool's mapping is only touched below size_
  }
  uint64_t size() const override { return size_; }

 private:
  int fd_;
  std::string path_;
  char* mapped_ = nullptr;  // the pool's, covering mapped_size_ bytes
  uint64_t mapped_size_ = 0;
  uint64_t size_ = 0;
};

// The tier's view of one step directory as a dcp location: a common uri on every rank (the
// operation's target must agree), the names this rank creates, and the metadata held back
// (the tier commits it itself, after the replicas). For a restore, the files of the step that
// only other nodes hold count as present with their size (`elsewhere`): the reader's check that
// every data file exists must pass on a node that fetched only what its ranks read; opening
// one still fails, naming it.
class TierStepStore : public ForwardingStore {
 public:
  TierStepStore(std::shared_ptr<Store> target, MappingPool& pool, std::string dir,
                std::string recycle, std::string uri,
                std::map<std::string, uint64_t> elsewhere = {})
      : ForwardingStore(std::move(target)),
        pool_(pool),
        dir_(std::move(dir)),
        recycle_(std::move(recycle)),
        uri_(std::move(uri)),
        elsewhere_(std::move(elsewhere)) {}
  std::string uri() const override { return uri_; }
  std::optional<uint64_t> Size(const std::string& name) override {
    auto size = ForwardingStore::Size(name);
    if (!size) {
      if (auto it = elsewhere_.find(name); it != elsewhere_.end()) return it->second;
    }
    return size;
  }
  std::unique_ptr<WritableObject> Create(const std::string& name) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      created_.insert(name);
    }
    if (!IsPlainName(name)) return ForwardingStore::Create(name);  // refused there, named
    const std::string path = dir_ + "/" + name;
    return std::make_unique<TierFileWriter>(OpenForOverwrite(recycle_, path, pool_), path, pool_);
  }
  void PublishAtomically(const std::string& name, std::string_view bytes) override {
    if (Hold(name, bytes)) return;
    ForwardingStore::PublishAtomically(name, bytes);
  }
  void PublishNew(const std::string& name, std::string_view bytes) override {
    if (Hold(name, bytes)) return;
    ForwardingStore::PublishNew(name, bytes);
  }
  std::set<std::string> created() const {
    std::lock_guard<std::mutex> lock(mu_);
    return created_;
  }
  const std::string& held_metadata() const { return metadata_; }

 private:
  bool Hold(const std::string& name, std::string_view bytes) {
    if (name != kMetadataName) return false;
    std::lock_guard<std::mutex> lock(mu_);
    metadata_.assign(bytes);
    return true;
  }
  MappingPool& pool_;
  std::string dir_, recycle_, uri_;
  std::map<std::string, uint64_t> elsewhere_;
  mutable std::mutex mu_;
  std::set<std::string> created_;
  std::string metadata_;
};

std::shared_ptr<Store> StepStore(const std::string& dir) {
  FileStoreOptions o;
  o.direct_io = false;  // tmpfs: the page cache is the storage
  return MakeFileStore(dir, o);
}

int RanksPerNodeFromEnv() {
  const char* v = std::getenv("DCP_TIER_RANKS_PER_NODE");
  if (v == nullptr || *v == '\0') return 0;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  if (*end != '\0' || n < 1 || n > (1 << 24)) {
    throw InvalidArgumentError(std::string("DCP_TIER_RANKS_PER_NODE='") + v +
                               "' is not a positive rank count");
  }
  return static_cast<int>(n);
}

void WriteWholeFile(const std::string& path, std::string_view bytes) {
  // Written under a temporary name and renamed: a reader never sees half a metadata file.
  const std::string tmp = path + ".tmp";
  ::unlink(tmp.c_str());  // a leftover (or a planted link): created afresh, never followed
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600);
  if (fd < 0) throw TierIoError("memory tier: cannot create " + tmp + ": " + std::strerror(errno));
  try {
    WriteAt(fd, bytes.data(), bytes.size(), 0, tmp);
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    throw TierIoError("memory tier: cannot rename " + tmp + ": " + std::strerror(errno));
  }
}

// A rank's failure as a vote carries it: "<ErrorCode>:<message>", so that every rank raises
// the category the failing rank met (a refused directory is not an I/O error).
std::string ErrorText(const std::exception& e) {
  const auto* error = dynamic_cast<const Error*>(&e);
  const ErrorCode code = error != nullptr ? error->code() : ErrorCode::kInternal;
  return std::to_string(static_cast<int>(code)) + ":" + e.what();
}
std::string IoText(const std::string& message) {
  return std::to_string(static_cast<int>(ErrorCode::kIo)) + ":" + message;
}
RankFailure DecodeFailure(int rank, const std::string& text) {
  const size_t colon = text.find(':');
  int code = 0;
  if (colon != std::string::npos && colon > 0 && colon <= 2) {
    for (size_t i = 0; i < colon && code >= 0; ++i) {
      code = text[i] >= '0' && text[i] <= '9' ? code * 10 + (text[i] - '0') : -1;
    }
  }
  if (code <= 0 || code > static_cast<int>(ErrorCode::kResourceExhausted)) {
    return {rank, ErrorCode::kIo, text, false};
  }
  return {rank, static_cast<ErrorCode>(code), text.substr(colon + 1), false};
}

}  // namespace

namespace tier_detail {
// One node's committed copy of a step, as its first rank reports it.
struct StepReport {
  int node = 0;
  int64_t step = 0;
  uint64_t metadata_hash = 0;  // CRC32C of metadata.dcp: nodes holding other bytes differ
  uint64_t referenced = 0;     // data files the metadata names
  std::map<std::string, uint64_t> present;  // referenced files present and long enough: size
};

// One file this rank sends: `name` of the step, to rank `dest`.
struct Transfer {
  int dest = 0;
  std::string name;
};

// Who exchanges file headers with whom in a transfer: the ranks this one sends to (each gets
// a header, maybe empty) and those it receives from.
struct Pairs {
  std::vector<int> to, from;
};

// A step's copies with one metadata: complete when its files, over every node that committed
// it, number what the metadata names.
struct Candidate {
  int64_t step = 0;
  uint64_t hash = 0;
  uint64_t referenced = 0;
  std::map<std::string, std::vector<int>> holders;  // file -> nodes holding it
  std::vector<int> nodes;                           // nodes that committed it
  bool complete() const { return holders.size() == referenced; }
};

// Newest first.
std::vector<Candidate> Candidates(const std::vector<StepReport>& reports) {
  std::map<std::pair<int64_t, uint64_t>, Candidate> by_key;
  for (const auto& rep : reports) {
    Candidate& c = by_key[{rep.step, rep.metadata_hash}];
    c.step = rep.step;
    c.hash = rep.metadata_hash;
    c.referenced = rep.referenced;
    c.nodes.push_back(rep.node);
    for (const auto& [name, size] : rep.present) c.holders[name].push_back(rep.node);
  }
  std::vector<Candidate> out;
  for (auto it = by_key.rbegin(); it != by_key.rend(); ++it) out.push_back(std::move(it->second));
  return out;
}

}  // namespace tier_detail

using tier_detail::Candidate;

MemoryTier::MemoryTier(Communicator& comm, MemoryTierOptions options,
                       std::unique_ptr<Communicator> background_comm, AsyncOptions async)
    : comm_(comm),
      options_(std::move(options)),
      rank_(comm.rank()),
      pool_(std::make_unique<tier_detail::MappingPool>()) {
  const std::string& name = options_.name;
  std::string problem;
  if (!IsPlainName(name)) problem = "name '" + name + "' is not a plain name";
  if (options_.replicas < 0) problem = "replicas must be >= 0";
  if (options_.keep < 1) problem = "keep must be >= 1";
  if (options_.shm_root.empty()) problem = "shm_root is empty";
  if (options_.transfer_chunk_bytes < 4096) problem = "transfer_chunk_bytes must be >= 4096";
  if (!problem.empty()) throw InvalidArgumentError("memory tier: " + problem);
  int per_node = options_.ranks_per_node > 0 ? options_.ranks_per_node : RanksPerNodeFromEnv();
  const int world = comm.size();
  std::string label;
  if (per_node > 0) {
    for (int r = 0; r < world; ++r) {
      if (r % per_node == 0) nodes_.emplace_back();
      nodes_.back().push_back(r);
    }
    node_ = rank_ / per_node;
    label = "node-" + std::to_string(node_);
  } else {
    // Ranks that share a host (and boot) share /dev/shm.
    auto ids = comm.AllGather(HostIdentity(), "tier/nodes");
    std::map<std::string, int> index;
    for (int r = 0; r < world; ++r) {
      auto [it, added] = index.emplace(ids[r], static_cast<int>(nodes_.size()));
      if (added) nodes_.emplace_back();
      nodes_[it->second].push_back(r);
      if (r == rank_) node_ = it->second;
    }
    label = "local";
  }
  const int nn = static_cast<int>(nodes_.size());
  // Too few nodes for the replicas (a job restarted on the nodes that survived a loss): the
  // steps in memory can still be restored and drained; saves are refused (BeginSave).
  if (options_.replicas > 0 && options_.replicas >= nn) {
    cannot_save_ = "memory tier: " + std::to_string(options_.replicas) + " replica(s) need " +
                   std::to_string(options_.replicas + 1) + " nodes; the job has " +
                   std::to_string(nn) +
                   ". Restore, CompleteSteps and Drain work; to save, set replicas below the "
                   "node count (or set ranks_per_node or DCP_TIER_RANKS_PER_NODE to simulate "
                   "nodes on one machine)";
  }
  const auto& mine = nodes_[node_];
  const size_t position = std::find(mine.begin(), mine.end(), rank_) - mine.begin();
  for (int j = 1; cannot_save_.empty() && j <= options_.replicas; ++j) {
    const auto& other = nodes_[(node_ + j) % nn];
    partners_.push_back(other[position % other.size()]);
  }
  // The ranks whose partner this one is (it keeps their replicas), by the same rule.
  for (int n = 0; cannot_save_.empty() && n < nn; ++n) {
    for (size_t p = 0; p < nodes_[n].size(); ++p) {
      for (int j = 1; j <= options_.replicas; ++j) {
        const auto& other = nodes_[(n + j) % nn];
        if (other[p % other.size()] == rank_) replica_sources_.push_back(nodes_[n][p]);
      }
    }
  }
  if (background_comm && (background_comm->rank() != rank_ || background_comm->size() != world)) {
    throw InvalidArgumentError("memory tier: the background communicator's ranks differ");
  }
  // This job's directory, private to the user, and this node's in it, locked while in use.
  root_ = JobDirectory(options_) + "/" + label;
  std::string error;
  if (leader()) {
    try {
      CheckSharedRoot(options_.shm_root);
      MakeNodeDirectories();
      node_lock_fd_ = LockNodeDirectory(root_, name);
    } catch (const std::exception& e) {
      error = ErrorText(e);
    }
  }
  try {
    Vote(comm, error, "tier/open");
  } catch (...) {
    ReleaseNodeLock();
    throw;
  }
  if (background_comm) {
    saver_ = std::make_unique<AsyncCheckpointer>(std::move(background_comm), std::move(async));
  }
}

MemoryTier::~MemoryTier() {
  saver_.reset();  // a save still running ends before the lock goes
  ReleaseNodeLock();
}

void MemoryTier::MakeNodeDirectories() const {
  const std::string job = JobDirectory(options_);
  MakePrivateDirectory(fs::path(job).parent_path().string());
  MakePrivateDirectory(job);
  ClaimJobDirectory(job, options_.owner);
  MakePrivateDirectory(root_);
}

void MemoryTier::ReleaseNodeLock() noexcept {
  if (node_lock_fd_ >= 0) ::close(node_lock_fd_);  // closing the descriptor drops the flock
  node_lock_fd_ = -1;
}

std::string MemoryTier::JobDirectory(const MemoryTierOptions& options) {
  std::string dir =
      options.shm_root + "/dcp-tier-u" + std::to_string(::geteuid()) + "/" + options.name;
  if (!options.owner.empty()) dir += "-" + OwnerHash(options.owner);
  return dir;
}

std::string MemoryTier::StepDirectory(int64_t step) const { return root_ + "/" + StepName(step); }

void MemoryTier::Vote(Communicator& comm, const std::string& my_error, std::string_view phase) {
  auto all = comm.AllGather(my_error, phase);
  std::vector<RankFailure> failures;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (!all[r].empty()) failures.push_back(DecodeFailure(r, all[r]));
  }
  if (!failures.empty()) throw CollectiveError(std::string(phase), std::move(failures));
}

// The file headers between the pairs only: each rank sends every rank of `to` (even nothing)
// and receives from every rank of `from`, first the lengths, then the bytes. A save's partners
// are known to both sides, so it needs no AllToAll, whose message to every rank would make a
// save's cost grow with the job's size.
std::vector<std::string> ExchangeHeaders(Communicator& comm, const tier_detail::Pairs& pairs,
                                         const std::vector<std::string>& headers,
                                         std::string_view what) {
  std::vector<std::string> out_len(pairs.to.size()),
      in_len(pairs.from.size(), std::string(8, '\0'));
  std::vector<Communicator::BulkSend> sends;
  std::vector<Communicator::BulkReceive> receives;
  for (size_t k = 0; k < pairs.to.size(); ++k) {
    PutU64(out_len[k], headers[pairs.to[k]].size());
    sends.push_back({pairs.to[k], out_len[k].data(), out_len[k].size()});
  }
  for (size_t k = 0; k < pairs.from.size(); ++k) {
    receives.push_back({pairs.from[k], in_len[k].data(), in_len[k].size()});
  }
  comm.ExchangeBytes(sends, receives, what);
  std::vector<std::string> got(comm.size());
  sends.clear();
  receives.clear();
  for (int dest : pairs.to) sends.push_back({dest, headers[dest].data(), headers[dest].size()});
  for (size_t k = 0; k < pairs.from.size(); ++k) {
    const int source = pairs.from[k];
    const uint64_t n = MessageReader(in_len[k], "rank " + std::to_string(source)).U64();
    constexpr uint64_t kMaxHeaderBytes = uint64_t{1} << 30;
    if (n > kMaxHeaderBytes) {
      throw CorruptionError("memory tier: rank " + std::to_string(source) + " announces " +
                            std::to_string(n) + " bytes of file headers");
    }
    got[source].resize(n);
    receives.push_back({source, got[source].data(), got[source].size()});
  }
  comm.ExchangeBytes(sends, receives, what);
  return got;
}

// First what each rank will send each other rank (file names and sizes: between the pairs, or
// an AllToAll); then the bytes, in rounds: each round moves up to transfer_chunk_bytes of every
// (sender, receiver) pair's stream (its files in order) through Communicator::ExchangeBytes,
// which MPI does without copies of its own. The bytes go straight from the sender's file to
// the receiver's, both mapped (the pool's mappings, kept across saves), so a replica costs the
// transport's copy and nothing else, where reading into and writing out of staging buffers
// cost two more copies (2.7x the exchange on 2 cores). The receiver reserves its files' pages
// (fallocate) before mapping them: a full tmpfs is an error then, not a SIGBUS in the middle of
// the transfer. Every file is opened and mapped before the bytes move (a vote first), so a
// failure never leaves a peer waiting for data that will not come; a vote at the end reports
// every outcome.
void MemoryTier::TransferFiles(Communicator& comm, int64_t step,
                               const std::vector<Transfer>& outgoing, std::string_view what,
                               std::vector<std::string>* received, const Pairs* pairs) {
  const std::string dir = StepDirectory(step);
  const std::string recycle = root_ + "/" + kRecycleDir;
  const uint64_t chunk = options_.transfer_chunk_bytes;
  std::string error;
  auto fail = [&](const std::string& e) {
    if (error.empty()) error = e;
  };
  // A pair's stream: its files, in order, each an open descriptor, a size and its mapping.
  struct PairFile {
    std::string name;
    int fd = -1;
    uint64_t size = 0;
    char* data = nullptr;  // its bytes: the pool's mapping, or `map`
    FileMapping map;       // a sent file the pool does not hold (written by another process)
  };
  struct Stream {
    std::vector<PairFile> files;
    uint64_t total = 0;
  };
  std::map<int, Stream> out_streams, in_streams;
  auto close_all = [&] {
    for (auto* streams : {&out_streams, &in_streams}) {
      for (auto& [peer, st] : *streams) {
        for (auto& f : st.files) {
          f.map.Reset();
          if (f.fd >= 0) ::close(f.fd);
          f.fd = -1;
        }
      }
    }
  };
  std::vector<std::string> headers(comm.size());
  for (const auto& t : outgoing) {
    Stream& st = out_streams[t.dest];
    PairFile f;
    f.name = t.name;
    const std::string path = dir + "/" + t.name;
    try {
      f.fd = OpenTierFile(path, O_RDWR);  // RDWR: the pool's mappings are
      struct stat sb {};
      if (::fstat(f.fd, &sb) != 0) {
        throw TierIoError("memory tier: cannot open " + path + ": " + std::strerror(errno));
      }
      f.size = static_cast<uint64_t>(sb.st_size);
      if (static_cast<uint64_t>(sb.st_blocks) * 512 >= f.size) {
        f.data = pool_->Map(f.fd, f.size, path);  // kept: the file comes back recycled
      } else {
        // A sparse file (not one the tier wrote) is read through a mapping of its own.
        f.map = FileMapping(f.fd, f.size, /*writable=*/false, path);
        f.data = f.map.data();
        stats_.bytes_mapped += f.size;
      }
    } catch (const std::exception& e) {
      fail(ErrorText(e));
    }
    st.total += f.size;
    PutString(headers[t.dest], f.name);
    PutU64(headers[t.dest], f.size);
    st.files.push_back(std::move(f));
  }
  uint64_t my_rounds = 0;
  for (const auto& [peer, st] : out_streams) {
    my_rounds = std::max(my_rounds, (st.total + chunk - 1) / chunk);
  }
  std::vector<std::string> got;
  if (pairs) {
    for (const auto& t : outgoing) {
      if (std::find(pairs->to.begin(), pairs->to.end(), t.dest) == pairs->to.end()) {
        throw InternalError("memory tier: a file for rank " + std::to_string(t.dest) +
                            ", which is not among the pairs");
      }
    }
    got = ExchangeHeaders(comm, *pairs, headers, what);
  } else {
    got = comm.AllToAll(std::move(headers), what);
  }
  bool have_dir = false;
  for (int source = 0; source < static_cast<int>(got.size()); ++source) {
    try {
      MessageReader in(got[source], "rank " + std::to_string(source));
      while (!in.done()) {
        PairFile f;
        f.name = in.String();
        f.size = in.U64();
        if (!IsPlainName(f.name) || f.name == kMetadataName) {
          throw CorruptionError("memory tier: rank " + std::to_string(source) +
                                " sends a file named '" + ClippedName(f.name) + "'");
        }
        if (!have_dir) {
          MakePrivateDirectory(dir);
          have_dir = true;
        }
        Stream& st = in_streams[source];
        st.total += f.size;
        const std::string path = dir + "/" + f.name;
        f.fd = OpenForOverwrite(recycle, path, *pool_);
        st.files.push_back(std::move(f));
        PairFile& placed = st.files.back();
        ReserveExactly(placed.fd, placed.size, path);
        placed.data = pool_->Map(placed.fd, placed.size, path);
      }
    } catch (const std::exception& e) {
      fail(ErrorText(e));
    }
  }
  uint64_t rounds = 0;
  try {
    Vote(comm, error, std::string(what) + "/ready");
    for (const auto& r : comm.AllGather(std::to_string(my_rounds), what)) {
      rounds = std::max<uint64_t>(rounds, std::stoull(r));
    }
  } catch (...) {
    close_all();
    throw;
  }
  // Every file is mapped on every rank (the vote passed). A round's window of a stream,
  // [round * chunk, +chunk), is cut at its files' boundaries; both sides know the sizes, so
  // they cut alike, and the pieces match one for one.
  auto for_each_piece = [chunk](Stream& st, uint64_t round, auto&& piece) {
    const uint64_t begin = round * chunk;
    const uint64_t end = std::min(st.total, begin + chunk);
    uint64_t file_start = 0;
    for (auto& f : st.files) {
      const uint64_t lo = std::max(begin, file_start), hi = std::min(end, file_start + f.size);
      if (lo < hi) piece(f.data + (lo - file_start), static_cast<size_t>(hi - lo));
      file_start += f.size;
      if (file_start >= end) break;
    }
  };
  for (uint64_t round = 0; round < rounds; ++round) {
    std::vector<Communicator::BulkSend> sends;
    std::vector<Communicator::BulkReceive> receives;
    for (auto& [peer, st] : out_streams) {
      for_each_piece(st, round, [&, peer = peer](char* data, size_t n) {
        sends.push_back({peer, data, n});
        stats_.bytes_sent += n;
      });
    }
    for (auto& [peer, st] : in_streams) {
      for_each_piece(st, round, [&, peer = peer](char* data, size_t n) {
        receives.push_back({peer, data, n});
        stats_.bytes_received += n;
      });
    }
    try {
      comm.ExchangeBytes(sends, receives, what);
    } catch (...) {
      // The transport may still write into the mappings of a poisoned communicator: leave
      // them mapped (they are the step's files, which the failed save removes by name).
      for (auto* streams : {&out_streams, &in_streams}) {
        for (auto& [peer, st] : *streams) {
          for (auto& f : st.files) f.map.Leak();
        }
      }
      pool_->Leak();
      close_all();
      throw;
    }
  }
  for (auto& [peer, st] : in_streams) {
    for (auto& f : st.files) {
      try {
        f.map.Reset();
        const int fd = f.fd;
        f.fd = -1;
        TruncateAndClose(fd, f.size, dir + "/" + f.name);
        if (received) received->push_back(f.name);
      } catch (const std::exception& e) {
        fail(ErrorText(e));
      }
    }
  }
  close_all();
  Vote(comm, error, std::string(what) + "/vote");
}

SaveResult MemoryTier::SaveOn(Communicator& comm, int64_t step, const StateDict& state,
                              const SaveOptions& options) {
  stats_ = {};
  auto t0 = std::chrono::steady_clock::now();
  const std::string dir = StepDirectory(step);
  std::string error;
  if (leader()) {
    // A directory of this step left by a crashed attempt (or a step being saved again after a
    // restore from an older one) is replaced.
    std::error_code ec;
    fs::remove_all(dir, ec);  // a link there is removed itself, never followed
    try {
      if (ec) throw TierIoError("memory tier: cannot prepare " + dir + ": " + ec.message());
      MakeNodeDirectories();  // again: a node whose memory was wiped lost them
      MakePrivateDirectory(dir);
    } catch (const std::exception& e) {
      error = ErrorText(e);
    }
  }
  Vote(comm, error, "tier/prepare");
  pool_->Prune();  // the files the previous saves' retention removed
  const uint64_t mapped_before = pool_->bytes_mapped();
  auto store =
      std::make_shared<TierStepStore>(StepStore(dir), *pool_, dir, root_ + "/" + kRecycleDir,
                                      "tier://" + options_.name + "/" + StepName(step));
  SaveOptions o = options;
  o.step = step;
  auto writer = MakeStoreWriter(store, o.storage);
  SaveResult result = dcp::Save(state, *writer, comm, o);
  stats_.write_s = SecondsSince(t0);

  // This rank's own data files: those it created that the metadata names.
  const auto referenced = ReferencedFiles(result.metadata);
  std::vector<std::string> own;
  for (const auto& name : store->created()) {
    if (referenced.count(name)) own.push_back(name);
  }
  for (const auto& name : own) {
    struct stat st {};
    if (::stat((dir + "/" + name).c_str(), &st) == 0) stats_.bytes_written += st.st_size;
  }
  auto t1 = std::chrono::steady_clock::now();
  std::vector<Transfer> outgoing;
  for (int partner : partners_) {
    for (const auto& name : own) outgoing.push_back({partner, name});
  }
  try {
    const Pairs pairs{partners_, replica_sources_};
    TransferFiles(comm, step, outgoing, "tier/replicate", nullptr, &pairs);
  } catch (const Error&) {
    // Not committed anywhere: no node wrote the metadata. Free the step's copies.
    if (leader()) {
      std::error_code ec;
      fs::remove_all(dir, ec);
    }
    throw;
  }
  stats_.replicate_s = SecondsSince(t1);
  stats_.bytes_mapped += pool_->bytes_mapped() - mapped_before;

  auto t2 = std::chrono::steady_clock::now();
  // Every copy of every file exists: each node commits its copy.
  std::string encoded =
      comm.Broadcast(rank_ == 0 ? store->held_metadata() : std::string(), 0, "tier/metadata");
  error.clear();
  if (leader()) {
    try {
      WriteWholeFile(dir + "/" + kMetadataName, encoded);
    } catch (const std::exception& e) {
      error = ErrorText(e);
    }
  }
  auto all =
      comm.AllGather(error.empty() ? std::string(leader() ? "W" : "") : "E" + error, "tier/commit");
  std::vector<RankFailure> failures;
  bool committed = false;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    if (all[r] == "W") committed = true;
    if (!all[r].empty() && all[r][0] == 'E') {
      failures.push_back(DecodeFailure(r, all[r].substr(1)));
    }
  }
  written_[step] = own;
  metadata_[step] = encoded;
  if (!failures.empty()) {
    throw CollectiveError("tier/commit", std::move(failures),
                          committed ? Outcome::kCommitted : Outcome::kFailed);
  }
  Retain(step);
  stats_.commit_s = SecondsSince(t2);
  return result;
}

// Keeps the newest `keep` committed steps up to `newest` and frees every other step directory
// of this node (uncommitted leftovers included). Bookkeeping: a failure is reported, not raised.
void MemoryTier::Retain(int64_t newest) {
  std::vector<int64_t> committed;
  std::vector<int64_t> other;
  if (leader()) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(root_, ec)) {
      auto step = ParseStepName(e.path().filename().string());
      if (!step) continue;
      if (!IsRealDirectory(e.path())) {
        fs::remove(e.path(), ec);  // a link in the tier's place: removed itself, never followed
        continue;
      }
      const bool has_md = IsRealFile(e.path() / kMetadataName);
      if (has_md && *step <= newest) {
        committed.push_back(*step);
      } else if (!has_md && *step != newest) {
        other.push_back(*step);  // an attempt that never committed (this job's: see LOCK)
      }
      // A committed step newer than this one (the job's earlier run got further) is kept.
    }
    std::sort(committed.rbegin(), committed.rend());
    for (size_t i = options_.keep; i < committed.size(); ++i) other.push_back(committed[i]);
    // A freed step's data files go to the recycle directory (replacing the previous step's), to
    // be written over by the next saves. Its metadata goes first: a crash midway leaves a step
    // that is not committed here, never a committed one with files missing.
    const fs::path recycle = fs::path(root_) / kRecycleDir;
    bool recycled = false;
    for (int64_t s : other) {
      const fs::path dir = StepDirectory(s);
      if (!recycled && IsRealFile(dir / kMetadataName)) {
        fs::remove(dir / kMetadataName, ec);
        if (!ec) {
          fs::remove_all(recycle, ec);
          try {
            MakePrivateDirectory(recycle.string());
          } catch (const Error& e) {
            std::cerr << "dcp: memory tier: " << e.what() << "\n";
          }
          for (const auto& e : fs::directory_iterator(dir, ec)) {
            if (IsDataObjectName(e.path().filename().string()) && IsRealFile(e.path())) {
              fs::rename(e.path(), recycle / e.path().filename(), ec);
            }
          }
          recycled = true;
        }
      }
      fs::remove_all(dir, ec);
      if (ec) {
        std::cerr << "dcp: memory tier: cannot free " << StepDirectory(s) << ": " << ec.message()
                  << "\n";
      }
    }
  }
  // Every rank forgets what no node keeps: the same rule, on the steps it saved.
  while (static_cast<int>(written_.size()) > options_.keep) {
    metadata_.erase(written_.begin()->first);
    written_.erase(written_.begin());
  }
}

std::vector<MemoryTier::StepReport> MemoryTier::GatherReports(Communicator& comm) {
  std::string mine;
  if (leader()) {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(root_, ec)) {
      auto step = ParseStepName(e.path().filename().string());
      if (!step) continue;
      if (!IsRealDirectory(e.path())) {
        std::cerr << "dcp: memory tier: ignoring " << e.path().string()
                  << ": not a directory of the tier (a link is never followed)\n";
        continue;
      }
      const std::string md_path = (e.path() / kMetadataName).string();
      std::string bytes;
      Metadata md;
      try {
        bytes = ReadTierFile(md_path, kMaxTierMetadataBytes);
        md = DecodeMetadataFile(bytes, md_path);
      } catch (const NotFoundError&) {
        continue;  // not committed on this node
      } catch (const std::exception& ex) {
        std::cerr << "dcp: memory tier: ignoring " << md_path << ": " << ex.what() << "\n";
        continue;
      }
      const auto referenced = ReferencedFiles(md);
      PutU64(mine, static_cast<uint64_t>(*step));
      PutU64(mine, Crc32c(0, bytes.data(), bytes.size()));
      PutU64(mine, referenced.size());
      std::string present;
      uint64_t count = 0;
      for (const auto& [name, extent] : referenced) {
        struct stat st {};
        const std::string path = (e.path() / name).string();
        if (::lstat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
            static_cast<uint64_t>(st.st_size) >= extent) {
          PutString(present, name);
          PutU64(present, static_cast<uint64_t>(st.st_size));
          ++count;
        }
      }
      PutU64(mine, count);
      mine += present;
    }
  }
  auto all = comm.AllGather(std::move(mine), "tier/report");
  std::vector<StepReport> reports;
  for (int r = 0; r < static_cast<int>(all.size()); ++r) {
    MessageReader in(all[r], "rank " + std::to_string(r));
    int node = 0;
    while (node < node_count() && nodes_[node].front() != r) ++node;
    while (!in.done()) {
      StepReport rep;
      rep.node = node;
      rep.step = static_cast<int64_t>(in.U64());
      rep.metadata_hash = in.U64();
      rep.referenced = in.U64();
      const uint64_t count = in.U64();
      for (uint64_t i = 0; i < count; ++i) {
        std::string name = in.String();
        rep.present[name] = in.U64();
      }
      reports.push_back(std::move(rep));
    }
  }
  return reports;
}

void MemoryTier::BeginSave(int64_t step, const SaveOptions& options) {
  if (closed_) throw InvalidArgumentError("memory tier: Save after Close");
  if (!cannot_save_.empty()) throw InvalidArgumentError(cannot_save_);
  if (step < next_step_) {
    throw InvalidArgumentError("memory tier: step " + std::to_string(step) +
                               " does not follow step " + std::to_string(next_step_ - 1));
  }
  if (options.step && *options.step != step) {
    throw InvalidArgumentError("memory tier: SaveOptions::step is set by the tier");
  }
  Wait();
  next_step_ = step + 1;
}

SaveResult MemoryTier::Save(int64_t step, const StateDict& state, const SaveOptions& options) {
  BeginSave(step, options);
  return SaveOn(comm_, step, state, options);
}

std::shared_ptr<AsyncSave> MemoryTier::SaveAsync(int64_t step, const StateDict& state,
                                                 const SaveOptions& options,
                                                 const std::string& drain_to,
                                                 const SaveOptions& drain_options) {
  if (!saver_) {
    throw InvalidArgumentError("memory tier: SaveAsync needs a background communicator");
  }
  BeginSave(step, options);
  in_flight_ =
      saver_->SaveWith(state, "tier://" + options_.name + "/" + StepName(step), options,
                       [this, step, drain_to, drain_options](
                           const StateDict& snapshot, Communicator& comm, const SaveOptions& so) {
                         SaveResult result = SaveOn(comm, step, snapshot, so);
                         if (drain_to.empty()) return std::move(result.metadata);
                         if (DrainCopies(drain_options.storage)) {
                           DrainOn(comm, step, drain_to, drain_options.storage);
                         } else {
                           // Another format or compression: the snapshot is saved there
                           // (already taken: no second copy of the training state).
                           SaveOptions durable = drain_options;
                           durable.step = step;
                           dcp::Save(snapshot, drain_to, comm, durable);
                         }
                         return std::move(result.metadata);
                       });
  return in_flight_;
}

void MemoryTier::Wait() {
  if (!in_flight_) return;
  auto s = std::move(in_flight_);
  in_flight_.reset();
  saver_->Wait();  // raises the background error, once
}

void MemoryTier::Drain(int64_t step, const std::string& uri, const StorageOptions& options) {
  Wait();
  DrainOn(comm_, step, uri, options);
}

std::vector<int64_t> MemoryTier::CompleteSteps() {
  Wait();
  std::set<int64_t> steps;
  for (const auto& c : tier_detail::Candidates(GatherReports(comm_))) {
    if (c.complete()) steps.insert(c.step);
  }
  return {steps.begin(), steps.end()};
}

std::optional<int64_t> MemoryTier::Restore(StateDict& state, const LoadOptions& options) {
  if (closed_) throw InvalidArgumentError("memory tier: Restore after Close");
  Wait();
  stats_ = {};
  const uint64_t mapped_before = pool_->bytes_mapped();
  auto t0 = std::chrono::steady_clock::now();
  const auto reports = GatherReports(comm_);
  const auto candidates = tier_detail::Candidates(reports);
  const Candidate* chosen = nullptr;
  for (const auto& c : candidates) {
    if (c.complete()) {
      chosen = &c;
      break;
    }
  }
  if (chosen == nullptr) return std::nullopt;
  const int64_t step = chosen->step;
  const std::string dir = StepDirectory(step);
  const bool committed_here =
      std::find(chosen->nodes.begin(), chosen->nodes.end(), node_) != chosen->nodes.end();

  // The metadata, from the first node that committed the step.
  const int md_root = nodes_[chosen->nodes.front()].front();
  std::string encoded;
  std::string error;
  if (rank_ == md_root) {
    try {
      encoded = ReadTierFile(dir + "/" + kMetadataName, kMaxTierMetadataBytes);
    } catch (const std::exception& e) {
      error = ErrorText(e);
    }
  }
  Vote(comm_, error, "tier/recover-metadata");
  encoded = comm_.Broadcast(std::move(encoded), md_root, "tier/recover-metadata");
  const Metadata md = DecodeMetadataFile(encoded, "tier://" + options_.name + "/" + StepName(step));
  const auto referenced = ReferencedFiles(md);
  std::vector<std::string> names;
  for (const auto& [name, extent] : referenced) names.push_back(name);

  // The files this rank's load reads: its plan's, from the metadata and its own request (a
  // custom planner's reads are not known in advance: every file).
  std::vector<bool> need(names.size(), options.planner != nullptr);
  if (options.planner == nullptr) {
    try {
      LoadPlannerOptions po;
      po.allow_partial_load = options.allow_partial_load;
      po.cast_dtypes = options.cast_dtypes;
      DefaultLoadPlanner planner(po);
      planner.SetUp(state, md, PlannerContext{rank_, comm_.size(), rank_ == 0});
      auto mark = [&](const std::string& file) {
        auto pos = std::lower_bound(names.begin(), names.end(), file);
        if (pos != names.end() && *pos == file) need[pos - names.begin()] = true;
      };
      std::set<int32_t> writers;  // version 2: the ranks whose files hold the planned items
      for (const auto& item : planner.CreateLocalPlan().items) {
        if (md.format_version >= 2) {
          auto e = md.entries.find(item.storage_index.fqn);
          if (e == md.entries.end()) continue;
          if (const auto* t = std::get_if<TensorMetadata>(&e->second)) {
            if (auto k = ChunkOrdinal(*t, item.storage_index.offset, item.storage_index.index)) {
              for (size_t c = *k; c < *k + item.chunk_span; ++c) writers.insert(ChunkWriter(*t, c));
            }
          } else {
            writers.insert(std::get<BytesMetadata>(e->second).writer);
          }
          continue;
        }
        auto it = md.storage.find(item.storage_index);
        if (it != md.storage.end()) mark(it->second.relative_path);
      }
      for (const DataFile& f : md.files) {
        if (writers.count(f.writer)) mark(f.name);
      }
    } catch (const Error&) {
      // The load below fails the same way, on every rank, with the planner's message.
    }
  }
  std::string wanted;
  for (size_t i = 0; i < names.size(); ++i) {
    if (need[i]) PutU64(wanted, i);
  }
  auto all_wanted = comm_.AllGather(std::move(wanted), "tier/recover-needs");

  // What each node lacks, and who moves it: the least loaded node holding the file sends it,
  // its ranks taking turns, and the lacking node's ranks take turns receiving, so that a node's
  // loss spreads its recovery over every rank of the survivors and of the new node.
  std::map<int, const tier_detail::StepReport*> report_of;
  for (const auto& rep : reports) {
    if (rep.step == step && rep.metadata_hash == chosen->hash) report_of[rep.node] = &rep;
  }
  std::vector<uint64_t> sent_by_node(node_count(), 0);
  std::vector<size_t> turns_of_node(node_count(), 0);
  std::vector<Transfer> outgoing;
  int expected = 0;
  std::set<int> receivers, senders;  // every rank computes the same plan: both sides know them
  for (int n = 0; n < node_count(); ++n) {
    std::set<size_t> lacking;
    for (int r : nodes_[n]) {
      MessageReader in(all_wanted[r], "rank " + std::to_string(r));
      while (!in.done()) {
        const uint64_t i = in.U64();
        if (i >= names.size()) {
          throw CorruptionError("memory tier: rank " + std::to_string(r) + " needs file " +
                                std::to_string(i) + " of " + std::to_string(names.size()));
        }
        auto rep = report_of.find(n);
        if (rep == report_of.end() || !rep->second->present.count(names[i])) lacking.insert(i);
      }
    }
    size_t k = 0;
    for (size_t i : lacking) {
      const auto& holders = chosen->holders.at(names[i]);
      int best = holders.front();
      for (int h : holders) {
        if (sent_by_node[h] < sent_by_node[best]) best = h;
      }
      sent_by_node[best] += referenced.at(names[i]);
      const int sender = nodes_[best][turns_of_node[best]++ % nodes_[best].size()];
      const int receiver = nodes_[n][k++ % nodes_[n].size()];
      if (sender == rank_) {
        outgoing.push_back({receiver, names[i]});
        receivers.insert(receiver);
      }
      if (receiver == rank_) {
        ++expected;
        senders.insert(sender);
      }
    }
  }
  error.clear();
  if (leader() && !committed_here) {
    // Whatever this node holds of the step is not committed here: start it afresh.
    std::error_code ec;
    fs::remove_all(dir, ec);
    try {
      if (ec) throw TierIoError("memory tier: cannot prepare " + dir + ": " + ec.message());
      MakeNodeDirectories();  // again: a node whose memory was wiped lost them
      MakePrivateDirectory(dir);
    } catch (const std::exception& e) {
      error = ErrorText(e);
    }
  }
  Vote(comm_, error, "tier/recover-prepare");
  std::vector<std::string> received;
  const Pairs pairs{{receivers.begin(), receivers.end()}, {senders.begin(), senders.end()}};
  TransferFiles(comm_, step, outgoing, "tier/recover", &received, &pairs);
  stats_.files_fetched = static_cast<int>(received.size());
  stats_.bytes_mapped += pool_->bytes_mapped() - mapped_before;
  error.clear();
  if (static_cast<int>(received.size()) != expected) {
    error = IoText("memory tier: rank " + std::to_string(rank_) + " received " +
                   std::to_string(received.size()) + " of the " + std::to_string(expected) +
                   " files it fetches for node " + std::to_string(node_));
  }
  Vote(comm_, error, "tier/recover-received");
  // Every file is in: a node that did not hold the step commits its copy.
  if (leader() && !committed_here) {
    try {
      WriteWholeFile(dir + "/" + kMetadataName, encoded);
    } catch (const std::exception& e) {
      error = ErrorText(e);
    }
  }
  Vote(comm_, error, "tier/recover-commit");
  stats_.recover_s = SecondsSince(t0);

  auto t1 = std::chrono::steady_clock::now();
  std::map<std::string, uint64_t> elsewhere;
  for (const auto& [node, rep] : report_of) {
    for (const auto& [name, size] : rep->present) elsewhere.emplace(name, size);
  }
  auto store = std::make_shared<TierStepStore>(
      StepStore(dir), *pool_, dir, root_ + "/" + kRecycleDir,
      "tier://" + options_.name + "/" + StepName(step), std::move(elsewhere));
  auto reader = MakeStoreReader(store, options.storage);
  dcp::Load(state, *reader, comm_, options);
  stats_.load_s = SecondsSince(t1);
  next_step_ = std::max(next_step_, step + 1);
  return step;
}

bool MemoryTier::DrainCopies(const StorageOptions& options) {
  return options.format == CheckpointFormat::kDcp && options.compression == Compression::kNone;
}

void MemoryTier::DrainOn(Communicator& comm, int64_t step, const std::string& uri,
                         const StorageOptions& options) {
  const auto t0 = std::chrono::steady_clock::now();
  auto files = written_.find(step);
  if (files == written_.end()) {
    throw InvalidArgumentError("memory tier: step " + std::to_string(step) +
                               " was not saved by this tier (or is no longer kept): cannot drain "
                               "it to " +
                               uri);
  }
  if (!DrainCopies(options)) {
    throw InvalidArgumentError(
        "memory tier: Drain copies the tier's files (the dcp format, uncompressed) and cannot "
        "write another format or compress; save the state to " +
        uri + " with dcp::Save (CheckpointManager does so for such durable steps)");
  }
  const std::string dir = StepDirectory(step);
  // Rank 0 holds the destination's writer lock from the existence check to the commit and the
  // clean-up, as a save does: a replaced checkpoint (StorageOptions::overwrite) stays loadable
  // until the new metadata is in place, and its files go only after that.
  std::shared_ptr<Store> dest;
  std::unique_ptr<StoreLock> lock;
  bool replacing = false;
  std::string replaced_version;  // what the commit may replace (s3://: its ETag)
  std::set<std::string> replaced_files;
  std::string error;
  if (rank_ == 0) {
    try {
      dest = OpenStore(uri, options.backend);
      dest->CreateRoot();
      char host[256] = {};
      if (gethostname(host, sizeof(host) - 1) != 0) std::strcpy(host, "unknown-host");
      lock = dest->TryLock(std::string("host=") + host + " pid=" + std::to_string(::getpid()) +
                           " memory-tier-drain step=" + std::to_string(step));
      if (dest->SizeAndVersion(kMetadataName, &replaced_version)) {
        if (!options.overwrite) {
          throw AlreadyExistsError("memory tier: " + uri +
                                   " already holds a checkpoint; set StorageOptions::overwrite "
                                   "(CheckpointManager: allow_replacing_steps) to replace it");
        }
        replacing = true;
        try {
          replaced_files = ReadMetadata(uri, options).DataFileNames();
        } catch (const Error&) {
          // A damaged checkpoint being replaced: its files stay (dcp verify lists them).
        }
      }
    } catch (const std::exception& e) {
      error = ErrorText(e);
    }
  }
  Vote(comm, error, "tier/drain-open");
  // Each rank copies the files it wrote; what it copied goes again if the drain fails.
  std::vector<std::string> copied;
  auto remove_copies = [&]() noexcept {
    for (const auto& name : copied) {
      try {
        dest->Remove(name);
      } catch (...) {
        // Unreferenced: dcp verify lists it, and the next save there removes it.
      }
    }
  };
  error.clear();
  try {
    if (!dest) dest = OpenStore(uri, options.backend);
    constexpr size_t kPiece = 16 << 20;  // what a store is handed at once
    std::vector<char> buffer(kPiece);
    for (const auto& name : files->second) {
      const std::string path = dir + "/" + name;
      int fd = OpenTierFile(path, O_RDONLY);
      try {
        struct stat st {};
        if (::fstat(fd, &st) != 0) throw TierIoError("memory tier: cannot stat " + path);
        copied.push_back(name);
        auto out = dest->Create(name);
        const uint64_t size = static_cast<uint64_t>(st.st_size);
        for (uint64_t at = 0; at < size; at += kPiece) {
          const size_t n = static_cast<size_t>(std::min<uint64_t>(kPiece, size - at));
          ReadAt(fd, buffer.data(), n, at, path);
          out->Append(buffer.data(), n);
        }
        if (options.sync) out->Sync();
        out->Close();
        stats_.bytes_sent += size;
      } catch (...) {
        ::close(fd);
        throw;
      }
      ::close(fd);
    }
  } catch (const std::exception& e) {
    error = ErrorText(e);
  }
  try {
    Vote(comm, error, "tier/drain");
  } catch (...) {
    remove_copies();
    throw;
  }
  error.clear();
  if (rank_ == 0) {
    const std::string& encoded = metadata_.at(step);
    try {
      if (lock) lock->CheckHeld();
      if (replacing) {
        // Only over the checkpoint found: a writer that took the location over meanwhile (a
        // lease that ran out) keeps its commit.
        dest->PublishReplacing(kMetadataName, encoded, replaced_version);
      } else {
        dest->PublishNew(kMetadataName, encoded);
      }
    } catch (const std::exception& e) {
      // Committed all the same when the metadata in place is ours (a failure after the rename).
      bool ours = false;
      try {
        ours = dest->Size(kMetadataName) == encoded.size() &&
               dest->ReadAll(kMetadataName, encoded.size()) == encoded;
      } catch (...) {
      }
      if (!ours) error = ErrorText(e);
    }
    if (error.empty() && !replaced_files.empty()) {
      // The replaced checkpoint's files that the new one does not name are dead now.
      std::vector<std::string> dead;
      try {
        const Metadata md = DecodeMetadataFile(encoded, uri);
        const auto live = md.DataFileNames();
        for (const auto& name : replaced_files) {
          if (!live.count(name)) dead.push_back(name);
        }
        if (lock) lock->CheckHeld();
        dest->RemoveMany(dead);
      } catch (const std::exception& e) {
        std::cerr << "dcp: memory tier: step " << step << " replaced the checkpoint at " << uri
                  << "; removing the replaced files failed (" << e.what()
                  << "): dcp verify lists them\n";
      }
    }
  }
  try {
    Vote(comm, error, "tier/drain-commit");
  } catch (...) {
    remove_copies();
    throw;
  }
  stats_.drain_s = SecondsSince(t0);
}

void MemoryTier::Close() {
  if (closed_) return;
  closed_ = true;
  std::exception_ptr pending;
  try {
    Wait();
  } catch (...) {
    pending = std::current_exception();
  }
  if (saver_) saver_->Close();
  pool_->Clear();  // every rank's mappings, so that freed files' pages go
  std::string error;
  if (options_.free_on_close && leader()) {
    std::error_code ec;
    fs::remove_all(root_, ec);
    if (ec) error = IoText("memory tier: cannot free " + root_ + ": " + ec.message());
  }
  Vote(comm_, error, "tier/close");
  ReleaseNodeLock();
  if (pending) std::rethrow_exception(pending);
}

}  // namespace dcp
