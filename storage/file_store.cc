#include "storage/file_store.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <random>

#include "proto/error.h"

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

std::string RandomSuffix() {
  static thread_local std::mt19937_64 rng(std::random_device{}());
  char buf[17];
  snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

// Writes go to the final name directly: data files are only meaningful once the metadata that
// names them is committed, so a partial one is harmless, and the destructor removes it when the
// object is abandoned.
class FileWritable : public WritableObject {
 public:
  explicit FileWritable(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd_ < 0) throw MakeIoError("create", path_, errno);
  }
  ~FileWritable() override {
    if (fd_ >= 0) {
      ::close(fd_);
      ::unlink(path_.c_str());
    }
  }
  void Append(const void* data, size_t n) override {
    WriteFully(fd_, static_cast<const char*>(data), n, size_, path_);
    size_ += n;
  }
  void Sync() override {
    if (::fdatasync(fd_) != 0) throw MakeIoError("fdatasync", path_, errno);
  }
  void Close() override {
    const int fd = fd_;
    fd_ = -1;
    if (::close(fd) != 0) throw MakeIoError("close", path_, errno);
  }
  uint64_t size() const override { return size_; }

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
};

class FileReadable : public ReadableObject {
 public:
  explicit FileReadable(std::string path) : path_(std::move(path)) {
    fd_ = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd_ < 0) {
      if (errno == ENOENT) throw NotFoundError("file '" + path_ + "' does not exist");
      throw MakeIoError("open", path_, errno);
    }
    struct stat st;
    if (::fstat(fd_, &st) != 0) throw MakeIoError("stat", path_, errno);
    size_ = static_cast<uint64_t>(st.st_size);
  }
  ~FileReadable() override { ::close(fd_); }
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

class FileStore : public Store {
 public:
  explicit FileStore(std::string dir) : dir_(std::move(dir)) {
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
    return std::make_unique<FileWritable>(Path(name));
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
    return static_cast<uint64_t>(st.st_size);
  }
  void PublishAtomically(const std::string& name, std::string_view bytes) override {
    const std::string final_path = Path(name);
    const std::string tmp = final_path + ".tmp." + RandomSuffix();
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

 private:
  std::string Path(const std::string& name) const { return dir_ + "/" + name; }
  std::string dir_;
};

}  // namespace

std::shared_ptr<Store> MakeFileStore(const std::string& directory) {
  return std::make_shared<FileStore>(directory);
}

}  // namespace dcp
