// Read-once on load (LoadOptions::read_once, planner/read_sharing.h): bytes several ranks ask for
// in identical form are read from storage once and broadcast. The planning function on its own,
// then whole loads with N ranks as threads, counting the bytes read from a FaultInjectionStore.
#include <catch2/catch.hpp>
#include <chrono>
#include <map>
#include <set>

#include "dcp/planner/read_sharing.h"
#include "dcp/storage/backends/fault_store.h"
#include "dcp/storage/backends/mem_store.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::RandomTensor;
using dcp::testing::RequireNoErrors;
using dcp::testing::RowRange;
using dcp::testing::RunRanks;
using dcp::testing::SameElements;

namespace {

ReadItem WholeTensor(const std::string& fqn, const Shape& shape) {
  ReadItem item;
  item.type = ReadItemType::kTensor;
  item.dest_index = {fqn, Shape(shape.size(), 0), std::nullopt};
  item.dest_offsets = Shape(shape.size(), 0);
  item.storage_index = {fqn, Shape(shape.size(), 0), std::nullopt};
  item.storage_offsets = Shape(shape.size(), 0);
  item.lengths = shape;
  return item;
}

ReadItem WholeBlob(const std::string& fqn) {
  ReadItem item;
  item.type = ReadItemType::kBytes;
  item.dest_index = {fqn, {}, std::nullopt};
  item.storage_index = {fqn, {}, std::nullopt};
  return item;
}

// "big" f32[64,4] and "small" f32[8] replicated, "blob" 40 bytes replicated, "rows" f32[8]
// split 2 rows per rank (never shared).
Metadata ToyMetadata() {
  Metadata md;
  md.entries["big"] = TensorMetadata{DType::kFloat32, {64, 4}, {{{0, 0}, {64, 4}}}};
  md.entries["small"] = TensorMetadata{DType::kFloat32, {8}, {{{0}, {8}}}};
  md.entries["rows"] = TensorMetadata{DType::kFloat32, {8}, {}};
  for (int r = 0; r < 4; ++r)
    std::get<TensorMetadata>(md.entries["rows"]).chunks.push_back({{2 * r}, {2}});
  md.entries["blob"] = BytesMetadata{};
  StorageInfo blob;
  blob.relative_path = "data-0";
  blob.length = 40;
  md.storage[{"blob", {}, std::nullopt}] = blob;
  return md;
}

std::vector<LoadPlan> ToyPlans(int n) {
  std::vector<LoadPlan> plans(n);
  for (int r = 0; r < n; ++r) {
    plans[r].items.push_back(WholeTensor("big", {64, 4}));
    plans[r].items.push_back(WholeBlob("blob"));
    ReadItem rows = WholeTensor("rows", {2});
    rows.storage_index.offset = {2 * r};
    rows.dest_index.offset = {2 * r};
    plans[r].items.push_back(rows);
    plans[r].items.push_back(WholeTensor("small", {8}));
  }
  return plans;
}

// Which rank reads each shared item, and who receives it; checks that every rank holds the same
// sequence of roots.
struct Roles {
  std::map<int32_t, int> reader_of;               // item index (same on every toy rank) -> root
  std::map<int32_t, std::set<int>> receivers_of;  // item index -> ranks receiving it
};

Roles Collect(const std::vector<std::vector<SharedReadBatch>>& batches) {
  Roles roles;
  for (size_t r = 0; r < batches.size(); ++r) {
    REQUIRE(batches[r].size() == batches[0].size());
    for (size_t b = 0; b < batches[r].size(); ++b) {
      const SharedReadBatch& mine = batches[r][b];
      REQUIRE(mine.root == batches[0][b].root);
      REQUIRE(mine.bytes == batches[0][b].bytes);
      if (static_cast<int>(r) != mine.root) REQUIRE(mine.send_items.empty());
      for (int32_t i : mine.send_items) {
        REQUIRE(roles.reader_of.count(i) == 0);
        roles.reader_of[i] = static_cast<int>(r);
      }
      for (int32_t i : mine.recv_items) roles.receivers_of[i].insert(static_cast<int>(r));
    }
  }
  return roles;
}

}  // namespace

TEST_CASE("read-once: identical reads get one reader, balanced, the rest receive", "[read-once]") {
  const Metadata md = ToyMetadata();
  auto batches = PlanSharedReads(ToyPlans(4), md, {true, true, true, true}, 1 << 20);
  Roles roles = Collect(batches);
  // big (item 0), blob (1) and small (3) are shared; rows (2) differs per rank.
  REQUIRE(roles.reader_of.size() == 3);
  CHECK(roles.reader_of.count(2) == 0);
  for (int32_t i : {0, 1, 3}) {
    const int root = roles.reader_of.at(i);
    std::set<int> others = {0, 1, 2, 3};
    others.erase(root);
    CHECK(roles.receivers_of[i] == others);
  }
  // Largest first to the least loaded: the three items land on three different ranks.
  CHECK(std::set<int>{roles.reader_of[0], roles.reader_of[1], roles.reader_of[3]}.size() == 3);
  CHECK(ReadItemBytes(ToyPlans(1)[0].items[0], md) == 64 * 4 * 4);
  CHECK(ReadItemBytes(ToyPlans(1)[0].items[1], md) == 40);
}

TEST_CASE("read-once: items over the budget, and ranks that opt out, read for themselves",
          "[read-once]") {
  const Metadata md = ToyMetadata();
  SECTION("an item larger than one batch is not shared") {
    Roles roles = Collect(PlanSharedReads(ToyPlans(4), md, {true, true, true, true}, 512));
    CHECK(roles.reader_of.count(0) == 0);  // big: 1 KiB
    CHECK(roles.reader_of.count(1) == 1);
    CHECK(roles.reader_of.count(3) == 1);
  }
  SECTION("a rank that cannot share neither reads for others nor receives") {
    auto batches = PlanSharedReads(ToyPlans(4), md, {true, true, false, true}, 1 << 20);
    Roles roles = Collect(batches);
    REQUIRE(roles.reader_of.size() == 3);
    for (const auto& [item, root] : roles.reader_of) {
      CHECK(root != 2);
      CHECK(roles.receivers_of[item].count(2) == 0);
      CHECK(roles.receivers_of[item].size() == 2);
    }
    REQUIRE(batches[2].size() == batches[0].size());  // but it joins every broadcast
  }
  SECTION("batches hold at most the budget") {
    auto batches = PlanSharedReads(ToyPlans(2), md, {true, true}, 1100);
    for (const auto& b : batches[0]) CHECK(b.bytes <= 1100);
    Roles roles = Collect(batches);
    CHECK(roles.reader_of.size() == 3);
  }
  SECTION("nothing shared: no batches") {
    CHECK(PlanSharedReads(ToyPlans(1), md, {true}, 1 << 20)[0].empty());
    auto none = PlanSharedReads(ToyPlans(3), md, {false, false, false}, 1 << 20);
    for (const auto& b : none) CHECK(b.empty());
  }
}

namespace {

constexpr int kWorld = 4;
constexpr int64_t kRows = 40, kCols = 64;

// A replicated-heavy state: three replicated f32 matrices (10 KiB each), a replicated blob, and
// one row-sharded matrix. Values depend only on the name, so any rank can check any other.
struct State {
  std::vector<TensorView> replicated;
  TensorView shard;
  StateDict sd;
};

State MakeState(int rank, bool filled) {
  State s;
  for (int i = 0; i < 3; ++i) {
    TensorView t = filled ? RandomTensor(DType::kFloat32, {kRows, kCols}, 100 + i)
                          : TensorView::Allocate(DType::kFloat32, {kRows, kCols});
    s.replicated.push_back(t);
    s.sd.Set("replicated" + std::to_string(i), t);
  }
  s.sd.Set("tokenizer", Blob{filled ? std::string(5000, 't') : std::string()});
  auto [b, e] = RowRange(kRows, rank, kWorld);
  TensorView full = RandomTensor(DType::kFloat32, {kRows, kCols}, 7);
  s.shard = filled ? dcp::testing::Clone(full.Narrow({b, 0}, {e - b, kCols}))
                   : TensorView::Allocate(DType::kFloat32, {e - b, kCols});
  ShardedTensor st{DType::kFloat32, {kRows, kCols}, {{s.shard, {b, 0}}}};
  s.sd.Set("sharded", st);
  return s;
}

constexpr uint64_t kReplicatedBytes = 3 * kRows * kCols * 4 + 5000;

std::shared_ptr<FaultInjectionStore> SavedState(const std::string& bucket) {
  ClearMemStore(bucket);
  auto store = std::make_shared<FaultInjectionStore>(MakeMemStore(bucket));
  RegisterFaultScheme("readonce", store);
  std::vector<State> states(kWorld);
  RequireNoErrors(RunRanks(kWorld, [&](int r, Communicator& comm) {
    states[r] = MakeState(r, true);
    Save(states[r].sd, "readonce://x", comm);
  }));
  return store;
}

// Every rank holds the saved values.
void CheckLoaded(const std::vector<State>& loaded) {
  for (int r = 0; r < kWorld; ++r) {
    State want = MakeState(r, true);
    for (int i = 0; i < 3; ++i) CHECK(SameElements(loaded[r].replicated[i], want.replicated[i]));
    CHECK(SameElements(loaded[r].shard, want.shard));
    CHECK(std::get<Blob>(*loaded[r].sd.Find("tokenizer")).bytes == std::string(5000, 't'));
  }
}

// Load at kWorld ranks; returns the bytes read from storage and each rank's stats.
uint64_t LoadAll(FaultInjectionStore& store, bool read_once, size_t budget,
                 std::vector<LoadStats>& stats) {
  store.Reset();
  stats.assign(kWorld, {});
  std::vector<State> loaded(kWorld);
  RequireNoErrors(RunRanks(kWorld, [&](int r, Communicator& comm) {
    loaded[r] = MakeState(r, false);
    LoadOptions lo;
    lo.read_once = read_once;
    lo.storage.memory_budget_bytes = budget;
    stats[r] = Load(loaded[r].sd, "readonce://x", comm, lo).stats;
  }));
  CheckLoaded(loaded);
  return store.BytesRead();
}

}  // namespace

TEST_CASE("read-once: replicated entries are read from storage once at 4 ranks",
          "[read-once][option:LoadOptions::read_once]") {
  auto store = SavedState("read-once-bytes");
  std::vector<LoadStats> off_stats, on_stats;
  const uint64_t off = LoadAll(*store, false, 256 << 20, off_stats);
  const uint64_t on = LoadAll(*store, true, 256 << 20, on_stats);
  INFO("bytes read: read_once off " << off << ", on " << on);
  // Off: every rank reads every replicated byte. On: each is read once, 3 of 4 copies saved.
  CHECK(off - on == (kWorld - 1) * kReplicatedBytes);
  uint64_t sent = 0, received = 0;
  for (int r = 0; r < kWorld; ++r) {
    CHECK(off_stats[r].shared_batches == 0);
    CHECK(on_stats[r].shared_batches > 0);
    sent += on_stats[r].bytes_sent;
    received += on_stats[r].bytes_received;
  }
  CHECK(sent == kReplicatedBytes);
  CHECK(received == (kWorld - 1) * kReplicatedBytes);
  // Balanced: no rank reads more than the largest replicated item beyond its even share.
  for (int r = 0; r < kWorld; ++r) {
    CHECK(on_stats[r].bytes_sent <= kReplicatedBytes / kWorld + kRows * kCols * 4);
  }
}

TEST_CASE("read-once: a budget smaller than the shared bytes splits them into batches",
          "[read-once][option:StorageOptions::memory_budget_bytes]") {
  auto store = SavedState("read-once-budget");
  std::vector<LoadStats> stats;
  // 12 KiB: one 10 KiB matrix per batch; each root holds at most one batch ahead.
  const uint64_t on = LoadAll(*store, true, 12 << 10, stats);
  std::vector<LoadStats> off_stats;
  const uint64_t off = LoadAll(*store, false, 12 << 10, off_stats);
  CHECK(off - on == (kWorld - 1) * kReplicatedBytes);
  CHECK(stats[0].shared_batches == 4);  // three matrices and the tokenizer, one batch each
}

TEST_CASE("read-once: a root that cannot read its items fails every rank at once, naming it",
          "[read-once]") {
  auto store = SavedState("read-once-corrupt");
  // Damage replicated1's stored bytes: its root's checksum fails.
  const Metadata md = ReadMetadata("readonce://x");
  const StorageInfo& info = md.storage.at({"replicated1", {0, 0}, std::nullopt});
  std::string bytes = store->ReadAll(info.relative_path);
  bytes[info.offset + 17] ^= 0x40;
  {
    auto out = store->inner()->Create(info.relative_path);
    out->Append(bytes.data(), bytes.size());
    out->Close();
  }
  const auto start = std::chrono::steady_clock::now();
  std::vector<State> loaded(kWorld);
  auto errors = RunRanks(kWorld, [&](int r, Communicator& comm) {
    loaded[r] = MakeState(r, false);
    Load(loaded[r].sd, "readonce://x", comm);
  });
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(20));
  std::string first;
  int naming_root = 0;
  for (int r = 0; r < kWorld; ++r) {
    REQUIRE(errors[r]);
    try {
      std::rethrow_exception(errors[r]);
    } catch (const CollectiveError& e) {
      if (r == 0) first = e.what();
      CHECK(std::string(e.what()) == first);
      CHECK_THAT(e.what(), Contains("replicated1"));
      for (const auto& f : e.failures()) {
        naming_root +=
            f.message.find("could not read the items it reads for this rank") != std::string::npos;
        CHECK(f.code == ErrorCode::kCorruption);
      }
    }
  }
  CHECK(naming_root > 0);  // the receivers say whose read failed
}

TEST_CASE("read-once: a rank with its own planner reads for itself, values are the same",
          "[read-once][option:LoadOptions::planner]") {
  auto store = SavedState("read-once-mixed");
  std::vector<State> loaded(kWorld);
  std::vector<LoadStats> stats(kWorld);
  RequireNoErrors(RunRanks(kWorld, [&](int r, Communicator& comm) {
    loaded[r] = MakeState(r, false);
    DefaultLoadPlanner custom;
    LoadOptions lo;
    if (r == 2) lo.planner = &custom;
    stats[r] = Load(loaded[r].sd, "readonce://x", comm, lo).stats;
  }));
  CheckLoaded(loaded);
  CHECK(stats[2].bytes_received == 0);
  CHECK(stats[2].bytes_sent == 0);
  CHECK(stats[2].shared_batches == stats[0].shared_batches);
  CHECK(stats[0].bytes_received + stats[1].bytes_received + stats[3].bytes_received ==
        2 * kReplicatedBytes);
}
