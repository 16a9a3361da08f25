#include "dcp/torch_adapter.h"

#include <torch/version.h>

#include <sstream>
#include <type_traits>
#include <unordered_map>

#include "dcp/planner/flatten.h"
#include "dcp/proto/error.h"

namespace dcp {

namespace {

#define DCP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||      \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

struct Pair {
  c10::ScalarType torch;
  DType dcp;
};

const std::vector<Pair>& Pairs() {
  static const std::vector<Pair> pairs = {
    {c10::ScalarType::Bool, DType::kBool},
    {c10::ScalarType::Byte, DType::kUInt8},
    {c10::ScalarType::Char, DType::kInt8},
    {c10::ScalarType::Short, DType::kInt16},
    {c10::ScalarType::Int, DType::kInt32},
    {c10::ScalarType::Long, DType::kInt64},
    {c10::ScalarType::Half, DType::kFloat16},
    {c10::ScalarType::BFloat16, DType::kBFloat16},
    {c10::ScalarType::Float, DType::kFloat32},
    {c10::ScalarType::Double, DType::kFloat64},
    {c10::ScalarType::ComplexHalf, DType::kComplex32},
    {c10::ScalarType::ComplexFloat, DType::kComplex64},
    {c10::ScalarType::ComplexDouble, DType::kComplex128},
#if DCP_TORCH_AT_LEAST(2, 1)
    {c10::ScalarType::Float8_e4m3fn, DType::kFloat8_e4m3fn},
    {c10::ScalarType::Float8_e5m2, DType::kFloat8_e5m2},
#endif
#if DCP_TORCH_AT_LEAST(2, 2)
    {c10::ScalarType::Float8_e4m3fnuz, DType::kFloat8_e4m3fnuz},
    {c10::ScalarType::Float8_e5m2fnuz, DType::kFloat8_e5m2fnuz},
#endif
#if DCP_TORCH_AT_LEAST(2, 3)
    {c10::ScalarType::UInt16, DType::kUInt16},
    {c10::ScalarType::UInt32, DType::kUInt32},
    {c10::ScalarType::UInt64, DType::kUInt64},
#endif
#if DCP_TORCH_AT_LEAST(2, 7)
    {c10::ScalarType::Float8_e8m0fnu, DType::kFloat8_e8m0fnu},
#endif
  };
  return pairs;
}

}  // namespace

DType FromTorchDType(c10::ScalarType type) {
  for (const auto& p : Pairs()) {
    if (p.torch == type) return p.dcp;
  }
  throw UnsupportedError(std::string("LibTorch dtype ") + c10::toString(type) +
                         " has no dcp equivalent");
}

c10::ScalarType ToTorchDType(DType dtype) {
  for (const auto& p : Pairs()) {
    if (p.dcp == dtype) return p.torch;
  }
  throw UnsupportedError("dtype " + std::string(DTypeName(dtype)) +
                         " is not available in LibTorch " + TORCH_VERSION);
}

TensorView FromTorch(const torch::Tensor& tensor) {
  TensorView v;
  v.dtype = FromTorchDType(tensor.scalar_type());
  v.shape.assign(tensor.sizes().begin(), tensor.sizes().end());
  v.strides.assign(tensor.strides().begin(), tensor.strides().end());
  v.data = tensor.numel() > 0 ? tensor.data_ptr() : nullptr;
  if (tensor.device().is_cuda()) {
    v.device = Device{Device::Type::kCUDA, tensor.device().index()};
    // dcp copies on its own CUDA streams, which wait for the legacy default stream only; work
    // LibTorch queued on other streams (a user's side stream, say) must finish first.
    torch::cuda::synchronize(tensor.device().index());
  } else if (!tensor.device().is_cpu()) {
    throw UnsupportedError("tensors on " + tensor.device().str() + " are not supported");
  }
  // Hold a reference to the tensor (and so its storage) for as long as the view lives.
  v.owner = std::shared_ptr<void>(new torch::Tensor(tensor),
                                  [](void* p) { delete static_cast<torch::Tensor*>(p); });
  return v;
}

torch::Tensor ToTorch(const TensorView& view) {
  auto options = torch::TensorOptions().dtype(ToTorchDType(view.dtype));
  if (!view.device.is_cpu()) options = options.device(torch::kCUDA, view.device.index);
  std::shared_ptr<void> owner = view.owner;
  return torch::from_blob(
      view.data, view.shape, view.effective_strides(), [owner](void*) mutable { owner.reset(); },
      options);
}

StateDict& AddModuleState(const torch::nn::Module& module, StateDict& into) {
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    into.Set(item.key(), FromTorch(item.value()));
  }
  for (const auto& item : module.named_buffers(/*recurse=*/true)) {
    into.Set(item.key(), FromTorch(item.value()));
  }
  return into;
}

// ---------------------------------------------------------------------------------------------
// Optimizer state

namespace {

// The key of a parameter in Optimizer::state(): the TensorImpl pointer (LibTorch 2.x) or its
// rendering as a string (LibTorch 1.13, c10::guts::to_string of the pointer).
template <typename Key>
Key StateKey(const torch::Tensor& p) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream os;
    os << p.unsafeGetTensorImpl();
    return os.str();
  } else {
    return static_cast<Key>(p.unsafeGetTensorImpl());
  }
}

// A 0-d view of a scalar member of the optimizer (a step counter, a learning rate).
template <typename T>
TensorView ScalarView(T* value, DType dtype) {
  return TensorView::FromContiguous(value, dtype, {});
}

}  // namespace

StateDict& AddOptimizerState(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                             StateDict& into, const StateWrapper& wrap) {
  auto* adam = dynamic_cast<torch::optim::Adam*>(&optimizer);
  auto* adamw = dynamic_cast<torch::optim::AdamW*>(&optimizer);
  auto* sgd = dynamic_cast<torch::optim::SGD*>(&optimizer);
  if (!adam && !adamw && !sgd) {
    throw UnsupportedError("AddOptimizerState supports torch::optim Adam, AdamW and SGD");
  }
  std::unordered_map<const void*, std::string> names;
  for (const auto& item : module.named_parameters(/*recurse=*/true)) {
    names.emplace(item.value().unsafeGetTensorImpl(), item.key());
  }
  auto value = [&](const std::string& name, const torch::Tensor& t) -> StateValue {
    return wrap ? wrap(name, t) : StateValue(FromTorch(t));
  };
  auto& state = optimizer.state();
  using Key = typename std::decay_t<decltype(state)>::key_type;
  StateDict& state_sd = into.Nested("state");
  StateDict& groups_sd = into.Nested("param_groups");
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    auto& group = groups[g];
    StateDict& gsd = groups_sd.Nested(std::to_string(g));
    if (adam) {
      gsd.Set("lr", ScalarView(&static_cast<torch::optim::AdamOptions&>(group.options()).lr(),
                               DType::kFloat64));
    } else if (adamw) {
      gsd.Set("lr", ScalarView(&static_cast<torch::optim::AdamWOptions&>(group.options()).lr(),
                               DType::kFloat64));
    } else {
      gsd.Set("lr", ScalarView(&static_cast<torch::optim::SGDOptions&>(group.options()).lr(),
                               DType::kFloat64));
    }
    for (auto& p : group.params()) {
      auto name_it = names.find(p.unsafeGetTensorImpl());
      if (name_it == names.end()) {
        throw InvalidArgumentError("an optimizer parameter of shape " +
                                   ShapeToString(Shape(p.sizes().begin(), p.sizes().end())) +
                                   " is not a parameter of the module");
      }
      const std::string& name = name_it->second;
      const Key key = StateKey<Key>(p);
      auto it = state.find(key);
      auto zeros = [&] { return torch::zeros_like(p, torch::MemoryFormat::Preserve).detach(); };
      StateDict& psd = state_sd.Nested(name);
      if (adam || adamw) {
        const bool amsgrad =
            adam ? static_cast<torch::optim::AdamOptions&>(group.options()).amsgrad()
                 : static_cast<torch::optim::AdamWOptions&>(group.options()).amsgrad();
        auto fill = [&](auto* st) {
          psd.Set("step", ScalarView(&st->step(), DType::kInt64));
          psd.Set("exp_avg", value(name, st->exp_avg()));
          psd.Set("exp_avg_sq", value(name, st->exp_avg_sq()));
          if (amsgrad) {
            if (!st->max_exp_avg_sq().defined()) st->max_exp_avg_sq(zeros());
            psd.Set("max_exp_avg_sq", value(name, st->max_exp_avg_sq()));
          }
        };
        if (adam) {
          if (it == state.end()) {
            auto st = std::make_unique<torch::optim::AdamParamState>();
            st->step(0);
            st->exp_avg(zeros());
            st->exp_avg_sq(zeros());
            if (amsgrad) st->max_exp_avg_sq(zeros());
            it = state.emplace(key, std::move(st)).first;
          }
          fill(static_cast<torch::optim::AdamParamState*>(it->second.get()));
        } else {
          if (it == state.end()) {
            auto st = std::make_unique<torch::optim::AdamWParamState>();
            st->step(0);
            st->exp_avg(zeros());
            st->exp_avg_sq(zeros());
            if (amsgrad) st->max_exp_avg_sq(zeros());
            it = state.emplace(key, std::move(st)).first;
          }
          fill(static_cast<torch::optim::AdamWParamState*>(it->second.get()));
        }
      } else {
        if (static_cast<torch::optim::SGDOptions&>(group.options()).momentum() == 0) continue;
        if (it == state.end()) {
          auto st = std::make_unique<torch::optim::SGDParamState>();
          st->momentum_buffer(zeros());
          it = state.emplace(key, std::move(st)).first;
        }
        auto* st = static_cast<torch::optim::SGDParamState*>(it->second.get());
        psd.Set("momentum_buffer", value(name, st->momentum_buffer()));
      }
    }
  }
  return into;
}

// ---------------------------------------------------------------------------------------------
// Device mapping

std::map<std::string, torch::Tensor> LoadAllTensors(const std::string& uri, Communicator& comm,
                                                    const torch::Device& map_location,
                                                    std::map<std::string, std::string>* blobs,
                                                    LoadOptions options) {
  options.load_all = true;
  StateDict sd;
  Load(sd, uri, comm, options);
  std::map<std::string, torch::Tensor> out;
  for (auto& [fqn, entry] : FlattenStateDict(sd)) {
    if (const auto* t = std::get_if<TensorView>(entry.value)) {
      torch::Tensor tensor = ToTorch(*t);
      out.emplace(fqn, map_location.is_cpu() ? tensor : tensor.to(map_location));
    } else if (const auto* b = std::get_if<Blob>(entry.value)) {
      if (blobs) (*blobs)[fqn] = b->bytes;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Sharding helpers

std::pair<int64_t, int64_t> ShardRange(int64_t size, int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world || size < 0) {
    throw InvalidArgumentError("ShardRange: rank " + std::to_string(rank) + " of world " +
                               std::to_string(world) + " for size " + std::to_string(size));
  }
  const int64_t base = size / world, extra = size % world;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

torch::Tensor ShardOf(const torch::Tensor& full, int64_t dim, int rank, int world) {
  if (dim < 0 || dim >= full.dim()) {
    throw InvalidArgumentError("ShardOf: dim " + std::to_string(dim) + " of a " +
                               std::to_string(full.dim()) + "-d tensor");
  }
  auto [b, e] = ShardRange(full.size(dim), rank, world);
  return full.narrow(dim, b, e - b);
}

ShardedTensor MakeShardedTensor(const torch::Tensor& local,
                                const std::vector<int64_t>& global_shape, int64_t dim, int rank,
                                int world) {
  if (dim < 0 || dim >= static_cast<int64_t>(global_shape.size())) {
    throw InvalidArgumentError("MakeShardedTensor: dim " + std::to_string(dim) + " of shape " +
                               ShapeToString(global_shape));
  }
  auto [b, e] = ShardRange(global_shape[dim], rank, world);
  Shape expect = global_shape;
  expect[dim] = e - b;
  const Shape got(local.sizes().begin(), local.sizes().end());
  if (got != expect) {
    throw InvalidArgumentError("MakeShardedTensor: rank " + std::to_string(rank) + " of " +
                               std::to_string(world) + " should hold " + ShapeToString(expect) +
                               " of " + ShapeToString(global_shape) + ", got " +
                               ShapeToString(got));
  }
  ShardedTensor st{FromTorchDType(local.scalar_type()), global_shape, {}};
  if (e > b) {
    Shape offsets(global_shape.size(), 0);
    offsets[dim] = b;
    st.local_shards.push_back({FromTorch(local), offsets});
  }
  return st;
}

torch::Tensor Unshard(const std::vector<torch::Tensor>& shards, int64_t dim) {
  if (shards.empty()) throw InvalidArgumentError("Unshard: no shards");
  return torch::cat(shards, dim);
}

}  // namespace dcp
