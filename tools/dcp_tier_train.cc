// dcp-tier-train: a training loop that checkpoints every step through a CheckpointManager with a
// memory tier (ManagerOptions::memory_tier), under MPI. Every value of the state is a function of
// the step, so a restore is checked element by element: a step mixed from two saves, or a torn
// one, cannot pass.
//
//   mpirun -np 4 dcp-tier-train --demo          train, lose a node's memory, resume, with figures
//   mpirun -np 4 dcp-tier-train --resume --steps 100000   (killed by tools/tier_crash_trials.sh)
//   mpirun -np 4 dcp-tier-train --verify         restore, check, print "restored step ..." and exit
//   mpirun -np 4 dcp-tier-train --resume --preempt-grace 5 ...   SIGTERM drains the newest step
//     (tools/tier_sigterm_trials.sh): rank 0 prints "preempt: step N drained ..." and the job
//     ends; "preempt: nothing ..." when memory holds no complete step
//
// Exit status: 0 ok, 1 a restore did not hold the values of the step it reported (or lost the
// newest durable step), 2 usage or setup errors.
#include <mpi.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <string>
#include <thread>
#include <vector>

#include "dcp/dcp.h"
#include "dcp/mpi_communicator.h"

using namespace dcp;
using Clock = std::chrono::steady_clock;

namespace {

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double MaxOverRanks(double v) {
  double out = 0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
  return out;
}

// The value of element `i` of tensor `t` at `step`: every bit depends on all three.
uint32_t Value(int64_t step, int t, uint64_t i) {
  uint64_t x = (static_cast<uint64_t>(step) * 0x9E3779B97F4A7C15ull) ^ (uint64_t(t) << 56) ^ i;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return static_cast<uint32_t>(x);
}

struct TrainState {
  int64_t rows_per_rank = 0, cols = 1024;
  int rank = 0, world = 1;
  TensorView w;    // this rank's rows of "model.w" (row-sharded)
  TensorView emb;  // "model.emb", replicated
  StateDict sd;

  TrainState(int rank_, int world_, uint64_t mib) : rank(rank_), world(world_) {
    rows_per_rank = std::max<int64_t>(1, static_cast<int64_t>(mib << 20) / (cols * 4));
    w = TensorView::Allocate(DType::kFloat32, {rows_per_rank, cols});
    emb = TensorView::Allocate(DType::kFloat32, {256, 64});
    ShardedTensor st{DType::kFloat32, {rows_per_rank * world, cols}, {}};
    st.local_shards.push_back({w, {rows_per_rank * rank, 0}});
    sd.Set("model.w", st);
    sd.Set("model.emb", emb);
    sd.Set("trainer", Blob{});
  }
  // One "training step": the state becomes step's.
  void Fill(int64_t step) {
    auto* p = static_cast<uint32_t*>(w.data);
    const uint64_t base = static_cast<uint64_t>(rank) * rows_per_rank * cols;
    for (int64_t i = 0; i < w.numel(); ++i) p[i] = Value(step, 0, base + i);
    auto* e = static_cast<uint32_t*>(emb.data);
    for (int64_t i = 0; i < emb.numel(); ++i) e[i] = Value(step, 1, i);
    sd.Set("trainer", Blob{"step=" + std::to_string(step)});
  }
  void Clear() {
    std::memset(w.data, 0, w.nbytes());
    std::memset(emb.data, 0, emb.nbytes());
    sd.Set("trainer", Blob{});
  }
  bool Holds(int64_t step) const {
    const auto* p = static_cast<const uint32_t*>(w.data);
    const uint64_t base = static_cast<uint64_t>(rank) * rows_per_rank * cols;
    for (int64_t i = 0; i < w.numel(); ++i) {
      if (p[i] != Value(step, 0, base + i)) return false;
    }
    const auto* e = static_cast<const uint32_t*>(emb.data);
    for (int64_t i = 0; i < emb.numel(); ++i) {
      if (e[i] != Value(step, 1, i)) return false;
    }
    const auto* b = sd.Find("trainer");
    return b && std::get<Blob>(*b).bytes == "step=" + std::to_string(step);
  }
};

bool AllRanks(bool v) {
  int in = v ? 1 : 0, out = 0;
  MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  return out == 1;
}

}  // namespace

int main(int argc, char** argv) {
  InitMpi(&argc, &argv);
  CLI::App app{"dcp-tier-train: checkpoint every step through the memory tier"};
  std::string dir = "/tmp/dcp-tier-train", shm_root = "/dev/shm", name = "train";
  int64_t steps = 20;
  int per_node = 0, durable_every = 5, memory_every = 1, keep = 2;
  uint64_t mib = 16;
  bool resume = false, verify = false, demo = false, sync = false;
  double step_ms = 0, preempt_grace = 0;
  app.add_option("--dir", dir, "durable root (CheckpointManager)");
  app.add_option("--shm-root", shm_root, "MemoryTierOptions::shm_root");
  app.add_option("--name", name, "MemoryTierOptions::name");
  app.add_option("--ranks-per-node", per_node, "simulate nodes (also DCP_TIER_RANKS_PER_NODE)");
  app.add_option("--steps", steps, "last step to train");
  app.add_option("--durable-every", durable_every, "every k-th step also to --dir");
  app.add_option("--memory-every", memory_every, "every n-th step to memory");
  app.add_option("--keep", keep, "steps the tier keeps");
  app.add_option("--mib", mib, "state per rank, MiB");
  app.add_option("--step-ms", step_ms, "compute time of a step (sleep), ms");
  app.add_flag("--resume", resume, "restore first and go on from the restored step");
  app.add_flag("--verify", verify, "restore, check the values, print and exit");
  app.add_flag("--demo", demo, "train, lose node 1's memory, resume: with figures");
  app.add_flag("--sync", sync, "save synchronously (no background communicator)");
  app.add_option("--preempt-grace", preempt_grace,
                 "handle SIGTERM: drain the newest step within this many seconds, then end");
  CLI11_PARSE(app, argc, argv);

  int ret = 0;
  try {
    MpiCommunicator comm(MPI_COMM_WORLD);
    const int rank = comm.rank(), world = comm.size();
    ManagerOptions mo;
    MemoryTierOptions to;
    to.name = name;
    to.shm_root = shm_root;
    to.ranks_per_node = per_node;
    to.keep = keep;
    mo.memory_tier = to;
    mo.durable_every = durable_every;
    mo.memory_every = memory_every;
    mo.keep_last = 2;
    TrainState state(rank, world, mib);
    auto make_manager = [&] {
      return std::make_unique<CheckpointManager>(
          dir, comm, sync ? nullptr : std::make_unique<MpiCommunicator>(MPI_COMM_WORLD), mo);
    };
    auto manager = make_manager();
    if (preempt_grace > 0) {
      // Before the restore: a notice from here on ends the job with what the tier committed.
      PreemptionOptions po;
      po.grace_period = std::chrono::milliseconds(static_cast<int64_t>(preempt_grace * 1e3));
      manager->HandlePreemption(std::make_unique<MpiCommunicator>(MPI_COMM_WORLD), po);
    }
    // Restore: the step it reports must be exactly what the state holds, and never older than
    // the newest complete durable step.
    auto restore = [&](const char* when) -> int64_t {
      // The root's own steps (the manager's CompleteSteps counts the tier's too).
      const auto durable = CheckpointManager(dir, comm).CompleteSteps();
      state.Clear();
      auto t0 = Clock::now();
      auto step = manager->Restore(state.sd);
      const double t = MaxOverRanks(Since(t0));
      const bool exact = AllRanks(!step || state.Holds(*step));
      int fetched = manager->restore_source() == "memory"
                        ? manager->memory_tier()->last_stats().files_fetched
                        : 0;
      MPI_Allreduce(MPI_IN_PLACE, &fetched, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
      const bool newest = !durable.empty() ? step && *step >= durable.back() : true;
      if (rank == 0) {
        std::printf(
            "%s: restored step %lld from %s in %.3f s (durable newest %lld; fetched %d "
            "file(s)): %s\n",
            when, step ? static_cast<long long>(*step) : -1LL,
            step ? manager->restore_source().c_str() : "nowhere", t,
            durable.empty() ? -1LL : static_cast<long long>(durable.back()), fetched,
            exact && newest ? "bit-exact" : "MISMATCH");
        for (const auto& f : manager->restore_fallbacks())
          std::printf("  fell back: %s\n", f.c_str());
        std::fflush(stdout);
      }
      if (!exact || !newest) ret = 1;
      return step.value_or(0);
    };
    int64_t first = 1;
    if (resume || verify) first = restore(verify ? "verify" : "resume") + 1;
    if (verify) {
      manager->Close();
      return ret;
    }
    auto train = [&](int64_t from, int64_t to_step) {
      double blocking = 0, snapshot = 0;
      int n = 0;
      auto t_all = Clock::now();
      // A preempted job's saves fail with PreemptedError on every rank alike: it stops there.
      auto stopped = [&](const PreemptedError& e) {
        if (rank == 0) std::printf("preempt: stopped training: %s\n", e.what());
        return false;
      };
      for (int64_t s = from; s <= to_step; ++s) {
        state.Fill(s);
        if (step_ms > 0)
          std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(step_ms));
        const auto t0 = Clock::now();
        try {
          auto handle = manager->Save(s, state.sd);
          snapshot += handle->metrics().staging_s;
        } catch (const PreemptedError& e) {
          return stopped(e);
        }
        blocking += Since(t0);
        ++n;
      }
      try {
        manager->Wait();
      } catch (const PreemptedError& e) {
        return stopped(e);
      }
      const double all = MaxOverRanks(Since(t_all));
      blocking = MaxOverRanks(blocking);
      snapshot = MaxOverRanks(snapshot);
      if (rank == 0 && n > 0) {
        const auto& st = manager->memory_tier()->last_stats();
        std::printf(
            "trained steps %lld..%lld: %.1f ms per step, %.1f ms of it in Save (%.1f ms "
            "snapshot, the rest waiting for the previous step's save; state %.1f MiB per rank; "
            "last tier save: write %.1f ms, replicate %.1f ms, commit %.1f ms)\n",
            static_cast<long long>(from), static_cast<long long>(to_step), 1e3 * all / n,
            1e3 * blocking / n, 1e3 * snapshot / n,
            (state.w.nbytes() + state.emb.nbytes()) / 1048576.0, 1e3 * st.write_s,
            1e3 * st.replicate_s, 1e3 * st.commit_s);
        std::fflush(stdout);
      }
      return true;
    };
    if (demo) {
      if (rank == 0) {
        std::printf(
            "dcp-tier-train --demo: %d ranks on %d node(s); memory every %d step(s), "
            "durable every %d, under %s\n",
            world, manager->memory_tier()->node_count(), memory_every, durable_every, dir.c_str());
      }
      train(first, steps);
      // Node 1 is lost: its processes die (the manager goes, uncleanly) and its memory with
      // them; the job restarts on a fresh node.
      const int lost = manager->memory_tier()->node_count() > 1 ? 1 : -1;
      const std::string node_dir = manager->memory_tier()->StepDirectory(0).substr(
          0, manager->memory_tier()->StepDirectory(0).rfind('/'));
      const bool on_lost = manager->memory_tier()->node() == lost;
      int first_of_node = rank;  // the lowest rank of this node removes its memory
      {
        const int node = manager->memory_tier()->node();
        std::vector<int> nodes(world);
        MPI_Allgather(&node, 1, MPI_INT, nodes.data(), 1, MPI_INT, MPI_COMM_WORLD);
        for (int r = world - 1; r >= 0; --r) {
          if (nodes[r] == node) first_of_node = r;
        }
      }
      const bool manager_rank_is_first = first_of_node == rank;
      manager.reset();
      MPI_Barrier(MPI_COMM_WORLD);
      if (on_lost && manager_rank_is_first) {
        std::error_code ec;
        std::filesystem::remove_all(node_dir, ec);
      }
      MPI_Barrier(MPI_COMM_WORLD);
      if (rank == 0) std::printf("node %d lost: its shared memory is gone\n", lost);
      manager = make_manager();
      const int64_t back = restore("restart");
      train(back + 1, back + 5);
    } else if (!train(first, steps)) {
      const PreemptionReport r = manager->WaitForPreemption(
          std::chrono::milliseconds(static_cast<int64_t>(preempt_grace * 1e3)));
      if (rank == 0) {
        if (!r.done || !r.error.empty()) {
          std::printf("preempt: FAILED: %s\n", r.done ? r.error.c_str() : "did not end in time");
        } else if (r.step < 0) {
          std::printf("preempt: nothing complete in memory\n");
        } else {
          std::printf(
              "preempt: step %lld %s in %.3f s (%.3f s of the window left; %llu bytes "
              "copied by rank 0)\n",
              static_cast<long long>(r.step), r.drained ? "drained" : "already durable", r.seconds,
              r.window_left_s, static_cast<unsigned long long>(r.bytes));
        }
        std::fflush(stdout);
      }
      manager->Close();
      return ret;
    }
    manager->Close();
  } catch (const std::exception& e) {
    // One rank's failure ends the job: the others would wait for it.
    std::fprintf(stderr, "dcp-tier-train: %s\n", e.what());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  return ret;
}
