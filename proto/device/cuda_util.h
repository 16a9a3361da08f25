// Internal (not installed; builds with DCP_WITH_CUDA only): helpers shared by dcp's CUDA code
// (proto/device/cuda_device.cc, dcp/nccl_communicator.cc). Includes the CUDA runtime header.
#pragma once

#include <cuda_runtime_api.h>

#include <new>
#include <string>

namespace dcp::cuda {

/// "cudaErrorX: text" for an error code.
std::string Describe(cudaError_t e);

/// Throw DeviceError naming `call` and `device` unless e == cudaSuccess (and clear the
/// thread's last-error state, so a later unrelated call does not see it).
void Check(cudaError_t e, const char* call, int device);

/// Makes `device` current for the scope and restores the caller's device afterwards, so dcp
/// never changes which device the application's own CUDA calls go to.
class DeviceScope {
 public:
  /// Throws DeviceError when the device cannot be made current.
  explicit DeviceScope(int device);
  /// For destructors and clean-up: never throws; a failure to switch is ignored (the calls that
  /// follow then fail on their own, and clean-up ignores their results).
  DeviceScope(int device, std::nothrow_t);
  ~DeviceScope();
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace dcp::cuda
