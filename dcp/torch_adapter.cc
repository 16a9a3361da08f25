#include "dcp/torch_adapter.h"

#include <torch/version.h>

#include "proto/error.h"

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

}  // namespace dcp
