// Multi-rank save/load over MPI (run at 1, 2 and 4 ranks by CTest).
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <optional>
#include <thread>

#include "dcp/dcp.h"
#include "dcp/storage/backends/fault_store.h"
#include "dcp/storage/backends/file_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "mpi/mpi_support.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {

// Run `fn`; every rank must fail with a CollectiveError whose text is identical on all ranks.
CollectiveError ExpectSameFailureEverywhere(const std::function<void()>& fn) {
  std::string what = "<no error>";
  std::optional<CollectiveError> err;
  try {
    fn();
  } catch (const CollectiveError& e) {
    what = e.what();
    err = e;
  } catch (const std::exception& e) {
    what = std::string("<not a CollectiveError> ") + e.what();
  }
  auto all = Comm().AllGather(what, "test/compare-errors");
  for (int r = 0; r < Comm().size(); ++r) {
    INFO("rank " << r << ": " << all[r]);
    CHECK(all[r] == all[0]);
  }
  REQUIRE(err.has_value());
  return *err;
}

bool Exists(const std::string& path) { return std::filesystem::exists(path); }

size_t CountDataFiles(const std::string& dir) {
  size_t n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    n += IsDataObjectName(e.path().filename());
  return n;
}

// A row-sharded [rows, cols] tensor whose values depend only on the global element position.
struct Sharded {
  TensorView full_expected;  // only the local rows, as expected values
  TensorView local;          // the buffer in the state dict
  ShardedTensor st;
};

Sharded MakeSharded(DType dtype, int64_t rows, int64_t cols, uint64_t seed, bool fill) {
  Sharded s;
  const int r = Comm().rank(), w = Comm().size();
  auto [b, e] = RowRange(rows, r, w);
  TensorView full = RandomTensor(dtype, {rows, cols}, seed);
  s.full_expected = Clone(full.Narrow({b, 0}, {e - b, cols}));
  s.local = fill ? Clone(s.full_expected) : TensorView::Allocate(dtype, {e - b, cols});
  s.st = ShardedTensor{dtype, {rows, cols}, {}};
  if (e > b) s.st.local_shards.push_back({s.local, {b, 0}});
  return s;
}

}  // namespace

TEST_CASE("mpi: every dtype round trips bit-exactly, sharded and replicated", "[mpi]") {
  const std::string dir = SharedDir("dtypes");
  std::vector<Sharded> sharded, sharded_back;
  std::vector<TensorView> replicated, replicated_back;
  StateDict sd, back;
  uint64_t seed = 1;
  for (DType dt : AllDTypes()) {
    const std::string name(DTypeName(dt));
    sharded.push_back(MakeSharded(dt, 3 * Comm().size() + 1, 5, seed, true));
    sharded_back.push_back(MakeSharded(dt, 3 * Comm().size() + 1, 5, seed, false));
    replicated.push_back(RandomTensor(dt, {17}, seed + 1000));
    replicated_back.push_back(TensorView::Allocate(dt, {17}));
    sd.Nested("sharded").Set(name, sharded.back().st);
    back.Nested("sharded").Set(name, sharded_back.back().st);
    sd.Nested("replicated").Set(name, replicated.back());
    back.Nested("replicated").Set(name, replicated_back.back());
    ++seed;
  }
  Metadata md = Save(sd, dir + "/ckpt", Comm()).metadata;
  CHECK(md.world_size == Comm().size());
  CHECK(md.entries.size() == 2 * AllDTypes().size());
  Load(back, dir + "/ckpt", Comm());
  for (size_t i = 0; i < sharded.size(); ++i) {
    INFO(DTypeName(AllDTypes()[i]));
    CHECK(SameElements(sharded_back[i].local, sharded[i].full_expected));
    CHECK(SameElements(replicated_back[i], replicated[i]));
  }
  RemoveSharedDir(dir);
}

TEST_CASE("mpi: empty and 0-d tensors, non-contiguous views, byte blobs", "[mpi]") {
  const std::string dir = SharedDir("shapes");
  const int rank = Comm().rank();
  TensorView scalar = RandomTensor(DType::kInt64, {}, 5);
  TensorView empty = TensorView::Allocate(DType::kFloat32, {0, 4});
  // A transposed view of a [6, 9] buffer: shape [9, 6], strides [1, 9].
  TensorView base = RandomTensor(DType::kFloat16, {6, 9}, 6);
  TensorView transposed = base;
  transposed.shape = {9, 6};
  transposed.strides = {1, 9};
  // A strided slice: every other column of a [8, 10] buffer.
  TensorView wide = RandomTensor(DType::kFloat64, {8, 10}, 7);
  TensorView every_other = wide;
  every_other.shape = {8, 5};
  every_other.strides = {10, 2};
  StateDict sd;
  sd.Set("scalar", scalar)
      .Set("empty", empty)
      .Set("transposed", transposed)
      .Set("strided", every_other);
  sd.Set("shared_config", Blob{"lr=0.1"});
  sd.Set("rank_state_" + std::to_string(rank),
         Blob{std::string(100 + rank, static_cast<char>('a' + rank))});
  sd.Set("empty_blob", Blob{});
  Save(sd, dir + "/ckpt", Comm());

  // Load, including into a non-contiguous destination.
  TensorView scalar_b = TensorView::Allocate(DType::kInt64, {});
  TensorView empty_b = TensorView::Allocate(DType::kFloat32, {0, 4});
  TensorView base_b = TensorView::Allocate(DType::kFloat16, {6, 9});
  TensorView transposed_b = base_b;
  transposed_b.shape = {9, 6};
  transposed_b.strides = {1, 9};
  TensorView strided_b = TensorView::Allocate(DType::kFloat64, {8, 5});
  StateDict back;
  back.Set("scalar", scalar_b)
      .Set("empty", empty_b)
      .Set("transposed", transposed_b)
      .Set("strided", strided_b);
  back.Set("shared_config", Blob{})
      .Set("rank_state_" + std::to_string(rank), Blob{})
      .Set("empty_blob", Blob{"x"});
  Load(back, dir + "/ckpt", Comm());
  CHECK(SameElements(scalar_b, scalar));
  CHECK(SameElements(transposed_b, transposed));
  CHECK(SameElements(base_b, base));
  CHECK(SameElements(strided_b, every_other));
  CHECK(std::get<Blob>(*back.Find("shared_config")).bytes == "lr=0.1");
  CHECK(std::get<Blob>(*back.Find("rank_state_" + std::to_string(rank))).bytes ==
        std::string(100 + rank, static_cast<char>('a' + rank)));
  CHECK(std::get<Blob>(*back.Find("empty_blob")).bytes.empty());
  RemoveSharedDir(dir);
}

TEST_CASE("mpi: more than 2 GiB in total, with a chunk above 2 GiB at one rank", "[mpi][large]") {
  const std::string dir = SharedDir("large");
  // 2.25 GiB of float32 split by rows; at one rank the single chunk is 2.25 GiB.
  const int64_t cols = 1 << 20, rows = 576;  // 576 * 4 MiB
  const int r = Comm().rank(), w = Comm().size();
  auto [b, e] = RowRange(rows, r, w);
  TensorView local = TensorView::Allocate(DType::kFloat32, {e - b, cols});
  const size_t row_bytes = cols * 4;
  for (int64_t i = b; i < e; ++i)
    FillRandom(static_cast<char*>(local.data) + (i - b) * row_bytes, row_bytes, i);
  StateDict sd;
  sd.Set("big", ShardedTensor{DType::kFloat32, {rows, cols}, {{local, {b, 0}}}});
  SaveOptions so;
  so.storage.files_per_rank = 2;
  Metadata md = Save(sd, dir + "/ckpt", Comm(), so).metadata;
  CHECK(md.TotalStoredBytes() == static_cast<uint64_t>(rows) * row_bytes);
  CHECK(md.TotalStoredBytes() > (uint64_t{2} << 30));

  // Reload into a different layout: everyone holds half of the columns of its rows... and the
  // whole tensor is checked row by row against the generator.
  std::memset(local.data, 0, local.nbytes());
  Load(sd, dir + "/ckpt", Comm());
  std::vector<char> expect(row_bytes);
  bool ok = true;
  for (int64_t i = b; i < e && ok; ++i) {
    FillRandom(expect.data(), row_bytes, i);
    ok = std::memcmp(static_cast<char*>(local.data) + (i - b) * row_bytes, expect.data(),
                     row_bytes) == 0;
  }
  CHECK(ok);
  RemoveSharedDir(dir);
}

namespace {

class ThrowingPlanner : public DefaultSavePlanner {
 public:
  explicit ThrowingPlanner(bool fail) : fail_(fail) {}
  SavePlan CreateLocalPlan() override {
    if (fail_) throw InvalidArgumentError("planner refused on purpose");
    return DefaultSavePlanner::CreateLocalPlan();
  }

 private:
  bool fail_;
};

// Writes its data, then reports a storage failure (as a full disk would).
class FailingWriter : public ForwardingWriter {
 public:
  FailingWriter(std::unique_ptr<StorageWriter> inner, bool fail)
      : ForwardingWriter(std::move(inner)), fail_(fail) {}
  std::future<std::vector<WriteResult>> WriteData(const SavePlan& p,
                                                  const SavePlanner& pl) override {
    auto f = inner_->WriteData(p, pl);
    if (!fail_) return f;
    return std::async(std::launch::async, [f = std::move(f)]() mutable -> std::vector<WriteResult> {
      f.get();
      throw IoError("injected: no space left on device", false, 28);
    });
  }

 private:
  bool fail_;
};

StateDict SmallState(std::vector<TensorView>& keep) {
  keep = {RandomTensor(DType::kFloat32, {32, 32}, 1 + Comm().rank()),
          RandomTensor(DType::kInt32, {10}, 99)};
  StateDict sd;
  sd.Set("per_rank_" + std::to_string(Comm().rank()), keep[0]).Set("replicated", keep[1]);
  return sd;
}

}  // namespace

TEST_CASE("mpi: a rank whose planner throws fails every rank alike; no metadata", "[mpi][fault]") {
  const std::string dir = SharedDir("planner-fail");
  const int bad = Comm().size() - 1;
  std::vector<TensorView> keep;
  StateDict sd = SmallState(keep);
  ThrowingPlanner planner(Comm().rank() == bad);
  SaveOptions so;
  so.planner = &planner;
  CollectiveError e = ExpectSameFailureEverywhere([&] { Save(sd, dir + "/ckpt", Comm(), so); });
  CHECK(e.failed_ranks() == std::vector<int>{bad});
  CHECK_THAT(e.what(), Contains("planner refused on purpose") && Contains("save/plan"));
  CHECK_FALSE(Exists(dir + "/ckpt/" + kMetadataName));
  RemoveSharedDir(dir);
}

TEST_CASE("mpi: a rank whose storage fails mid-write fails every rank; its files are removed",
          "[mpi][fault]") {
  const std::string dir = SharedDir("storage-fail");
  const int bad = Comm().size() - 1;
  std::vector<TensorView> keep;
  StateDict sd = SmallState(keep);
  FailingWriter writer(OpenStorageWriter(dir + "/ckpt"), Comm().rank() == bad);
  CollectiveError e = ExpectSameFailureEverywhere([&] { Save(sd, writer, Comm()); });
  CHECK(e.failed_ranks() == std::vector<int>{bad});
  CHECK(e.failures()[0].code == ErrorCode::kIo);
  CHECK_THAT(e.what(), Contains("no space left") && Contains("save/write"));
  Comm().Barrier("test/after-fail");
  CHECK_FALSE(Exists(dir + "/ckpt/" + kMetadataName));
  CHECK(CountDataFiles(dir + "/ckpt") == 0);
  RemoveSharedDir(dir);
}

TEST_CASE("mpi: saving over a checkpoint is refused unless overwrite is asked", "[mpi]") {
  const std::string dir = SharedDir("overwrite");
  std::vector<TensorView> keep;
  StateDict sd = SmallState(keep);
  const Metadata first = Save(sd, dir + "/ckpt", Comm()).metadata;
  CollectiveError e = ExpectSameFailureEverywhere([&] { Save(sd, dir + "/ckpt", Comm()); });
  CHECK(e.failures()[0].code == ErrorCode::kAlreadyExists);
  CHECK(ReadMetadata(dir + "/ckpt").save_id == first.save_id);
  SaveOptions so;
  so.storage.overwrite = true;
  const Metadata second = Save(sd, dir + "/ckpt", Comm(), so).metadata;
  CHECK(second.save_id != first.save_id);
  CHECK(ReadMetadata(dir + "/ckpt").save_id == second.save_id);
  RemoveSharedDir(dir);
}

TEST_CASE("mpi: missing or garbage metadata gives a clear error on every rank", "[mpi][fault]") {
  const std::string dir = SharedDir("bad-metadata");
  std::vector<TensorView> keep;
  StateDict sd = SmallState(keep);
  CollectiveError missing =
      ExpectSameFailureEverywhere([&] { Load(sd, dir + "/nothing", Comm()); });
  CHECK(missing.failures()[0].code == ErrorCode::kNotFound);
  CHECK_THAT(missing.what(), Contains("no checkpoint") && Contains(dir + "/nothing"));

  Save(sd, dir + "/ckpt", Comm());
  Comm().Barrier("test/saved");
  if (Comm().rank() == 0) {
    std::ofstream(dir + "/ckpt/" + kMetadataName, std::ios::trunc) << "garbage, not metadata";
  }
  Comm().Barrier("test/garbled");
  CollectiveError garbage = ExpectSameFailureEverywhere([&] { Load(sd, dir + "/ckpt", Comm()); });
  CHECK(garbage.failures()[0].code == ErrorCode::kCorruption);
  CHECK_THAT(garbage.what(), Contains(kMetadataName) && Contains("not a dcp metadata file"));
  RemoveSharedDir(dir);
}

TEST_CASE("mpi: a stalled rank is reported as timed out on every rank", "[mpi][fault]") {
  if (Comm().size() < 2) return;  // needs a peer to stall
  const std::string dir = SharedDir("stall");
  std::vector<TensorView> keep;
  StateDict sd = SmallState(keep);
  const auto saved = Comm().timeout();
  Comm().set_timeout(std::chrono::milliseconds(500));
  const int bad = Comm().size() - 1;
  class StallingPlanner : public DefaultSavePlanner {
   public:
    explicit StallingPlanner(bool stall) : stall_(stall) {}
    SavePlan CreateLocalPlan() override {
      if (stall_) std::this_thread::sleep_for(std::chrono::seconds(2));
      return DefaultSavePlanner::CreateLocalPlan();
    }
    bool stall_;
  } planner(Comm().rank() == bad);
  SaveOptions so;
  so.planner = &planner;
  std::string what;
  std::vector<int> ranks;
  bool timed_out = false;
  try {
    Save(sd, dir + "/ckpt", Comm(), so);
  } catch (const CollectiveError& e) {
    what = e.what();
    ranks = e.failed_ranks();
    timed_out = e.timed_out();
  }
  Comm().set_timeout(saved);
  // A timeout poisons the communicator (docs/PROTOCOL.md): make a new one, as a job would.
  ResetComm();
  CHECK(ranks == std::vector<int>{bad});
  CHECK(timed_out);
  CHECK_THAT(what, Contains("did not answer"));
  auto all = Comm().AllGather(what, "test/compare");
  for (const auto& w : all) CHECK(w == all[0]);
  CHECK_FALSE(Exists(dir + "/ckpt/" + kMetadataName));
  RemoveSharedDir(dir);
}

TEST_CASE("mpi: a poisoned rank fails the next save on every rank at once, naming it",
          "[mpi][fault]") {
  // After an unknown outcome a peer's communicator is poisoned. Before, rank 0 then waited the
  // whole timeout for it in the next save's first gather; now its poison notice fails the save
  // on every rank at once, with the real cause.
  if (Comm().size() < 2) return;
  const std::string dir = SharedDir("poisoned-peer");
  std::vector<TensorView> keep;
  StateDict sd = SmallState(keep);
  const auto saved = Comm().timeout();
  Comm().set_timeout(std::chrono::seconds(60));
  const int bad = Comm().size() - 1;
  if (Comm().rank() == bad) Comm().Poison("test: the previous save's verdict did not arrive");
  const auto t0 = std::chrono::steady_clock::now();
  std::string what;
  std::vector<int> ranks;
  try {
    Save(sd, dir + "/ckpt", Comm());
  } catch (const CollectiveError& e) {
    what = e.what();
    ranks = e.failed_ranks();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Comm().set_timeout(saved);
  ResetComm();
  INFO("rank " << Comm().rank() << " after " << secs << " s: " << what);
  CHECK(secs < 10);  // not the 60 s timeout
  CHECK_THAT(what, Contains("verdict did not arrive"));
  CHECK(ranks == std::vector<int>{bad});
  CHECK_FALSE(Exists(dir + "/ckpt/" + kMetadataName));
  RemoveSharedDir(dir);
}

TEST_CASE("mpi: a rank loading while the others save fails every rank at once", "[mpi][fault]") {
  if (Comm().size() < 2) return;
  const std::string dir = SharedDir("save-vs-load");
  std::vector<TensorView> keep;
  StateDict sd = SmallState(keep);
  Save(sd, dir + "/ckpt", Comm());
  const auto saved = Comm().timeout();
  Comm().set_timeout(std::chrono::seconds(60));
  const int loader = Comm().size() - 1;
  const auto t0 = std::chrono::steady_clock::now();
  std::string what;
  try {
    if (Comm().rank() == loader) {
      Load(sd, dir + "/ckpt", Comm());
    } else {
      SaveOptions o;
      o.storage.overwrite = true;
      Save(sd, dir + "/ckpt", Comm(), o);
    }
  } catch (const CollectiveError& e) {
    what = e.what();
  }
  const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  Comm().set_timeout(saved);
  ResetComm();
  INFO("rank " << Comm().rank() << " after " << secs << " s: " << what);
  CHECK(secs < 10);
  CHECK_THAT(what, Contains("save/open") && Contains("load/open"));
  RemoveSharedDir(dir);
}

TEST_CASE("mpi: closing an async saver whose peer never joins stops it cleanly before finalize",
          "[mpi][fault]") {
  // Before, Close detached the background thread while it still polled MPI, and MPI_Finalize at
  // exit crashed it (SIGSEGV). Now Close stops the background communicator and joins the thread;
  // this binary finalising MPI and exiting 0 afterwards is part of the check.
  if (Comm().size() < 2) return;
  const std::string dir = SharedDir("async-stall");
  std::vector<TensorView> keep;
  StateDict sd = SmallState(keep);
  {
    auto background = std::make_unique<MpiCommunicator>(MPI_COMM_WORLD);  // collective
    background->set_timeout(std::chrono::minutes(5));
    AsyncCheckpointer saver(std::move(background));
    if (Comm().rank() == 0) {
      saver.Save(sd, dir + "/ckpt");  // the other ranks never join this save
      const auto t0 = std::chrono::steady_clock::now();
      CHECK_THROWS_WITH(saver.Close(std::chrono::milliseconds(200)), Contains("unfinished"));
      CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(5));
    }
    Comm().Barrier("test/async-stall-closed");
  }
  CHECK_FALSE(Exists(dir + "/ckpt/" + kMetadataName));
  RemoveSharedDir(dir);
}

TEST_CASE("mpi: read-once reads replicated entries from storage once, over MPI", "[mpi]") {
  const std::string dir = SharedDir("read-once");
  const int w = Comm().size();
  // Each process counts its own reads through a wrapper around the shared directory.
  auto store = std::make_shared<FaultInjectionStore>(MakeFileStore(dir));
  RegisterFaultScheme("mpireadonce", store);
  constexpr int64_t kRows = 64, kCols = 128;  // 32 KiB per replicated matrix
  auto make = [&](bool fill) {
    std::pair<std::vector<TensorView>, StateDict> s;
    for (int i = 0; i < 4; ++i) {
      TensorView t = fill ? RandomTensor(DType::kFloat32, {kRows, kCols}, 300 + i)
                          : TensorView::Allocate(DType::kFloat32, {kRows, kCols});
      s.first.push_back(t);
      s.second.Set("model.layer" + std::to_string(i), t);
    }
    s.second.Set("vocab", Blob{fill ? std::string(3000, 'v') : std::string()});
    return s;
  };
  auto saved = make(true);
  // Version 1: the byte counts below are of items only (version 2 adds the indexes of the data
  // files each rank reads from).
  SaveOptions v1;
  v1.storage.metadata_version = 1;
  Save(saved.second, "mpireadonce://x", Comm(), v1);
  const uint64_t replicated = 4 * kRows * kCols * 4 + 3000;
  uint64_t total[2] = {0, 0};
  for (bool read_once : {false, true}) {
    auto loaded = make(false);
    store->Reset();
    LoadOptions lo;
    lo.read_once = read_once;
    const LoadStats stats = Load(loaded.second, "mpireadonce://x", Comm(), lo).stats;
    for (int i = 0; i < 4; ++i) CHECK(SameElements(loaded.first[i], saved.first[i]));
    CHECK(std::get<Blob>(*loaded.second.Find("vocab")).bytes == std::string(3000, 'v'));
    for (const auto& b : Comm().AllGather(std::to_string(store->BytesRead()), "test/bytes"))
      total[read_once] += std::stoull(b);
    if (read_once && w > 1) CHECK(stats.shared_batches > 0);
    // Planned on every rank alone: one round, a summary of the request (a flag, a byte count,
    // no bitmap: every rank reads all 5 whole-value entries), not a plan.
    CHECK(stats.rank_local_plan);
    CHECK(stats.plan_rounds == 1);
    CHECK(stats.plan_bytes_sent == 10);
  }
  if (Comm().rank() == 0) {
    std::printf("read-once at %d ranks: %llu bytes read from storage without, %llu with\n", w,
                static_cast<unsigned long long>(total[0]),
                static_cast<unsigned long long>(total[1]));
  }
  CHECK(total[0] - total[1] == static_cast<uint64_t>(w - 1) * replicated);
  RemoveSharedDir(dir);
}

TEST_CASE("mpi: a rows-to-columns reshard reads each stored byte once (cooperative reads)",
          "[mpi][coop][rule-exchange]") {
  const int w = Comm().size(), me = Comm().rank();
  const Shape shape{512, 1024};  // rows of 4 KiB, 2 MiB
  const TensorView full = RandomTensor(DType::kFloat32, shape, 77);
  auto [rb, re] = RowRange(shape[0], me, w);
  // Version 2 stores the rows by a rule: the columns are exchanged by rule, with no request.
  // Version 1 lists the chunks: owners scatter them piece by piece.
  for (uint32_t version : {2u, 1u}) {
    const std::string dir = SharedDir("coop" + std::to_string(version));
    auto store = std::make_shared<FaultInjectionStore>(MakeFileStore(dir));
    RegisterFaultScheme("mpicoop", store);
    StateDict saved;
    saved.Set("w", ShardedTensor{DType::kFloat32,
                                 shape,
                                 {{Clone(full.Narrow({rb, 0}, {re - rb, shape[1]})), {rb, 0}}}});
    SaveOptions so;
    so.storage.metadata_version = version;
    Save(saved, "mpicoop://x", Comm(), so);
    auto load = [&](bool columns) {
      const size_t d = columns ? 1 : 0;
      auto [b, e] = RowRange(shape[d], me, w);
      Shape off{0, 0}, len = shape;
      off[d] = b;
      len[d] = e - b;
      TensorView part = TensorView::Allocate(DType::kFloat32, len);
      StateDict sd;
      sd.Set("w", ShardedTensor{DType::kFloat32, shape, {{part, off}}});
      store->Reset();
      const LoadStats stats = Load(sd, "mpicoop://x", Comm()).stats;
      CHECK(SameElements(part, full.Narrow(off, len)));
      uint64_t total = 0;
      for (const auto& n : Comm().AllGather(std::to_string(store->BytesRead()), "test/bytes"))
        total += std::stoull(n);
      return std::make_pair(total, stats);
    };
    const auto [same, same_stats] = load(false);
    const auto [cols, cols_stats] = load(true);
    if (me == 0) {
      std::printf("version %u reshard at %d ranks: %llu bytes read (same layout: %llu)\n", version,
                  w, static_cast<unsigned long long>(cols), static_cast<unsigned long long>(same));
    }
    CHECK(same_stats.coop_rounds + same_stats.rule_rounds == 0);
    CHECK(cols <= same + full.nbytes() / 20);
    const uint64_t rounds = version == 2 ? cols_stats.rule_rounds : cols_stats.coop_rounds;
    const uint64_t sent = version == 2 ? cols_stats.rule_bytes_sent : cols_stats.coop_bytes_sent;
    if (w > 1) CHECK(rounds > 0);
    if (w > 1 && 512 % w == 0) {
      // Each owner keeps its own columns of its chunk and sends the rest.
      CHECK(sent == full.nbytes() / w * (w - 1) / w);
    }
    RemoveSharedDir(dir);
  }
}

// MpiCommunicator::ExchangeBytes sends each piece straight from the caller's buffer: every rank
// sends every other rank (itself included) a small piece, an empty one and an 8 MiB one (past
// MPI's eager limit, so the transfer needs both sides polling), and checks what it got.
TEST_CASE("mpi: bulk exchange between every pair of ranks, pieces in order", "[mpi]") {
  const int me = Comm().rank(), n = Comm().size();
  std::vector<std::string> small(n), big(n);
  std::vector<Communicator::BulkSend> sends;
  for (int d = 0; d < n; ++d) {
    small[d] = std::to_string(me) + "->" + std::to_string(d);
    big[d] = std::string(8 << 20, static_cast<char>('a' + (me * 7 + d) % 26));
    sends.push_back({d, small[d].data(), small[d].size()});
    sends.push_back({d, nullptr, 0});
    sends.push_back({d, big[d].data(), big[d].size()});
  }
  std::vector<std::string> got_small(n), got_big(n);
  std::vector<Communicator::BulkReceive> receives;
  for (int s = 0; s < n; ++s) {
    got_small[s].assign((std::to_string(s) + "->" + std::to_string(me)).size(), '?');
    got_big[s].assign(8 << 20, '?');
    receives.push_back({s, got_small[s].data(), got_small[s].size()});
    receives.push_back({s, nullptr, 0});
    receives.push_back({s, got_big[s].data(), got_big[s].size()});
  }
  Comm().ExchangeBytes(sends, receives, "test/bulk");
  for (int s = 0; s < n; ++s) {
    CHECK(got_small[s] == std::to_string(s) + "->" + std::to_string(me));
    CHECK(got_big[s] == std::string(8 << 20, static_cast<char>('a' + (s * 7 + me) % 26)));
  }
}
