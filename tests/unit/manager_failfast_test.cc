// One job, one owner (issue 43): a rank whose CheckpointManager is on another step than its
// peers' (it skipped or repeated a Save) fails the manager's first collective at once; its peers
// must fail as fast, with the mismatch named, instead of waiting out the collective timeout in
// the save they run without it (synchronous saves on the job's communicator, asynchronous ones
// on the background communicators).
#include <catch2/catch.hpp>
#include <chrono>
#include <mutex>
#include <thread>

#include "dcp/dcp.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {

struct RankOutcome {
  std::exception_ptr error;
  double seconds = 0;  // from the skewed Save to its error (or to the end of its Wait)
};

std::string Text(const std::exception_ptr& e) {
  if (!e) return "(no error)";
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

}  // namespace

TEST_CASE("manager: a rank on another step fails every rank within seconds, sync and async",
          "[manager][protocol][fault]") {
  // Before, the rank out of step failed at once ("manager/begin step=N" mismatched), but rank 0
  // went on into the save without it and waited the whole collective timeout in `save/plan`
  // (30 min by default; here 15 s), and the others waited for rank 0's verdict. Rank 2 of 4
  // forwards the manager's broadcasts to rank 3; rank 0 out of step fails all the others.
  constexpr int n = 4;
  constexpr auto kTimeout = 15s;
  static int counter = 0;
  for (const bool async : {false, true}) {
    for (const int bad : {2, 0}) {
      DYNAMIC_SECTION((async ? "async" : "sync") << ", rank " << bad << " one step ahead") {
        const std::string root = "mem://manager-failfast-" + std::to_string(counter++);
        InProcessGroup group(n), background(n);
        std::vector<RankOutcome> out(n);
        std::vector<std::thread> threads;
        for (int r = 0; r < n; ++r) {
          group.communicator(r).set_timeout(kTimeout);
          background.communicator(r).set_timeout(kTimeout);
        }
        for (int r = 0; r < n; ++r) {
          threads.emplace_back([&, r] {
            Communicator& comm = group.communicator(r);
            CheckpointManager m(root, comm, async ? background.Release(r) : nullptr);
            StepState s;
            try {
              s.Fill(1);
              m.Save(1, s.sd);
              m.Wait();
            } catch (...) {
              out[r].error = std::current_exception();
              return;
            }
            const int64_t step = r == bad ? 3 : 2;  // `bad` skipped step 2
            s.Fill(step);
            const auto t0 = std::chrono::steady_clock::now();
            try {
              m.Save(step, s.sd);
              m.Wait();  // an asynchronous save's error surfaces here
            } catch (...) {
              out[r].error = std::current_exception();
            }
            out[r].seconds =
                std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            m.Close();  // what failed was reported above; nothing is left in flight
          });
        }
        for (auto& t : threads) t.join();
        for (int r = 0; r < n; ++r) {
          INFO("rank " << r << " after " << out[r].seconds << " s: " << Text(out[r].error));
          REQUIRE(out[r].error);
          bool collective = false;
          try {
            std::rethrow_exception(out[r].error);
          } catch (const CollectiveError& e) {
            collective = true;
            CHECK_FALSE(e.timed_out());
            // The mismatch itself, whichever rank saw it: both steps are named.
            CHECK_THAT(e.what(), Contains("manager/begin step=2"));
            CHECK_THAT(e.what(), Contains("manager/begin step=3"));
          } catch (...) {
          }
          CHECK(collective);
          CHECK(out[r].seconds < 5);  // not the 15 s timeout
        }
        // Nothing of step 2 or 3 was committed; step 1 is still the newest.
        InProcessGroup after(1);
        CheckpointManager check(root, after.communicator(0));
        CHECK(check.CompleteSteps() == std::vector<int64_t>{1});
      }
    }
  }
}
