// dcp-train: the demo as a training job. Under `mpirun -np N` it trains a small LibTorch model
// with one sharded layer (tensor-parallel style: each rank holds a block of rows of its weight
// and the matching Adam state) and replicated others, with a StepLR schedule; a
// CheckpointManager saves every K steps into --dir asynchronously (training goes on while the
// background thread writes; the last two steps are kept), and --resume restores the newest
// complete step at any world size (resharded on load). README.md quotes the loop below.
//
//   mpirun -np 4 dcp-train --dir D --steps 12 --every 3 --stop-after 6   # steps 1-6, saves 3, 6
//   mpirun -np 2 dcp-train --dir D --steps 12 --every 3 --resume         # steps 7-12
//   mpirun -np 4 dcp-train --dir E --steps 12 --losses ref.txt           # uninterrupted
//   mpirun -np 2 dcp-train --dir D --steps 12 --resume --compare ref.txt # exit 1 on mismatch
//
// Losses equal bit for bit between runs at any world sizes: every rank computes the whole
// (small) model on the same batch, with the sharded weight all-gathered from its shards; each
// rank updates only its own rows, and Adam's update is elementwise, so how the rows are spread
// over ranks does not change a single bit. Rank 0 prints "step <i> loss <value> <hex bits>".
#include <mpi.h>
#include <torch/torch.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>

#include "dcp/dcp.h"
#include "dcp/mpi_communicator.h"
#include "dcp/torch_adapter.h"

namespace {

using namespace dcp;

constexpr int64_t kIn = 8, kHidden = 30, kOut = 4, kBatch = 64;

// fc_in (replicated) -> tp (rows sharded over ranks) -> fc_out (replicated).
struct Model : torch::nn::Module {
  Model(int rank, int world) {
    torch::manual_seed(0);  // the same full initialisation at every world size
    fc_in = register_module("fc_in", torch::nn::Linear(kIn, kIn));
    const torch::Tensor full = torch::randn({kHidden, kIn}) / std::sqrt(double(kIn));
    tp = register_parameter("tp_weight", ShardOf(full, 0, rank, world).clone());
    fc_out = register_module("fc_out", torch::nn::Linear(kHidden, kOut));
  }
  torch::nn::Linear fc_in{nullptr}, fc_out{nullptr};
  torch::Tensor tp;  // this rank's rows of the [kHidden, kIn] weight
};

// All-gather the rows of the sharded weight (an exact copy; no arithmetic).
torch::Tensor GatherRows(const torch::Tensor& shard, int world, MPI_Comm comm) {
  std::vector<int> counts(world), displs(world);
  for (int r = 0; r < world; ++r) {
    auto [b, e] = ShardRange(kHidden, r, world);
    counts[r] = static_cast<int>((e - b) * kIn);
    displs[r] = static_cast<int>(b * kIn);
  }
  torch::Tensor full = torch::empty({kHidden, kIn});
  torch::Tensor local = shard.detach().contiguous();
  MPI_Allgatherv(local.data_ptr<float>(), static_cast<int>(local.numel()), MPI_FLOAT,
                 full.data_ptr<float>(), counts.data(), displs.data(), MPI_FLOAT, comm);
  return full;
}

float TrainStep(Model& m, torch::optim::Adam& opt, int64_t step, int rank, int world,
                MPI_Comm comm) {
  torch::manual_seed(10000 + step);  // the batch depends on the step only
  const torch::Tensor x = torch::randn({kBatch, kIn});
  const torch::Tensor y = torch::sin(x.sum(1, /*keepdim=*/true)).repeat({1, kOut});
  torch::Tensor w = GatherRows(m.tp, world, comm).requires_grad_(true);
  opt.zero_grad();
  const torch::Tensor h = torch::tanh(torch::matmul(torch::relu(m.fc_in->forward(x)), w.t()));
  const torch::Tensor loss = torch::mse_loss(m.fc_out->forward(h), y);
  loss.backward();
  auto [b, e] = ShardRange(kHidden, rank, world);
  m.tp.mutable_grad() = w.grad().narrow(0, b, e - b).clone();
  opt.step();
  return loss.item<float>();
}

// The training state as a dcp state dict: views of the module's parameters, the optimizer's
// state by parameter name (sharded like the parameter for tp.weight) and the step counter.
StateDict Bind(Model& m, torch::optim::Adam& opt, int64_t* step, int rank, int world) {
  auto wrap = [&](const std::string& name, const torch::Tensor& t) -> StateValue {
    if (name == "tp_weight") return MakeShardedTensor(t, {kHidden, kIn}, 0, rank, world);
    return FromTorch(t);
  };
  StateDict sd;
  for (const auto& p : m.named_parameters())
    sd.Nested("model").Set(p.key(), wrap(p.key(), p.value()));
  AddOptimizerState(opt, m, sd.Nested("optim"), wrap);
  sd.Set("step", TensorView::FromContiguous(step, DType::kInt64, {}));
  return sd;
}

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

}  // namespace

int main(int argc, char** argv) {
  InitMpi(&argc, &argv);
  CLI::App app{"dcp-train: a sharded LibTorch training job that checkpoints and resumes"};
  std::string dir, losses_path, compare_path;
  int64_t steps = 12, every = 3, stop_after = -1;
  bool resume = false;
  app.add_option("--dir", dir, "checkpoint directory (step-<n> checkpoints)")->required();
  app.add_option("--steps", steps, "train until this step");
  app.add_option("--every", every, "checkpoint every K steps");
  app.add_option("--stop-after", stop_after, "stop after this step (simulates a job ending)");
  app.add_flag("--resume", resume, "resume from the latest checkpoint in --dir");
  app.add_option("--losses", losses_path, "rank 0 writes 'step loss-bits' lines here");
  app.add_option("--compare", compare_path, "fail unless losses equal this file's, bit for bit");
  CLI11_PARSE(app, argc, argv);

  torch::set_num_threads(1);
  int status = 0;
  {
    MpiCommunicator comm(MPI_COMM_WORLD);
    const int rank = comm.rank(), world = comm.size();
    std::map<int64_t, uint32_t> reference;
    if (!compare_path.empty()) {
      std::ifstream in(compare_path);
      int64_t s;
      uint32_t bits;
      while (in >> s >> std::hex >> bits >> std::dec) reference[s] = bits;
    }
    std::ofstream losses;
    if (rank == 0 && !losses_path.empty()) losses.open(losses_path, std::ios::app);
    // Rank 0 prints each step's loss and compares it with the uninterrupted run's.
    auto Report = [&](int r, int64_t step, float loss) {
      if (r != 0) return;
      std::printf("step %lld loss %.9g %08x", static_cast<long long>(step), loss, Bits(loss));
      if (losses.is_open()) losses << step << ' ' << std::hex << Bits(loss) << std::dec << '\n';
      auto it = reference.find(step);
      if (it != reference.end()) {
        const bool same = it->second == Bits(loss);
        std::printf("  %s", same ? "== uninterrupted run" : "!= uninterrupted run");
        if (!same) status = 1;
      }
      std::printf("\n");
    };
    try {
      // [readme-training-loop]
      Model model(rank, world);
      torch::optim::Adam opt(model.parameters(), torch::optim::AdamOptions(5e-2));
      torch::optim::StepLR sched(opt, /*step_size=*/4, /*gamma=*/0.5);
      int64_t step = 0;
      StateDict sd = Bind(model, opt, &step, rank, world);  // views: no copies
      AddSchedulerState(sched, sd.Nested("sched"));

      ManagerOptions mo;
      mo.keep_last = 2;  // older steps are removed once a newer one is committed
      // A second communicator makes saves asynchronous: Save() returns after the snapshot.
      CheckpointManager manager(dir, comm, std::make_unique<MpiCommunicator>(MPI_COMM_WORLD), mo);
      if (resume) {
        // The newest complete step, saved at any world size, loaded into this rank's shards.
        if (!manager.Restore(sd)) throw NotFoundError("no checkpoint to resume from in " + dir);
        if (rank == 0) std::printf("resumed at step %lld, world size %d\n", (long long)step, world);
      }
      while (step < steps && (stop_after < 0 || step < stop_after)) {
        const float loss = TrainStep(model, opt, step + 1, rank, world, comm.comm());
        sched.step();
        ++step;  // the state dict views `step`, so a checkpoint records it
        Report(rank, step, loss);
        if (step % every == 0) manager.Save(step, sd);  // snapshot now, write in the background
      }
      manager.CloseOrThrow();  // waits for the last save; raises its error
      // [readme-training-loop-end]
      if (rank == 0 && !compare_path.empty() && status == 0) {
        std::printf("resumed losses equal the uninterrupted run's\n");
      }
    } catch (const std::exception& e) {
      std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
      status = 2;
    }
    MPI_Bcast(&status, 1, MPI_INT, 0, MPI_COMM_WORLD);
  }
  std::fflush(stdout);
  return status;
}
