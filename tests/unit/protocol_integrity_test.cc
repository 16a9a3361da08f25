// Protocol integrity (docs/PROTOCOL.md, "Outcomes"): the cases where ranks used to leave one save
// with different outcomes, or a committed checkpoint lost its data.
//   - a rank that skips one save, then keeps saving;
//   - a save on one rank paired with a load on another;
//   - a coordinator slower than its peers' timeout;
//   - a failure after the metadata rename;
//   - shutting down an async saver whose peer stalls.
#include <catch2/catch.hpp>
#include <chrono>
#include <thread>

#include "dcp/async_checkpointer.h"
#include "dcp/checkpoint.h"
#include "dcp/storage/backends/fault_store.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/registry.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {

using namespace std::chrono_literals;

constexpr int64_t kRows = 24, kCols = 8;

// Rank r's row shard of a [kRows, kCols] tensor whose values depend on `version`.
struct RankShard {
  TensorView full, rows;
  StateDict sd;
};

RankShard MakeShard(int rank, int world, uint64_t version) {
  RankShard s;
  s.full = RandomTensor(DType::kFloat32, {kRows, kCols}, version);
  auto [b, e] = RowRange(kRows, rank, world);
  s.rows = Clone(s.full.Narrow({b, 0}, {e - b, kCols}));
  ShardedTensor st{DType::kFloat32, {kRows, kCols}, {}};
  st.local_shards.push_back({s.rows, {b, 0}});
  s.sd.Set("w", st);
  return s;
}

// True when `uri` holds a committed checkpoint whose "w" loads and equals version `version`.
bool LoadsAs(const std::string& uri, uint64_t version) {
  try {
    StateDict sd;
    TensorView w = TensorView::Allocate(DType::kFloat32, {kRows, kCols});
    sd.Set("w", w);
    Load(sd, uri);
    return SameElements(w, RandomTensor(DType::kFloat32, {kRows, kCols}, version));
  } catch (const Error&) {
    return false;
  }
}

bool HasMetadata(const std::string& mem_name) {
  return MakeMemStore(mem_name)->Size(kMetadataName).has_value();
}

// A writer that sleeps before committing (a slow coordinator).
class SlowFinishWriter : public testing::ForwardingWriter {
 public:
  SlowFinishWriter(std::unique_ptr<StorageWriter> inner, std::chrono::milliseconds delay)
      : ForwardingWriter(std::move(inner)), delay_(delay) {}
  void Finish(Metadata& md, const std::vector<std::vector<WriteResult>>& r) override {
    std::this_thread::sleep_for(delay_);
    inner_->Finish(md, r);
  }

 private:
  std::chrono::milliseconds delay_;
};

}  // namespace

TEST_CASE("protocol: a rank that skips a save makes no later save split or unverifiable",
          "[protocol][integrity][fault]") {
  // Before operations were tagged, rank 1's next save paired with rank 0's skipped one: both
  // reported success and the committed checkpoint lacked rank 1's data, forever after.
  constexpr int kSaves = 4, kSkipped = 1;
  for (int s = 0; s < kSaves; ++s) ClearMemStore("skip-" + std::to_string(s));
  std::vector<std::vector<int>> ok(2, std::vector<int>(kSaves, 0));
  RunRanks(
      2,
      [&](int rank, Communicator& comm) {
        for (int s = 0; s < kSaves; ++s) {
          if (rank == 1 && s == kSkipped) continue;  // e.g. it timed out of a manager broadcast
          RankShard shard = MakeShard(rank, 2, 100 + s);
          try {
            Save(shard.sd, "mem://skip-" + std::to_string(s), comm);
            ok[rank][s] = 1;
          } catch (const CollectiveError&) {
          }
        }
      },
      400ms);
  for (int s = 0; s < kSaves; ++s) {
    INFO("save " << s);
    if (s != kSkipped) CHECK(ok[0][s] == ok[1][s]);  // never a split outcome
    // A checkpoint that exists always verifies: every rank's data, this save's values.
    if (HasMetadata("skip-" + std::to_string(s))) {
      CHECK(LoadsAs("mem://skip-" + std::to_string(s), 100 + s));
    }
    if (ok[0][s]) CHECK(LoadsAs("mem://skip-" + std::to_string(s), 100 + s));
  }
}

TEST_CASE("protocol: a save paired with a load fails on both ranks, naming both",
          "[protocol][integrity]") {
  ClearMemStore("pair");
  {
    RankShard s = MakeShard(0, 1, 7);
    Save(s.sd, "mem://pair");
  }
  std::vector<std::string> messages(2);
  auto errors = RunRanks(
      2,
      [&](int rank, Communicator& comm) {
        RankShard s = MakeShard(rank, 2, 8);
        try {
          if (rank == 0) {
            SaveOptions o;
            o.storage.overwrite = true;
            Save(s.sd, "mem://pair", comm, o);
          } else {
            Load(s.sd, "mem://pair", comm);
          }
        } catch (const CollectiveError& e) {
          messages[rank] = e.what();
          throw;
        }
      },
      400ms);
  REQUIRE(errors[0]);
  REQUIRE(errors[1]);
  // The rank that received the other's message names both operations.
  CHECK_THAT(messages[1], Contains("save/open") && Contains("load/open"));
  CHECK(LoadsAs("mem://pair", 7));  // the earlier checkpoint is intact
}

TEST_CASE("protocol: a poisoned communicator fails later collectives at once, naming why",
          "[protocol][integrity]") {
  InProcessGroup group(2);
  group.communicator(0).set_timeout(100ms);
  // Rank 1 never answers: rank 0 times out and its communicator is poisoned.
  CHECK_THROWS_AS(group.communicator(0).Gather("x", 0, "test/first"), CollectiveError);
  CHECK(group.communicator(0).poisoned());
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg =
      MessageOf<CollectiveError>([&] { group.communicator(0).Gather("y", 0, "test/second"); });
  CHECK(std::chrono::steady_clock::now() - t0 < 50ms);
  CHECK_THAT(msg, Contains("unusable") && Contains("test/first") && Contains("new communicator"));
}

TEST_CASE("protocol: a coordinator slower than its peers' timeout never splits the outcome",
          "[protocol][integrity][fault]") {
  // Rank 1 waits 2 x timeout + 5 s = 7 s for rank 0's verdict; rank 0 commits after 8 s. Before,
  // rank 1 gave up, called Abort and deleted its data while rank 0 committed metadata that named
  // it. (A 1 s timeout keeps the other phases clear of spurious timeouts on a loaded machine.)
  for (std::string uri : {std::string("mem://slowcoord")}) {
    ClearMemStore("slowcoord");
    std::vector<Outcome> outcome(2, Outcome::kFailed);
    std::vector<int> ok(2, 0);
    RunRanks(
        2,
        [&](int rank, Communicator& comm) {
          RankShard s = MakeShard(rank, 2, 31);
          std::unique_ptr<StorageWriter> writer = OpenStorageWriter(uri);
          if (rank == 0) writer = std::make_unique<SlowFinishWriter>(std::move(writer), 8000ms);
          try {
            Save(s.sd, *writer, comm);
            ok[rank] = 1;
          } catch (const CollectiveError& e) {
            outcome[rank] = e.outcome();
          }
        },
        1000ms);
    CHECK(ok[0] == 1);                       // rank 0 committed
    CHECK(outcome[1] == Outcome::kUnknown);  // rank 1 could not learn it, and says so
    REQUIRE(HasMetadata("slowcoord"));
    CHECK(LoadsAs(uri, 31));  // rank 1 kept its data: the committed checkpoint is whole
  }
}

TEST_CASE("protocol: a failure after the metadata rename keeps the committed checkpoint",
          "[protocol][integrity][fault]") {
  TempDir dir("postcommit");
  auto faults = std::make_shared<FaultInjectionStore>(OpenStore("file://" + (dir / "ckpt")));
  RegisterFaultScheme("postcommit", faults);
  {
    RankShard s = MakeShard(0, 1, 40);
    Save(s.sd, "postcommit://x");
  }
  faults->Reset();
  faults->FailNth(FaultOp::kPublishSync, 1);  // the directory fsync after the rename fails
  std::vector<Outcome> outcome(2, Outcome::kFailed);
  auto errors = RunRanks(2, [&](int rank, Communicator& comm) {
    RankShard s = MakeShard(rank, 2, 41);
    SaveOptions o;
    o.storage.overwrite = true;
    try {
      Save(s.sd, "postcommit://x", comm, o);
    } catch (const CollectiveError& e) {
      outcome[rank] = e.outcome();
      throw;
    }
  });
  REQUIRE(errors[0]);
  REQUIRE(errors[1]);
  // Every rank knows the checkpoint was committed, and nobody removed its data.
  CHECK(outcome[0] == Outcome::kCommitted);
  CHECK(outcome[1] == Outcome::kCommitted);
  faults->Reset();
  CHECK(LoadsAs("file://" + (dir / "ckpt"), 41));
}

TEST_CASE("async: closing a saver whose peer stalls stops its save and reports it unfinished",
          "[async][integrity][fault]") {
  // Before, Close detached a thread still polling the communicator (under MPI: a SIGSEGV once
  // MPI_Finalize ran). Now the communicator is stopped and the thread joined.
  ClearMemStore("stalled-peer");
  InProcessGroup group(2);
  auto comm0 = group.Release(0);
  comm0->set_timeout(std::chrono::minutes(5));  // the peer would be waited for a long time
  Communicator* raw = comm0.get();
  AsyncCheckpointer saver(std::move(comm0));
  RankShard s = MakeShard(0, 2, 50);
  saver.Save(s.sd, "mem://stalled-peer");  // rank 1 never joins
  const auto t0 = std::chrono::steady_clock::now();
  CHECK_THROWS_WITH(saver.Close(100ms), Contains("unfinished"));
  CHECK(std::chrono::steady_clock::now() - t0 < 5s);
  CHECK(raw->stopped());
  CHECK_FALSE(HasMetadata("stalled-peer"));
}

TEST_CASE("async: a communicator that cannot be used from a background thread is refused",
          "[async][integrity]") {
  // E.g. MPI initialised without MPI_THREAD_MULTIPLE (MpiCommunicator reports it): the saver
  // says what is missing instead of corrupting MPI's state from two threads.
  class SingleThreadedComm : public LocalCommunicator {
   public:
    std::string ConcurrentUseProblem() const override {
      return "MPI provides only MPI_THREAD_SERIALIZED";
    }
  };
  const std::string msg = MessageOf<UnsupportedError>(
      [] { AsyncCheckpointer saver(std::make_unique<SingleThreadedComm>()); });
  CHECK_THAT(msg, Contains("background") && Contains("MPI_THREAD_SERIALIZED"));
}
