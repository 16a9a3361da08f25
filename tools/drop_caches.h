// Page-cache eviction for the benchmarks' cold figures, shared by dcp-bench and its LibTorch peer
// (dcp-bench-torch-peer) so that both measure "cold" the same way.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <string>
#include <vector>

namespace dcp::tools {

/// Evict `files` from the page cache: sync, then /proc/sys/vm/drop_caches ("1": the page cache,
/// machine-wide) when writable, otherwise posix_fadvise(DONTNEED) on each file (works for clean
/// pages without privileges). Returns the method used: "drop_caches" or "fadvise_dontneed".
inline std::string DropCaches(const std::vector<std::string>& files) {
  ::sync();
  const int fd = ::open("/proc/sys/vm/drop_caches", O_WRONLY | O_CLOEXEC);
  if (fd >= 0) {
    const bool ok = ::write(fd, "1", 1) == 1;
    ::close(fd);
    if (ok) return "drop_caches";
  }
  for (const auto& f : files) {
    const int r = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (r < 0) continue;
    ::fdatasync(r);
    ::posix_fadvise(r, 0, 0, POSIX_FADV_DONTNEED);
    ::close(r);
  }
  return "fadvise_dontneed";
}

}  // namespace dcp::tools
