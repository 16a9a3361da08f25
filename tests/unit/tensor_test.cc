// The tensor vocabulary: dtypes, shapes, strides, views, boxes and strided copies.
#include "dcp/proto/tensor.h"

#include <unistd.h>

#include <catch2/catch.hpp>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "dcp/proto/error.h"
#include "support/test_support.h"

using namespace dcp;
using Catch::Matchers::Contains;
using dcp::testing::RandomTensor;

namespace {

// Address of element `idx` of `v`, computed directly from the view's strides (the reference
// the strided copy is checked against).
const char* ElementPtr(const TensorView& v, const Shape& idx) {
  const Shape st = v.strides.empty() ? ContiguousStrides(v.shape) : v.strides;
  int64_t off = 0;
  for (size_t d = 0; d < idx.size(); ++d) off += idx[d] * st[d];
  return static_cast<const char*>(v.data) + off * static_cast<int64_t>(ElementSize(v.dtype));
}

// Call `fn` with every multi-index of `shape` in row-major order.
void ForEachIndex(const Shape& shape, const std::function<void(const Shape&)>& fn) {
  if (NumElements(shape) == 0) return;
  Shape idx(shape.size(), 0);
  while (true) {
    fn(idx);
    size_t d = shape.size();
    while (d > 0) {
      --d;
      if (++idx[d] < shape[d]) break;
      idx[d] = 0;
      if (d == 0) return;
    }
    if (shape.empty()) return;
  }
}

// Number of elements of `a` and `b` whose bytes differ (same shape and dtype assumed).
int64_t CountMismatches(const TensorView& a, const TensorView& b) {
  REQUIRE(a.shape == b.shape);
  REQUIRE(a.dtype == b.dtype);
  const size_t es = ElementSize(a.dtype);
  int64_t bad = 0;
  ForEachIndex(a.shape, [&](const Shape& idx) {
    if (std::memcmp(ElementPtr(a, idx), ElementPtr(b, idx), es) != 0) ++bad;
  });
  return bad;
}

TensorView Strided(const TensorView& base, Shape shape, Shape strides, int64_t elem_offset = 0) {
  TensorView v = base;
  v.shape = std::move(shape);
  v.strides = std::move(strides);
  v.data = static_cast<char*>(base.data) + elem_offset * ElementSize(base.dtype);
  return v;
}

}  // namespace

TEST_CASE("tensor: ElementSize is right for every dtype", "[tensor][dtype]") {
  const std::map<DType, size_t> expected = {
      {DType::kBool, 1},
      {DType::kUInt8, 1},
      {DType::kInt8, 1},
      {DType::kFloat8_e4m3fn, 1},
      {DType::kFloat8_e5m2, 1},
      {DType::kFloat8_e4m3fnuz, 1},
      {DType::kFloat8_e5m2fnuz, 1},
      {DType::kFloat8_e8m0fnu, 1},
      {DType::kInt16, 2},
      {DType::kFloat16, 2},
      {DType::kBFloat16, 2},
      {DType::kUInt16, 2},
      {DType::kInt32, 4},
      {DType::kFloat32, 4},
      {DType::kComplex32, 4},
      {DType::kUInt32, 4},
      {DType::kInt64, 8},
      {DType::kFloat64, 8},
      {DType::kComplex64, 8},
      {DType::kUInt64, 8},
      {DType::kComplex128, 16},
  };
  const auto& all = AllDTypes();
  REQUIRE(all.size() == expected.size());
  for (size_t i = 0; i < all.size(); ++i) {
    INFO("dtype " << DTypeName(all[i]));
    CHECK(static_cast<int>(all[i]) == static_cast<int>(i) + 1);  // enum order, no gaps
    REQUIRE(expected.count(all[i]) == 1);
    CHECK(ElementSize(all[i]) == expected.at(all[i]));
  }
  CHECK_THROWS_AS(ElementSize(static_cast<DType>(0)), InvalidArgumentError);
  CHECK_THROWS_AS(ElementSize(static_cast<DType>(22)), InvalidArgumentError);
}

TEST_CASE("tensor: DTypeName and DTypeFromName round trip", "[tensor][dtype]") {
  std::set<std::string> names;
  for (DType dt : AllDTypes()) {
    const std::string name(DTypeName(dt));
    INFO("dtype " << name);
    CHECK(names.insert(name).second);  // names are unique
    const auto back = DTypeFromName(name);
    REQUIRE(back.has_value());
    CHECK(*back == dt);
  }
  CHECK(DTypeName(DType::kFloat32) == "float32");
  CHECK(DTypeName(DType::kBFloat16) == "bfloat16");
  CHECK(DTypeName(DType::kFloat8_e4m3fn) == "float8_e4m3fn");
  CHECK(DTypeName(DType::kComplex128) == "complex128");
  CHECK(DTypeName(DType::kBool) == "bool");
  CHECK_FALSE(DTypeFromName("Float32").has_value());
  CHECK_FALSE(DTypeFromName("float").has_value());
  CHECK_FALSE(DTypeFromName("").has_value());
}

TEST_CASE("tensor: IsValidDType accepts exactly the enum values", "[tensor][dtype]") {
  CHECK_FALSE(IsValidDType(0));
  CHECK_FALSE(IsValidDType(-1));
  CHECK_FALSE(IsValidDType(22));
  CHECK_FALSE(IsValidDType(255));
  for (DType dt : AllDTypes()) CHECK(IsValidDType(static_cast<int>(dt)));
}

TEST_CASE("tensor: NumElements", "[tensor][shape]") {
  CHECK(NumElements({}) == 1);
  CHECK(NumElements({7}) == 7);
  CHECK(NumElements({2, 3, 4}) == 24);
  CHECK(NumElements({0}) == 0);
  CHECK(NumElements({5, 0, 7}) == 0);
  CHECK(NumElements({std::numeric_limits<int64_t>::max(), 1}) ==
        std::numeric_limits<int64_t>::max());
  CHECK(NumElements({int64_t{1} << 31, int64_t{1} << 31}) == int64_t{1} << 62);

  CHECK_THROWS_AS(NumElements({-1}), InvalidArgumentError);
  CHECK_THROWS_WITH(NumElements({2, -3}), Contains("[2, -3]"));
  CHECK_THROWS_AS(NumElements({int64_t{1} << 32, int64_t{1} << 32}), InvalidArgumentError);
  CHECK_THROWS_WITH(NumElements({int64_t{1} << 62, 2}), Contains("overflow"));
  CHECK_THROWS_AS(NumElements({3, std::numeric_limits<int64_t>::max()}), InvalidArgumentError);
}

TEST_CASE("tensor: ShapeToString and ContiguousStrides", "[tensor][shape]") {
  CHECK(ShapeToString({}) == "[]");
  CHECK(ShapeToString({2, 3}) == "[2, 3]");
  CHECK(ContiguousStrides({}) == Shape{});
  CHECK(ContiguousStrides({5}) == Shape{1});
  CHECK(ContiguousStrides({2, 3, 4}) == Shape{12, 4, 1});
  CHECK(ContiguousStrides({4, 1, 3}) == Shape{3, 3, 1});
  // Zero-size dims count as 1 for the strides of outer dims (as in PyTorch).
  CHECK(ContiguousStrides({2, 0, 3}) == Shape{3, 3, 1});
}

TEST_CASE("tensor: TensorView::Narrow", "[tensor][view]") {
  TensorView t = TensorView::Allocate(DType::kInt32, {4, 5});
  auto* p = static_cast<int32_t*>(t.data);
  for (int i = 0; i < 20; ++i) p[i] = 100 + i;

  SECTION("box values and address") {
    TensorView v = t.Narrow({1, 2}, {2, 3});
    CHECK(v.shape == Shape{2, 3});
    CHECK(v.strides == Shape{5, 1});
    CHECK(v.data == p + 1 * 5 + 2);
    CHECK(v.dtype == DType::kInt32);
    CHECK_FALSE(v.is_contiguous());
    const int32_t expected[2][3] = {{107, 108, 109}, {112, 113, 114}};
    for (int64_t i = 0; i < 2; ++i) {
      for (int64_t j = 0; j < 3; ++j) {
        int32_t got;
        std::memcpy(&got, ElementPtr(v, {i, j}), 4);
        CHECK(got == expected[i][j]);
      }
    }
    // Narrowing a narrowed view composes offsets.
    TensorView w = v.Narrow({1, 1}, {1, 2});
    CHECK(w.data == p + 2 * 5 + 3);
    CHECK(w.shape == Shape{1, 2});
  }
  SECTION("full rows stay contiguous") {
    TensorView v = t.Narrow({2, 0}, {2, 5});
    CHECK(v.data == p + 10);
    CHECK(v.is_contiguous());
  }
  SECTION("empty boxes at the edge are allowed") {
    CHECK(t.Narrow({4, 0}, {0, 5}).numel() == 0);
    CHECK(t.Narrow({0, 5}, {4, 0}).numel() == 0);
  }
  SECTION("out of range") {
    CHECK_THROWS_AS(t.Narrow({3, 0}, {2, 5}), InvalidArgumentError);
    CHECK_THROWS_AS(t.Narrow({0, 1}, {4, 5}), InvalidArgumentError);
    CHECK_THROWS_AS(t.Narrow({-1, 0}, {1, 1}), InvalidArgumentError);
    CHECK_THROWS_AS(t.Narrow({0, 0}, {-1, 1}), InvalidArgumentError);
    CHECK_THROWS_AS(t.Narrow({5, 0}, {0, 1}), InvalidArgumentError);
    CHECK_THROWS_WITH(t.Narrow({3, 0}, {2, 5}), Contains("out of range"));
    CHECK_THROWS_AS(t.Narrow({0}, {1}), InvalidArgumentError);  // rank mismatch
  }
}

TEST_CASE("tensor: is_contiguous", "[tensor][view]") {
  TensorView t = TensorView::Allocate(DType::kFloat32, {5, 4});
  CHECK(t.is_contiguous());
  CHECK(Strided(t, {5, 4}, {4, 1}).is_contiguous());
  CHECK_FALSE(Strided(t, {4, 5}, {1, 4}).is_contiguous());  // transposed
  CHECK_FALSE(Strided(t, {5, 2}, {4, 2}).is_contiguous());  // every other column
  CHECK(Strided(t, {1, 4}, {99, 1}).is_contiguous());       // size-1 dims: any stride
  CHECK(Strided(t, {4, 1}, {1, 7}).is_contiguous());
  CHECK(t.effective_strides() == Shape{4, 1});
  CHECK_THROWS_AS(Strided(t, {5, 4}, {1}).effective_strides(), InvalidArgumentError);
}

TEST_CASE("tensor: CopyTensor from strided views matches a hand-computed reference",
          "[tensor][copy]") {
  // One dtype per element size: 1, 2, 4, 8, 16 bytes.
  const DType dtype =
      GENERATE(DType::kUInt8, DType::kInt16, DType::kInt32, DType::kInt64, DType::kComplex128);
  const int64_t es = static_cast<int64_t>(ElementSize(dtype));
  INFO("dtype " << DTypeName(dtype));
  TensorView base = RandomTensor(dtype, {6, 4}, 11 + es);
  const char* b = static_cast<const char*>(base.data);
  auto base_elem = [&](int64_t r, int64_t c) { return b + (r * 4 + c) * es; };

  SECTION("transposed") {
    TensorView src = Strided(base, {4, 6}, {1, 4});
    TensorView dst = TensorView::Allocate(dtype, {4, 6});
    CopyTensor(dst, src);
    const char* d = static_cast<const char*>(dst.data);
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t j = 0; j < 6; ++j) {
        CHECK(std::memcmp(d + (i * 6 + j) * es, base_elem(j, i), es) == 0);
      }
    }
    // And back: a contiguous source into a transposed destination.
    TensorView back = TensorView::Allocate(dtype, {6, 4});
    CopyTensor(Strided(back, {4, 6}, {1, 4}), dst);
    CHECK(std::memcmp(back.data, base.data, base.nbytes()) == 0);
  }
  SECTION("every other column") {
    TensorView src = Strided(base, {6, 2}, {4, 2}, 1);  // columns 1 and 3
    TensorView dst = TensorView::Allocate(dtype, {6, 2});
    CopyTensor(dst, src);
    const char* d = static_cast<const char*>(dst.data);
    for (int64_t i = 0; i < 6; ++i) {
      CHECK(std::memcmp(d + (i * 2 + 0) * es, base_elem(i, 1), es) == 0);
      CHECK(std::memcmp(d + (i * 2 + 1) * es, base_elem(i, 3), es) == 0);
    }
    // Scatter back into a zeroed strided destination: only the strided slots change.
    TensorView target = TensorView::Allocate(dtype, {6, 4});
    CopyTensor(Strided(target, {6, 2}, {4, 2}, 1), dst);
    const char* t = static_cast<const char*>(target.data);
    const std::vector<char> zero(es, 0);
    for (int64_t i = 0; i < 6; ++i) {
      for (int64_t j = 0; j < 4; ++j) {
        INFO("element " << i << "," << j);
        if (j == 1 || j == 3) {
          CHECK(std::memcmp(t + (i * 4 + j) * es, base_elem(i, j), es) == 0);
        } else {
          CHECK(std::memcmp(t + (i * 4 + j) * es, zero.data(), es) == 0);
        }
      }
    }
  }
  SECTION("sliced box") {
    TensorView src = base.Narrow({1, 1}, {3, 2});
    TensorView dst = TensorView::Allocate(dtype, {3, 2});
    CopyTensor(dst, src);
    const char* d = static_cast<const char*>(dst.data);
    for (int64_t i = 0; i < 3; ++i) {
      for (int64_t j = 0; j < 2; ++j) {
        CHECK(std::memcmp(d + (i * 2 + j) * es, base_elem(1 + i, 1 + j), es) == 0);
      }
    }
    // Back into a box of a zeroed tensor.
    TensorView target = TensorView::Allocate(dtype, {6, 4});
    CopyTensor(target.Narrow({2, 2}, {3, 2}), dst);
    const char* t = static_cast<const char*>(target.data);
    const std::vector<char> zero(es, 0);
    for (int64_t i = 0; i < 6; ++i) {
      for (int64_t j = 0; j < 4; ++j) {
        const bool inside = i >= 2 && i < 5 && j >= 2;
        const char* want = inside ? base_elem(i - 1, j - 1) : zero.data();
        CHECK(std::memcmp(t + (i * 4 + j) * es, want, es) == 0);
      }
    }
  }
  SECTION("3-d permutation with size-1 dims, strided on both sides") {
    TensorView big = RandomTensor(dtype, {2, 3, 4}, 5 + es);
    // src[i][k][j] = big[j][0 or 1...]: permute (2,3,4) -> (4,1,2,3) with a size-1 dim.
    TensorView src = Strided(big, {4, 1, 2, 3}, {1, 1000, 12, 4});
    TensorView dst_mem = TensorView::Allocate(dtype, {3, 4, 2});  // dst is itself transposed
    TensorView dst = Strided(dst_mem, {4, 1, 2, 3}, {2, 5, 1, 8});
    CopyTensor(dst, src);
    CHECK(CountMismatches(dst, src) == 0);
    const char* d = static_cast<const char*>(dst_mem.data);
    const char* s = static_cast<const char*>(big.data);
    for (int64_t i = 0; i < 4; ++i) {
      for (int64_t a = 0; a < 2; ++a) {
        for (int64_t c = 0; c < 3; ++c) {
          // dst_mem[c][i][a] == big[a][c][i]
          CHECK(std::memcmp(d + (c * 8 + i * 2 + a) * es, s + (a * 12 + c * 4 + i) * es, es) == 0);
        }
      }
    }
  }
}

TEST_CASE("tensor: CopyTensor of literal values through a transpose", "[tensor][copy]") {
  int16_t src_mem[2][3] = {{1, 2, 3}, {4, 5, 6}};
  TensorView src = TensorView::FromContiguous(src_mem, DType::kInt16, {2, 3});
  int16_t dst_mem[6] = {};
  // dst has shape [2, 3] and strides [1, 2]: dst[i][j] lands at dst_mem[i + 2 * j].
  TensorView dst = TensorView::FromContiguous(dst_mem, DType::kInt16, {2, 3});
  dst.strides = {1, 2};
  CopyTensor(dst, src);
  const int16_t expected[6] = {1, 4, 2, 5, 3, 6};
  for (int i = 0; i < 6; ++i) CHECK(dst_mem[i] == expected[i]);
}

TEST_CASE("tensor: CopyTensor edge cases", "[tensor][copy]") {
  SECTION("0-d tensors copy their single element") {
    double a = 3.25, b = 0;
    CopyTensor(TensorView::FromContiguous(&b, DType::kFloat64, {}),
               TensorView::FromContiguous(&a, DType::kFloat64, {}));
    CHECK(b == 3.25);
  }
  SECTION("zero elements is a no-op") {
    TensorView a = TensorView::Allocate(DType::kInt32, {0, 3});
    TensorView b = TensorView::Allocate(DType::kInt32, {0, 3});
    CHECK_NOTHROW(CopyTensor(b, a));
  }
  SECTION("broadcast source (zero stride)") {
    int32_t one[3] = {7, 8, 9};
    TensorView src = TensorView::FromContiguous(one, DType::kInt32, {4, 3});
    src.strides = {0, 1};
    TensorView dst = TensorView::Allocate(DType::kInt32, {4, 3});
    CopyTensor(dst, src);
    const auto* d = static_cast<const int32_t*>(dst.data);
    for (int i = 0; i < 4; ++i) {
      CHECK(d[i * 3 + 0] == 7);
      CHECK(d[i * 3 + 1] == 8);
      CHECK(d[i * 3 + 2] == 9);
    }
  }
  SECTION("large contiguous copy of every dtype") {
    for (DType dt : AllDTypes()) {
      TensorView a = RandomTensor(dt, {3, 17, 5}, 99);
      TensorView b = TensorView::Allocate(dt, {3, 17, 5});
      CopyTensor(b, a);
      CHECK(std::memcmp(a.data, b.data, a.nbytes()) == 0);
    }
  }
  SECTION("mismatches are rejected") {
    TensorView a = TensorView::Allocate(DType::kInt32, {2, 3});
    TensorView b = TensorView::Allocate(DType::kInt32, {3, 2});
    TensorView c = TensorView::Allocate(DType::kFloat32, {2, 3});
    CHECK_THROWS_AS(CopyTensor(b, a), InvalidArgumentError);
    CHECK_THROWS_AS(CopyTensor(c, a), InvalidArgumentError);
    // Host memory tagged as a device's: without a usable device the tag is refused
    // (Unsupported); with one, the pointer check finds it is not device memory (Device).
    TensorView gpu = a;
    gpu.device = {Device::Type::kCUDA, 0};
    try {
      CopyTensor(gpu, a);
      FAIL("a host buffer tagged cuda:0 was copied");
    } catch (const Error& e) {
      CHECK((e.code() == ErrorCode::kUnsupported || e.code() == ErrorCode::kDevice));
      CHECK_THAT(e.what(), Contains("cuda:0"));
    }
  }
}

TEST_CASE("tensor: IsDense", "[tensor][view]") {
  TensorView t = TensorView::Allocate(DType::kFloat32, {6, 4});
  CHECK(IsDense(t));
  CHECK(IsDense(t.Narrow({1, 0}, {3, 4})));           // whole rows
  CHECK(IsDense(t.Narrow({2, 1}, {1, 3})));           // part of one row
  CHECK_FALSE(IsDense(t.Narrow({0, 0}, {3, 2})));     // gaps between rows
  CHECK_FALSE(IsDense(Strided(t, {6, 2}, {4, 2})));   // every other column
  CHECK_FALSE(IsDense(Strided(t, {3, 4}, {8, 1})));   // every other row
  CHECK(IsDense(Strided(t, {1, 4, 1}, {77, 1, 5})));  // size-1 dims do not matter
  CHECK(IsDense(t.Narrow({3, 2}, {1, 1})));           // one element
  CHECK(IsDense(Strided(t, {0, 4}, {100, 3})));       // no elements
  CHECK(IsDense(TensorView::Allocate(DType::kInt8, {})));
}

TEST_CASE("tensor: Intersect", "[tensor][chunk]") {
  auto box = [](Shape o, Shape s) { return ChunkMeta{std::move(o), std::move(s)}; };
  SECTION("overlap") {
    const ChunkMeta a = box({0, 0}, {4, 4}), b = box({2, 1}, {4, 4});
    auto r = Intersect(a, b);
    REQUIRE(r.has_value());
    CHECK(*r == box({2, 1}, {2, 3}));
    CHECK(Intersect(b, a) == r);
    CHECK(r->numel() == 6);
  }
  SECTION("containment") {
    auto r = Intersect(box({0, 0, 0}, {8, 8, 8}), box({1, 2, 3}, {1, 2, 3}));
    REQUIRE(r.has_value());
    CHECK(*r == box({1, 2, 3}, {1, 2, 3}));
  }
  SECTION("touching boxes are disjoint") {
    CHECK_FALSE(Intersect(box({0, 0}, {2, 4}), box({2, 0}, {2, 4})).has_value());
    CHECK_FALSE(Intersect(box({0, 0}, {4, 2}), box({0, 2}, {4, 2})).has_value());
    CHECK_FALSE(Intersect(box({0, 0}, {2, 2}), box({2, 2}, {2, 2})).has_value());  // corner
  }
  SECTION("overlap in one dim only") {
    CHECK_FALSE(Intersect(box({0, 0}, {4, 2}), box({1, 5}, {2, 2})).has_value());
  }
  SECTION("zero-size boxes never overlap") {
    CHECK_FALSE(Intersect(box({1}, {0}), box({0}, {4})).has_value());
    CHECK_FALSE(Intersect(box({0, 2}, {4, 0}), box({0, 0}, {4, 4})).has_value());
    CHECK_FALSE(Intersect(box({0, 0}, {0, 0}), box({0, 0}, {0, 0})).has_value());
  }
  SECTION("0-d boxes overlap in their single element") {
    auto r = Intersect(box({}, {}), box({}, {}));
    REQUIRE(r.has_value());
    CHECK(r->offsets.empty());
    CHECK(r->sizes.empty());
    CHECK(r->numel() == 1);
  }
  SECTION("rank mismatch") {
    CHECK_FALSE(Intersect(box({0}, {4}), box({0, 0}, {4, 4})).has_value());
  }
}

TEST_CASE("tensor: a zero dimension makes an empty tensor whatever the others", "[tensor]") {
  CHECK(NumElements({int64_t{1} << 40, int64_t{1} << 40, 0}) == 0);
  CHECK_THROWS_AS(NumElements({int64_t{1} << 40, int64_t{1} << 40}), InvalidArgumentError);
  CHECK_THROWS_AS(NumElements({0, -1}), InvalidArgumentError);
}

TEST_CASE("tensor: a large allocation costs memory only where it is written", "[tensor]") {
  // A load allocates what the metadata declares before reading (issue 44: a damaged zstd item
  // claiming 32,768x its stored size made a load zero-fill 4 GiB); the pages must stay untouched
  // until data lands in them.
  auto resident_mib = [] {
    std::ifstream statm("/proc/self/statm");
    uint64_t size = 0, resident = 0;
    statm >> size >> resident;
    return resident * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE)) >> 20;
  };
  const uint64_t before = resident_mib();
  TensorView t = TensorView::Allocate(DType::kFloat32, {int64_t{1} << 28});  // 1 GiB
  CHECK(resident_mib() < before + 64);
  auto* f = static_cast<float*>(t.data);
  CHECK(f[0] == 0.0f);
  CHECK(f[(int64_t{1} << 28) - 1] == 0.0f);
  CHECK(reinterpret_cast<uintptr_t>(t.data) % 64 == 0);
  f[12345] = 1.5f;
  CHECK(f[12345] == 1.5f);
  CHECK(resident_mib() < before + 64);
}
