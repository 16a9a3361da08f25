// Resharding: any saved layout and world size loads into any requested layout and world size,
// bit-exact; indexed overlaps equal the naive ones; reads stay within the scratch bound;
// dedup, strict/partial loads, extra keys and loading without a model.
#include <catch2/catch.hpp>
#include <functional>
#include <mutex>
#include <random>
#include <thread>

#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/store.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::Clone;
using dcp::testing::RandomTensor;
using dcp::testing::RowRange;
using dcp::testing::SameElements;

namespace {

using dcp::testing::RunRanks;

using dcp::testing::RequireNoErrors;

// Layouts of a tensor over `world` ranks: the chunks rank `rank` holds.
enum class Layout { kRows, kCols, kBlocks, kUneven, kLastOnly, kFull };
const Layout kLayouts[] = {Layout::kRows,   Layout::kCols,     Layout::kBlocks,
                           Layout::kUneven, Layout::kLastOnly, Layout::kFull};
const char* Name(Layout l) {
  switch (l) {
    case Layout::kRows:
      return "rows";
    case Layout::kCols:
      return "cols";
    case Layout::kBlocks:
      return "blocks";
    case Layout::kUneven:
      return "uneven";
    case Layout::kLastOnly:
      return "last-rank-only";
    case Layout::kFull:
      return "replicated";
  }
  return "?";
}

std::vector<ChunkMeta> Chunks(Layout layout, const Shape& shape, int rank, int world) {
  std::vector<ChunkMeta> out;
  auto along = [&](size_t dim, int64_t b, int64_t e) {
    ChunkMeta c{Shape(shape.size(), 0), shape};
    c.offsets[dim] = b;
    c.sizes[dim] = e - b;
    if (e > b) out.push_back(c);
  };
  switch (layout) {
    case Layout::kRows: {
      auto [b, e] = RowRange(shape[0], rank, world);
      along(0, b, e);
      break;
    }
    case Layout::kCols: {
      auto [b, e] = RowRange(shape[1], rank, world);
      along(1, b, e);
      break;
    }
    case Layout::kBlocks: {  // a 2 x 3 grid of uneven blocks, dealt round-robin
      int block = 0;
      for (int i = 0; i < 2; ++i) {
        for (int j = 0; j < 3; ++j, ++block) {
          if (block % world != rank) continue;
          auto [r0, r1] = RowRange(shape[0], i, 2);
          auto [c0, c1] = RowRange(shape[1], j, 3);
          ChunkMeta c{Shape(shape.size(), 0), shape};
          c.offsets[0] = r0, c.sizes[0] = r1 - r0, c.offsets[1] = c0, c.sizes[1] = c1 - c0;
          out.push_back(c);
        }
      }
      break;
    }
    case Layout::kUneven: {  // rank r gets a share proportional to r (rank 0 holds nothing)
      const int64_t total = int64_t{world} * (world - 1) / 2;
      auto cut = [&](int r) {
        return total == 0 ? (r > 0 ? shape[0] : 0) : shape[0] * (int64_t{r} * (r - 1) / 2) / total;
      };
      if (world == 1) {
        along(0, 0, shape[0]);
      } else {
        along(0, cut(rank), cut(rank + 1));
      }
      break;
    }
    case Layout::kLastOnly:
      if (rank == world - 1) out.push_back({Shape(shape.size(), 0), shape});
      break;
    case Layout::kFull:
      out.push_back({Shape(shape.size(), 0), shape});
      break;
  }
  return out;
}

// A destination view of `sizes`: contiguous, or (strided=true, rank >= 2) column-major.
TensorView Dest(DType dtype, const Shape& sizes, bool strided) {
  if (!strided || sizes.size() < 2) return TensorView::Allocate(dtype, sizes);
  Shape rev(sizes.rbegin(), sizes.rend());
  TensorView v = TensorView::Allocate(dtype, rev);
  Shape strides = ContiguousStrides(rev);
  v.shape = sizes;
  v.strides.assign(strides.rbegin(), strides.rend());
  return v;
}

struct TensorSpec {
  std::string fqn;
  DType dtype;
  Shape shape;
  uint64_t seed;
};
const std::vector<TensorSpec> kTensors = {
    {"model.w", DType::kFloat32, {7, 10}, 1},
    {"model.emb", DType::kInt16, {9, 5, 3}, 2},
    {"opt.m", DType::kFloat64, {4, 4}, 3},
};

// Every rank's state dict for `layout`: sharded tensors (replicated: plain views), with either
// the reference values or zeroed (possibly strided) destinations.
StateDict Build(Layout layout, int rank, int world, bool fill, bool strided,
                std::vector<std::pair<TensorView, ChunkMeta>>* dests) {
  StateDict sd;
  for (const auto& spec : kTensors) {
    const TensorView ref = RandomTensor(spec.dtype, spec.shape, spec.seed);
    KeyPath path{spec.fqn.substr(0, spec.fqn.find('.')), spec.fqn.substr(spec.fqn.find('.') + 1)};
    if (layout == Layout::kFull) {
      TensorView v = fill ? Clone(ref) : Dest(spec.dtype, spec.shape, strided);
      if (dests) dests->push_back({v, {Shape(spec.shape.size(), 0), spec.shape}});
      sd.Nested(path[0]).Set(path[1], v);
      continue;
    }
    ShardedTensor st{spec.dtype, spec.shape, {}};
    for (const auto& c : Chunks(layout, spec.shape, rank, world)) {
      TensorView v =
          fill ? Clone(ref.Narrow(c.offsets, c.sizes)) : Dest(spec.dtype, c.sizes, strided);
      if (dests) dests->push_back({v, c});
      st.local_shards.push_back({v, c.offsets});
    }
    sd.Nested(path[0]).Set(path[1], st);
  }
  sd.Set("step", Blob{"42"});
  return sd;
}

TensorView RefFor(const TensorView& dest) {
  for (const auto& spec : kTensors) {
    if (spec.dtype == dest.dtype) return RandomTensor(spec.dtype, spec.shape, spec.seed);
  }
  return {};
}

void SaveLayout(const std::string& name, Layout layout, int world) {
  ClearMemStore(name);
  std::vector<StateDict> sds(world);
  RequireNoErrors(RunRanks(world, [&](int r, Communicator& comm) {
    sds[r] = Build(layout, r, world, true, false, nullptr);
    Save(sds[r], "mem://" + name, comm);
  }));
}

void LoadAndCheck(const std::string& name, Layout layout, int world, size_t scratch) {
  std::vector<std::vector<std::pair<TensorView, ChunkMeta>>> dests(world);
  std::vector<StateDict> sds(world);
  RequireNoErrors(RunRanks(world, [&](int r, Communicator& comm) {
    sds[r] = Build(layout, r, world, false, /*strided=*/r % 2 == 1, &dests[r]);
    LoadOptions lo;
    lo.storage.max_scratch_bytes = scratch;
    Load(sds[r], "mem://" + name, comm, lo);
  }));
  for (int r = 0; r < world; ++r) {
    for (const auto& [view, chunk] : dests[r]) {
      const TensorView ref = RefFor(view).Narrow(chunk.offsets, chunk.sizes);
      INFO("rank " << r << " chunk " << chunk.ToString() << " " << view.ToString());
      CHECK(SameElements(view, ref));
    }
    CHECK(std::get<Blob>(*sds[r].Find("step")).bytes == "42");
  }
}

void ReshardFrom(int save_world) {
  for (Layout save_layout : kLayouts) {
    const std::string name = "reshard-" + std::to_string(save_world) + "-" + Name(save_layout);
    SaveLayout(name, save_layout, save_world);
    for (int load_world = 1; load_world <= 4; ++load_world) {
      for (Layout load_layout : kLayouts) {
        INFO("saved " << Name(save_layout) << " at " << save_world << ", loaded "
                      << Name(load_layout) << " at " << load_world);
        LoadAndCheck(name, load_layout, load_world, load_world % 2 ? 64 : 32 << 20);
      }
    }
    ClearMemStore(name);
  }
}

// A random guillotine tiling of `shape` into about `n` boxes.
std::vector<ChunkMeta> RandomTiling(const Shape& shape, int n, std::mt19937_64& rng) {
  std::vector<ChunkMeta> boxes{{Shape(shape.size(), 0), shape}};
  for (int tries = 0; static_cast<int>(boxes.size()) < n && tries < 10 * n; ++tries) {
    const size_t i = rng() % boxes.size();
    const size_t d = rng() % shape.size();
    ChunkMeta& b = boxes[i];
    if (b.sizes[d] < 2) continue;
    const int64_t cut = 1 + static_cast<int64_t>(rng() % (b.sizes[d] - 1));
    ChunkMeta hi = b;
    hi.offsets[d] += cut;
    hi.sizes[d] -= cut;
    b.sizes[d] = cut;
    boxes.push_back(hi);
  }
  std::shuffle(boxes.begin(), boxes.end(), rng);
  return boxes;
}

// Counts the largest single read, to show reads are bounded.
class CountingStore : public ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  std::unique_ptr<ReadableObject> Open(const std::string& n) override {
    struct Obj : ForwardingReadableObject {
      Obj(std::unique_ptr<ReadableObject> in, CountingStore* o)
          : ForwardingReadableObject(std::move(in)), owner(o) {}
      void ReadAt(uint64_t off, void* dst, size_t n) override {
        owner->Record(n);
        ForwardingReadableObject::ReadAt(off, dst, n);
      }
      CountingStore* owner;
    };
    return std::make_unique<Obj>(ForwardingStore::Open(n), this);
  }

  void Record(size_t n) {
    std::lock_guard<std::mutex> lock(mu_);
    max_read = std::max(max_read, n);
    total_read += n;
  }
  size_t max_read = 0;
  uint64_t total_read = 0;

 private:
  std::mutex mu_;
};

}  // namespace

TEST_CASE("reshard matrix: saved at world 1, every layout loads at 1-4 ranks", "[reshard]") {
  ReshardFrom(1);
}
TEST_CASE("reshard matrix: saved at world 2, every layout loads at 1-4 ranks", "[reshard]") {
  ReshardFrom(2);
}
TEST_CASE("reshard matrix: saved at world 3, every layout loads at 1-4 ranks", "[reshard]") {
  ReshardFrom(3);
}
TEST_CASE("reshard matrix: saved at world 4, every layout loads at 1-4 ranks", "[reshard]") {
  ReshardFrom(4);
}

TEST_CASE("reshard: indexed overlaps equal the naive ones on random tilings",
          "[reshard][planner]") {
  std::mt19937_64 rng(12345);
  for (int round = 0; round < 200; ++round) {
    const size_t rank = 1 + rng() % 3;
    Shape shape(rank);
    for (auto& s : shape) s = 1 + static_cast<int64_t>(rng() % 40);
    const auto saved = RandomTiling(shape, 1 + static_cast<int>(rng() % 60), rng);
    const auto wanted = RandomTiling(shape, 1 + static_cast<int>(rng() % 60), rng);
    ChunkIndex index(saved);
    for (const auto& box : wanted) {
      INFO("round " << round << " box " << box.ToString());
      CHECK(index.Overlapping(box) == OverlappingChunksNaive(saved, box));
    }
    // And whole plans: the default planner with and without the index.
    Metadata md;
    md.entries["t"] = TensorMetadata{DType::kFloat32, shape, saved};
    StateDict sd;
    ShardedTensor st{DType::kFloat32, shape, {}};
    for (const auto& c : wanted)
      st.local_shards.push_back({TensorView::Allocate(DType::kFloat32, c.sizes), c.offsets});
    sd.Set("t", st);
    LoadPlannerOptions naive_opts;
    naive_opts.naive_overlaps = true;
    DefaultLoadPlanner fast, naive(naive_opts);
    fast.SetUp(sd, md, {});
    naive.SetUp(sd, md, {});
    const LoadPlan a = fast.CreateLocalPlan(), b = naive.CreateLocalPlan();
    REQUIRE(a.items.size() == b.items.size());
    for (size_t i = 0; i < a.items.size(); ++i) {
      CHECK(a.items[i].dest_index == b.items[i].dest_index);
      CHECK(a.items[i].storage_index == b.items[i].storage_index);
      CHECK(a.items[i].dest_offsets == b.items[i].dest_offsets);
      CHECK(a.items[i].storage_offsets == b.items[i].storage_offsets);
      CHECK(a.items[i].lengths == b.items[i].lengths);
    }
  }
}

TEST_CASE("reshard: strided and partial reads stay within the scratch bound",
          "[reshard][storage][option:StorageOptions::max_scratch_bytes]") {
  const std::string name = "reshard-bounded";
  ClearMemStore(name);
  const Shape shape{64, 3000};  // rows of 12000 bytes
  const TensorView ref = RandomTensor(DType::kFloat32, shape, 77);
  // Each writer's chunk (384,000 bytes) is one block of the default 1 MiB block CRCs, or has
  // none with checksum_block_bytes = 0.
  for (uint64_t block_bytes : {uint64_t{1} << 20, uint64_t{0}}) {
    ClearMemStore(name);
    RequireNoErrors(RunRanks(2, [&](int r, Communicator& comm) {
      auto [b, e] = RowRange(shape[0], r, 2);
      StateDict sd;
      sd.Set("w",
             ShardedTensor{
                 DType::kFloat32, shape, {{Clone(ref.Narrow({b, 0}, {e - b, shape[1]})), {b, 0}}}});
      SaveOptions save;
      save.storage.checksum_block_bytes = block_bytes;
      Save(sd, "mem://" + name, comm, save);
    }));
    for (size_t scratch : {size_t{64}, size_t{4096}, size_t{100000}}) {
      for (bool verify_partial : {false, true}) {
        for (bool coop : {false, true}) {
          DYNAMIC_SECTION("blocks " << block_bytes << " scratch " << scratch << " verify partial "
                                    << verify_partial << " cooperative " << coop) {
            auto store = std::make_shared<CountingStore>(MakeMemStore(name));
            std::vector<TensorView> dst(3);
            RequireNoErrors(RunRanks(3, [&](int r, Communicator& comm) {
              StorageOptions so;
              so.max_scratch_bytes = scratch;
              so.verify_partial_reads = verify_partial;
              auto reader = MakeStoreReader(store, so);
              auto [b, e] = RowRange(shape[1], r, 3);  // column shards: strided overlaps
              dst[r] = Dest(DType::kFloat32, {shape[0], e - b}, r == 1);
              StateDict sd;
              sd.Set("w", ShardedTensor{DType::kFloat32, shape, {{dst[r], {0, b}}}});
              LoadOptions lo;
              lo.storage = so;
              lo.read_once = coop;  // with it, each chunk's owner reads it once for all three
              Load(sd, *reader, comm, lo);
            }));
            for (int r = 0; r < 3; ++r) {
              auto [b, e] = RowRange(shape[1], r, 3);
              CHECK(SameElements(dst[r], ref.Narrow({0, b}, {shape[0], e - b})));
            }
            // The metadata read is whole; every data read is bounded by the scratch size.
            const size_t md_size = *MakeMemStore(name)->Size(kMetadataName);
            CHECK(store->max_read <= std::max(scratch, md_size));
            if (coop) {
              // Cooperative: every stored byte once (the indexes travel in the metadata).
              CHECK(store->total_read <= ref.nbytes() + ref.nbytes() / 20 + md_size);
            } else if (verify_partial && block_bytes == 0) {
              // Without block CRCs each rank streams every item it reads from a second time.
              CHECK(store->total_read >= 3 * ref.nbytes());
            } else if (verify_partial) {
              // With them each rank reads each block its column touches (all of them) once: the
              // three ranks read the data once each, plus the metadata and the block tables.
              CHECK(store->total_read <= 3 * ref.nbytes() + 3 * (md_size + 64));
            }
          }
        }
      }
    }
  }
  ClearMemStore(name);
}

TEST_CASE("reshard: a corrupted item is caught by a partial read that verifies",
          "[reshard][storage][option:StorageOptions::verify_partial_reads]"
          "[option:LoadOptions::storage]") {
  const std::string name = "reshard-corrupt";
  ClearMemStore(name);
  const TensorView ref = RandomTensor(DType::kFloat32, {16, 16}, 5);
  StateDict sd;
  sd.Set("w", ref);
  Save(sd, "mem://" + name);
  // Flip a byte in the last row of the data file (not read by a load of the first rows).
  auto store = MakeMemStore(name);
  for (const auto& n : store->List()) {
    if (!IsDataObjectName(n)) continue;
    std::string bytes = store->ReadAll(n, UINT64_MAX);
    bytes[static_cast<size_t>(ref.nbytes()) - 1] ^= 0x5a;  // the item's end (an index follows)
    auto w = store->Create(n);
    w->Append(bytes.data(), bytes.size());
    w->Close();
  }
  StateDict part;
  TensorView top = TensorView::Allocate(DType::kFloat32, {4, 16});
  part.Set("w", ShardedTensor{DType::kFloat32, {16, 16}, {{top, {0, 0}}}});
  LoadOptions lo;
  lo.storage.verify_partial_reads = false;
  Load(part, "mem://" + name, lo);
  CHECK(SameElements(top, ref.Narrow({0, 0}, {4, 16})));
  lo.storage.verify_partial_reads = true;
  CHECK_THROWS_WITH(Load(part, "mem://" + name, lo), Contains("checksum mismatch"));
  ClearMemStore(name);
}

TEST_CASE("reshard: a replicated tensor on 4 ranks is written about once", "[reshard][dedup]") {
  const std::string name = "reshard-dedup";
  ClearMemStore(name);
  const TensorView big =
      RandomTensor(DType::kFloat32, {1024, 1024}, 9);  // 4 MiB stands in for 1 GiB
  std::vector<TensorView> small;
  for (int i = 0; i < 8; ++i) small.push_back(RandomTensor(DType::kFloat32, {128, 128}, 20 + i));
  Metadata md;
  RequireNoErrors(RunRanks(4, [&](int r, Communicator& comm) {
    StateDict sd;
    sd.Set("big", big);
    for (int i = 0; i < 8; ++i) sd.Set("small" + std::to_string(i), small[i]);
    Metadata m = Save(sd, "mem://" + name, comm).metadata;
    ReadStoredItems("mem://" + name, m);
    if (r == 0) md = m;
  }));
  const uint64_t logical = big.nbytes() + 8 * small[0].nbytes();
  uint64_t written = 0;
  auto store = MakeMemStore(name);
  std::map<std::string, uint64_t> per_file;
  for (const auto& n : store->List()) {
    if (IsDataObjectName(n)) per_file[n] = *store->Size(n), written += *store->Size(n);
  }
  for (const DataFile& f : md.files) {
    written -= f.index_length + f.block_table_length;  // version 2's indexes and block tables
  }
  CHECK(written == logical);  // 1x, not 4x
  CHECK(md.TotalStoredBytes() == logical);
  // Balanced: big alone on one rank, the small ones spread over the other three.
  CHECK(per_file.size() == 4);
  std::vector<TensorView> dst(4);
  RequireNoErrors(RunRanks(4, [&](int r, Communicator& comm) {
    dst[r] = TensorView::Allocate(DType::kFloat32, {1024, 1024});
    StateDict sd;
    sd.Set("big", dst[r]);
    LoadOptions lo;
    lo.allow_partial_load = true;
    Load(sd, "mem://" + name, comm, lo);
  }));
  for (int r = 0; r < 4; ++r) CHECK(SameElements(dst[r], big));
  ClearMemStore(name);
}

TEST_CASE("reshard: strict, partial, mismatch and extra keys",
          "[reshard][load][option:LoadOptions::allow_partial_load]") {
  const std::string name = "reshard-keys";
  ClearMemStore(name);
  StateDict saved = Build(Layout::kFull, 0, 1, true, false, nullptr);
  Save(saved, "mem://" + name);

  SECTION("a subset loads, and the extra keys are reported") {
    StateDict sd;
    TensorView w = TensorView::Allocate(DType::kFloat32, {7, 10});
    sd.Nested("model").Set("w", w);
    const std::vector<std::string> extra = Load(sd, "mem://" + name).unrequested_keys;
    CHECK(SameElements(w, RandomTensor(DType::kFloat32, {7, 10}, 1)));
    CHECK(extra == std::vector<std::string>{"model.emb", "opt.m", "step"});
  }
  SECTION("a missing key is an error naming it, unless partial") {
    StateDict sd;
    sd.Nested("model").Set("w", TensorView::Allocate(DType::kFloat32, {7, 10}));
    sd.Nested("model").Set("nope", TensorView::Allocate(DType::kFloat32, {2}));
    CHECK_THROWS_WITH(Load(sd, "mem://" + name), Contains("model.nope"));
    LoadOptions lo;
    lo.allow_partial_load = true;
    CHECK_NOTHROW(Load(sd, "mem://" + name, lo));
  }
  SECTION("shape and dtype mismatches name the fqn and both sides") {
    StateDict sd;
    sd.Nested("model").Set("w", TensorView::Allocate(DType::kFloat32, {10, 7}));
    CHECK_THROWS_WITH(Load(sd, "mem://" + name),
                      Contains("model.w") && Contains("[7, 10]") && Contains("[10, 7]"));
    StateDict sd2;
    sd2.Nested("model").Set("w", TensorView::Allocate(DType::kFloat64, {7, 10}));
    CHECK_THROWS_WITH(Load(sd2, "mem://" + name),
                      Contains("model.w") && Contains("float32") && Contains("float64"));
  }
  ClearMemStore(name);
}

TEST_CASE("reshard: load everything without a model at any world size", "[reshard][load]") {
  const std::string name = "reshard-loadall";
  SaveLayout(name, Layout::kBlocks, 2);
  const Metadata md = ReadMetadata("mem://" + name);
  const StateDict shape_only = StateDictFromMetadata(md);
  CHECK(shape_only.Find("model") != nullptr);
  for (int world : {1, 3}) {
    std::vector<StateDict> sds(world);
    RequireNoErrors(RunRanks(
        world, [&](int r, Communicator& comm) { sds[r] = LoadAll("mem://" + name, comm); }));
    for (int r = 0; r < world; ++r) {
      for (const auto& spec : kTensors) {
        const std::string outer = spec.fqn.substr(0, spec.fqn.find('.'));
        const std::string inner = spec.fqn.substr(spec.fqn.find('.') + 1);
        auto* nested = std::get_if<std::shared_ptr<StateDict>>(sds[r].Find(outer));
        REQUIRE(nested);
        const auto* t = std::get_if<TensorView>((*nested)->Find(inner));
        REQUIRE(t);
        CHECK(SameElements(*t, RandomTensor(spec.dtype, spec.shape, spec.seed)));
      }
      CHECK(std::get<Blob>(*sds[r].Find("step")).bytes == "42");
    }
  }
  ClearMemStore(name);
}
