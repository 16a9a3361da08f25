// Device memory: how dcp moves tensor bytes between host memory and an accelerator.
//
// A TensorView whose `device` is not the CPU holds a device address that host code must never
// dereference. Every byte that crosses between host and device goes through a DeviceBackend,
// registered per Device::Type. A build with DCP_WITH_CUDA has a CUDA backend (CUDA runtime only,
// never the driver library); a build without it has none, and a device tensor is refused with
// UnsupportedError naming it. Tests install a fake backend (SetDeviceBackend) that plays a
// device in host memory, so the pipelines below are exercised on machines without a GPU.
//
// Save and load never need a whole host copy of a device tensor: StreamToHost and
// StreamFromHost move it through a pair of page-locked buffers from a process-wide pool,
// copying piece i+1 on a dedicated stream while the caller consumes (writes) piece i.
//
// Ordering with the application's own device work: dcp's streams are created as blocking
// streams, so they wait for work on the device's legacy default stream. Work queued on other
// streams must be complete before a save reads a tensor (the LibTorch adapter synchronises the
// device for CUDA tensors). Every copy dcp issues is complete when the call that issued it
// returns (Save, Load, AsyncCheckpointer::Save's snapshot).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>

#include "dcp/proto/tensor.h"

namespace dcp {

/// The direction of a copy.
enum class CopyKind { kDeviceToHost, kHostToDevice, kDeviceToDevice };

/// A 2-D copy: `height` rows of `width` bytes; row i is read at src + i * src_pitch and written
/// at dst + i * dst_pitch. A plain copy has height 1. Pitches are at least `width`.
struct Copy2D {
  void* dst = nullptr;
  size_t dst_pitch = 0;
  const void* src = nullptr;
  size_t src_pitch = 0;
  size_t width = 0;
  size_t height = 1;
};

/// An ordered queue of copies on one device (a CUDA stream). Copies run in issue order, possibly
/// after CopyAsync returns; the memory involved must stay valid until Synchronize returns.
/// Errors from a queued copy surface at the latest at Synchronize, as DeviceError.
/// One thread at a time per stream. Destroying a stream waits for its queued copies.
class DeviceStream {
 public:
  virtual ~DeviceStream() = default;
  virtual void CopyAsync(const Copy2D& copy, CopyKind kind) = 0;
  /// Wait until every queued copy has finished; DeviceError if one failed.
  virtual void Synchronize() = 0;
};

/// One accelerator runtime. Implementations must be thread-safe.
class DeviceBackend {
 public:
  virtual ~DeviceBackend() = default;
  /// "cuda", "fake", ...: used in messages.
  virtual std::string name() const = 0;
  /// Devices visible to this process; 0 (never an exception) when the runtime finds none, e.g.
  /// no driver. unavailable_reason() then says why.
  virtual int device_count() = 0;
  virtual std::string unavailable_reason() = 0;
  /// A new stream on `device`, ordered after the device's legacy default stream.
  virtual std::unique_ptr<DeviceStream> NewStream(int device) = 0;
  /// Page-locked host memory (the source/target of fast asynchronous copies). DeviceError when
  /// it cannot be had. FreePinned accepts only pointers from AllocPinned.
  virtual void* AllocPinned(size_t bytes) = 0;
  virtual void FreePinned(void* p) noexcept = 0;
  /// Page-lock existing host memory in place (e.g. async-save staging). Returns false (no
  /// error) when the runtime refuses; copies then still work, more slowly.
  virtual bool RegisterHost(void* p, size_t bytes) = 0;
  virtual void UnregisterHost(void* p) noexcept = 0;
  /// DeviceError unless `p` is memory of device `device` (a host buffer tagged as device memory,
  /// or memory of another device, would otherwise be copied as if it were). `what` names the
  /// tensor in the message. The default trusts the tag (backends that cannot tell).
  virtual void CheckDevicePointer(const void* /*p*/, int /*device*/, const std::string& /*what*/) {}
  /// Device memory, for tests and benchmarks (the product copies only to/from the caller's).
  virtual void* AllocDevice(int device, size_t bytes) = 0;
  virtual void FreeDevice(int device, void* p) noexcept = 0;
};

/// The backend that serves `type`, or nullptr when this build/process has none (the CPU never
/// has one). The CUDA backend is created on first use in builds with CUDA.
std::shared_ptr<DeviceBackend> FindDeviceBackend(Device::Type type);
/// The backend for `device`, checked: UnsupportedError when none is built in, or when the
/// device index is not present (the message carries the runtime's reason and `what`, e.g. the
/// tensor's name).
std::shared_ptr<DeviceBackend> DeviceBackendFor(const Device& device, const std::string& what);
/// Install `backend` for `type` (nullptr restores the built-in one); returns the previous
/// override. For tests; not to be called while a save or load is running.
std::shared_ptr<DeviceBackend> SetDeviceBackend(Device::Type type,
                                                std::shared_ptr<DeviceBackend> backend);
/// True when this build has the CUDA backend compiled in (it may still find no device).
bool BuiltWithCuda();

/// Queue the element-wise copy src -> dst (same shape and dtype, any strides, at least one side
/// on the stream's device; the host side may be pageable or pinned). Contiguous runs become one
/// 2-D copy each. The memory must stay valid until stream.Synchronize().
void CopyTensorAsync(const TensorView& dst, const TensorView& src, DeviceStream& stream);

/// CopyTensor's path when a side is on a device: CopyTensorAsync on a temporary stream, then
/// Synchronize.
void CopyTensorThroughDevice(const TensorView& dst, const TensorView& src);

/// Size of the pinned pieces StreamToHost/StreamFromHost move at a time (16 MiB).
constexpr size_t kDevicePieceBytes = size_t{16} << 20;

/// Deliver the bytes of `src` (any device, any strides) in row-major order to `consume`, in
/// pieces of at most `piece_bytes` (rounded down to whole elements, at least one). A contiguous
/// host view is delivered in place, in pieces; a strided host view is gathered into a reused
/// buffer; a device view is copied through two pinned buffers, the next piece's copy
/// overlapping `consume` of the current one. `consume` must not keep the pointer.
/// Exceptions from `consume` or the device propagate after queued copies have finished.
void StreamToHost(const TensorView& src, size_t piece_bytes,
                  const std::function<void(const void* data, size_t n)>& consume);

/// The reverse: `produce(buf, n)` must fill buf with the next n bytes of the row-major image of
/// `dst`, which StreamFromHost places into dst (any device, any strides). For a contiguous host
/// dst, `produce` writes straight into the tensor; for a device dst, into pinned buffers whose
/// host-to-device copy overlaps the next `produce`.
void StreamFromHost(const TensorView& dst, size_t piece_bytes,
                    const std::function<void(void* buf, size_t n)>& produce);

/// Split `view` into consecutive boxes whose row-major concatenation is the view's row-major
/// order, each at most `max_bytes` (but at least one element). A contiguous view is split as a
/// flat 1-D range. Exposed for tests.
std::vector<TensorView> SplitRowMajor(const TensorView& view, size_t max_bytes);

/// Process-wide pool of pinned buffers of one backend, reused across saves and loads so a
/// steady-state save allocates no pinned memory. Thread-safe.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  /// A buffer of at least `bytes` from `backend`'s pool (allocating only when the pool has none).
  PinnedBuffer(std::shared_ptr<DeviceBackend> backend, size_t bytes);
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  ~PinnedBuffer();  // returns the buffer to the pool
  void* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  void Release() noexcept;
  std::shared_ptr<DeviceBackend> backend_;
  void* data_ = nullptr;
  size_t size_ = 0;
};

/// Pinned bytes allocated so far by the pool (all backends), for tests and metrics.
uint64_t PinnedBytesAllocated();
/// Free every idle pooled buffer (e.g. before the backend is replaced in a test).
void TrimPinnedPool();

}  // namespace dcp
