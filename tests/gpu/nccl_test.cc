// NcclCommunicator under mpirun: every collective with empty, small and large messages and
// every root, a save and a resharded load over NCCL, and a peer that never answers becoming a
// CollectiveError (then an aborted communicator) instead of a hang.
// Exits 77 (CTest: Skipped) on every rank when the node lacks one CUDA device per rank.
#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdio>
#include <filesystem>

#include "dcp/mpi_communicator.h"
#include "dcp/nccl_communicator.h"
#include "support/catch_runner.h"
#include "support/fake_device.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {
NcclCommunicator* g_nccl = nullptr;
MpiCommunicator* g_mpi = nullptr;

std::string Message(int rank, size_t n) {
  std::string s(n, '\0');
  FillRandom(s.data(), n, 1000 + rank * 7 + n);
  return s;
}
}  // namespace

TEST_CASE("nccl: collectives carry messages of any size", "[nccl]") {
  NcclCommunicator& c = *g_nccl;
  const int n = c.size(), me = c.rank();
  for (size_t len : {size_t{0}, size_t{1}, size_t{1000}, size_t{(3 << 20) + 5}}) {
    for (int root = 0; root < n; ++root) {
      auto g = c.Gather(Message(me, len + me), root, "gather");
      if (me == root) {
        REQUIRE(g.size() == static_cast<size_t>(n));
        for (int r = 0; r < n; ++r) CHECK(g[r] == Message(r, len + r));
      } else {
        CHECK(g.empty());
      }
      std::vector<std::string> parts;
      if (me == root) {
        for (int r = 0; r < n; ++r) parts.push_back(Message(r, len * r));
      }
      CHECK(c.Scatter(parts, root, "scatter") == Message(me, len * me));
      CHECK(c.Broadcast(me == root ? Message(root, len) : "", root, "bcast") == Message(root, len));
    }
    auto all = c.AllGather(Message(me, len + 3 * me), "allgather");
    for (int r = 0; r < n; ++r) CHECK(all[r] == Message(r, len + 3 * r));
    c.Barrier("barrier");
  }
}

TEST_CASE("nccl: save and resharded load with plans exchanged over NCCL", "[nccl]") {
  NcclCommunicator& c = *g_nccl;
  auto cuda = FindDeviceBackend(Device::Type::kCUDA);
  std::string dir =
      g_mpi->Broadcast(c.rank() == 0 ? std::filesystem::temp_directory_path().string() +
                                           "/dcp-nccl-" + std::to_string(::getpid())
                                     : "",
                       0, "dir");
  const TensorView w = RandomTensor(DType::kFloat32, {64, 1000}, 9);
  StateDict sd;
  auto [r0, r1] = RowRange(64, c.rank(), c.size());
  ShardedTensor st{DType::kFloat32, w.shape, {}};
  st.local_shards.push_back(
      {DeviceUpload(cuda, w.Narrow({r0, 0}, {r1 - r0, 1000}), c.device()), {r0, 0}});
  sd.Set("w", st);
  SaveOptions so;
  so.storage.overwrite = true;
  Save(sd, dir, c, so);
  // Load whole on every rank (a reshard of the row layout).
  StateDict into;
  TensorView back = DeviceEmpty(cuda, DType::kFloat32, w.shape, c.device());
  into.Set("w", back);
  Load(into, dir, c);
  CHECK(SameElements(DeviceDownload(back), w));
  c.Barrier("done");
  if (c.rank() == 0) std::filesystem::remove_all(dir);
}

TEST_CASE("nccl: a silent peer is a CollectiveError, then the communicator is aborted", "[nccl]") {
  NcclCommunicator& c = *g_nccl;
  if (c.size() < 2) return;  // needs a peer
  c.set_timeout(std::chrono::seconds(3));
  if (c.rank() != c.size() - 1) {
    try {
      c.Gather("x", 0, "silent peer");
      FAIL("expected a timeout");
    } catch (const CollectiveError& e) {
      CHECK(e.timed_out());
    }
  } else {
    std::this_thread::sleep_for(std::chrono::seconds(5));  // never joins the gather
  }
  g_mpi->Barrier("after-timeout");
  if (c.rank() != c.size() - 1) {
    CHECK_THAT(MessageOf<CollectiveError>([&] { c.Barrier("later"); }), Contains("aborted"));
  }
}

int main(int argc, char** argv) {
  InitMpi(&argc, &argv);
  int rc = 0;
  {
    MpiCommunicator mpi(MPI_COMM_WORLD);
    g_mpi = &mpi;
    // Skip on every rank alike when any rank cannot run NCCL.
    MPI_Comm node;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
    int per_node = 1;
    MPI_Comm_size(node, &per_node);
    MPI_Comm_free(&node);
    std::string why;
    int ok = NcclUsable(per_node, &why) ? 1 : 0, all = 0;
    MPI_Allreduce(&ok, &all, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
    if (!all) {
      // Without devices, constructing the communicator must fail cleanly and alike on every
      // rank (an error, not a crash or a hang); then the tests are skipped.
      std::string error;
      try {
        NcclCommunicator nccl(MPI_COMM_WORLD);
        error = "constructed without a usable device";
      } catch (const CollectiveError& e) {
        if (e.failed_ranks().empty()) error = "CollectiveError names no rank";
      } catch (const std::exception& e) {
        error = std::string("unexpected error type: ") + e.what();
      }
      if (!error.empty()) {
        std::printf("FAILED: rank %d: %s\n", mpi.rank(), error.c_str());
        rc = 1;
      } else {
        if (mpi.rank() == 0) {
          std::printf(
              "SKIPPED: NCCL tests need a CUDA device per rank: %s (construction failed "
              "cleanly on every rank)\n",
              why.empty() ? "another rank lacks one" : why.c_str());
        }
        rc = 77;
      }
    } else {
      NcclCommunicator nccl(MPI_COMM_WORLD);
      nccl.set_timeout(std::chrono::seconds(60));
      g_nccl = &nccl;
      rc = dcp::testing::RunCatchSession(argc, argv, mpi.rank() != 0);
      g_nccl = nullptr;
    }
  }
  return rc;
}
