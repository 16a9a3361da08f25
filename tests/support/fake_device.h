// A fake accelerator for tests on machines without a GPU.
//
// FakeDevice plays Device::Type::kCUDA in host memory, so the device paths of dcp (pinned
// pipelines, device-to-host snapshots, device destinations on load) run in CI. It is strict
// where a real GPU would be: device addresses are poisoned (a host dereference of one faults),
// copies run asynchronously on a worker thread per stream (consuming a buffer before
// Synchronize is a data race that TSan and the checks see), every device address must lie in
// a live allocation, and a copy can be made to fail. Install with ScopedFakeDevice.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <set>

#include "dcp/proto/device/device.h"

namespace dcp::testing {

class FakeDevice : public DeviceBackend, public std::enable_shared_from_this<FakeDevice> {
 public:
  explicit FakeDevice(int devices = 2) : devices_(devices) {}
  ~FakeDevice() override;

  std::string name() const override { return "fake"; }
  int device_count() override { return devices_; }
  std::string unavailable_reason() override { return "the fake device has no devices"; }
  std::unique_ptr<DeviceStream> NewStream(int device) override;
  void* AllocPinned(size_t bytes) override;
  void FreePinned(void* p) noexcept override;
  bool RegisterHost(void* p, size_t bytes) override;
  void UnregisterHost(void* p) noexcept override;
  void* AllocDevice(int device, size_t bytes) override;
  void FreeDevice(int device, void* p) noexcept override;

  /// A device tensor on `device` holding a copy of the host view `host`, owning its memory.
  TensorView Upload(const TensorView& host, int device = 0);
  /// A zero-filled (0xCD-filled, like fresh device memory) device tensor.
  TensorView Empty(DType dtype, const Shape& shape, int device = 0);
  /// A contiguous host copy of a device view.
  TensorView Download(const TensorView& device_view);

  /// The copy with this 1-based number (counting from now) fails with DeviceError.
  void FailCopy(uint64_t nth) { fail_at_ = copies_.load() + nth; }

  std::atomic<uint64_t> copies_{0}, d2h_bytes_{0}, h2d_bytes_{0}, registered_{0};
  std::atomic<uint64_t> pinned_allocs_{0}, streams_{0};
  /// Copies queued on any stream and not yet finished, and the most there ever were at once.
  std::atomic<uint64_t> copies_in_flight_{0}, max_copies_in_flight_{0};
  /// Every copy takes at least this long (a slow link), so overlap can be observed.
  std::atomic<int> copy_delay_ms_{0};

  /// Translate a device address to the host memory behind it; throws InternalError when it is
  /// not inside a live device allocation of `bytes` bytes.
  char* Resolve(const void* device_address, size_t bytes);

 private:
  int devices_;
  std::atomic<uint64_t> fail_at_{0};
  std::mutex mu_;
  std::map<uintptr_t, size_t> allocations_;  // host address -> size
  std::set<void*> pinned_;
  friend class FakeStream;
};

/// Device tensors through any backend (the fake one or real CUDA), owning their memory (the
/// owner keeps the backend alive).
TensorView DeviceEmpty(const std::shared_ptr<DeviceBackend>& backend, DType dtype,
                       const Shape& shape, int device = 0);
TensorView DeviceUpload(const std::shared_ptr<DeviceBackend>& backend, const TensorView& host,
                        int device = 0);
/// A contiguous host copy of a device (or host) view.
TensorView DeviceDownload(const TensorView& view);

/// Installs a FakeDevice as the kCUDA backend for the scope; restores the previous backend and
/// frees pooled pinned buffers on exit.
class ScopedFakeDevice {
 public:
  explicit ScopedFakeDevice(int devices = 2);
  ~ScopedFakeDevice();
  FakeDevice& operator*() { return *device_; }
  FakeDevice* operator->() { return device_.get(); }
  std::shared_ptr<FakeDevice> get() { return device_; }

 private:
  std::shared_ptr<FakeDevice> device_;
  std::shared_ptr<DeviceBackend> previous_;
};

}  // namespace dcp::testing
