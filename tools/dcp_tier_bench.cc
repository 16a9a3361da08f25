// dcp-tier-bench: the memory tier (dcp/memory_tier.h) against its baselines, measured side by
// side in one run under MPI (nodes simulated with --ranks-per-node on one machine):
//   memcpy      copying each rank's state into warm buffers (what a snapshot costs at best)
//   exchange    one MPI point-to-point exchange of the same bytes with the rank's partner
//   tier save   MemoryTier::Save: the state into node-local shared memory, a replica on the
//               partner node, the commit (ratio against memcpy + exchange)
//   async       the same through the tier's background saver: the caller's blocking time
//               (ratio against memcpy) and the step's time to commit
//   restore     MemoryTier::Restore with every node's copy in place, and after one node's copy
//               was wiped (its shards fetched from their replicas); "load" is the part after
//               the copies were checked and fetched (TierStats::load_s)
//   disk load   a cold-cache dcp::Load of the same state from --disk (ratio: disk / tier)
//   preemption  the drain of the tier's newest step to a root under --disk on a preemption
//               notice (CheckpointManager::HandlePreemption), from the notice to its commit,
//               against a raw O_DIRECT write + fsync of the same bytes there
// Every figure is the slowest rank's, median of --repeats. Restores are checked bit-exact.
// With --cuda the state lives in CUDA tensors (the tier stages it to host; restores load into
// CUDA tensors), and the memcpy baseline is a copy of it from the device into warm host buffers.
//
//   mpirun -np 4 dcp-tier-bench --mib 512 --ranks-per-node 2 --disk /tmp/dcp-tier-bench
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "dcp/dcp.h"
#include "dcp/mpi_communicator.h"
#include "dcp/proto/device/device.h"
#include "tools/bench_util.h"
#include "tools/fill_random.h"

using namespace dcp;
using dcp::bench::Clock;
using dcp::bench::Median;
using dcp::bench::Since;

namespace {

double MaxOverRanks(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

double MinOverRanks(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MIN, MPI_COMM_WORLD);
  return out;
}

bool AllRanks(bool v) {
  int in = v ? 1 : 0, out = 0;
  MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return out == 1;
}

struct RankState {
  std::vector<TensorView> tensors;  // this rank's shards (on the host)
  std::vector<TensorView> device;   // with --cuda: the same on the device, which sd holds
  StateDict sd;
};

// With --cuda: the device the states live on (null: the host).
std::shared_ptr<DeviceBackend> g_device;

// Moves `s`'s state dict onto g_device (a copy of each host tensor), when there is one.
void ToDevice(RankState& s) {
  if (!g_device) return;
  for (size_t t = 0; t < s.tensors.size(); ++t) {
    const TensorView& h = s.tensors[t];
    TensorView d = h;
    d.device = Device{Device::Type::kCUDA, 0};
    d.data = g_device->AllocDevice(0, h.nbytes());
    d.owner = std::shared_ptr<void>(d.data, [dev = g_device](void* p) { dev->FreeDevice(0, p); });
    CopyTensor(d, h);
    const std::string name = "layer" + std::to_string(t) + ".weight";
    auto st = std::get<ShardedTensor>(*s.sd.Find(name));
    st.local_shards[0].view = d;
    s.sd.Set(name, st);
    s.device.push_back(d);
  }
}

// Copies `from`'s state into `into`'s host tensors: a memcpy, or from the device with --cuda.
void CopyState(const RankState& from, RankState& into) {
  for (size_t i = 0; i < from.tensors.size(); ++i) {
    if (from.device.empty()) {
      std::memcpy(into.tensors[i].data, from.tensors[i].data, from.tensors[i].nbytes());
    } else {
      CopyTensor(into.tensors[i], from.device[i]);
    }
  }
}

// `tensors` row-sharded tensors of `rows_per_rank` x 4096 floats per rank, filled from `seed`;
// `on_device`: its state dict on g_device (when set).
RankState MakeState(int rank, int world, int tensors, int64_t rows_per_rank, uint64_t seed,
                    bool fill, bool on_device = true) {
  RankState s;
  for (int t = 0; t < tensors; ++t) {
    TensorView v = dcp::bench::AlignedTensor(DType::kFloat32, {rows_per_rank, 4096});
    if (fill) dcp::tools::FillRandomBytes(v.data, v.nbytes(), seed * 1000 + rank * 100 + t);
    ShardedTensor st{DType::kFloat32, {rows_per_rank * world, 4096}, {}};
    st.local_shards.push_back({v, {rows_per_rank * rank, 0}});
    s.sd.Set("layer" + std::to_string(t) + ".weight", st);
    s.tensors.push_back(v);
  }
  if (on_device) ToDevice(s);
  return s;
}

// Whether `b` (a restore's or load's state, downloaded first when on the device) holds `a`'s
// host values.
bool Same(const RankState& a, RankState& b) {
  for (size_t i = 0; i < b.device.size(); ++i) CopyTensor(b.tensors[i], b.device[i]);
  for (size_t i = 0; i < a.tensors.size(); ++i) {
    if (std::memcmp(a.tensors[i].data, b.tensors[i].data, a.tensors[i].nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

// The exchange baseline: every tensor of `from` to `partner` and every one of `into` from
// `source`, all posted at once and polled to completion yielding the core between polls. (A
// blocking MPI_Sendrecv per tensor spins without yielding: with more ranks than cores, as on a
// 2-core machine running 4 ranks, it ran 1.5-3x slower than this and flattered the tier's ratio.)
void ExchangeWithPartner(const RankState& from, RankState& into, int partner, int source) {
  std::vector<MPI_Request> requests;
  for (size_t i = 0; i < from.tensors.size(); ++i) {
    requests.emplace_back();
    MPI_Irecv(into.tensors[i].data, static_cast<int>(into.tensors[i].nbytes()), MPI_BYTE, source, 7,
              MPI_COMM_WORLD, &requests.back());
    requests.emplace_back();
    MPI_Isend(from.tensors[i].data, static_cast<int>(from.tensors[i].nbytes()), MPI_BYTE, partner,
              7, MPI_COMM_WORLD, &requests.back());
  }
  for (int done = 0; !done;) {
    MPI_Testall(static_cast<int>(requests.size()), requests.data(), &done, MPI_STATUSES_IGNORE);
    if (!done) std::this_thread::yield();
  }
}

// The preemption drain (CheckpointManager::HandlePreemption) of a step in the tier to a root
// under `disk`, against a raw write of the same bytes there (O_DIRECT, then fsync; every rank at
// once, as the drain). The order alternates between repeats. Returns the medians of the slowest
// rank's times {raw, drain}; `ok` goes false when a drain did not drain.
std::pair<double, double> PreemptionFigures(MpiCommunicator& comm, const RankState& state,
                                            MemoryTierOptions tier, const std::string& disk,
                                            int repeats, bool& ok) {
  std::vector<double> t_raw, t_drain;
  tier.name = "bench-preempt";
  for (int rep = 0; rep < repeats; ++rep) {
    const std::string root = disk + "/preempt-" + std::to_string(rep);
    const std::string raw = disk + "/raw-" + std::to_string(comm.rank());
    if (comm.rank() == 0) std::filesystem::remove_all(root);
    auto raw_write = [&] {
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = Clock::now();
      dcp::bench::RawWrite(raw, state.tensors);
      t_raw.push_back(MaxOverRanks(Since(t0)));
      std::filesystem::remove(raw);
    };
    if (rep % 2 == 1) raw_write();
    {
      ManagerOptions mo;
      mo.memory_tier = tier;
      mo.durable_every = 1 << 30;  // steps only to memory: the drain is what reaches the root
      CheckpointManager manager(root, comm, nullptr, mo);
      PreemptionOptions po;
      po.on_sigterm = false;
      po.grace_period = std::chrono::minutes(10);
      manager.HandlePreemption(std::make_unique<MpiCommunicator>(MPI_COMM_WORLD), po);
      manager.Save(1, state.sd);
      MPI_Barrier(MPI_COMM_WORLD);
      NotifyPreemption();  // this process's manager, as SIGTERM to every rank
      const PreemptionReport r = manager.WaitForPreemption(std::chrono::minutes(10));
      ok = ok && r.done && r.error.empty() && r.drained && r.step == 1;
      t_drain.push_back(MaxOverRanks(r.seconds));
      manager.Close();
    }
    if (rep % 2 == 0) raw_write();
    MPI_Barrier(MPI_COMM_WORLD);
    if (comm.rank() == 0) std::filesystem::remove_all(root);
  }
  return {Median(t_raw), Median(t_drain)};
}

}  // namespace

int main(int argc, char** argv) {
  InitMpi(&argc, &argv);
  CLI::App app{"dcp-tier-bench: the memory tier against memcpy, MPI and a cold disk load"};
  uint64_t mib = 256;
  int repeats = 3, per_node = 0, tensors = 8;
  std::string disk = "/tmp/dcp-tier-bench";
  std::string shm_root = "/dev/shm";
  bool no_async = false;
  app.add_option("--mib", mib, "state per rank, MiB");
  app.add_option("--tensors", tensors, "tensors per rank");
  app.add_option("--repeats", repeats, "runs of each figure (medians are printed)");
  app.add_option("--ranks-per-node", per_node, "simulate nodes of this many ranks (0: hosts)");
  app.add_option("--disk", disk, "directory for the disk baseline");
  app.add_option("--shm-root", shm_root, "where the tier lives");
  app.add_flag("--no-async", no_async, "skip the background-save figures");
  bool no_preempt = false;
  app.add_flag("--no-preempt", no_preempt, "skip the preemption drain against a raw write");
  bool cuda = false;
  app.add_flag("--cuda", cuda, "the state in CUDA tensors on device 0 (exit 77 without one)");
  int overlap_files = MemoryTierOptions{}.overlap_files;
  app.add_option("--overlap-files", overlap_files,
                 "MemoryTierOptions::overlap_files of the tier (a second tier, with 0, saves "
                 "the same state for comparison)");
  CLI11_PARSE(app, argc, argv);

  if (cuda) {
    g_device = FindDeviceBackend(Device::Type::kCUDA);
    if (!g_device || g_device->device_count() == 0) {
      std::printf("dcp-tier-bench: no CUDA device: %s\n",
                  g_device ? g_device->unavailable_reason().c_str() : "a build without CUDA");
      return 77;
    }
  }
  int ret = 0;
  {
    MpiCommunicator comm(MPI_COMM_WORLD);
    const int rank = comm.rank(), world = comm.size();
    const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(mib << 20) / tensors / 16384);
    RankState state = MakeState(rank, world, tensors, rows, 1, true);
    const uint64_t bytes = static_cast<uint64_t>(tensors) * rows * 16384;
    MemoryTierOptions to;
    to.name = "bench";
    to.shm_root = shm_root;
    to.ranks_per_node = per_node;
    to.keep = 1;
    to.free_on_close = true;
    to.overlap_files = overlap_files;
    std::unique_ptr<MemoryTier> tier, serial;
    SaveOptions serial_options;
    try {
      tier = std::make_unique<MemoryTier>(
          comm, to, no_async ? nullptr : std::make_unique<MpiCommunicator>(MPI_COMM_WORLD));
      if (overlap_files > 1) {
        MemoryTierOptions after = to;
        after.name = "bench-serial";
        after.overlap_files = 0;
        serial = std::make_unique<MemoryTier>(comm, after);
      }
      // The same files as the overlapped save writes (one writer, overlap_files files): the two
      // differ only in when the replicas go.
      serial_options.storage.files_per_rank = overlap_files;
      serial_options.storage.memory_budget_bytes = kWriterStagingBytes;
    } catch (const std::exception& e) {
      if (rank == 0) std::fprintf(stderr, "dcp-tier-bench: %s\n", e.what());
      return 2;
    }
    const int partner = tier->partners().empty() ? rank : tier->partners()[0];
    // The rank whose replica this rank keeps sends to it; with one replica on a ring of nodes
    // that is the rank whose partner this rank is.
    int source = rank;
    {
      std::vector<int> partners(world);
      MPI_Allgather(&partner, 1, MPI_INT, partners.data(), 1, MPI_INT, MPI_COMM_WORLD);
      for (int r = 0; r < world; ++r) {
        if (partners[r] == rank) source = r;
      }
    }
    RankState warm = MakeState(rank, world, tensors, rows, 0, true, false);  // warm, host
    std::vector<double> t_memcpy, t_exchange, t_save, t_write, t_repl, t_restore, t_lost, t_disk,
        t_block, t_async, t_restore_load, t_lost_load, t_serial, t_overlapped;
    bool exact = true;
    int64_t step = 0;
    // The saves first, all repeats, as a loop that saves every step runs them: nothing between
    // them maps or unmaps memory. (On a VM with shadow page tables, as the machine these figures
    // were first taken on, a process that unmaps memory it touched pays a fault on the next
    // write to each page it keeps mapped: ~1 s per 256 MiB, for the tier's files and the
    // memcpy baseline's buffers alike. The restores and disk loads below allocate and free.)
    // Two untimed saves first, so that the step freed before the timed ones left its pages to
    // be written over, and one untimed pass of each baseline.
    int64_t serial_step = 0;
    for (int warmup = 0; warmup < 2; ++warmup) {
      tier->Save(++step, state.sd);
      if (serial) serial->Save(++serial_step, state.sd, serial_options);
    }
    for (int rep = -1; rep < repeats; ++rep) {
      // memcpy into warm buffers.
      MPI_Barrier(MPI_COMM_WORLD);
      auto t0 = Clock::now();
      CopyState(state, warm);
      const double memcpy_s = MaxOverRanks(Since(t0));
      // One exchange of the same bytes with the partner (send to it, receive from the rank whose
      // partner this one is), into warm buffers.
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = Clock::now();
      ExchangeWithPartner(state, warm, partner, source);
      const double exchange_s = MaxOverRanks(Since(t0));
      // The same save with the replicas sent after the write (overlap_files 0), before the
      // tier's own in every other repeat, so that neither always follows the other.
      double serial_s = 0;
      auto save_serially = [&] {
        if (!serial) return;
        MPI_Barrier(MPI_COMM_WORLD);
        const auto start = Clock::now();
        serial->Save(++serial_step, state.sd, serial_options);
        serial_s = MaxOverRanks(Since(start));
      };
      if (rep % 2 != 0) save_serially();
      // The tier's synchronous save in its steady state.
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = Clock::now();
      tier->Save(++step, state.sd);
      const double save_s = MaxOverRanks(Since(t0));
      const double write_s = MaxOverRanks(tier->last_stats().write_s);
      const double replicate_s = MaxOverRanks(tier->last_stats().replicate_s);
      const TierStats& st = tier->last_stats();
      const double overlapped = MinOverRanks(
          st.bytes_sent > 0 ? static_cast<double>(st.bytes_sent_while_writing) / st.bytes_sent : 0);
      if (rep % 2 == 0) save_serially();
      if (rep >= 0) {
        t_serial.push_back(serial_s);
        t_overlapped.push_back(overlapped);
        t_memcpy.push_back(memcpy_s);
        t_exchange.push_back(exchange_s);
        t_save.push_back(save_s);
        t_write.push_back(write_s);
        t_repl.push_back(replicate_s);
      }
      if (!no_async) {
        // In the background: the caller blocks for the snapshot into (warm) staging only. The
        // first background save allocates the staging and is not counted.
        for (int k = rep < 0 ? 0 : 1; k < 2; ++k) {
          MPI_Barrier(MPI_COMM_WORLD);
          t0 = Clock::now();
          auto handle = tier->SaveAsync(++step, state.sd);
          const double blocking = Since(t0);
          handle->Wait();
          const double committed = Since(t0);
          tier->Wait();
          if (k == 1 && rep >= 0) {
            t_block.push_back(MaxOverRanks(blocking));
            t_async.push_back(MaxOverRanks(committed));
          }
        }
      }
    }
    for (int rep = 0; rep < repeats; ++rep) {
      // Restore with every copy in place.
      RankState back = MakeState(rank, world, tensors, rows, 0, false);
      MPI_Barrier(MPI_COMM_WORLD);
      auto t0 = Clock::now();
      auto got = tier->Restore(back.sd);
      t_restore.push_back(MaxOverRanks(Since(t0)));
      t_restore_load.push_back(MaxOverRanks(tier->last_stats().load_s));
      exact = exact && got == step && Same(back, state);
      // Node 1's copy is wiped (its first rank removes the node's directory): recovery fetches
      // its shards from their replicas.
      if (tier->node_count() > 1) {
        MPI_Barrier(MPI_COMM_WORLD);
        if (tier->node() == 1) {
          std::error_code ec;
          std::filesystem::remove_all(tier->StepDirectory(step), ec);
        }
        RankState lost = MakeState(rank, world, tensors, rows, 0, false);
        MPI_Barrier(MPI_COMM_WORLD);
        t0 = Clock::now();
        got = tier->Restore(lost.sd);
        t_lost.push_back(MaxOverRanks(Since(t0)));
        t_lost_load.push_back(MaxOverRanks(tier->last_stats().load_s));
        exact = exact && got == step && Same(lost, state);
      }
      // Cold disk load of the same state.
      const std::string dir = disk + "/rep-" + std::to_string(rep);
      if (rank == 0) std::filesystem::remove_all(dir);
      MPI_Barrier(MPI_COMM_WORLD);
      Save(state.sd, dir, comm);
      if (rank == 0) dcp::bench::DropCaches(dcp::bench::FilesUnder(dir));
      RankState cold = MakeState(rank, world, tensors, rows, 0, false);
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = Clock::now();
      Load(cold.sd, dir, comm);
      t_disk.push_back(MaxOverRanks(Since(t0)));
      exact = exact && Same(cold, state);
      if (rank == 0) std::filesystem::remove_all(dir);
    }
    bool drained = true;
    std::pair<double, double> preempt{0, 0};
    if (!no_preempt) {
      to.free_on_close = true;
      preempt = PreemptionFigures(comm, state, to, disk, repeats, drained);
      drained = AllRanks(drained);
    }
    exact = AllRanks(exact);
    tier->Close();
    if (serial) serial->Close();
    if (rank == 0) {
      const double gb = static_cast<double>(bytes) / 1e9;
      const double mc = Median(t_memcpy), ex = Median(t_exchange), sv = Median(t_save);
      std::printf(
          "dcp-tier-bench: %d ranks, %d node(s), %.0f MiB per rank, %d repeats (medians, "
          "slowest rank)\n",
          world, tier->node_count(), bytes / 1048576.0, repeats);
      std::printf("  %-34s %8.3f s  %6.2f GB/s per rank\n",
                  cuda ? "copy from the device (warm buffers)" : "memcpy into warm buffers", mc,
                  gb / mc);
      std::printf("  %-34s %8.3f s  %6.2f GB/s per rank\n", "MPI exchange with the partner", ex,
                  gb / ex);
      std::printf("  %-34s %8.3f s  (write %.3f, replicate %.3f)  ratio %.2fx memcpy+exchange\n",
                  "tier save (sync, committed)", sv, Median(t_write), Median(t_repl),
                  sv / (mc + ex));
      if (serial) {
        const double se = Median(t_serial);
        std::printf(
            "  %-34s %8.3f s  ratio %.2fx memcpy+exchange; the overlapped save is %.2fx it (%.0f%% "
            "of the replicas sent while writing)\n",
            "tier save, replicas after the write", se, se / (mc + ex), sv / se,
            100 * Median(t_overlapped));
      }
      if (!t_block.empty()) {
        const double bl = Median(t_block);
        std::printf("  %-34s %8.3f s  ratio %.2fx memcpy (committed %.3f s after the call)\n",
                    "tier save (background): blocking", bl, bl / mc, Median(t_async));
      }
      const double rs = Median(t_restore), dk = Median(t_disk);
      std::printf("  %-34s %8.3f s  %.1fx faster than the cold disk load (load %.3f)\n",
                  "tier restore (copies in place)", rs, dk / rs, Median(t_restore_load));
      if (!t_lost.empty()) {
        const double lo = Median(t_lost);
        std::printf("  %-34s %8.3f s  %.1fx faster than the cold disk load (load %.3f)\n",
                    "tier restore (node 1 wiped)", lo, dk / lo, Median(t_lost_load));
      }
      std::printf("  %-34s %8.3f s\n", "cold disk load (dcp::Load)", dk);
      std::printf("  restores bit-exact: %s\n", exact ? "yes" : "NO");
      if (!no_preempt) {
        std::printf("  %-34s %8.3f s  ratio %.2fx the raw write (%s)\n",
                    "preemption drain (notice to commit)", preempt.second,
                    preempt.second / preempt.first, drained ? "drained" : "NOT DRAINED");
        std::printf("  %-34s %8.3f s\n", "raw write of the same bytes", preempt.first);
      }
    }
    if (!exact || !drained) ret = 1;
  }
  return ret;
}
