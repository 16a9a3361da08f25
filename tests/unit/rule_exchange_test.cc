// Rule exchange on load (planner/rule_reads.h, dcp/protocol/rule_exchange.h): which reads take
// part, the piece arithmetic both sides share (every element of every rank's slice comes from
// exactly one chunk, in place), and whole loads with N ranks as threads: reshards between two
// rules of 2- and 3-dimensional tensors, dtype casts, a damaged chunk and an owner that fails.
#include <catch2/catch.hpp>
#include <map>
#include <random>

#include "dcp/planner/rule_reads.h"
#include "dcp/proto/dtype_cast.h"
#include "dcp/storage/backends/fault_store.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/layout.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::Clone;
using dcp::testing::RandomTensor;
using dcp::testing::RequireNoErrors;
using dcp::testing::RowRange;
using dcp::testing::RunRanks;
using dcp::testing::SameElements;

namespace {

// A version-2 metadata of one float32 tensor "m" of `shape` stored under `saved`.
Metadata OneTensor(const Shape& shape, RegularLayout saved) {
  Metadata md;
  md.format_version = 2;
  md.world_size = saved.world;
  TensorMetadata t(DType::kFloat32, shape);
  t.regular = saved;
  md.entries["m"] = t;
  return md;
}

// Rank `rank`'s read of its slice [lo, hi) along `d` of "m", as the default planner lists it: one
// span over the stored chunks the box meets.
ReadItem SliceRead(const Metadata& md, size_t d, int64_t lo, int64_t hi,
                   const std::string& fqn = "m") {
  const auto& t = std::get<TensorMetadata>(md.entries.at(fqn));
  const size_t ds = static_cast<size_t>(t.regular->dim);
  Shape box_lo(t.shape.size(), 0), len = t.shape;
  box_lo[d] = lo;
  len[d] = hi - lo;
  const auto [c0, c1] = RegularChunkRange(t, box_lo[ds], box_lo[ds] + len[ds]);
  ReadItem item;
  item.dest_index = {fqn, box_lo, std::nullopt};
  item.dest_offsets = Shape(t.shape.size(), 0);
  item.storage_index = {fqn, ChunkAt(t, c0).offsets, static_cast<int32_t>(c0)};
  item.storage_offsets = box_lo;
  item.storage_offsets[ds] -= ChunkAt(t, c0).offsets[ds];
  item.lengths = len;
  item.chunk_span = static_cast<uint32_t>(c1 - c0);
  return item;
}

}  // namespace

TEST_CASE(
    "rule reads: a reshard between two rules takes part and a resume or a row reshard does not",
    "[rule-exchange]") {
  const Metadata md = OneTensor({8, 6}, {0, kRuleBalanced, 4});
  auto table = [&](size_t d, int rank, int world, uint64_t round = 1 << 20) {
    const auto& t = std::get<TensorMetadata>(md.entries.at("m"));
    const auto [lo, hi] = RowRange(t.shape[d], rank, world);
    LoadPlan plan;
    plan.items.push_back(SliceRead(md, d, lo, hi));
    return FindRuleReads(plan, md, rank, world, round);
  };
  // Columns at 2 ranks: both ranks find the same one-read table.
  const RuleReadTable c0 = table(1, 0, 2), c1 = table(1, 1, 2);
  REQUIRE(c0.reads.size() == 1);
  CHECK(c0.reads[0].load == RegularLayout{1, kRuleBalanced, 2});
  CHECK(c0.reads[0].cross_elems == 1);
  CHECK(c0.hash != 0);
  CHECK(c0.hash == c1.hash);
  // The same layout (resume) and rows at 2 ranks (each chunk read as one range) do not.
  CHECK(table(0, 1, 4).reads.empty());
  CHECK(table(0, 1, 2).reads.empty());
  // Nor a world whose slices would be empty on some rank, nor one chunk over the round.
  CHECK(table(1, 0, 8).reads.empty());
  // (Each owner of 2 reads 2 of the 4 saved chunks: half the tensor.)
  CHECK(table(1, 0, 2, 8 * 6 * 4 / 2 - 1).reads.empty());
  CHECK_FALSE(table(1, 0, 2, 8 * 6 * 4 / 2).reads.empty());
  // Another world: another hash.
  CHECK(table(1, 0, 3).hash != c0.hash);
  // Along the stored dimension with more than one unit before it: not one range per chunk.
  const Metadata deep = OneTensor({4, 8, 2}, {1, kRuleBalanced, 4});
  LoadPlan plan;
  plan.items.push_back(SliceRead(deep, 1, 0, 4));
  CHECK(FindRuleReads(plan, deep, 0, 2, 1 << 20).reads.size() == 1);
  CHECK(FindRuleReads(plan, OneTensor({4, 8, 2}, {1, kRuleBalanced, 4}), 0, 1, 1 << 20)
            .reads.empty());  // one rank: nothing to exchange
}

TEST_CASE("rule reads: every element of every slice comes from exactly one chunk in place",
          "[rule-exchange]") {
  std::mt19937 rng(7);
  auto pick = [&](int64_t a, int64_t b) {
    return std::uniform_int_distribution<int64_t>(a, b)(rng);
  };
  for (int trial = 0; trial < 300; ++trial) {
    const size_t dims = static_cast<size_t>(pick(1, 4));
    Shape shape(dims);
    for (auto& v : shape) v = pick(dims == 4 ? 2 : 3, dims == 4 ? 6 : 9);
    const auto ds = static_cast<size_t>(pick(0, static_cast<int64_t>(dims) - 1));
    const auto dl = static_cast<size_t>(pick(0, static_cast<int64_t>(dims) - 1));
    const int saved_world = static_cast<int>(pick(1, std::min<int64_t>(shape[ds], 5)));
    const int world = static_cast<int>(pick(2, std::min<int64_t>(shape[dl], 5)));
    const RegularRule rule_s = pick(0, 1) ? kRuleBalanced : kRuleCeil;
    const RegularRule rule_l = pick(0, 1) ? kRuleBalanced : kRuleCeil;
    const RegularLayout saved{static_cast<int32_t>(ds), rule_s, saved_world};
    const RegularLayout load{static_cast<int32_t>(dl), rule_l, world};
    // Rules whose slices are not all non-empty are never a layout (compact_plan.h).
    bool holds = true;
    for (const auto& [lay, n] : {std::pair{saved, shape[ds]}, std::pair{load, shape[dl]}}) {
      for (int r = 0; r < lay.world; ++r) {
        const auto [a, b] = RegularSlice(n, r, lay.world, lay.rule);
        holds = holds && a < b;
      }
    }
    if (!holds) continue;
    INFO("trial " << trial << ": shape " << ShapeToString(shape) << ", stored along " << ds
                  << " at " << saved_world << ", loaded along " << dl << " at " << world);
    const Metadata md = OneTensor(shape, saved);
    const auto& t = std::get<TensorMetadata>(md.entries.at("m"));
    const RuleRead read = MakeRuleRead(0, 0, md.entries.begin()->first, t, load);
    const RuleOwnerMap owners(saved_world, world);
    const TensorView full = RandomTensor(DType::kFloat32, shape, 100 + trial);
    // Each chunk as stored, contiguous.
    std::vector<TensorView> chunks;
    for (size_t k = 0; k < ChunkCount(t); ++k) {
      const ChunkMeta c = ChunkAt(t, k);
      chunks.push_back(Clone(full.Narrow(c.offsets, c.sizes)));
    }
    uint64_t all_pieces = 0;
    for (int f = 0; f < world; ++f) {
      Shape lo(dims, 0), len = shape;
      std::tie(lo[dl], len[dl]) = RegularSlice(shape[dl], f, world, rule_l);
      len[dl] -= lo[dl];
      TensorView slice = TensorView::Allocate(DType::kFloat32, len);
      uint64_t bytes = 0;
      for (int o = 0; o < world; ++o) {
        ForEachRulePiece(read, owners, o, f, [&](const RulePiece& p) {
          std::string packed(p.bytes, '\0');
          CopyRulePiece(read, p, static_cast<char*>(chunks[p.w].data), true, packed.data(), true);
          CopyRulePiece(read, p, static_cast<char*>(slice.data), false, packed.data(), false);
          bytes += p.bytes;
        });
      }
      CHECK(bytes == slice.nbytes());
      CHECK(SameElements(slice, full.Narrow(lo, len)));
    }
    for (int o = 0; o < world; ++o) {
      ForEachRulePiece(read, owners, o, -1, [&](const RulePiece& p) { all_pieces += p.bytes; });
    }
    CHECK(all_pieces == full.nbytes());
  }
}

namespace {

constexpr int kSaved = 4;
const std::map<std::string, Shape>& Shapes() {
  // A matrix, a 3-dimensional tensor cut along its middle dimension, a vector (rows as saved).
  static const std::map<std::string, Shape> shapes = {
      {"w", {64, 96}}, {"x", {6, 40, 10}}, {"b", {4096}}};
  return shapes;
}
size_t SavedDim(const std::string& name) { return name == "x" ? 1 : 0; }
size_t LoadDim(const std::string& name) { return name == "w" ? 1 : name == "x" ? 2 : 0; }
bool g_compressible = false;  // Full() gives values zstd compresses (small integers)
TensorView Full(const std::string& name) {
  TensorView t = RandomTensor(DType::kFloat32, Shapes().at(name), 7 + name[0]);
  if (g_compressible) {
    float* v = static_cast<float*>(t.data);
    for (int64_t i = 0; i < t.numel(); ++i) v[i] = static_cast<float>(i % 7);
  }
  return t;
}

// Rank r's slice of `shape` along d at `world` ranks: its offsets and lengths.
std::pair<Shape, Shape> SliceOf(const Shape& shape, size_t d, int r, int world) {
  auto [b, e] = RowRange(shape[d], r, world);
  Shape off(shape.size(), 0), len = shape;
  off[d] = b;
  len[d] = e - b;
  return {off, len};
}

std::shared_ptr<FaultInjectionStore> Save(const std::string& bucket, SaveOptions so = {}) {
  ClearMemStore(bucket);
  auto store = std::make_shared<FaultInjectionStore>(MakeMemStore(bucket));
  RegisterFaultScheme("rule", store);
  RequireNoErrors(RunRanks(kSaved, [&](int r, Communicator& comm) {
    StateDict sd;
    for (const auto& [name, shape] : Shapes()) {
      const auto [off, len] = SliceOf(shape, SavedDim(name), r, kSaved);
      sd.Set(name,
             ShardedTensor{DType::kFloat32, shape, {{Clone(Full(name).Narrow(off, len)), off}}});
    }
    Save(sd, "rule://x", comm, so);
  }));
  return store;
}

// Loads every tensor at `world` ranks along its LoadDim as `dtype`; checks the values and
// returns each rank's stats (or the errors, when `errors` is given).
std::vector<LoadStats> LoadResharded(int world, DType dtype = DType::kFloat32,
                                     std::vector<std::exception_ptr>* errors = nullptr,
                                     bool strided = false) {
  std::vector<LoadStats> stats(world);
  std::vector<std::map<std::string, std::pair<TensorView, TensorView>>> got(world);
  auto run = RunRanks(world, [&](int r, Communicator& comm) {
    StateDict sd;
    for (const auto& [name, shape] : Shapes()) {
      const auto [off, len] = SliceOf(shape, LoadDim(name), r, world);
      // Strided: the slice is a view of a whole tensor's columns (as a model's shard may be).
      TensorView part = strided ? TensorView::Allocate(dtype, shape).Narrow(off, len)
                                : TensorView::Allocate(dtype, len);
      got[r][name] = {part, Full(name).Narrow(off, len)};
      sd.Set(name, ShardedTensor{dtype, shape, {{part, off}}});
    }
    LoadOptions lo;
    lo.cast_dtypes = dtype != DType::kFloat32;
    stats[r] = Load(sd, "rule://x", comm, lo).stats;
  });
  if (errors != nullptr) {
    *errors = run;
    return stats;
  }
  RequireNoErrors(run);
  for (auto& rank : got) {
    for (auto& [name, pair] : rank) {
      INFO(name);
      if (dtype == DType::kFloat32) {
        CHECK(SameElements(pair.first, pair.second));
      } else {
        TensorView expected = TensorView::Allocate(dtype, pair.second.shape);
        CastTensor(expected, pair.second);
        CHECK(SameElements(pair.first, expected));
      }
    }
  }
  return stats;
}

}  // namespace

TEST_CASE("rule exchange: reshards between two rules load exact with each chunk read once",
          "[rule-exchange][read-once]") {
  auto store = Save("rule-reshard");
  for (int world : {4, 3, 2}) {
    DYNAMIC_SECTION(world << " ranks") {
      store->Reset();
      const std::vector<LoadStats> stats = LoadResharded(world);
      uint64_t items = 0;
      for (const LoadStats& s : stats) {
        CHECK(s.rule_rounds == 1);
        CHECK(s.coop_rounds == 0);
        CHECK(s.rule_items_fallen_back == 0);
        items += s.rule_items;
      }
      CHECK(items == 2 * static_cast<uint64_t>(world));  // "w" and "x" on every rank
      // The chunks of "w" and "x" once, "b" once, plus the metadata, the indexes and block
      // tables (a fifth of these small tensors' bytes at most; alone, every rank would read
      // every chunk of "w" and "x").
      uint64_t stored = 0;
      for (const auto& [name, shape] : Shapes()) stored += NumElements(shape) * 4;
      INFO("stored " << stored << ", read " << store->BytesRead());
      CHECK(store->BytesRead() <= stored + stored / 5);
    }
  }
  SECTION("into strided views (a whole tensor's columns)") {
    for (const LoadStats& s : LoadResharded(3, DType::kFloat32, nullptr, true)) {
      CHECK(s.rule_items == 2);
    }
  }
  SECTION("into another dtype (the planner's staging, cast at commit)") {
    for (const LoadStats& s : LoadResharded(3, DType::kFloat64)) CHECK(s.rule_items == 2);
  }
}

TEST_CASE("rule exchange: a checkpoint whose items owners cannot stream (zstd) reads as before",
          "[rule-exchange][read-once]") {
  SaveOptions so;
  so.storage.compression = Compression::kZstd;
  so.storage.compression_min_bytes = 0;
  g_compressible = true;
  Save("rule-zstd", so);
  const std::vector<LoadStats> stats = LoadResharded(3);
  g_compressible = false;
  for (const LoadStats& s : stats) {
    CHECK(s.rule_rounds == 0);  // no rank offered a table: no exchange of messages nobody fills
    CHECK(s.rule_items_fallen_back == 0);
  }
}

TEST_CASE("rule exchange: a damaged chunk fails every rank naming it and a failed read is retried",
          "[rule-exchange][read-once]") {
  auto store = Save("rule-damage");
  SECTION("a flipped bit in rank 2's chunk of w") {
    Metadata md = ReadMetadata("rule://x");
    ReadAllStoredItems(*store->inner(), md);
    const StorageInfo& info = md.storage.at({"w", {32, 0}, std::nullopt});
    std::string bytes = store->ReadAll(info.relative_path, UINT64_MAX);
    bytes[info.offset + info.length - 5] ^= 0x10;
    auto out = store->inner()->Create(info.relative_path);
    out->Append(bytes.data(), bytes.size());
    out->Close();
    std::vector<std::exception_ptr> errors;
    LoadResharded(4, DType::kFloat32, &errors);
    for (int r = 0; r < 4; ++r) {
      INFO("rank " << r);
      REQUIRE(errors[r]);
      try {
        std::rethrow_exception(errors[r]);
      } catch (const Error& e) {
        // The owner could not serve it, so each rank read its piece itself and found it bad.
        CHECK_THAT(e.what(), Contains("'w'") && Contains(info.relative_path));
      }
    }
  }
  SECTION("an owner's read that fails once: its pieces are read by each rank itself") {
    store->Reset();
    store->FailNth(FaultOp::kRead, 4);
    uint64_t fallen_back = 0;
    for (const LoadStats& s : LoadResharded(4)) fallen_back += s.rule_items_fallen_back;
    CHECK(fallen_back > 0);
  }
}

TEST_CASE("rule exchange: a load cut as torch.chunk cuts (ceil) whose first ranks cannot tell",
          "[rule-exchange][read-once]") {
  // 10 columns at 4 ranks: torch.chunk gives 3, 3, 3, 1 and numpy.array_split 3, 3, 2, 2, so ranks
  // 0 and 1 hold a slice of both rules. Checking balanced first they disagree with ranks 2 and 3;
  // checking ceil first every rank finds the same table, and the coordinator takes that one.
  const Shape shape{30, 10};
  const TensorView full = RandomTensor(DType::kFloat32, shape, 5);
  ClearMemStore("rule-ceil");
  RegisterFaultScheme("ruleceil", std::make_shared<FaultInjectionStore>(MakeMemStore("rule-ceil")));
  RequireNoErrors(RunRanks(4, [&](int r, Communicator& comm) {
    StateDict sd;
    const auto [off, len] = SliceOf(shape, 0, r, 4);
    sd.Set("c", ShardedTensor{DType::kFloat32, shape, {{Clone(full.Narrow(off, len)), off}}});
    Save(sd, "ruleceil://x", comm);
  }));
  const Metadata md = ReadMetadata("ruleceil://x");
  std::vector<LoadStats> stats(4);
  std::vector<std::pair<TensorView, TensorView>> got(4);
  RequireNoErrors(RunRanks(4, [&](int r, Communicator& comm) {
    const auto [lo, hi] = RegularSlice(10, r, 4, kRuleCeil);
    TensorView part = TensorView::Allocate(DType::kFloat32, {30, hi - lo});
    got[r] = {part, full.Narrow({0, lo}, {30, hi - lo})};
    StateDict sd;
    sd.Set("c", ShardedTensor{DType::kFloat32, shape, {{part, {0, lo}}}});
    stats[r] = Load(sd, "ruleceil://x", comm).stats;
  }));
  {  // rank 0's two tables: the same read, the rule it checked first
    const auto [lo, hi] = RegularSlice(10, 0, 4, kRuleCeil);
    LoadPlan plan;
    plan.items.push_back(SliceRead(md, 1, lo, hi, "c"));
    CHECK(FindRuleReads(plan, md, 0, 4, 1 << 20).reads.at(0).load.rule == kRuleBalanced);
    CHECK(FindRuleReads(plan, md, 0, 4, 1 << 20, kRuleCeil).reads.at(0).load.rule == kRuleCeil);
  }
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    CHECK(SameElements(got[r].first, got[r].second));
    CHECK(stats[r].rule_rounds == 1);
    CHECK(stats[r].rule_items == 1);
  }
}
