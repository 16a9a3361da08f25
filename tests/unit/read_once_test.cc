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
    // Version 1: the byte counts below are of items only (version 2 adds each data file's
    // index to the reads of the ranks that read from it).
    SaveOptions so;
    so.storage.metadata_version = 1;
    Save(states[r].sd, "readonce://x", comm, so);
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
  std::string bytes = store->ReadAll(info.relative_path, UINT64_MAX);
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
  // The coordinator's planner is the default one: the load still plans rank-locally.
  for (const auto& st : stats) CHECK(st.rank_local_plan);
  CHECK(stats[2].bytes_received == 0);
  CHECK(stats[2].bytes_sent == 0);
  CHECK(stats[2].shared_batches == stats[0].shared_batches);
  CHECK(stats[0].bytes_received + stats[1].bytes_received + stats[3].bytes_received ==
        2 * kReplicatedBytes);
}

// ---- Rank-local load planning: a summary per rank, one schedule for all ----

namespace {

// Each rank's part of the rank-local schedule, built as dcp::Load builds it.
std::vector<std::vector<SharedReadBatch>> RankLocalBatches(const std::vector<LoadPlan>& plans,
                                                           const Metadata& md,
                                                           const std::vector<bool>& can_share,
                                                           uint64_t budget) {
  const auto candidates = ShareCandidates(md);
  std::vector<std::vector<int32_t>> items;
  std::vector<ReadRequestSummary> summaries;
  for (size_t r = 0; r < plans.size(); ++r) {
    items.push_back(CandidateItems(plans[r], candidates, md));
    const auto mine = SummarizeRequest(plans[r], items.back(), md, can_share[r]);
    // Through the wire format, as the coordinator gets it.
    summaries.push_back(DecodeReadRequestSummary(EncodeReadRequestSummary(mine), candidates.size(),
                                                 static_cast<int>(r)));
  }
  const ShareSchedule schedule = DecodeShareSchedule(
      EncodeShareSchedule(ScheduleCandidates(summaries, CandidateBytes(candidates, md), budget)),
      candidates.size());
  std::vector<std::vector<SharedReadBatch>> out;
  for (size_t r = 0; r < plans.size(); ++r) {
    out.push_back(BatchesFor(schedule, summaries[r], items[r], static_cast<int>(r)));
  }
  return out;
}

void CheckSameBatches(const std::vector<std::vector<SharedReadBatch>>& a,
                      const std::vector<std::vector<SharedReadBatch>>& b) {
  REQUIRE(a.size() == b.size());
  for (size_t r = 0; r < a.size(); ++r) {
    REQUIRE(a[r].size() == b[r].size());
    for (size_t k = 0; k < a[r].size(); ++k) {
      INFO("rank " << r << " batch " << k);
      CHECK(a[r][k].root == b[r][k].root);
      CHECK(a[r][k].send_items == b[r][k].send_items);
      CHECK(a[r][k].recv_segments == b[r][k].recv_segments);
      CHECK(a[r][k].recv_items == b[r][k].recv_items);
      CHECK(a[r][k].bytes == b[r][k].bytes);
    }
  }
}

}  // namespace

TEST_CASE("read-once: rank-local summaries give the batches full plans give", "[read-once]") {
  const Metadata md = ToyMetadata();
  const auto candidates = ShareCandidates(md);
  // big, blob and small are each stored whole; rows is not.
  REQUIRE(candidates.size() == 3);
  CHECK(candidates[0].fqn == "big");
  CHECK(candidates[1].fqn == "blob");
  CHECK(candidates[2].fqn == "small");
  CHECK(CandidateItems(ToyPlans(1)[0], candidates, md) == std::vector<int32_t>{0, 1, 3});
  for (const auto& [share, budget] : std::vector<std::pair<std::vector<bool>, uint64_t>>{
           {{true, true, true, true}, 1 << 20},
           {{true, true, true, true}, 512},
           {{true, true, false, true}, 1 << 20},
           {{true, true, true, true}, 1100},
           {{false, false, false, false}, 1 << 20},
           {{true, false, false, false}, 1 << 20}}) {
    const auto plans = ToyPlans(static_cast<int>(share.size()));
    CheckSameBatches(RankLocalBatches(plans, md, share, budget),
                     PlanSharedReads(plans, md, share, budget));
  }
}

TEST_CASE("read-once: a partial read of a whole-value item is not shared as whole", "[read-once]") {
  const Metadata md = ToyMetadata();
  auto plans = ToyPlans(2);
  // Rank 1 reads only the first 32 rows of "big": different bytes from rank 0's whole read.
  plans[1].items[0].lengths = {32, 4};
  const auto candidates = ShareCandidates(md);
  CHECK(CandidateItems(plans[1], candidates, md)[0] == -1);
  CheckSameBatches(RankLocalBatches(plans, md, {true, true}, 1 << 20),
                   PlanSharedReads(plans, md, {true, true}, 1 << 20));
}

TEST_CASE("read-once: malformed request summaries and schedules are refused by name",
          "[read-once][hostile]") {
  ReadRequestSummary s;
  s.can_share = true;
  s.plan_bytes = 99;
  s.reads = {true, false, true};
  const std::string enc = EncodeReadRequestSummary(s);
  const auto back = DecodeReadRequestSummary(enc, 3, 5);
  CHECK(back.can_share);
  CHECK(back.plan_bytes == 99);
  CHECK(back.reads == s.reads);
  CHECK_THROWS_AS(DecodeReadRequestSummary(enc.substr(0, 5), 3, 5), CorruptionError);
  CHECK_THROWS_WITH(DecodeReadRequestSummary(enc.substr(0, 5), 3, 5), Contains("rank 5"));
  CHECK_THROWS_AS(DecodeReadRequestSummary(enc + "x", 3, 5), CorruptionError);
  // A bitmap for another candidate count.
  CHECK_THROWS_AS(DecodeReadRequestSummary(enc, 20, 5), CorruptionError);
  CHECK_THROWS_AS(DecodeReadRequestSummary(std::string(1, '\x07') + enc.substr(1), 3, 5),
                  CorruptionError);
  // A summary that reads every candidate is one flag, whatever their number.
  s.reads.assign(100000, true);
  CHECK(EncodeReadRequestSummary(s).size() == 9);

  ShareSchedule schedule;
  schedule.batches.push_back({1, {0, 2}, 64});
  const std::string sched = EncodeShareSchedule(schedule);
  CHECK(DecodeShareSchedule(sched, 3).batches[0].candidates == std::vector<int32_t>{0, 2});
  CHECK_THROWS_WITH(DecodeShareSchedule(sched, 2), Contains("names item 2 of 2"));
  CHECK_THROWS_AS(DecodeShareSchedule(sched.substr(0, sched.size() - 1), 3), CorruptionError);
  // A count of 4 billion batches costs nothing.
  CHECK_THROWS_WITH(DecodeShareSchedule(std::string("\xff\xff\xff\xff", 4), 3),
                    Contains("claims 4294967295 batches"));
  // A root asked to read what it does not read.
  ReadRequestSummary none;
  none.can_share = true;
  none.reads = {false, false, false};
  CHECK_THROWS_AS(BatchesFor(schedule, none, {-1, -1, -1}, 1), InternalError);
}

namespace {

constexpr int64_t kMatrices = 24;

// kMatrices f32[kRows, kCols] matrices, row-sharded (save) or column-sharded (load) over kWorld
// ranks: every rank's load reads a box of every saved shard (an all-to-all reshard).
StateDict ShardedMatrices(int rank, bool by_rows, bool filled, int64_t count,
                          std::vector<TensorView>& views) {
  StateDict sd;
  for (int64_t i = 0; i < count; ++i) {
    TensorView full = RandomTensor(DType::kFloat32, {kRows, kCols}, 1000 + i);
    auto [b, e] = RowRange(by_rows ? kRows : kCols, rank, kWorld);
    const Shape offsets = by_rows ? Shape{b, 0} : Shape{0, b};
    const Shape sizes = by_rows ? Shape{e - b, kCols} : Shape{kRows, e - b};
    TensorView mine = filled ? dcp::testing::Clone(full.Narrow(offsets, sizes))
                             : TensorView::Allocate(DType::kFloat32, sizes);
    views.push_back(mine);
    sd.Set("m" + std::to_string(i),
           ShardedTensor{DType::kFloat32, {kRows, kCols}, {{mine, offsets}}});
  }
  return sd;
}

}  // namespace

TEST_CASE("load planning: an all-to-all reshard plans on every rank alone and sends no plan",
          "[read-once][reshard]") {
  // One store per checkpoint (a scheme's store is its root).
  for (const char* name : {"ranklocalfew", "ranklocalmany"}) {
    ClearMemStore(name);
    RegisterFaultScheme(name, std::make_shared<FaultInjectionStore>(MakeMemStore(name)));
  }
  auto save = [&](const std::string& uri, int64_t count) {
    RequireNoErrors(RunRanks(kWorld, [&](int r, Communicator& comm) {
      std::vector<TensorView> views;
      Save(ShardedMatrices(r, true, true, count, views), uri, comm);
    }));
  };
  // Loads column-sharded; returns each rank's stats after checking every value.
  auto load = [&](const std::string& uri, int64_t count, int custom_rank) {
    std::vector<LoadStats> stats(kWorld);
    std::vector<std::vector<TensorView>> views(kWorld);
    RequireNoErrors(RunRanks(kWorld, [&](int r, Communicator& comm) {
      StateDict sd = ShardedMatrices(r, false, false, count, views[r]);
      DefaultLoadPlanner custom;
      LoadOptions lo;
      if (r == custom_rank) lo.planner = &custom;
      stats[r] = Load(sd, uri, comm, lo).stats;
    }));
    for (int r = 0; r < kWorld; ++r) {
      std::vector<TensorView> want;
      ShardedMatrices(r, false, true, count, want);
      for (int64_t i = 0; i < count; ++i) CHECK(SameElements(views[r][i], want[i]));
    }
    return stats;
  };
  save("ranklocalfew://x", 1);
  save("ranklocalmany://x", kMatrices);
  const auto few = load("ranklocalfew://x", 1, -1);
  const auto many = load("ranklocalmany://x", kMatrices, -1);
  for (int r = 0; r < kWorld; ++r) {
    CHECK(many[r].rank_local_plan);
    CHECK(many[r].plan_rounds == 1);
    // A summary (nothing is stored whole here: a flag, a byte count and the hash of the rule
    // reads' table, one: both rules cut these alike), the same size for 1 matrix as for 24: 4
    // reads each, 96 reads in all.
    CHECK(many[r].plan_bytes_sent == few[r].plan_bytes_sent);
    CHECK(many[r].plan_bytes_sent <= 24);
  }
  // A custom planner at the coordinator has its global step: every plan goes to it.
  const auto full = load("ranklocalmany://x", kMatrices, 0);
  for (int r = 0; r < kWorld; ++r) {
    CHECK_FALSE(full[r].rank_local_plan);
    CHECK(full[r].plan_rounds == 2);
    CHECK(full[r].plan_bytes_sent > 50 * many[r].plan_bytes_sent);
  }
}
