// The LibTorch adapter: the only part of dcp that includes LibTorch headers.
//
// Views, not copies: FromTorch(tensor) describes the tensor's memory (data pointer, dtype,
// shape, strides, device), so saving reads the tensor's own bytes and loading writes into it in
// place: parameters keep their identity and storage. Views are bound to the tensor object
// (TensorView::binding): Save and Load re-resolve them at their start, so a state dict built
// once follows what happens to the tensors afterwards (module->to(), torch::load into the
// module, set_data, an optimizer replacing its state entries): each save reads the current
// memory, each load writes into it, and no view ever points at freed memory (each resolved
// view also pins the storage it points at). Optimizer and scheduler numbers (step, lr, betas,
// ...) are never pointers into the objects: they are copied out at each save and written back
// after each load. The caller keeps the module, optimizer and scheduler alive while the state
// dict is used (as for any tensor a state dict names).
//
// CUDA tensors (where LibTorch has CUDA, e.g. 2.x builds on GPU machines) are device views:
// Save copies them through dcp's pinned pipeline and Load writes into them in place
// (proto/device/device.h). FromTorch synchronises a CUDA tensor's device first, so kernels LibTorch
// queued on any stream have finished before dcp reads the bytes.
//
// Also: optimizer state by parameter name (Adam, AdamW, SGD), in dcp's layout or in PyTorch 2.x's
// (get_state_dict's, so checkpoints cross between a PyTorch trainer and C++), loading everything
// onto a device (map_location), and helpers that shard a tensor along a dimension and reassemble
// it.
//
// Builds against LibTorch 1.13 (Debian) and 2.x; dtypes that a LibTorch version lacks
// (fp8 kinds before 2.1, unsigned 16/32/64 before 2.3) are simply not mapped there.
#pragma once

#include <torch/torch.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "dcp/checkpoint.h"
#include "dcp/communicator.h"
#include "dcp/proto/state_dict.h"

namespace dcp {

/// dcp dtype of a LibTorch scalar type; UnsupportedError for quantized and other unmapped types.
DType FromTorchDType(c10::ScalarType type);
/// LibTorch scalar type of a dcp dtype; UnsupportedError when this LibTorch lacks it.
c10::ScalarType ToTorchDType(DType dtype);

/// A view of `tensor` (any strides, CPU or CUDA). The view keeps the storage alive.
TensorView FromTorch(const torch::Tensor& tensor);

/// A tensor aliasing the memory of `view` (no copy). The view's owner, if any, is kept alive by
/// the tensor's deleter.
torch::Tensor ToTorch(const TensorView& view);

/// Parameters and buffers of `module` by dotted name ("layer1.weight"), as views, nested under
/// `into` (so loading writes into the parameters in place). The views are bound to the module
/// by name: each save and load uses what the module holds under each name then (after
/// torch::load, to(), set_data, or replace_module of a submodule); a name the module no longer
/// has fails that save or load (InvalidArgumentError). `module` must outlive `into`. Returns
/// `into`.
StateDict& AddModuleState(const torch::nn::Module& module, StateDict& into);

// ---------------------------------------------------------------------------------------------
// Optimizer state

/// Turns one optimizer state tensor of the parameter `param_name` into a state dict value.
/// The default (FromTorch) views it as a whole tensor; a tensor-parallel job returns a
/// ShardedTensor (e.g. MakeShardedTensor) for the state of a sharded parameter.
using StateWrapper =
    std::function<StateValue(const std::string& param_name, const torch::Tensor& state)>;

/// The state of a torch::optim Adam, AdamW or SGD optimizer, keyed by parameter NAME (from
/// `module.named_parameters()`), not by index, so it survives reordering of parameters or
/// groups. Added to `into` as views (saving reads the optimizer's tensors, loading writes into
/// them in place):
///   state.<param name>.exp_avg, .exp_avg_sq, .max_exp_avg_sq (amsgrad only), .step  (Adam/AdamW)
///   state.<param name>.momentum_buffer                                  (SGD with momentum)
///   param_groups.<i>.lr, .betas ([2]), .eps, .weight_decay, .amsgrad          (Adam/AdamW)
///   param_groups.<i>.lr, .momentum, .dampening, .weight_decay, .nesterov      (SGD)
/// `step` (int64) and the group options (float64; amsgrad/nesterov bool) are copied from the
/// optimizer at each save and written back into it after each load, so a resume restores the
/// whole parameter-group configuration, not only lr. State tensors are looked up afresh at each
/// save and load. `wrap` is called once per state tensor, during this call (it may capture
/// locals by reference); the views it makes with FromTorch follow those tensor objects, so with
/// a wrapper, rebuild the state dict if the optimizer replaces its state entries (e.g. clears
/// its state). amsgrad is structure: it decides whether max_exp_avg_sq is in the state dict; a
/// load of a checkpoint saved with the other setting fails (InvalidArgumentError) rather than
/// resume without it. InvalidArgumentError at save/load time when
/// the optimizer has fewer parameter groups than when the state dict was built.
///
/// Parameters that have no state yet (a fresh optimizer, before its first step) get it created
/// here, exactly as the optimizer's first step would create it for Adam/AdamW (zeros, step 0)
/// and as zeros for SGD's momentum buffer; so a fresh optimizer can be loaded in place and its
/// next step continues where the saved run left off. (For SGD with dampening != 0 a zero buffer
/// differs from the buffer a first step would create; load such state before stepping.)
/// UnsupportedError for other optimizers; InvalidArgumentError for a parameter the module does
/// not name. Returns `into`.
StateDict& AddOptimizerState(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                             StateDict& into, const StateWrapper& wrap = {});

/// Which layout AddOptimizerState writes.
enum class OptimizerLayout : uint8_t {
  /// dcp's own, above (step int64, group options float64/bool tensors).
  kDcp,
  /// PyTorch 2.x's: what torch.distributed.checkpoint.state_dict.get_state_dict(model, optim)
  /// returns for the optimizer, so a checkpoint crosses between a PyTorch 2.x trainer and C++
  /// (checked field for field against one torch 2.11 wrote, tests/fixtures/pytorch-dcp-2.11/
  /// model_adamw; see docs/TORCH_DCP.md for what no live torch 2.x has checked):
  ///   state.<param name>.exp_avg, .exp_avg_sq, .max_exp_avg_sq (amsgrad only)    (Adam/AdamW)
  ///   state.<param name>.step          a 0-d float32 tensor, as torch 2.x keeps it (Adam/AdamW)
  ///   state.<param name>.momentum_buffer                          (SGD with momentum only)
  ///   param_groups.<i>.<option>        byte entries: a torch.save'd Python object each, as torch
  ///                                    writes non-tensors:
  ///     Adam/AdamW: lr, betas (a tuple), eps, weight_decay (floats), amsgrad, maximize,
  ///       capturable, differentiable, decoupled_weight_decay (True for AdamW) (bools), foreach,
  ///       fused (None)
  ///     SGD: lr, momentum, dampening, weight_decay (floats), nesterov, maximize,
  ///       differentiable (bools), foreach, fused (None)
  ///     both: params, the list of the group's parameter names ('0.weight', ...)
  /// Loading parses each option (dcp's restricted unpickler: plain data only) and writes it back
  /// into the optimizer; an int where a float belongs is accepted (torch writes weight_decay=0
  /// as an int). Accepted whatever their value: foreach, fused, capturable, differentiable
  /// (how torch ran, not what it computes). Refused: maximize=True (UnsupportedError: LibTorch
  /// has no maximize), a value of the wrong type, decoupled_weight_decay naming the other of
  /// Adam/AdamW, an amsgrad other than the optimizer's, a `params` list naming other parameters
  /// than the optimizer's group (InvalidArgumentError naming the key). Keys the checkpoint has
  /// and this layout does not name (initial_lr from a torch LR scheduler, options of a later
  /// torch) are not read. Keys this layout names and the checkpoint lacks (an older torch's
  /// groups without decoupled_weight_decay, a parameter torch never stepped) fail the load with
  /// dcp's missing-key error naming them (kNotFound), unless LoadOptions::allow_partial_load (the
  /// optimizer then keeps its own value) or, for the options LibTorch lacks,
  /// torch2_extra_options is off. With LoadOptions::weights_only the group options are not
  /// loaded.
  /// The model's weights go elsewhere, e.g. AddModuleState(model, sd.Nested("model")) for
  /// get_state_dict's `model.<name>`.
  kTorch2,
};

struct OptimizerStateOptions {
  OptimizerLayout layout = OptimizerLayout::kDcp;
  /// Where under `into` the entries go, as a dotted path ("optim" puts them at
  /// optim.state..., optim.param_groups..., as PyTorch trainers save {"model": ..., "optim":
  /// ...}; "" puts them in `into` itself). InvalidArgumentError for an empty path component.
  std::string prefix = "optim";
  /// As for the overload above.
  StateWrapper wrap;
  /// kTorch2: include the group options LibTorch has no counterpart for (maximize, foreach,
  /// capturable, differentiable, fused; Adam/AdamW's decoupled_weight_decay), written as torch
  /// 2.11 writes them and checked on load as described above. Off: they are neither written nor
  /// read, so a checkpoint from a torch whose groups lack some of them (decoupled_weight_decay
  /// came with torch 2.x's AdamW-as-Adam) loads; what the checkpoint holds for them is then not
  /// checked (a maximize=True checkpoint loads as if False), and torch 2.x loading dcp's output
  /// gets its own defaults for them.
  bool torch2_extra_options = true;
};

/// AddOptimizerState in the layout and at the place `options` choose. The same contract as
/// above otherwise (names, state created for a fresh optimizer, values copied out at each save
/// and written back after each load, supported optimizers).
StateDict& AddOptimizerState(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                             StateDict& into, const OptimizerStateOptions& options);

/// The state of an LR scheduler (torch::optim::LRScheduler subclasses such as StepLR: its step
/// count; the learning rates themselves live in the optimizer's param groups), added to `into`
/// as `step_count` (int64), copied out at each save and written back after each load. Returns
/// `into`.
StateDict& AddSchedulerState(torch::optim::LRScheduler& scheduler, StateDict& into);

// ---------------------------------------------------------------------------------------------
// Device mapping and loading without a model

/// Load every tensor of the checkpoint at `uri` (no model needed) and place it on `device`,
/// like torch.load's map_location. Every rank gets every tensor; blobs go to `blobs` when given.
/// Tensors on the CPU alias dcp's buffers (no copy); other devices get a copy. Collective.
std::map<std::string, torch::Tensor> LoadAllTensors(
    const std::string& uri, Communicator& comm, const torch::Device& map_location = torch::kCPU,
    std::map<std::string, std::string>* blobs = nullptr, LoadOptions options = {});

// ---------------------------------------------------------------------------------------------
// Sharding helpers

/// [begin, end) of `size` elements for `rank` of `world`: the first size % world ranks get one
/// more; ranks beyond `size` get an empty range.
std::pair<int64_t, int64_t> ShardRange(int64_t size, int rank, int world);

/// This rank's piece of `full` along `dim` (a view sharing `full`'s storage, possibly empty).
torch::Tensor ShardOf(const torch::Tensor& full, int64_t dim, int rank, int world);

/// A ShardedTensor for a tensor of `global_shape` split along `dim` over `world` ranks, holding
/// `local` (this rank's piece, shape global_shape with dim `dim` = ShardRange's length) as its
/// only shard, viewed in place. A rank whose piece is empty holds no shard.
/// InvalidArgumentError when `local` has the wrong shape.
ShardedTensor MakeShardedTensor(const torch::Tensor& local,
                                const std::vector<int64_t>& global_shape, int64_t dim, int rank,
                                int world);

/// Reassemble a tensor from every rank's piece, in rank order, along `dim` (the inverse of
/// ShardOf over rank = 0..world-1).
torch::Tensor Unshard(const std::vector<torch::Tensor>& shards, int64_t dim);

// ---------------------------------------------------------------------------------------------
// Jobs launched by torchrun, without MPI (built where Gloo's headers were found:
// DCP_WITH_TORCHRUN)
//
// dcp's collectives over LibTorch's own transport, c10d's ProcessGroupGloo (its point-to-point
// send and receive), bootstrapped from a c10d TCPStore. Each communicator is a
// PointToPointCommunicator (communicator.h): collectives keep their deadlines (timeout(): a rank
// that does not answer fails the operation naming it), poison notices and tree fan-out, and
// make no transport call once stopped. Messages travel as a length then the bytes, on Gloo tags
// of their own, under the store prefix "dcp/"; one thread per tag receives them in the
// background. A communicator is used by one thread at a time, as every dcp communicator; the
// two of a TorchrunGroup may be used concurrently (a training thread and a background saver).
#ifdef DCP_WITH_TORCHRUN

/// Where a job's processes meet: a c10d TCPStore at host:port, which the process with `serve`
/// true hosts (exactly one, or none when the launcher hosts it), and this process's place.
struct StoreAddress {
  std::string host;
  uint16_t port = 0;
  int rank = 0;
  int world_size = 1;
  bool serve = false;
};

/// A process's communicators: `comm` for its training thread's calls (Save, Load,
/// CheckpointManager), `background` for a background saver (AsyncCheckpointer,
/// CheckpointManager's async saves, MemoryTier::SaveAsync), on a second Gloo group over the same
/// processes. Destroying them ends their receiving threads; every process should do so (or stop
/// them) after its last collective, before it exits.
struct TorchrunGroup {
  int rank = 0, world_size = 1;
  int local_rank = 0, local_world_size = 1;  // LOCAL_RANK, LOCAL_WORLD_SIZE (else 0 and 1)
  std::unique_ptr<Communicator> comm;
  std::unique_ptr<Communicator> background;
  /// One more communicator over the same processes, on a Gloo group of its own (a preemption
  /// handler's, CheckpointManager::HandlePreemption; a second manager's background saves).
  /// Collective: every process calls it, in the same order; the n-th call of each process meets
  /// the n-th of the others. IoError when a process does not join within the group's timeout.
  /// Not thread-safe.
  std::unique_ptr<Communicator> Connect();

  struct Connection;  // the store and Gloo device the group's communicators were made from
  std::shared_ptr<Connection> connection;
};

/// The group of a process torchrun launched: RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT from
/// the environment (InvalidArgumentError naming a variable that is missing or not a number in
/// range). Rank 0 hosts the TCPStore at MASTER_ADDR:MASTER_PORT, as torch.distributed's env://
/// does, unless TORCHELASTIC_USE_AGENT_STORE is "True" (torchrun's agent hosts it). Gloo binds to
/// GLOO_SOCKET_IFNAME when set, to the loopback address when MASTER_ADDR is loopback, else to
/// this host's name. `timeout` is every collective's deadline (Communicator::timeout) and
/// connecting's. Collective over the job; IoError when the store cannot be reached or hosted or
/// a process does not join within `timeout`.
TorchrunGroup ConnectTorchrun(std::chrono::milliseconds timeout = std::chrono::minutes(30));

/// The same from an explicit address (a launcher other than torchrun, a test).
TorchrunGroup ConnectStore(const StoreAddress& address,
                           std::chrono::milliseconds timeout = std::chrono::minutes(30));

#endif  // DCP_WITH_TORCHRUN

}  // namespace dcp
