// Flattening of nested state dicts and the default save and load planners, driven by hand for N
// simulated ranks (no communicator, no storage).
#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "dcp/planner/default_planner.h"
#include "dcp/planner/planner.h"
#include "dcp/proto/error.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::RowRange;

namespace {

using dcp::testing::MessageOf;

// Run the save planners of `sds.size()` simulated ranks: SetUp and CreateLocalPlan on each, then
// CreateGlobalPlan on rank 0's planner with every plan.
struct SaveRun {
  std::vector<SavePlan> local;
  std::vector<SavePlan> global;
  Metadata md;
};

SaveRun RunSave(const std::vector<StateDict>& sds) {
  const int n = static_cast<int>(sds.size());
  std::vector<DefaultSavePlanner> planners(n);
  SaveRun run;
  for (int r = 0; r < n; ++r) {
    planners[r].SetUp(sds[r], {r, n, r == 0});
    run.local.push_back(planners[r].CreateLocalPlan());
  }
  auto [plans, md] = planners[0].CreateGlobalPlan(run.local);
  run.global = std::move(plans);
  run.md = std::move(md);
  return run;
}

// A rank's state dict holding `rows` [begin, end) of a [rows_total, cols] float32 tensor as a
// sharded tensor under `fqn` (shards need memory only for their views).
ShardedTensor RowShard(const Shape& global, int64_t begin, int64_t end, uint64_t seed) {
  ShardedTensor st;
  st.dtype = DType::kFloat32;
  st.global_shape = global;
  if (end > begin) {
    Shape local = global;
    local[0] = end - begin;
    Shape offsets(global.size(), 0);
    offsets[0] = begin;
    st.local_shards.push_back({dcp::testing::RandomTensor(DType::kFloat32, local, seed), offsets});
  }
  return st;
}

ShardedTensor ColShard(const Shape& global, int64_t begin, int64_t end, uint64_t seed) {
  ShardedTensor st;
  st.dtype = DType::kFloat32;
  st.global_shape = global;
  st.local_shards.push_back(
      {dcp::testing::RandomTensor(DType::kFloat32, {global[0], end - begin}, seed), {0, begin}});
  return st;
}

std::set<std::pair<Shape, Shape>> ChunkSet(const std::vector<ChunkMeta>& chunks) {
  std::set<std::pair<Shape, Shape>> out;
  for (const auto& c : chunks) out.insert({c.offsets, c.sizes});
  return out;
}

const TensorMetadata& TensorEntry(const Metadata& md, const std::string& fqn) {
  auto it = md.entries.find(fqn);
  REQUIRE(it != md.entries.end());
  REQUIRE(std::holds_alternative<TensorMetadata>(it->second));
  return std::get<TensorMetadata>(it->second);
}

// Ranks whose final plan writes an item named `fqn`.
std::vector<int> Writers(const SaveRun& run, const std::string& fqn) {
  std::vector<int> out;
  for (size_t r = 0; r < run.global.size(); ++r) {
    for (const auto& item : run.global[r].items) {
      if (item.index.fqn == fqn) out.push_back(static_cast<int>(r));
    }
  }
  return out;
}

TensorView Filled(DType dtype, const Shape& shape, uint64_t seed = 1) {
  return dcp::testing::RandomTensor(dtype, shape, seed);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// FlattenStateDict

TEST_CASE("planner: FlattenStateDict gives dotted fqns and key paths", "[planner][flatten]") {
  StateDict sd;
  TensorView w = Filled(DType::kFloat32, {2, 2});
  sd.Nested("model").Nested("layer1").Set("weight", w);
  sd.Nested("model").Set("bias", Filled(DType::kFloat32, {2}));
  sd.Nested("optim").Nested("state");  // empty: vanishes
  sd.Set("step", Blob{"7"});
  sd.Set("a.b", Blob{"dotted key"});

  const auto flat = FlattenStateDict(static_cast<const StateDict&>(sd));
  std::vector<std::string> fqns;
  for (const auto& [fqn, e] : flat) fqns.push_back(fqn);
  CHECK(fqns == std::vector<std::string>{"a.b", "model.bias", "model.layer1.weight", "step"});
  CHECK(flat.at("model.layer1.weight").path == KeyPath{"model", "layer1", "weight"});
  CHECK(flat.at("model.bias").path == KeyPath{"model", "bias"});
  CHECK(flat.at("a.b").path == KeyPath{"a.b"});  // the path keeps the dot inside the key
  CHECK(flat.at("step").path == KeyPath{"step"});
  // Values point into the dict.
  const auto* tv = std::get_if<TensorView>(flat.at("model.layer1.weight").value);
  REQUIRE(tv != nullptr);
  CHECK(tv->data == w.data);
  CHECK(std::get<Blob>(*flat.at("step").value).bytes == "7");

  // The mutable overload points at the same entries and allows writing through them.
  auto mflat = FlattenStateDict(sd);
  REQUIRE(mflat.size() == 4);
  std::get<Blob>(*mflat.at("step").value).bytes = "8";
  CHECK(std::get<Blob>(*sd.Find("step")).bytes == "8");

  // InsertAtPath rebuilds the nesting.
  StateDict rebuilt;
  for (const auto& [fqn, e] : flat) InsertAtPath(rebuilt, e.path, *e.value);
  const auto again = FlattenStateDict(static_cast<const StateDict&>(rebuilt));
  REQUIRE(again.size() == 4);
  for (const auto& [fqn, e] : flat) CHECK(again.at(fqn).path == e.path);
  CHECK(rebuilt.Find("a.b") != nullptr);
  CHECK(rebuilt.Find("a") == nullptr);
}

TEST_CASE("planner: FlattenStateDict rejects colliding and empty keys", "[planner][flatten]") {
  SECTION("nested and dotted keys collide") {
    StateDict sd;
    sd.Nested("a").Set("b", Blob{"x"});
    sd.Set("a.b", Blob{"y"});
    const StateDict& csd = sd;
    const std::string msg = MessageOf<InvalidArgumentError>([&] { FlattenStateDict(csd); });
    CHECK_THAT(msg, Contains("'a.b'"));
    CHECK_THROWS_AS(FlattenStateDict(sd), InvalidArgumentError);
  }
  SECTION("deeper collision") {
    StateDict sd;
    sd.Nested("a").Set("b.c", Blob{"x"});
    sd.Nested("a.b").Set("c", Blob{"y"});
    CHECK_THAT(MessageOf<InvalidArgumentError>([&] { FlattenStateDict(sd); }), Contains("a.b.c"));
  }
  SECTION("empty key at the top") {
    StateDict sd;
    sd.Set("", Blob{"x"});
    CHECK_THROWS_AS(FlattenStateDict(sd), InvalidArgumentError);
  }
  SECTION("empty key in a nested dict names its parent") {
    StateDict sd;
    sd.Nested("model").Set("", Blob{"x"});
    CHECK_THAT(MessageOf<InvalidArgumentError>([&] { FlattenStateDict(sd); }), Contains("model"));
  }
  SECTION("null nested dict") {
    StateDict sd;
    sd.Set("m", std::shared_ptr<StateDict>());
    CHECK_THAT(MessageOf<InvalidArgumentError>([&] { FlattenStateDict(sd); }), Contains("'m'"));
  }
}

// ---------------------------------------------------------------------------------------------
// DefaultSavePlanner

TEST_CASE("planner: a replicated tensor is written by exactly one rank", "[planner][save]") {
  const TensorView w = Filled(DType::kFloat32, {3, 5});
  std::vector<StateDict> sds(4);
  for (auto& sd : sds) {
    sd.Nested("model").Set("w", w);
    sd.Set("rng", Blob{"state"});
  }
  const SaveRun run = RunSave(sds);
  for (const auto& plan : run.local) CHECK(plan.items.size() == 2);
  CHECK(Writers(run, "model.w").size() == 1);
  CHECK(Writers(run, "rng").size() == 1);

  const TensorMetadata t = TensorEntry(run.md, "model.w");
  CHECK(t.dtype == DType::kFloat32);
  CHECK(t.shape == Shape{3, 5});
  REQUIRE(t.chunks.size() == 1);
  CHECK(t.chunks[0] == ChunkMeta{{0, 0}, {3, 5}});
  REQUIRE(run.md.entries.count("rng") == 1);
  CHECK(std::holds_alternative<BytesMetadata>(run.md.entries.at("rng")));
  CHECK(run.md.key_paths.at("model.w") == KeyPath{"model", "w"});
  CHECK(run.md.key_paths.at("rng") == KeyPath{"rng"});

  // The kept item carries its chunk position as the index hint; the two go to different ranks
  // (the second replicated item goes to a rank with no load yet).
  const int w_rank = Writers(run, "model.w")[0];
  const int rng_rank = Writers(run, "rng")[0];
  CHECK(w_rank != rng_rank);
  const WriteItem& item = run.global[w_rank].items[0];
  CHECK(item.index.index == std::optional<int32_t>(0));
  CHECK(item.size_bytes == 60);
  CHECK(item.type == WriteItemType::kTensor);
}

TEST_CASE("planner: four equal replicated tensors go one to each rank", "[planner][save]") {
  std::vector<StateDict> sds(4);
  std::vector<TensorView> ts;
  for (int i = 0; i < 4; ++i) ts.push_back(Filled(DType::kInt32, {16}, i));
  for (auto& sd : sds) {
    for (int i = 0; i < 4; ++i) sd.Set("t" + std::to_string(i), ts[i]);
  }
  const SaveRun run = RunSave(sds);
  std::set<std::string> written;
  for (const auto& plan : run.global) {
    REQUIRE(plan.items.size() == 1);
    written.insert(plan.items[0].index.fqn);
  }
  CHECK(written.size() == 4);
  CHECK(run.md.entries.size() == 4);
}

TEST_CASE("planner: replicated tensors are balanced largest first", "[planner][save]") {
  // Names sort opposite to sizes, so processing in name order would give {a, c} and {b, d}.
  const std::map<std::string, int64_t> sizes = {{"a", 100}, {"b", 200}, {"c", 300}, {"d", 400}};
  std::vector<TensorView> ts;
  std::vector<StateDict> sds(2);
  for (const auto& [name, n] : sizes) {
    ts.push_back(Filled(DType::kUInt8, {n}));
    for (auto& sd : sds) sd.Set(name, ts.back());
  }
  const SaveRun run = RunSave(sds);
  std::vector<std::set<std::string>> per_rank(2);
  std::vector<uint64_t> bytes(2, 0);
  for (int r = 0; r < 2; ++r) {
    for (const auto& item : run.global[r].items) {
      per_rank[r].insert(item.index.fqn);
      bytes[r] += item.size_bytes;
    }
  }
  CHECK(per_rank[0] == std::set<std::string>{"a", "d"});
  CHECK(per_rank[1] == std::set<std::string>{"b", "c"});
  CHECK(bytes[0] == 500);
  CHECK(bytes[1] == 500);
}

TEST_CASE("planner: replicated items avoid a rank loaded with unique items", "[planner][save]") {
  std::vector<StateDict> sds(3);
  const TensorView shared = Filled(DType::kFloat32, {10});
  for (auto& sd : sds) sd.Set("shared", shared);
  sds[0].Set("big", Filled(DType::kFloat32, {1000}));
  sds[2].Set("small", Filled(DType::kFloat32, {1}));
  const SaveRun run = RunSave(sds);
  CHECK(Writers(run, "shared") == std::vector<int>{1});
  CHECK(Writers(run, "big") == std::vector<int>{0});
  CHECK(Writers(run, "small") == std::vector<int>{2});
}

TEST_CASE("planner: sharded layouts become one entry with every chunk", "[planner][save]") {
  std::vector<StateDict> sds(4);
  std::set<std::pair<Shape, Shape>> expected;
  Shape global;
  SECTION("rows") {
    global = {8, 6};
    for (int r = 0; r < 4; ++r) {
      sds[r].Nested("m").Set("w", RowShard(global, 2 * r, 2 * r + 2, r));
      expected.insert({Shape{2 * r, 0}, Shape{2, 6}});
    }
  }
  SECTION("columns") {
    global = {5, 8};
    for (int r = 0; r < 4; ++r) {
      sds[r].Nested("m").Set("w", ColShard(global, 2 * r, 2 * r + 2, r));
      expected.insert({Shape{0, 2 * r}, Shape{5, 2}});
    }
  }
  SECTION("uneven rows") {
    global = {10, 3};
    for (int r = 0; r < 4; ++r) {
      const auto [b, e] = RowRange(10, r, 4);
      sds[r].Nested("m").Set("w", RowShard(global, b, e, r));
      expected.insert({Shape{b, 0}, Shape{e - b, 3}});
    }
    CHECK(expected.count({{0, 0}, {3, 3}}) == 1);
    CHECK(expected.count({{8, 0}, {2, 3}}) == 1);
  }
  SECTION("2x2 blocks, two per rank on two ranks") {
    global = {4, 6};
    sds.resize(2);
    for (int r = 0; r < 2; ++r) {
      ShardedTensor st;
      st.global_shape = global;
      for (int c = 0; c < 2; ++c) {
        const Shape off = {2 * r, 3 * c};
        st.local_shards.push_back({Filled(DType::kFloat32, {2, 3}, r * 2 + c), off});
        expected.insert({off, Shape{2, 3}});
      }
      sds[r].Nested("m").Set("w", st);
    }
  }
  const SaveRun run = RunSave(sds);
  const TensorMetadata t = TensorEntry(run.md, "m.w");
  CHECK(t.dtype == DType::kFloat32);
  CHECK(t.shape == global);
  CHECK(ChunkSet(t.chunks) == expected);
  CHECK(t.chunks.size() == expected.size());
  // Nothing is deduplicated: each rank writes its own shards, and every item's index hint is
  // the position of its chunk in the entry.
  for (size_t r = 0; r < sds.size(); ++r) {
    CHECK(run.global[r].items.size() == run.local[r].items.size());
    for (const auto& item : run.global[r].items) {
      CHECK(item.type == WriteItemType::kShard);
      REQUIRE(item.index.index.has_value());
      REQUIRE(*item.index.index < static_cast<int32_t>(t.chunks.size()));
      CHECK(t.chunks[*item.index.index] == item.chunk);
      CHECK(item.index.offset == item.chunk.offsets);
      CHECK(item.size_bytes == static_cast<uint64_t>(item.chunk.numel()) * 4);
    }
  }
  CHECK(run.md.key_paths.at("m.w") == KeyPath{"m", "w"});
}

TEST_CASE("planner: a rank with no shards still yields the entry", "[planner][save]") {
  SECTION("other ranks hold every chunk") {
    std::vector<StateDict> sds(3);
    const Shape global = {6, 2};
    sds[0].Set("w", RowShard(global, 0, 4, 0));
    sds[1].Set("w", RowShard(global, 4, 6, 1));
    sds[2].Set("w", RowShard(global, 0, 0, 2));  // declares, holds nothing
    const SaveRun run = RunSave(sds);
    CHECK(run.local[2].items.empty());
    const TensorMetadata t = TensorEntry(run.md, "w");
    CHECK(t.shape == global);
    CHECK(t.chunks.size() == 2);
    CHECK(run.md.key_paths.at("w") == KeyPath{"w"});
    for (const auto& plan : run.global) CHECK(plan.planner_data.empty());
  }
  SECTION("nobody holds a zero-size tensor") {
    std::vector<StateDict> sds(2);
    for (auto& sd : sds) sd.Nested("opt").Set("empty", RowShard({0, 4}, 0, 0, 0));
    const SaveRun run = RunSave(sds);
    const TensorMetadata t = TensorEntry(run.md, "opt.empty");
    CHECK(t.shape == Shape{0, 4});
    CHECK(t.chunks.empty());
    CHECK(run.md.key_paths.at("opt.empty") == KeyPath{"opt", "empty"});
  }
  SECTION("nobody holds a tensor that has elements") {
    std::vector<StateDict> sds(2);
    for (auto& sd : sds) sd.Set("lost", RowShard({3, 4}, 0, 0, 0));
    const std::string msg = MessageOf<InvalidArgumentError>([&] { RunSave(sds); });
    CHECK_THAT(msg, Contains("'lost'"));
  }
  SECTION("the declaring rank disagrees on the dtype") {
    std::vector<StateDict> sds(2);
    sds[0].Set("w", RowShard({4, 2}, 0, 4, 0));
    ShardedTensor none = RowShard({4, 2}, 0, 0, 0);
    none.dtype = DType::kFloat16;
    sds[1].Set("w", none);
    const std::string msg = MessageOf<InvalidArgumentError>([&] { RunSave(sds); });
    CHECK_THAT(msg, Contains("'w'"));
    CHECK_THAT(msg, Contains("float16"));
    CHECK_THAT(msg, Contains("float32"));
  }
}

TEST_CASE("planner: inconsistent shards across ranks are errors naming the fqn",
          "[planner][save]") {
  std::vector<StateDict> sds(2);
  const Shape global = {8, 4};
  std::vector<std::string> needles;
  SECTION("overlapping shards") {
    sds[0].Nested("layer").Set("w", RowShard(global, 0, 5, 0));
    sds[1].Nested("layer").Set("w", RowShard(global, 4, 8, 1));
    needles = {"overlap", "rank 0", "rank 1"};
  }
  SECTION("a gap") {
    sds[0].Nested("layer").Set("w", RowShard(global, 0, 3, 0));
    sds[1].Nested("layer").Set("w", RowShard(global, 4, 8, 1));
    needles = {"cover"};
  }
  SECTION("a shard outside the global shape") {
    sds[0].Nested("layer").Set("w", RowShard(global, 0, 4, 0));
    ShardedTensor st = RowShard(global, 4, 8, 1);
    st.local_shards[0].offsets = {5, 0};  // rows 5..9 of 8
    sds[1].Nested("layer").Set("w", st);
    needles = {"outside"};
  }
  SECTION("dtypes disagree") {
    sds[0].Nested("layer").Set("w", RowShard(global, 0, 4, 0));
    ShardedTensor st;
    st.dtype = DType::kFloat64;
    st.global_shape = global;
    st.local_shards.push_back({Filled(DType::kFloat64, {4, 4}), {4, 0}});
    sds[1].Nested("layer").Set("w", st);
    needles = {"float32", "float64"};
  }
  SECTION("global shapes disagree") {
    sds[0].Nested("layer").Set("w", RowShard(global, 0, 4, 0));
    sds[1].Nested("layer").Set("w", RowShard({9, 4}, 4, 9, 1));
    needles = {"[8, 4]", "[9, 4]"};
  }
  SECTION("a tensor on one rank, a blob on another") {
    sds[0].Nested("layer").Set("w", Filled(DType::kFloat32, global));
    sds[1].Nested("layer").Set("w", Blob{"not a tensor"});
    needles = {"blob"};
  }
  SECTION("a replicated tensor whose shape differs between ranks") {
    sds[0].Nested("layer").Set("w", Filled(DType::kFloat32, {8, 4}));
    sds[1].Nested("layer").Set("w", Filled(DType::kFloat32, {8, 3}));
    needles = {"[8, 4]", "[8, 3]"};
  }
  const std::string msg = MessageOf<InvalidArgumentError>([&] { RunSave(sds); });
  CHECK_THAT(msg, Contains("'layer.w'"));
  for (const auto& n : needles) CHECK_THAT(msg, Contains(n));
}

TEST_CASE("planner: local plan errors", "[planner][save]") {
  StateDict sd;
  DefaultSavePlanner planner;
  SECTION("a shard whose dtype is not the tensor's") {
    ShardedTensor st = RowShard({4, 4}, 0, 4, 0);
    st.dtype = DType::kInt32;
    sd.Set("w", st);
  }
  SECTION("two local shards at the same offsets") {
    ShardedTensor st = RowShard({4, 4}, 0, 2, 0);
    st.local_shards.push_back(st.local_shards[0]);
    sd.Set("w", st);
  }
  SECTION("a shard of the wrong rank") {
    ShardedTensor st = RowShard({4, 4}, 0, 4, 0);
    st.local_shards[0].offsets = {0};
    sd.Set("w", st);
  }
  planner.SetUp(sd, {0, 1, true});
  CHECK_THAT(MessageOf<InvalidArgumentError>([&] { planner.CreateLocalPlan(); }), Contains("'w'"));
}

TEST_CASE("planner: ResolveData returns the local data", "[planner][save]") {
  StateDict sd;
  const TensorView t = Filled(DType::kInt16, {3});
  const ShardedTensor st = RowShard({4, 2}, 2, 4, 5);
  sd.Set("t", t).Set("s", st).Set("b", Blob{"bytes!"});
  DefaultSavePlanner planner;
  planner.SetUp(sd, {0, 1, true});
  const SavePlan plan = planner.CreateLocalPlan();
  REQUIRE(plan.items.size() == 3);
  for (const auto& item : plan.items) {
    const ResolvedData data = planner.ResolveData(item);
    if (item.index.fqn == "t") CHECK(data.tensor.data == t.data);
    if (item.index.fqn == "s") CHECK(data.tensor.data == st.local_shards[0].view.data);
    if (item.index.fqn == "b") CHECK(data.bytes == "bytes!");
  }
  WriteItem bogus = plan.items[0];
  bogus.index.fqn = "nope";
  CHECK_THROWS_AS(planner.ResolveData(bogus), InternalError);
}

// ---------------------------------------------------------------------------------------------
// ValidateChunks

TEST_CASE("planner: ValidateChunks", "[planner][chunks]") {
  auto pc = [](Shape o, Shape s, int rank = -1) {
    return PlacedChunk{{std::move(o), std::move(s)}, rank};
  };
  SECTION("0-d tensors") {
    CHECK_NOTHROW(ValidateChunks("s", {}, {pc({}, {})}));
    CHECK_THAT(MessageOf<InvalidArgumentError>([&] { ValidateChunks("s", {}, {}); }),
               Contains("'s'"));
    CHECK_THAT(MessageOf<InvalidArgumentError>([&] {
                 ValidateChunks("s", {}, {pc({}, {}), pc({}, {})});
               }),
               Contains("overlap"));
    CHECK_THROWS_AS(ValidateChunks("s", {}, {pc({0}, {1})}), InvalidArgumentError);
  }
  SECTION("zero-size tensors") {
    CHECK_NOTHROW(ValidateChunks("z", {0, 4}, {}));
    CHECK_NOTHROW(ValidateChunks("z", {0, 4}, {pc({0, 0}, {0, 4})}));
    CHECK_NOTHROW(ValidateChunks("z", {0, 4}, {pc({0, 0}, {0, 4}), pc({0, 0}, {0, 2})}));
    CHECK_THROWS_AS(ValidateChunks("z", {0, 4}, {pc({0, 1}, {0, 4})}), InvalidArgumentError);
    CHECK_THROWS_AS(ValidateChunks("z", {0, 4}, {pc({1, 0}, {0, 4})}), InvalidArgumentError);
    // A zero-size chunk inside a tensor that has elements is harmless.
    CHECK_NOTHROW(ValidateChunks("z", {2, 2}, {pc({0, 0}, {2, 2}), pc({1, 1}, {0, 1})}));
  }
  SECTION("exact tilings") {
    CHECK_NOTHROW(ValidateChunks(
        "t", {4, 4},
        {pc({2, 2}, {2, 2}), pc({0, 0}, {2, 2}), pc({0, 2}, {2, 2}), pc({2, 0}, {2, 2})}));
    CHECK_NOTHROW(ValidateChunks("t", {5, 3}, {pc({0, 0}, {5, 1}), pc({0, 1}, {5, 2})}));
    // An L-shaped tiling: a long chunk beside two short ones.
    CHECK_NOTHROW(
        ValidateChunks("t", {4, 2}, {pc({0, 0}, {4, 1}), pc({0, 1}, {1, 1}), pc({1, 1}, {3, 1})}));
  }
  SECTION("overlaps whose sizes add up to the volume") {
    // Rows [0, 2) and [1, 3) of 4: 16 elements as the tensor has, yet overlapping.
    const std::string msg = MessageOf<InvalidArgumentError>([&] {
      ValidateChunks("t", {4, 4}, {pc({0, 0}, {2, 4}, 0), pc({1, 0}, {2, 4}, 1)});
    });
    CHECK_THAT(msg, Contains("'t'"));
    CHECK_THAT(msg, Contains("overlap"));
    CHECK_THAT(msg, Contains("rank 0"));
    CHECK_THAT(msg, Contains("rank 1"));
  }
  SECTION("an overlap with a chunk that is not the previous one") {
    // Chunk A spans rows 0..3 of column 0; B sits between; C overlaps A only.
    CHECK_THROWS_WITH(ValidateChunks("t", {4, 2},
                                     {pc({0, 0}, {4, 1}), pc({1, 1}, {1, 1}), pc({2, 0}, {1, 1}),
                                      pc({0, 1}, {1, 1})}),
                      Contains("overlap"));
  }
  SECTION("column overlaps are found too") {
    CHECK_THROWS_WITH(ValidateChunks("t", {2, 6},
                                     {pc({0, 0}, {2, 2}), pc({0, 2}, {2, 2}), pc({0, 3}, {2, 2}),
                                      pc({0, 4}, {2, 2})}),
                      Contains("overlap"));
  }
  SECTION("out of bounds and rank mismatch") {
    CHECK_THROWS_WITH(ValidateChunks("t", {4}, {pc({2}, {3})}), Contains("outside"));
    CHECK_THROWS_WITH(ValidateChunks("t", {4}, {pc({-1}, {1}), pc({0}, {4})}), Contains("outside"));
    CHECK_THROWS_AS(ValidateChunks("t", {4}, {pc({0, 0}, {4, 1})}), InvalidArgumentError);
  }
  SECTION("a gap") {
    CHECK_THROWS_WITH(ValidateChunks("t", {4, 4}, {pc({0, 0}, {2, 4}), pc({3, 0}, {1, 4})}),
                      Contains("cover 12 of 16"));
  }
}

// ---------------------------------------------------------------------------------------------
// DefaultLoadPlanner

namespace {

// Metadata of an [8, 6] float32 tensor "m.w" saved as 4 row shards, a plain [3] int64 tensor
// "step" and a blob "rng", built by the save planner.
Metadata SavedMetadata() {
  std::vector<StateDict> sds(4);
  const TensorView step = Filled(DType::kInt64, {3});
  for (int r = 0; r < 4; ++r) {
    sds[r].Nested("m").Set("w", RowShard({8, 6}, 2 * r, 2 * r + 2, r));
    sds[r].Set("step", step);
    sds[r].Set("rng", Blob{"rng"});
  }
  return RunSave(sds).md;
}

LoadPlan LocalLoadPlan(StateDict& sd, const Metadata& md, LoadPlannerOptions options = {}) {
  DefaultLoadPlanner planner(options);
  planner.SetUp(sd, md, {0, 1, true});
  return planner.CreateLocalPlan();
}

}  // namespace

TEST_CASE("planner: load plans reshard row shards into column shards", "[planner][load]") {
  const Metadata md = SavedMetadata();
  const TensorMetadata saved = TensorEntry(md, "m.w");
  for (int64_t col : {0, 3}) {
    INFO("column shard at " << col);
    StateDict sd;
    ShardedTensor st;
    st.global_shape = {8, 6};
    st.local_shards.push_back({TensorView::Allocate(DType::kFloat32, {8, 3}), {0, col}});
    sd.Nested("m").Set("w", st);
    const LoadPlan plan = LocalLoadPlan(sd, md);
    REQUIRE(plan.items.size() == 4);
    int64_t total = 0;
    std::vector<int> hits(8 * 3, 0);  // how often each local element is written
    for (const auto& item : plan.items) {
      CHECK(item.type == ReadItemType::kTensor);
      CHECK(item.dest_index.fqn == "m.w");
      CHECK(item.dest_index.offset == Shape{0, col});
      CHECK(item.storage_index.fqn == "m.w");
      REQUIRE(item.storage_index.index.has_value());
      const ChunkMeta& src = saved.chunks.at(*item.storage_index.index);
      CHECK(src.offsets == item.storage_index.offset);
      CHECK(item.lengths == Shape{2, 3});
      CHECK(item.storage_offsets == Shape{0, col});
      CHECK(item.dest_offsets == Shape{src.offsets[0], 0});
      total += NumElements(item.lengths);
      for (int64_t i = 0; i < item.lengths[0]; ++i) {
        for (int64_t j = 0; j < item.lengths[1]; ++j) {
          ++hits[(item.dest_offsets[0] + i) * 3 + item.dest_offsets[1] + j];
        }
      }
    }
    CHECK(total == 8 * 3);
    CHECK(std::all_of(hits.begin(), hits.end(), [](int h) { return h == 1; }));
  }
}

TEST_CASE("planner: load plans for uneven and whole-tensor destinations", "[planner][load]") {
  const Metadata md = SavedMetadata();
  StateDict sd;
  // Rows [3, 8) of the tensor: partial overlaps with the shards at rows 2, 4 and 6.
  ShardedTensor st;
  st.global_shape = {8, 6};
  st.local_shards.push_back({TensorView::Allocate(DType::kFloat32, {5, 6}), {3, 0}});
  sd.Nested("m").Set("w", st);
  sd.Set("step", TensorView::Allocate(DType::kInt64, {3}));
  sd.Set("rng", Blob{});
  const LoadPlan plan = LocalLoadPlan(sd, md);
  std::map<Shape, const ReadItem*> by_storage;
  int blobs = 0;
  for (const auto& item : plan.items) {
    if (item.type == ReadItemType::kBytes) {
      ++blobs;
      CHECK(item.dest_index.fqn == "rng");
      CHECK(item.storage_index.fqn == "rng");
      continue;
    }
    if (item.dest_index.fqn == "m.w") by_storage[item.storage_index.offset] = &item;
    if (item.dest_index.fqn == "step") {
      CHECK(item.lengths == Shape{3});
      CHECK(item.dest_offsets == Shape{0});
      CHECK(item.storage_offsets == Shape{0});
    }
  }
  CHECK(blobs == 1);
  REQUIRE(by_storage.size() == 3);
  const ReadItem* a = by_storage.at({2, 0});
  CHECK(a->storage_offsets == Shape{1, 0});
  CHECK(a->dest_offsets == Shape{0, 0});
  CHECK(a->lengths == Shape{1, 6});
  const ReadItem* b = by_storage.at({4, 0});
  CHECK(b->storage_offsets == Shape{0, 0});
  CHECK(b->dest_offsets == Shape{1, 0});
  CHECK(b->lengths == Shape{2, 6});
  const ReadItem* c = by_storage.at({6, 0});
  CHECK(c->dest_offsets == Shape{3, 0});
  CHECK(c->lengths == Shape{2, 6});
}

TEST_CASE("planner: load plan errors", "[planner][load]") {
  const Metadata md = SavedMetadata();
  StateDict sd;
  sd.Set("rng", Blob{});
  SECTION("a missing key is NotFoundError naming it") {
    sd.Nested("model").Set("missing", TensorView::Allocate(DType::kFloat32, {2}));
    const std::string msg = MessageOf<NotFoundError>([&] { LocalLoadPlan(sd, md); });
    CHECK_THAT(msg, Contains("'model.missing'"));
    CHECK_THAT(msg, Contains("allow_partial_load"));
  }
  SECTION("allow_partial_load skips missing keys") {
    sd.Nested("model").Set("missing", TensorView::Allocate(DType::kFloat32, {2}));
    sd.Set("step", TensorView::Allocate(DType::kInt64, {3}));
    const LoadPlan plan = LocalLoadPlan(sd, md, {true});
    REQUIRE(plan.items.size() == 2);
    for (const auto& item : plan.items) CHECK(item.dest_index.fqn != "model.missing");
  }
  SECTION("dtype mismatch names both sides") {
    sd.Set("step", TensorView::Allocate(DType::kInt32, {3}));
    const std::string msg = MessageOf<InvalidArgumentError>([&] { LocalLoadPlan(sd, md); });
    CHECK_THAT(msg, Contains("'step'"));
    CHECK_THAT(msg, Contains("int64[3]"));
    CHECK_THAT(msg, Contains("int32[3]"));
  }
  SECTION("global shape mismatch names both sides") {
    ShardedTensor st;
    st.global_shape = {8, 5};
    st.local_shards.push_back({TensorView::Allocate(DType::kFloat32, {8, 5}), {0, 0}});
    sd.Nested("m").Set("w", st);
    const std::string msg = MessageOf<InvalidArgumentError>([&] { LocalLoadPlan(sd, md); });
    CHECK_THAT(msg, Contains("'m.w'"));
    CHECK_THAT(msg, Contains("[8, 6]"));
    CHECK_THAT(msg, Contains("[8, 5]"));
  }
  SECTION("a blob where the checkpoint has a tensor") {
    sd.Set("step", Blob{});
    const std::string msg = MessageOf<InvalidArgumentError>([&] { LocalLoadPlan(sd, md); });
    CHECK_THAT(msg, Contains("'step'"));
    CHECK_THAT(msg, Contains("blob"));
  }
  SECTION("a tensor where the checkpoint has a blob") {
    sd.Set("rng", TensorView::Allocate(DType::kUInt8, {3}));
    const std::string msg = MessageOf<InvalidArgumentError>([&] { LocalLoadPlan(sd, md); });
    CHECK_THAT(msg, Contains("'rng'"));
    CHECK_THAT(msg, Contains("blob"));
  }
  SECTION("a local shard outside the global shape") {
    ShardedTensor st;
    st.global_shape = {8, 6};
    st.local_shards.push_back({TensorView::Allocate(DType::kFloat32, {8, 3}), {0, 4}});
    sd.Nested("m").Set("w", st);
    CHECK_THAT(MessageOf<InvalidArgumentError>([&] { LocalLoadPlan(sd, md); }), Contains("'m.w'"));
  }
  SECTION("two local shards at the same offsets") {
    ShardedTensor st;
    st.global_shape = {8, 6};
    st.local_shards.push_back({TensorView::Allocate(DType::kFloat32, {8, 3}), {0, 0}});
    st.local_shards.push_back({TensorView::Allocate(DType::kFloat32, {8, 3}), {0, 0}});
    sd.Nested("m").Set("w", st);
    CHECK_THAT(MessageOf<InvalidArgumentError>([&] { LocalLoadPlan(sd, md); }), Contains("'m.w'"));
  }
  SECTION("a local shard whose dtype is not the tensor's") {
    ShardedTensor st;
    st.global_shape = {8, 6};
    st.local_shards.push_back({TensorView::Allocate(DType::kFloat64, {8, 6}), {0, 0}});
    sd.Nested("m").Set("w", st);
    CHECK_THAT(MessageOf<InvalidArgumentError>([&] { LocalLoadPlan(sd, md); }), Contains("'m.w'"));
  }
}

TEST_CASE("planner: ResolveTensor returns a narrowed view at the right address",
          "[planner][load]") {
  const Metadata md = SavedMetadata();
  StateDict sd;
  ShardedTensor st;
  st.global_shape = {8, 6};
  const TensorView shard = TensorView::Allocate(DType::kFloat32, {8, 3});
  st.local_shards.push_back({shard, {0, 3}});
  sd.Nested("m").Set("w", st);
  const TensorView step = TensorView::Allocate(DType::kInt64, {3});
  sd.Set("step", step);
  sd.Set("rng", Blob{"old"});

  DefaultLoadPlanner planner;
  planner.SetUp(sd, md, {0, 1, true});
  const LoadPlan plan =
      planner.FinishPlan(planner.CreateGlobalPlan({planner.CreateLocalPlan()})[0]);
  int tensors = 0;
  for (const auto& item : plan.items) {
    if (item.type == ReadItemType::kBytes) {
      planner.LoadBytes(item, "new bytes");
      continue;
    }
    const TensorView v = planner.ResolveTensor(item);
    CHECK(v.shape == item.lengths);
    CHECK(v.dtype == (item.dest_index.fqn == "step" ? DType::kInt64 : DType::kFloat32));
    if (item.dest_index.fqn == "m.w") {
      ++tensors;
      const int64_t row = item.dest_offsets[0];
      CHECK(item.dest_offsets[1] == 0);
      CHECK(v.data == static_cast<float*>(shard.data) + row * 3);
      CHECK(v.effective_strides() == Shape{3, 1});
      // Fill the box the way storage would: value = global row * 10 + global column.
      TensorView src = TensorView::Allocate(DType::kFloat32, item.lengths);
      auto* s = static_cast<float*>(src.data);
      for (int64_t i = 0; i < item.lengths[0]; ++i) {
        for (int64_t j = 0; j < item.lengths[1]; ++j) {
          s[i * item.lengths[1] + j] = static_cast<float>((row + i) * 10 + 3 + j);
        }
      }
      CopyTensor(v, src);
      planner.CommitTensor(item, v);
    } else {
      CHECK(v.data == step.data);
    }
  }
  CHECK(tensors == 4);
  const auto* out = static_cast<const float*>(shard.data);
  for (int64_t i = 0; i < 8; ++i) {
    for (int64_t j = 0; j < 3; ++j) CHECK(out[i * 3 + j] == static_cast<float>(i * 10 + 3 + j));
  }
  CHECK(std::get<Blob>(*sd.Find("rng")).bytes == "new bytes");

  ReadItem bogus = plan.items[0];
  bogus.dest_index.fqn = "nope";
  CHECK_THROWS_AS(planner.ResolveTensor(bogus), InternalError);
}

TEST_CASE("planner: an empty shard at another rank's offset is a legal layout",
          "[planner][empty]") {
  // 1-D [1000] saved 5-way as 1, 0, 499, 250, 250: rank 1's empty shard starts at offset 1,
  // where rank 2's non-empty one does.
  const int64_t sizes[] = {1, 0, 499, 250, 250};
  std::vector<StateDict> sds(5);
  int64_t at = 0;
  for (int r = 0; r < 5; ++r) {
    ShardedTensor st;
    st.dtype = DType::kFloat32;
    st.global_shape = {1000};
    st.local_shards.push_back(
        {dcp::testing::RandomTensor(DType::kFloat32, {sizes[r]}, 100 + r), {at}});
    sds[r].Set("w", st);
    at += sizes[r];
  }
  SaveRun run;
  REQUIRE_NOTHROW(run = RunSave(sds));
  CHECK(
      ChunkSet(TensorEntry(run.md, "w").chunks) ==
      std::set<std::pair<Shape, Shape>>{{{0}, {1}}, {{1}, {499}}, {{500}, {250}}, {{750}, {250}}});
  CHECK(run.global[1].items.empty());  // nothing to write for the empty shard
  // Still checked: an empty shard of the wrong dtype or global shape is refused.
  ShardedTensor bad;
  bad.dtype = DType::kFloat64;
  bad.global_shape = {1000};
  bad.local_shards.push_back({dcp::testing::RandomTensor(DType::kFloat64, {0}, 1), {1}});
  sds[1].Set("w", bad);
  CHECK_THROWS_WITH(RunSave(sds), Contains("'w'"));
}
