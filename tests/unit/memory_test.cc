// Memory: staging comes from pools (a second save allocates none), and the memory budget bounds
// how many files a rank writes at once.
#include <fcntl.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <thread>

#include "dcp/proto/staging.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/store.h"
#include "support/fake_device.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;

namespace {

// A Store that counts how many objects are open for writing at once.
class CountingStore : public ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  std::unique_ptr<WritableObject> Create(const std::string& n) override {
    class Counted : public ForwardingWritableObject {
     public:
      Counted(std::unique_ptr<WritableObject> w, CountingStore& s)
          : ForwardingWritableObject(std::move(w)), s_(s) {
        const int now = ++s_.open_;
        int seen = s_.max_open_.load();
        while (now > seen && !s_.max_open_.compare_exchange_weak(seen, now)) {
        }
      }
      ~Counted() override { --s_.open_; }
      void Append(const void* d, size_t n) override {
        std::this_thread::sleep_for(std::chrono::milliseconds(2));  // let writers overlap
        ForwardingWritableObject::Append(d, n);
      }

     private:
      CountingStore& s_;
    };
    return std::make_unique<Counted>(ForwardingStore::Create(n), *this);
  }

  std::atomic<int> open_{0}, max_open_{0};
};

StateDict ManyTensors(std::vector<TensorView>& keep) {
  StateDict sd;
  for (int i = 0; i < 8; ++i) {
    keep.push_back(RandomTensor(DType::kFloat32, {64, 1024}, 50 + i));
    sd.Set("t" + std::to_string(i), keep.back());
  }
  return sd;
}

}  // namespace

TEST_CASE("memory: the budget bounds concurrent writers and readers",
          "[memory][option:StorageOptions::memory_budget_bytes]") {
  for (size_t budget : {size_t{1}, kWriterStagingBytes, 4 * kWriterStagingBytes}) {
    INFO("budget " << budget);
    auto store = std::make_shared<CountingStore>(MakeMemStore("budget-" + std::to_string(budget)));
    std::vector<TensorView> keep;
    StateDict sd = ManyTensors(keep);
    StorageOptions o;
    o.files_per_rank = 4;
    o.memory_budget_bytes = budget;
    LocalCommunicator comm;
    auto writer = MakeStoreWriter(store, o);
    Save(sd, *writer, comm);
    const size_t allowed = std::max<size_t>(1, std::min<size_t>(4, budget / kWriterStagingBytes));
    CHECK(store->max_open_ <= static_cast<int>(allowed));
    CHECK(store->max_open_ >= 1);
    // Loads within the same budget read everything back.
    StateDict back;
    std::vector<TensorView> dst;
    for (int i = 0; i < 8; ++i) {
      dst.push_back(TensorView::Allocate(DType::kFloat32, {64, 1024}));
      back.Set("t" + std::to_string(i), dst.back());
    }
    auto reader = MakeStoreReader(store, o);
    Load(back, *reader, comm);
    for (int i = 0; i < 8; ++i) CHECK(SameElements(dst[i], keep[i]));
  }
}

TEST_CASE("memory: after the first save no staging memory is allocated", "[memory]") {
  ScopedFakeDevice dev;
  TempDir dir("mem");
  // A strided host tensor (gathered through host staging) and a device tensor (pinned pieces).
  TensorView base = RandomTensor(DType::kFloat32, {1024, 3000}, 61);
  TensorView strided = base.Narrow({0, 1}, {1024, 2000});
  StateDict sd;
  sd.Set("strided", strided);
  sd.Set("device", dev->Upload(RandomTensor(DType::kBFloat16, {4096, 2048}, 62)));
  LocalCommunicator comm;
  SaveOptions o;
  o.storage.overwrite = true;
  Save(sd, dir / "a", comm, o);
  const uint64_t host = HostStagingBytesAllocated(), pinned = PinnedBytesAllocated();
  for (int i = 0; i < 3; ++i) Save(sd, dir / "a", comm, o);
  CHECK(HostStagingBytesAllocated() == host);
  CHECK(PinnedBytesAllocated() == pinned);
}

// Whether files in `dir` can be opened with O_DIRECT (tmpfs cannot).
bool DirectIoSupported(const std::string& dir) {
  const std::string probe = dir + "/.direct-probe";
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_DIRECT, 0644);
  if (fd < 0) return false;
  ::close(fd);
  ::unlink(probe.c_str());
  return true;
}

TEST_CASE("memory: direct-I/O writes and read scratch lease from the one host buffer pool",
          "[memory]") {
  TempDir dir("pool");
  // 32 MiB in 1 MiB items: appended through the file store's two 16 MiB direct-I/O buffers.
  StateDict sd;
  std::vector<TensorView> keep;
  for (int i = 0; i < 32; ++i) {
    keep.push_back(RandomTensor(DType::kFloat32, {256, 1024}, 80 + i));
    sd.Set("t" + std::to_string(i), keep.back());
  }
  LocalCommunicator comm;
  SaveOptions o;
  o.storage.overwrite = true;
  // Strided destinations: each item is read through a reader's scratch buffer.
  std::vector<TensorView> wide;
  auto load_back = [&] {
    StateDict back;
    wide.clear();
    for (int i = 0; i < 32; ++i) {
      wide.push_back(RandomTensor(DType::kFloat32, {256, 1100}, 200 + i));
      back.Set("t" + std::to_string(i), wide.back().Narrow({0, 0}, {256, 1024}));
    }
    Load(back, dir / "a", comm);
    for (int i = 0; i < 32; ++i) {
      REQUIRE(SameElements(wide[i].Narrow({0, 0}, {256, 1024}), keep[i]));
    }
  };
  Save(sd, dir / "a", comm, o);
  load_back();
  // The direct-I/O buffers came from the pool (when the filesystem takes O_DIRECT).
  if (DirectIoSupported(dir.path())) CHECK(HostStagingBytesAllocated() >= (size_t{32} << 20));
  const uint64_t host = HostStagingBytesAllocated();
  for (int i = 0; i < 3; ++i) {
    Save(sd, dir / "a", comm, o);
    load_back();
  }
  CHECK(HostStagingBytesAllocated() == host);
}
