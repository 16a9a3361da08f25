#include "dcp/proto/staging.h"

#include <pthread.h>

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
  uint64_t idle_bytes = 0;
  // A few buffers per concurrent writer/reader; beyond that the smallest idle one is freed.
  // An s3:// writer holds parts_in_flight + 1 parts (5 by default): at 16, four ranks of one
  // process freed some at every save and faulted them in again at the next (~20 ms of CPU per
  // 8 MiB part on a busy host). kMaxIdleBytes bounds what they hold.
  static constexpr size_t kMaxIdle = 64;
  // What an idle process keeps: a buffer that would take the pool past this (an async
  // checkpointer's staging for a whole model, say) is freed when it comes back.
  static constexpr uint64_t kMaxIdleBytes = uint64_t{1} << 30;
};

Pool* the_pool = nullptr;

Pool& GetPool() {
  static std::once_flag once;
  std::call_once(once, [] {
    the_pool = new Pool;  // never destroyed: leases may be returned during exit
    // Held across fork(), so a child never inherits it locked by a thread it does not have.
    pthread_atfork([] { the_pool->mu.lock(); }, [] { the_pool->mu.unlock(); },
                   [] { the_pool->mu.unlock(); });
  });
  return *the_pool;
}

}  // namespace

HostBuffer::HostBuffer(size_t bytes) { Reserve(bytes); }

void HostBuffer::Reserve(size_t bytes) {
  if (data_ != nullptr && size_ >= bytes) return;
  Release();
  Pool& pool = GetPool();
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    // The smallest idle buffer that fits, if it is at most twice the size asked for: an async
    // snapshot of many small tensors would otherwise take the writers' large idle buffers, one
    // small tensor each, and the writers would then fault in new ones (measured: 30 MiB over
    // the budget for a snapshot of 256 tensors of 1 MiB).
    auto best = pool.idle.end();
    for (auto it = pool.idle.begin(); it != pool.idle.end(); ++it) {
      if (it->second >= bytes && it->second / 2 <= bytes &&
          (best == pool.idle.end() || it->second < best->second)) {
        best = it;
      }
    }
    if (best != pool.idle.end()) {
      data_ = best->first;
      size_ = best->second;
      pool.idle_bytes -= best->second;
      pool.idle.erase(best);
      return;
    }
  }
  // Whole pages; from 1 MiB up, whole MiB, so that buffers asked for with sizes a little apart
  // (a load's exchange rounds, say) fit each other's leases instead of each faulting in its own.
  const size_t unit = bytes >= (size_t{1} << 20) ? size_t{1} << 20 : 4096;
  const size_t n = std::max<size_t>(4096, (bytes + unit - 1) / unit * unit);
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
  std::vector<char*> evicted;
  {
    std::lock_guard<std::mutex> lock(pool.mu);
    if (size_ > Pool::kMaxIdleBytes) {
      evicted.push_back(data_);
    } else {
      pool.idle.emplace_back(data_, size_);
      pool.idle_bytes += size_;
      // Over a limit: free the smallest idle buffers (the big ones are the costly ones to fault).
      while (pool.idle.size() > Pool::kMaxIdle || pool.idle_bytes > Pool::kMaxIdleBytes) {
        auto smallest =
            std::min_element(pool.idle.begin(), pool.idle.end(),
                             [](const auto& a, const auto& b) { return a.second < b.second; });
        evicted.push_back(smallest->first);
        pool.idle_bytes -= smallest->second;
        pool.idle.erase(smallest);
      }
    }
  }
  for (char* p : evicted) std::free(p);
  data_ = nullptr;
  size_ = 0;
}

uint64_t HostStagingBytesAllocated() {
  std::lock_guard<std::mutex> lock(GetPool().mu);
  return GetPool().allocated;
}

}  // namespace dcp
