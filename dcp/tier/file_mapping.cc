#include "dcp/tier/file_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "dcp/proto/error.h"
#include "dcp/tier/tier_internal.h"

namespace dcp::tier_detail {

namespace fs = std::filesystem;

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

void TruncateAndClose(int fd, uint64_t size, const std::string& path) {
  const bool ok = ::ftruncate(fd, static_cast<off_t>(size)) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) {
    errno = err;
    throw TierIoError("memory tier: cannot truncate " + path + ": " + std::strerror(err));
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

FileMapping::FileMapping(int fd, uint64_t size, bool writable, const std::string& path)
    : size_(size) {
  if (size == 0) return;
  void* p = ::mmap(nullptr, size, PROT_READ | (writable ? PROT_WRITE : 0),
                   MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    throw TierIoError("memory tier: cannot map " + path + ": " + std::strerror(errno));
  }
  data_ = static_cast<char*>(p);
}

void FileMapping::Reset() {
  if (data_ != nullptr) ::munmap(data_, size_);
  data_ = nullptr;
}

char* MappingPool::Map(int fd, uint64_t size, const std::string& path) {
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

char* MappingPool::Find(int fd, uint64_t size) {
  struct stat sb {};
  if (size == 0 || ::fstat(fd, &sb) != 0) return nullptr;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = entries_.find(Key{sb.st_dev, sb.st_ino});
  return it != entries_.end() && it->second.map.size() >= size ? it->second.map.data() : nullptr;
}

bool MappingPool::Holds(dev_t dev, ino_t ino) const {
  std::lock_guard<std::mutex> lock(mu_);
  return entries_.count(Key{dev, ino}) > 0;
}

uint64_t MappingPool::bytes_mapped() const {
  std::lock_guard<std::mutex> lock(mu_);
  return bytes_mapped_;
}

void MappingPool::Prune() {
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

void MappingPool::Clear() {
  std::lock_guard<std::mutex> lock(mu_);
  while (!entries_.empty()) Drop(entries_.begin());
}

void MappingPool::Leak() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& [key, e] : entries_) {
    e.map.Leak();
    ::close(e.fd);
  }
  entries_.clear();
}

std::map<MappingPool::Key, MappingPool::Entry>::iterator MappingPool::Drop(
    std::map<Key, Entry>::iterator it) {
  it->second.map.Reset();
  if (it->second.fd >= 0) ::close(it->second.fd);
  return entries_.erase(it);
}

namespace {

// A data file's name without its save id ("data-<save>-r<rank>-b<bucket>.data" gives
// "r<rank>-b<bucket>.data"): what a rank's file of one step shares with its file of the next.
std::string_view WithoutSaveId(std::string_view name) {
  if (name.substr(0, 5) != "data-") return name;
  const size_t dash = name.find('-', 5);
  return dash == std::string_view::npos ? name : name.substr(dash + 1);
}

}  // namespace

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

TierFileWriter::TierFileWriter(int fd, std::string path, MappingPool& pool,
                               std::function<void(const std::string&)> on_closed)
    : fd_(fd), path_(std::move(path)), on_closed_(std::move(on_closed)) {
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

TierFileWriter::~TierFileWriter() {
  if (fd_ >= 0) ::close(fd_);  // an abandoned write: the save's abort removes the file
}

void TierFileWriter::Append(const void* data, size_t n) {
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

void TierFileWriter::Close() {
  if (fd_ < 0) return;
  const int fd = fd_;
  fd_ = -1;
  TruncateAndClose(fd, size_, path_);  // the pool's mapping is only touched below size_
  if (on_closed_) on_closed_(path_);
}

}  // namespace dcp::tier_detail
