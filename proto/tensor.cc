#include "dcp/proto/tensor.h"

#include <sys/mman.h>

#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "dcp/proto/error.h"
#include "dcp/proto/tensor_layout.h"

namespace dcp {

namespace {
struct DTypeInfo {
  DType dtype;
  size_t size;
  std::string_view name;
};
constexpr std::array<DTypeInfo, 21> kDTypes = {{
    {DType::kBool, 1, "bool"},
    {DType::kUInt8, 1, "uint8"},
    {DType::kInt8, 1, "int8"},
    {DType::kInt16, 2, "int16"},
    {DType::kInt32, 4, "int32"},
    {DType::kInt64, 8, "int64"},
    {DType::kFloat16, 2, "float16"},
    {DType::kBFloat16, 2, "bfloat16"},
    {DType::kFloat32, 4, "float32"},
    {DType::kFloat64, 8, "float64"},
    {DType::kComplex32, 4, "complex32"},
    {DType::kComplex64, 8, "complex64"},
    {DType::kComplex128, 16, "complex128"},
    {DType::kFloat8_e4m3fn, 1, "float8_e4m3fn"},
    {DType::kFloat8_e5m2, 1, "float8_e5m2"},
    {DType::kFloat8_e4m3fnuz, 1, "float8_e4m3fnuz"},
    {DType::kFloat8_e5m2fnuz, 1, "float8_e5m2fnuz"},
    {DType::kUInt16, 2, "uint16"},
    {DType::kUInt32, 4, "uint32"},
    {DType::kUInt64, 8, "uint64"},
    {DType::kFloat8_e8m0fnu, 1, "float8_e8m0fnu"},
}};

const DTypeInfo& Info(DType dtype) {
  const int v = static_cast<int>(dtype);
  if (v < 1 || v > static_cast<int>(kDTypes.size())) {
    throw InvalidArgumentError("unknown dtype value " + std::to_string(v));
  }
  return kDTypes[v - 1];
}
}  // namespace

size_t ElementSize(DType dtype) { return Info(dtype).size; }
std::string_view DTypeName(DType dtype) { return Info(dtype).name; }
bool IsValidDType(int value) { return value >= 1 && value <= static_cast<int>(kDTypes.size()); }

std::optional<DType> DTypeFromName(std::string_view name) {
  for (const auto& info : kDTypes) {
    if (info.name == name) return info.dtype;
  }
  return std::nullopt;
}

const std::vector<DType>& AllDTypes() {
  static const std::vector<DType> all = [] {
    std::vector<DType> v;
    for (const auto& info : kDTypes) v.push_back(info.dtype);
    return v;
  }();
  return all;
}

int64_t NumElements(const Shape& shape) {
  for (int64_t d : shape) {
    if (d < 0) throw InvalidArgumentError("negative dimension in shape " + ShapeToString(shape));
  }
  for (int64_t d : shape) {
    if (d == 0) return 0;  // an empty tensor, however large its other dimensions
  }
  int64_t n = 1;
  for (int64_t d : shape) {
    if (d != 0 && n > INT64_MAX / d) {
      throw InvalidArgumentError("element count of shape " + ShapeToString(shape) +
                                 " overflows int64");
    }
    n *= d;
  }
  return n;
}

std::string ShapeToString(const Shape& shape) {
  std::ostringstream os;
  os << '[';
  for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
  os << ']';
  return os.str();
}

Shape ContiguousStrides(const Shape& shape) {
  Shape strides(shape.size());
  int64_t s = 1;
  for (size_t i = shape.size(); i-- > 0;) {
    strides[i] = s;
    s *= std::max<int64_t>(shape[i], 1);
  }
  return strides;
}

std::string Device::ToString() const {
  return type == Type::kCPU ? "cpu" : "cuda:" + std::to_string(index);
}

TensorView TensorView::FromContiguous(void* data, DType dtype, Shape shape, Device device) {
  TensorView v;
  v.data = data;
  v.dtype = dtype;
  v.shape = std::move(shape);
  v.device = device;
  return v;
}

TensorView TensorView::Allocate(DType dtype, Shape shape) {
  TensorView v;
  v.dtype = dtype;
  v.shape = std::move(shape);
  const size_t bytes = v.nbytes();
  // Large tensors come from the kernel's zero pages, which cost memory only as they are
  // written: a load allocates every tensor the metadata declares before reading, and a shape
  // that its stored bytes cannot fill (a damaged zstd frame that claims 32,768x its size) must
  // not cost the memory it claims. mmap's pages are 4 KiB-aligned, more than the 64 promised.
  constexpr size_t kMapped = size_t{1} << 20;
  if (bytes >= kMapped) {
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    v.owner = std::shared_ptr<void>(p, [bytes](void* q) { ::munmap(q, bytes); });
    v.data = p;
    return v;
  }
  // Round up so aligned_alloc's size requirement holds; never allocate 0 bytes.
  const size_t rounded = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, rounded);
  if (p == nullptr) throw std::bad_alloc();
  std::memset(p, 0, rounded);
  v.owner = std::shared_ptr<void>(p, [](void* q) { std::free(q); });
  v.data = p;
  return v;
}

Shape TensorView::effective_strides() const {
  if (strides.empty()) return ContiguousStrides(shape);
  if (strides.size() != shape.size()) {
    throw InvalidArgumentError("tensor view has " + std::to_string(strides.size()) +
                               " strides for shape " + ShapeToString(shape));
  }
  return strides;
}

bool TensorView::is_contiguous() const {
  if (strides.empty()) return true;
  const Shape expected = ContiguousStrides(shape);
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] != 1 && strides[i] != expected[i]) return false;
  }
  return true;
}

TensorView TensorView::Narrow(const Shape& offsets, const Shape& sizes) const {
  if (offsets.size() != shape.size() || sizes.size() != shape.size()) {
    throw InvalidArgumentError("narrow of " + ShapeToString(shape) + " with offsets " +
                               ShapeToString(offsets) + " sizes " + ShapeToString(sizes) +
                               ": rank mismatch");
  }
  const Shape st = effective_strides();
  int64_t elem_offset = 0;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (offsets[i] < 0 || sizes[i] < 0 || offsets[i] > shape[i] - sizes[i]) {
      throw InvalidArgumentError("narrow of " + ShapeToString(shape) + " with offsets " +
                                 ShapeToString(offsets) + " sizes " + ShapeToString(sizes) +
                                 ": out of range");
    }
    elem_offset += offsets[i] * st[i];
  }
  TensorView v = *this;
  v.shape = sizes;
  v.strides = st;
  if (NumElements(sizes) > 0) {
    v.data = static_cast<char*>(data) + elem_offset * static_cast<int64_t>(ElementSize(dtype));
  }
  return v;
}

std::string TensorView::ToString() const {
  return std::string(DTypeName(dtype)) + ShapeToString(shape) + "@" + device.ToString();
}

std::string ChunkMeta::ToString() const {
  return "{offsets " + ShapeToString(offsets) + ", sizes " + ShapeToString(sizes) + "}";
}

std::optional<ChunkMeta> Intersect(const ChunkMeta& a, const ChunkMeta& b) {
  if (a.offsets.size() != b.offsets.size()) return std::nullopt;
  ChunkMeta r;
  r.offsets.resize(a.offsets.size());
  r.sizes.resize(a.offsets.size());
  for (size_t i = 0; i < a.offsets.size(); ++i) {
    const int64_t lo = std::max(a.offsets[i], b.offsets[i]);
    const int64_t hi = std::min(a.offsets[i] + a.sizes[i], b.offsets[i] + b.sizes[i]);
    if (hi <= lo) return std::nullopt;
    r.offsets[i] = lo;
    r.sizes[i] = hi - lo;
  }
  // Two 0-d tensors (scalars) always overlap in their single element.
  return r;
}

namespace internal {

Layout Coalesce(const Shape& shape, const Shape& dst, const Shape& src) {
  Layout l;
  for (size_t i = 0; i < shape.size(); ++i) {
    if (shape[i] == 1) continue;  // size-1 dims contribute nothing
    if (!l.sizes.empty() && l.dst_strides.back() == dst[i] * shape[i] &&
        l.src_strides.back() == src[i] * shape[i]) {
      l.sizes.back() *= shape[i];
      l.dst_strides.back() = dst[i];
      l.src_strides.back() = src[i];
      continue;
    }
    l.sizes.push_back(shape[i]);
    l.dst_strides.push_back(dst[i]);
    l.src_strides.push_back(src[i]);
  }
  return l;
}

}  // namespace internal

using internal::Coalesce;
using internal::Layout;

namespace {

template <size_t N>
void CopyElements(char* d, const char* s, int64_t n, int64_t dstep, int64_t sstep) {
  for (int64_t i = 0; i < n; ++i) std::memcpy(d + i * dstep, s + i * sstep, N);
}

}  // namespace

namespace internal {

void CopyHostTensor(const TensorView& dst, const TensorView& src) {
  const int64_t es = static_cast<int64_t>(ElementSize(src.dtype));
  Layout l = Coalesce(src.shape, dst.effective_strides(), src.effective_strides());
  if (l.sizes.empty()) {  // a single element
    std::memcpy(dst.data, src.data, es);
    return;
  }
  const size_t nd = l.sizes.size();
  const int64_t inner = l.sizes.back();
  const bool inner_contig = l.dst_strides.back() == 1 && l.src_strides.back() == 1;
  std::vector<int64_t> idx(nd, 0);
  char* dbase = static_cast<char*>(dst.data);
  const char* sbase = static_cast<const char*>(src.data);
  while (true) {
    int64_t doff = 0, soff = 0;
    for (size_t i = 0; i + 1 < nd; ++i) {
      doff += idx[i] * l.dst_strides[i];
      soff += idx[i] * l.src_strides[i];
    }
    char* d = dbase + doff * es;
    const char* s = sbase + soff * es;
    if (inner_contig) {
      std::memcpy(d, s, static_cast<size_t>(inner * es));
    } else {
      const int64_t ds = l.dst_strides.back() * es, ss = l.src_strides.back() * es;
      switch (es) {
        case 1:
          CopyElements<1>(d, s, inner, ds, ss);
          break;
        case 2:
          CopyElements<2>(d, s, inner, ds, ss);
          break;
        case 4:
          CopyElements<4>(d, s, inner, ds, ss);
          break;
        case 8:
          CopyElements<8>(d, s, inner, ds, ss);
          break;
        default:
          CopyElements<16>(d, s, inner, ds, ss);
          break;
      }
    }
    // Advance the outer index (odometer over all but the innermost dim).
    size_t k = nd - 1;
    while (k > 0) {
      --k;
      if (++idx[k] < l.sizes[k]) break;
      idx[k] = 0;
      if (k == 0) return;
    }
    if (nd == 1) return;
  }
}

}  // namespace internal

bool IsDense(const TensorView& view) {
  if (view.numel() <= 1) return true;
  const Shape st = view.effective_strides();
  Layout l = Coalesce(view.shape, st, st);
  return l.sizes.size() <= 1 && (l.sizes.empty() || l.dst_strides[0] == 1);
}

void ViewBinding::Loaded(const TensorView&) const {}

}  // namespace dcp
