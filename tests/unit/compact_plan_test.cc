// Compact save planning (planner/compact_plan.h, issue 16): regularly sharded tensors are
// described once instead of once per rank. The checkpoint must be the same as with full plans,
// and anything irregular must fall back to full planning and still save correctly.
#include "dcp/planner/compact_plan.h"

#include <catch2/catch.hpp>

#include "dcp/dcp.h"
#include "dcp/planner/default_planner.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/mem_store.h"
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
  p.items.push_back(Shard("small", {3}, {2}, {1}));           // extent < world: unit 2
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
  // A tensor this rank holds none of (its dimensions exceed the rank: not a short one).
  const std::string absent = EncodeSaveDeclaration("absent", DType::kFloat32, {8, 4});
  p.planner_data = absent;

  const PlanSplit split = SplitRegularShards(p, 2, 4);
  REQUIRE(split.regular.size() == 3);
  CHECK(split.regular[0].item == 0);
  CHECK(split.regular[0].dim == 0);
  CHECK(split.regular[0].rules == kRuleBalanced);
  CHECK(split.regular[1].item == 1);
  CHECK(split.regular[1].dim == 1);
  CHECK(split.regular[1].rules == kRuleCeil);
  CHECK(split.regular[2].item == 4);
  CHECK(split.regular[2].rules == kRuleBalanced);
  CHECK(split.regular[2].extent == 3);
  REQUIRE(split.residual.items.size() == p.items.size() - 3);
  CHECK(split.residual.items[0].index.fqn == "both");
  CHECK(split.residual.key_paths.count("rows") == 0);
  CHECK(split.residual.key_paths.count("cols") == 0);
  CHECK(split.residual.key_paths.count("small") == 0);
  CHECK(split.residual.key_paths.count("both") == 1);
  // A slice that is not its rank's unit of a short tensor is not regular.
  SavePlan off = p;
  off.items[4] = Shard("small", {3}, {1}, {1});
  CHECK(SplitRegularShards(off, 2, 4).regular.size() == 2);
  CHECK(split.residual.planner_data == absent);
  CHECK(split.declarations_hashed);
  CHECK(split.declared_hash == 0);

  // The hash depends on the description, not on the rank: rank 1 of the same layout hashes
  // alike; another shape, another dimension or another key path does not.
  SavePlan q = p;
  q.items[0] = Shard("rows", {10, 4}, {3, 0}, {3, 4});
  q.items[1] = Shard("cols", {4, 10}, {0, 3}, {4, 3});
  q.items[4] = Shard("small", {3}, {1}, {1});
  const PlanSplit other_rank = SplitRegularShards(q, 1, 4);
  REQUIRE(other_rank.regular.size() == 3);
  CHECK(other_rank.regular[1].rules == (kRuleBalanced | kRuleCeil));  // 3..6 under both
  CHECK(other_rank.hash == split.hash);
  SavePlan r = p;
  r.key_paths["rows"] = {"m", "renamed"};
  CHECK(SplitRegularShards(r, 2, 4).hash != split.hash);
  SavePlan t = p;
  t.items[0] = Shard("rows", {11, 4}, {6, 0}, {3, 4});  // balanced 11 over 4: 3,3,3,2
  CHECK(SplitRegularShards(t, 2, 4).hash != split.hash);

  // Rank 3 holds no unit of "small": it describes only "rows" and "cols", as the coordinator
  // (rank 0 here: rows 0..3, cols 0..3, small 0) expects of it, and declares "small", which
  // goes into its declared hash with its key path (3 units <= rank 3 may be a short tensor).
  SavePlan p0 = p, p3 = p;
  p0.items[0] = Shard("rows", {10, 4}, {0, 0}, {3, 4});
  p0.items[1] = Shard("cols", {4, 10}, {0, 0}, {4, 3});
  p0.items[4] = Shard("small", {3}, {0}, {1});
  p3.items[0] = Shard("rows", {10, 4}, {8, 0}, {2, 4});
  p3.items[1] = Shard("cols", {4, 10}, {0, 9}, {4, 1});
  p3.items.erase(p3.items.begin() + 4);
  p3.planner_data = EncodeSaveDeclaration("small", DType::kFloat32, {3}) + absent;
  const PlanSplit split0 = SplitRegularShards(p0, 0, 4);
  const PlanSplit split3 = SplitRegularShards(p3, 3, 4);
  REQUIRE(split3.regular.size() == 2);
  CHECK(split3.hash != split.hash);
  CHECK(split3.declared_hash != 0);
  CHECK(split3.residual.planner_data == absent);
  CHECK(split3.residual.key_paths.count("small") == 0);
  CHECK(split3.residual.key_paths.count("absent") == 0);  // no path was given for it
  // With declarations in full, "small" stays in the residual with its key path.
  const PlanSplit split3_full = SplitRegularShards(p3, 3, 4, /*hash_declarations=*/false);
  CHECK_FALSE(split3_full.declarations_hashed);
  CHECK(split3_full.residual.planner_data == p3.planner_data);
  CHECK(split3_full.residual.key_paths.count("small") == 1);

  auto compact = [](const PlanSplit& s) {
    CompactSavePlan c;
    c.hash = s.hash;
    c.declarations_hashed = s.declarations_hashed;
    c.declared_hash = s.declared_hash;
    for (const auto& reg : s.regular) c.rules.push_back(reg.rules);
    return c;
  };
  auto agree = [&](const std::vector<CompactSavePlan>& got) {
    return AgreeOnRegularShards(p0, split0, got);
  };
  const auto ok = agree({compact(split0), compact(other_rank), compact(split), compact(split3)});
  REQUIRE(ok.outcome == RegularAgreement::kAgreed);
  // "cols": rank 2 matches only ceil, so ceil is the common rule; "rows" and "small" balanced.
  REQUIRE(ok.rules.size() == 3);
  CHECK(ok.rules[0] == kRuleBalanced);
  CHECK(ok.rules[1] == kRuleCeil);
  CHECK(ok.rules[2] == kRuleBalanced);
  CHECK(
      agree({compact(split0), compact(other_rank), compact(split), compact(split3_full)}).outcome ==
      RegularAgreement::kAgreed);
  // Any rank that differs: rank 3 claiming "small" too, rank 2 missing it, a rule byte short,
  // a rank beyond the extent with a copy of a unit, a splitting rule no other rank shares.
  auto differ = [&](const std::vector<CompactSavePlan>& got) {
    return agree(got).outcome == RegularAgreement::kDiffer;
  };
  CHECK(differ({compact(split0), compact(other_rank), compact(split), compact(split)}));
  CHECK(differ({compact(split0), compact(other_rank), compact(split3), compact(split3)}));
  CompactSavePlan short_rules = compact(split);
  short_rules.rules.pop_back();
  CHECK(differ({compact(split0), compact(other_rank), short_rules, compact(split3)}));
  CompactSavePlan copy_of_small = compact(split3);
  copy_of_small.residual.items.push_back(p.items[4]);
  CHECK(differ({compact(split0), compact(other_rank), compact(split), copy_of_small}));
  CompactSavePlan balanced_only = compact(split);
  balanced_only.rules[1] = kRuleBalanced;  // rank 2's "cols" as if only balanced matched
  CHECK(differ({compact(split0), compact(other_rank), balanced_only, compact(split3)}));
  // Only the declarations differ: rank 3 does not declare "small", or declares another tensor
  // that may be short (2 units) but is no regular one: declare in full.
  SavePlan p3_quiet = p3, p3_more = p3;
  p3_quiet.planner_data = absent;
  p3_more.planner_data += EncodeSaveDeclaration("other", DType::kFloat32, {2, 100});
  for (const SavePlan* q : {&p3_quiet, &p3_more}) {
    CHECK(agree({compact(split0), compact(other_rank), compact(split),
                 compact(SplitRegularShards(*q, 3, 4))})
              .outcome == RegularAgreement::kDeclarationsDiffer);
  }
  // A malformed declaration is corruption, named as such.
  SavePlan garbled = p3;
  garbled.planner_data = "small\tfloat32\tx\n";
  CHECK_THROWS_AS(SplitRegularShards(garbled, 3, 4), CorruptionError);

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
// Layout::kIrregular, "layer.0.w" is split regularly on some ranks only; with kShortCopy, rank 3
// also holds a copy of rank 2's unit of "short" (a replicated chunk, deduplicated); with
// kLonely, rank 1 holds all of "lonely" (2 rows), which the others declare.
struct State {
  std::vector<TensorView> mine;  // what this rank saved, for checking
  StateDict sd;
};

enum class Layout { kRegular, kIrregular, kShortCopy, kLonely };

State MakeState(int rank, uint64_t seed, Layout layout = Layout::kRegular) {
  const bool irregular = layout == Layout::kIrregular;
  State s;
  auto shard_rows = [&](const std::string& fqn, Shape shape, int dim, RegularRule rule) {
    int holder = rank;
    if (fqn == "short" && layout == Layout::kShortCopy && rank == 3) holder = 2;
    auto [b, e] = RegularSlice(shape[static_cast<size_t>(dim)], holder, kRanks, rule);
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
                                  seed * 1000 + std::hash<std::string>()(fqn) % 997 + holder);
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
  if (layout == Layout::kLonely) {
    ShardedTensor st{DType::kFloat32, {2, 5}, {}};
    if (rank == 1) {
      s.mine.push_back(RandomTensor(DType::kFloat32, {2, 5}, seed + 55));
      st.local_shards.push_back({s.mine.back(), {0, 0}});
    }
    s.sd.Set("lonely", st);
  }
  s.mine.push_back(RandomTensor(DType::kInt64, {4}, seed + 77));
  s.sd.Set("replicated", s.mine.back());
  s.sd.Set("blob", Blob{"rank-independent bytes"});
  return s;
}

// Save at kRanks ranks (compactly unless `full`), check every rank's stats, load back and
// compare; return the metadata.
Metadata SaveLoad(const std::string& name, bool full, uint64_t seed, Layout layout,
                  bool expect_compact, int expect_rounds = 1) {
  ClearMemStore(name);
  const std::string uri = "mem://" + name;
  std::vector<State> states;
  for (int r = 0; r < kRanks; ++r) states.push_back(MakeState(r, seed, layout));
  std::vector<SaveStats> stats(kRanks);
  RequireNoErrors(RunRanks(kRanks, [&](int r, Communicator& comm) {
    std::unique_ptr<StorageWriter> w = OpenStorageWriter(uri);
    if (full) w = std::make_unique<FullPlanWriter>(std::move(w));
    stats[static_cast<size_t>(r)] = Save(states[static_cast<size_t>(r)].sd, *w, comm).stats;
  }));
  for (int r = 0; r < kRanks; ++r) {
    INFO("rank " << r);
    CHECK(stats[static_cast<size_t>(r)].compact_plan == expect_compact);
    CHECK((stats[static_cast<size_t>(r)].regular_items > 0) == expect_compact);
    CHECK(stats[static_cast<size_t>(r)].plan_rounds == expect_rounds);
  }
  std::vector<State> back;
  for (int r = 0; r < kRanks; ++r) back.push_back(MakeState(r, seed + 1, layout));
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
  for (auto& f : md.files) {
    if (auto pos = f.name.find(save); pos != std::string::npos)
      f.name.replace(pos, save.size(), "S");
  }
  // Version 2 records a regular tensor as its rule where full planning lists its chunks (with
  // the same writers: rank k wrote chunk k): compared as lists.
  for (auto& [fqn, entry] : md.entries) {
    if (auto* t = std::get_if<TensorMetadata>(&entry)) {
      if (t->regular) {
        for (size_t k = 0; k < ChunkCount(*t); ++k)
          t->chunk_writers.push_back(static_cast<int32_t>(k));
        const std::vector<int32_t> writers = t->chunk_writers;
        *t = WithListedChunks(*t);
        t->chunk_writers = writers;
      }
    }
  }
  return EncodeMetadata(md);
}

TEST_CASE("compact plan: the checkpoint equals the one full planning makes", "[compactplan]") {
  const Metadata compact =
      SaveLoad("compact-a", /*full=*/false, 1, Layout::kRegular, /*expect=*/true);
  const Metadata full = SaveLoad("compact-b", /*full=*/true, 1, Layout::kRegular, /*expect=*/false);
  CHECK(compact.entries.size() == full.entries.size());
  CHECK(compact.storage.size() == full.storage.size());
  CHECK(compact.files.size() == full.files.size());
  CHECK(Normalized(compact) == Normalized(full));
  ClearMemStore("compact-a");
  ClearMemStore("compact-b");
}

TEST_CASE("compact plan: ranks that split a tensor irregularly make every rank plan in full",
          "[compactplan]") {
  // Ranks 2 and 3 do not describe layer.0.w as regular: their hashes differ from rank 0's,
  // the coordinator answers "plan in full", and the save is still whole and exact.
  const Metadata md = SaveLoad("compact-c", /*full=*/false, 2, Layout::kIrregular,
                               /*expect=*/false, /*rounds=*/2);
  const auto& w = std::get<TensorMetadata>(md.entries.at("layer.0.w"));
  CHECK(w.chunks.size() == 4);
  ClearMemStore("compact-c");
}

TEST_CASE(
    "compact plan: a rank beyond a short tensor's extent that holds a copy of it makes "
    "every rank plan in full",
    "[compactplan]") {
  // "short" has 3 units over 4 ranks; rank 3, which the coordinator expects to hold none, holds
  // a copy of unit 2 (in its residual). The regular description would add "short" a second
  // time: the coordinator answers "plan in full", which deduplicates the copy.
  const Metadata md = SaveLoad("compact-e", /*full=*/false, 3, Layout::kShortCopy,
                               /*expect=*/false, /*rounds=*/2);
  const auto& t = std::get<TensorMetadata>(md.entries.at("short"));
  CHECK(t.chunks.size() == 3);
  const Metadata full = SaveLoad("compact-f", /*full=*/true, 3, Layout::kShortCopy,
                                 /*expect=*/false);
  CHECK(Normalized(md) == Normalized(full));
  ClearMemStore("compact-e");
  ClearMemStore("compact-f");
}

TEST_CASE(
    "compact plan: a declared tensor that is no short regular one is declared again in "
    "full, and the plan stays compact",
    "[compactplan]") {
  // Ranks 2 and 3 hold none of "lonely" (2 rows: it may be a short tensor) and hash its
  // declaration; rank 0 holds no such regular tensor, so it asks for declarations in full. The
  // second round is compact, and the checkpoint is the one full planning makes.
  const Metadata md = SaveLoad("compact-g", /*full=*/false, 4, Layout::kLonely,
                               /*expect=*/true, /*rounds=*/2);
  const Metadata full = SaveLoad("compact-h", /*full=*/true, 4, Layout::kLonely,
                                 /*expect=*/false);
  CHECK(std::get<TensorMetadata>(md.entries.at("lonely")).chunks.size() == 1);
  CHECK(Normalized(md) == Normalized(full));
  ClearMemStore("compact-g");
  ClearMemStore("compact-h");
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
      stats[static_cast<size_t>(r)] = Save(sds[static_cast<size_t>(r)], *w, comm, o).stats;
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
