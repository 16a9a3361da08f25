// Hostile checkpoints cost nothing: a corpus of damaged metadata, generated here from a real
// save, each case loaded (or validated) under a bound on peak memory and time. Also the legal
// layout with an empty shard at another rank's offset.
#include <sys/mman.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>

#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/store.h"
#include "dcp/storage/registry.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::RandomTensor;
using dcp::testing::RequireNoErrors;
using dcp::testing::RunRanks;
using dcp::testing::SameElements;

namespace {

constexpr uint64_t kGiB = uint64_t{1} << 30;
#ifdef DCP_UNDER_SANITIZER
constexpr double kMaxSeconds = 20.0;  // sanitizers slow everything down up to ~10x
#else
constexpr double kMaxSeconds = 2.0;
#endif
constexpr long kMaxPeakMiB = 200;

long StatusKiB(const char* key) {
  std::ifstream in("/proc/self/status");
  std::string line;
  const std::string k = std::string(key) + ":";
  while (std::getline(in, line)) {
    if (line.rfind(k, 0) == 0) return std::stol(line.substr(k.size()));
  }
  return 0;
}

struct Cost {
  double seconds;
  long peak_mib;  // growth of the peak RSS over the RSS before
};

// Run `f`, measuring how far the process' peak RSS rose above its RSS before (the peak is reset
// through /proc/self/clear_refs where allowed; otherwise only a rise of the old peak counts).
template <typename F>
Cost Measure(F&& f) {
  bool reset = false;
  if (FILE* c = std::fopen("/proc/self/clear_refs", "w")) {
    reset = std::fputs("5", c) >= 0;
    reset = std::fclose(c) == 0 && reset;
  }
  const long base = reset ? StatusKiB("VmRSS") : StatusKiB("VmHWM");
  const auto t0 = std::chrono::steady_clock::now();
  f();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return {s, std::max(0L, StatusKiB("VmHWM") - base) / 1024};
}

#define CHECK_CHEAP(cost)                                                \
  do {                                                                   \
    const Cost c_ = (cost);                                              \
    INFO("peak RSS +" << c_.peak_mib << " MiB, " << c_.seconds << " s"); \
    CHECK(c_.peak_mib < kMaxPeakMiB);                                    \
    CHECK(c_.seconds < kMaxSeconds);                                     \
  } while (0)

// A small real checkpoint at mem://NAME: a tensor, a blob, and (with compression) a zstd blob.
void SaveSmall(const std::string& name, bool compress = false) {
  ClearMemStore(name);
  StateDict sd;
  sd.Nested("model").Set("w", RandomTensor(DType::kFloat32, {8, 8}, 1));
  sd.Set("rng", Blob{"0123456789"});
  if (compress) sd.Set("config", Blob{std::string(300000, 'a')});
  SaveOptions so;
  if (compress) so.storage.compression = Compression::kZstd;
  // Version 1: these cases edit the stored items the metadata lists (version 2's hostile cases,
  // which edit file tables and indexes, are in metadata_v2_test.cc).
  so.storage.metadata_version = 1;
  Save(sd, "mem://" + name, so);
}

Metadata ReadRaw(const std::string& name) {
  auto store = MakeMemStore(name);
  return DecodeMetadataFile(store->ReadAll(kMetadataName, UINT64_MAX), "test");
}

// Publish `md` as the checkpoint's metadata without validating it (what an attacker can do).
void Publish(const std::string& name, const Metadata& md) {
  MakeMemStore(name)->PublishAtomically(kMetadataName, EncodeMetadataFile(md));
}

StorageInfo& Item(Metadata& md, const std::string& fqn, const Shape& offset = {}) {
  return md.storage.at(MetadataIndex{fqn, offset, {}});
}

// The failure of a single-process load: its code and message.
std::pair<ErrorCode, std::string> LoadError(const std::string& uri, StateDict& sd,
                                            bool load_all = false) {
  try {
    if (load_all) {
      sd = LoadAll(uri);
    } else {
      Load(sd, uri);
    }
  } catch (const CollectiveError& e) {
    REQUIRE(e.failures().size() == 1);
    return {e.failures()[0].code, e.what()};
  } catch (const Error& e) {
    return {e.code(), e.what()};
  }
  FAIL("the load succeeded");
  return {};
}

StateDict BlobDict() {
  StateDict sd;
  sd.Set("rng", Blob{});
  return sd;
}

constexpr bool kLoadAll = true;

// A Store that reports every data file as `size` bytes long (its reads fail): metadata whose
// claims the "files" back, for allocation failures without a petabyte of disk.
class HugeFileStore : public ForwardingStore {
 public:
  HugeFileStore(std::shared_ptr<Store> inner, uint64_t size)
      : ForwardingStore(std::move(inner)), size_(size) {}
  std::string uri() const override { return "huge://" + target_->uri(); }
  std::optional<uint64_t> Size(const std::string& n) override {
    return IsDataObjectName(n) ? std::optional<uint64_t>(size_) : target_->Size(n);
  }

 private:
  uint64_t size_;
};

}  // namespace

TEST_CASE("hostile: the meter sees what a case allocates", "[hostile]") {
  // So that the bounds below can fail: 64 MiB allocated and touched inside Measure show.
  // Fresh pages from mmap: heap memory freed by earlier tests in this process may already be
  // resident and would not raise the RSS.
  const Cost c = Measure([] {
    const size_t n = size_t{64} << 20;
    void* p = ::mmap(nullptr, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(p != MAP_FAILED);
    char* v = static_cast<char*>(p);
    for (size_t i = 0; i < n; i += 4096) v[i] = static_cast<char>(i);
    CHECK(v[4096] == 0);
    ::munmap(p, n);
  });
  CHECK(c.peak_mib >= 60);
}

TEST_CASE("hostile: a blob claiming 8 GiB in a tiny file fails fast, naming entry and file",
          "[hostile][reader]") {
  const std::string name = "hostile-blob";
  SaveSmall(name);
  Metadata md = ReadRaw(name);
  StorageInfo& rng = Item(md, "rng");
  const std::string file = rng.relative_path;
  rng.length = rng.raw_length = 8 * kGiB;
  Publish(name, md);
  for (bool all : {false, true}) {
    INFO((all ? "load_all" : "load"));
    StateDict sd = all ? StateDict{} : BlobDict();
    std::pair<ErrorCode, std::string> err;
    CHECK_CHEAP(Measure([&] { err = LoadError("mem://" + name, sd, all); }));
    CHECK(err.first == ErrorCode::kCorruption);
    CHECK_THAT(err.second, Contains("'rng'") && Contains(file) && Contains("truncated"));
  }
  // ReadMetadata (what inspect-like callers use) refuses it as well.
  CHECK_THROWS_AS(ReadMetadata("mem://" + name), CorruptionError);
  ClearMemStore(name);
}

TEST_CASE("hostile: a zstd blob with a raw_length of 8 GiB fails before any allocation",
          "[hostile][compression]") {
  const std::string name = "hostile-zstd";
  SaveSmall(name, /*compress=*/true);
  Metadata md = ReadRaw(name);
  REQUIRE(Item(md, "config").transforms == std::vector<std::string>{"zstd"});
  const StorageInfo good = Item(md, "config");
  SECTION("beyond what any zstd frame of that length can hold: invalid metadata") {
    Item(md, "config").raw_length = 8 * kGiB;
    Publish(name, md);
    StateDict sd;
    std::pair<ErrorCode, std::string> err;
    CHECK_CHEAP(Measure([&] { err = LoadError("mem://" + name, sd, kLoadAll); }));
    CHECK(err.first == ErrorCode::kCorruption);
    CHECK_THAT(err.second, Contains("'config'") && Contains("zstd"));
  }
  SECTION("within the ratio bound, but not what the frame declares") {
    Item(md, "config").raw_length = good.length * kMaxZstdExpansion;
    Publish(name, md);
    StateDict sd;
    std::pair<ErrorCode, std::string> err;
    CHECK_CHEAP(Measure([&] { err = LoadError("mem://" + name, sd, kLoadAll); }));
    CHECK(err.first == ErrorCode::kCorruption);
    CHECK_THAT(err.second, Contains("'config'") && Contains(good.relative_path) &&
                               Contains("the frame declares 300000"));
  }
  ClearMemStore(name);
}

TEST_CASE("hostile: load_all of a [2^30] float32 entry in a tiny file allocates nothing",
          "[hostile][load]") {
  const std::string name = "hostile-loadall";
  SaveSmall(name);
  Metadata md = ReadRaw(name);
  const std::string file = Item(md, "rng").relative_path;
  md.entries["big"] =
      TensorMetadata{DType::kFloat32, {int64_t{1} << 30}, {{{0}, {int64_t{1} << 30}}}};
  StorageInfo info = Item(md, "rng");
  info.length = info.raw_length = 4 * kGiB;
  info.transforms.clear();
  md.storage[MetadataIndex{"big", {0}, {}}] = info;
  md.key_paths["big"] = {"big"};
  REQUIRE_NOTHROW(ValidateMetadata(md, "test"));  // consistent: only the data cannot back it
  Publish(name, md);
  StateDict sd;
  std::pair<ErrorCode, std::string> err;
  CHECK_CHEAP(Measure([&] { err = LoadError("mem://" + name, sd, kLoadAll); }));
  CHECK(err.first == ErrorCode::kCorruption);
  CHECK_THAT(err.second, Contains("'big'") && Contains(file));
  ClearMemStore(name);
}

TEST_CASE("hostile: allocation failures are resource errors naming entry, file and size",
          "[hostile][load]") {
#ifdef DCP_UNDER_SANITIZER
  WARN("skipped: sanitizer allocators abort on petabyte requests instead of throwing");
#else
  const std::string name = "hostile-alloc";
  SaveSmall(name);
  constexpr uint64_t kPiB = uint64_t{1} << 50;  // more than any address space: never allocated
  RegisterBackend(
      "huge",
      [](const std::string& loc) {
        return std::make_shared<HugeFileStore>(MakeMemStore(loc), 4 * kPiB);
      },
      /*replace=*/true);
  Metadata md = ReadRaw(name);
  const std::string file = Item(md, "rng").relative_path;
  SECTION("a blob") {
    Item(md, "rng").length = Item(md, "rng").raw_length = kPiB;
    Publish(name, md);
    StateDict sd = BlobDict();
    std::pair<ErrorCode, std::string> err;
    CHECK_CHEAP(Measure([&] { err = LoadError("huge://" + name, sd); }));
    CHECK(err.first == ErrorCode::kResourceExhausted);
    CHECK_THAT(err.second, Contains("'rng'") && Contains(file) && Contains(std::to_string(kPiB)));
  }
  SECTION("a tensor of load_all") {
    const int64_t n = static_cast<int64_t>(kPiB / 4);
    md.entries["big"] = TensorMetadata{DType::kFloat32, {n}, {{{0}, {n}}}};
    StorageInfo info = Item(md, "rng");
    info.length = info.raw_length = kPiB;
    md.storage[MetadataIndex{"big", {0}, {}}] = info;
    Publish(name, md);
    StateDict sd;
    std::pair<ErrorCode, std::string> err;
    CHECK_CHEAP(Measure([&] { err = LoadError("huge://" + name, sd, kLoadAll); }));
    CHECK(err.first == ErrorCode::kResourceExhausted);
    CHECK_THAT(err.second, Contains("'big'") && Contains(file) && Contains(std::to_string(kPiB)));
  }
  ClearMemStore(name);
#endif
}

TEST_CASE("hostile: inconsistent key paths and nested relative paths are invalid metadata",
          "[hostile][codec]") {
  const std::string name = "hostile-keys";
  SaveSmall(name);
  const Metadata good = ReadRaw(name);
  REQUIRE(good.key_paths.at("model.w") == KeyPath{"model", "w"});
  struct Case {
    const char* what;
    std::function<void(Metadata&)> damage;
    const char* names;  // the entry the error must name
  };
  const Case cases[] = {
      {"disagrees with the fqn",
       [](Metadata& m) {
         m.key_paths["model.w"] = {"model", "v"};
       },
       "'model.w'"},
      {"empty", [](Metadata& m) { m.key_paths["model.w"] = {}; }, "'model.w'"},
      {"an empty key", [](Metadata& m) { m.key_paths["rng"] = {""}; }, "'rng'"},
      {"names no entry", [](Metadata& m) { m.key_paths["ghost"] = {"ghost"}; }, "'ghost'"},
      {"collides with another entry's",
       [](Metadata& m) {
         m.key_paths["rng"] = {"model", "w"};
       },
       "'rng'"},
      {"nests under a tensor",
       [](Metadata& m) {
         m.entries["model.w.x"] = BytesMetadata{};
         m.storage[MetadataIndex{"model.w.x", {}, {}}] = m.storage.at(MetadataIndex{"rng", {}, {}});
       },
       "'model.w.x'"},
      {"nests under a blob",
       [](Metadata& m) {
         m.entries["rng.state"] = BytesMetadata{};
         m.storage[MetadataIndex{"rng.state", {}, {}}] = m.storage.at(MetadataIndex{"rng", {}, {}});
         m.key_paths["rng.state"] = {"rng", "state"};
       },
       "'rng.state'"},
      {"an entry nested a million levels deep (load_all overflowed the stack in O(depth^2))",
       [](Metadata& m) {
         std::string deep = "x";
         for (int i = 0; i < (1 << 20); ++i) deep += ".x";
         m.entries[deep] = BytesMetadata{};
         m.storage[MetadataIndex{deep, {}, {}}] = m.storage.at(MetadataIndex{"rng", {}, {}});
       },
       "nested 1048577 levels deep"},
      {"a key path 257 levels deep",
       [](Metadata& m) {
         KeyPath path(257, "k");
         std::string fqn = "k";
         for (int i = 1; i < 257; ++i) fqn += ".k";
         m.entries[fqn] = BytesMetadata{};
         m.storage[MetadataIndex{fqn, {}, {}}] = m.storage.at(MetadataIndex{"rng", {}, {}});
         m.key_paths[fqn] = path;
       },
       "nested 257 levels deep (limit 256)"},
      {"a relative path with a '/'",
       [](Metadata& m) {
         m.storage.at(MetadataIndex{"rng", {}, {}}).relative_path =
             "sub/" + m.storage.at(MetadataIndex{"rng", {}, {}}).relative_path;
       },
       "'rng'"},
  };
  for (const auto& c : cases) {
    INFO(c.what);
    Metadata md = good;
    c.damage(md);
    CHECK_THROWS_WITH(ValidateMetadata(md, "test"), Contains(c.names));
    Publish(name, md);
    StateDict sd;
    std::pair<ErrorCode, std::string> err;
    CHECK_CHEAP(Measure([&] { err = LoadError("mem://" + name, sd, kLoadAll); }));
    CHECK(err.first == ErrorCode::kCorruption);
    CHECK_THAT(err.second, Contains(c.names) && !Contains("state dict"));
  }
  ClearMemStore(name);
}

TEST_CASE("hostile: unknown transforms and undefined chains are refused by load",
          "[hostile][compression]") {
  const std::string name = "hostile-transforms";
  SaveSmall(name);
  for (const auto& t :
       {std::vector<std::string>{"rot13"}, std::vector<std::string>{"zstd", "zstd"}}) {
    Metadata md = ReadRaw(name);
    Item(md, "rng").transforms = t;
    Publish(name, md);
    StateDict sd = BlobDict();
    std::pair<ErrorCode, std::string> err;
    CHECK_CHEAP(Measure([&] { err = LoadError("mem://" + name, sd); }));
    CHECK(err.first == ErrorCode::kUnsupported);
    CHECK_THAT(err.second, Contains("'rng'"));
  }
  ClearMemStore(name);
}

TEST_CASE("hostile: validation is O(n log n) in the chunks of a tensor",
          "[hostile][codec][scale]") {
  auto tiled = [](const Shape& grid) {
    // A float32 tensor of shape `grid` split into 1-element chunks (the worst case per byte).
    Metadata md;
    TensorMetadata t{DType::kFloat32, grid, {}};
    const int64_t n = NumElements(grid);
    t.chunks.reserve(n);
    for (int64_t i = 0; i < n; ++i) {
      Shape at(grid.size());
      for (size_t d = grid.size(), rest = i; d-- > 0;) at[d] = rest % grid[d], rest /= grid[d];
      t.chunks.push_back({at, Shape(grid.size(), 1)});
      StorageInfo info;
      info.relative_path = "data-0-r0-b0.data";
      info.offset = static_cast<uint64_t>(i) * 4;
      info.length = info.raw_length = 4;
      info.crc32c = 0;
      md.storage.emplace(MetadataIndex{"t", at, {}}, info);
    }
    md.entries["t"] = std::move(t);
    return md;
  };
  for (const Shape& grid : {Shape{200000}, Shape{400, 400}, Shape{50, 50, 50}}) {
    INFO("grid " << ShapeToString(grid));
    Metadata md = tiled(grid);
    CHECK_CHEAP(Measure([&] { CHECK_NOTHROW(ValidateMetadata(md, "test")); }));
    // One chunk grown over its neighbour: an overlap (and a gap elsewhere) is found as fast.
    auto& t = std::get<TensorMetadata>(md.entries.at("t"));
    ChunkMeta& last = t.chunks.back();
    const size_t d = grid.size() - 1;
    last.offsets[d] -= 1;
    StorageInfo info = md.storage.begin()->second;
    md.storage.erase(std::prev(md.storage.end()));
    md.storage.emplace(MetadataIndex{"t", last.offsets, {}}, info);
    // Its item moved with it; the chunk it now overlaps keeps its own.
    CHECK_CHEAP(Measure([&] {
      CHECK_THROWS_WITH(ValidateMetadata(md, "test"), Contains("overlap") || Contains("items"));
    }));
  }
}

// Metadata of one float32 tensor "t" of `shape` stored as `chunks` (offsets, sizes), one item each.
Metadata ChunkLayout(const Shape& shape, const std::vector<std::pair<Shape, Shape>>& chunks) {
  Metadata md;
  TensorMetadata t{DType::kFloat32, shape, {}};
  uint64_t offset = 0;
  for (const auto& [at, sizes] : chunks) {
    t.chunks.push_back({at, sizes});
    StorageInfo info;
    info.relative_path = "data-0-r0-b0.data";
    info.offset = offset;
    info.length = info.raw_length = static_cast<uint64_t>(NumElements(sizes)) * 4;
    info.crc32c = 0;
    offset += info.length;
    md.storage.emplace(MetadataIndex{"t", at, {}}, info);
  }
  md.entries["t"] = std::move(t);
  return md;
}

TEST_CASE("hostile: irregular 3-D layouts validate in bounded time", "[hostile][codec][scale]") {
  // Slab i (thickness 1 along dim 0) cut at i + 1 along dims 1 and 2: 100k chunks whose
  // boundaries form a grid of ~10^13 cells, and a sweep along dim 1 or 2 (the most distinct
  // starts) keeps ~n chunks alive: 174 s before; along dim 0 at most 4 are.
  const int64_t n = 25000;
  std::vector<std::pair<Shape, Shape>> chunks;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t p = i + 1;
    for (auto [y0, y1] : {std::pair{int64_t{0}, p}, std::pair{p, n + 1}}) {
      for (auto [z0, z1] : {std::pair{int64_t{0}, p}, std::pair{p, n + 1}}) {
        if (y1 > y0 && z1 > z0) chunks.push_back({{i, y0, z0}, {1, y1 - y0, z1 - z0}});
      }
    }
  }
  Metadata md = ChunkLayout({n, n + 1, n + 1}, chunks);
  CHECK_CHEAP(Measure([&] { CHECK_NOTHROW(ValidateMetadata(md, "test")); }));
  // Three families of sticks, each family long along one dimension: a sweep along any of them
  // keeps one family alive (~10^8 comparisons). Refused, cheaply, naming the tensor.
  const int64_t m = 150, l = 3 * m;
  chunks.clear();
  for (int64_t a = 0; a < m; ++a) {
    for (int64_t b = 0; b < m; ++b) {
      chunks.push_back({{0, a, b}, {l, 1, 1}});
      chunks.push_back({{a, 0, m + b}, {1, l, 1}});
      chunks.push_back({{m + a, m + b, 0}, {1, 1, l}});
    }
  }
  md = ChunkLayout({l, l, l}, chunks);
  CHECK_CHEAP(Measure([&] {
    CHECK_THROWS_WITH(ValidateMetadata(md, "test"),
                      Contains("tensor 't'") && Contains("irregular layout"));
  }));
}

TEST_CASE("hostile: an empty shard at another rank's offset saves and loads at any world size",
          "[hostile][reshard][empty]") {
  const std::string name = "hostile-empty-shard";
  ClearMemStore(name);
  const TensorView full = RandomTensor(DType::kFloat32, {1000}, 5);
  const int64_t sizes[] = {1, 0, 499, 250, 250};
  auto shard_dict = [&](const TensorView& src, int64_t begin, int64_t n) {
    ShardedTensor st;
    st.dtype = DType::kFloat32;
    st.global_shape = {1000};
    st.local_shards.push_back({src.Narrow({begin}, {n}), {begin}});
    StateDict sd;
    sd.Set("w", st);
    return sd;
  };
  RequireNoErrors(RunRanks(5, [&](int r, Communicator& comm) {
    int64_t begin = 0;
    for (int k = 0; k < r; ++k) begin += sizes[k];
    StateDict sd = shard_dict(full, begin, sizes[r]);
    Save(sd, "mem://" + name, comm);
  }));
  const Metadata md = ReadMetadata("mem://" + name);
  CHECK(std::get<TensorMetadata>(md.entries.at("w")).chunks.size() == 4);
  for (int world : {3, 5}) {
    INFO("world " << world);
    const TensorView dst = TensorView::Allocate(DType::kFloat32, {1000});
    RequireNoErrors(RunRanks(world, [&](int r, Communicator& comm) {
      int64_t begin = 0, n = 0;
      if (world == 5) {
        for (int k = 0; k < r; ++k) begin += sizes[k];
        n = sizes[r];
      } else {
        auto [b, e] = dcp::testing::RowRange(1000, r, world);
        begin = b, n = e - b;
      }
      StateDict sd = shard_dict(dst, begin, n);
      Load(sd, "mem://" + name, comm);
    }));
    CHECK(SameElements(dst, full));
  }
  ClearMemStore(name);
}
