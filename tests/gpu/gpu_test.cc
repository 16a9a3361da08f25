// The device paths of proto/device/device.h on a real CUDA device: copies with any strides, save
// and load of CUDA tensors (whole, resharded, through the pinned pipeline), async snapshots,
// the memory tier with CUDA tensors, and that dcp leaves the caller's current device alone.
#include <cuda_runtime_api.h>

#include <catch2/catch.hpp>
#include <filesystem>

#include "dcp/proto/device/device.h"
#include "support/fake_device.h"
#include "support/test_support.h"
#include "support/tier_device_case.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {

std::shared_ptr<DeviceBackend> Cuda() { return FindDeviceBackend(Device::Type::kCUDA); }

TensorView Transposed(const TensorView& base) {
  TensorView t = base;
  t.shape = {base.shape[1], base.shape[0]};
  t.strides = {1, base.shape[1]};
  return t;
}

}  // namespace

TEST_CASE("gpu: CopyTensor host <-> cuda with strides", "[gpu]") {
  auto cuda = Cuda();
  for (DType dtype : {DType::kUInt8, DType::kBFloat16, DType::kFloat32, DType::kComplex128}) {
    const TensorView host = RandomTensor(dtype, {129, 67}, 1);
    TensorView d = DeviceUpload(cuda, host);
    CHECK(SameElements(DeviceDownload(d), host));
    CHECK(
        SameElements(DeviceDownload(d.Narrow({5, 3}, {100, 60})), host.Narrow({5, 3}, {100, 60})));
    TensorView dt = DeviceEmpty(cuda, dtype, {67, 129});
    CopyTensor(dt, Transposed(d));  // device to device, strided source
    CHECK(SameElements(DeviceDownload(dt), Transposed(host)));
  }
}

TEST_CASE("gpu: save and load CUDA tensors through the pinned pipeline", "[gpu]") {
  auto cuda = Cuda();
  TempDir dir("gpu");
  const TensorView big = RandomTensor(DType::kFloat32, {40, 1 << 20}, 2);  // 160 MiB, 10 pieces
  const TensorView small = RandomTensor(DType::kInt64, {33, 17}, 3);
  int device_before = -1;
  cudaGetDevice(&device_before);
  const uint64_t pinned_before = PinnedBytesAllocated();
  RequireNoErrors(RunRanks(2, [&](int rank, Communicator& comm) {
    StateDict sd;
    auto [r0, r1] = RowRange(40, rank, 2);
    ShardedTensor st{DType::kFloat32, big.shape, {}};
    st.local_shards.push_back(
        {DeviceUpload(cuda, big.Narrow({r0, 0}, {r1 - r0, 1 << 20})), {r0, 0}});
    sd.Set("big", st);
    sd.Set("small", Transposed(DeviceUpload(cuda, small)));
    Save(sd, dir / "c", comm);
  }));
  CHECK(PinnedBytesAllocated() - pinned_before <= 2 * 2 * kDevicePieceBytes);
  int device_after = -1;
  cudaGetDevice(&device_after);
  CHECK(device_after == device_before);
  // Load at 3 ranks into CUDA tensors (resharded: partial chunks) and at 1 rank whole.
  RequireNoErrors(RunRanks(3, [&](int rank, Communicator& comm) {
    StateDict sd;
    auto [r0, r1] = RowRange(40, rank, 3);
    ShardedTensor st{DType::kFloat32, big.shape, {}};
    st.local_shards.push_back({DeviceEmpty(cuda, DType::kFloat32, {r1 - r0, 1 << 20}), {r0, 0}});
    sd.Set("big", st);
    sd.Set("small", DeviceEmpty(cuda, DType::kInt64, {17, 33}));
    Load(sd, dir / "c", comm);
    Expect(
        SameElements(DeviceDownload(std::get<ShardedTensor>(*sd.Find("big")).local_shards[0].view),
                     big.Narrow({r0, 0}, {r1 - r0, 1 << 20})),
        "big");
    Expect(SameElements(DeviceDownload(std::get<TensorView>(*sd.Find("small"))), Transposed(small)),
           "small");
  }));
  StateDict sd;
  TensorView whole = DeviceEmpty(cuda, DType::kFloat32, big.shape);
  sd.Set("big", whole);
  LocalCommunicator comm;
  LoadOptions lo;
  lo.allow_partial_load = true;
  Load(sd, dir / "c", comm, lo);
  CHECK(SameElements(DeviceDownload(whole), big));
}

TEST_CASE("gpu: async save snapshots CUDA tensors", "[gpu]") {
  auto cuda = Cuda();
  const TensorView v0 = RandomTensor(DType::kBFloat16, {1024, 4096}, 5);
  const TensorView v1 = RandomTensor(DType::kBFloat16, {1024, 4096}, 6);
  TensorView w = DeviceUpload(cuda, v0);
  StateDict sd;
  sd.Set("w", w);
  AsyncCheckpointer ckpt(std::make_unique<LocalCommunicator>());
  auto save = ckpt.Save(sd, "mem://gpu-async");
  CopyTensor(w, v1);  // training moves on at once
  save->Wait();
  CHECK(save->metrics().device_bytes == v0.nbytes());
  TensorView back = DeviceEmpty(cuda, DType::kBFloat16, v0.shape);
  StateDict into;
  into.Set("w", back);
  LocalCommunicator comm;
  Load(into, "mem://gpu-async", comm);
  CHECK(SameElements(DeviceDownload(back), v0));
  ckpt.Close();
}

TEST_CASE("gpu: a device index the process does not have is refused by name", "[gpu]") {
  auto cuda = Cuda();
  TensorView v = DeviceUpload(cuda, RandomTensor(DType::kFloat32, {4}, 7));
  v.device.index = cuda->device_count();
  StateDict sd;
  sd.Set("head.bias", v);
  LocalCommunicator comm;
  CHECK_THAT(MessageOf<CollectiveError>([&] { Save(sd, "mem://gpu-bad", comm); }),
             Contains("head.bias") && Contains("cuda:"));
}

TEST_CASE("gpu: host memory tagged as device memory is refused by name, not copied", "[gpu]") {
  // Before, cudaMemcpy2DAsync copied a host buffer tagged cuda:0 without complaint.
  TensorView host = RandomTensor(DType::kFloat32, {64}, 8);
  TensorView lying = host;
  lying.device = Device{Device::Type::kCUDA, 0};
  StateDict sd;
  sd.Set("layer.lying", lying);
  LocalCommunicator comm;
  const std::string msg = MessageOf<CollectiveError>([&] { Save(sd, "mem://gpu-lying", comm); });
  CHECK_THAT(msg, Contains("layer.lying") && Contains("not device memory"));
  // Loading into it is refused the same way.
  TensorView back = RandomTensor(DType::kFloat32, {64}, 8);
  StateDict ok;
  ok.Set("layer.lying", back);
  Save(ok, "mem://gpu-lying-ok", comm);
  StateDict into;
  into.Set("layer.lying", lying);
  CHECK_THAT(MessageOf<CollectiveError>([&] { Load(into, "mem://gpu-lying-ok", comm); }),
             Contains("not device memory"));
}

TEST_CASE(
    "gpu: the memory tier saves CUDA tensors in the foreground and the background and restores "
    "them bit-exact after a node's loss and at another world size",
    "[gpu][memory-tier]") {
  TempDir root("gpu-tier");
  CheckTierWithDeviceTensors(Cuda(), root.path());
}
