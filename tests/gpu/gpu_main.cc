// GPU tests: run only where a CUDA device is usable; otherwise exit 77, which CTest reports as
// "Skipped" (SKIP_RETURN_CODE), with the reason on stdout.
#include <catch2/catch.hpp>
#include <cstdio>

#include "dcp/proto/device/device.h"
#include "support/catch_runner.h"

int main(int argc, char** argv) {
  auto cuda = dcp::FindDeviceBackend(dcp::Device::Type::kCUDA);
  if (!cuda || cuda->device_count() == 0) {
    std::printf("SKIPPED: %s\n",
                !cuda ? "this build has no CUDA backend" : cuda->unavailable_reason().c_str());
    return 77;
  }
  std::printf("CUDA devices: %d\n", cuda->device_count());
  return dcp::testing::RunCatchSession(argc, argv);
}
