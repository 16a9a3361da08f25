// Saves in Hugging Face safetensors (storage/format/safetensors_writer.cc): whole tensors
// assembled across ranks, every dtype the format names, byte entries, resharded loads, refusals,
// a rank failing mid-exchange, and an independent numpy reader of what dcp wrote
// (tests/fixtures/safetensors/read_safetensors.py).
#include <catch2/catch.hpp>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dcp/storage/format/layout.h"
#include "dcp/storage/format/safetensors.h"
#include "dcp/storage/registry.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::RandomTensor;
using dcp::testing::RowRange;
using dcp::testing::RowSlice;
using dcp::testing::RunRanks;
using dcp::testing::TempDir;

namespace {

const std::string kFixtures = DCP_SAFETENSORS_FIXTURES;

std::string Bytes(const TensorView& v) {
  return std::string(static_cast<const char*>(v.data), v.nbytes());
}

// The full tensors of the tests, by fqn (the same on every rank: seeded).
struct Model {
  std::map<std::string, TensorView> tensors;
  std::map<std::string, std::string> blobs;
};

Model MakeModel() {
  Model m;
  int seed = 1;
  auto add = [&](const std::string& name, DType d, Shape s) {
    m.tensors.emplace(name, RandomTensor(d, std::move(s), static_cast<uint64_t>(seed++)));
  };
  add("model.embed.weight", DType::kFloat32, {64, 33});
  add("model.norm.weight", DType::kBFloat16, {7, 5});
  add("model.head.weight", DType::kFloat16, {3, 4, 2});
  add("model.q.weight", DType::kFloat8_e4m3fn, {16});
  add("model.k.weight", DType::kFloat8_e5m2, {4, 4});
  add("model.scale", DType::kFloat8_e8m0fnu, {5});
  add("model.big", DType::kFloat64, {600, 300});  // 1.4 MB: cut into row units below
  add("step", DType::kInt64, {});
  add("empty", DType::kUInt8, {0, 5});
  m.blobs = {{"rng", std::string("\x00\x01\xff state", 9)}, {"nothing", std::string()}};
  return m;
}

// A state dict of `m` as rank `rank` of `world` holds it: 2-d and larger tensors row-sharded,
// except "model.k.weight", column-sharded; the rest whole on every rank (the planner writes
// each once). Byte entries on every rank.
StateDict Shards(const Model& m, int rank, int world, std::vector<TensorView>& keep) {
  StateDict sd;
  for (const auto& [name, full] : m.tensors) {
    if (world == 1 || full.shape.size() < 2) {
      sd.Set(name, full);
      continue;
    }
    Shape offsets(full.shape.size(), 0), sizes = full.shape;
    const size_t dim = name == "model.k.weight" ? 1 : 0;
    const auto [b, e] = RowRange(full.shape[dim], rank, world);
    offsets[dim] = b;
    sizes[dim] = e - b;
    ShardedTensor st{full.dtype, full.shape, {}};
    if (e > b) {
      TensorView local = TensorView::Allocate(full.dtype, sizes);
      CopyTensor(local, full.Narrow(offsets, sizes));
      keep.push_back(local);
      st.local_shards.push_back({local, offsets});
    }
    sd.Set(name, st);
  }
  for (const auto& [name, bytes] : m.blobs) sd.Set(name, Blob{bytes});
  return sd;
}

// A whole, zeroed destination for every entry of `m`.
StateDict WholeLike(const Model& m, std::map<std::string, TensorView>& views) {
  StateDict sd;
  for (const auto& [name, full] : m.tensors) {
    views.emplace(name, TensorView::Allocate(full.dtype, full.shape));
    sd.Set(name, views.at(name));
  }
  for (const auto& [name, bytes] : m.blobs) sd.Set(name, Blob{});
  return sd;
}

void CheckWhole(const Model& m, const StateDict& sd, const std::map<std::string, TensorView>& v) {
  for (const auto& [name, full] : m.tensors) {
    INFO(name);
    CHECK(Bytes(v.at(name)) == Bytes(full));
  }
  for (const auto& [name, bytes] : m.blobs) {
    INFO(name);
    CHECK(std::get<Blob>(*sd.Find(name)).bytes == bytes);
  }
}

// Row shards of every tensor at `world` ranks, loaded and compared with the full tensors.
void LoadRowShards(const Model& m, const std::string& uri, int world) {
  dcp::testing::RequireNoErrors(RunRanks(world, [&](int r, Communicator& comm) {
    StateDict sd;
    std::map<std::string, std::pair<TensorView, std::pair<int64_t, int64_t>>> mine;
    for (const auto& [name, full] : m.tensors) {
      if (full.shape.empty()) {
        TensorView v = TensorView::Allocate(full.dtype, full.shape);
        sd.Set(name, v);
        mine.emplace(name, std::make_pair(v, std::make_pair(int64_t{0}, int64_t{1})));
        continue;
      }
      const auto [b, e] = RowRange(full.shape[0], r, world);
      Shape local = full.shape, offsets(full.shape.size(), 0);
      local[0] = e - b;
      offsets[0] = b;
      TensorView v = TensorView::Allocate(full.dtype, local);
      ShardedTensor st{full.dtype, full.shape, {}};
      if (e > b) st.local_shards.push_back({v, offsets});
      sd.Set(name, st);
      mine.emplace(name, std::make_pair(v, std::make_pair(b, e)));
    }
    Load(sd, uri, comm);
    for (const auto& [name, got] : mine) {
      const TensorView& full = m.tensors.at(name);
      dcp::testing::Expect(
          Bytes(got.first) == RowSlice(Bytes(full), full.shape, ElementSize(full.dtype),
                                       got.second.first, got.second.second),
          "rank " + std::to_string(r) + ": " + name + " differs");
    }
  }));
}

// A planner whose ResolveData fails on one rank: a failure in the middle of the exchange.
class FailingPlanner : public DefaultSavePlanner {
 public:
  explicit FailingPlanner(bool fail) : fail_(fail) {}
  ResolvedData ResolveData(const WriteItem& item) const override {
    if (fail_) throw IoError("injected failure resolving " + item.index.fqn, false);
    return DefaultSavePlanner::ResolveData(item);
  }

 private:
  bool fail_;
};

std::string MessageOfPtr(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  }
}

// A python3 with numpy, or "" (the check is skipped).
std::string NumpyPython() {
  for (const char* py : {"python3", "/usr/bin/python3"}) {
    const std::string cmd = std::string(py) + " -c 'import numpy' >/dev/null 2>&1";
    if (std::system(cmd.c_str()) == 0) return py;
  }
  return {};
}

}  // namespace

TEST_CASE("safetensors: a save round-trips every dtype it names and byte entries",
          "[safetensors][option:StorageOptions::format]") {
  TempDir dir("st-rt");
  const Model m = MakeModel();
  for (const std::string scheme : {"file", "mem"}) {
    for (int files : {1, 2}) {
      DYNAMIC_SECTION(scheme << " files_per_rank=" << files) {
        const std::string base = scheme == "mem"
                                     ? "mem://st-rt-" + std::to_string(files)
                                     : "file://" + dir.path() + "/" + std::to_string(files);
        const std::string uri = base + "?format=safetensors";
        std::vector<TensorView> keep;
        SaveOptions so;
        so.storage.files_per_rank = files;
        so.storage.memory_budget_bytes = 4 << 20;  // rounds of 1 MiB: model.big in two units
        const Metadata md = Save(Shards(m, 0, 1, keep), uri, so).metadata;
        CHECK(md.entries.size() == m.tensors.size() + m.blobs.size());
        CHECK(std::holds_alternative<BytesMetadata>(md.entries.at("rng")));

        auto store = OpenStore(base);
        size_t data_files = 0;
        for (const auto& n : store->List()) data_files += IsSafetensorsDataName(n);
        CHECK(data_files == static_cast<size_t>(files));
        const Metadata read = ReadMetadata(base);
        CHECK(read.save_id == md.save_id);
        CHECK(read.TotalStoredBytes() == md.TotalStoredBytes());
        CHECK(read.entries.size() == md.entries.size());

        std::map<std::string, TensorView> views;
        StateDict back = WholeLike(m, views);
        Load(back, base);
        CheckWhole(m, back, views);
        // LoadAll nests by the dots, as for any safetensors checkpoint.
        const StateDict all = LoadAll(base);
        CHECK(all.Find("model") != nullptr);
        CHECK(std::get<Blob>(*all.Find("rng")).bytes == m.blobs.at("rng"));
      }
    }
  }
}

TEST_CASE("safetensors: saves from 2 and 4 ranks with row and column shards reshard on load",
          "[safetensors]") {
  TempDir dir("st-ranks");
  const Model m = MakeModel();
  for (int world : {2, 4}) {
    for (int files : {1, 2}) {
      DYNAMIC_SECTION("world " << world << " files_per_rank=" << files) {
        const std::string base =
            "file://" + dir.path() + "/w" + std::to_string(world) + "-" + std::to_string(files);
        std::vector<std::string> save_ids(static_cast<size_t>(world));
        dcp::testing::RequireNoErrors(RunRanks(world, [&](int r, Communicator& comm) {
          std::vector<TensorView> keep;
          SaveOptions so;
          so.storage.files_per_rank = files;
          so.storage.memory_budget_bytes = 4 << 20;
          save_ids[static_cast<size_t>(r)] =
              Save(Shards(m, r, world, keep), base + "?format=safetensors", comm, so)
                  .metadata.save_id;
        }));
        CHECK(save_ids[0] == save_ids.back());
        // One file per rank and bucket (there are more tensors than files here).
        size_t data_files = 0;
        for (const auto& n : OpenStore(base)->List()) data_files += IsSafetensorsDataName(n);
        CHECK(data_files == static_cast<size_t>(world * files));

        std::map<std::string, TensorView> views;
        StateDict back = WholeLike(m, views);
        Load(back, base);
        CheckWhole(m, back, views);
        LoadRowShards(m, base, 3);
      }
    }
  }
}

TEST_CASE("safetensors: a save refuses what the format cannot hold", "[safetensors]") {
  StateDict sd;
  sd.Set("ok", RandomTensor(DType::kFloat32, {2}, 1))
      .Set("z", RandomTensor(DType::kComplex128, {2}, 2));
  try {
    Save(sd, "mem://st-refuse?format=safetensors");
    FAIL("the save succeeded");
  } catch (const CollectiveError& e) {
    CHECK(e.failures()[0].code == ErrorCode::kUnsupported);
    CHECK_THAT(e.what(), Contains("'z'") && Contains("complex128") && Contains("safetensors"));
  }
  CHECK_FALSE(OpenStore("mem://st-refuse")->Size(kSafetensorsIndexName));
  // At 2 ranks the rank holding it fails the plan phase for both.
  const auto errors = RunRanks(2, [&](int r, Communicator& comm) {
    StateDict part;
    part.Set("ok", RandomTensor(DType::kFloat32, {2}, 1));
    if (r == 1) part.Set("z", RandomTensor(DType::kComplex128, {2}, 2));
    Save(part, "mem://st-refuse2?format=safetensors", comm);
  });
  for (const auto& e : errors) {
    REQUIRE(e);
    CHECK_THAT(MessageOfPtr(e), Contains("'z'"));
  }
  SaveOptions zstd;
  zstd.storage.compression = Compression::kZstd;
  StateDict fine;
  fine.Set("ok", RandomTensor(DType::kFloat32, {2}, 1));
  CHECK_THROWS_WITH(Save(fine, "mem://st-refuse3?format=safetensors", zstd),
                    Contains("compression"));
  // An empty state dict: its index would map nothing, which the reader refuses (an empty
  // weight_map); refused before anything is written.
  try {
    Save(StateDict{}, "mem://st-refuse4?format=safetensors");
    FAIL("the save succeeded");
  } catch (const CollectiveError& e) {
    CHECK(e.failures()[0].code == ErrorCode::kInvalidArgument);
    CHECK_THAT(e.what(), Contains("is empty") && Contains("mem://st-refuse4"));
  }
  CHECK(OpenStore("mem://st-refuse4")->List().empty());
}

TEST_CASE("safetensors: a rank failing mid-exchange fails every rank at once and leaves nothing",
          "[safetensors]") {
  TempDir dir("st-fail");
  const Model m = MakeModel();
  const std::string base = "file://" + dir.path() + "/c";
  const auto start = std::chrono::steady_clock::now();
  const auto errors = RunRanks(
      3,
      [&](int r, Communicator& comm) {
        std::vector<TensorView> keep;
        FailingPlanner planner(r == 1);
        SaveOptions so;
        so.planner = &planner;
        so.storage.memory_budget_bytes = 4 << 20;
        Save(Shards(m, r, 3, keep), base + "?format=safetensors", comm, so);
      },
      std::chrono::seconds(20));
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(15));
  for (size_t r = 0; r < errors.size(); ++r) {
    INFO("rank " << r);
    REQUIRE(errors[r]);
    CHECK_THAT(MessageOfPtr(errors[r]), Contains("injected failure"));
  }
  auto store = OpenStore(base);
  CHECK_FALSE(store->Size(kSafetensorsIndexName));
  for (const auto& n : store->List()) CHECK_FALSE(IsSafetensorsDataName(n));
}

TEST_CASE("safetensors: an independent numpy reader reads what dcp writes", "[safetensors]") {
  const std::string py = NumpyPython();
  if (py.empty()) {
    dcp::testing::SkipTestCase("no python3 with numpy for the independent safetensors reader");
    return;
  }
  TempDir dir("st-numpy");
  const Model m = MakeModel();
  dcp::testing::RequireNoErrors(RunRanks(2, [&](int r, Communicator& comm) {
    std::vector<TensorView> keep;
    SaveOptions so;
    so.storage.memory_budget_bytes = 4 << 20;
    Save(Shards(m, r, 2, keep), "file://" + dir.path() + "/c?format=safetensors", comm, so);
  }));
  nlohmann::json expected = nlohmann::json::object();
  static const char* kHex = "0123456789abcdef";
  auto hex = [](const std::string& bytes) {
    std::string out;
    for (unsigned char c : bytes) {
      out.push_back(kHex[c >> 4]);
      out.push_back(kHex[c & 15]);
    }
    return out;
  };
  for (const auto& [name, full] : m.tensors) {
    expected[name] = {{"dtype", *SafetensorsDTypeName(full.dtype)},
                      {"shape", full.shape},
                      {"hex", hex(Bytes(full))}};
  }
  for (const auto& [name, bytes] : m.blobs) {
    expected[name] = {{"dtype", "U8"},
                      {"shape", Shape{static_cast<int64_t>(bytes.size())}},
                      {"hex", hex(bytes)},
                      {"blob", true}};
  }
  const std::string want = dir.path() + "/expected.json";
  std::ofstream(want) << expected.dump();
  const std::string cmd = py + " " + kFixtures + "/read_safetensors.py " + dir.path() + "/c " +
                          want + " > " + dir.path() + "/out.txt 2>&1";
  const int rc = std::system(cmd.c_str());
  INFO(dcp::testing::ReadFileBytes(dir.path() + "/out.txt"));
  CHECK(rc == 0);
}
