#include "dcp/torch_adapter.h"

#include <torch/version.h>

#include <algorithm>
#include <cmath>
#include <mutex>
#include <optional>
#include <sstream>
#include <type_traits>
#include <unordered_map>

#include "dcp/planner/planner.h"
#include "dcp/proto/error.h"
#include "dcp/storage/format/pickle.h"
#include "dcp/storage/format/torch_dcp.h"

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

namespace {

// The view of `tensor` as it is now. The owner pins the tensor's storage itself, not only the
// TensorImpl: set_() (torch::load) and set_data() (module->to()) replace a TensorImpl's storage,
// which would otherwise be freed under the view.
TensorView DescribeTorch(const torch::Tensor& tensor) {
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
  struct Pin {
    torch::Tensor tensor;
    c10::Storage storage;
  };
  auto* pin = new Pin{tensor, tensor.has_storage() ? tensor.storage() : c10::Storage()};
  v.owner = std::shared_ptr<void>(pin, [](void* p) { delete static_cast<Pin*>(p); });
  return v;
}

// Follows one tensor object (its TensorImpl) through storage swaps, dtype and device moves.
class TorchTensorBinding : public ViewBinding {
 public:
  explicit TorchTensorBinding(torch::Tensor tensor) : tensor_(std::move(tensor)) {}
  TensorView Resolve() const override { return DescribeTorch(tensor_); }

 private:
  torch::Tensor tensor_;
};

}  // namespace

TensorView FromTorch(const torch::Tensor& tensor) {
  TensorView v = DescribeTorch(tensor);
  v.binding = std::make_shared<TorchTensorBinding>(tensor);
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

namespace {

// A module's parameters and buffers by name, listed once per resolution (ResolveEpoch) and
// shared by the bindings of every name: a submodule replaced since the state dict was built
// (replace_module, a new head) is followed by name, not by the old tensor objects.
class ModuleIndex {
 public:
  explicit ModuleIndex(const torch::nn::Module& module) : module_(module) {}
  torch::Tensor Find(const std::string& name) const {
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t epoch = ResolveEpoch();
    if (epoch != epoch_) {
      tensors_.clear();
      for (const auto& item : module_.named_parameters(/*recurse=*/true)) {
        tensors_.emplace(item.key(), item.value());
      }
      for (const auto& item : module_.named_buffers(/*recurse=*/true)) {
        tensors_.emplace(item.key(), item.value());
      }
      epoch_ = epoch;
    }
    auto it = tensors_.find(name);
    if (it == tensors_.end() || !it->second.defined()) {
      throw InvalidArgumentError("the module no longer has a parameter or buffer '" + name +
                                 "' (the state dict was built when it had)");
    }
    return it->second;
  }

 private:
  const torch::nn::Module& module_;
  mutable std::mutex mu_;
  mutable uint64_t epoch_ = 0;
  mutable std::unordered_map<std::string, torch::Tensor> tensors_;
};

class ModuleEntryBinding : public ViewBinding {
 public:
  ModuleEntryBinding(std::shared_ptr<const ModuleIndex> index, std::string name)
      : index_(std::move(index)), name_(std::move(name)) {}
  TensorView Resolve() const override { return DescribeTorch(index_->Find(name_)); }

 private:
  std::shared_ptr<const ModuleIndex> index_;
  std::string name_;
};

}  // namespace

StateDict& AddModuleState(const torch::nn::Module& module, StateDict& into) {
  auto index = std::make_shared<const ModuleIndex>(module);
  auto add = [&](const std::string& name, const torch::Tensor& t) {
    TensorView v = DescribeTorch(t);
    v.binding = std::make_shared<ModuleEntryBinding>(index, name);
    into.Set(name, std::move(v));
  };
  for (const auto& item : module.named_parameters(/*recurse=*/true)) add(item.key(), item.value());
  for (const auto& item : module.named_buffers(/*recurse=*/true)) add(item.key(), item.value());
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

// Numbers kept in optimizer or scheduler fields (a step counter, a learning rate, betas...):
// saved as an owned 0-d (or 1-d) tensor filled from the field at each save, and written back
// into the field after each load. Never a pointer into the object, whose state entries and
// options may be replaced between checkpoints.
class FieldBinding : public ViewBinding {
 public:
  using Getter = std::function<std::vector<double>()>;
  using Setter = std::function<void(const std::vector<double>&)>;
  FieldBinding(DType dtype, bool vector, Getter get, Setter set)
      : dtype_(dtype), vector_(vector), get_(std::move(get)), set_(std::move(set)) {}

  TensorView Resolve() const override {
    const std::vector<double> values = get_();
    TensorView v = TensorView::Allocate(
        dtype_, vector_ ? Shape{static_cast<int64_t>(values.size())} : Shape{});
    for (size_t i = 0; i < values.size(); ++i) {
      switch (dtype_) {
        case DType::kInt64:
          static_cast<int64_t*>(v.data)[i] = static_cast<int64_t>(values[i]);
          break;
        case DType::kBool:
          static_cast<bool*>(v.data)[i] = values[i] != 0;
          break;
        case DType::kFloat32:
          static_cast<float*>(v.data)[i] = static_cast<float>(values[i]);
          break;
        default:
          static_cast<double*>(v.data)[i] = values[i];
      }
    }
    return v;
  }
  void Loaded(const TensorView& loaded) const override {
    std::vector<double> values(static_cast<size_t>(loaded.numel()));
    for (size_t i = 0; i < values.size(); ++i) {
      switch (dtype_) {
        case DType::kInt64:
          values[i] = static_cast<double>(static_cast<const int64_t*>(loaded.data)[i]);
          break;
        case DType::kBool:
          values[i] = static_cast<const bool*>(loaded.data)[i] ? 1 : 0;
          break;
        case DType::kFloat32:
          values[i] = static_cast<const float*>(loaded.data)[i];
          break;
        default:
          values[i] = static_cast<const double*>(loaded.data)[i];
      }
    }
    set_(values);
  }

 private:
  DType dtype_;
  bool vector_;
  Getter get_;
  Setter set_;
};

TensorView Field(DType dtype, FieldBinding::Getter get, FieldBinding::Setter set,
                 bool vector = false) {
  auto binding = std::make_shared<FieldBinding>(dtype, vector, std::move(get), std::move(set));
  TensorView v = binding->Resolve();
  v.binding = std::move(binding);
  return v;
}

// A state tensor of the optimizer (exp_avg, ...), looked up afresh at each save and load, so a
// state entry the optimizer replaced (a load of its own, a reset) is followed, never freed under
// a view.
class OptimizerStateBinding : public ViewBinding {
 public:
  explicit OptimizerStateBinding(std::function<torch::Tensor()> find) : find_(std::move(find)) {}
  TensorView Resolve() const override { return DescribeTorch(find_()); }

 private:
  std::function<torch::Tensor()> find_;
};

// The state dict value of one optimizer state tensor. With a StateWrapper, what it returns
// (called once, now: a wrapper may capture locals by reference); its views made by FromTorch
// follow the state tensor object they were made from.
StateValue StateTensor(const std::function<torch::Tensor()>& find, const std::string& name,
                       const StateWrapper& wrap) {
  const torch::Tensor now = find();
  if (wrap) return wrap(name, now);
  TensorView v = DescribeTorch(now);
  v.binding = std::make_shared<OptimizerStateBinding>(find);
  return v;
}

template <typename Options>
Options& GroupOptions(torch::optim::Optimizer& opt, size_t g) {
  auto& groups = opt.param_groups();
  if (g >= groups.size()) {
    throw InvalidArgumentError("the optimizer has " + std::to_string(groups.size()) +
                               " parameter groups; the state dict was built with group " +
                               std::to_string(g));
  }
  return static_cast<Options&>(groups[g].options());
}

// lr, betas, eps, weight_decay, amsgrad of an Adam or AdamW parameter group.
template <typename Options>
void AddAdamGroup(torch::optim::Optimizer& opt, size_t g, StateDict& gsd) {
  auto get = [&opt, g] { return &GroupOptions<Options>(opt, g); };
  auto one = [](double v) { return std::vector<double>{v}; };
  gsd.Set("lr", Field(
                    DType::kFloat64, [get, one] { return one(get()->lr()); },
                    [get](const std::vector<double>& v) { get()->lr(v.at(0)); }));
  gsd.Set("betas", Field(
                       DType::kFloat64,
                       [get] {
                         const auto& b = get()->betas();
                         return std::vector<double>{std::get<0>(b), std::get<1>(b)};
                       },
                       [get](const std::vector<double>& v) {
                         get()->betas(std::make_tuple(v.at(0), v.at(1)));
                       },
                       /*vector=*/true));
  gsd.Set("eps", Field(
                     DType::kFloat64, [get, one] { return one(get()->eps()); },
                     [get](const std::vector<double>& v) { get()->eps(v.at(0)); }));
  gsd.Set("weight_decay",
          Field(
              DType::kFloat64, [get, one] { return one(get()->weight_decay()); },
              [get](const std::vector<double>& v) { get()->weight_decay(v.at(0)); }));
  // amsgrad decides whether max_exp_avg_sq is part of each parameter's state, so it is part of
  // the state dict's structure: a checkpoint saved with another setting cannot resume exactly.
  const bool built_amsgrad = get()->amsgrad();
  gsd.Set("amsgrad",
          Field(
              DType::kBool, [get, one] { return one(get()->amsgrad() ? 1 : 0); },
              [get, built_amsgrad, g](const std::vector<double>& v) {
                if ((v.at(0) != 0) != built_amsgrad) {
                  throw InvalidArgumentError("param group " + std::to_string(g) +
                                             ": the checkpoint has "
                                             "amsgrad=" +
                                             (v.at(0) != 0 ? "true" : "false") +
                                             " but the optimizer was built with amsgrad=" +
                                             (built_amsgrad ? "true" : "false") +
                                             " (max_exp_avg_sq would be lost); build it with the "
                                             "checkpoint's amsgrad before AddOptimizerState");
                }
                get()->amsgrad(v.at(0) != 0);
              }));
}

void AddSgdGroup(torch::optim::Optimizer& opt, size_t g, StateDict& gsd) {
  using O = torch::optim::SGDOptions;
  auto get = [&opt, g] { return &GroupOptions<O>(opt, g); };
  auto one = [](double v) { return std::vector<double>{v}; };
  gsd.Set("lr", Field(
                    DType::kFloat64, [get, one] { return one(get()->lr()); },
                    [get](const std::vector<double>& v) { get()->lr(v.at(0)); }));
  gsd.Set("momentum", Field(
                          DType::kFloat64, [get, one] { return one(get()->momentum()); },
                          [get](const std::vector<double>& v) { get()->momentum(v.at(0)); }));
  gsd.Set("dampening", Field(
                           DType::kFloat64, [get, one] { return one(get()->dampening()); },
                           [get](const std::vector<double>& v) { get()->dampening(v.at(0)); }));
  gsd.Set("weight_decay",
          Field(
              DType::kFloat64, [get, one] { return one(get()->weight_decay()); },
              [get](const std::vector<double>& v) { get()->weight_decay(v.at(0)); }));
  gsd.Set("nesterov", Field(
                          DType::kBool, [get, one] { return one(get()->nesterov() ? 1 : 0); },
                          [get](const std::vector<double>& v) { get()->nesterov(v.at(0) != 0); }));
}

// The optimizer's state entry of `param`, created as the optimizer's first step would create it
// when absent (Adam/AdamW: zeros, step 0; SGD: a zero momentum buffer).
template <typename ParamState>
ParamState& FindState(torch::optim::Optimizer& opt, const torch::Tensor& param, bool amsgrad) {
  auto& state = opt.state();
  using Key = typename std::decay_t<decltype(state)>::key_type;
  const Key key = StateKey<Key>(param);
  auto it = state.find(key);
  auto zeros = [&] { return torch::zeros_like(param, torch::MemoryFormat::Preserve).detach(); };
  if (it == state.end()) {
    auto st = std::make_unique<ParamState>();
    if constexpr (std::is_same_v<ParamState, torch::optim::SGDParamState>) {
      st->momentum_buffer(zeros());
    } else {
      st->step(0);
      st->exp_avg(zeros());
      st->exp_avg_sq(zeros());
      if (amsgrad) st->max_exp_avg_sq(zeros());
    }
    it = state.emplace(key, std::move(st)).first;
  }
  auto& st = static_cast<ParamState&>(*it->second);
  if constexpr (!std::is_same_v<ParamState, torch::optim::SGDParamState>) {
    if (amsgrad && !st.max_exp_avg_sq().defined()) st.max_exp_avg_sq(zeros());
  }
  return st;
}

template <typename ParamState, typename Options>
void AddAdamParam(torch::optim::Optimizer& opt, size_t g, const torch::Tensor& p,
                  const std::string& name, StateDict& psd, const StateWrapper& wrap, bool torch2) {
  auto amsgrad = [&opt, g] { return GroupOptions<Options>(opt, g).amsgrad(); };
  auto st = [&opt, p, amsgrad]() -> ParamState& {
    return FindState<ParamState>(opt, p, amsgrad());
  };
  auto add = [&](const char* key, const std::function<torch::Tensor()>& find) {
    psd.Set(key, StateTensor(find, name, wrap));
  };
  // torch 2.x keeps step as a 0-d float32 tensor; LibTorch as an int64.
  psd.Set("step", Field(
                      torch2 ? DType::kFloat32 : DType::kInt64,
                      [st] { return std::vector<double>{static_cast<double>(st().step())}; },
                      [st](const std::vector<double>& v) {
                        st().step(static_cast<int64_t>(std::llround(v.at(0))));
                      }));
  add("exp_avg", [st] { return st().exp_avg(); });
  add("exp_avg_sq", [st] { return st().exp_avg_sq(); });
  if (amsgrad()) add("max_exp_avg_sq", [st] { return st().max_exp_avg_sq(); });
}

// ---------------------------------------------------------------------------------------------
// The torch 2.x layout's parameter-group options: byte entries, each a torch.save archive of the
// pickled Python value (as torch.distributed.checkpoint writes a non-tensor), made from the
// optimizer at each save and parsed and written back after each load.

using PyGetter = std::function<pickle::ValuePtr()>;
// Applies a loaded value; `key` is the entry's full name, for messages.
using PySetter = std::function<void(const pickle::Value&, const std::string& key)>;

class PyFieldBinding : public BlobBinding {
 public:
  PyFieldBinding(std::string key, PyGetter get, PySetter set)
      : key_(std::move(key)), get_(std::move(get)), set_(std::move(set)) {}
  std::string Bytes() const override { return TorchSaveOfPickle(pickle::Dump(*get_())); }
  void Loaded(const std::string& bytes) const override {
    const pickle::ValuePtr v = TorchSaveObject(bytes, key_);
    if (set_) set_(*v, key_);
  }

 private:
  std::string key_;
  PyGetter get_;
  PySetter set_;
};

[[noreturn]] void BadGroupValue(const std::string& key, const char* want, const pickle::Value& v) {
  throw InvalidArgumentError("'" + key + "': expected " + want + ", the checkpoint has " +
                             v.Describe());
}

double FloatOf(const pickle::Value& v, const std::string& key) {
  const auto f = v.AsFloat();
  if (!f) BadGroupValue(key, "a float", v);
  return *f;
}

bool BoolOf(const pickle::Value& v, const std::string& key) {
  const auto b = v.AsBool();
  if (!b) BadGroupValue(key, "a bool", v);
  return *b;
}

// Adds the group options of a torch 2.x param group as byte entries under `gsd`.
class Torch2Group {
 public:
  Torch2Group(StateDict& gsd, std::string base, bool extras)
      : gsd_(gsd), base_(std::move(base)), extras_(extras) {}
  // Whether the options LibTorch has no counterpart for are part of the layout
  // (OptimizerStateOptions::torch2_extra_options).
  bool extras() const { return extras_; }
  void Add(const std::string& key, PyGetter get, PySetter set = {}) {
    auto binding = std::make_shared<PyFieldBinding>(base_ + key, std::move(get), std::move(set));
    std::string bytes = binding->Bytes();
    gsd_.Set(key, Blob{std::move(bytes), std::move(binding)});
  }
  void AddFloat(const std::string& key, std::function<double()> get,
                std::function<void(double)> set) {
    Add(
        key, [get] { return pickle::Float(get()); },
        [set](const pickle::Value& v, const std::string& k) { set(FloatOf(v, k)); });
  }
  // A torch option LibTorch lacks, always `value` here; a checkpoint's other value is accepted
  // (an implementation choice of the torch that wrote it: foreach, fused, ...) or refused with
  // `refuse` (it changes the results: maximize).
  void AddFixed(const std::string& key, pickle::ValuePtr value, const char* refuse = nullptr) {
    if (!extras_) return;
    std::string expect = pickle::Dump(*value);
    Add(
        key, [value] { return value; },
        [refuse, expect](const pickle::Value& v, const std::string& k) {
          if (refuse && pickle::Dump(v) != expect) {
            throw UnsupportedError("'" + k + "' is " + v.Describe() + " other than " + refuse +
                                   ", which LibTorch's optimizer cannot do");
          }
        });
  }
  // `params`: the parameter names of the group; a load checks the checkpoint's group holds the
  // same ones.
  void AddParams(std::vector<std::string> names) {
    std::vector<pickle::ValuePtr> items;
    for (const auto& n : names) items.push_back(pickle::Str(n));
    auto list = pickle::List(std::move(items));
    Add(
        "params", [list] { return list; },
        [names](const pickle::Value& v, const std::string& k) {
          if (v.kind != pickle::Kind::kList) BadGroupValue(k, "a list of parameter names", v);
          std::vector<std::string> got;
          for (const auto& item : v.items) {
            const auto s = item->AsStr();
            if (!s) BadGroupValue(k, "a list of parameter names (str)", *item);
            got.push_back(*s);
          }
          std::vector<std::string> a = names, b = got;
          std::sort(a.begin(), a.end());
          std::sort(b.begin(), b.end());
          if (a != b) {
            std::string msg = "'" + k +
                              "': the checkpoint's group holds other parameters than "
                              "the optimizer's (checkpoint:";
            for (const auto& s : got) msg += " " + s;
            msg += "; optimizer:";
            for (const auto& s : names) msg += " " + s;
            throw InvalidArgumentError(msg + ")");
          }
        });
  }

 private:
  StateDict& gsd_;
  std::string base_;
  bool extras_;
};

// Adam/AdamW options as torch 2.11 lays out a param group (its keys, in its types).
template <typename Options>
void AddAdamGroupTorch2(torch::optim::Optimizer& opt, size_t g, Torch2Group& t, bool adamw) {
  auto get = [&opt, g] { return &GroupOptions<Options>(opt, g); };
  t.AddFloat(
      "lr", [get] { return get()->lr(); }, [get](double v) { get()->lr(v); });
  t.Add(
      "betas",
      [get] {
        const auto& b = get()->betas();
        return pickle::Tuple({pickle::Float(std::get<0>(b)), pickle::Float(std::get<1>(b))});
      },
      [get](const pickle::Value& v, const std::string& k) {
        if ((v.kind != pickle::Kind::kTuple && v.kind != pickle::Kind::kList) ||
            v.items.size() != 2) {
          BadGroupValue(k, "a tuple of 2 floats", v);
        }
        get()->betas(std::make_tuple(FloatOf(*v.items[0], k), FloatOf(*v.items[1], k)));
      });
  t.AddFloat(
      "eps", [get] { return get()->eps(); }, [get](double v) { get()->eps(v); });
  t.AddFloat(
      "weight_decay", [get] { return get()->weight_decay(); },
      [get](double v) { get()->weight_decay(v); });
  const bool built_amsgrad = get()->amsgrad();
  t.Add(
      "amsgrad", [get] { return pickle::Bool(get()->amsgrad()); },
      [built_amsgrad](const pickle::Value& v, const std::string& k) {
        const bool a = BoolOf(v, k);
        if (a != built_amsgrad) {
          throw InvalidArgumentError(
              "'" + k + "': the checkpoint has amsgrad=" + (a ? "True" : "False") +
              " but the optimizer was built with amsgrad=" + (built_amsgrad ? "true" : "false") +
              " (max_exp_avg_sq would be lost); build it with the checkpoint's amsgrad before "
              "AddOptimizerState");
        }
      });
  t.AddFixed("foreach", pickle::None());
  t.AddFixed("maximize", pickle::Bool(false), "False");
  t.AddFixed("capturable", pickle::Bool(false));
  t.AddFixed("differentiable", pickle::Bool(false));
  t.AddFixed("fused", pickle::None());
  // torch >= 2.6: AdamW is Adam with decoupled_weight_decay=True.
  if (!t.extras()) return;
  t.Add(
      "decoupled_weight_decay", [adamw] { return pickle::Bool(adamw); },
      [adamw](const pickle::Value& v, const std::string& k) {
        if (BoolOf(v, k) != adamw) {
          throw InvalidArgumentError("'" + k + "': the checkpoint's optimizer was " +
                                     (adamw ? "Adam" : "AdamW") +
                                     " (decoupled_weight_decay=" + (adamw ? "False" : "True") +
                                     "), this one is " + (adamw ? "AdamW" : "Adam"));
        }
      });
}

// SGD options as torch 2.11 lays out a param group.
void AddSgdGroupTorch2(torch::optim::Optimizer& opt, size_t g, Torch2Group& t) {
  using O = torch::optim::SGDOptions;
  auto get = [&opt, g] { return &GroupOptions<O>(opt, g); };
  t.AddFloat(
      "lr", [get] { return get()->lr(); }, [get](double v) { get()->lr(v); });
  t.AddFloat(
      "momentum", [get] { return get()->momentum(); }, [get](double v) { get()->momentum(v); });
  t.AddFloat(
      "dampening", [get] { return get()->dampening(); }, [get](double v) { get()->dampening(v); });
  t.AddFloat(
      "weight_decay", [get] { return get()->weight_decay(); },
      [get](double v) { get()->weight_decay(v); });
  t.Add(
      "nesterov", [get] { return pickle::Bool(get()->nesterov()); },
      [get](const pickle::Value& v, const std::string& k) { get()->nesterov(BoolOf(v, k)); });
  t.AddFixed("maximize", pickle::Bool(false), "False");
  t.AddFixed("foreach", pickle::None());
  t.AddFixed("differentiable", pickle::Bool(false));
  t.AddFixed("fused", pickle::None());
}

StateDict& AddOptimizerStateImpl(torch::optim::Optimizer& optimizer,
                                 const torch::nn::Module& module, StateDict& into,
                                 const OptimizerStateOptions& options) {
  const StateWrapper& wrap = options.wrap;
  const std::string& prefix = options.prefix;
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
  const bool torch2 = options.layout == OptimizerLayout::kTorch2;
  StateDict* base = &into;
  for (size_t begin = 0; begin < prefix.size();) {
    size_t end = prefix.find('.', begin);
    if (end == std::string::npos) end = prefix.size();
    if (end == begin) throw InvalidArgumentError("optimizer state prefix '" + prefix + "'");
    base = &base->Nested(prefix.substr(begin, end - begin));
    begin = end + 1;
  }
  const std::string fqn_base = prefix.empty() ? std::string() : prefix + ".";
  StateDict& state_sd = base->Nested("state");
  StateDict& groups_sd = base->Nested("param_groups");
  auto& groups = optimizer.param_groups();
  for (size_t g = 0; g < groups.size(); ++g) {
    StateDict& gsd = groups_sd.Nested(std::to_string(g));
    std::optional<Torch2Group> t2;
    if (torch2) {
      t2.emplace(gsd, fqn_base + "param_groups." + std::to_string(g) + ".",
                 options.torch2_extra_options);
    }
    if (adam) {
      if (torch2) {
        AddAdamGroupTorch2<torch::optim::AdamOptions>(optimizer, g, *t2, false);
      } else {
        AddAdamGroup<torch::optim::AdamOptions>(optimizer, g, gsd);
      }
    } else if (adamw) {
      if (torch2) {
        AddAdamGroupTorch2<torch::optim::AdamWOptions>(optimizer, g, *t2, true);
      } else {
        AddAdamGroup<torch::optim::AdamWOptions>(optimizer, g, gsd);
      }
    } else if (torch2) {
      AddSgdGroupTorch2(optimizer, g, *t2);
    } else {
      AddSgdGroup(optimizer, g, gsd);
    }
    std::vector<std::string> group_names;
    for (auto& p : groups[g].params()) {
      auto name_it = names.find(p.unsafeGetTensorImpl());
      if (name_it == names.end()) {
        throw InvalidArgumentError("an optimizer parameter of shape " +
                                   ShapeToString(Shape(p.sizes().begin(), p.sizes().end())) +
                                   " is not a parameter of the module");
      }
      const std::string& name = name_it->second;
      group_names.push_back(name);
      StateDict& psd = state_sd.Nested(name);
      if (adam) {
        AddAdamParam<torch::optim::AdamParamState, torch::optim::AdamOptions>(optimizer, g, p, name,
                                                                              psd, wrap, torch2);
      } else if (adamw) {
        AddAdamParam<torch::optim::AdamWParamState, torch::optim::AdamWOptions>(
            optimizer, g, p, name, psd, wrap, torch2);
      } else {
        if (static_cast<torch::optim::SGDOptions&>(groups[g].options()).momentum() == 0) {
          continue;
        }
        std::function<torch::Tensor()> find = [&optimizer, p] {
          return FindState<torch::optim::SGDParamState>(optimizer, p, false).momentum_buffer();
        };
        psd.Set("momentum_buffer", StateTensor(find, name, wrap));
      }
    }
    if (torch2) t2->AddParams(std::move(group_names));
  }
  // A parameter without state (SGD without momentum) has no entry: no empty nested dict either.
  for (auto it = torch2 ? state_sd.items().begin() : state_sd.items().end();
       it != state_sd.items().end();) {
    auto* nested = std::get_if<std::shared_ptr<StateDict>>(&it->second);
    it = nested && *nested && (*nested)->empty() ? state_sd.items().erase(it) : std::next(it);
  }
  return into;
}

}  // namespace

StateDict& AddOptimizerState(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                             StateDict& into, const StateWrapper& wrap) {
  OptimizerStateOptions options;
  options.layout = OptimizerLayout::kDcp;
  options.prefix = "";
  options.wrap = wrap;
  return AddOptimizerStateImpl(optimizer, module, into, options);
}

StateDict& AddOptimizerState(torch::optim::Optimizer& optimizer, const torch::nn::Module& module,
                             StateDict& into, const OptimizerStateOptions& options) {
  return AddOptimizerStateImpl(optimizer, module, into, options);
}

namespace {
// LRScheduler keeps its step count in a protected member; a derived class may name it.
struct SchedulerAccess : torch::optim::LRScheduler {
  static unsigned& StepCount(torch::optim::LRScheduler& s) {
    return s.*(&SchedulerAccess::step_count_);
  }
};
}  // namespace

StateDict& AddSchedulerState(torch::optim::LRScheduler& scheduler, StateDict& into) {
  torch::optim::LRScheduler* s = &scheduler;
  into.Set(
      "step_count",
      Field(
          DType::kInt64,
          [s] { return std::vector<double>{static_cast<double>(SchedulerAccess::StepCount(*s))}; },
          [s](const std::vector<double>& v) {
            if (v.at(0) < 0) throw InvalidArgumentError("negative scheduler step count");
            SchedulerAccess::StepCount(*s) = static_cast<unsigned>(v.at(0));
          }));
  return into;
}

// ---------------------------------------------------------------------------------------------
// Device mapping

std::map<std::string, torch::Tensor> LoadAllTensors(const std::string& uri, Communicator& comm,
                                                    const torch::Device& map_location,
                                                    std::map<std::string, std::string>* blobs,
                                                    LoadOptions options) {
  StateDict sd = LoadAll(uri, comm, options);
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
