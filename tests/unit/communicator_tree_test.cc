// PointToPointCommunicator::Broadcast as a tree (issue 16, thousands of ranks): every rank gets
// root's message from any root; the root (and every forwarding rank) sends O(log N) frames from
// one shared buffer; and a rank that cannot forward (stalled, poisoned, mismatched, stopped)
// fails its whole subtree with one error naming it, while ranks outside its subtree succeed.
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <thread>

#include "support/test_support.h"

using namespace dcp;
using namespace std::chrono_literals;
using Catch::Matchers::Contains;

namespace {

// A transport that counts what each rank does: frames sent (and how: copied or shared), every
// transport call, and which rank sent to which.
struct Wire {
  explicit Wire(int size) : n(size), sends(size), copies(size), calls(size), buffers(size) {}
  int n;
  std::mutex mu;
  std::map<std::pair<int, int>, std::deque<std::string>> mail;
  std::vector<int> sends, copies, calls;
  std::vector<std::set<const void*>> buffers;  // the shared buffers each rank sent from
  std::vector<std::pair<int, int>> edges;      // (from, to) of every frame
  void Reset() {
    std::lock_guard<std::mutex> lock(mu);
    std::fill(sends.begin(), sends.end(), 0);
    std::fill(copies.begin(), copies.end(), 0);
    std::fill(calls.begin(), calls.end(), 0);
    for (auto& b : buffers) b.clear();
    edges.clear();
  }
};

class WireComm : public PointToPointCommunicator {
 public:
  WireComm(std::shared_ptr<Wire> w, int r) : w_(std::move(w)), r_(r) {}
  int rank() const override { return r_; }
  int size() const override { return w_->n; }

 protected:
  void Send(int dest, int, std::string payload) override {
    std::lock_guard<std::mutex> lock(w_->mu);
    ++w_->calls[r_];
    ++w_->sends[r_];
    ++w_->copies[r_];
    w_->edges.push_back({r_, dest});
    w_->mail[{r_, dest}].push_back(std::move(payload));
  }
  void SendShared(int dest, int, std::shared_ptr<const std::string> payload) override {
    std::lock_guard<std::mutex> lock(w_->mu);
    ++w_->calls[r_];
    ++w_->sends[r_];
    w_->buffers[r_].insert(payload.get());
    w_->edges.push_back({r_, dest});
    w_->mail[{r_, dest}].push_back(*payload);
  }
  std::optional<std::string> TryReceive(int source, int) override {
    std::lock_guard<std::mutex> lock(w_->mu);
    ++w_->calls[r_];
    auto it = w_->mail.find({source, r_});
    if (it == w_->mail.end() || it->second.empty()) return std::nullopt;
    std::string m = std::move(it->second.front());
    it->second.pop_front();
    return m;
  }

 private:
  std::shared_ptr<Wire> w_;
  int r_;
};

struct Group {
  explicit Group(int n, std::chrono::milliseconds timeout) : wire(std::make_shared<Wire>(n)) {
    for (int r = 0; r < n; ++r) {
      comms.push_back(std::make_unique<WireComm>(wire, r));
      comms.back()->set_timeout(timeout);
    }
  }
  std::shared_ptr<Wire> wire;
  std::vector<std::unique_ptr<WireComm>> comms;
};

struct Result {
  std::string value;
  std::exception_ptr error;
  double secs = 0;
};

// Run fn(rank, comm) on one thread per rank; each rank's return value or exception, and time.
std::vector<Result> Run(Group& g, const std::function<std::string(int, Communicator&)>& fn) {
  std::vector<Result> out(g.comms.size());
  std::vector<std::thread> threads;
  for (size_t r = 0; r < g.comms.size(); ++r) {
    threads.emplace_back([&, r] {
      const auto t0 = std::chrono::steady_clock::now();
      try {
        out[r].value = fn(static_cast<int>(r), *g.comms[r]);
      } catch (...) {
        out[r].error = std::current_exception();
      }
      out[r].secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

CollectiveError CollectiveErrorOf(const Result& r, int rank) {
  INFO("rank " << rank);
  REQUIRE(r.error);
  try {
    std::rethrow_exception(r.error);
  } catch (const CollectiveError& e) {
    return e;
  } catch (const std::exception& e) {
    FAIL("rank " << rank << " threw a non-collective error: " << e.what());
  }
  throw std::logic_error("unreachable");
}

std::string ErrorText(const Result& r) {
  if (!r.error) return "";
  try {
    std::rethrow_exception(r.error);
  } catch (const std::exception& e) {
    return e.what();
  }
  return "?";
}

int CeilLog2(int n) {
  int k = 0;
  while ((1 << k) < n) ++k;
  return k;
}

// The tree a successful broadcast from `root` used, as each rank's parent (-1 for root).
std::vector<int> LearnTree(Group& g, int root) {
  g.wire->Reset();
  auto res = Run(g, [&](int r, Communicator& c) {
    return c.Broadcast(r == root ? "learn" : "", root, "tree/learn");
  });
  std::vector<int> parent(g.comms.size(), -1);
  for (auto [from, to] : g.wire->edges) parent[to] = from;
  for (size_t r = 0; r < res.size(); ++r) {
    INFO("rank " << r << ": " << ErrorText(res[r]));
    REQUIRE_FALSE(res[r].error);
    REQUIRE(res[r].value == "learn");
    REQUIRE((parent[r] == -1) == (static_cast<int>(r) == root));
  }
  g.wire->Reset();
  return parent;
}

bool Below(const std::vector<int>& parent, int r, int ancestor) {
  for (int p = parent[r]; p != -1; p = parent[p]) {
    if (p == ancestor) return true;
  }
  return false;
}

int Depth(const std::vector<int>& parent, int r) {
  int d = 0;
  for (int p = parent[r]; p != -1; p = parent[p]) ++d;
  return d;
}

// The non-root rank with the largest subtree (it has grandchildren when n >= 8).
int BusiestForwarder(const std::vector<int>& parent, int root) {
  int best = -1, best_size = -1;
  for (int x = 0; x < static_cast<int>(parent.size()); ++x) {
    if (x == root) continue;
    int size = 0;
    for (int r = 0; r < static_cast<int>(parent.size()); ++r) size += Below(parent, r, x);
    if (size > best_size) best = x, best_size = size;
  }
  return best;
}

// The deepest rank with a grandchild.
int DeepestWithGrandchildren(const std::vector<int>& parent) {
  int best = -1;
  for (int r = 0; r < static_cast<int>(parent.size()); ++r) {
    if (parent[r] == -1 || parent[parent[r]] == -1) continue;
    const int g = parent[parent[r]];
    if (best == -1 || Depth(parent, g) > Depth(parent, best)) best = g;
  }
  return best;
}

std::string Payload(int root, size_t bytes) {
  std::string s(bytes, '\0');
  for (size_t i = 0; i < bytes; ++i) s[i] = static_cast<char>('a' + (i * 7 + root) % 26);
  return s;
}

}  // namespace

// A large message: a few MiB, but less under a sanitizer, which instruments every byte copied
// (33 ranks copy it each) for the same code paths.
#ifdef DCP_UNDER_SANITIZER
constexpr size_t kLargeMessage = size_t{256} << 10;
#else
constexpr size_t kLargeMessage = size_t{3} << 20;
#endif

TEST_CASE("communicator: a broadcast reaches every rank from any root, empty or large", "[comm]") {
  for (int n : {16, 33}) {
    for (int root : {0, 1, n / 2, n - 1}) {
      for (size_t bytes : {size_t{0}, kLargeMessage}) {
        INFO("n=" << n << " root=" << root << " bytes=" << bytes);
        const std::string want = Payload(root, bytes);
        std::vector<int> got(n, 0);
        auto errors = dcp::testing::RunRanks(n, [&](int r, Communicator& comm) {
          std::string m = comm.Broadcast(r == root ? want : std::string(), root, "tree/any-root");
          got[r] = m == want;
          // A broadcast inside an all-gather, and the next broadcast, still line up.
          auto all = comm.AllGather(std::to_string(r), "tree/all-gather");
          dcp::testing::Expect(
              all.size() == static_cast<size_t>(n) && all[n - 1] == std::to_string(n - 1),
              "all-gather");
        });
        dcp::testing::RequireNoErrors(errors);
        CHECK(std::count(got.begin(), got.end(), 1) == n);
      }
    }
  }
}

TEST_CASE("communicator: a broadcast's root and forwarders send O(log N) frames, one buffer each",
          "[comm]") {
  for (int n : {2, 3, 5, 16, 33}) {
    for (int root : {0, 1, n - 1}) {
      INFO("n=" << n << " root=" << root);
      Group g(n, 10s);
      const std::string want = Payload(root, kLargeMessage / 3);
      auto res = Run(g, [&](int r, Communicator& c) {
        return c.Broadcast(r == root ? want : std::string(), root, "tree/count");
      });
      for (int r = 0; r < n; ++r) {
        INFO("rank " << r << ": " << ErrorText(res[r]));
        REQUIRE_FALSE(res[r].error);
        CHECK(res[r].value == want);
        CHECK(g.wire->sends[r] <= CeilLog2(n));  // a flat broadcast's root sends n - 1
        CHECK(g.wire->copies[r] == 0);           // every frame from a shared buffer...
        CHECK(g.wire->buffers[r].size() <= 1);   // ... and one buffer for all children
      }
      CHECK(g.wire->sends[root] == CeilLog2(n));
      CHECK(static_cast<int>(g.wire->edges.size()) == n - 1);  // each rank receives once
    }
  }
}

TEST_CASE("communicator: a rank that never joins a broadcast fails its subtree, naming it",
          "[comm][fault]") {
  const auto timeout = 2000ms;  // margin per level: 200 ms
  const int n = 16;
  Group g(n, timeout);
  const std::vector<int> parent = LearnTree(g, 0);
  // A child of the root, and a deeper forwarder that still has grandchildren.
  const bool deep = GENERATE(false, true);
  const int x = deep ? DeepestWithGrandchildren(parent) : BusiestForwarder(parent, 0);
  INFO("stalled rank " << x << " at depth " << Depth(parent, x));
  if (deep) REQUIRE(Depth(parent, x) >= 2);
  const std::string want = Payload(0, 1 << 16);
  auto res = Run(g, [&](int r, Communicator& c) -> std::string {
    if (r == x) return "";  // stalled: never calls Broadcast
    return c.Broadcast(r == 0 ? want : std::string(), 0, "tree/stall");
  });
  int below = 0;
  for (int r = 0; r < n; ++r) {
    if (r == x) continue;
    INFO("rank " << r << ": " << ErrorText(res[r]));
    if (!Below(parent, r, x)) {
      // Outside the stalled rank's subtree nothing changes.
      REQUIRE_FALSE(res[r].error);
      CHECK(res[r].value == want);
      continue;
    }
    ++below;
    CollectiveError e = CollectiveErrorOf(res[r], r);
    CHECK(e.failed_ranks() == std::vector<int>{x});  // the stalled rank, not the parent
    CHECK(e.timed_out());
    CHECK(g.comms[r]->poisoned());
    // Its children timed out themselves; deeper ranks got their notice, not a timeout of their
    // own (whose message would say "seen by rank <r>").
    int child_of_x = r;
    while (parent[child_of_x] != x) child_of_x = parent[child_of_x];
    CHECK_THAT(e.failures().at(0).message,
               Contains("seen by rank " + std::to_string(child_of_x) + ")"));
    // About one timeout: the children of x wait timeout() + (depth - 1) * margin, the rest
    // learn it from them at once, well before their own (later) deadlines.
    CHECK(res[r].secs >= 0.9 * timeout.count() / 1000.0);
    CHECK(res[r].secs < timeout.count() / 1000.0 + Depth(parent, x) * 0.2 + 1.5);
  }
  CHECK(below >= (deep ? 3 : 7));  // the test covers children and grandchildren
}

TEST_CASE("communicator: a poisoned forwarder fails its subtree at once, naming the poison",
          "[comm][fault]") {
  const int n = 33;
  Group g(n, 30s);  // nobody may wait for this
  const int root = 5;
  const std::vector<int> parent = LearnTree(g, root);
  const int x = BusiestForwarder(parent, root);
  INFO("poisoned rank " << x);
  g.comms[x]->Poison("test: injected poison");
  const std::string want = Payload(root, 1 << 16);
  auto res = Run(g, [&](int r, Communicator& c) {
    return c.Broadcast(r == root ? want : std::string(), root, "tree/poisoned");
  });
  CHECK_THAT(ErrorText(res[x]), Contains("injected poison"));
  int below = 0;
  for (int r = 0; r < n; ++r) {
    if (r == x) continue;
    INFO("rank " << r << ": " << ErrorText(res[r]));
    if (!Below(parent, r, x)) {
      REQUIRE_FALSE(res[r].error);
      CHECK(res[r].value == want);
      continue;
    }
    ++below;
    CollectiveError e = CollectiveErrorOf(res[r], r);
    CHECK(e.failed_ranks() == std::vector<int>{x});
    CHECK_THAT(e.what(), Contains("injected poison"));
    CHECK(res[r].secs < 5);  // at once, not after the 30 s timeout
    CHECK(g.comms[r]->poisoned());
  }
  CHECK(below >= 4);
}

TEST_CASE("communicator: a forwarder in another phase fails its subtree at once, others succeed",
          "[comm][fault]") {
  const int n = 16;
  Group g(n, 30s);
  const std::vector<int> parent = LearnTree(g, 0);
  const int x = BusiestForwarder(parent, 0);
  auto res = Run(g, [&](int r, Communicator& c) {
    return c.Broadcast(r == 0 ? "m" : "", 0, r == x ? "tree/other" : "tree/phase");
  });
  CollectiveError ex = CollectiveErrorOf(res[x], x);
  CHECK_THAT(ex.what(), Contains("tree/other") && Contains("tree/phase"));
  CHECK(g.comms[x]->poisoned());
  for (int r = 0; r < n; ++r) {
    if (r == x) continue;
    INFO("rank " << r << ": " << ErrorText(res[r]));
    if (!Below(parent, r, x)) {
      REQUIRE_FALSE(res[r].error);
      CHECK(res[r].value == "m");
      continue;
    }
    CollectiveError e = CollectiveErrorOf(res[r], r);
    CHECK(e.failed_ranks() == ex.failed_ranks());  // the same failure as the mismatched rank
    CHECK_THAT(e.what(), Contains("tree/other"));
    CHECK(res[r].secs < 5);
    CHECK(g.comms[r]->poisoned());
  }
}

TEST_CASE("communicator: a poisoned root still broadcasts, a stopped forwarder makes no call",
          "[comm][fault]") {
  const int n = 16;
  Group g(n, 1000ms);
  const std::vector<int> parent = LearnTree(g, 0);
  // The coordinator announcing the verdict of a failed phase.
  g.comms[0]->Poison("test: root poisoned");
  auto res = Run(g, [&](int r, Communicator& c) {
    return c.Broadcast(r == 0 ? "verdict" : "", 0, "tree/verdict");
  });
  for (int r = 0; r < n; ++r) {
    INFO("rank " << r << ": " << ErrorText(res[r]));
    REQUIRE_FALSE(res[r].error);
    CHECK(res[r].value == "verdict");
  }

  const int x = BusiestForwarder(parent, 0);
  g.comms[x]->Stop("test: stopped");
  g.wire->Reset();
  res = Run(g, [&](int r, Communicator& c) {
    return c.Broadcast(r == 0 ? "after" : "", 0, "tree/stopped");
  });
  CHECK(g.wire->calls[x] == 0);  // not even a failure frame
  CHECK_THAT(ErrorText(res[x]), Contains("test: stopped"));
  for (int r = 0; r < n; ++r) {
    if (r == x || r == 0) continue;
    INFO("rank " << r << ": " << ErrorText(res[r]));
    if (!Below(parent, r, x)) {
      CHECK_FALSE(res[r].error);
      continue;
    }
    // Its subtree learns it only from its children's deadline: they name the stopped rank.
    CollectiveError e = CollectiveErrorOf(res[r], r);
    CHECK(e.failed_ranks() == std::vector<int>{x});
    CHECK(e.timed_out());
  }
}
