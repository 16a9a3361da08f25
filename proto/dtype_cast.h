// Converting tensor values between dtypes, as a load that casts needs (a bf16 checkpoint into
// an fp32 model: LoadOptions::cast_dtypes). Internal: not installed.
#pragma once

#include "dcp/proto/tensor.h"

namespace dcp {

/// True when CastTensor converts `from` into `to`: between bool, the integer types, float16,
/// bfloat16, float32 and float64. (float8 and complex values are not converted.)
bool CanCastDType(DType from, DType to);

/// Write every element of `src` into `dst`, converted to dst's dtype as torch's Tensor.copy_
/// converts: floats round to nearest even (to float16 and bfloat16 through float32, as torch
/// does), floats to integers truncate toward zero, saturating at the type's range (NaN gives 0;
/// torch leaves both undefined), anything non-zero to bool is true. Same shape; `src` is host
/// memory, `dst` host or device memory, either may be strided. UnsupportedError when
/// !CanCastDType(src.dtype, dst.dtype).
void CastTensor(const TensorView& dst, const TensorView& src);

}  // namespace dcp
