#include "dcp/proto/staging.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <new>
#include <vector>

namespace dcp {

namespace {

struct Pool {
  std::mutex mu;
  std::vector<std::pair<char*, size_t>> idle;
  uint64_t allocated = 0;
  // A few buffers per concurrent writer/reader; beyond that the smallest idle one is freed.
  static constexpr size_t kMaxIdle = 16;
};

Pool& GetPool() {
  static Pool* p = new Pool;  // never destroyed: leases may be returned during exit
  return *p;
}

}  // namespace

HostBuffer::HostBuffer(size_t bytes) { Reserve(bytes); }

void HostBuffer::Reserve(size_t bytes) {
  if (data_ != nullptr && size_ >= bytes) return;
  Release();
  Pool& pool = GetPool();
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    auto best = pool.idle.end();
    for (auto it = pool.idle.begin(); it != pool.idle.end(); ++it) {
      if (it->second >= bytes && (best == pool.idle.end() || it->second < best->second)) best = it;
    }
    if (best != pool.idle.end()) {
      data_ = best->first;
      size_ = best->second;
      pool.idle.erase(best);
      return;
    }
  }
  const size_t n = std::max<size_t>(4096, (bytes + 4095) / 4096 * 4096);
  void* p = std::aligned_alloc(4096, n);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, n);  // fault the pages in now, once
  data_ = static_cast<char*>(p);
  size_ = n;
  std::lock_guard<std::mutex> lock(pool.mu);
  pool.allocated += n;
}

HostBuffer::HostBuffer(HostBuffer&& o) noexcept : data_(o.data_), size_(o.size_) {
  o.data_ = nullptr;
  o.size_ = 0;
}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    Release();
    data_ = o.data_;
    size_ = o.size_;
    o.data_ = nullptr;
    o.size_ = 0;
  }
  return *this;
}

HostBuffer::~HostBuffer() { Release(); }

void HostBuffer::Release() noexcept {
  if (data_ == nullptr) return;
  Pool& pool = GetPool();
  char* evicted = nullptr;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    pool.idle.emplace_back(data_, size_);
    if (pool.idle.size() > Pool::kMaxIdle) {
      auto smallest =
          std::min_element(pool.idle.begin(), pool.idle.end(),
                           [](const auto& a, const auto& b) { return a.second < b.second; });
      evicted = smallest->first;
      pool.idle.erase(smallest);
    }
  }
  std::free(evicted);
  data_ = nullptr;
  size_ = 0;
}

uint64_t HostStagingBytesAllocated() {
  std::lock_guard<std::mutex> lock(GetPool().mu);
  return GetPool().allocated;
}

}  // namespace dcp
