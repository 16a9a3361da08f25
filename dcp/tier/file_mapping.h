// The memory tier's files on this node (not installed): read and written only as regular files
// of the user's own, never through a link, and kept mapped across saves (MappingPool) so that a
// step written over a freed one's files maps nothing anew.
//
// Errors: TierIoError (IoError, not retryable) for a failed call, CorruptionError for a file that
// is not what the tier writes (a link, FIFO, device). Thread safety: MappingPool is thread-safe;
// FileMapping and TierFileWriter are used by one thread at a time.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>

#include "dcp/storage/store.h"

namespace dcp::tier_detail {

// Write `n` bytes at `offset` of `fd`, naming `path` in the error.
void WriteAt(int fd, const char* data, size_t n, uint64_t offset, const std::string& path);
// Read `n` bytes at `offset` of `fd`; a file that ends early is an error naming `path`.
void ReadAt(int fd, char* data, size_t n, uint64_t offset, const std::string& path);
// Truncates the file at `fd` to `size` and closes it (closed even when the truncation fails).
void TruncateAndClose(int fd, uint64_t size, const std::string& path);

// The bytes of a regular file of the tier, at most `max_bytes`. A link, FIFO or device is
// refused (CorruptionError), never followed or waited on. NotFoundError when absent.
std::string ReadTierFile(const std::string& path, uint64_t max_bytes);
// A tier file opened with `flags` (O_CREAT: created 0600 if absent): a regular file, never
// through a link; a FIFO or device is refused, never waited on. The caller closes it.
int OpenTierFile(const std::string& path, int flags);
// Writes `bytes` as the file `path` (0600) under a temporary name and renames it: a reader
// never sees half a file.
void WriteWholeFile(const std::string& path, std::string_view bytes);

// Whether `path` is a directory (a regular file) itself: a link to one does not count.
bool IsRealDirectory(const std::filesystem::path& path);
bool IsRealFile(const std::filesystem::path& path);

// A file's pages mapped shared (MAP_POPULATE: mapped in one pass, not faulted in one by one).
// Move-only; unmaps when destroyed unless Leak()ed.
class FileMapping {
 public:
  FileMapping() = default;
  FileMapping(int fd, uint64_t size, bool writable, const std::string& path);
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
  void Reset();
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
  char* Map(int fd, uint64_t size, const std::string& path);
  /// The kept mapping of the file open at `fd` when it covers `size` bytes, else null.
  char* Find(int fd, uint64_t size);
  /// Whether the file with this identity is kept mapped.
  bool Holds(dev_t dev, ino_t ino) const;
  /// Bytes mapped anew so far (mappings the pool already held are not counted again).
  uint64_t bytes_mapped() const;
  /// Unmaps the files that no longer exist.
  void Prune();
  void Clear();
  /// Forgets every mapping without unmapping it: a transport that may still write into one
  /// must never find it gone, or another mapping in its place.
  void Leak();

 private:
  using Key = std::pair<dev_t, ino_t>;
  struct Entry {
    FileMapping map;
    int fd = -1;
  };
  std::map<Key, Entry>::iterator Drop(std::map<Key, Entry>::iterator it);
  mutable std::mutex mu_;
  std::map<Key, Entry> entries_;
  uint64_t bytes_mapped_ = 0;
};

// Opens `path` for writing from offset 0 without truncating, as a file taken from `recycle_dir`
// when there is one (renamed: atomic, and two ranks never get the same one), else a new one.
// The ranks of a node share the directory; each takes first the file that held the same data
// file of an earlier step (same name but for the save id: the same size, and the mapping this
// rank kept of it), then any file it keeps mapped, then any. So a save in the steady state
// writes over its own earlier files and maps nothing anew. The writer truncates the file to
// what it wrote when it closes.
int OpenForOverwrite(const std::string& recycle_dir, const std::string& path,
                     const MappingPool& pool);

// Makes the file at `fd` exactly `size` bytes with every page allocated, so that writing
// through a mapping cannot hit a full tmpfs (SIGBUS): that fails here, as an error naming it.
// File systems without fallocate keep the sparse size.
void ReserveExactly(int fd, uint64_t size, const std::string& path);

// A data file of a step being written: sequential writes over a possibly recycled file. The
// recycled file's pages are written through the pool's mapping (copies at memory speed,
// without pwrite's per-page lookups), which the replication then sends from. Bytes past those
// pages go through pwrite, where a full tmpfs is an error, not a SIGBUS. Owns `fd`.
class TierFileWriter : public WritableObject {
 public:
  // `on_closed` (when set) is called with the path once Close has completed the file.
  TierFileWriter(int fd, std::string path, MappingPool& pool,
                 std::function<void(const std::string&)> on_closed = {});
  ~TierFileWriter() override;
  void Append(const void* data, size_t n) override;
  void Sync() override {}  // tmpfs: nothing to make durable
  void Close() override;
  uint64_t size() const override { return size_; }

 private:
  int fd_;
  std::string path_;
  char* mapped_ = nullptr;  // the pool's, covering mapped_size_ bytes
  uint64_t mapped_size_ = 0;
  uint64_t size_ = 0;
  std::function<void(const std::string&)> on_closed_;
};

}  // namespace dcp::tier_detail
