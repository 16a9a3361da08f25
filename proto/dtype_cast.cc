#include "dcp/proto/dtype_cast.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "dcp/proto/error.h"

namespace dcp {
namespace {

struct BFloat16 {
  uint16_t bits;
};

// IEEE binary16 by hand: not every supported compiler has _Float16 on x86-64 (clang 14 does
// not).
struct Float16 {
  uint16_t bits;
};

float ToFloat(Float16 v) {
  const uint32_t sign = static_cast<uint32_t>(v.bits & 0x8000) << 16;
  const uint32_t exponent = (v.bits >> 10) & 0x1F;
  const uint32_t mantissa = v.bits & 0x3FF;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24, exact in float
    const float magnitude = std::ldexp(static_cast<float>(mantissa), -24);
    return sign ? -magnitude : magnitude;
  }
  const uint32_t bits = exponent == 31 ? sign | 0x7F800000 | (mantissa << 13)
                                       : sign | ((exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

// Round to nearest even, as a hardware conversion does.
Float16 ToFloat16(float f) {
  uint32_t x;
  std::memcpy(&x, &f, sizeof(x));
  const auto sign = static_cast<uint16_t>((x >> 16) & 0x8000);
  const uint32_t abs = x & 0x7FFFFFFF;
  if (abs > 0x7F800000) {  // NaN: quiet, keeping the top payload bits
    return {static_cast<uint16_t>(sign | 0x7E00 | ((abs >> 13) & 0x3FF))};
  }
  if (abs >= 0x477FF000) return {static_cast<uint16_t>(sign | 0x7C00)};  // >= 65520: infinity
  if (abs >= 0x38800000) {  // normal in binary16 (>= 2^-14): rebias, round on 13 bits
    uint32_t r = abs - (112u << 23);
    r += 0xFFF + ((r >> 13) & 1);
    return {static_cast<uint16_t>(sign | (r >> 13))};
  }
  if (abs < 0x33000000) return {sign};  // below 2^-25: rounds to zero
  // Subnormal: units of 2^-24.
  const uint32_t mantissa = (abs & 0x7FFFFF) | 0x800000;
  const uint32_t shift = 126 - (abs >> 23);
  uint32_t units = mantissa >> shift;
  const uint32_t rest = mantissa & ((1u << shift) - 1);
  const uint32_t half = 1u << (shift - 1);
  if (rest > half || (rest == half && (units & 1))) ++units;
  return {static_cast<uint16_t>(sign | units)};
}

float ToFloat(BFloat16 v) {
  const uint32_t bits = static_cast<uint32_t>(v.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

BFloat16 ToBFloat16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof(bits));
  if (std::isnan(f)) return {static_cast<uint16_t>((bits >> 16) | 0x0040)};  // quiet NaN
  bits += 0x7FFF + ((bits >> 16) & 1);  // round to nearest even
  return {static_cast<uint16_t>(bits >> 16)};
}

// Every value goes through one wide intermediate: long double holds every int64, uint64 and
// double exactly on x86-64 (64-bit mantissa) and is double elsewhere.
template <class T>
long double Widen(T v) {
  if constexpr (std::is_same_v<T, BFloat16>) {
    return ToFloat(v);
  } else if constexpr (std::is_same_v<T, Float16>) {
    return ToFloat(v);
  } else {
    return static_cast<long double>(v);
  }
}

template <class T>
T Narrow(long double v) {
  if constexpr (std::is_same_v<T, bool>) {
    return v != 0;
  } else if constexpr (std::is_same_v<T, BFloat16>) {
    return ToBFloat16(static_cast<float>(v));
  } else if constexpr (std::is_same_v<T, Float16>) {
    return ToFloat16(static_cast<float>(v));
  } else if constexpr (std::is_floating_point_v<T>) {
    return static_cast<T>(v);
  } else {
    if (std::isnan(v)) return 0;
    const long double t = std::trunc(v);
    if (t <= static_cast<long double>(std::numeric_limits<T>::min())) {
      return std::numeric_limits<T>::min();
    }
    if (t >= static_cast<long double>(std::numeric_limits<T>::max())) {
      return std::numeric_limits<T>::max();
    }
    return static_cast<T>(t);
  }
}

template <class S, class D>
void ConvertRun(void* dst, const void* src, size_t n) {
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  for (size_t i = 0; i < n; ++i) {
    S in;
    std::memcpy(&in, s + i * sizeof(S), sizeof(S));
    const D out = Narrow<D>(Widen(in));
    std::memcpy(d + i * sizeof(D), &out, sizeof(D));
  }
}

// Calls fn(T{}) with the C++ type of `dtype`; false for dtypes without one here.
template <class Fn>
bool WithType(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBool:
      fn(bool{});
      return true;
    case DType::kUInt8:
      fn(uint8_t{});
      return true;
    case DType::kInt8:
      fn(int8_t{});
      return true;
    case DType::kInt16:
      fn(int16_t{});
      return true;
    case DType::kInt32:
      fn(int32_t{});
      return true;
    case DType::kInt64:
      fn(int64_t{});
      return true;
    case DType::kUInt16:
      fn(uint16_t{});
      return true;
    case DType::kUInt32:
      fn(uint32_t{});
      return true;
    case DType::kUInt64:
      fn(uint64_t{});
      return true;
    case DType::kFloat16:
      fn(Float16{});
      return true;
    case DType::kBFloat16:
      fn(BFloat16{});
      return true;
    case DType::kFloat32:
      fn(float{});
      return true;
    case DType::kFloat64:
      fn(double{});
      return true;
    default:
      return false;
  }
}

// Convert n contiguous elements.
void ConvertContiguous(void* dst, DType to, const void* src, DType from, size_t n) {
  const bool known = WithType(from, [&](auto s) {
    WithType(to, [&](auto d) { ConvertRun<decltype(s), decltype(d)>(dst, src, n); });
  });
  if (!known) throw InternalError("no conversion from " + std::string(DTypeName(from)));
}

}  // namespace

bool CanCastDType(DType from, DType to) {
  return WithType(from, [](auto) {}) && WithType(to, [](auto) {});
}

void CastTensor(const TensorView& dst, const TensorView& src) {
  if (!CanCastDType(src.dtype, dst.dtype)) {
    throw UnsupportedError("cannot convert " + std::string(DTypeName(src.dtype)) + " to " +
                           std::string(DTypeName(dst.dtype)) +
                           " (conversions exist between bool, integers, float16, bfloat16, "
                           "float32 and float64)");
  }
  if (dst.shape != src.shape) {
    throw InvalidArgumentError("cast from " + src.ToString() + " into " + dst.ToString() +
                               ": shapes differ");
  }
  if (!src.device.is_cpu()) throw UnsupportedError("a cast reads host memory only");
  // Convert from and to contiguous host memory; CopyTensor does strides and devices.
  TensorView from = src;
  if (!IsDense(src)) {
    from = TensorView::Allocate(src.dtype, src.shape);
    CopyTensor(from, src);
  }
  const size_t n = static_cast<size_t>(src.numel());
  if (dst.device.is_cpu() && IsDense(dst)) {
    ConvertContiguous(dst.data, dst.dtype, from.data, src.dtype, n);
    return;
  }
  TensorView to = TensorView::Allocate(dst.dtype, dst.shape);
  ConvertContiguous(to.data, dst.dtype, from.data, src.dtype, n);
  CopyTensor(dst, to);
}

}  // namespace dcp
