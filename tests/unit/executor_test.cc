// The one executor (proto/executor.h): threads are reused, work that waits on other work cannot
// deadlock it, a Task waits for its work when dropped, and exceptions reach the caller.
#include "dcp/proto/executor.h"

#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <future>
#include <set>
#include <stdexcept>
#include <thread>
#include <vector>

#include "support/test_support.h"

namespace dcp {
namespace {

TEST_CASE("executor: reuses its threads for work that comes one after another", "[executor]") {
  Spawn([] {}).get();  // at least one thread exists
  const size_t before = PoolThreadCount();
  std::set<std::thread::id> ids;
  for (int i = 0; i < 200; ++i) {
    ids.insert(Spawn([] { return std::this_thread::get_id(); }).get());
  }
  // std::async starts 200 threads here. The pool starts one only when none is idle: get()
  // can return before the thread that ran the work is back to idle, so a few, not 200.
  CHECK(ids.size() <= 4);
  CHECK(PoolThreadCount() <= before + 4);
}

TEST_CASE("executor: runs work that waits on other work without deadlock", "[executor]") {
  // More blocked parents than cores, each waiting on children: a fixed-size pool would hang.
  const int parents = 4 * static_cast<int>(std::max(2u, std::thread::hardware_concurrency()));
  std::atomic<int> done{0};
  std::vector<Task<int>> tasks;
  for (int p = 0; p < parents; ++p) {
    tasks.push_back(Spawn([&done] {
      std::vector<Task<int>> children;
      for (int c = 0; c < 3; ++c) children.push_back(Spawn([c] { return c; }));
      int sum = 0;
      for (auto& t : children) sum += t.get();
      ++done;
      return sum;
    }));
  }
  for (auto& t : tasks) CHECK(t.get() == 3);
  CHECK(done == parents);
}

TEST_CASE("executor: a dropped Task waits for its work", "[executor]") {
  std::atomic<bool> finished{false};
  {
    Task<void> t = Spawn([&finished] {
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
      finished = true;
    });
  }
  CHECK(finished);
  finished = false;
  {
    std::future<void> f = Spawn([&finished] {
                            std::this_thread::sleep_for(std::chrono::milliseconds(100));
                            finished = true;
                          }).ToFuture();
  }
  CHECK(finished);
}

TEST_CASE("executor: carries exceptions to get and ParallelFor rethrows the first", "[executor]") {
  Task<int> t = Spawn([]() -> int { throw std::runtime_error("boom"); });
  CHECK_THROWS_WITH(t.get(), "boom");
  std::future<int> f = Spawn([]() -> int { throw std::logic_error("bang"); }).ToFuture();
  CHECK_THROWS_WITH(f.get(), "bang");

  std::atomic<int> ran{0};
  CHECK_THROWS_WITH(ParallelFor(
                        100,
                        [&](size_t i) {
                          ++ran;
                          if (i == 3) throw std::runtime_error("item 3");
                          std::this_thread::sleep_for(std::chrono::milliseconds(2));
                        },
                        4),
                    "item 3");
  CHECK(ran < 100);  // items not started after the failure are skipped
}

TEST_CASE("executor: ParallelFor runs every item once and inline when given one thread",
          "[executor]") {
  std::vector<std::atomic<int>> hits(1000);
  ParallelFor(
      hits.size(), [&](size_t i) { ++hits[i]; }, 3);
  for (auto& h : hits) REQUIRE(h == 1);
  const auto caller = std::this_thread::get_id();
  bool inline_only = true;
  ParallelFor(
      10, [&](size_t) { inline_only = inline_only && std::this_thread::get_id() == caller; }, 1);
  CHECK(inline_only);
}

TEST_CASE("executor: works in a child forked while the parent's pool has idle threads",
          "[executor]") {
#ifdef DCP_UNDER_SANITIZER
  WARN("skipped under sanitizers: threads started after a multi-threaded fork");
  return;
#endif
  std::vector<Task<void>> warm;
  for (int i = 0; i < 4; ++i) warm.push_back(Spawn([] {}));
  for (auto& t : warm) t.get();
  REQUIRE(PoolThreadCount() > 0);  // idle threads that a child does not inherit
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // Without a fresh pool in the child this waits forever for a thread that is not there.
    std::thread watchdog([] {
      std::this_thread::sleep_for(std::chrono::seconds(20));
      ::_exit(2);
    });
    watchdog.detach();
    int sum = 0;
    ParallelFor(
        8, [&](size_t) { Spawn([] {}).get(); }, 4);
    sum = Spawn([] { return 7; }).get();
    ::_exit(sum == 7 ? 0 : 1);
  }
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE(WIFEXITED(status));
  CHECK(WEXITSTATUS(status) == 0);
}

}  // namespace
}  // namespace dcp
