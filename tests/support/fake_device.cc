#include "support/fake_device.h"

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <thread>

#include "dcp/proto/error.h"

namespace dcp::testing {

namespace {

// Added to host addresses to make device addresses: the sum is not a canonical x86-64/arm64
// user address, so any host load or store through it faults at once.
constexpr uintptr_t kPoison = uintptr_t{1} << 62;

bool IsPoisoned(const void* p) { return reinterpret_cast<uintptr_t>(p) & kPoison; }

}  // namespace

class FakeStream : public DeviceStream {
 public:
  FakeStream(FakeDevice& dev, int device) : dev_(dev), device_(device) {
    worker_ = std::thread([this] { Run(); });
  }
  ~FakeStream() override {
    {
      std::unique_lock<std::mutex> lock(mu_);
      idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
      stop_ = true;
    }
    work_.notify_all();
    worker_.join();
  }

  void CopyAsync(const Copy2D& c, CopyKind kind) override {
    if (c.width == 0 || c.height == 0) return;
    const bool src_dev = kind != CopyKind::kHostToDevice;
    const bool dst_dev = kind != CopyKind::kDeviceToHost;
    if (c.height > 1 && (c.src_pitch < c.width || c.dst_pitch < c.width)) {
      throw InternalError("fake device: 2-D copy with a pitch below its width");
    }
    const size_t src_extent = (c.height - 1) * c.src_pitch + c.width;
    const size_t dst_extent = (c.height - 1) * c.dst_pitch + c.width;
    if (src_dev != IsPoisoned(c.src) || dst_dev != IsPoisoned(c.dst)) {
      throw InternalError("fake device: copy kind does not match the addresses' memory");
    }
    const char* src = src_dev ? dev_.Resolve(c.src, src_extent) : static_cast<const char*>(c.src);
    char* dst = dst_dev ? dev_.Resolve(c.dst, dst_extent) : static_cast<char*>(c.dst);
    const Copy2D plain{dst, c.dst_pitch, src, c.src_pitch, c.width, c.height};
    std::lock_guard<std::mutex> lock(mu_);
    const uint64_t in_flight = ++dev_.copies_in_flight_;
    for (uint64_t m = dev_.max_copies_in_flight_;
         in_flight > m && !dev_.max_copies_in_flight_.compare_exchange_weak(m, in_flight);) {
    }
    queue_.push_back([this, plain, kind] {
      struct Landed {  // however the copy ends, it is no longer in flight
        FakeDevice& dev;
        ~Landed() { --dev.copies_in_flight_; }
      } landed{dev_};
      if (const int ms = dev_.copy_delay_ms_.load(); ms > 0) {
        std::this_thread::sleep_for(std::chrono::milliseconds(ms));
      }
      const uint64_t n = ++dev_.copies_;
      if (n == dev_.fail_at_.load()) {
        throw DeviceError("fake device: injected failure of copy " + std::to_string(n) +
                          " on cuda:" + std::to_string(device_));
      }
      for (size_t i = 0; i < plain.height; ++i) {
        std::memcpy(static_cast<char*>(plain.dst) + i * plain.dst_pitch,
                    static_cast<const char*>(plain.src) + i * plain.src_pitch, plain.width);
      }
      const uint64_t bytes = plain.width * plain.height;
      if (kind == CopyKind::kDeviceToHost) dev_.d2h_bytes_ += bytes;
      if (kind == CopyKind::kHostToDevice) dev_.h2d_bytes_ += bytes;
    });
    work_.notify_one();
  }

  void Synchronize() override {
    std::unique_lock<std::mutex> lock(mu_);
    idle_.wait(lock, [this] { return queue_.empty() && !busy_; });
    if (error_) {
      auto e = error_;
      error_ = nullptr;
      std::rethrow_exception(e);
    }
  }

 private:
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      work_.wait(lock, [this] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_
      auto task = std::move(queue_.front());
      queue_.pop_front();
      busy_ = true;
      lock.unlock();
      // Like CUDA, a failed copy poisons the stream: later copies still "run", but the
      // first error is what Synchronize reports.
      std::exception_ptr err;
      try {
        task();
      } catch (...) {
        err = std::current_exception();
      }
      lock.lock();
      if (err && !error_) error_ = err;
      busy_ = false;
      if (queue_.empty()) idle_.notify_all();
    }
  }

  FakeDevice& dev_;
  int device_;
  std::mutex mu_;
  std::condition_variable work_, idle_;
  std::deque<std::function<void()>> queue_;
  bool busy_ = false, stop_ = false;
  std::exception_ptr error_;
  std::thread worker_;
};

FakeDevice::~FakeDevice() {
  for (auto& [addr, size] : allocations_) std::free(reinterpret_cast<void*>(addr));
  for (void* p : pinned_) std::free(p);
}

std::unique_ptr<DeviceStream> FakeDevice::NewStream(int device) {
  if (device < 0 || device >= devices_)
    throw DeviceError("fake device: no device " + std::to_string(device));
  ++streams_;
  return std::make_unique<FakeStream>(*this, device);
}

void* FakeDevice::AllocPinned(size_t bytes) {
  void* p = std::aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
  if (p == nullptr) throw DeviceError("fake device: out of pinned memory");
  std::lock_guard<std::mutex> lock(mu_);
  pinned_.insert(p);
  ++pinned_allocs_;
  return p;
}

void FakeDevice::FreePinned(void* p) noexcept {
  std::lock_guard<std::mutex> lock(mu_);
  if (pinned_.erase(p)) std::free(p);
}

bool FakeDevice::RegisterHost(void*, size_t) {
  ++registered_;
  return true;
}

void FakeDevice::UnregisterHost(void*) noexcept {}

void* FakeDevice::AllocDevice(int device, size_t bytes) {
  if (device < 0 || device >= devices_)
    throw DeviceError("fake device: no device " + std::to_string(device));
  const size_t n = std::max<size_t>(64, (bytes + 63) / 64 * 64);
  void* p = std::aligned_alloc(64, n);
  if (p == nullptr) throw DeviceError("fake device: out of device memory");
  std::memset(p, 0xCD, n);
  std::lock_guard<std::mutex> lock(mu_);
  allocations_[reinterpret_cast<uintptr_t>(p)] = bytes;
  return reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(p) + kPoison);
}

void FakeDevice::FreeDevice(int, void* p) noexcept {
  const uintptr_t host = reinterpret_cast<uintptr_t>(p) - kPoison;
  std::lock_guard<std::mutex> lock(mu_);
  if (allocations_.erase(host)) std::free(reinterpret_cast<void*>(host));
}

char* FakeDevice::Resolve(const void* device_address, size_t bytes) {
  const uintptr_t host = reinterpret_cast<uintptr_t>(device_address) - kPoison;
  std::lock_guard<std::mutex> lock(mu_);
  auto it = allocations_.upper_bound(host);
  if (it == allocations_.begin()) throw InternalError("fake device: not a device address");
  --it;
  if (host + bytes > it->first + it->second) {
    throw InternalError("fake device: access of " + std::to_string(bytes) +
                        " bytes runs past a device allocation");
  }
  return reinterpret_cast<char*>(host);
}

TensorView DeviceEmpty(const std::shared_ptr<DeviceBackend>& backend, DType dtype,
                       const Shape& shape, int device) {
  TensorView v;
  v.dtype = dtype;
  v.shape = shape;
  v.device = Device{Device::Type::kCUDA, device};
  const size_t n = v.nbytes();
  if (n > 0) {
    v.data = backend->AllocDevice(device, n);
    v.owner = std::shared_ptr<void>(v.data,
                                    [backend, device](void* p) { backend->FreeDevice(device, p); });
  }
  return v;
}

TensorView DeviceUpload(const std::shared_ptr<DeviceBackend>& backend, const TensorView& host,
                        int device) {
  TensorView v = DeviceEmpty(backend, host.dtype, host.shape, device);
  CopyTensor(v, host);
  return v;
}

TensorView DeviceDownload(const TensorView& view) {
  TensorView host = TensorView::Allocate(view.dtype, view.shape);
  CopyTensor(host, view);
  return host;
}

TensorView FakeDevice::Empty(DType dtype, const Shape& shape, int device) {
  return DeviceEmpty(shared_from_this(), dtype, shape, device);
}

TensorView FakeDevice::Upload(const TensorView& host, int device) {
  return DeviceUpload(shared_from_this(), host, device);
}

TensorView FakeDevice::Download(const TensorView& device_view) {
  return DeviceDownload(device_view);
}

ScopedFakeDevice::ScopedFakeDevice(int devices)
    : device_(std::make_shared<FakeDevice>(devices)),
      previous_(SetDeviceBackend(Device::Type::kCUDA, device_)) {}

ScopedFakeDevice::~ScopedFakeDevice() {
  TrimPinnedPool();
  SetDeviceBackend(Device::Type::kCUDA, previous_);
}

}  // namespace dcp::testing
