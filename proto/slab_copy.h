// Internal (not installed): placing a slab of a stored chunk into a box destination, shared by
// the raw reader (storage/checkpoint/store_reader.cc) and the zstd reader
// (storage/format/zstd_transform.cc).
#pragma once

#include "dcp/proto/tensor.h"

namespace dcp {

/// A stored C-contiguous chunk of shape `sizes` is read in slabs: along the dims before `d` a
/// slab is one index (box-relative `prefix`), along `d` it is the box's indices [i, i + n), and
/// it holds every index of the dims after `d`. Copy the slab, held contiguously at `slab`, into
/// its place in `dst`, the destination of the box [box_off, box_off + box_len).
inline void CopySlabIntoBox(const TensorView& dst, void* slab, DType dtype, const Shape& sizes,
                            const Shape& box_off, const Shape& box_len, const Shape& prefix,
                            size_t d, int64_t i, int64_t n) {
  const size_t rank = sizes.size();
  // The slab as a full-rank view: 1 along the fixed dims, n along d, whole below.
  Shape slab_shape(rank, 1), src_off(rank, 0), len(rank, 1), dst_off(rank, 0);
  for (size_t j = 0; j < d; ++j) dst_off[j] = prefix[j];
  slab_shape[d] = n;
  len[d] = n;
  dst_off[d] = i;
  for (size_t j = d + 1; j < rank; ++j) {
    slab_shape[j] = sizes[j];
    src_off[j] = box_off[j];
    len[j] = box_len[j];
  }
  CopyTensor(dst.Narrow(dst_off, len),
             TensorView::FromContiguous(slab, dtype, slab_shape).Narrow(src_off, len));
}

}  // namespace dcp
