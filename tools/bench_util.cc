#include "tools/bench_util.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <filesystem>
#include <thread>

namespace dcp::bench {

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

double TimeRanks(InProcessGroup& group, const std::function<void(int, Communicator&)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(group.size()));
  std::vector<std::thread> threads;
  const auto t0 = Clock::now();
  for (int r = 0; r < group.size(); ++r) {
    threads.emplace_back([&, r] {
      try {
        fn(r, group.communicator(r));
      } catch (...) {
        errors[static_cast<size_t>(r)] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  const double s = Since(t0);
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  return s;
}

TensorView AlignedTensor(DType dt, Shape shape) {
  TensorView v;
  v.dtype = dt;
  v.shape = std::move(shape);
  const size_t rounded = std::max(kPage, (v.nbytes() + kPage - 1) / kPage * kPage);
  void* p = std::aligned_alloc(kPage, rounded);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  v.owner = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  v.data = p;
  return v;
}

std::vector<std::string> FilesUnder(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir)) {
    if (e.is_regular_file()) out.push_back(e.path().string());
  }
  return out;
}

bool ResetPeakRss() {
  const int fd = ::open("/proc/self/clear_refs", O_WRONLY | O_CLOEXEC);
  if (fd < 0) return false;
  const bool ok = ::write(fd, "5", 1) == 1;
  ::close(fd);
  return ok;
}

namespace {
uint64_t StatusKiB(const char* key) {
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t kib = 0;
  const size_t klen = std::strlen(key);
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, key, klen) == 0) {
      kib = std::strtoull(line + klen, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return kib;
}
}  // namespace

uint64_t RssBytes() { return StatusKiB("VmRSS:") << 10; }
uint64_t PeakRssBytes() { return StatusKiB("VmHWM:") << 10; }

uint64_t ReadCallBytes() {
  std::FILE* f = std::fopen("/proc/self/io", "r");
  if (f == nullptr) return 0;
  char line[256];
  uint64_t bytes = 0;
  while (std::fgets(line, sizeof line, f)) {
    if (std::strncmp(line, "rchar:", 6) == 0) {
      bytes = std::strtoull(line + 6, nullptr, 10);
      break;
    }
  }
  std::fclose(f);
  return bytes;
}

void Die(const std::string& what) {
  std::fprintf(stderr, "%s: %s\n", what.c_str(), std::strerror(errno));
  std::exit(1);
}

void RawWrite(const std::string& path, const std::vector<TensorView>& ts) {
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_DIRECT, 0644);
  bool direct = fd >= 0;
  if (fd < 0) fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) Die("open " + path);
  uint64_t off = 0;
  for (const auto& t : ts) {
    const char* p = static_cast<const char*>(t.data);
    size_t n = t.nbytes();
    if (direct && (off % kPage || n % kPage || reinterpret_cast<uintptr_t>(p) % kPage)) {
      if (::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_DIRECT) != 0) Die("fcntl");
      direct = false;
    }
    while (n > 0) {
      const ssize_t w = ::pwrite(fd, p, std::min(n, kRawBlock), static_cast<off_t>(off));
      if (w <= 0) Die("write " + path);
      p += w;
      n -= static_cast<size_t>(w);
      off += static_cast<uint64_t>(w);
    }
  }
  if (::fsync(fd) != 0) Die("fsync " + path);
  ::close(fd);
}

void RawRead(const std::string& path, const std::vector<TensorView>& ts) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) Die("open " + path);
  uint64_t off = 0;
  for (const auto& t : ts) {
    char* p = static_cast<char*>(t.data);
    size_t n = t.nbytes();
    while (n > 0) {
      const ssize_t r = ::pread(fd, p, std::min(n, kRawBlock), static_cast<off_t>(off));
      if (r <= 0) Die("read " + path);
      p += r;
      n -= static_cast<size_t>(r);
      off += static_cast<uint64_t>(r);
    }
  }
  ::close(fd);
}

}  // namespace dcp::bench
