// Device tensors in the core (proto/device/device.h), exercised through a fake device that keeps
// device memory behind poisoned addresses and runs copies asynchronously (support/fake_device.h),
// so these run on machines without a GPU. The real CUDA backend is tested in tests/gpu.
// Tagged [device]; CI also runs them under ThreadSanitizer.
#include "dcp/proto/device/device.h"

#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>

#include "dcp/storage/backends/mem_store.h"
#include "support/fake_device.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {

// A column-major (transposed) view of a fresh tensor of `shape`.
TensorView Transposed(const TensorView& base) {
  TensorView t = base;
  t.shape = {base.shape[1], base.shape[0]};
  t.strides = {1, base.shape[1]};
  return t;
}

// The row-major bytes of a host view.
std::vector<char> Bytes(const TensorView& v) {
  TensorView c = Clone(v);
  const char* p = static_cast<const char*>(c.data);
  return std::vector<char>(p, p + c.nbytes());
}

// XOR `mask` into the byte at `offset` of the (single) data file of the checkpoint at `ckpt`.
void FlipByteOfDataFile(const std::string& ckpt, long offset, int mask) {
  std::string data;
  for (const auto& e : std::filesystem::directory_iterator(ckpt)) {
    if (e.path().extension() == ".data") data = e.path();
  }
  REQUIRE(!data.empty());
  std::FILE* f = std::fopen(data.c_str(), "r+b");
  REQUIRE(f);
  std::fseek(f, offset, SEEK_SET);
  const int c = std::fgetc(f);
  std::fseek(f, offset, SEEK_SET);
  std::fputc(c ^ mask, f);
  std::fclose(f);
}

}  // namespace

TEST_CASE("device: SplitRowMajor pieces are bounded and concatenate to row-major order",
          "[device]") {
  const TensorView base = RandomTensor(DType::kFloat32, {37, 53}, 1);
  std::vector<TensorView> views = {
      base, Transposed(base), base.Narrow({3, 5}, {20, 40}),  // strided rows
      TensorView::Allocate(DType::kInt8, {}), RandomTensor(DType::kInt16, {2, 3, 1000}, 2)};
  // A 3-D view whose single row exceeds the piece size, strided: forces splitting inside rows.
  TensorView big = RandomTensor(DType::kFloat64, {4, 6, 300}, 3);
  views.push_back(big.Narrow({1, 0, 7}, {3, 6, 290}));
  for (size_t max :
       {size_t{1}, size_t{7}, size_t{64}, size_t{1000}, size_t{4096}, size_t{1} << 20}) {
    for (const auto& v : views) {
      std::vector<char> joined;
      for (const TensorView& piece : SplitRowMajor(v, max)) {
        CHECK((piece.nbytes() <= std::max(max, ElementSize(v.dtype))));
        const auto b = Bytes(piece);
        joined.insert(joined.end(), b.begin(), b.end());
      }
      REQUIRE(joined == Bytes(v));
    }
  }
}

TEST_CASE("device: CopyTensor between host and device with any strides", "[device]") {
  ScopedFakeDevice dev;
  for (DType dtype :
       {DType::kUInt8, DType::kBFloat16, DType::kFloat32, DType::kFloat64, DType::kComplex128}) {
    const TensorView host = RandomTensor(dtype, {19, 23}, 7);
    // contiguous up and down
    TensorView d = dev->Upload(host);
    CHECK(SameElements(dev->Download(d), host));
    // strided host source into a contiguous device tensor, and back into a strided host view
    TensorView t = Transposed(host);
    TensorView dt = dev->Empty(dtype, t.shape);
    CopyTensor(dt, t);
    CHECK(SameElements(dev->Download(dt), t));
    TensorView back_base = TensorView::Allocate(dtype, {19, 23});
    TensorView back = Transposed(back_base);
    CopyTensor(back, dt);
    CHECK(SameElements(back, t));
    // a strided device view (a sub-box of a device tensor) to host
    TensorView sub = d.Narrow({2, 3}, {10, 11});
    CHECK(SameElements(dev->Download(sub), host.Narrow({2, 3}, {10, 11})));
    // device to device, transposed
    TensorView dd = dev->Empty(dtype, t.shape);
    CopyTensor(dd, Transposed(d));
    CHECK(SameElements(dev->Download(dd), t));
  }
  // A broadcast (stride 0) host source.
  TensorView one = RandomTensor(DType::kInt32, {1, 5}, 9);
  TensorView bcast = one;
  bcast.shape = {4, 5};
  bcast.strides = {0, 1};
  TensorView d = dev->Empty(DType::kInt32, {4, 5});
  CopyTensor(d, bcast);
  CHECK(SameElements(dev->Download(d), Clone(bcast)));
  // A scalar.
  TensorView s = RandomTensor(DType::kFloat32, {}, 4);
  CHECK(SameElements(dev->Download(dev->Upload(s)), s));
}

TEST_CASE("device: save from and load into device tensors, whole and resharded", "[device]") {
  ScopedFakeDevice dev;
  TempDir dir("dev");
  for (std::string uri : {dir / "ckpt", std::string("mem://device-roundtrip")}) {
    INFO(uri);
    // 2 ranks. "big" spans several 16 MiB pieces; "cols" is sharded by columns (strided
    // destination boxes on load); "t" is a transposed device view; "host" stays on the host.
    const TensorView big = RandomTensor(DType::kFloat32, {9, 1 << 20}, 11);  // 36 MiB
    const TensorView cols = RandomTensor(DType::kBFloat16, {64, 96}, 12);
    const TensorView tbase = RandomTensor(DType::kInt64, {33, 17}, 13);
    const TensorView host = RandomTensor(DType::kFloat64, {5}, 14);
    const uint64_t pinned_before = PinnedBytesAllocated();
    RequireNoErrors(RunRanks(2, [&](int rank, Communicator& comm) {
      StateDict sd;
      sd.Set("big", dev->Upload(big));
      ShardedTensor st{DType::kBFloat16, cols.shape, {}};
      auto [c0, c1] = RowRange(96, rank, 2);
      st.local_shards.push_back({dev->Upload(cols.Narrow({0, c0}, {64, c1 - c0})), {0, c0}});
      sd.Set("cols", st);
      sd.Set("t", Transposed(dev->Upload(tbase)));
      sd.Set("host", host);
      SaveOptions o;
      o.storage.overwrite = true;
      Save(sd, uri, comm, o);
    }));
    // The pipeline stages through at most two pinned pieces per writer, whatever the size.
    const uint64_t pinned = PinnedBytesAllocated() - pinned_before;
    CHECK(pinned <= 2 * 2 * kDevicePieceBytes);
    // A second save allocates no pinned memory: the pool is reused.
    RequireNoErrors(RunRanks(1, [&](int, Communicator& comm) {
      StateDict sd;
      sd.Set("big", dev->Upload(big));
      SaveOptions o;
      o.storage.overwrite = true;
      Save(sd, uri + "-again", comm, o);
    }));
    CHECK(PinnedBytesAllocated() - pinned_before == pinned);

    // Load at 3 ranks into device tensors: "big" by rows (whole chunks are partial here),
    // "cols" into row shards of a device tensor, "t" into a device tensor, "host" onto a device.
    RequireNoErrors(RunRanks(3, [&](int rank, Communicator& comm) {
      StateDict sd;
      auto [r0, r1] = RowRange(9, rank, 3);
      ShardedTensor bs{DType::kFloat32, big.shape, {}};
      bs.local_shards.push_back({dev->Empty(DType::kFloat32, {r1 - r0, 1 << 20}), {r0, 0}});
      sd.Set("big", bs);
      auto [q0, q1] = RowRange(64, rank, 3);
      ShardedTensor cs{DType::kBFloat16, cols.shape, {}};
      cs.local_shards.push_back({dev->Empty(DType::kBFloat16, {q1 - q0, 96}), {q0, 0}});
      sd.Set("cols", cs);
      sd.Set("t", dev->Empty(DType::kInt64, {17, 33}));
      sd.Set("host", dev->Empty(DType::kFloat64, {5}));
      Load(sd, uri, comm);
      const auto* b = std::get_if<ShardedTensor>(sd.Find("big"));
      Expect(SameElements(dev->Download(b->local_shards[0].view),
                          big.Narrow({r0, 0}, {r1 - r0, 1 << 20})),
             "big rows");
      const auto* c = std::get_if<ShardedTensor>(sd.Find("cols"));
      Expect(
          SameElements(dev->Download(c->local_shards[0].view), cols.Narrow({q0, 0}, {q1 - q0, 96})),
          "cols rows");
      Expect(SameElements(dev->Download(std::get<TensorView>(*sd.Find("t"))), Transposed(tbase)),
             "transposed");
      Expect(SameElements(dev->Download(std::get<TensorView>(*sd.Find("host"))), host), "host");
    }));
    // And the device-saved checkpoint loads into plain host tensors.
    StateDict sd;
    TensorView big_host = TensorView::Allocate(DType::kFloat32, big.shape);
    sd.Set("big", big_host);
    LocalCommunicator local;
    LoadOptions lo;
    lo.allow_partial_load = true;
    Load(sd, uri, local, lo);
    CHECK(SameElements(big_host, big));
    CHECK(dev->d2h_bytes_ > 0);
    CHECK(dev->h2d_bytes_ > 0);
  }
}

TEST_CASE("device: a corrupted byte is reported when loading into a device tensor", "[device]") {
  ScopedFakeDevice dev;
  TempDir dir("devc");
  const TensorView w = RandomTensor(DType::kFloat32, {3, 1 << 20}, 21);  // 12 MiB: one piece
  LocalCommunicator comm;
  StateDict sd;
  sd.Set("layer.w", dev->Upload(w));
  Save(sd, dir / "c", comm);
  FlipByteOfDataFile(dir / "c", 5 << 20, 0x10);
  StateDict into;
  into.Set("layer.w", dev->Empty(DType::kFloat32, w.shape));
  const std::string msg = MessageOf<CollectiveError>([&] { Load(into, dir / "c", comm); });
  CHECK_THAT(msg, Contains("checksum mismatch") && Contains("layer.w") && Contains(".data"));
}

TEST_CASE("device: a failing device copy fails the save on every rank, nothing committed",
          "[device]") {
  ScopedFakeDevice dev;
  const TensorView w = RandomTensor(DType::kFloat32, {6, 1 << 20}, 31);  // 2 pieces
  const std::string uri = "mem://device-fail";
  auto errors = RunRanks(2, [&](int, Communicator& comm) {
    StateDict sd;
    sd.Set("w", dev->Upload(w));  // replicated: one rank writes it
    if (comm.rank() == 0) dev->FailCopy(2);
    comm.Barrier("armed");
    Save(sd, uri, comm);
  });
  for (const auto& e : errors) {
    REQUIRE(e);
    try {
      std::rethrow_exception(e);
    } catch (const CollectiveError& ce) {
      CHECK_THAT(ce.what(), Contains("injected failure"));
      REQUIRE(!ce.failures().empty());
      CHECK(ce.failures()[0].code == ErrorCode::kDevice);
    }
  }
  CHECK_FALSE(MakeMemStore("device-fail")->Size("metadata.dcp"));
}

TEST_CASE("device: a device tensor without a usable backend is refused by name", "[device]") {
  // Override with a backend that has no devices (a CUDA build on a machine without a GPU
  // behaves like this; a build without CUDA has no backend at all: both refuse).
  ScopedFakeDevice dev(/*devices=*/0);
  TensorView v;
  v.dtype = DType::kFloat32;
  v.shape = {4};
  v.data = reinterpret_cast<void*>(uintptr_t{1} << 62);
  v.device = Device{Device::Type::kCUDA, 0};
  StateDict sd;
  sd.Set("encoder.weight", v);
  LocalCommunicator comm;
  const std::string msg = MessageOf<CollectiveError>([&] { Save(sd, "mem://device-none", comm); });
  CHECK_THAT(msg, Contains("encoder.weight") && Contains("cuda:0"));
  // A device index beyond what the backend has is refused the same way.
  ScopedFakeDevice two(2);
  v.device.index = 5;
  sd.Set("encoder.weight", v);
  CHECK_THAT(MessageOf<CollectiveError>([&] { Save(sd, "mem://device-none2", comm); }),
             Contains("encoder.weight") && Contains("cuda:5"));
}

TEST_CASE("device: async save blocks only for the device snapshot", "[device][async]") {
  ScopedFakeDevice dev;
  const Shape ws{4, 300000};
  // Values the state holds at save s are w_vals[s], h_vals[s]; right after Save() returns the
  // training loop overwrites them with the next values.
  const std::vector<TensorView> w_vals = {RandomTensor(DType::kFloat32, ws, 41),
                                          RandomTensor(DType::kFloat32, ws, 42),
                                          RandomTensor(DType::kFloat32, ws, 43)};
  const std::vector<TensorView> h_vals = {RandomTensor(DType::kInt32, {1000}, 44),
                                          RandomTensor(DType::kInt32, {1000}, 45),
                                          RandomTensor(DType::kInt32, {1000}, 46)};
  TensorView w = dev->Upload(w_vals[0]);
  TensorView h = Clone(h_vals[0]);
  StateDict sd;
  sd.Set("w", w);
  sd.Set("h", h);
  AsyncCheckpointer ckpt(std::make_unique<LocalCommunicator>());
  for (int step = 0; step < 2; ++step) {
    const std::string uri = "mem://device-async-" + std::to_string(step);
    std::shared_ptr<AsyncSave> save = ckpt.Save(sd, uri);
    CopyTensor(w, w_vals[step + 1]);
    CopyTensor(h, h_vals[step + 1]);
    save->Wait();
    const SaveMetrics m = save->metrics();
    CHECK(m.device_bytes == w.nbytes());
    if (step == 1) CHECK(m.staging_allocations == 0);
    StateDict back;
    TensorView wl = dev->Empty(DType::kFloat32, ws);
    TensorView hl = TensorView::Allocate(DType::kInt32, {1000});
    back.Set("w", wl);
    back.Set("h", hl);
    LocalCommunicator comm;
    Load(back, uri, comm);
    CHECK(SameElements(dev->Download(wl), w_vals[step]));
    CHECK(SameElements(hl, h_vals[step]));
  }
  ckpt.Close();
  CHECK(dev->registered_ >= 1);  // staging was page-locked with the device runtime
}

TEST_CASE("device: the built-in backend on this machine refuses device tensors cleanly",
          "[device]") {
  // No override installed: a CUDA build uses the real CUDA runtime (on a machine without a
  // driver it finds 0 devices, it must not crash); a build without CUDA has no backend.
  auto cuda = FindDeviceBackend(Device::Type::kCUDA);
  CHECK((cuda != nullptr) == BuiltWithCuda());
  if (cuda && cuda->device_count() > 0) return;  // a GPU machine: tests/gpu covers it
  TensorView v;
  v.dtype = DType::kFloat16;
  v.shape = {8};
  v.data = reinterpret_cast<void*>(uintptr_t{1} << 62);
  v.device = Device{Device::Type::kCUDA, 0};
  StateDict sd;
  sd.Set("lm_head.weight", v);
  LocalCommunicator comm;
  const std::string msg = MessageOf<CollectiveError>([&] { Save(sd, "mem://device-real", comm); });
  CHECK_THAT(msg, Contains("lm_head.weight") && Contains("cuda:0"));
  if (cuda) {
    CHECK_THAT(msg, Contains(cuda->unavailable_reason()));
  } else {
    CHECK_THAT(msg, Contains("no cuda support"));
  }
}

TEST_CASE("device: compressed items save from and load into device tensors", "[device]") {
  ScopedFakeDevice dev;
  TensorView host = TensorView::Allocate(DType::kInt32, {1000, 3000});  // 12 MiB, compressible
  for (int64_t i = 0; i < host.numel(); ++i) static_cast<int32_t*>(host.data)[i] = (i / 5) % 7;
  StateDict sd;
  sd.Set("w", dev->Upload(host));
  LocalCommunicator comm;
  SaveOptions o;
  o.storage.compression = Compression::kZstd;
  Metadata md = Save(sd, "mem://device-zstd", comm, o).metadata;
  ReadStoredItems("mem://device-zstd", md);
  bool compressed = false;
  for (const auto& [index, info] : md.storage) compressed |= !info.transforms.empty();
  CHECK(compressed);
  // Whole into a device tensor, and a box of it (resharded) into another.
  StateDict back;
  TensorView whole = dev->Empty(DType::kInt32, host.shape);
  back.Set("w", whole);
  Load(back, "mem://device-zstd", comm);
  CHECK(SameElements(dev->Download(whole), host));
  ShardedTensor part{DType::kInt32, host.shape, {}};
  part.local_shards.push_back({dev->Empty(DType::kInt32, {300, 3000}), {600, 0}});
  StateDict back2;
  back2.Set("w", part);
  LoadOptions lo;
  Load(back2, "mem://device-zstd", comm, lo);
  CHECK(SameElements(dev->Download(std::get<ShardedTensor>(*back2.Find("w")).local_shards[0].view),
                     host.Narrow({600, 0}, {300, 3000})));
}

TEST_CASE("device: one read thread overlaps a piece's copy to the device with the next read",
          "[device]") {
  ScopedFakeDevice dev;
  TempDir dir("devoverlap");
  // 56 MiB: four device pieces (16 MiB each), all read by one thread through its two pinned
  // pieces. Each copy takes 150 ms, far longer than reading 16 MiB from the page cache, so a
  // reader that waited for each copy before the next read never has two copies in flight.
  const TensorView w = RandomTensor(DType::kFloat32, {14, 1 << 20}, 41);
  LocalCommunicator comm;
  StateDict sd;
  sd.Set("layer.w", w);
  Save(sd, dir / "c", comm);
  dev->copy_delay_ms_ = 150;
  StateDict into;
  into.Set("layer.w", dev->Empty(DType::kFloat32, w.shape));
  LoadOptions lo;
  lo.storage.read_threads = 1;
  Load(into, dir / "c", comm, lo);
  dev->copy_delay_ms_ = 0;
  CHECK(dev->max_copies_in_flight_ == 2);  // double-buffered, never more
  CHECK(dev->copies_in_flight_ == 0);
  CHECK(SameElements(dev->Download(std::get<TensorView>(*into.Find("layer.w"))), w));

  SECTION("a copy that fails on the device fails the load, naming the device") {
    dev->copy_delay_ms_ = 50;
    dev->FailCopy(2);  // the second piece's copy, found while the third piece is read
    StateDict again;
    again.Set("layer.w", dev->Empty(DType::kFloat32, w.shape));
    const std::string msg = MessageOf<CollectiveError>([&] { Load(again, dir / "c", comm, lo); });
    dev->copy_delay_ms_ = 0;
    CHECK_THAT(msg, Contains("injected failure") && Contains("cuda:0"));
    CHECK(dev->copies_in_flight_ == 0);  // nothing left copying out of a pooled pinned buffer
  }
  SECTION("a flipped byte in the last piece is found after its copy, and named") {
    FlipByteOfDataFile(dir / "c", 50 << 20, 0x04);
    StateDict again;
    again.Set("layer.w", dev->Empty(DType::kFloat32, w.shape));
    const std::string msg = MessageOf<CollectiveError>([&] { Load(again, dir / "c", comm, lo); });
    CHECK_THAT(msg, Contains("checksum mismatch") && Contains("layer.w"));
  }
}

TEST_CASE("device: a large item loads into a device tensor in pieces on every read thread",
          "[device]") {
  ScopedFakeDevice dev;
  TempDir dir("devsplit");
  // 40 MiB: three device pieces, read by the two read threads through their pinned pieces.
  const TensorView w = RandomTensor(DType::kFloat32, {10, 1 << 20}, 31);
  LocalCommunicator comm;
  StateDict sd;
  sd.Set("layer.w", w);
  Save(sd, dir / "c", comm);
  {
    StateDict into;
    into.Set("layer.w", dev->Empty(DType::kFloat32, w.shape));
    const uint64_t h2d_before = dev->h2d_bytes_;
    LoadOptions lo;
    lo.storage.read_threads = 2;
    Load(into, dir / "c", comm, lo);
    CHECK(SameElements(dev->Download(std::get<TensorView>(*into.Find("layer.w"))), w));
    CHECK(dev->h2d_bytes_ - h2d_before == w.nbytes());
  }
  // A flipped byte in the last piece is found and named.
  FlipByteOfDataFile(dir / "c", 37 << 20, 0x01);
  StateDict into;
  into.Set("layer.w", dev->Empty(DType::kFloat32, w.shape));
  const std::string msg = MessageOf<CollectiveError>([&] { Load(into, dir / "c", comm); });
  CHECK_THAT(msg, Contains("checksum mismatch") && Contains("layer.w"));
}
