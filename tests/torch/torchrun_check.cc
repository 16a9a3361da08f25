// A job as torchrun launches it, with no MPI (ConnectTorchrun, dcp/torch_adapter.h): `save DIR` at
// any world size saves a row-sharded state (and a background save of it through AsyncCheckpointer,
// on the group's second communicator) to DIR and DIR-async; `load DIR` at another world size loads
// both column-sharded and checks every element. `bench DIR MIB REPEATS` times saves of MIB per
// rank and prints the median. Built twice: dcp_torchrun_check (torchrun; links no MPI) and,
// with DCP_CHECK_OVER_MPI, dcp_torchrun_check_mpi (the same job under mpirun, for the bench's
// baseline).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <memory>
#include <string>
#include <vector>

#include "dcp/dcp.h"
#ifdef DCP_CHECK_OVER_MPI
#include "dcp/mpi_communicator.h"
#else
#include "dcp/torch_adapter.h"
#endif

namespace {

constexpr int64_t kRows = 301, kCols = 17;

// The value every rank expects at (i, j): exact in float32.
float Value(int64_t i, int64_t j) { return static_cast<float>(i * 64 + j) + 0.25f; }

// This rank's share [lo, hi) of n along one dimension.
std::pair<int64_t, int64_t> Share(int64_t n, int rank, int world) {
  return {n * rank / world, n * (rank + 1) / world};
}

struct State {
  std::vector<float> w;
  int64_t lo = 0, hi = 0;
  std::vector<double> bias = std::vector<double>(5);
  dcp::StateDict sd;
};

// "w" sharded by rows (save) or by columns (load), "bias" replicated, "note" a blob.
void Build(State& s, int rank, int world, bool by_rows, bool fill) {
  std::tie(s.lo, s.hi) = Share(by_rows ? kRows : kCols, rank, world);
  const int64_t rows = by_rows ? s.hi - s.lo : kRows, cols = by_rows ? kCols : s.hi - s.lo;
  s.w.assign(static_cast<size_t>(rows * cols), 0.0f);
  for (int64_t i = 0; fill && i < rows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      s.w[i * cols + j] = by_rows ? Value(s.lo + i, j) : Value(i, s.lo + j);
    }
  }
  for (size_t k = 0; k < s.bias.size(); ++k) s.bias[k] = fill ? 0.5 * static_cast<double>(k) : 0;
  dcp::ShardedTensor st{dcp::DType::kFloat32, {kRows, kCols}, {}};
  if (rows > 0 && cols > 0) {
    st.local_shards.push_back(
        {dcp::TensorView::FromContiguous(s.w.data(), dcp::DType::kFloat32, {rows, cols}),
         by_rows ? dcp::Shape{s.lo, 0} : dcp::Shape{0, s.lo}});
  }
  s.sd.Set("w", st);
  s.sd.Set("bias", dcp::TensorView::FromContiguous(s.bias.data(), dcp::DType::kFloat64, {5}));
  s.sd.Set("note", dcp::Blob{fill ? "saved by a job without MPI" : ""});
}

// Every element of a column-sharded load.
bool Check(State& s) {
  const int64_t cols = s.hi - s.lo;
  for (int64_t i = 0; i < kRows; ++i) {
    for (int64_t j = 0; j < cols; ++j) {
      if (s.w[i * cols + j] != Value(i, s.lo + j)) return false;
    }
  }
  for (size_t k = 0; k < s.bias.size(); ++k) {
    if (s.bias[k] != 0.5 * static_cast<double>(k)) return false;
  }
  return std::get<dcp::Blob>(*s.sd.Find("note")).bytes == "saved by a job without MPI";
}

struct Group {
  int rank = 0, world = 1;
  std::unique_ptr<dcp::Communicator> comm, background;
};

Group Connect(int* argc, char*** argv) {
  Group g;
#ifdef DCP_CHECK_OVER_MPI
  dcp::InitMpi(argc, argv);
  g.comm = std::make_unique<dcp::MpiCommunicator>();
  g.background = std::make_unique<dcp::MpiCommunicator>();
#else
  (void)argc;
  (void)argv;
  dcp::TorchrunGroup t = dcp::ConnectTorchrun(std::chrono::seconds(100));
  g.comm = std::move(t.comm);
  g.background = std::move(t.background);
#endif
  g.rank = g.comm->rank();
  g.world = g.comm->size();
  return g;
}

int Bench(Group& g, const std::string& dir, int64_t mib, int repeats) {
  const int64_t floats = mib * (int64_t{1} << 20) / 4;
  std::vector<float> mine(static_cast<size_t>(floats), 1.0f + static_cast<float>(g.rank));
  dcp::StateDict sd;
  dcp::ShardedTensor st{dcp::DType::kFloat32, {floats * g.world}, {}};
  st.local_shards.push_back(
      {dcp::TensorView::FromContiguous(mine.data(), dcp::DType::kFloat32, {floats}),
       {floats * g.rank}});
  sd.Set("x", st);
  dcp::SaveOptions o;
  o.storage.overwrite = true;
  std::vector<double> times;
  for (int r = 0; r < repeats; ++r) {
    g.comm->Barrier("bench");
    const auto t0 = std::chrono::steady_clock::now();
    dcp::Save(sd, dir, *g.comm, o);
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  if (g.rank == 0) {
    std::printf("save_s %.4f (median of %d, %lld MiB per rank, %d ranks)\n",
                times[times.size() / 2], repeats, static_cast<long long>(mib), g.world);
  }
  return 0;
}

int Run(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s save|load DIR | bench DIR MIB REPEATS\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2];
  Group g = Connect(&argc, &argv);
  if (mode == "bench" && argc >= 5) return Bench(g, dir, std::atoll(argv[3]), std::atoi(argv[4]));
  if (mode == "save") {
    State s;
    Build(s, g.rank, g.world, /*by_rows=*/true, /*fill=*/true);
    dcp::Save(s.sd, dir, *g.comm);
    dcp::AsyncCheckpointer saver(std::move(g.background));
    saver.Save(s.sd, dir + "-async")->Wait();
    saver.Close();
    std::printf("rank %d of %d: saved %s and %s-async\n", g.rank, g.world, dir.c_str(),
                dir.c_str());
    return 0;
  }
  if (mode == "load") {
    bool ok = true;
    for (const std::string& from : {dir, dir + "-async"}) {
      State s;
      Build(s, g.rank, g.world, /*by_rows=*/false, /*fill=*/false);
      dcp::Load(s.sd, from, *g.comm);
      if (!Check(s)) {
        std::fprintf(stderr, "rank %d of %d: %s loaded other values\n", g.rank, g.world,
                     from.c_str());
        ok = false;
      }
    }
    if (ok) std::printf("rank %d of %d: loaded bit-exact, resharded\n", g.rank, g.world);
    return ok ? 0 : 1;
  }
  std::fprintf(stderr, "unknown mode %s\n", mode.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return Run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", argv[0], e.what());
    return 1;
  }
}
