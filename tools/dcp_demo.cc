// dcp-demo: the main job. Under `mpirun -np 4` it builds a realistic training state (sharded and
// replicated tensors of mixed dtypes, non-contiguous views, byte blobs), saves it, loads it into
// fresh buffers, checks bit-exactness and prints what it did. With --baseline it also times a
// plain write+fsync and read of the same bytes in the same directory, as the yardstick.
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>

#include "dcp/dcp.h"
#include "tools/fill_random.h"
#ifdef DCP_WITH_MPI
#include "dcp/mpi_communicator.h"
#endif

namespace {

using Clock = std::chrono::steady_clock;
using namespace dcp;

// Every rank's bytes differ and none are zero pages.
void Fill(void* p, size_t n, uint64_t seed) { tools::FillRandomBytes(p, n, seed); }

std::pair<int64_t, int64_t> Rows(int64_t n, int rank, int world) {
  const int64_t base = n / world, extra = n % world;
  const int64_t b = rank * base + std::min<int64_t>(rank, extra);
  return {b, b + base + (rank < extra ? 1 : 0)};
}

// The training state of one rank. `fill` false gives zeroed buffers of the same layout.
struct Model {
  std::vector<TensorView> buffers;                         // keeps memory alive
  std::vector<std::pair<std::string, TensorView>> checks;  // what to compare after load
  StateDict sd;
};

Model BuildState(int rank, int world, int64_t size_mib, bool fill) {
  Model m;
  uint64_t seed = 1000;
  auto alloc = [&](DType dt, Shape shape) {
    TensorView t = TensorView::Allocate(dt, std::move(shape));
    if (fill) Fill(t.data, t.nbytes(), seed * 7919 + rank);  // rank-specific unless replicated
    ++seed;
    m.buffers.push_back(t);
    return t;
  };
  auto replicated = [&](DType dt, Shape shape) {
    TensorView t = TensorView::Allocate(dt, std::move(shape));
    if (fill) Fill(t.data, t.nbytes(), seed * 104729);  // same on every rank
    ++seed;
    m.buffers.push_back(t);
    return t;
  };
  // Sizes scale with --size-mib; hidden width 1024.
  const int64_t d = 1024;
  const int64_t vocab = std::max<int64_t>(world, size_mib * 1024 * 1024 * 35 / 100 / (d * 4));
  const int64_t ffn = std::max<int64_t>(world, size_mib * 1024 * 1024 * 20 / 100 / (d * 2));

  StateDict& model = m.sd.Nested("model");
  // Row-sharded embedding (fp32), uneven when vocab % world != 0.
  {
    auto [b, e] = Rows(vocab, rank, world);
    TensorView local = alloc(DType::kFloat32, {e - b, d});
    model.Nested("embed").Set("weight",
                              ShardedTensor{DType::kFloat32, {vocab, d}, {{local, {b, 0}}}});
    m.checks.emplace_back("model.embed.weight", local);
    TensorView moment = alloc(DType::kFloat32, {e - b, d});
    m.sd.Nested("optim").Nested("exp_avg").Set(
        "embed", ShardedTensor{DType::kFloat32, {vocab, d}, {{moment, {b, 0}}}});
    m.checks.emplace_back("optim.exp_avg.embed", moment);
  }
  // Column-sharded MLP weight (bf16): tensor-parallel style.
  {
    auto [b, e] = Rows(ffn, rank, world);
    TensorView local = alloc(DType::kBFloat16, {d, e - b});
    model.Nested("mlp").Set("fc1", ShardedTensor{DType::kBFloat16, {d, ffn}, {{local, {0, b}}}});
    m.checks.emplace_back("model.mlp.fc1", local);
  }
  // Replicated tensors of several dtypes (written once thanks to dedup).
  TensorView norm = replicated(DType::kFloat32, {d});
  TensorView attn = replicated(DType::kFloat16, {d, 3 * d / 4});
  TensorView fp8 = replicated(DType::kFloat8_e4m3fn, {d, 64});
  TensorView mask = replicated(DType::kBool, {4096});
  if (fill) {
    auto* p = static_cast<unsigned char*>(mask.data);
    for (size_t i = 0; i < mask.nbytes(); ++i) p[i] &= 1;
  }
  model.Set("norm", norm);
  model.Nested("attn").Set("qkv", attn);
  model.Set("fp8_cache", fp8);
  model.Set("mask", mask);
  m.checks.emplace_back("model.norm", norm);
  m.checks.emplace_back("model.attn.qkv", attn);
  m.checks.emplace_back("model.fp8_cache", fp8);
  m.checks.emplace_back("model.mask", mask);
  // A non-contiguous view: the output head is stored transposed in its buffer.
  {
    TensorView buf = replicated(DType::kFloat32, {d, 512});
    TensorView head = buf;
    head.shape = {512, d};
    head.strides = {1, 512};
    model.Set("head_t", head);
    m.checks.emplace_back("model.head_t", head);
  }
  TensorView step = replicated(DType::kInt64, {});
  m.sd.Nested("optim").Set("step", step);
  m.checks.emplace_back("optim.step", step);
  // Byte blobs: a replicated config and per-rank RNG state.
  m.sd.Set("config", Blob{fill ? "{\"lr\": 3e-4, \"hidden\": 1024}" : ""});
  std::string rng(256, '\0');
  if (fill) Fill(rng.data(), rng.size(), 42 + rank);
  m.sd.Set("rng_rank" + std::to_string(rank), Blob{rng});
  return m;
}

bool Equal(const TensorView& a, const TensorView& b) {
  TensorView ca = TensorView::Allocate(a.dtype, a.shape),
             cb = TensorView::Allocate(b.dtype, b.shape);
  CopyTensor(ca, a);
  CopyTensor(cb, b);
  return std::memcmp(ca.data, cb.data, ca.nbytes()) == 0;
}

bool DropCaches() {
  ::sync();
  std::ofstream f("/proc/sys/vm/drop_caches");
  if (!f) return false;
  f << "3\n";
  return static_cast<bool>(f.flush());
}

double Seconds(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

// Raw baseline: write this rank's bytes to one file with large pwrites + fdatasync, read back.
std::pair<double, double> RawBaseline(Communicator& comm, const std::string& dir, const Model& m,
                                      bool drop) {
  const std::string path = dir + "/raw-baseline-r" + std::to_string(comm.rank()) + ".bin";
  comm.Barrier("raw");
  auto t0 = Clock::now();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  for (const auto& t : m.buffers) {
    const char* p = static_cast<const char*>(t.data);
    size_t n = t.nbytes();
    while (n > 0) {
      ssize_t w = ::write(fd, p, std::min<size_t>(n, 64 << 20));
      if (w <= 0) break;
      p += w;
      n -= static_cast<size_t>(w);
    }
  }
  ::fdatasync(fd);
  ::close(fd);
  comm.Barrier("raw");
  auto t1 = Clock::now();
  if (drop && comm.rank() == 0) DropCaches();
  comm.Barrier("raw");
  auto t2 = Clock::now();
  fd = ::open(path.c_str(), O_RDONLY);
  for (const auto& t : m.buffers) {  // read back into the same (warm) buffers
    char* p = static_cast<char*>(t.data);
    size_t n = t.nbytes();
    while (n > 0) {
      ssize_t r = ::read(fd, p, std::min<size_t>(n, 64 << 20));
      if (r <= 0) break;
      p += r;
      n -= static_cast<size_t>(r);
    }
  }
  ::close(fd);
  comm.Barrier("raw");
  auto t3 = Clock::now();
  std::filesystem::remove(path);
  return {Seconds(t0, t1), Seconds(t2, t3)};
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dcp-demo: save a realistic multi-rank training state, load it back, verify"};
  std::string dir;
  int64_t size_mib = 384;
  int files_per_rank = 1;
  bool baseline = false, no_drop = false;
  app.add_option("--dir", dir, "checkpoint directory (default: a fresh temporary directory, kept)");
  app.add_option("--size-mib", size_mib, "approximate size of the state in MiB")
      ->check(CLI::PositiveNumber);
  app.add_option("--files-per-rank", files_per_rank, "data files each rank writes in parallel");
  app.add_flag("--baseline", baseline, "also time raw write+fsync and read of the same bytes");
  app.add_flag("--no-drop-caches", no_drop, "do not drop the page cache before loads");
  CLI11_PARSE(app, argc, argv);

  std::unique_ptr<Communicator> comm;
#ifdef DCP_WITH_MPI
  InitMpi(&argc, &argv);
  comm = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);
#else
  comm = std::make_unique<LocalCommunicator>();
#endif
  const int rank = comm->rank(), world = comm->size();
  try {
    if (dir.empty()) {
      std::string made;
      if (rank == 0) {
        std::string tmpl = (std::filesystem::temp_directory_path() / "dcp-demo-XXXXXX").string();
        if (::mkdtemp(tmpl.data()) == nullptr) throw IoError("mkdtemp failed", false, errno);
        made = tmpl;
      }
      dir = comm->Broadcast(made, 0, "demo/dir");
    }
    const std::string ckpt = dir + "/checkpoint";
    Model src = BuildState(rank, world, size_mib, true);
    uint64_t local_bytes = 0;
    for (const auto& t : src.buffers) local_bytes += t.nbytes();

    comm->Barrier("demo");
    auto t0 = Clock::now();
    SaveOptions so;
    so.storage.overwrite = true;
    so.storage.files_per_rank = files_per_rank;
    const Metadata md = Save(src.sd, ckpt, *comm, so).metadata;
    comm->Barrier("demo");
    auto t1 = Clock::now();

    const bool cold = !no_drop && (rank != 0 || true) &&
                      comm->Broadcast(rank == 0 && DropCaches() ? "1" : "0", 0, "demo") == "1";
    Model dst = BuildState(rank, world, size_mib, false);  // fresh, zeroed buffers
    comm->Barrier("demo");
    auto t2 = Clock::now();
    Load(dst.sd, ckpt, *comm);
    comm->Barrier("demo");
    auto t3 = Clock::now();

    // Bit-exactness, on every rank, of every tensor and blob.
    int mismatches = 0;
    for (size_t i = 0; i < src.checks.size(); ++i) {
      if (!Equal(src.checks[i].second, dst.checks[i].second)) {
        std::fprintf(stderr, "rank %d: MISMATCH in %s\n", rank, src.checks[i].first.c_str());
        ++mismatches;
      }
    }
    for (const auto& key : {std::string("config"), "rng_rank" + std::to_string(rank)}) {
      if (std::get<Blob>(*src.sd.Find(key)).bytes != std::get<Blob>(*dst.sd.Find(key)).bytes) {
        std::fprintf(stderr, "rank %d: MISMATCH in blob %s\n", rank, key.c_str());
        ++mismatches;
      }
    }
    auto all = comm->AllGather(std::to_string(mismatches), "demo/verify");
    int total_mismatches = 0;
    for (const auto& s : all) total_mismatches += std::stoi(s);

    // Asynchronous checkpoint: training blocks only for the snapshot, then mutates its state at
    // once (here: flips every bit of every tensor) while the write goes on in the background.
    double memcpy_s = 0, async_block_s = 0, async_background_s = 0;
    int async_mismatches = 0;
    {
      std::unique_ptr<Communicator> background;
#ifdef DCP_WITH_MPI
      background = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);
#else
      background = std::make_unique<LocalCommunicator>();
#endif
      AsyncOptions ao;
      AsyncCheckpointer saver(std::move(background), ao);
      saver.Save(src.sd, dir + "/checkpoint-async", so)->Wait();  // first save allocates staging
      // The same bytes copied with memcpy into warm buffers: the floor for a snapshot.
      const auto m0 = Clock::now();
      for (size_t i = 0; i < src.buffers.size(); ++i) {
        std::memcpy(dst.buffers[i].data, src.buffers[i].data, src.buffers[i].nbytes());
      }
      memcpy_s = Seconds(m0, Clock::now());
      comm->Barrier("demo");
      auto handle = saver.Save(src.sd, dir + "/checkpoint-async", so);
      async_block_s = handle->metrics().blocking_s;
      auto flip = [&] {
        for (auto& t : src.buffers) {
          auto* p = static_cast<unsigned char*>(t.data);
          for (size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(~p[i]);
        }
      };
      flip();  // "training" overwrites everything right after the call
      handle->Wait();
      async_background_s = handle->metrics().background_s;
      flip();  // back to the values at the call
      saver.Close();
      Model again = BuildState(rank, world, size_mib, false);
      Load(again.sd, dir + "/checkpoint-async", *comm);
      for (size_t i = 0; i < src.checks.size(); ++i) {
        if (!Equal(src.checks[i].second, again.checks[i].second)) ++async_mismatches;
      }
      auto all_async = comm->AllGather(std::to_string(async_mismatches), "demo/verify-async");
      async_mismatches = 0;
      for (const auto& s : all_async) async_mismatches += std::stoi(s);
    }

    std::pair<double, double> raw{0, 0};
    if (baseline) raw = RawBaseline(*comm, dir, src, !no_drop);

    if (rank == 0) {
      std::set<std::string> files;
      size_t tensors = 0, blobs = 0;
      for (const auto& name : md.DataFileNames()) files.insert(name);
      for (const auto& [fqn, e] : md.entries)
        (std::holds_alternative<TensorMetadata>(e) ? tensors : blobs)++;
      const double stored = static_cast<double>(md.TotalStoredBytes());
      const double save_s = Seconds(t0, t1), load_s = Seconds(t2, t3);
      std::printf("dcp-demo: %d rank%s, checkpoint %s\n", world, world == 1 ? "" : "s",
                  ckpt.c_str());
      std::printf(
          "  state    %zu tensors + %zu blobs, %.1f MiB held in memory (all ranks), %.1f MiB "
          "stored "
          "(replicated data written once) in %zu data files + metadata\n",
          tensors, blobs, static_cast<double>(local_bytes) * world / 1048576.0, stored / 1048576.0,
          files.size());
      std::printf("  save     %.3f s  %.2f GB/s (stored bytes, fsync'd)\n", save_s,
                  stored / save_s / 1e9);
      std::printf("  load     %.3f s  %.2f GB/s (%s page cache, into fresh buffers)\n", load_s,
                  stored / load_s / 1e9, cold ? "cold" : "warm");
      if (baseline) {
        const double raw_bytes = static_cast<double>(local_bytes) * world;
        std::printf(
            "  raw      write+fsync %.2f GB/s, read %.2f GB/s (%s) of %.1f MiB, same directory\n",
            raw_bytes / raw.first / 1e9, raw_bytes / raw.second / 1e9, cold ? "cold" : "warm",
            raw_bytes / 1048576.0);
        std::printf("  ratio    save/raw-write %.2f, load/raw-read %.2f\n",
                    (stored / save_s) / (raw_bytes / raw.first),
                    (stored / load_s) / (raw_bytes / raw.second));
      }
      std::printf("  verify   %s\n",
                  total_mismatches == 0 ? "bit-exact on every rank" : "MISMATCHES (see stderr)");
      std::printf(
          "  async    blocked %.3f s (memcpy of the same bytes %.3f s, ratio %.2f; sync save %.3f "
          "s)\n",
          async_block_s, memcpy_s, async_block_s / memcpy_s, save_s);
      std::printf(
          "           background write %.3f s; state overwritten right after the call; "
          "checkpoint %s\n",
          async_background_s,
          async_mismatches == 0 ? "holds the values at the call (bit-exact)" : "WRONG");
    }
    return total_mismatches == 0 && async_mismatches == 0 ? 0 : 1;
  } catch (const Error& e) {
    std::fprintf(stderr, "dcp-demo (rank %d): %s\n", rank, e.what());
    return 2;
  }
}
