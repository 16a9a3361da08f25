// PyTorch DCP checkpoints at several ranks: every fixture torch 2.11 wrote (some at 4 ranks)
// loads row-split and column-split at this run's world size (1, 2, 3 and 4 in CTest), bit-exact
// against its expected safetensors; and a checkpoint dcp writes in torch's layout at N ranks
// loads back resharded.
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string_view>

#include "dcp/checkpoint.h"
#include "mpi/mpi_support.h"
#include "support/test_support.h"

namespace dcp {
namespace {

using testing::Comm;
using testing::RemoveSharedDir;
using testing::SharedDir;
using Json = nlohmann::json;
using testing::ReadFileBytes;
using testing::ReadSafetensors;

const std::string kFixtures = DCP_TORCH_DCP_FIXTURES;

std::pair<int64_t, int64_t> Split(int64_t n, int rank, int world) {
  const int64_t base = n / world, extra = n % world;
  const int64_t b = rank * base + std::min<int64_t>(rank, extra);
  return {b, b + base + (rank < extra ? 1 : 0)};
}

// What each rank asks for: along `dim` its Split piece of every tensor of rank > dim, the
// whole tensor otherwise, and every byte entry.
struct Request {
  StateDict sd;
  std::vector<std::pair<std::string, std::vector<char>>> buffers;  // fqn -> local bytes
  std::map<std::string, std::pair<int64_t, int64_t>> ranges;
};

Request MakeRequest(const Json& entries, size_t dim, Request& r) {
  const int rank = Comm().rank(), world = Comm().size();
  r.buffers.reserve(entries.size());
  for (const auto& [fqn, e] : entries.items()) {
    if (e["kind"] == "bytes") {
      r.sd.Set(fqn, Blob{});
      continue;
    }
    const DType dtype = *DTypeFromName(e["dtype"].get<std::string>().substr(6));
    const Shape shape = e["shape"].get<Shape>();
    if (shape.size() <= dim) {
      auto& buf =
          r.buffers.emplace_back(fqn, std::vector<char>(NumElements(shape) * ElementSize(dtype)))
              .second;
      r.sd.Set(fqn, TensorView::FromContiguous(buf.data(), dtype, shape));
      continue;
    }
    const auto [b, end] = Split(shape[dim], rank, world);
    Shape local = shape, offsets(shape.size(), 0);
    local[dim] = end - b;
    offsets[dim] = b;
    auto& buf =
        r.buffers.emplace_back(fqn, std::vector<char>(NumElements(local) * ElementSize(dtype)))
            .second;
    ShardedTensor st{dtype, shape, {}};
    if (end > b)
      st.local_shards.push_back({TensorView::FromContiguous(buf.data(), dtype, local), offsets});
    r.sd.Set(fqn, st);
    r.ranges[fqn] = {b, end};
  }
  return {};
}

// The bytes of the box [b, e) along `dim` of a row-major tensor.
std::string Slice(const std::string& full, const Shape& shape, size_t esize, size_t dim, int64_t b,
                  int64_t e) {
  size_t inner = esize;
  for (size_t k = dim + 1; k < shape.size(); ++k) inner *= static_cast<size_t>(shape[k]);
  int64_t outer = 1;
  for (size_t k = 0; k < dim; ++k) outer *= shape[k];
  std::string out;
  for (int64_t o = 0; o < outer; ++o) {
    const size_t row = static_cast<size_t>(o * shape[dim]) * inner;
    out.append(full, row + static_cast<size_t>(b) * inner, static_cast<size_t>(e - b) * inner);
  }
  return out;
}

void CheckRequest(const Request& r, const Json& entries,
                  const std::map<std::string, std::string>& want, size_t dim) {
  for (const auto& [fqn, buf] : r.buffers) {
    INFO(fqn << " split along " << dim << " at rank " << Comm().rank() << "/" << Comm().size());
    const Json& e = entries[fqn];
    const DType dtype = *DTypeFromName(e["dtype"].get<std::string>().substr(6));
    const Shape shape = e["shape"].get<Shape>();
    std::string expected = want.at(fqn);
    auto it = r.ranges.find(fqn);
    if (it != r.ranges.end()) {
      expected =
          Slice(expected, shape, ElementSize(dtype), dim, it->second.first, it->second.second);
    }
    REQUIRE(buf.size() == expected.size());
    // An empty local shard has a null data(); memcmp must not see it.
    CHECK(std::string_view(buf.data(), buf.size()) == expected);
  }
  for (const auto& [fqn, e] : entries.items()) {
    if (e["kind"] == "bytes") {
      const auto* blob = std::get_if<Blob>(r.sd.Find(fqn));
      REQUIRE(blob);
      CHECK(!blob->bytes.empty());
    }
  }
}

TEST_CASE("mpi: PyTorch DCP fixtures load row- and column-split at any world size",
          "[mpi][torchdcp]") {
  for (const char* name : {"single_dtypes", "model_adamw", "dist4_dtensor"}) {
    const Json entries = Json::parse(ReadFileBytes(kFixtures + "/" + name + ".json"))["entries"];
    const auto want = ReadSafetensors(kFixtures + "/" + name + ".expected.safetensors");
    for (size_t dim : {0, 1}) {
      INFO(name);
      Request r;
      MakeRequest(entries, dim, r);
      Load(r.sd, kFixtures + "/" + name, Comm());
      CheckRequest(r, entries, want, dim);
    }
  }
}

TEST_CASE("mpi: a PyTorch DCP checkpoint dcp writes at N ranks loads back resharded",
          "[mpi][torchdcp]") {
  const std::string dir = SharedDir("torchdcp");
  for (const char* scheme : {"torchdcp://", "torchdcp113://"}) {
    const char* name = "dist4_dtensor";
    const Json entries = Json::parse(ReadFileBytes(kFixtures + "/" + name + ".json"))["entries"];
    const auto want = ReadSafetensors(kFixtures + "/" + name + ".expected.safetensors");
    Request rows;
    MakeRequest(entries, 0, rows);
    Load(rows.sd, kFixtures + "/" + name, Comm());
    SaveOptions so;
    so.storage.overwrite = true;
    Save(rows.sd, scheme + dir + "/ck", Comm(), so);
    // DCP_TEST_TORCHDCP_OUT keeps a copy of this multi-rank torchdcp:// save for an outside reader
    // (tests/gpu/torch2_load_check.py: torch 2.x's own loader, on the GPU machine).
    if (const char* keep = std::getenv("DCP_TEST_TORCHDCP_OUT");
        keep != nullptr && std::string_view(scheme) == "torchdcp://") {
      Save(rows.sd, std::string(scheme) + keep, Comm(), so);
    }
    Request cols;
    MakeRequest(entries, 1, cols);
    Load(cols.sd, dir + "/ck", Comm());
    INFO(scheme);
    CheckRequest(cols, entries, want, 1);
    // Byte entries come back as they were loaded (torch.save bytes, unchanged).
    for (const auto& [fqn, e] : entries.items()) {
      if (e["kind"] == "bytes") {
        CHECK(std::get<Blob>(*cols.sd.Find(fqn)).bytes == std::get<Blob>(*rows.sd.Find(fqn)).bytes);
      }
    }
  }
  RemoveSharedDir(dir);
}

}  // namespace
}  // namespace dcp
