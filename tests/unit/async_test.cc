// Asynchronous save and the checkpoint lifecycle. Tagged [async]: CI also runs these under
// ThreadSanitizer.
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <thread>

#include "dcp/dcp.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/store.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {

// A mem:// store whose writes take a while, to keep a save in flight on purpose.
class SlowStore : public ForwardingStore {
 public:
  SlowStore(std::shared_ptr<Store> inner, std::chrono::milliseconds delay)
      : ForwardingStore(std::move(inner)), delay_(delay) {}
  std::unique_ptr<WritableObject> Create(const std::string& n) override {
    std::this_thread::sleep_for(delay_);
    return ForwardingStore::Create(n);
  }

 private:
  std::chrono::milliseconds delay_;
};

void RegisterSlowScheme() {
  // Each Create takes 1 s: the shutdown test checks that a save has not finished right after a
  // 10 ms wait, and on a loaded machine "right after" has taken more than 300 ms.
  static bool done = [] {
    RegisterBackend("slowmem", [](const std::string& loc) {
      return std::make_shared<SlowStore>(MakeMemStore("slow/" + loc),
                                         std::chrono::milliseconds(1000));
    });
    return true;
  }();
  (void)done;
}

struct TrainingState {
  TensorView w, moments, step, transposed_base, transposed;
  StateDict sd;
};

TrainingState MakeState(uint64_t seed, const std::string& prefix = "") {
  TrainingState s;
  s.w = RandomTensor(DType::kFloat32, {256, 300}, seed);
  s.moments = RandomTensor(DType::kBFloat16, {4096}, seed + 1);
  s.step = RandomTensor(DType::kInt64, {}, seed + 2);
  s.transposed_base = RandomTensor(DType::kFloat64, {5, 7}, seed + 3);
  s.transposed = s.transposed_base;
  s.transposed.shape = {7, 5};
  s.transposed.strides = {1, 7};
  StateDict& root = prefix.empty() ? s.sd : s.sd.Nested(prefix);
  root.Nested("model").Set("w", s.w).Set("t", s.transposed);
  root.Nested("optim")
      .Set("moments", ShardedTensor{DType::kBFloat16, {4096}, {{s.moments, {0}}}})
      .Set("step", s.step);
  root.Set("rng", Blob{"state-" + std::to_string(seed)});
  return s;
}

std::unique_ptr<AsyncCheckpointer> LocalSaver(AsyncOptions o = {}) {
  return std::make_unique<AsyncCheckpointer>(std::make_unique<LocalCommunicator>(), std::move(o));
}

}  // namespace

TEST_CASE("async: the checkpoint holds the values at the call, whatever happens after", "[async]") {
  // Two ranks, each with its own background communicator (a second group).
  ClearMemStore("async-mutate");
  InProcessGroup background(2);
  std::vector<std::unique_ptr<Communicator>> bg;
  bg.push_back(background.Release(0));
  bg.push_back(background.Release(1));
  std::vector<TrainingState> expected(2);
  RequireNoErrors(RunRanks(2, [&](int r, Communicator&) {
    AsyncCheckpointer saver(std::move(bg[r]));
    const std::string prefix = "rank" + std::to_string(r);
    TrainingState s = MakeState(10 + r, prefix);
    expected[r] = MakeState(10 + r, prefix);  // the values at the call
    auto handle = saver.Save(s.sd, "mem://async-mutate");
    // Training goes on at once and overwrites everything.
    FillRandom(s.w.data, s.w.nbytes(), 999);
    FillRandom(s.moments.data, s.moments.nbytes(), 998);
    FillRandom(s.transposed_base.data, s.transposed_base.nbytes(), 997);
    std::memset(s.step.data, 0xff, 8);
    std::get<Blob>(*s.sd.Nested(prefix).Find("rng")).bytes = "overwritten";
    handle->Wait();
    saver.Close();
  }));
  CHECK(ReadMetadata("mem://async-mutate").world_size == 2);
  for (int r = 0; r < 2; ++r) {
    const std::string prefix = "rank" + std::to_string(r);
    TrainingState back = MakeState(1, prefix);
    Load(back.sd, "mem://async-mutate");
    const TrainingState& e = expected[r];
    CHECK(SameElements(back.w, e.w));
    CHECK(SameElements(back.moments, e.moments));
    CHECK(SameElements(back.transposed, e.transposed));
    CHECK(SameElements(back.step, e.step));
    CHECK(std::get<Blob>(*back.sd.Nested(prefix).Find("rng")).bytes ==
          "state-" + std::to_string(10 + r));
  }
}

TEST_CASE("async: staging is allocated once and reused", "[async]") {
  ClearMemStore("async-reuse");
  auto saver = LocalSaver();
  TrainingState s = MakeState(3);
  auto first = saver->Save(s.sd, "mem://async-reuse/1");
  first->Wait();
  const size_t after_first = saver->staging_allocations();
  CHECK(after_first == 4);  // one per tensor (blobs are copied into the staged dict itself)
  CHECK(first->metrics().staging_allocations == 4);
  for (int i = 2; i <= 4; ++i) {
    FillRandom(s.w.data, s.w.nbytes(), 100 + i);
    auto h = saver->Save(s.sd, "mem://async-reuse/" + std::to_string(i));
    h->Wait();
    const SaveMetrics m = h->metrics();
    CHECK(m.staging_allocations == 0);
    CHECK(m.succeeded);
    CHECK(m.staged_bytes == s.w.nbytes() + s.moments.nbytes() + 8 + s.transposed.nbytes() + 7);
    CHECK(m.bytes_written > 0);
    CHECK(m.blocking_s >= m.staging_s);
  }
  CHECK(saver->staging_allocations() == after_first);
  CHECK(saver->staging_bytes() >= s.w.nbytes() + s.moments.nbytes());
  saver->Close();
}

TEST_CASE("async: a background failure surfaces at the next call, once", "[async][fault]") {
  TempDir dir("async-err");
  const std::string blocker = dir / "file";
  std::ofstream(blocker) << "a file where a directory should be";
  auto saver = LocalSaver();
  TrainingState s = MakeState(4);
  auto bad = saver->Save(s.sd, blocker + "/ckpt");  // cannot create the directory
  CHECK(bad->WaitFor(std::chrono::seconds(30)));
  CHECK_FALSE(bad->metrics().succeeded);
  // The next Save raises it instead of starting...
  CHECK_THROWS_AS(saver->Save(s.sd, dir / "good"), CollectiveError);
  CHECK_FALSE(std::filesystem::exists(dir / "good"));
  // ...exactly once: the following one works.
  auto good = saver->Save(s.sd, dir / "good");
  CHECK(good->Wait().entries.size() == 5);

  SECTION("Wait raises it") {
    saver->Save(s.sd, blocker + "/again");
    CHECK_THROWS_AS(saver->Wait(), CollectiveError);
    CHECK_NOTHROW(saver->Wait());
  }
  SECTION("Close raises it") {
    saver->Save(s.sd, blocker + "/again");
    CHECK_THROWS_AS(saver->Close(), CollectiveError);
  }
  SECTION("a snapshot failure fails the save, not the caller's thread") {
    StateDict gpu;
    TensorView t = RandomTensor(DType::kFloat32, {4}, 1);
    t.device = Device{Device::Type::kCUDA, 0};
    gpu.Set("x", t);
    auto h = saver->Save(gpu, dir / "gpu");
    CHECK_THROWS_WITH(h->Wait(), Contains("cuda:0"));
    CHECK_FALSE(std::filesystem::exists(dir / "gpu/metadata.dcp"));
  }
}

TEST_CASE("async: one save in flight, a new save waits for the previous", "[async]") {
  RegisterSlowScheme();
  ClearMemStore("slow/order-1");
  ClearMemStore("slow/order-2");
  auto saver = LocalSaver();
  TrainingState s = MakeState(5);
  auto first = saver->Save(s.sd, "slowmem://order-1");
  CHECK(first->metrics().blocking_s < 0.25);  // returned before the slow write
  CHECK_FALSE(first->done());
  auto second = saver->Save(s.sd, "slowmem://order-2");
  CHECK(first->done());  // the second call waited for it
  CHECK(second->metrics().wait_previous_s > 0.05);
  second->Wait();
  CHECK(ReadMetadata("slowmem://order-1").save_id != ReadMetadata("slowmem://order-2").save_id);
  saver->Close();
}

TEST_CASE("async: shutdown with a save in flight", "[async][fault]") {
  RegisterSlowScheme();
  SECTION("the destructor waits and the checkpoint completes") {
    ClearMemStore("slow/shutdown-ok");
    {
      auto saver = LocalSaver();
      TrainingState s = MakeState(6);
      saver->Save(s.sd, "slowmem://shutdown-ok");
    }
    CHECK(ReadMetadata("slowmem://shutdown-ok").entries.size() == 5);
  }
  SECTION("a save that outlives the bounded wait is reported unfinished, not done") {
    ClearMemStore("slow/shutdown-late");
    auto saver = LocalSaver();
    TrainingState s = MakeState(7);
    saver->Save(s.sd, "slowmem://shutdown-late");
    CHECK_THROWS_WITH(saver->Close(std::chrono::milliseconds(10)), Contains("unfinished"));
    CHECK_FALSE(MakeMemStore("slow/shutdown-late")->Size(kMetadataName));
    // The abandoned background save still finishes on its own (it owns what it uses).
    for (int i = 0; i < 100 && !MakeMemStore("slow/shutdown-late")->Size(kMetadataName); ++i) {
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    CHECK(MakeMemStore("slow/shutdown-late")->Size(kMetadataName));
    CHECK_THROWS_AS(saver->Save(s.sd, "mem://x"), InvalidArgumentError);  // closed
  }
}

TEST_CASE("manager: retention keeps the newest N and every Mth, crash leftovers are never chosen",
          "[async][manager][option:ManagerOptions::keep_last][option:ManagerOptions::keep_every]") {
  for (bool async : {false, true}) {
    DYNAMIC_SECTION((async ? "async" : "sync")) {
      TempDir dir("manager");
      LocalCommunicator comm;
      ManagerOptions o;
      o.keep_last = 2;
      o.keep_every = 4;
      std::unique_ptr<Communicator> bg;
      if (async) bg = std::make_unique<LocalCommunicator>();
      std::vector<int64_t> expected_steps;
      {
        CheckpointManager m(dir.path(), comm, std::move(bg), o);
        CHECK_FALSE(m.LatestStep());
        TrainingState s = MakeState(8);
        for (int step = 1; step <= 9; ++step) {
          *static_cast<int64_t*>(s.step.data) = step;
          m.Save(step, s.sd);
        }
        m.Wait();
        CHECK(m.CompleteSteps() == std::vector<int64_t>{4, 8, 9});
        CHECK(m.LatestStep() == 9);
        std::ifstream latest(dir / "latest");
        int64_t named = 0;
        latest >> named;
        CHECK(named == 9);
        CHECK_THROWS_AS(m.Save(9, s.sd), InvalidArgumentError);  // steps increase
        m.Close();
      }
      // A crash during step 10: data files, no metadata.
      {
        const std::string crashed = dir / "step-0000000010";
        std::filesystem::create_directories(crashed);
        std::ofstream(crashed + "/data-deadbeef-r0-b0.data") << "partial";
      }
      CheckpointManager m(dir.path(), comm, nullptr, o);
      CHECK(m.LatestStep() == 9);  // never the partial step
      TrainingState back = MakeState(9);
      CHECK(m.Restore(back.sd) == 9);
      CHECK(*static_cast<int64_t*>(back.step.data) == 9);
      m.Save(11, back.sd);  // the crashed step-10 is now older than the newest: cleaned up
      CHECK_FALSE(std::filesystem::exists(dir / "step-0000000010"));
      CHECK(m.CompleteSteps() == std::vector<int64_t>{4, 8, 9, 11});
    }
  }
}

TEST_CASE("checkpoint io: Lightning-style save, load, weights-only, remove",
          "[async][manager][option:LoadOptions::weights_only]") {
  TempDir dir("ckpt-io");
  LocalCommunicator comm;
  AsyncCheckpointIO io(comm, std::make_unique<LocalCommunicator>());
  TrainingState s = MakeState(12);
  io.SaveCheckpoint(s.sd, dir / "a");
  TrainingState back = MakeState(13);
  std::get<Blob>(*back.sd.Find("rng")).bytes = "untouched";
  LoadOptions wo;
  wo.weights_only = true;
  io.LoadCheckpoint(dir / "a", back.sd, wo);  // waits for the save first
  CHECK(SameElements(back.w, s.w));
  CHECK(std::get<Blob>(*back.sd.Find("rng")).bytes == "untouched");
  io.LoadCheckpoint(dir / "a", back.sd);
  CHECK(std::get<Blob>(*back.sd.Find("rng")).bytes == "state-12");
  // A new state, allocated from the metadata.
  StateDict fresh = io.LoadCheckpoint(dir / "a");
  const auto* w = std::get_if<TensorView>(fresh.Nested("model").Find("w"));
  REQUIRE(w != nullptr);
  CHECK(SameElements(*w, s.w));
  CHECK(std::get<Blob>(*fresh.Find("rng")).bytes == "state-12");
  StateDict weights = io.LoadCheckpoint(dir / "a", wo);
  CHECK(weights.Find("rng") == nullptr);
  CHECK_THROWS_AS(io.LoadCheckpoint(dir / "a", LoadOptions{}, Device{Device::Type::kCUDA, 0}),
                  UnsupportedError);
  io.RemoveCheckpoint(dir / "a");
  CHECK_FALSE(std::filesystem::exists(dir / "a"));
  io.Teardown();
}
