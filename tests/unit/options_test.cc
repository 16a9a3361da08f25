// One test per public option that no other test checks on its own (dcp/options.h,
// StorageOptions in dcp/storage/storage.h): each sets the field to a value other than its
// default and checks what that changes, so a field that is ignored fails its test. Every test
// claims its field with a tag "[option:<struct>::<field>]"; tests/options_coverage_check.py finds
// the claims here and in the other test files and fails while a field has none.
#include <signal.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "dcp/dcp.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/store.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {

std::string FreshMem(const std::string& tag) {
  static int counter = 0;
  const std::string name = "options-" + tag + "-" + std::to_string(counter++);
  ClearMemStore(name);
  return name;
}

// Data file names of the checkpoint in `store`, by writing rank ("...-r<rank>-b<k>.data").
std::map<int, int> DataFilesPerRank(Store& store) {
  std::map<int, int> per_rank;
  for (const auto& n : store.List()) {
    if (!IsDataObjectName(n)) continue;
    const size_t r = n.rfind("-r");
    per_rank[std::stoi(n.substr(r + 2))]++;
  }
  return per_rank;
}

// Random bytes with 4 bits of entropy each: zstd stores them in a little over half their size.
TensorView Compressible(const Shape& shape, uint64_t seed) {
  TensorView t = RandomTensor(DType::kUInt8, shape, seed);
  auto* p = static_cast<uint8_t*>(t.data);
  for (size_t i = 0; i < t.nbytes(); ++i) p[i] &= 0x0F;
  return t;
}

const StorageInfo& Item(const Metadata& md, const std::string& fqn, const Shape& offsets) {
  return md.storage.at(MetadataIndex{fqn, offsets, {}});
}

bool Compressed(const Metadata& md, const std::string& fqn, const Shape& offsets) {
  return !Item(md, fqn, offsets).transforms.empty();
}

SaveOptions Zstd() {
  SaveOptions so;
  so.storage.compression = Compression::kZstd;
  return so;
}

std::unique_ptr<AsyncCheckpointer> LocalSaver(AsyncOptions o = {}) {
  return std::make_unique<AsyncCheckpointer>(std::make_unique<LocalCommunicator>(), std::move(o));
}

// Threads of this process right now (Linux: /proc/self/status).
int ProcessThreads() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("Threads:", 0) == 0) return std::stoi(line.substr(8));
  }
  return -1;
}

// Locked memory of this process in KiB (VmLck of /proc/self/status).
long LockedKiB() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmLck:", 0) == 0) return std::stol(line.substr(6));
  }
  return -1;
}

}  // namespace

// ---- StorageOptions

TEST_CASE("option: StorageOptions::files_per_rank is the number of data files each rank writes",
          "[options][option:StorageOptions::files_per_rank][option:SaveOptions::storage]") {
  std::vector<TensorView> src;
  for (int i = 0; i < 8; ++i) src.push_back(RandomTensor(DType::kFloat32, {2, 64, 16}, 10 + i));
  for (int files : {1, 3}) {
    DYNAMIC_SECTION("files_per_rank " << files) {
      const std::string name = FreshMem("files");
      RequireNoErrors(RunRanks(2, [&](int r, Communicator& comm) {
        StateDict sd;
        for (int i = 0; i < 8; ++i) {
          sd.Set("t" + std::to_string(i),
                 ShardedTensor{DType::kFloat32,
                               {2, 64, 16},
                               {{Clone(src[i].Narrow({r, 0, 0}, {1, 64, 16})), {r, 0, 0}}}});
        }
        SaveOptions so;
        so.storage.files_per_rank = files;
        Save(sd, "mem://" + name, comm, so);
      }));
      CHECK(DataFilesPerRank(*MakeMemStore(name)) == std::map<int, int>{{0, files}, {1, files}});
      StateDict back = LoadAll("mem://" + name);
      for (int i = 0; i < 8; ++i) {
        CHECK(SameElements(std::get<TensorView>(*back.Find("t" + std::to_string(i))), src[i]));
      }
      ClearMemStore(name);
    }
  }
}

namespace {

// Counts WritableObject::Sync calls made on a mem:// store.
std::atomic<int> g_syncs{0};

class SyncCountingStore : public ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  std::unique_ptr<WritableObject> Create(const std::string& n) override {
    class Counted : public ForwardingWritableObject {
     public:
      using ForwardingWritableObject::ForwardingWritableObject;
      void Sync() override {
        ++g_syncs;
        ForwardingWritableObject::Sync();
      }
    };
    return std::make_unique<Counted>(ForwardingStore::Create(n));
  }
};

}  // namespace

TEST_CASE("option: StorageOptions::sync off makes no Sync call on the data files",
          "[options][option:StorageOptions::sync]") {
  static const bool registered = [] {
    RegisterBackend("optsync", [](const std::string& loc) {
      return std::make_shared<SyncCountingStore>(MakeMemStore("optsync/" + loc));
    });
    return true;
  }();
  (void)registered;
  StateDict sd;
  const TensorView w = RandomTensor(DType::kFloat32, {64, 64}, 3);
  sd.Set("w", w).Set("b", RandomTensor(DType::kFloat32, {64}, 4));
  SaveOptions so;
  so.storage.files_per_rank = 2;
  ClearMemStore("optsync/on");
  g_syncs = 0;
  Save(sd, "optsync://on", so);
  CHECK(g_syncs == 2);  // one per data file
  so.storage.sync = false;
  ClearMemStore("optsync/off");
  g_syncs = 0;
  Save(sd, "optsync://off", so);
  CHECK(g_syncs == 0);
  StateDict back = LoadAll("optsync://off");
  CHECK(SameElements(std::get<TensorView>(*back.Find("w")), w));
  ClearMemStore("optsync/on");
  ClearMemStore("optsync/off");
}

TEST_CASE("option: StorageOptions::compression_level trades speed for size",
          "[options][compression][option:StorageOptions::compression_level]") {
  // Text of words drawn from a small vocabulary: the higher levels find more of its repeats.
  const char* const words[] = {"tensor", "shard", "rank", "checkpoint", "metadata", "save",
                               "load",   "plan",  "zstd", "storage",    "bucket",   "offset"};
  std::mt19937_64 rng(42);
  std::string text;
  while (text.size() < (1 << 20)) {
    text += words[rng() % 12];
    text += (rng() % 7 == 0) ? ".\n" : " ";
  }
  StateDict sd;
  sd.Set("text", Blob{text});
  std::map<int, uint64_t> stored;
  for (int level : {-5, 1, 19}) {
    const std::string name = FreshMem("level");
    SaveOptions so = Zstd();
    so.storage.compression_level = level;
    Metadata md = Save(sd, "mem://" + name, so).metadata;
    ReadStoredItems("mem://" + name, md);
    REQUIRE(Compressed(md, "text", {}));
    stored[level] = Item(md, "text", {}).length;
    StateDict back = LoadAll("mem://" + name);
    CHECK(std::get<Blob>(*back.Find("text")).bytes == text);
    ClearMemStore(name);
  }
  INFO("stored bytes at levels -5, 1, 19: " << stored[-5] << ", " << stored[1] << ", "
                                            << stored[19]);
  CHECK(stored[19] < stored[1]);
  CHECK(stored[1] < stored[-5]);
}

TEST_CASE("option: StorageOptions::compression_threads runs zstd workers during the save",
          "[options][compression][option:StorageOptions::compression_threads]") {
  // 32 MiB that zstd compresses: long enough for a sampler to see the workers.
  const TensorView big = Compressible({32 << 20}, 5);
  StateDict sd;
  sd.Set("big", big);
  auto peak_threads = [&](int compression_threads) {
    const std::string name = FreshMem("zthreads");
    SaveOptions so = Zstd();
    so.storage.compression_threads = compression_threads;
    std::atomic<bool> done{false};
    std::atomic<int> peak{0};
    std::thread sampler([&] {
      while (!done) {
        peak = std::max(peak.load(), ProcessThreads());
        std::this_thread::sleep_for(std::chrono::microseconds(200));
      }
    });
    Metadata md = Save(sd, "mem://" + name, so).metadata;
    ReadStoredItems("mem://" + name, md);
    done = true;
    sampler.join();
    CHECK(Compressed(md, "big", {0}));
    StateDict back = LoadAll("mem://" + name);
    CHECK(SameElements(std::get<TensorView>(*back.Find("big")), big));
    ClearMemStore(name);
    return peak.load();
  };
  const int without = peak_threads(0);
  const int with4 = peak_threads(4);
  INFO("peak threads while saving: " << without << " with compression_threads 0, " << with4
                                     << " with 4");
  CHECK(with4 >= without + 3);
}

TEST_CASE("option: StorageOptions::compression_min_bytes leaves smaller items raw",
          "[options][compression][option:StorageOptions::compression_min_bytes]") {
  StateDict sd;
  sd.Set("small", Compressible({2000}, 1)).Set("mid", Compressible({100000}, 2));
  auto compressed = [&](std::optional<uint64_t> min_bytes) {
    const std::string name = FreshMem("minbytes");
    SaveOptions so = Zstd();
    if (min_bytes) so.storage.compression_min_bytes = *min_bytes;
    Metadata md = Save(sd, "mem://" + name, so).metadata;
    ReadStoredItems("mem://" + name, md);
    ClearMemStore(name);
    return std::make_pair(Compressed(md, "small", {0}), Compressed(md, "mid", {0}));
  };
  CHECK(compressed(std::nullopt) == std::make_pair(false, true));  // default: 4096
  CHECK(compressed(1000) == std::make_pair(true, true));
  CHECK(compressed(1 << 20) == std::make_pair(false, false));
}

TEST_CASE("option: StorageOptions::compression_max_ratio keeps items that shrink too little raw",
          "[options][compression][option:StorageOptions::compression_max_ratio]") {
  StateDict sd;
  const TensorView half = Compressible({1 << 18}, 3);  // compresses to a little over 0.5
  sd.Set("half", half);
  for (double ratio : {0.9, 0.75, 0.4}) {
    DYNAMIC_SECTION("max ratio " << ratio) {
      const std::string name = FreshMem("ratio");
      SaveOptions so = Zstd();
      so.storage.compression_max_ratio = ratio;
      Metadata md = Save(sd, "mem://" + name, so).metadata;
      ReadStoredItems("mem://" + name, md);
      const StorageInfo& info = Item(md, "half", {0});
      if (ratio > 0.6) {
        CHECK(Compressed(md, "half", {0}));
        CHECK(info.length <= info.raw_length * ratio);
      } else {
        CHECK_FALSE(Compressed(md, "half", {0}));
        CHECK(info.length == info.raw_length);
      }
      StateDict back = LoadAll("mem://" + name);
      CHECK(SameElements(std::get<TensorView>(*back.Find("half")), half));
      ClearMemStore(name);
    }
  }
}

namespace {

std::mutex g_backend_mu;
std::vector<std::string> g_shelves;  // the "shelf" option each opening of optrec:// was given

}  // namespace

TEST_CASE("option: StorageOptions::backend reaches the backend on save and load",
          "[options][option:StorageOptions::backend]") {
  static const bool registered = [] {
    RegisterBackend("optrec", [](const std::string& loc, const BackendOptionMap& options) {
      BackendOptionReader reader("optrec://", options);
      const std::optional<std::string> shelf = reader.String("shelf");
      reader.Done();
      std::lock_guard<std::mutex> lock(g_backend_mu);
      g_shelves.push_back(shelf.value_or("(none)"));
      return MakeMemStore("optrec/" + loc);
    });
    return true;
  }();
  (void)registered;
  ClearMemStore("optrec/a");
  const TensorView w = RandomTensor(DType::kFloat32, {8, 8}, 6);
  StateDict sd;
  sd.Set("w", w);
  g_shelves.clear();
  SaveOptions so;
  so.storage.backend["shelf"] = "top";
  Save(sd, "optrec://a", so);
  REQUIRE_FALSE(g_shelves.empty());
  CHECK(std::set<std::string>(g_shelves.begin(), g_shelves.end()) == std::set<std::string>{"top"});
  g_shelves.clear();
  LoadOptions lo;
  lo.storage.backend["shelf"] = "bottom";
  TensorView back = TensorView::Allocate(DType::kFloat32, {8, 8});
  StateDict bsd;
  bsd.Set("w", back);
  Load(bsd, "optrec://a", lo);
  CHECK(SameElements(back, w));
  REQUIRE_FALSE(g_shelves.empty());
  CHECK(std::set<std::string>(g_shelves.begin(), g_shelves.end()) ==
        std::set<std::string>{"bottom"});
  // A key the backend does not read fails the save, naming it: nothing is silently ignored.
  SaveOptions typo;
  typo.storage.backend["shelff"] = "top";
  typo.storage.overwrite = true;
  CHECK_THROWS_WITH(Save(sd, "optrec://a", typo), Contains("shelff"));
  ClearMemStore("optrec/a");
}

// ---- SaveOptions

TEST_CASE("option: SaveOptions::checkpoint_id is recorded in the metadata",
          "[options][option:SaveOptions::checkpoint_id]") {
  StateDict sd;
  sd.Set("w", RandomTensor(DType::kFloat32, {4, 4}, 7));
  const std::string plain = "mem://" + FreshMem("ckptid");
  CHECK(Save(sd, plain).metadata.checkpoint_id == plain);  // the default: the URI
  const std::string named = "mem://" + FreshMem("ckptid");
  SaveOptions so;
  so.checkpoint_id = "run-7/step-100";
  CHECK(Save(sd, named, so).metadata.checkpoint_id == "run-7/step-100");
  CHECK(ReadMetadata(named).checkpoint_id == "run-7/step-100");
}

// ---- LoadOptions

TEST_CASE("option: LoadOptions::weights_only loads tensors and leaves byte blobs alone",
          "[options][option:LoadOptions::weights_only]") {
  const std::string uri = "mem://" + FreshMem("weights");
  const TensorView w = RandomTensor(DType::kFloat32, {16, 4}, 8);
  StateDict sd;
  sd.Set("w", w).Set("rng", Blob{"saved rng"});
  Save(sd, uri);
  LoadOptions wo;
  wo.weights_only = true;
  TensorView back = TensorView::Allocate(DType::kFloat32, {16, 4});
  StateDict bsd;
  bsd.Set("w", back).Set("rng", Blob{"untouched"});
  Load(bsd, uri, wo);
  CHECK(SameElements(back, w));
  CHECK(std::get<Blob>(*bsd.Find("rng")).bytes == "untouched");
  StateDict all = LoadAll(uri, wo);
  CHECK(all.Find("w") != nullptr);
  CHECK(all.Find("rng") == nullptr);
  Load(bsd, uri);
  CHECK(std::get<Blob>(*bsd.Find("rng")).bytes == "saved rng");
  CHECK(LoadAll(uri).Find("rng") != nullptr);
}

TEST_CASE("option: LoadOptions::cast_dtypes converts tensors stored in another dtype",
          "[options][option:LoadOptions::cast_dtypes]") {
  const std::string uri = "mem://" + FreshMem("cast");
  // bf16 values exactly representable: they convert to fp32 exactly.
  std::vector<uint16_t> bf16(64);
  for (size_t i = 0; i < bf16.size(); ++i) bf16[i] = static_cast<uint16_t>(0x3F80 + i * 3);
  const TensorView stored_bf16 = TensorView::FromContiguous(bf16.data(), DType::kBFloat16, {8, 8});
  std::vector<float> f32 = {1.5f, -2.75f, 3e9f, -3e9f, 0.0f, 7.9f, -7.9f, 1e-3f};
  const TensorView stored_f32 = TensorView::FromContiguous(f32.data(), DType::kFloat32, {8});
  StateDict sd;
  sd.Set("emb", stored_bf16).Set("stat", stored_f32);
  Save(sd, uri);

  // Into fp32 (a strided destination: the rows of a wider tensor) and int32.
  TensorView wide = TensorView::Allocate(DType::kFloat32, {8, 10});
  TensorView ints = TensorView::Allocate(DType::kInt32, {8});
  StateDict dst;
  dst.Set("emb", wide.Narrow({0, 1}, {8, 8})).Set("stat", ints);
  CHECK_THROWS_WITH(Load(dst, uri), Contains("tensor 'emb'") && Contains("cast_dtypes"));
  LoadOptions cast;
  cast.cast_dtypes = true;
  Load(dst, uri, cast);
  const float* w = static_cast<const float*>(wide.data);
  for (int r = 0; r < 8; ++r) {
    for (int c = 0; c < 8; ++c) {
      const uint32_t bits = static_cast<uint32_t>(bf16[r * 8 + c]) << 16;
      float want;
      std::memcpy(&want, &bits, sizeof(want));
      REQUIRE(w[r * 10 + 1 + c] == want);
    }
    CHECK(w[r * 10] == 0.0f);  // outside the view: untouched
  }
  const int32_t* n = static_cast<const int32_t*>(ints.data);
  CHECK(std::vector<int32_t>(n, n + 8) ==
        std::vector<int32_t>{1, -2, 2147483647, -2147483647 - 1, 0, 7, -7, 0});

  // Resharded while cast: two shards of the bf16 tensor, loaded as float64.
  TensorView top = TensorView::Allocate(DType::kFloat64, {3, 8});
  TensorView bottom = TensorView::Allocate(DType::kFloat64, {5, 8});
  ShardedTensor st;
  st.dtype = DType::kFloat64;
  st.global_shape = {8, 8};
  st.local_shards = {{top, {0, 0}}, {bottom, {3, 0}}};
  StateDict sharded;
  sharded.Set("emb", st);
  LoadOptions partial = cast;
  partial.allow_partial_load = true;
  Load(sharded, uri, partial);
  const double* b = static_cast<const double*>(bottom.data);
  const uint32_t bits = static_cast<uint32_t>(bf16[3 * 8 + 2]) << 16;
  float want;
  std::memcpy(&want, &bits, sizeof(want));
  CHECK(b[2] == static_cast<double>(want));

  // Shapes must still match, and a custom planner does its own resolving.
  StateDict wrong;
  wrong.Set("stat", TensorView::Allocate(DType::kFloat64, {9}));
  CHECK_THROWS_WITH(Load(wrong, uri, cast), Contains("asks for float64[9]"));
  DefaultLoadPlanner planner;
  LoadOptions custom = cast;
  custom.planner = &planner;
  CHECK_THROWS_WITH(Load(dst, uri, custom), Contains("cast_dtypes"));
}

// ---- AsyncOptions

TEST_CASE("option: AsyncOptions::on_complete is called with every save's metrics",
          "[options][async][option:AsyncOptions::on_complete]") {
  std::mutex mu;
  std::vector<SaveMetrics> seen;
  AsyncOptions o;
  o.on_complete = [&](const SaveMetrics& m) {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(m);
  };
  const std::string uri = "mem://" + FreshMem("oncomplete");
  StateDict sd;
  sd.Set("w", RandomTensor(DType::kFloat32, {32, 32}, 9));
  auto saver = LocalSaver(o);
  const Metadata md = saver->Save(sd, uri)->Wait();
  saver->Save(sd, uri);  // over a checkpoint, without overwrite: fails
  CHECK_THROWS_AS(saver->Wait(), CollectiveError);
  saver->Close();
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (seen.size() >= 2) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::lock_guard<std::mutex> lock(mu);
  REQUIRE(seen.size() == 2);
  CHECK(seen[0].succeeded);
  CHECK(seen[0].uri == uri);
  CHECK(seen[0].staged_bytes == 32 * 32 * 4);
  CHECK(seen[0].bytes_written == md.TotalStoredBytes());
  CHECK_FALSE(seen[1].succeeded);
  CHECK_THAT(seen[1].error, Contains("already exists"));
}

namespace {

// A mem:// store whose Create blocks until the gate opens (at most 60 s).
struct Gate {
  std::mutex mu;
  std::condition_variable cv;
  bool open = false;
  bool entered = false;
};
Gate g_gate;

class GatedStore : public ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  std::unique_ptr<WritableObject> Create(const std::string& n) override {
    {
      std::unique_lock<std::mutex> lock(g_gate.mu);
      g_gate.entered = true;
      g_gate.cv.notify_all();
      g_gate.cv.wait_for(lock, std::chrono::seconds(60), [] { return g_gate.open; });
    }
    return ForwardingStore::Create(n);
  }
};

}  // namespace

TEST_CASE("option: AsyncOptions::close_timeout bounds how long destruction waits for a save",
          "[options][async][fault][option:AsyncOptions::close_timeout]") {
  static const bool registered = [] {
    RegisterBackend("optgate", [](const std::string& loc) {
      return std::make_shared<GatedStore>(MakeMemStore("optgate/" + loc));
    });
    return true;
  }();
  (void)registered;
  ClearMemStore("optgate/x");
  {
    std::lock_guard<std::mutex> lock(g_gate.mu);
    g_gate.open = false;
    g_gate.entered = false;
  }
  StateDict sd;
  sd.Set("w", RandomTensor(DType::kFloat32, {16, 16}, 10));
  AsyncOptions o;
  o.close_timeout = std::chrono::milliseconds(200);
  auto saver = LocalSaver(o);
  saver->Save(sd, "optgate://x");
  {
    std::unique_lock<std::mutex> lock(g_gate.mu);
    REQUIRE(g_gate.cv.wait_for(lock, std::chrono::seconds(30), [] { return g_gate.entered; }));
  }
  // The save is stuck in storage: the destructor gives up on it after close_timeout (with the
  // default, ten minutes, it would wait here until the gate's 60 s ran out).
  const auto start = std::chrono::steady_clock::now();
  saver.reset();
  const auto waited = std::chrono::steady_clock::now() - start;
  CHECK(waited >= std::chrono::milliseconds(200));
  CHECK(waited < std::chrono::seconds(20));
  CHECK_FALSE(MakeMemStore("optgate/x")->Size(kMetadataName));
  // Released, the abandoned save finishes on its own.
  {
    std::lock_guard<std::mutex> lock(g_gate.mu);
    g_gate.open = true;
  }
  g_gate.cv.notify_all();
  for (int i = 0; i < 200 && !MakeMemStore("optgate/x")->Size(kMetadataName); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  CHECK(MakeMemStore("optgate/x")->Size(kMetadataName));
  ClearMemStore("optgate/x");
}

namespace {

// Which threads read a region: its pages are unreadable, and the SIGSEGV handler records the
// faulting thread, then makes the page readable. A thread's first fault waits (bounded) until
// `g_want` distinct threads have faulted, so every thread the copy uses gets to read a piece.
char* g_region = nullptr;
size_t g_region_len = 0;
size_t g_page = 4096;
int g_want = 1;
constexpr int kMaxReaders = 32;
std::atomic<int> g_reader_tids[kMaxReaders];
std::atomic<int> g_readers{0};
std::atomic<int64_t> g_first_fault_ns{0};
int64_t g_wait_ns = 0;
struct sigaction g_previous_segv;

int64_t MonotonicNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

void OnSegv(int, siginfo_t* info, void*) {
  char* at = static_cast<char*>(info->si_addr);
  if (at < g_region || at >= g_region + g_region_len) {
    sigaction(SIGSEGV, &g_previous_segv, nullptr);  // not ours: fault again, as before
    return;
  }
  const int tid = static_cast<int>(syscall(SYS_gettid));
  bool known = false;
  const int n = std::min(g_readers.load(), kMaxReaders);
  for (int i = 0; i < n; ++i) known = known || g_reader_tids[i].load() == tid;
  if (!known) {
    const int slot = g_readers.fetch_add(1);
    if (slot < kMaxReaders) g_reader_tids[slot] = tid;
    int64_t zero = 0;
    g_first_fault_ns.compare_exchange_strong(zero, MonotonicNs());
    while (g_readers.load() < g_want && MonotonicNs() - g_first_fault_ns.load() < g_wait_ns) {
      timespec ms{0, 1000000};
      nanosleep(&ms, nullptr);
    }
  }
  char* page = g_region + static_cast<size_t>(at - g_region) / g_page * g_page;
  mprotect(page, g_page, PROT_READ | PROT_WRITE);
}

}  // namespace

TEST_CASE("option: AsyncOptions::copy_threads is the number of threads copying into staging",
          "[options][option:AsyncOptions::copy_threads]") {
#ifdef DCP_UNDER_SANITIZER
  // The sanitizers own SIGSEGV and check memory before touching it; the main build runs this.
  WARN("skipped under a sanitizer: it observes readers through SIGSEGV on protected pages");
  return;
#endif
  g_page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
  const Shape shape{2048, 1024};  // 8 MiB of float32: 8 pieces for 4 threads, 4 for 1
  const TensorView ref = RandomTensor(DType::kFloat32, shape, 11);
  g_region_len = ref.nbytes();
  void* mem =
      mmap(nullptr, g_region_len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  REQUIRE(mem != MAP_FAILED);
  g_region = static_cast<char*>(mem);
  for (int threads : {1, 4}) {
    DYNAMIC_SECTION("copy_threads " << threads) {
      std::memcpy(g_region, ref.data, g_region_len);
      StateDict sd;
      sd.Set("w", TensorView::FromContiguous(g_region, DType::kFloat32, shape));
      // With one thread, wait 300 ms for a second reader that must not come; with four, wait
      // (up to 20 s) for all of them.
      g_want = threads == 1 ? 2 : threads;
      g_wait_ns = threads == 1 ? 300000000 : 20000000000;
      g_readers = 0;
      g_first_fault_ns = 0;
      for (auto& t : g_reader_tids) t = 0;
      struct sigaction sa {};
      sa.sa_sigaction = OnSegv;
      sa.sa_flags = SA_SIGINFO;
      sigemptyset(&sa.sa_mask);
      REQUIRE(sigaction(SIGSEGV, &sa, &g_previous_segv) == 0);
      REQUIRE(mprotect(g_region, g_region_len, PROT_NONE) == 0);
      const std::string uri = "mem://" + FreshMem("copythreads");
      AsyncOptions o;
      o.copy_threads = threads;
      auto saver = LocalSaver(o);
      saver->Save(sd, uri);  // returns once the snapshot is taken
      mprotect(g_region, g_region_len, PROT_READ | PROT_WRITE);
      sigaction(SIGSEGV, &g_previous_segv, nullptr);
      saver->Wait();
      saver->Close();
      CHECK(g_readers.load() == threads);
      StateDict back = LoadAll(uri);
      CHECK(SameElements(std::get<TensorView>(*back.Find("w")), ref));
    }
  }
  munmap(g_region, g_region_len);
  g_region = nullptr;
}

TEST_CASE("option: AsyncOptions::lock_staging page-locks the staging buffers",
          "[options][option:AsyncOptions::lock_staging]") {
#ifdef DCP_UNDER_SANITIZER
  // AddressSanitizer intercepts mlock as a no-op that reports success: nothing is ever locked.
  WARN("skipped under a sanitizer: its mlock locks nothing");
  return;
#endif
  // 40 MiB: above glibc's largest mmap threshold, so the staging buffer is a mapping of its own
  // (freed pages of the heap may still be locked from an earlier checkpointer).
  const Shape shape{10, 1 << 20};
  const size_t bytes = size_t{40} << 20;
  StateDict sd;
  sd.Set("w", RandomTensor(DType::kFloat32, shape, 12));
  REQUIRE(LockedKiB() >= 0);
  // Whether this process may lock that much (root, or a high RLIMIT_MEMLOCK).
  rlimit lim{};
  if (getrlimit(RLIMIT_MEMLOCK, &lim) == 0 && lim.rlim_cur < lim.rlim_max) {
    lim.rlim_cur = lim.rlim_max;
    setrlimit(RLIMIT_MEMLOCK, &lim);
  }
  bool can_lock = false;
  {
    void* probe = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    REQUIRE(probe != MAP_FAILED);
    can_lock = mlock(probe, bytes) == 0;
    munmap(probe, bytes);
  }
  for (bool lock : {false, true}) {
    DYNAMIC_SECTION("lock_staging " << lock) {
      AsyncOptions o;
      o.lock_staging = lock;
      auto saver = LocalSaver(o);
      const long before = LockedKiB();
      saver->Save(sd, "mem://" + FreshMem("lock"));  // staging is allocated here
      const long locked = LockedKiB() - before;
      saver->Wait();
      INFO("locked " << locked << " KiB more during the save");
      if (!lock) {
        CHECK(locked < static_cast<long>(bytes >> 10) / 2);
      } else if (can_lock) {
        CHECK(locked >= static_cast<long>(bytes >> 10));
      } else {
        WARN("this process cannot lock 40 MiB: lock_staging=true is not checked here");
      }
    }
  }
}

// ---- ManagerOptions

TEST_CASE("option: ManagerOptions::save is what every step's save uses",
          "[options][manager][option:ManagerOptions::save]") {
  const std::string root = "mem://" + FreshMem("mgrsave");
  LocalCommunicator comm;
  ManagerOptions o;
  o.save.storage.files_per_rank = 3;
  o.save.checkpoint_id = "managed";
  StateDict sd;
  for (int i = 0; i < 6; ++i)
    sd.Set("t" + std::to_string(i), RandomTensor(DType::kFloat32, {16, 16}, 20 + i));
  CheckpointManager m(root, comm, nullptr, o);
  for (int64_t step : {1, 2}) {
    m.Save(step, sd);
    CHECK(DataFilesPerRank(*OpenStore(m.PathFor(step))) == std::map<int, int>{{0, 3}});
    CHECK(ReadMetadata(m.PathFor(step)).checkpoint_id == "managed");
  }
  CHECK(m.Close());
}

TEST_CASE("option: ManagerOptions::async configures the manager's background saver",
          "[options][manager][async][option:ManagerOptions::async]") {
  const std::string root = "mem://" + FreshMem("mgrasync");
  LocalCommunicator comm;
  ManagerOptions o;
  std::mutex mu;
  std::vector<std::string> completed;
  o.async.on_complete = [&](const SaveMetrics& m) {
    std::lock_guard<std::mutex> lock(mu);
    completed.push_back(m.uri + (m.succeeded ? "" : " failed"));
  };
  StateDict sd;
  sd.Set("w", RandomTensor(DType::kFloat32, {16, 16}, 30));
  std::vector<std::string> expected;
  {
    CheckpointManager m(root, comm, std::make_unique<LocalCommunicator>(), o);
    for (int64_t step : {1, 2, 3}) {
      m.Save(step, sd);
      expected.push_back(m.PathFor(step));
    }
    CHECK(m.Close());
  }
  for (int i = 0; i < 500; ++i) {
    {
      std::lock_guard<std::mutex> lock(mu);
      if (completed.size() >= 3) break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::lock_guard<std::mutex> lock(mu);
  CHECK(completed == expected);
}
