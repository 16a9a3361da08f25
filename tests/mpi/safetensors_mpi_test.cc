// Hugging Face safetensors checkpoints at several ranks (1, 2 and 4 in CTest): the numpy-written
// sharded directory and single file (tests/fixtures/safetensors) load into row shards and into
// column shards at this run's world size, bit-exact against the values numpy recorded; then what
// was loaded saves as dcp at this world size and loads back whole. And safetensors saves at this
// world size (shards exchanged among the ranks, each file written by one rank) load back whole,
// resharded along another dimension, and at another world size (rank 0 alone).
#include <catch2/catch.hpp>
#include <cstring>

#include "dcp/checkpoint.h"
#include "mpi/mpi_support.h"
#include "support/test_support.h"

namespace dcp {
namespace {

using testing::Comm;
using testing::ExpectedTensor;
using testing::RemoveSharedDir;
using testing::RowRange;
using testing::SharedDir;

const std::string kFixtures = DCP_SAFETENSORS_FIXTURES;

// The bytes of the box [b, e) along `dim` of a row-major tensor.
std::string Slice(const std::string& full, const Shape& shape, size_t esize, size_t dim, int64_t b,
                  int64_t e) {
  size_t inner = esize;
  for (size_t k = dim + 1; k < shape.size(); ++k) inner *= static_cast<size_t>(shape[k]);
  size_t outer = 1;
  for (size_t k = 0; k < dim; ++k) outer *= static_cast<size_t>(shape[k]);
  const size_t row = static_cast<size_t>(shape[dim]) * inner;
  std::string out;
  for (size_t o = 0; o < outer; ++o) {
    out.append(full, o * row + static_cast<size_t>(b) * inner, static_cast<size_t>(e - b) * inner);
  }
  return out;
}

// Each rank's piece along `dim` of every tensor of rank > dim; whole tensors otherwise.
struct Request {
  StateDict sd;
  std::map<std::string, std::pair<TensorView, std::pair<int64_t, int64_t>>> views;
};

void Fill(Request& r, const std::map<std::string, ExpectedTensor>& want, size_t dim,
          const std::set<std::string>& blobs) {
  const int rank = Comm().rank(), world = Comm().size();
  for (const auto& [name, t] : want) {
    if (blobs.count(name)) {
      r.sd.Set(name, Blob{});
      continue;
    }
    if (t.shape.size() <= dim) {
      TensorView v = TensorView::Allocate(t.dtype, t.shape);
      r.views.emplace(name, std::make_pair(v, std::make_pair(int64_t{-1}, int64_t{-1})));
      r.sd.Set(name, v);
      continue;
    }
    const auto [b, e] = RowRange(t.shape[dim], rank, world);
    Shape local = t.shape, offsets(t.shape.size(), 0);
    local[dim] = e - b;
    offsets[dim] = b;
    TensorView v = TensorView::Allocate(t.dtype, local);
    ShardedTensor st{t.dtype, t.shape, {}};
    if (e > b) st.local_shards.push_back({v, offsets});
    r.sd.Set(name, st);
    r.views.emplace(name, std::make_pair(v, std::make_pair(b, e)));
  }
}

void Check(const Request& r, const std::map<std::string, ExpectedTensor>& want, size_t dim) {
  for (const auto& [name, got] : r.views) {
    const ExpectedTensor& t = want.at(name);
    const auto [b, e] = got.second;
    const std::string expect =
        b < 0 ? t.bytes : Slice(t.bytes, t.shape, ElementSize(t.dtype), dim, b, e);
    INFO("rank " << Comm().rank() << " " << name << " dim " << dim);
    CHECK(std::string(static_cast<const char*>(got.first.data), got.first.nbytes()) == expect);
  }
}

}  // namespace

TEST_CASE("mpi: safetensors checkpoints load resharded bit-exact", "[mpi][safetensors]") {
  for (const std::string which : {"sharded", "single"}) {
    const auto want = testing::ReadSafetensorsExpected(kFixtures, which);
    const std::set<std::string> blobs =
        which == "single" ? std::set<std::string>{"rng"} : std::set<std::string>{};
    for (size_t dim : {0, 1}) {
      DYNAMIC_SECTION(which << " dim " << dim) {
        Request r;
        Fill(r, want, dim, blobs);
        const LoadResult res = Load(r.sd, kFixtures + "/" + which, Comm());
        CHECK(res.metadata.library_version == "safetensors");
        Check(r, want, dim);
        for (const auto& b : blobs) {
          CHECK(std::get<Blob>(*r.sd.Find(b)).bytes == want.at(b).bytes);
        }

        // What was loaded saves as dcp at this world size and loads back, whole, on every rank.
        const std::string dir = SharedDir("st-resave");
        Save(r.sd, dir, Comm());
        Request whole;
        Fill(whole, want, 99, blobs);  // no tensor has 100 dimensions: every one whole
        Load(whole.sd, dir, Comm());
        Check(whole, want, 99);
        RemoveSharedDir(dir);
      }
    }
  }
}

TEST_CASE("mpi: safetensors saves at this world size reshard on load", "[mpi][safetensors]") {
  for (const std::string which : {"sharded", "single"}) {
    auto want = testing::ReadSafetensorsExpected(kFixtures, which);
    const std::set<std::string> blobs =
        which == "single" ? std::set<std::string>{"rng"} : std::set<std::string>{};
    // A tensor over the 1 MiB exchange rounds: its rows travel in several rounds.
    const TensorView big = testing::RandomTensor(DType::kFloat32, {700, 600}, 24);
    want["big"] = ExpectedTensor{DType::kFloat32, big.shape, "",
                                 std::string(static_cast<const char*>(big.data), big.nbytes())};
    for (int files : {1, 2}) {
      DYNAMIC_SECTION(which << " files_per_rank " << files) {
        // Row shards of every tensor, filled from the values numpy recorded.
        Request rows;
        Fill(rows, want, 0, blobs);
        for (auto& [name, got] : rows.views) {
          const ExpectedTensor& t = want.at(name);
          const auto [b, e] = got.second;
          const std::string bytes =
              b < 0 ? t.bytes : Slice(t.bytes, t.shape, ElementSize(t.dtype), 0, b, e);
          std::memcpy(got.first.data, bytes.data(), bytes.size());
        }
        for (const auto& b : blobs) rows.sd.Set(b, Blob{want.at(b).bytes});

        const std::string dir = SharedDir("st-save");
        SaveOptions so;
        so.storage.files_per_rank = files;
        so.storage.memory_budget_bytes = 4 << 20;
        const SaveResult saved = Save(rows.sd, "file://" + dir + "?format=safetensors", Comm(), so);
        CHECK(saved.metadata.world_size == Comm().size());

        Request whole;
        Fill(whole, want, 99, blobs);
        Load(whole.sd, dir, Comm());
        Check(whole, want, 99);
        for (const auto& b : blobs) {
          CHECK(std::get<Blob>(*whole.sd.Find(b)).bytes == want.at(b).bytes);
        }
        Request cols;
        Fill(cols, want, 1, blobs);
        Load(cols.sd, dir, Comm());
        Check(cols, want, 1);
        if (Comm().rank() == 0) {  // another world size: one rank
          Request alone;
          Fill(alone, want, 99, blobs);
          Load(alone.sd, dir);
          Check(alone, want, 99);
        }
        Comm().Barrier("st-save checked");
        RemoveSharedDir(dir);
      }
    }
  }
}

}  // namespace dcp
