// The CUDA backend of proto/device/device.h, on the CUDA runtime API only.
//
// Why the runtime and never the driver library: libcuda.so.1 ships with the driver, so a binary
// linked against it does not even start on a machine without a GPU (CI). The runtime loads the
// driver lazily and reports its absence as an error code (cudaErrorInsufficientDriver or
// cudaErrorNoDevice), which device_count() turns into 0 devices and a reason.
//
// Every call that needs a current device sets it for the duration of the call and restores the
// caller's (cuda::DeviceScope), so dcp never changes which device the training thread's own
// CUDA calls go to.
#include <mutex>
#include <string>

#include "dcp/proto/device/cuda_util.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"

namespace dcp {

namespace cuda {

std::string Describe(cudaError_t e) {
  return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e);
}

void Check(cudaError_t e, const char* call, int device) {
  if (e == cudaSuccess) return;
  (void)cudaGetLastError();  // clear the sticky per-thread error of non-fatal failures
  throw DeviceError(std::string("CUDA ") + call + " on cuda:" + std::to_string(device) +
                    " failed: " + Describe(e));
}

DeviceScope::DeviceScope(int device) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  if (previous_ != device) Check(cudaSetDevice(device), "cudaSetDevice", device);
}

DeviceScope::DeviceScope(int device, std::nothrow_t) {
  if (cudaGetDevice(&previous_) != cudaSuccess) previous_ = -1;
  if (previous_ != device && cudaSetDevice(device) != cudaSuccess) (void)cudaGetLastError();
}

DeviceScope::~DeviceScope() {
  int now = -1;
  if (previous_ >= 0 && cudaGetDevice(&now) == cudaSuccess && now != previous_) {
    (void)cudaSetDevice(previous_);
  }
}

}  // namespace cuda

namespace {

using cuda::Check;
using cuda::Describe;
using cuda::DeviceScope;

class CudaStream : public DeviceStream {
 public:
  explicit CudaStream(int device) : device_(device) {
    DeviceScope scope(device_);
    // cudaStreamDefault (blocking): ordered after work on the legacy default stream, where
    // LibTorch and most applications queue their kernels unless told otherwise.
    Check(cudaStreamCreateWithFlags(&stream_, cudaStreamDefault), "cudaStreamCreate", device_);
  }
  ~CudaStream() override {
    DeviceScope scope(device_, std::nothrow);
    (void)cudaStreamSynchronize(stream_);
    (void)cudaStreamDestroy(stream_);
  }

  void CopyAsync(const Copy2D& c, CopyKind) override {
    // cudaMemcpyDefault lets unified addressing pick the direction, which also covers a host
    // side that is pageable (the runtime stages it) or pinned (true DMA).
    DeviceScope scope(device_);
    if (c.height == 1) {
      Check(cudaMemcpyAsync(c.dst, c.src, c.width, cudaMemcpyDefault, stream_), "cudaMemcpyAsync",
            device_);
    } else {
      Check(cudaMemcpy2DAsync(c.dst, c.dst_pitch, c.src, c.src_pitch, c.width, c.height,
                              cudaMemcpyDefault, stream_),
            "cudaMemcpy2DAsync", device_);
    }
  }

  void Synchronize() override {
    DeviceScope scope(device_);
    Check(cudaStreamSynchronize(stream_), "cudaStreamSynchronize", device_);
  }

 private:
  int device_;
  cudaStream_t stream_ = nullptr;
};

class CudaBackend : public DeviceBackend {
 public:
  std::string name() const override { return "cuda"; }

  int device_count() override {
    std::call_once(probe_, [this] {
      int n = 0;
      const cudaError_t e = cudaGetDeviceCount(&n);
      if (e != cudaSuccess) {
        (void)cudaGetLastError();
        count_ = 0;
        reason_ = "no usable CUDA device (" + Describe(e) + ")";
      } else {
        count_ = n;
        if (n == 0) reason_ = "no CUDA device is visible";
      }
    });
    return count_;
  }
  std::string unavailable_reason() override {
    device_count();
    return reason_;
  }

  std::unique_ptr<DeviceStream> NewStream(int device) override {
    return std::make_unique<CudaStream>(device);
  }

  void CheckDevicePointer(const void* p, int device, const std::string& what) override {
    cudaPointerAttributes a{};
    const cudaError_t e = cudaPointerGetAttributes(&a, p);
    const std::string tag = what + " is tagged cuda:" + std::to_string(device);
    if (e != cudaSuccess) {
      (void)cudaGetLastError();
      throw DeviceError(tag + " but CUDA does not know its address (" + Describe(e) + ")");
    }
    if (a.type == cudaMemoryTypeDevice || a.type == cudaMemoryTypeManaged) {
      if (a.device != device) {
        throw DeviceError(tag + " but its memory is on cuda:" + std::to_string(a.device));
      }
      return;
    }
    throw DeviceError(tag + " but its memory is " +
                      (a.type == cudaMemoryTypeHost ? "page-locked host memory"
                                                    : "host memory, not device memory"));
  }

  void* AllocPinned(size_t bytes) override {
    void* p = nullptr;
    Check(cudaHostAlloc(&p, bytes, cudaHostAllocDefault), "cudaHostAlloc (pinned host memory)",
          CurrentDevice());
    return p;
  }
  void FreePinned(void* p) noexcept override { (void)cudaFreeHost(p); }

  bool RegisterHost(void* p, size_t bytes) override {
    if (cudaHostRegister(p, bytes, cudaHostRegisterDefault) == cudaSuccess) return true;
    (void)cudaGetLastError();
    return false;
  }
  void UnregisterHost(void* p) noexcept override { (void)cudaHostUnregister(p); }

  void* AllocDevice(int device, size_t bytes) override {
    DeviceScope scope(device);
    void* p = nullptr;
    Check(cudaMalloc(&p, bytes), "cudaMalloc", device);
    return p;
  }
  void FreeDevice(int device, void* p) noexcept override {
    int previous = -1;
    (void)cudaGetDevice(&previous);
    (void)cudaSetDevice(device);
    (void)cudaFree(p);
    if (previous >= 0) (void)cudaSetDevice(previous);
  }

 private:
  static int CurrentDevice() {
    int d = 0;
    (void)cudaGetDevice(&d);
    return d;
  }

  std::once_flag probe_;
  int count_ = 0;
  std::string reason_;
};

}  // namespace

std::shared_ptr<DeviceBackend> MakeCudaBackend() { return std::make_shared<CudaBackend>(); }

}  // namespace dcp
