// The LibTorch adapter: the only part of dcp that includes LibTorch headers.
//
// Views, not copies: FromTorch(tensor) describes the tensor's memory (data pointer, dtype,
// shape, strides, device) and keeps its storage alive through TensorView::owner, so saving
// reads the tensor's own bytes and loading writes into it in place: parameters keep their
// identity and storage.
//
// Builds against LibTorch 1.13 (Debian) and 2.x; dtypes that a LibTorch version lacks
// (fp8 kinds before 2.1, unsigned 16/32/64 before 2.3) are simply not mapped there.
#pragma once

#include <torch/torch.h>

#include <string>

#include "proto/state_dict.h"

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

}  // namespace dcp
