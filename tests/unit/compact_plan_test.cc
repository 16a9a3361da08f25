// Compact save planning (planner/compact_plan.h, issue 16): regularly sharded tensors are
// described once instead of once per rank. The checkpoint must be the same as with full plans,
// and anything irregular must fall back to full planning and still save correctly.
#include "dcp/planner/compact_plan.h"

#include <catch2/catch.hpp>

#include "dcp/dcp.h"
#include "dcp/proto/codec.h"
#include "dcp/storage/mem_store.h"
#include "dcp/storage/registry.h"
#include "support/test_support.h"

namespace dcp {
namespace {

using testing::RandomTensor;
using testing::RequireNoErrors;
using testing::RunRanks;
using testing::SameElements;

constexpr int kRanks = 4;

TEST_CASE("compact plan: the splitting rules", "[compactplan]") {
  // 10 over 4: balanced 3,3,2,2; ceil 3,3,3,1.
  CHECK(RegularSlice(10, 0, 4, kRuleBalanced) == std::make_pair<int64_t, int64_t>(0, 3));
  CHECK(RegularSlice(10, 2, 4, kRuleBalanced) == std::make_pair<int64_t, int64_t>(6, 8));
  CHECK(RegularSlice(10, 3, 4, kRuleBalanced) == std::make_pair<int64_t, int64_t>(8, 10));
  CHECK(RegularSlice(10, 2, 4, kRuleCeil) == std::make_pair<int64_t, int64_t>(6, 9));
  CHECK(RegularSlice(10, 3, 4, kRuleCeil) == std::make_pair<int64_t, int64_t>(9, 10));
  // 9 over 4 with ceil leaves rank 3 nothing.
  CHECK(RegularSlice(9, 3, 4, kRuleCeil) == std::make_pair<int64_t, int64_t>(9, 9));
}

WriteItem Shard(const std::string& fqn, const Shape& global, const Shape& off, const Shape& sz) {
  WriteItem it;
  it.index = {fqn, off, {}};
  it.type = WriteItemType::kShard;
  it.dtype = DType::kFloat32;
  it.global_shape = global;
  it.chunk = {off, sz};
  it.size_bytes = static_cast<uint64_t>(NumElements(sz)) * 4;
  return it;
}

TEST_CASE("compact plan: which items of a local plan are regular", "[compactplan]") {
  // Rank 2 of 4.
  SavePlan p;
  p.items.push_back(Shard("rows", {10, 4}, {6, 0}, {2, 4}));  // balanced rows 6..8
  p.items.push_back(Shard("cols", {4, 10}, {0, 6}, {4, 3}));  // ceil columns 6..9
  p.items.push_back(Shard("both", {8, 8}, {4, 4}, {2, 2}));   // cut along two dims
  p.items.push_back(Shard("odd", {10, 4}, {5, 0}, {2, 4}));   // no rule gives 5..7
  p.items.push_back(Shard("small", {3}, {2}, {1}));           // extent < world
  p.items.push_back(Shard("twice", {16}, {8}, {2}));          // two items of one fqn
  p.items.push_back(Shard("twice", {16}, {12}, {2}));
  WriteItem whole = Shard("whole", {5}, {0}, {5});
  whole.type = WriteItemType::kTensor;
  p.items.push_back(whole);
  WriteItem blob;
  blob.index = {"blob", {}, {}};
  blob.type = WriteItemType::kBytes;
  p.items.push_back(blob);
  for (const auto& it : p.items) p.key_paths[it.index.fqn] = {"m", it.index.fqn};
  p.planner_data = "declarations";

  const PlanSplit split = SplitRegularShards(p, 2, 4);
  REQUIRE(split.regular.size() == 2);
  CHECK(split.regular[0].item == 0);
  CHECK(split.regular[0].dim == 0);
  CHECK(split.regular[0].rules == kRuleBalanced);
  CHECK(split.regular[1].item == 1);
  CHECK(split.regular[1].dim == 1);
  CHECK(split.regular[1].rules == kRuleCeil);
  REQUIRE(split.residual.items.size() == p.items.size() - 2);
  CHECK(split.residual.items[0].index.fqn == "both");
  CHECK(split.residual.key_paths.count("rows") == 0);
  CHECK(split.residual.key_paths.count("cols") == 0);
  CHECK(split.residual.key_paths.count("both") == 1);
  CHECK(split.residual.planner_data == "declarations");

  // The hash depends on the description, not on the rank: rank 1 of the same layout hashes
  // alike; another shape, another dimension or another key path does not.
  SavePlan q = p;
  q.items[0] = Shard("rows", {10, 4}, {3, 0}, {3, 4});
  q.items[1] = Shard("cols", {4, 10}, {0, 3}, {4, 3});
  const PlanSplit other_rank = SplitRegularShards(q, 1, 4);
  REQUIRE(other_rank.regular.size() == 2);
  CHECK(other_rank.regular[1].rules == (kRuleBalanced | kRuleCeil));  // 3..6 under both
  CHECK(other_rank.hash == split.hash);
  SavePlan r = p;
  r.key_paths["rows"] = {"m", "renamed"};
  CHECK(SplitRegularShards(r, 2, 4).hash != split.hash);
  SavePlan t = p;
  t.items[0] = Shard("rows", {11, 4}, {6, 0}, {3, 4});  // balanced 11 over 4: 3,3,3,2
  CHECK(SplitRegularShards(t, 2, 4).hash != split.hash);

  // The common rule of "cols" over ranks 1 and 2 is ceil (rank 2 matches only it).
  const auto rules =
      CommonRules(split, {{kRuleBalanced, kRuleCeil}, {kRuleBalanced, kRuleBalanced | kRuleCeil}});
  REQUIRE(rules.size() == 2);
  CHECK(rules[0] == kRuleBalanced);
  CHECK(rules[1] == kRuleCeil);
  CHECK(CommonRules(split, {{kRuleBalanced, kRuleCeil}, {kRuleCeil, kRuleCeil}}).empty());

  // One world: nothing is regular.
  CHECK(SplitRegularShards(p, 0, 1).regular.empty());
}

TEST_CASE("compact plan: the rebuilt plan is the local plan less what the coordinator dropped",
          "[compactplan]") {
  SavePlan p;
  p.items.push_back(Shard("a", {8}, {4}, {2}));  // regular for rank 2 of 4
  WriteItem rep = Shard("b", {3}, {0}, {3});
  rep.type = WriteItemType::kTensor;
  p.items.push_back(rep);
  p.items.push_back(Shard("c", {8}, {4}, {2}));
  WriteItem rep2 = rep;
  rep2.index.fqn = "d";
  p.items.push_back(rep2);
  const PlanSplit split = SplitRegularShards(p, 2, 4);
  REQUIRE(split.regular.size() == 2);
  SavePlan reply;
  reply.storage_data = "files";
  reply.items.push_back(split.residual.items[1]);  // "b" dropped (another rank writes it)
  reply.items[0].index.index = 0;
  const SavePlan rebuilt = RebuildGlobalPlan(p, split, reply, 2);
  REQUIRE(rebuilt.items.size() == 3);
  CHECK(rebuilt.items[0].index.fqn == "a");
  CHECK(rebuilt.items[0].index.index == 2);
  CHECK(rebuilt.items[1].index.fqn == "c");
  CHECK(rebuilt.items[2].index.fqn == "d");
  CHECK(rebuilt.items[2].index.index == 0);
  CHECK(rebuilt.storage_data == "files");
  // A reply naming an item this rank does not have (or out of order) is refused.
  SavePlan bad = reply;
  bad.items[0].index.fqn = "zz";
  CHECK_THROWS_AS(RebuildGlobalPlan(p, split, bad, 2), InternalError);
}

// A writer that hides its inner writer's capabilities: the protocol plans in full with it.
class FullPlanWriter : public testing::ForwardingWriter {
 public:
  using ForwardingWriter::ForwardingWriter;
  bool GlobalPlanOnlyNamesFiles() const override { return false; }
  bool FinishTakesFilledStorage() const override { return false; }
};

// An FSDP-like state: row-sharded matrices (balanced and ceil splits), a column-sharded one, a
// 1-D vector shorter than the world (rank 3 holds none), replicated tensors and a blob; with
// `irregular`, "layer.0.w" is split regularly on some ranks only.
struct State {
  std::vector<TensorView> mine;  // what this rank saved, for checking
  StateDict sd;
};

State MakeState(int rank, uint64_t seed, bool irregular = false) {
  State s;
  auto shard_rows = [&](const std::string& fqn, Shape shape, int dim, RegularRule rule) {
    auto [b, e] = RegularSlice(shape[static_cast<size_t>(dim)], rank, kRanks, rule);
    if (fqn == "layer.0.w" && irregular) {
      // 8 rows split 2,2,1,3: ranks 0 and 1 hold what the balanced rule gives them, ranks 2
      // and 3 do not (so only ranks 0 and 1 describe the tensor as regular).
      static const int64_t begins[] = {0, 2, 4, 5, 8};
      b = begins[rank];
      e = begins[rank + 1];
      shape[0] = 8;
    }
    Shape local = shape, off(shape.size(), 0);
    local[static_cast<size_t>(dim)] = e - b;
    off[static_cast<size_t>(dim)] = b;
    ShardedTensor st{DType::kFloat32, shape, {}};
    if (e > b) {
      TensorView v = RandomTensor(DType::kFloat32, local,
                                  seed * 1000 + std::hash<std::string>()(fqn) % 997 + rank);
      st.local_shards.push_back({v, off});
      s.mine.push_back(v);
    }
    s.sd.Set(fqn, st);
  };
  for (int l = 0; l < 3; ++l) {
    shard_rows("layer." + std::to_string(l) + ".w", {5, 3}, 0, kRuleBalanced);  // 2,1,1,1
    shard_rows("layer." + std::to_string(l) + ".v", {10, 2}, 0, kRuleCeil);     // 3,3,3,1
  }
  shard_rows("cols", {2, 9}, 1, kRuleBalanced);
  shard_rows("short", {3}, 0, kRuleBalanced);  // rank 3 holds nothing
  s.mine.push_back(RandomTensor(DType::kInt64, {4}, seed + 77));
  s.sd.Set("replicated", s.mine.back());
  s.sd.Set("blob", Blob{"rank-independent bytes"});
  return s;
}

// Save at kRanks ranks (compactly unless `full`), check every rank's stats, load back and
// compare; return the metadata.
Metadata SaveLoad(const std::string& name, bool full, uint64_t seed, bool irregular,
                  bool expect_compact) {
  ClearMemStore(name);
  const std::string uri = "mem://" + name;
  std::vector<State> states;
  for (int r = 0; r < kRanks; ++r) states.push_back(MakeState(r, seed, irregular));
  std::vector<SaveStats> stats(kRanks);
  RequireNoErrors(RunRanks(kRanks, [&](int r, Communicator& comm) {
    std::unique_ptr<StorageWriter> w = OpenStorageWriter(uri);
    if (full) w = std::make_unique<FullPlanWriter>(std::move(w));
    SaveOptions o;
    o.stats = &stats[static_cast<size_t>(r)];
    Save(states[static_cast<size_t>(r)].sd, *w, comm, o);
  }));
  for (int r = 0; r < kRanks; ++r) {
    INFO("rank " << r);
    CHECK(stats[static_cast<size_t>(r)].compact_plan == expect_compact);
    CHECK((stats[static_cast<size_t>(r)].regular_items > 0) == expect_compact);
  }
  std::vector<State> back;
  for (int r = 0; r < kRanks; ++r) back.push_back(MakeState(r, seed + 1, irregular));
  RequireNoErrors(RunRanks(kRanks, [&](int r, Communicator& comm) {
    Load(back[static_cast<size_t>(r)].sd, uri, comm);
  }));
  for (int r = 0; r < kRanks; ++r) {
    const auto& a = states[static_cast<size_t>(r)].mine;
    const auto& b = back[static_cast<size_t>(r)].mine;
    REQUIRE(a.size() == b.size());
    for (size_t i = 0; i < a.size(); ++i) {
      INFO("rank " << r << " tensor " << i);
      CHECK(SameElements(a[i], b[i]));
    }
  }
  return OpenStorageReader(uri)->ReadMetadata();
}

// The metadata with what differs between two saves of the same state (ids, time, file names)
// made equal.
std::string Normalized(Metadata md) {
  const std::string save = md.save_id;
  md.save_id.clear();
  md.checkpoint_id.clear();
  md.created_unix_ns = 0;
  for (auto& [index, info] : md.storage) {
    if (auto pos = info.relative_path.find(save); pos != std::string::npos) {
      info.relative_path.replace(pos, save.size(), "S");
    }
  }
  return EncodeMetadata(md);
}

TEST_CASE("compact plan: the checkpoint equals the one full planning makes", "[compactplan]") {
  const Metadata compact = SaveLoad("compact-a", /*full=*/false, 1, false, /*expect=*/true);
  const Metadata full = SaveLoad("compact-b", /*full=*/true, 1, false, /*expect=*/false);
  CHECK(compact.entries.size() == full.entries.size());
  CHECK(compact.storage.size() == full.storage.size());
  CHECK(Normalized(compact) == Normalized(full));
  ClearMemStore("compact-a");
  ClearMemStore("compact-b");
}

TEST_CASE("compact plan: ranks that split a tensor irregularly make every rank plan in full",
          "[compactplan]") {
  // Ranks 2 and 3 do not describe layer.0.w as regular: their hashes differ from rank 0's,
  // the coordinator answers "plan in full", and the save is still whole and exact.
  const Metadata md = SaveLoad("compact-c", /*full=*/false, 2, /*irregular=*/true,
                               /*expect=*/false);
  const auto& w = std::get<TensorMetadata>(md.entries.at("layer.0.w"));
  CHECK(w.chunks.size() == 4);
  ClearMemStore("compact-c");
}

TEST_CASE("compact plan: a save of regular shards sends less to the coordinator", "[compactplan]") {
  // 64 regularly sharded tensors per rank: the compact message carries their hash and a byte
  // each instead of 64 items.
  auto run = [&](bool full) {
    ClearMemStore("compact-d");
    std::vector<std::vector<TensorView>> keep(kRanks);
    std::vector<StateDict> sds(kRanks);
    for (int r = 0; r < kRanks; ++r) {
      for (int i = 0; i < 64; ++i) {
        auto [b, e] = RegularSlice(8, r, kRanks, kRuleBalanced);
        keep[static_cast<size_t>(r)].push_back(RandomTensor(DType::kFloat32, {e - b, 4}, i));
        ShardedTensor st{DType::kFloat32, {8, 4}, {{keep[static_cast<size_t>(r)].back(), {b, 0}}}};
        sds[static_cast<size_t>(r)].Set("model.layers." + std::to_string(i) + ".weight", st);
      }
    }
    std::vector<SaveStats> stats(kRanks);
    RequireNoErrors(RunRanks(kRanks, [&](int r, Communicator& comm) {
      std::unique_ptr<StorageWriter> w = OpenStorageWriter("mem://compact-d");
      if (full) w = std::make_unique<FullPlanWriter>(std::move(w));
      SaveOptions o;
      o.storage.overwrite = true;
      o.stats = &stats[static_cast<size_t>(r)];
      Save(sds[static_cast<size_t>(r)], *w, comm, o);
    }));
    return stats[1];
  };
  const SaveStats compact = run(false), full = run(true);
  CHECK(compact.compact_plan);
  CHECK(compact.regular_items == 64);
  CHECK_FALSE(full.compact_plan);
  INFO("plan bytes: compact " << compact.plan_bytes_sent << ", full " << full.plan_bytes_sent);
  CHECK(compact.plan_bytes_sent * 10 < full.plan_bytes_sent);
  ClearMemStore("compact-d");
}

}  // namespace
}  // namespace dcp
