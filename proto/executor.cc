#include "dcp/proto/executor.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace dcp {
namespace {

// Idle threads wait this long for work before they retire: long enough to span the gaps
// between the phases of a save, short enough that an idle process holds no thread for long.
constexpr auto kIdleRetire = std::chrono::seconds(10);

class ThreadPool;

// The pool the current thread works for (null on other threads), and whether its job has said
// it is about to end (AboutToFinishPoolJob).
thread_local ThreadPool* t_pool = nullptr;
thread_local bool t_finishing = false;

class ThreadPool {
 public:
  void Post(std::function<void()> job) {
    std::unique_lock<std::mutex> lock(mu_);
    jobs_.push_back(std::move(job));
    // Each waiting thread takes one queued job, and so does each thread whose job is about to
    // end (it has delivered, or is delivering, its result: a caller that waited for it may post
    // again before that thread waits); a job beyond them gets a thread of its own.
    if (jobs_.size() <= idle_ + finishing_) {
      cv_.notify_one();
      return;
    }
    try {
      std::thread([this] { Work(); }).detach();
      ++threads_;
    } catch (...) {
      jobs_.pop_back();
      throw;
    }
  }

  size_t threads() {
    std::lock_guard<std::mutex> lock(mu_);
    return threads_;
  }
  std::mutex& mu() { return mu_; }

  void Finishing() {
    std::lock_guard<std::mutex> lock(mu_);
    ++finishing_;
  }

 private:
  void Work() {
    t_pool = this;
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      if (jobs_.empty()) {
        ++idle_;
        const bool got = cv_.wait_for(lock, kIdleRetire, [&] { return !jobs_.empty(); });
        --idle_;
        if (!got) {
          --threads_;
          return;
        }
      }
      std::function<void()> job = std::move(jobs_.front());
      jobs_.pop_front();
      lock.unlock();
      job();
      job = nullptr;  // captures die before the thread waits again
      lock.lock();
      if (t_finishing) {
        t_finishing = false;
        --finishing_;
      }
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  size_t idle_ = 0;
  size_t finishing_ = 0;  // threads between AboutToFinishPoolJob and their next wait
  size_t threads_ = 0;
};

// Never destroyed: detached threads still use it while the process exits.
std::atomic<ThreadPool*> current_pool{nullptr};

// fork() copies only the calling thread: a child that kept the parent's pool would count idle
// threads that do not exist in it and queue work that never runs. The pool's lock is held
// across fork (no thread is inside it then), and the child starts from a fresh, empty pool;
// the parent's copy is left unused.
void LockPoolForFork() { current_pool.load()->mu().lock(); }
void UnlockPoolAfterFork() { current_pool.load()->mu().unlock(); }
void FreshPoolInChild() { current_pool.store(new ThreadPool); }

ThreadPool& Pool() {
  static std::once_flag once;
  std::call_once(once, [] {
    current_pool.store(new ThreadPool);
    pthread_atfork(LockPoolForFork, UnlockPoolAfterFork, FreshPoolInChild);
  });
  return *current_pool.load();
}

}  // namespace

void RunOnPoolThread(std::function<void()> job) { Pool().Post(std::move(job)); }

void AboutToFinishPoolJob() noexcept {
  // A forked child's pool is a new one: a thread of the parent's never runs there.
  if (t_pool == nullptr || t_finishing || t_pool != current_pool.load()) return;
  t_pool->Finishing();
  t_finishing = true;
}

size_t PoolThreadCount() { return Pool().threads(); }

void ParallelFor(size_t n, const std::function<void(size_t)>& fn, size_t threads) {
  if (threads == 0) threads = std::clamp<size_t>(std::thread::hardware_concurrency(), 1, 16);
  threads = std::min(threads, n);
  if (threads <= 1) {
    for (size_t i = 0; i < n; ++i) fn(i);
    return;
  }
  std::atomic<size_t> next{0};
  std::mutex mu;
  std::exception_ptr first;
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < n;) {
      try {
        fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> lock(mu);
        if (!first) first = std::current_exception();
        next = n;  // hand out nothing more
      }
    }
  };
  {
    std::vector<Task<void>> helpers;  // their destructors wait, also if Spawn throws
    helpers.reserve(threads - 1);
    for (size_t t = 1; t < threads; ++t) helpers.push_back(Spawn(work));
    work();
  }
  if (first) std::rethrow_exception(first);
}

}  // namespace dcp
