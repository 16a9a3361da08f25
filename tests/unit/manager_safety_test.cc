// Nothing committed is ever lost by the manager (issue 21): retention removes only steps that are
// provably not checkpoints, steps increase across restarts, Restore falls back to the newest step
// that loads, ranks that disagree about a step fail instead of pairing, and a manager goes on
// with fresh communicators after a poisoned one.
#include <atomic>
#include <catch2/catch.hpp>
#include <mutex>
#include <random>
#include <set>

#include "dcp/dcp.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/backends/file_store.h"
#include "dcp/storage/backends/mem_store.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/store.h"
#include "dcp/storage/registry.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {

// Faults of the "chaos" scheme (a mem:// store per location underneath): reads, sizes, listings
// and removals fail with EIO, either at random (probability per operation) or for the next n
// operations on objects whose path contains a given text.
struct Chaos {
  std::mutex mu;
  std::mt19937_64 rng{1};
  double p_read = 0, p_size = 0, p_list = 0, p_remove = 0, p_create = 0;
  std::string target;  // fail_next_reads applies to paths containing this
  int fail_next_reads = 0;
  int injected = 0;

  void Reset(uint64_t seed) {
    std::lock_guard<std::mutex> lock(mu);
    rng.seed(seed);
    p_read = p_size = p_list = p_remove = p_create = 0;
    target.clear();
    fail_next_reads = injected = 0;
  }
  void Maybe(double Chaos::*p, const std::string& what, bool is_read = false) {
    std::lock_guard<std::mutex> lock(mu);
    bool fail = false;
    if (is_read && fail_next_reads > 0 && !target.empty() &&
        what.find(target) != std::string::npos) {
      --fail_next_reads;
      fail = true;
    } else if (this->*p > 0) {
      fail = std::uniform_real_distribution<double>(0, 1)(rng) < this->*p;
    }
    if (fail) {
      ++injected;
      throw IoError("injected EIO on " + what, /*retryable=*/true, EIO);
    }
  }
};
Chaos g_chaos;

class ChaosReadable : public ForwardingReadableObject {
 public:
  ChaosReadable(std::unique_ptr<ReadableObject> inner, std::string path)
      : ForwardingReadableObject(std::move(inner)), path_(std::move(path)) {}
  void ReadAt(uint64_t offset, void* dst, size_t n) override {
    g_chaos.Maybe(&Chaos::p_read, "read " + path_, true);
    ForwardingReadableObject::ReadAt(offset, dst, n);
  }

 private:
  std::string path_;
};

class ChaosStore : public ForwardingStore {
 public:
  ChaosStore(std::shared_ptr<Store> inner, std::string location)
      : ForwardingStore(std::move(inner)), location_(std::move(location)) {}
  std::string uri() const override { return "chaos://" + location_; }
  std::unique_ptr<WritableObject> Create(const std::string& n) override {
    g_chaos.Maybe(&Chaos::p_create, "create " + Path(n));
    return ForwardingStore::Create(n);
  }
  std::unique_ptr<ReadableObject> Open(const std::string& n) override {
    g_chaos.Maybe(&Chaos::p_read, "open " + Path(n), true);
    return std::make_unique<ChaosReadable>(ForwardingStore::Open(n), Path(n));
  }
  std::optional<uint64_t> Size(const std::string& n) override {
    g_chaos.Maybe(&Chaos::p_size, "size " + Path(n));
    return ForwardingStore::Size(n);
  }
  // A save's existence check asks this (ForwardingStore's contract: it changes Size, so this too).
  std::optional<uint64_t> SizeAndVersion(const std::string& n, std::string* version) override {
    g_chaos.Maybe(&Chaos::p_size, "size " + Path(n));
    return ForwardingStore::SizeAndVersion(n, version);
  }
  std::vector<std::string> List() override {
    g_chaos.Maybe(&Chaos::p_list, "list " + location_);
    return ForwardingStore::List();
  }
  void Remove(const std::string& n) override {
    g_chaos.Maybe(&Chaos::p_remove, "remove " + Path(n));
    ForwardingStore::Remove(n);
  }

 private:
  std::string Path(const std::string& n) const { return location_ + "/" + n; }
  std::string location_;
};

void RegisterChaos() {
  static bool done = [] {
    RegisterBackend("chaos", [](const std::string& location) -> std::shared_ptr<Store> {
      return std::make_shared<ChaosStore>(MakeMemStore("chaos/" + location), location);
    });
    return true;
  }();
  (void)done;
}

// The fault-free view of a location (the mem:// store under chaos://).
std::shared_ptr<Store> Underlying(const std::string& chaos_uri) {
  return MakeMemStore("chaos/" + SplitUri(chaos_uri).second);
}

// Complete steps under a manager's root, read without faults.
std::set<int64_t> TrulyComplete(CheckpointManager& m, const std::vector<int64_t>& candidates) {
  std::set<int64_t> out;
  for (int64_t s : candidates) {
    try {
      Metadata md = DecodeMetadataFile(Underlying(m.PathFor(s))->ReadAll(kMetadataName, UINT64_MAX),
                                       m.PathFor(s));
      (void)md;
      out.insert(s);
    } catch (const Error&) {
    }
  }
  return out;
}

int g_counter = 0;
std::string FreshRoot(const std::string& tag) {
  return "chaos://" + tag + "-" + std::to_string(g_counter++);
}

ErrorCode FirstCode(const std::function<void()>& f) {
  try {
    f();
  } catch (const CollectiveError& e) {
    return e.failures().empty() ? ErrorCode::kInternal : e.failures().front().code;
  } catch (const Error& e) {
    return e.code();
  }
  FailNoException();
}

}  // namespace

TEST_CASE("manager: a transient read error during retention never removes a committed step",
          "[manager]") {
  RegisterChaos();
  g_chaos.Reset(1);
  LocalCommunicator comm;
  ManagerOptions o;
  o.keep_last = 1;
  o.keep_every = 1;  // every step is to be kept
  CheckpointManager m(FreshRoot("eio"), comm, nullptr, o);
  StepState s;
  s.Fill(1);
  m.Save(1, s.sd);
  {
    std::lock_guard<std::mutex> lock(g_chaos.mu);
    g_chaos.target = "step-0000000001/metadata.dcp";
    g_chaos.fail_next_reads = 1;  // one EIO, in the retention pass after step 2
  }
  s.Fill(2);
  m.Save(2, s.sd);
  CHECK(g_chaos.injected == 1);
  // Step 1 is still there, whole, and the pass that could not read it said so.
  CHECK(TrulyComplete(m, {1, 2}) == std::set<int64_t>{1, 2});
  CHECK(m.retention_failures() == 1);
  CHECK_THAT(m.last_retention_error(), Contains("step 1"));
  CHECK_THAT(m.last_retention_error(), Contains("injected EIO"));
  CHECK(m.unreadable_steps() == std::vector<int64_t>{1});
  // Once it reads again it is an ordinary kept step.
  s.Fill(3);
  m.Save(3, s.sd);
  CHECK(m.CompleteSteps() == std::vector<int64_t>{1, 2, 3});
  CHECK(m.unreadable_steps().empty());
  CHECK(m.Close());
}

TEST_CASE("manager: a step written by a newer dcp is kept and reported, never removed",
          "[manager]") {
  RegisterChaos();
  g_chaos.Reset(2);
  LocalCommunicator comm;
  ManagerOptions o;
  o.keep_last = 1;
  CheckpointManager m(FreshRoot("newer"), comm, nullptr, o);
  StepState s;
  for (int64_t step : {1, 2}) {
    s.Fill(step);
    m.Save(step, s.sd);
  }
  // Step 2's metadata as a newer build would write it: a newer format version in its header.
  auto store2 = Underlying(m.PathFor(2));
  std::string bytes = store2->ReadAll(kMetadataName, UINT64_MAX);
  bytes[8] = static_cast<char>(kFormatVersion + 1);
  store2->PublishAtomically(kMetadataName, bytes);
  const auto data_files = store2->List();
  s.Fill(3);
  m.Save(3, s.sd);
  // keep_last = 1 would remove step 2 if it were an old complete step, and the old code took it
  // for a crashed leftover: it stays, whole, and is reported.
  CHECK(store2->ReadAll(kMetadataName, UINT64_MAX) == bytes);
  CHECK(store2->List().size() == data_files.size());
  CHECK(m.unreadable_steps() == std::vector<int64_t>{2});
  CHECK_THAT(m.last_retention_error(), Contains("newer"));
  CHECK(m.retention_failures() >= 1);
  CHECK(m.Close());
}

TEST_CASE("manager: the step 'latest' names stays while 'latest' cannot advance", "[manager]") {
  // 'latest' does not move past a newer step whose metadata cannot be read (it may be a
  // commit); the step it still names must not be removed meanwhile, however many readable
  // steps come after it.
  RegisterChaos();
  g_chaos.Reset(1);
  LocalCommunicator comm;
  ManagerOptions o;
  o.keep_last = 1;
  const std::string root = FreshRoot("latest-stays");
  CheckpointManager m(root, comm, nullptr, o);
  StepState s;
  s.Fill(1);
  m.Save(1, s.sd);
  for (int64_t step : {2, 3}) {
    {
      std::lock_guard<std::mutex> lock(g_chaos.mu);
      g_chaos.target = "step-000000000" + std::to_string(step) + "/metadata.dcp";
      g_chaos.fail_next_reads = 1000;  // unreadable for its retention pass
    }
    s.Fill(step);
    m.Save(step, s.sd);
  }
  {
    std::lock_guard<std::mutex> lock(g_chaos.mu);
    g_chaos.fail_next_reads = 0;
  }
  // After step 3's pass: complete {1, 2}, unreadable {3}. 'latest' still names 1, so 1 stays
  // (keep_last alone would have kept only 2).
  CHECK(Underlying(root)->ReadAll("latest", UINT64_MAX) == "1\n");
  CHECK(TrulyComplete(m, {1, 2, 3}) == std::set<int64_t>{1, 2, 3});
  // Once step 3 reads again, 'latest' advances and the old steps go.
  s.Fill(4);
  m.Save(4, s.sd);
  CHECK(Underlying(root)->ReadAll("latest", UINT64_MAX) == "4\n");
  CHECK(TrulyComplete(m, {1, 2, 3, 4}) == std::set<int64_t>{4});
  CHECK(m.Close());
}

TEST_CASE(
    "manager: 1000 randomized saves (300 under a sanitizer) with injected read, remove and list "
    "failures never remove a committed step",
    "[manager]") {
#ifdef DCP_UNDER_SANITIZER
  constexpr int kSaves = 300;  // a minute under ASan or TSan otherwise, in each CI stage
#else
  constexpr int kSaves = 1000;
#endif
  RegisterChaos();
  g_chaos.Reset(3);
  std::mt19937_64 rng(20261125);
  LocalCommunicator comm;
  ManagerOptions o;
  o.keep_last = 2;
  o.keep_every = 7;
  const std::string root = FreshRoot("random");
  CheckpointManager m(root, comm, nullptr, o);
  StepState s;
  std::set<int64_t> previous;  // the truly complete steps after the last iteration
  std::vector<int64_t> attempted;
  int failed_saves = 0, injected = 0;
  int64_t step = 0;
  for (int i = 0; i < kSaves; ++i) {
    step += 1 + static_cast<int64_t>(rng() % 3);
    {
      std::lock_guard<std::mutex> lock(g_chaos.mu);
      auto p = [&] { return (rng() % 4 == 0) ? 0.05 * static_cast<double>(rng() % 6) : 0.0; };
      g_chaos.p_read = p();
      g_chaos.p_size = p();
      g_chaos.p_list = p();
      g_chaos.p_remove = p();
      g_chaos.p_create = (rng() % 10 == 0) ? 0.2 : 0.0;
    }
    s.Fill(step);
    attempted.push_back(step);
    try {
      m.Save(step, s.sd);
    } catch (const Error&) {
      ++failed_saves;  // the save itself hit a fault: it is not a checkpoint, or it is one
    }
    {
      std::lock_guard<std::mutex> lock(g_chaos.mu);
      injected = g_chaos.injected;
      g_chaos.p_read = g_chaos.p_size = g_chaos.p_list = g_chaos.p_remove = g_chaos.p_create = 0;
    }
    // Every step that was complete and that the policy keeps is still complete: the newest
    // keep_last of all complete steps ever seen or made, and every multiple of keep_every.
    const std::set<int64_t> now = TrulyComplete(m, attempted);
    std::set<int64_t> all = previous;
    all.insert(now.begin(), now.end());
    std::vector<int64_t> ordered(all.begin(), all.end());
    for (size_t k = 0; k < ordered.size(); ++k) {
      const int64_t t = ordered[k];
      const bool kept_by_policy =
          k + static_cast<size_t>(o.keep_last) >= ordered.size() || t % o.keep_every == 0;
      if (previous.count(t) && kept_by_policy && !now.count(t)) {
        FAIL("iteration " << i << ": committed step " << t << " was removed");
      }
    }
    // "latest" never names a step that is not complete.
    auto latest =
        Underlying(root)->Size("latest") ? Underlying(root)->ReadAll("latest", UINT64_MAX) : "";
    if (!latest.empty()) {
      const int64_t l = std::stoll(latest);
      if (!now.count(l)) FAIL("iteration " << i << ": latest names step " << l);
    }
    previous = now;
    // Steps that are gone for good need not be probed again.
    std::vector<int64_t> still;
    for (int64_t a : attempted) {
      if (Underlying(m.PathFor(a))->List().size() > 0 || now.count(a)) still.push_back(a);
    }
    attempted.swap(still);
  }
  // The run exercised the faults: many injected, and the state still restores.
  CHECK(injected > 200);
  CHECK(failed_saves > 10);
  CHECK(failed_saves < 900);
  INFO("failed saves " << failed_saves << ", injected faults " << injected);
  StepState back;
  const auto restored = m.Restore(back.sd);
  REQUIRE(restored);
  CHECK(back.Holds(*restored));
  CHECK(*restored == *previous.rbegin());
  m.Close();
}

TEST_CASE(
    "manager: steps increase across restarts, and a complete step is replaced only when "
    "asked",
    "[manager][option:ManagerOptions::allow_replacing_steps]") {
  RegisterChaos();
  g_chaos.Reset(4);
  const std::string root = FreshRoot("restart");
  LocalCommunicator comm;
  StepState s;
  {
    CheckpointManager m(root, comm);
    for (int64_t step : {1, 2, 3}) {
      s.Fill(step);
      m.Save(step, s.sd);
    }
    CHECK(m.Close());
  }
  // A restarted job (a new manager) that saves step 3 again, or an older step, is refused on
  // every rank and the complete checkpoints stay as they are.
  CheckpointManager m(root, comm);
  s.Fill(103);
  CHECK(FirstCode([&] { m.Save(3, s.sd); }) == ErrorCode::kAlreadyExists);
  s.Fill(102);
  CHECK(FirstCode([&] { m.Save(2, s.sd); }) == ErrorCode::kInvalidArgument);
  StepState back;
  CHECK(m.Restore(back.sd) == 3);
  CHECK(back.Holds(3));
  dcp::Load(back.sd, m.PathFor(2));
  CHECK(back.Holds(2));
  // A step whose earlier attempt crashed (an index entry and data, no metadata) is written again.
  Underlying(root)->PublishAtomically("step-0000000004.step", m.PathFor(4));
  {
    auto w = Underlying(m.PathFor(4))->Create("data-0000000000000000-r0-b0.data");
    w->Append("torn", 4);
    w->Close();
  }
  s.Fill(4);
  m.Save(4, s.sd);
  CHECK(m.Restore(back.sd) == 4);
  CHECK(back.Holds(4));
  CHECK(m.Close());
  // Asked to, a job replaces a complete step (e.g. one restored from it and saving it again).
  ManagerOptions replace;
  replace.allow_replacing_steps = true;
  CheckpointManager again(root, comm, nullptr, replace);
  s.Fill(1004);
  again.Save(4, s.sd);
  CHECK(again.Restore(back.sd) == 4);
  CHECK(back.Holds(1004));
  s.Fill(103);
  CHECK(FirstCode([&] { again.Save(3, s.sd); }) == ErrorCode::kInvalidArgument);
  CHECK(again.Close());
}

TEST_CASE("manager: Restore falls back to the newest step that loads, and says so", "[manager]") {
  RegisterChaos();
  g_chaos.Reset(5);
  LocalCommunicator comm;
  CheckpointManager m(FreshRoot("fallback"), comm);
  StepState s;
  for (int64_t step : {1, 2, 3}) {
    s.Fill(step);
    m.Save(step, s.sd);
  }
  // Step 3's data is damaged (its metadata is fine, so it is the newest complete step).
  auto store3 = Underlying(m.PathFor(3));
  for (const auto& name : store3->List()) {
    if (name.rfind("data-", 0) != 0) continue;
    std::string bytes = store3->ReadAll(name, UINT64_MAX);
    bytes[bytes.size() / 2] ^= 0x40;
    store3->PublishAtomically(name, bytes);
  }
  StepState back;
  CHECK(m.Restore(back.sd) == 2);
  CHECK(back.Holds(2));
  REQUIRE(m.restore_fallbacks().size() == 1);
  CHECK_THAT(m.restore_fallbacks()[0], Contains("step 3"));
  // And a newest step whose metadata cannot be read at all.
  s.Fill(4);
  m.Save(4, s.sd);
  auto store4 = Underlying(m.PathFor(4));
  std::string md = store4->ReadAll(kMetadataName, UINT64_MAX);
  md[md.size() - 3] ^= 0x01;
  store4->PublishAtomically(kMetadataName, md);
  CHECK(m.Restore(back.sd) == 2);
  CHECK(m.restore_fallbacks().size() == 2);
  CHECK(back.Holds(2));
  CHECK(m.Close());
}

TEST_CASE("save: ranks that disagree about the step fail instead of pairing on a reused target",
          "[manager][protocol][option:SaveOptions::step]") {
  // The "latest" pattern: one location overwritten by every save. Rank 1 skips step 2's save,
  // so its step-3 save meets rank 0's step-2 save.
  const std::string target = "mem://reused-latest-" + std::to_string(g_counter++);
  std::atomic<int> step2_ok{0};
  auto errors = RunRanks(
      2,
      [&](int rank, Communicator& comm) {
        StepState s;
        SaveOptions o;
        o.storage.overwrite = true;
        s.Fill(1);
        o.step = 1;
        Save(s.sd, target, comm, o);
        const int64_t next = rank == 0 ? 2 : 3;
        s.Fill(next);
        o.step = next;
        Save(s.sd, target, comm, o);
        step2_ok++;
      },
      std::chrono::seconds(3));
  CHECK(step2_ok == 0);
  REQUIRE(errors[1]);
  try {
    std::rethrow_exception(errors[1]);
  } catch (const CollectiveError& e) {
    CHECK_THAT(e.what(), Contains("step 2"));
    CHECK_THAT(e.what(), Contains("step 3"));
  }
  CHECK(errors[0]);
  // The location still holds step 1's checkpoint, unmixed.
  StepState back;
  Load(back.sd, target);
  CHECK(back.Holds(1));
}

TEST_CASE("manager: collectives name their step, so ranks on different steps fail",
          "[manager][protocol]") {
  static int n = 0;
  const std::string root = "mem://manager-steps-" + std::to_string(n++);
  std::atomic<int> ok{0};
  auto errors = RunRanks(
      2,
      [&](int rank, Communicator& comm) {
        CheckpointManager m(root, comm);
        StepState s;
        s.Fill(5);
        m.Save(rank == 0 ? 5 : 6, s.sd);  // rank 1 is one step ahead
        ok++;
      },
      std::chrono::seconds(3));
  CHECK(ok == 0);
  REQUIRE(errors[1]);
  try {
    std::rethrow_exception(errors[1]);
  } catch (const CollectiveError& e) {
    CHECK_THAT(e.what(), Contains("step=5"));
  }
  CHECK(errors[0]);
}

TEST_CASE("manager: goes on with fresh communicators after a poisoned one", "[manager][protocol]") {
  static int n = 0;
  for (bool async : {false, true}) {
    DYNAMIC_SECTION((async ? "async" : "sync")) {
      const std::string root = "mem://manager-replace-" + std::to_string(n++);
      InProcessGroup first_bg(2), fresh(2), fresh_bg(2);
      std::atomic<int> failed{0}, restored{0};
      auto errors = RunRanks(
          2,
          [&](int rank, Communicator& comm) {
            std::unique_ptr<Communicator> bg;
            if (async) bg = first_bg.Release(rank);
            Communicator* bg_comm = bg.get();
            CheckpointManager m(root, comm, std::move(bg));
            StepState s;
            s.Fill(1);
            m.Save(1, s.sd);
            m.Wait();
            // A timeout elsewhere poisoned this rank's communicators: the next save fails.
            comm.Poison("test: a peer timed out");
            if (bg_comm) bg_comm->Poison("test: a peer timed out");
            s.Fill(2);
            try {
              m.Save(2, s.sd);
              m.Wait();
            } catch (const CollectiveError&) {
              failed++;
            }
            m.ReplaceCommunicator(fresh.communicator(rank),
                                  async ? fresh_bg.Release(rank) : nullptr);
            s.Fill(3);
            m.Save(3, s.sd);
            m.Wait();
            StepState back;
            if (m.Restore(back.sd) == 3 && back.Holds(3)) restored++;
            Expect(m.Close(), "clean close");
          },
          std::chrono::seconds(5));
      RequireNoErrors(errors);
      CHECK(failed == 2);
      CHECK(restored == 2);
    }
  }
}

TEST_CASE(
    "file store: flock on NFS with local locks or Lustre localflock is known to be "
    "node-local",
    "[manager][lock]") {
  CHECK(NodeLocalLockReason("nfs4", "rw,relatime,vers=4.2,local_lock=none,addr=10.0.0.1") == "");
  CHECK_THAT(NodeLocalLockReason("nfs", "rw,vers=3,nolock,proto=tcp"), Contains("nolock"));
  CHECK_THAT(NodeLocalLockReason("nfs4", "rw,local_lock=flock"), Contains("local_lock=flock"));
  CHECK_THAT(NodeLocalLockReason("nfs4", "rw,local_lock=all"), Contains("local_lock=all"));
  CHECK_THAT(NodeLocalLockReason("lustre", "rw,localflock"), Contains("localflock"));
  CHECK(NodeLocalLockReason("lustre", "rw,flock") == "");
  CHECK(NodeLocalLockReason("ext4", "rw,nolock") == "");
  // This machine's temporary directory is local: its lock works as before.
  TempDir dir("nfs-probe");
  CHECK(NodeLocalLockReason(dir.path()) == "");
  CHECK(MakeFileStore(dir.path())->TryLock("probe"));
}
