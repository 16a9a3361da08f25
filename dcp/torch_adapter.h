// The LibTorch adapter: the only part of dcp that includes LibTorch headers.
//
// Views, not copies: FromTorch(tensor) describes the tensor's memory (data pointer, dtype,
// shape, strides, device) and keeps its storage alive through TensorView::owner, so saving
// reads the tensor's own bytes and loading writes into it in place: parameters keep their
// identity and storage.
//
// CUDA tensors (where LibTorch has CUDA, e.g. 2.x builds on GPU machines) are device views:
// Save copies them through dcp's pinned pipeline and Load writes into them in place
// (proto/device.h). FromTorch synchronises a CUDA tensor's device first, so kernels LibTorch
// queued on any stream have finished before dcp reads the bytes.
//
// Also: optimizer state by parameter name (Adam, AdamW, SGD), loading everything onto a device
// (map_location), and helpers that shard a tensor along a dimension and reassemble it.
//
// Builds against LibTorch 1.13 (Debian) and 2.x; dtypes that a LibTorch version lacks
// (fp8 kinds before 2.1, unsigned 16/32/64 before 2.3) are simply not mapped there.
#pragma once

#include <torch/torch.h>

#include <functional>
#include <map>
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
/// `into` (so loading writes into the parameters in place). Returns `into`.
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
///   param_groups.<i>.lr                                                 (every optimizer)
/// `step` (int64) and `lr` (float64) are 0-d views of the optimizer's own counters.
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

}  // namespace dcp
