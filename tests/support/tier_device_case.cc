#include "support/tier_device_case.h"

#include <filesystem>
#include <utility>
#include <vector>

#include "dcp/dcp.h"
#include "support/fake_device.h"
#include "support/test_support.h"

namespace dcp::testing {

namespace {

constexpr int64_t kRows = 64, kCols = 1 << 16;  // 16 MiB of float32 in all

// A rank's state on the device: its rows of "w" and the replicated "bias", copied from `full`
// and `bias` (when null: uninitialised tensors to load into).
StateDict DeviceState(const std::shared_ptr<DeviceBackend>& backend, int rank, int world,
                      const TensorView* full, const TensorView* bias) {
  StateDict sd;
  auto [r0, r1] = RowRange(kRows, rank, world);
  ShardedTensor st{DType::kFloat32, {kRows, kCols}, {}};
  TensorView rows = DeviceEmpty(backend, DType::kFloat32, {r1 - r0, kCols});
  if (full) CopyTensor(rows, full->Narrow({r0, 0}, {r1 - r0, kCols}));
  st.local_shards.push_back({rows, {r0, 0}});
  sd.Set("w", st);
  TensorView b = DeviceEmpty(backend, DType::kBFloat16, {4096});
  if (bias) CopyTensor(b, *bias);
  sd.Set("bias", b);
  return sd;
}

bool Holds(StateDict& sd, int rank, int world, const TensorView& full, const TensorView& bias) {
  auto [r0, r1] = RowRange(kRows, rank, world);
  const auto& st = std::get<ShardedTensor>(*sd.Find("w"));
  return SameElements(DeviceDownload(st.local_shards[0].view),
                      full.Narrow({r0, 0}, {r1 - r0, kCols})) &&
         SameElements(DeviceDownload(std::get<TensorView>(*sd.Find("bias"))), bias);
}

}  // namespace

void CheckTierWithDeviceTensors(const std::shared_ptr<DeviceBackend>& backend,
                                const std::string& shm_root) {
  const TensorView full = RandomTensor(DType::kFloat32, {kRows, kCols}, 11);
  const TensorView bias = RandomTensor(DType::kBFloat16, {4096}, 12);
  MemoryTierOptions options;
  options.name = "device";
  options.shm_root = shm_root;
  options.ranks_per_node = 2;
  constexpr int kWorld = 4;
  std::vector<std::unique_ptr<Communicator>> background(kWorld);
  InProcessGroup group(kWorld);
  for (int r = 0; r < kWorld; ++r) background[r] = group.Release(r);
  RequireNoErrors(RunRanks(kWorld, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options, std::move(background[rank]));
    StateDict sd = DeviceState(backend, rank, kWorld, &full, &bias);
    tier.Save(1, sd);
    tier.SaveAsync(2, sd)->Wait();
    tier.Wait();
    comm.Barrier("saved");
    if (rank == 0) std::filesystem::remove_all(MemoryTier::JobDirectory(options) + "/node-1");
    comm.Barrier("lost");
    StateDict back = DeviceState(backend, rank, kWorld, nullptr, nullptr);
    Expect(tier.Restore(back) == 2, "step 2 restored");
    Expect(Holds(back, rank, kWorld, full, bias), "step 2 is bit-exact on the device");
    tier.Close();
  }));
  options.ranks_per_node = 1;  // 2 nodes of 1 rank: the directories of the 2 nodes of 2
  RequireNoErrors(RunRanks(2, [&](int rank, Communicator& comm) {
    MemoryTier tier(comm, options);
    StateDict back = DeviceState(backend, rank, 2, nullptr, nullptr);
    Expect(tier.Restore(back) == 2, "step 2 restored at 2 ranks");
    Expect(Holds(back, rank, 2, full, bias), "step 2 is bit-exact at 2 ranks");
  }));
}

}  // namespace dcp::testing
