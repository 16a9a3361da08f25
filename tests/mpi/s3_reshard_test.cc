// s3:// across processes: a 4-rank save and a resharding 3-rank load through the real test
// server (Ceph RGW). Two mpirun jobs (tests/s3/mpi_reshard.sh): "[.s3save]" at 4 ranks writes
// the checkpoint at $DCP_S3_MPI_URI, "[.s3load]" at 3 ranks loads it with a different row split
// and checks every value. Hidden tags: the ordinary mpi_np* runs do not run them. Without a
// server (or without $DCP_S3_MPI_URI) they SKIP and say why.
#include <catch2/catch.hpp>
#include <cstdlib>

#include "dcp/dcp.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/registry.h"
#include "mpi/mpi_support.h"
#include "support/s3_test_support.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;

namespace {

// ~37 MB of float32: each of 4 ranks writes a ~9 MB chunk (a 2-part multipart upload), and each
// of 3 loading ranks reads parts of two of them (ranged GETs).
constexpr int64_t kRows = 9001, kCols = 1031;

std::string UriOrSkip() {
  std::string why = S3SkipReason();
  const char* uri = std::getenv("DCP_S3_MPI_URI");
  if (why.empty() && (uri == nullptr || *uri == '\0')) why = "DCP_S3_MPI_URI is not set";
  if (!why.empty()) {
    if (Comm().rank() == 0) WARN("SKIPPED: " << why);
    return "";
  }
  return uri;
}

struct Model {
  TensorView w_full = RandomTensor(DType::kFloat32, {kRows, kCols}, 11);
  TensorView emb_full = RandomTensor(DType::kBFloat16, {4099, 64}, 12);
  TensorView bias = RandomTensor(DType::kFloat32, {kCols}, 13);  // replicated
  std::vector<TensorView> keep;
  StateDict sd;
  // Row-sharded over the current world; `fill`: this rank's rows of the full tensors.
  explicit Model(bool fill) {
    const int r = Comm().rank(), n = Comm().size();
    for (auto* full : {&w_full, &emb_full}) {
      const int64_t rows = full->shape[0], cols = full->shape[1];
      auto [b, e] = RowRange(rows, r, n);
      TensorView local = fill ? Clone(full->Narrow({b, 0}, {e - b, cols}))
                              : TensorView::Allocate(full->dtype, {e - b, cols});
      keep.push_back(local);
      ShardedTensor st{full->dtype, {rows, cols}, {}};
      if (e > b) st.local_shards.push_back({local, {b, 0}});
      sd.Set(full == &w_full ? "w" : "emb", st);
    }
    keep.push_back(fill ? bias : TensorView::Allocate(DType::kFloat32, {kCols}));
    sd.Set("bias", keep.back());
    sd.Set("step", Blob{fill ? "step 42" : ""});
  }
};

}  // namespace

TEST_CASE("s3 mpi: 4-rank save through s3://", "[.s3save]") {
  const std::string uri = UriOrSkip();
  if (uri.empty()) return;
  REQUIRE(Comm().size() == 4);
  Model m(true);
  SaveOptions so;
  so.storage.files_per_rank = 2;
  Metadata md = Save(m.sd, uri, Comm(), so).metadata;
  CHECK(md.world_size == 4);
  if (Comm().rank() == 0) {
    int data = 0, multipart = 0;
    auto store = OpenStore(uri);
    for (const auto& n : store->List()) {
      if (!IsDataObjectName(n)) continue;
      ++data;
      multipart += *store->Size(n) > (uint64_t{8} << 20);  // over one 8 MiB part
    }
    CHECK(data == 8);       // 4 ranks x 2 files
    CHECK(multipart == 4);  // each rank's chunk of w went up in parts
  }
}

TEST_CASE("s3 mpi: resharding 3-rank load through s3://", "[.s3load]") {
  const std::string uri = UriOrSkip();
  if (uri.empty()) return;
  REQUIRE(Comm().size() == 3);
  Model expect(true), back(false);
  CHECK(ReadMetadata(uri).world_size == 4);
  Load(back.sd, uri, Comm());
  for (size_t i = 0; i < back.keep.size(); ++i) {
    INFO("tensor " << i << " on rank " << Comm().rank());
    CHECK(SameElements(back.keep[i], expect.keep[i]));
  }
  CHECK(std::get<Blob>(*back.sd.Find("step")).bytes == "step 42");
}
