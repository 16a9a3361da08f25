// CastTensor (proto/dtype_cast.h): the conversions a casting load applies, value by value.
#include "dcp/proto/dtype_cast.h"

#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "dcp/proto/error.h"

using namespace dcp;

namespace {

template <class D, class S>
std::vector<D> Cast(const std::vector<S>& in, DType from, DType to) {
  std::vector<D> out(in.size());
  CastTensor(TensorView::FromContiguous(out.data(), to, {static_cast<int64_t>(out.size())}),
             TensorView::FromContiguous(const_cast<S*>(in.data()), from,
                                        {static_cast<int64_t>(in.size())}));
  return out;
}

float FromBits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

}  // namespace

TEST_CASE("cast: float32 to bfloat16 rounds to nearest even and keeps NaN", "[cast]") {
  const std::vector<float> in = {
      1.0f,
      FromBits(0x3F808000),  // 1 + 2^-8: a tie, rounds down to even 0x3F80
      FromBits(0x3F818000),  // 1 + 3 * 2^-8: a tie, rounds up to even 0x3F82
      FromBits(0x3F808001),  // just above the tie: up
      -2.5f,
      std::numeric_limits<float>::infinity(),
      std::numeric_limits<float>::quiet_NaN()};
  const auto out = Cast<uint16_t>(in, DType::kFloat32, DType::kBFloat16);
  CHECK(out[0] == 0x3F80);
  CHECK(out[1] == 0x3F80);
  CHECK(out[2] == 0x3F82);
  CHECK(out[3] == 0x3F81);
  CHECK(out[4] == 0xC020);
  CHECK(out[5] == 0x7F80);
  CHECK((out[6] & 0x7F80) == 0x7F80);
  CHECK((out[6] & 0x007F) != 0);  // still a NaN, not infinity
}

TEST_CASE("cast: float16 both ways and float to integer truncation with saturation", "[cast]") {
  const std::vector<float> in = {0.5f, 65504.0f, 1e6f, -1.0f};
  const auto half = Cast<uint16_t>(in, DType::kFloat32, DType::kFloat16);
  CHECK(half == std::vector<uint16_t>{0x3800, 0x7BFF, 0x7C00, 0xBC00});  // 1e6 overflows to inf
  // Subnormals: 2^-24 is one unit; 3 * 2^-25 is a tie between 1 and 2 units (even: 2); 2^-26
  // rounds to zero; NaN stays NaN.
  const std::vector<float> tiny = {std::ldexp(1.0f, -24), 3 * std::ldexp(1.0f, -25),
                                   std::ldexp(1.0f, -26), -std::ldexp(1.0f, -14),
                                   std::numeric_limits<float>::quiet_NaN()};
  const auto tiny_half = Cast<uint16_t>(tiny, DType::kFloat32, DType::kFloat16);
  CHECK(tiny_half[0] == 0x0001);
  CHECK(tiny_half[1] == 0x0002);
  CHECK(tiny_half[2] == 0x0000);
  CHECK(tiny_half[3] == 0x8400);
  CHECK((tiny_half[4] & 0x7C00) == 0x7C00);
  CHECK((tiny_half[4] & 0x03FF) != 0);
  const auto tiny_back = Cast<float>(tiny_half, DType::kFloat16, DType::kFloat32);
  CHECK(tiny_back[0] == std::ldexp(1.0f, -24));
  CHECK(tiny_back[3] == -std::ldexp(1.0f, -14));
  const auto back = Cast<float>(half, DType::kFloat16, DType::kFloat32);
  CHECK(back[0] == 0.5f);
  CHECK(back[1] == 65504.0f);
  CHECK(std::isinf(back[2]));

  const std::vector<double> d = {2.9, -2.9, 300.0, -300.0, std::nan("")};
  CHECK(Cast<int8_t>(d, DType::kFloat64, DType::kInt8) == std::vector<int8_t>{2, -2, 127, -128, 0});
  CHECK(Cast<uint8_t>(d, DType::kFloat64, DType::kUInt8) == std::vector<uint8_t>{2, 0, 255, 0, 0});
  const auto b = Cast<uint8_t>(d, DType::kFloat64, DType::kBool);
  CHECK(b == std::vector<uint8_t>{1, 1, 1, 1, 1});
}

TEST_CASE("cast: 64-bit integers convert exactly and float8 is refused", "[cast]") {
  const std::vector<int64_t> big = {(int64_t{1} << 53) + 1, -5};
  CHECK(Cast<uint64_t>(big, DType::kInt64, DType::kUInt64) ==
        std::vector<uint64_t>{(uint64_t{1} << 53) + 1, 0});
  CHECK(Cast<int32_t>(big, DType::kInt64, DType::kInt32) == std::vector<int32_t>{2147483647, -5});
  CHECK_FALSE(CanCastDType(DType::kFloat8_e4m3fn, DType::kFloat32));
  CHECK_FALSE(CanCastDType(DType::kFloat32, DType::kComplex64));
  std::vector<uint8_t> f8(4);
  CHECK_THROWS_AS(Cast<float>(f8, DType::kFloat8_e4m3fn, DType::kFloat32), UnsupportedError);
}
