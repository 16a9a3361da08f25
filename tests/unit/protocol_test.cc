// The save/load protocol with N ranks as threads of one process (InProcessGroup): round trips,
// dedup, and the failure semantics: an error or a stall on any rank in any phase is the same
// CollectiveError on every rank, no metadata is written, and the location keeps what it had.
#include <catch2/catch.hpp>
#include <chrono>
#include <functional>
#include <set>
#include <thread>

#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/registry.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::RandomTensor;
using dcp::testing::RowRange;
using dcp::testing::SameElements;

namespace {

using dcp::testing::RequireNoErrors;
using dcp::testing::RunRanks;

// Every rank failed with a CollectiveError, all with the same message; returns rank 0's.
CollectiveError SameErrorEverywhere(const std::vector<std::exception_ptr>& errors) {
  std::string first;
  std::optional<CollectiveError> result;
  for (size_t r = 0; r < errors.size(); ++r) {
    REQUIRE(errors[r]);
    try {
      std::rethrow_exception(errors[r]);
    } catch (const CollectiveError& e) {
      if (r == 0) {
        first = e.what();
        result = e;
      } else {
        CHECK(std::string(e.what()) == first);
      }
    } catch (const std::exception& e) {
      FAIL("rank " << r << " threw a non-collective error: " << e.what());
    }
  }
  return *result;
}

// The training state of one rank: a row-sharded matrix, a replicated vector, a per-rank blob.
struct RankState {
  TensorView shard, bias;
  StateDict sd;
};

constexpr int64_t kRows = 37, kCols = 16;

RankState MakeRankState(int rank, int world, bool random) {
  RankState s;
  auto [b, e] = RowRange(kRows, rank, world);
  // Values depend only on global position, so any layout can be compared with any other.
  TensorView full = RandomTensor(DType::kFloat32, {kRows, kCols}, 7);
  TensorView rows = full.Narrow({b, 0}, {e - b, kCols});
  s.shard =
      random ? dcp::testing::Clone(rows) : TensorView::Allocate(DType::kFloat32, {e - b, kCols});
  s.bias =
      random ? RandomTensor(DType::kFloat64, {5}, 11) : TensorView::Allocate(DType::kFloat64, {5});
  ShardedTensor st{DType::kFloat32, {kRows, kCols}, {}};
  if (e > b) st.local_shards.push_back({s.shard, {b, 0}});
  s.sd.Nested("layer").Set("weight", st).Set("bias", s.bias);
  s.sd.Set("rng" + std::to_string(rank), Blob{random ? "rank-" + std::to_string(rank) : ""});
  return s;
}

// A SavePlanner that throws from a chosen step on a chosen rank.
class FailingSavePlanner : public DefaultSavePlanner {
 public:
  FailingSavePlanner(int rank, int fail_rank, std::string step)
      : rank_(rank), fail_rank_(fail_rank), step_(std::move(step)) {}
  SavePlan CreateLocalPlan() override {
    Maybe("local");
    return DefaultSavePlanner::CreateLocalPlan();
  }
  std::pair<std::vector<SavePlan>, Metadata> CreateGlobalPlan(std::vector<SavePlan> p) override {
    Maybe("global");
    return DefaultSavePlanner::CreateGlobalPlan(std::move(p));
  }
  ResolvedData ResolveData(const WriteItem& item) const override {
    if (rank_ == fail_rank_ && step_ == "resolve")
      throw InvalidArgumentError("resolve failed on purpose");
    return DefaultSavePlanner::ResolveData(item);
  }

 private:
  void Maybe(const std::string& step) {
    if (rank_ == fail_rank_ && step_ == step)
      throw InvalidArgumentError(step + " failed on purpose");
    if (rank_ == fail_rank_ && step_ == "stall-" + step)
      std::this_thread::sleep_for(std::chrono::seconds(2));
  }
  int rank_, fail_rank_;
  std::string step_;
};

bool HasMetadata(const std::string& mem_name) {
  return MakeMemStore(mem_name)->Size(kMetadataName).has_value();
}

size_t DataObjects(const std::string& mem_name) {
  size_t n = 0;
  for (const auto& name : MakeMemStore(mem_name)->List()) n += IsDataObjectName(name);
  return n;
}

}  // namespace

TEST_CASE("protocol: round trip and reshard across 1, 2, 3 and 4 ranks", "[protocol]") {
  for (int save_world : {1, 2, 4}) {
    const std::string name = "proto-rt-" + std::to_string(save_world);
    ClearMemStore(name);
    std::vector<RankState> saved(save_world);
    RequireNoErrors(RunRanks(save_world, [&](int r, Communicator& comm) {
      saved[r] = MakeRankState(r, save_world, true);
      Metadata md = Save(saved[r].sd, "mem://" + name, comm).metadata;
      dcp::testing::Expect(md.world_size == save_world, "world size recorded");
    }));
    for (int load_world : {1, 2, 3, 4}) {
      DYNAMIC_SECTION("saved at " << save_world << ", loaded at " << load_world) {
        std::vector<RankState> loaded(load_world);
        RequireNoErrors(RunRanks(load_world, [&](int r, Communicator& comm) {
          loaded[r] = MakeRankState(r, load_world, false);
          LoadOptions lo;
          lo.allow_partial_load = true;  // per-rank blobs differ between world sizes
          Load(loaded[r].sd, "mem://" + name, comm, lo);
        }));
        for (int r = 0; r < load_world; ++r) {
          RankState expect = MakeRankState(r, load_world, true);
          CHECK(SameElements(loaded[r].shard, expect.shard));
          CHECK(SameElements(loaded[r].bias, expect.bias));
          if (r < save_world)
            CHECK(std::get<Blob>(*loaded[r].sd.Find("rng" + std::to_string(r))).bytes ==
                  "rank-" + std::to_string(r));
        }
      }
    }
  }
}

TEST_CASE("protocol: replicated tensors are written once, balanced across ranks", "[protocol]") {
  const std::string name = "proto-dedup";
  ClearMemStore(name);
  std::vector<TensorView> replicated;
  for (int i = 0; i < 4; ++i)
    replicated.push_back(RandomTensor(DType::kFloat32, {256, 256}, 100 + i));
  std::vector<Metadata> mds(4);
  RequireNoErrors(RunRanks(4, [&](int r, Communicator& comm) {
    StateDict sd;
    for (int i = 0; i < 4; ++i) sd.Set("p" + std::to_string(i), replicated[i]);
    mds[r] = Save(sd, "mem://" + name, comm).metadata;
  }));
  const uint64_t one = replicated[0].nbytes();
  CHECK(mds[0].TotalStoredBytes() == 4 * one);  // not 16x
  std::set<std::string> files;
  for (const auto& name : mds[0].DataFileNames()) files.insert(name);
  CHECK(files.size() == 4);  // one tensor per rank: balanced
  for (int r = 1; r < 4; ++r) CHECK(mds[r].save_id == mds[0].save_id);
}

TEST_CASE("protocol: a failing planner fails every rank alike and writes no metadata",
          "[protocol][fault][option:SaveOptions::planner]") {
  for (std::string step : {"local", "global", "resolve"}) {
    DYNAMIC_SECTION("failure in " << step) {
      const std::string name = "proto-fail-" + step;
      ClearMemStore(name);
      const int fail_rank = step == "global" ? 0 : 2;
      auto errors = RunRanks(4, [&](int r, Communicator& comm) {
        RankState s = MakeRankState(r, 4, true);
        FailingSavePlanner planner(r, fail_rank, step);
        SaveOptions so;
        so.planner = &planner;
        Save(s.sd, "mem://" + name, comm, so);
      });
      CollectiveError e = SameErrorEverywhere(errors);
      CHECK(e.failed_ranks() == std::vector<int>{fail_rank});
      CHECK_THAT(e.what(),
                 Contains("failed on purpose") && Contains("rank " + std::to_string(fail_rank)));
      CHECK_FALSE(e.timed_out());
      CHECK_FALSE(HasMetadata(name));
      CHECK(DataObjects(name) == 0);  // aborted saves clean up after themselves
    }
  }
}

TEST_CASE("protocol: a stalled rank times out, is named, and nothing hangs", "[protocol][fault]") {
  const std::string name = "proto-stall";
  ClearMemStore(name);
  const auto start = std::chrono::steady_clock::now();
  auto errors = RunRanks(
      4,
      [&](int r, Communicator& comm) {
        RankState s = MakeRankState(r, 4, true);
        FailingSavePlanner planner(r, 3, "stall-local");
        SaveOptions so;
        so.planner = &planner;
        Save(s.sd, "mem://" + name, comm, so);
      },
      std::chrono::milliseconds(300));
  const double secs =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  CollectiveError e = SameErrorEverywhere(errors);  // the stalled rank learns it too
  CHECK(e.failed_ranks() == std::vector<int>{3});
  CHECK(e.timed_out());
  CHECK_THAT(e.what(), Contains("did not answer"));
  CHECK(secs < 10);
  CHECK_FALSE(HasMetadata(name));
}

TEST_CASE("protocol: a failed overwrite keeps the previous checkpoint loadable",
          "[protocol][fault]") {
  const std::string name = "proto-keep";
  ClearMemStore(name);
  std::vector<RankState> first(2);
  RequireNoErrors(RunRanks(2, [&](int r, Communicator& comm) {
    first[r] = MakeRankState(r, 2, true);
    Save(first[r].sd, "mem://" + name, comm);
  }));
  const Metadata before = ReadMetadata("mem://" + name);
  auto errors = RunRanks(2, [&](int r, Communicator& comm) {
    RankState s = MakeRankState(r, 2, true);
    dcp::testing::FillRandom(s.shard.data, s.shard.nbytes(), 1234);
    FailingSavePlanner planner(r, 1, "resolve");
    SaveOptions so;
    so.planner = &planner;
    so.storage.overwrite = true;
    Save(s.sd, "mem://" + name, comm, so);
  });
  SameErrorEverywhere(errors);
  CHECK(ReadMetadata("mem://" + name).save_id == before.save_id);
  std::vector<RankState> loaded(2);
  RequireNoErrors(RunRanks(2, [&](int r, Communicator& comm) {
    loaded[r] = MakeRankState(r, 2, false);
    Load(loaded[r].sd, "mem://" + name, comm);
  }));
  for (int r = 0; r < 2; ++r) CHECK(SameElements(loaded[r].shard, first[r].shard));
}

TEST_CASE("protocol: load errors on one rank reach every rank", "[protocol][fault]") {
  const std::string name = "proto-load-err";
  ClearMemStore(name);
  RequireNoErrors(RunRanks(2, [&](int r, Communicator& comm) {
    RankState s = MakeRankState(r, 2, true);
    Save(s.sd, "mem://" + name, comm);
  }));
  SECTION("a key only one rank asks for") {
    auto errors = RunRanks(2, [&](int r, Communicator& comm) {
      RankState s = MakeRankState(r, 2, false);
      if (r == 1) s.sd.Set("not_saved", TensorView::Allocate(DType::kFloat32, {3}));
      Load(s.sd, "mem://" + name, comm);
    });
    CollectiveError e = SameErrorEverywhere(errors);
    CHECK(e.failed_ranks() == std::vector<int>{1});
    CHECK(e.failures()[0].code == ErrorCode::kNotFound);
    CHECK_THAT(e.what(), Contains("not_saved"));
  }
  SECTION("a dtype mismatch") {
    auto errors = RunRanks(2, [&](int r, Communicator& comm) {
      RankState s = MakeRankState(r, 2, false);
      s.sd.Nested("layer").Set("bias", TensorView::Allocate(DType::kFloat32, {5}));
      Load(s.sd, "mem://" + name, comm);
    });
    CollectiveError e = SameErrorEverywhere(errors);
    CHECK(e.failed_ranks() == std::vector<int>{0, 1});
    CHECK_THAT(e.what(),
               Contains("layer.bias") && Contains("float64[5]") && Contains("float32[5]"));
  }
  SECTION("no checkpoint at all") {
    auto errors = RunRanks(3, [&](int r, Communicator& comm) {
      RankState s = MakeRankState(r, 3, false);
      Load(s.sd, "mem://proto-nothing-here", comm);
    });
    CollectiveError e = SameErrorEverywhere(errors);
    CHECK(e.failures()[0].code == ErrorCode::kNotFound);
  }
}

TEST_CASE("communicator: collectives over an in-process group", "[comm]") {
  using dcp::testing::Expect;
  RequireNoErrors(RunRanks(4, [&](int r, Communicator& comm) {
    auto g = comm.Gather("g" + std::to_string(r), 0, "t");
    if (r == 0)
      Expect(g == std::vector<std::string>{"g0", "g1", "g2", "g3"}, "gather at root");
    else
      Expect(g.empty(), "gather elsewhere");
    std::vector<std::string> msgs;
    if (r == 0) msgs = {"s0", "s1", "s2", "s3"};
    Expect(comm.Scatter(msgs, 0, "t") == "s" + std::to_string(r), "scatter");
    Expect(comm.Broadcast(r == 0 ? std::string(1 << 20, 'b') : "", 0, "t").size() == 1u << 20,
           "broadcast");
    Expect(
        comm.AllGather(std::string(r, 'x'), "t") == std::vector<std::string>{"", "x", "xx", "xxx"},
        "all-gather");
    comm.Barrier("t");
  }));
}

TEST_CASE("protocol: a load broadcasts the metadata file's payload as read, not a re-encoding",
          "[protocol]") {
  StateDict sd;
  sd.Set("w", RandomTensor(DType::kFloat32, {6, 4}, 3));
  for (const char* format : {"dcp", "torchdcp"}) {
    INFO(format);
    const std::string uri = std::string("mem://payload-") + format + "?format=" + format;
    ClearMemStore(std::string("payload-") + format);
    LocalCommunicator comm;
    Save(sd, uri, comm);
    auto reader = OpenStorageReader(uri);
    const Metadata md = reader->ReadMetadata();
    const std::string encoded = reader->TakeEncodedMetadata();
    if (std::string(format) == "dcp") {
      // The file's bytes after the 24-byte envelope: they decode to what the reader returned.
      const std::string file = OpenStore(uri)->ReadAll(kMetadataName, UINT64_MAX);
      CHECK(encoded == file.substr(kMetadataHeaderSize));
      CHECK(DecodeMetadata(encoded, "test").entries.size() == md.entries.size());
      CHECK(reader->TakeEncodedMetadata().empty());  // moved out
    } else {
      CHECK(encoded.empty());  // PyTorch DCP's .metadata is a pickle: encoded by the protocol
    }
    // Either way every rank loads the same values (checked after the ranks' threads: Catch's
    // assertions are not thread-safe).
    std::vector<TensorView> loaded;
    for (int r = 0; r < 3; ++r) loaded.push_back(TensorView::Allocate(DType::kFloat32, {6, 4}));
    RequireNoErrors(RunRanks(3, [&](int r, Communicator& c) {
      StateDict back;
      back.Set("w", loaded[r]);
      Load(back, uri, c);
    }));
    for (const TensorView& w : loaded) CHECK(SameElements(w, std::get<TensorView>(*sd.Find("w"))));
  }
}
