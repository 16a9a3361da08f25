// Internal (not installed): the strided-copy layout shared by CopyTensor and the device copies,
// and CopyTensor's host-to-host copy.
#pragma once

#include <cstdint>
#include <vector>

#include "dcp/proto/tensor.h"

namespace dcp::internal {

/// A copy problem reduced to the fewest dimensions: size-1 dims are dropped and adjacent dims
/// are merged when both sides step through them contiguously, so the innermost run is as long
/// as possible. Strides are in elements.
struct Layout {
  std::vector<int64_t> sizes, dst_strides, src_strides;
};

Layout Coalesce(const Shape& shape, const Shape& dst, const Shape& src);

/// CopyTensor between two host views, after its checks: same shape and dtype, at least one
/// element, both on the CPU. Runs of contiguous elements are copied with memcpy.
void CopyHostTensor(const TensorView& dst, const TensorView& src);

}  // namespace dcp::internal
