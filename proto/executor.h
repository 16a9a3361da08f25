// The one executor: every thread the libraries run work on comes from one process-wide pool.
// Internal: not installed.
//
// The pool grows on demand (a job never waits for a thread, so jobs that block on other jobs,
// as an I/O task waiting for its parts does, cannot deadlock it) and idle threads are kept for
// reuse, then retire after a while. CPU-bound fan-out is bounded by its caller (ParallelFor's
// `threads`), I/O fan-out by the caller's window (e.g. S3 parts in flight).
#pragma once

#include <cstddef>
#include <functional>
#include <future>
#include <memory>
#include <optional>
#include <type_traits>
#include <utility>

namespace dcp {

/// Run `job` on a pooled thread (an idle one, else a new one). Throws std::system_error when
/// no thread can be created. `job` must not throw (Spawn wraps it so).
void RunOnPoolThread(std::function<void()> job);

/// Called by a job on a pool thread that has done its work and only delivers its result now
/// (fulfils a promise): the pool counts the thread as available, so work posted by whoever that
/// result wakes reuses it rather than starting another thread. No effect on other threads.
void AboutToFinishPoolJob() noexcept;

/// The result of work started by Spawn: like the std::future of std::async, its destructor
/// waits for the work to end, so work that borrows the caller's objects cannot outlive them,
/// even when the caller unwinds with an exception. Exceptions travel to get(). Move-only; one
/// thread uses a Task at a time.
template <class T>
class Task {
 public:
  Task() = default;
  explicit Task(std::future<T> f) : future_(std::move(f)) {}
  Task(Task&&) noexcept = default;
  Task& operator=(Task&& other) noexcept {
    if (this != &other) {
      Wait();
      future_ = std::move(other.future_);
    }
    return *this;
  }
  ~Task() { Wait(); }

  bool valid() const { return future_.valid(); }
  /// The work's result, or its exception; the Task is then empty.
  T get() { return future_.get(); }
  void Wait() const noexcept {
    if (future_.valid()) future_.wait();
  }
  /// Stop owning the work: it runs on and nothing waits for it. Only for work whose captures
  /// own everything it touches.
  void Abandon() noexcept { future_ = {}; }
  /// A std::future for interfaces that return one (StorageWriter::WriteData...). Dropping it
  /// waits for the work, as dropping the Task would; get() and wait() wait for it too.
  /// (A deferred future: wait_for/wait_until report `deferred`, never `ready`.)
  std::future<T> ToFuture() && {
    return std::async(std::launch::deferred,
                      [task = std::move(*this)]() mutable { return task.get(); });
  }

 private:
  std::future<T> future_;
};

/// Start fn() on the pool; its result (or exception) comes back through the Task. fn and its
/// captures are destroyed on the pool thread once it has run; the Task's shared state holds only
/// the result, so work that owns the object holding its Task forms no reference cycle.
template <class F>
Task<std::invoke_result_t<F&>> Spawn(F fn) {
  using R = std::invoke_result_t<F&>;
  struct Work {
    std::promise<R> promise;
    std::optional<F> fn;
  };
  auto work = std::make_shared<Work>();
  work->fn.emplace(std::move(fn));
  Task<R> task(work->promise.get_future());
  RunOnPoolThread([work] {
    try {
      if constexpr (std::is_void_v<R>) {
        (*work->fn)();
        work->fn.reset();
        AboutToFinishPoolJob();
        work->promise.set_value();
      } else {
        R result = (*work->fn)();
        work->fn.reset();
        AboutToFinishPoolJob();
        work->promise.set_value(std::move(result));
      }
    } catch (...) {
      work->fn.reset();
      AboutToFinishPoolJob();
      work->promise.set_exception(std::current_exception());
    }
  });
  return task;
}

/// Run fn(i) for every i in [0, n) on up to `threads` threads (0: the hardware's concurrency,
/// at most 16), the calling thread among them. Calls for different i must be independent.
/// Returns when every call has finished; if any threw, the first exception is rethrown (items
/// not yet started are skipped). Runs inline when n or the thread count is 1.
void ParallelFor(size_t n, const std::function<void(size_t)>& fn, size_t threads = 0);

/// Threads the pool holds now (busy or idle), for tests and diagnostics.
size_t PoolThreadCount();

}  // namespace dcp
