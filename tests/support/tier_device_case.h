// One check of the memory tier with device tensors, run on the fake device in CI
// (memory_tier_test.cc) and on a real CUDA device where one is lent (tests/gpu/gpu_test.cc).
#pragma once

#include <memory>
#include <string>

#include "dcp/proto/device/device.h"

namespace dcp::testing {

// 4 ranks as 2 simulated nodes hold a row-sharded float32 "w" and a replicated bfloat16 "bias"
// on `backend`'s device 0. They save step 1 (synchronous) and step 2 (in the background) into a
// tier under `shm_root`; node 1's memory is wiped; the restore brings step 2 back into device
// tensors, bit-exact; then 2 ranks (as 2 nodes) restore it at their world size, bit-exact.
// Fails the test (Catch) when any rank fails.
void CheckTierWithDeviceTensors(const std::shared_ptr<DeviceBackend>& backend,
                                const std::string& shm_root);

}  // namespace dcp::testing
