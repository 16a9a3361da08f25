// The reader's parallel path: a large whole item is read in pieces (at least 32 MiB, no more
// than the read threads can share) by every read thread, each piece CRC'd alone and the CRCs
// combined; corruption in any piece is still named.
// Each read thread reads a contiguous stripe of the tasks through one open object per file.
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <mutex>
#include <vector>

#include "dcp/storage/backends/fault_store.h"
#include "dcp/storage/backends/file_store.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/registry.h"
#include "dcp/storage/store.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {

// Load "big" and "small" from `uri` into fresh tensors and check their values.
void LoadAndCheck(const std::string& uri, const TensorView& big, const TensorView& small,
                  LoadOptions options) {
  LocalCommunicator comm;
  StateDict back;
  TensorView b = TensorView::Allocate(big.dtype, big.shape);
  TensorView s = TensorView::Allocate(small.dtype, small.shape);
  back.Set("big", b);
  back.Set("small", s);
  Load(back, uri, comm, options);
  CHECK(SameElements(b, big));
  CHECK(SameElements(s, small));
}

// Save "big" and "small" to `uri` from one rank.
void SaveBigAndSmall(const std::string& uri, const TensorView& big, const TensorView& small) {
  StateDict sd;
  sd.Set("big", big);
  sd.Set("small", small);
  LocalCommunicator comm;
  Save(sd, uri, comm);
}

}  // namespace

TEST_CASE("reader: large items read in parallel pieces, corruption in any piece is named",
          "[reader]") {
  TempDir dir("rd");
  const TensorView big = RandomTensor(DType::kFloat32, {5, 5 << 20}, 81);  // 100 MiB: 4 pieces
  const TensorView small = RandomTensor(DType::kInt8, {1000}, 82);
  StateDict sd;
  sd.Set("big", big);
  sd.Set("small", small);
  LocalCommunicator comm;
  Save(sd, dir / "c", comm);
  for (int threads : {1, 2, 3}) {
    for (bool verify : {true, false}) {
#ifdef DCP_UNDER_SANITIZER
      // Each load copies 100 MiB, every byte instrumented: one setting per thread count.
      if (verify != (threads != 2)) continue;
#endif
      INFO("threads " << threads << " verify " << verify);
      LoadOptions o;
      o.storage.read_threads = threads;
      o.storage.verify_checksums = verify;
      LoadAndCheck(dir / "c", big, small, o);
    }
  }
  // Flip one byte in the third piece of "big" (the file holds big first: larger items first).
  std::string data;
  for (const auto& e : std::filesystem::directory_iterator(dir / "c")) {
    if (e.path().extension() == ".data") data = e.path();
  }
  const Metadata md = ReadMetadata(dir / "c");
  uint64_t offset = 0;
  for (const auto& [index, info] : md.storage) {
    if (index.fqn == "big") offset = info.offset;
  }
  const long at = static_cast<long>(offset + (70u << 20) + 12345);
  std::FILE* f = std::fopen(data.c_str(), "r+b");
  REQUIRE(f);
  std::fseek(f, at, SEEK_SET);
  const int c = std::fgetc(f);
  std::fseek(f, at, SEEK_SET);
  std::fputc(c ^ 1, f);
  std::fclose(f);
  StateDict back;
  back.Set("big", TensorView::Allocate(DType::kFloat32, big.shape));
  LoadOptions o;
  o.allow_partial_load = true;
  o.storage.read_threads = 2;
  const std::string msg = MessageOf<CollectiveError>([&] { Load(back, dir / "c", comm, o); });
  CHECK_THAT(msg, Contains("checksum mismatch") && Contains("big") && Contains(".data") &&
                      Contains("offset " + std::to_string(offset)));
}

TEST_CASE("reader: each read thread streams its stripe of a file through one open object",
          "[reader][option:StorageOptions::read_threads][option:LoadOptions::storage]") {
  // The kernel's readahead state lives in the open file: a reader that opened the file afresh
  // for every 32 MiB piece, or read every other piece, restarted it each time, which filled the
  // page cache with small folios and slowed the next (warm) load. Each reader now reads a
  // contiguous stripe of the tasks through one open object per file.
#ifdef DCP_UNDER_THREAD_SANITIZER
  WARN("skipped under ThreadSanitizer: it counts opens, and its 100 MiB loads take a minute there");
  return;
#endif
  TempDir dir("rdstripe");
  const TensorView big = RandomTensor(DType::kFloat32, {5, 5 << 20}, 83);  // 100 MiB: 4 pieces
  const TensorView small = RandomTensor(DType::kInt8, {1000}, 84);
  auto store = std::make_shared<FaultInjectionStore>(MakeFileStore(dir / "c"));
  RegisterFaultScheme("stripes", store);
  SaveBigAndSmall("stripes://c", big, small);
  auto opens_to_load = [&](int threads) {
    LoadOptions o;
    o.storage.read_threads = threads;
    store->Reset();
    LoadAndCheck("stripes://c", big, small, o);
    return store->Count(FaultOp::kOpen);
  };
  const int one = opens_to_load(1), two = opens_to_load(2), three = opens_to_load(3);
  INFO("opens with 1, 2, 3 read threads: " << one << ", " << two << ", " << three);
  // The metadata (at most one open), the data file's index (version 2: one ranged read before
  // the plan's reads) and then at most one open of the data file per read thread: a thread that
  // starts after the others took its whole stripe opens nothing (seen under ASan: 2, 3, 3), so
  // more threads may open fewer, never more.
  CHECK(one <= 3);
  CHECK(two >= one);
  CHECK(two <= one + 1);
  CHECK(three >= one);
  CHECK(three <= one + 2);
}

namespace {

// Records the streamed reads (ReadAtStreaming, ReadManyStreaming) of data files, each by its
// bytes; they then read through ReadAt, as the defaults do.
std::mutex g_streamed_mu;
std::vector<uint64_t> g_streamed;

class StreamCountingObject : public ForwardingReadableObject {
 public:
  using ForwardingReadableObject::ForwardingReadableObject;
  void ReadAtStreaming(uint64_t offset, void* dst, size_t n, size_t step,
                       const std::function<void(size_t, size_t)>& landed) override {
    Record(n);
    ReadableObject::ReadAtStreaming(offset, dst, n, step, landed);
  }
  void ReadManyStreaming(const std::vector<ReadTarget>& targets, size_t step,
                         const std::function<void(size_t, size_t, size_t)>& landed) override {
    uint64_t n = 0;
    for (const ReadTarget& t : targets) n += t.n;
    Record(n);
    in_many_ = true;  // its targets come through ReadAtStreaming: one streamed read
    ReadableObject::ReadManyStreaming(targets, step, landed);
    in_many_ = false;
  }

 private:
  void Record(uint64_t n) const {
    if (in_many_) return;
    std::lock_guard<std::mutex> lock(g_streamed_mu);
    g_streamed.push_back(n);
  }
  bool in_many_ = false;
};

class StreamCountingStore : public ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  std::unique_ptr<ReadableObject> Open(const std::string& name) override {
    auto inner = ForwardingStore::Open(name);
    if (!IsDataObjectName(name)) return inner;
    return std::make_unique<StreamCountingObject>(std::move(inner));
  }
};

}  // namespace

TEST_CASE("reader: a large item is cut into no more pieces than its readers share",
          "[reader][option:StorageOptions::read_threads]") {
  // A remote store keeps several requests in flight within one streamed read and drains them
  // at its end: s3:// ran a 4-rank load (one reader per rank, 64 MiB each) at 0.90x raw GET
  // because each item was read in 32 MiB pieces whatever the number of readers.
#ifdef DCP_UNDER_THREAD_SANITIZER
  WARN("skipped under ThreadSanitizer: it sizes reads, and its 100 MiB loads take 40 s there");
  return;
#endif
  TempDir dir("rdpieces");
  const TensorView big = RandomTensor(DType::kFloat32, {5, 5 << 20}, 85);  // 100 MiB
  const TensorView small = RandomTensor(DType::kInt8, {1000}, 86);
  RegisterBackend("streamcount", [&](const std::string& location) -> std::shared_ptr<Store> {
    return std::make_shared<StreamCountingStore>(MakeFileStore(dir / location));
  });
  SaveBigAndSmall("streamcount://c", big, small);
  auto streamed = [&](int threads) {
    {
      std::lock_guard<std::mutex> lock(g_streamed_mu);
      g_streamed.clear();
    }
    LoadOptions o;
    o.storage.read_threads = threads;
    LoadAndCheck("streamcount://c", big, small, o);
    std::lock_guard<std::mutex> lock(g_streamed_mu);
    std::vector<uint64_t> big_reads;
    for (uint64_t n : g_streamed) {
      if (n > 1000) big_reads.push_back(n);
    }
    std::sort(big_reads.begin(), big_reads.end());
    return big_reads;
  };
  // One reader: the item in one streamed read, with the small one after it (before: four
  // pieces of at most 32 MiB, then the small item).
  CHECK(streamed(1) == std::vector<uint64_t>{(uint64_t{100} << 20) + 1000});
  // Two: about a half each.
  const std::vector<uint64_t> two = streamed(2);
  REQUIRE(two.size() == 2);
  CHECK(two[0] + two[1] == uint64_t{100} << 20);
  CHECK(two[0] >= uint64_t{49} << 20);
}

namespace {

// Records whether two size queries of data files were ever in flight at once: the first one
// waits (up to 10 s) for a second to arrive.
class ConcurrentSizeStore : public ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  std::optional<uint64_t> Size(const std::string& name) override {
    if (IsDataObjectName(name)) {
      std::unique_lock<std::mutex> lock(mu_);
      ++in_flight_;
      if (in_flight_ > 1) overlapped_ = true;
      cv_.notify_all();
      if (!waited_) {
        waited_ = true;
        cv_.wait_for(lock, std::chrono::seconds(10), [&] { return overlapped_; });
      }
      --in_flight_;
    }
    return target_->Size(name);
  }
  bool overlapped() {
    std::lock_guard<std::mutex> lock(mu_);
    return overlapped_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  int in_flight_ = 0;
  bool waited_ = false, overlapped_ = false;
};

}  // namespace

TEST_CASE("reader: the data files' sizes are checked with the queries in flight together",
          "[reader]") {
  // On an object store each size query is a round trip: the coordinator checked a 4,096-rank
  // checkpoint's 4,096 files one after another before any rank could plan its load.
  TempDir dir("rdsizes");
  StateDict sd;
  std::vector<TensorView> tensors;
  for (int i = 0; i < 4; ++i) {
    tensors.push_back(RandomTensor(DType::kFloat32, {1000}, 90 + i));
    sd.Set("t" + std::to_string(i), tensors.back());
  }
  SaveOptions so;
  so.storage.files_per_rank = 4;
  LocalCommunicator comm;
  Save(sd, dir / "c", comm, so);
  auto store = std::make_shared<ConcurrentSizeStore>(MakeFileStore(dir / "c"));
  const Metadata md = MakeStoreReader(store, {})->ReadMetadata();
  CHECK(md.entries.size() == 4);
  CHECK(store->overlapped());
}
