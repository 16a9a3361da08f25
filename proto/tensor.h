// Tensor vocabulary shared by every layer: dtypes, shapes, devices, non-owning tensor views,
// chunks (boxes inside a global shape), and strided copies between views.
//
// Nothing here depends on LibTorch; the adapter in dcp/torch_adapter.h maps torch::Tensor to a
// TensorView without copying.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace dcp {

/// Every LibTorch dtype a checkpoint can hold (quantized types excepted). Values are stable:
/// they match the enum in proto/schema/dcp.proto.
enum class DType : uint8_t {
  kBool = 1,
  kUInt8 = 2,
  kInt8 = 3,
  kInt16 = 4,
  kInt32 = 5,
  kInt64 = 6,
  kFloat16 = 7,
  kBFloat16 = 8,
  kFloat32 = 9,
  kFloat64 = 10,
  kComplex32 = 11,
  kComplex64 = 12,
  kComplex128 = 13,
  kFloat8_e4m3fn = 14,
  kFloat8_e5m2 = 15,
  kFloat8_e4m3fnuz = 16,
  kFloat8_e5m2fnuz = 17,
  kUInt16 = 18,
  kUInt32 = 19,
  kUInt64 = 20,
  kFloat8_e8m0fnu = 21,
};

/// Size of one element in bytes.
size_t ElementSize(DType dtype);
/// Stable lowercase name ("float32", "bfloat16", "float8_e4m3fn", ...).
std::string_view DTypeName(DType dtype);
/// Inverse of DTypeName; nullopt for unknown names.
std::optional<DType> DTypeFromName(std::string_view name);
/// True for values that name a DType (used to validate untrusted input).
bool IsValidDType(int value);
/// All dtypes, in enum order.
const std::vector<DType>& AllDTypes();

using Shape = std::vector<int64_t>;

/// Number of elements of `shape` (1 for a 0-d shape). Throws InvalidArgumentError on a negative
/// dimension or when the count overflows int64.
int64_t NumElements(const Shape& shape);
/// "[2, 3]" style rendering for error messages.
std::string ShapeToString(const Shape& shape);
/// Row-major (C-contiguous) strides, in elements.
Shape ContiguousStrides(const Shape& shape);

struct Device {
  enum class Type : uint8_t { kCPU = 0, kCUDA = 1 };
  Type type = Type::kCPU;
  int index = 0;
  bool is_cpu() const { return type == Type::kCPU; }
  bool operator==(const Device&) const = default;
  std::string ToString() const;
};

struct TensorView;

/// Late binding of a view to memory that may move or be replaced between checkpoints (a
/// LibTorch parameter after module->to() or torch::load, an optimizer's step counter). Save,
/// Load and AsyncCheckpointer::Save call Resolve() at their start, so a state dict built once
/// always saves and loads the current memory; after a load they hand the loaded view to
/// Loaded(). Implementations must be callable from the thread that calls Save/Load.
class ViewBinding {
 public:
  virtual ~ViewBinding() = default;
  /// The view as it is now (memory, dtype and shape may differ from the last call). The result
  /// should own (TensorView::owner) or otherwise pin what it points at until it is destroyed.
  virtual TensorView Resolve() const = 0;
  /// A load wrote `loaded` (a view this binding's Resolve returned): e.g. copy a value back into
  /// the object it came from. The default does nothing (the view was the object's memory).
  virtual void Loaded(const TensorView& loaded) const;
};

/// A non-owning view of tensor memory: data pointer, dtype, shape, strides (in elements) and
/// device. Views may be non-contiguous (transposed, sliced); strides may be zero (broadcast) when
/// the view is only read. `owner`, when set, keeps the memory alive (TensorView::Allocate sets
/// it); otherwise the caller guarantees the memory outlives every use of the view.
/// Copying a view copies the description, never the data.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  Shape shape;
  Shape strides;  // elements; empty means contiguous row-major
  Device device;
  std::shared_ptr<void> owner;
  /// When set, Save and Load use binding->Resolve() instead of this description (see
  /// ViewBinding); the fields above are then what it resolved to when the view was made.
  std::shared_ptr<const ViewBinding> binding;

  /// Wrap contiguous memory.
  static TensorView FromContiguous(void* data, DType dtype, Shape shape, Device device = {});
  /// Allocate zero-initialised, 64-byte aligned host memory that the view owns. From 1 MiB up
  /// the memory is the kernel's zero pages: it costs resident memory only where it is written.
  /// std::bad_alloc when the memory cannot be had.
  static TensorView Allocate(DType dtype, Shape shape);

  int64_t numel() const { return NumElements(shape); }
  size_t nbytes() const { return static_cast<size_t>(numel()) * ElementSize(dtype); }
  int64_t dim() const { return static_cast<int64_t>(shape.size()); }
  /// Strides with the empty (contiguous) case made explicit.
  Shape effective_strides() const;
  bool is_contiguous() const;
  /// A view of the box [offsets, offsets + sizes); throws InvalidArgumentError when out of range.
  TensorView Narrow(const Shape& offsets, const Shape& sizes) const;
  std::string ToString() const;
};

/// A box inside a tensor's global shape. Also used for a local shard's placement.
struct ChunkMeta {
  Shape offsets;
  Shape sizes;
  bool operator==(const ChunkMeta&) const = default;
  int64_t numel() const { return NumElements(sizes); }
  std::string ToString() const;
};

/// Intersection of two boxes of the same rank; nullopt when they do not overlap. Empty boxes
/// (a zero size) never overlap anything.
std::optional<ChunkMeta> Intersect(const ChunkMeta& a, const ChunkMeta& b);

/// Copy every element of `src` into `dst`. Both must have the same shape and dtype; they may
/// have arbitrary strides but must not overlap. Host to host, runs of contiguous elements are
/// copied with memcpy. When either side is on a device, the copy goes through that device's
/// backend (proto/device/device.h) and is complete on return; UnsupportedError when there is none.
void CopyTensor(const TensorView& dst, const TensorView& src);

/// True when the elements of `view`, visited in row-major order, occupy one gap-free ascending
/// byte range; such a view can be read or written as a single span. (A transposed view is dense
/// in memory but not in that order, so it is not.)
bool IsDense(const TensorView& view);

}  // namespace dcp
