// One writer per checkpoint location (issue 12, case 4): two jobs saving into one location at
// once, a lock left by a killed process, and the post-commit clean-up that may remove only the
// files of saves it can prove dead. The lock primitive itself is checked on every backend by
// the conformance suite (storage_conformance_test.cc). And where the store has versions, an
// overwrite's commit is conditional on the metadata its save found (Store::PublishReplacing).
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>
#include <thread>
#include <utility>

#include "dcp/dcp.h"
#include "dcp/storage/backends/fault_store.h"
#include "dcp/storage/backends/file_store.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/store.h"
#include "support/test_support.h"

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

namespace {

constexpr int kWorld = 2;

struct Versioned {
  std::vector<TensorView> tensors;
  StateDict sd;
};

// The state of `rank` at `version`: values depend on both, so a mix of two saves is detected.
Versioned MakeVersion(int version, int rank, bool fill) {
  Versioned v;
  const Shape shapes[] = {{64, 33}, {1000}};
  const DType dtypes[] = {DType::kFloat32, DType::kInt64};
  for (int i = 0; i < 2; ++i) {
    TensorView t = TensorView::Allocate(dtypes[i], shapes[i]);
    if (fill) FillRandom(t.data, t.nbytes(), version * 1000 + rank * 10 + i);
    v.tensors.push_back(t);
    v.sd.Nested("rank" + std::to_string(rank)).Set("t" + std::to_string(i), t);
  }
  v.sd.Nested("rank" + std::to_string(rank))
      .Set("blob", Blob{fill ? "v" + std::to_string(version) : ""});
  return v;
}

// The version a location holds, checked value by value on every rank's entries; -1 when there
// is no checkpoint. Throws when the checkpoint does not load or mixes versions.
int CheckpointVersion(const std::string& uri) {
  try {
    ReadMetadata(uri);
  } catch (const NotFoundError&) {
    return -1;
  }
  int version = -2;
  for (int r = 0; r < kWorld; ++r) {
    Versioned back = MakeVersion(0, r, false);
    Load(back.sd, uri);  // every data file present, checksums verified
    const std::string blob =
        std::get<Blob>(*back.sd.Nested("rank" + std::to_string(r)).Find("blob")).bytes;
    const int v = std::stoi(blob.substr(1));
    Versioned expect = MakeVersion(v, r, true);
    for (size_t i = 0; i < back.tensors.size(); ++i) {
      if (!SameElements(back.tensors[i], expect.tensors[i])) {
        throw std::runtime_error("values of rank " + std::to_string(r) + " differ");
      }
    }
    if (version != -2 && version != v) throw std::runtime_error("ranks of different versions");
    version = v;
  }
  return version;
}

// One 2-rank job saving `version` into `dir`, its writes slowed down so that two jobs overlap.
std::vector<std::exception_ptr> SlowJob(const std::string& dir, int version, bool overwrite,
                                        std::chrono::milliseconds delay) {
  return RunRanks(
      kWorld,
      [&](int r, Communicator& comm) {
        auto store = std::make_shared<FaultInjectionStore>(MakeFileStore(dir));
        store->Delay(FaultOp::kAppend, delay);
        store->Delay(FaultOp::kClose, delay);
        StorageOptions so;
        so.overwrite = overwrite;
        so.files_per_rank = 2;
        auto writer = MakeStoreWriter(store, so);
        Versioned v = MakeVersion(version, r, true);
        Save(v.sd, *writer, comm);
      },
      std::chrono::seconds(60));
}

bool AllOk(const std::vector<std::exception_ptr>& errors) {
  for (const auto& e : errors) {
    if (e) return false;
  }
  return true;
}

std::string FirstMessage(const std::vector<std::exception_ptr>& errors) {
  for (const auto& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const std::exception& x) {
      return x.what();
    }
  }
  return {};
}

int CountDataFiles(const std::string& dir) {
  int n = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) {
    n += IsDataObjectName(e.path().filename().string());
  }
  return n;
}

// A Store without the lock primitive (TryLock's default), to check the documented fallback.
class UnlockedStore : public ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  std::unique_ptr<StoreLock> TryLock(const std::string& h) override { return Store::TryLock(h); }
};

void PutObject(Store& store, const std::string& name, const std::string& bytes) {
  auto w = store.Create(name);
  w->Append(bytes.data(), bytes.size());
  w->Close();
}

}  // namespace

TEST_CASE("lock: two concurrent jobs on one location: one wins, the other is refused by name",
          "[fault][lock]") {
  int rounds = 0, refused_by_lock = 0;
  for (bool overwrite : {false, true}) {
    for (int offset_ms : {0, 10, 30, 60}) {
      for (int rep = 0; rep < 2; ++rep) {
        TempDir tmp("lock");
        const std::string dir = tmp.path() + "/ckpt";
        if (overwrite) {
          RequireNoErrors(SlowJob(dir, 1, false, std::chrono::milliseconds(0)));
        }
        INFO("overwrite " << overwrite << ", second job " << offset_ms << " ms later");
        // Each save takes well over 100 ms (two files per rank, each append and close delayed),
        // so the second job starts while the first one is still writing.
        std::vector<std::exception_ptr> a, b;
        std::thread ta([&] { a = SlowJob(dir, 2, overwrite, std::chrono::milliseconds(100)); });
        std::thread tb([&] {
          std::this_thread::sleep_for(std::chrono::milliseconds(offset_ms));
          b = SlowJob(dir, 3, overwrite, std::chrono::milliseconds(100));
        });
        ta.join();
        tb.join();
        ++rounds;
        const int successes = AllOk(a) + AllOk(b);
        CHECK(successes == 1);  // never two "ok"s for overlapping saves
        const int version = CheckpointVersion("file://" + dir);  // throws if it fails to verify
        if (successes == 1) {
          CHECK(version == (AllOk(a) ? 2 : 3));
          const std::string loser = FirstMessage(AllOk(a) ? b : a);
          CHECK_THAT(loser, Contains(dir));  // names the location
          refused_by_lock += loser.find("locked") != std::string::npos;
        }
        // Only the committed checkpoint's files remain: 2 ranks x 2 files.
        CHECK(CountDataFiles(dir) == 4);
        CHECK_FALSE(std::filesystem::exists(dir + "/" + kLockObjectName));  // released
      }
    }
  }
  WARN("concurrent-job rounds: " << rounds << ", loser refused by the lock: " << refused_by_lock);
  CHECK(refused_by_lock == rounds);
}

TEST_CASE("lock: a lock left by a SIGKILLed process does not block the next save",
          "[fault][lock]") {
  TempDir tmp("lockkill");
  const std::string dir = tmp.path() + "/ckpt";
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // The "stale job": takes the lock, says so, then hangs until killed.
    try {
      auto lock = MakeFileStore(dir)->TryLock("stale-job");
      if (::write(ready[1], "x", 1) != 1) ::_exit(3);
      for (;;) ::pause();
    } catch (...) {
      ::_exit(4);
    }
  }
  ::close(ready[1]);
  // Whatever fails below, the child must not outlive the test (it holds the test's stdout).
  struct KillOnExit {
    pid_t pid;
    ~KillOnExit() {
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
    }
  } guard{pid};
  char c = 0;
  REQUIRE(::read(ready[0], &c, 1) == 1);
  ::close(ready[0]);

  // While it lives, saves are refused with the location and the holder named.
  auto store = MakeFileStore(dir);
  try {
    store->TryLock("me");
    FAIL("the lock was taken twice");
  } catch (const LockedError& e) {
    CHECK_THAT(e.what(), Contains(dir));
    CHECK_THAT(e.what(), Contains("stale-job"));
    CHECK(e.code() == ErrorCode::kAlreadyExists);
  }
  Versioned v = MakeVersion(7, 0, true);
  const std::string msg = MessageOf<Error>([&] { Save(v.sd, dir); });
  CHECK_THAT(msg, Contains("locked"));
  CHECK_THAT(msg, Contains(dir));
  CHECK(CheckpointVersion("file://" + dir) == -1);  // the refused save wrote nothing

  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  guard.pid = -1;
  REQUIRE(WIFSIGNALED(status));

  // The kernel released the dead process's lock: the next save goes through at once.
  SaveOptions so;
  so.storage.overwrite = true;
  Save(v.sd, dir, so);
  CHECK(ReadMetadata(dir).storage.size() > 0);
  CHECK_FALSE(std::filesystem::exists(dir + "/" + kLockObjectName));
}

TEST_CASE("lock: clean-up after a commit removes only the files of dead saves", "[fault][lock]") {
  TempDir tmp("lockgc");
  const std::string dir = tmp.path() + "/ckpt";
  SaveOptions so;
  so.storage.overwrite = true;

  SECTION("with the lock: every unreferenced data file and metadata temporary is dead") {
    Versioned v1 = MakeVersion(1, 0, true);
    Save(v1.sd, dir, so);
    auto store = MakeFileStore(dir);
    // Leftovers of a crashed save and of a crashed metadata publish.
    PutObject(*store, "data-deadbeef00000000-r1-b0.data", "orphan");
    PutObject(*store, std::string(kMetadataName) + ".tmp.0123456789abcdef", "torn");
    Versioned v2 = MakeVersion(2, 0, true);
    const Metadata md = Save(v2.sd, dir, so).metadata;
    for (const auto& name : store->List()) {
      INFO(name);
      CHECK(name != "data-deadbeef00000000-r1-b0.data");
      CHECK(name.rfind(std::string(kMetadataName) + ".tmp.", 0) != 0);
      if (IsDataObjectName(name)) CHECK_THAT(name, Contains(md.save_id));
    }
  }

  SECTION("without a lock primitive: only the replaced checkpoint's files are removed") {
    auto unlocked = std::make_shared<UnlockedStore>(MakeFileStore(dir));
    LocalCommunicator comm;
    auto save = [&](int version) {
      auto writer = MakeStoreWriter(unlocked, so.storage);
      Versioned v = MakeVersion(version, 0, true);
      return Save(v.sd, *writer, comm).metadata;
    };
    const Metadata md1 = save(1);
    // Unreferenced, but nothing proves it dead without a lock: it could be a concurrent save's.
    PutObject(*unlocked, "data-0000000000000000-r1-b0.data", "maybe live");
    const Metadata md2 = save(2);
    int old_files = 0, foreign = 0;
    for (const auto& name : unlocked->List()) {
      old_files += name.find(md1.save_id) != std::string::npos;
      foreign += name == "data-0000000000000000-r1-b0.data";
    }
    CHECK(old_files == 0);
    CHECK(foreign == 1);
    CHECK(ReadMetadata(dir).save_id == md2.save_id);
  }
}

namespace {

// A store with versions and no lock: each object has a generation, SizeAndVersion states it and
// PublishReplacing replaces an object only at the generation it names (what s3:// does with
// ETags and If-Match). Two writers without a lock then race as two jobs of which one lost its
// lease do: the fence is the store's condition alone.
class VersionedStore : public ForwardingStore {
 public:
  using ForwardingStore::ForwardingStore;
  std::unique_ptr<StoreLock> TryLock(const std::string& h) override { return Store::TryLock(h); }
  std::optional<uint64_t> SizeAndVersion(const std::string& name, std::string* version) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto size = target_->Size(name);
    if (version != nullptr) *version = size ? std::to_string(generation_[name]) : "";
    return size;
  }
  void PublishAtomically(const std::string& name, std::string_view bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    target_->PublishAtomically(name, bytes);
    ++generation_[name];
  }
  void PublishNew(const std::string& name, std::string_view bytes) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (target_->Size(name)) throw AlreadyExistsError(name + " exists");
    target_->PublishAtomically(name, bytes);
    ++generation_[name];
  }
  void PublishReplacing(const std::string& name, std::string_view bytes,
                        const std::string& version) override {
    std::lock_guard<std::mutex> lock(mu_);
    ++replacing_publishes;
    if (!target_->Size(name) || std::to_string(generation_[name]) != version) {
      throw AlreadyExistsError(name + " changed since version " + version);
    }
    target_->PublishAtomically(name, bytes);
    ++generation_[name];
  }
  int replacing_publishes = 0;

 private:
  std::mutex mu_;
  std::map<std::string, uint64_t> generation_;
};

// Runs `before` once, right before the first publish of the metadata goes to the target.
class BeforeCommitStore : public ForwardingStore {
 public:
  BeforeCommitStore(std::shared_ptr<Store> target, std::function<void()> before)
      : ForwardingStore(std::move(target)), before_(std::move(before)) {}
  void PublishAtomically(const std::string& n, std::string_view b) override {
    Before(n);
    ForwardingStore::PublishAtomically(n, b);
  }
  void PublishNew(const std::string& n, std::string_view b) override {
    Before(n);
    ForwardingStore::PublishNew(n, b);
  }
  void PublishReplacing(const std::string& n, std::string_view b, const std::string& v) override {
    Before(n);
    ForwardingStore::PublishReplacing(n, b, v);
  }

 private:
  void Before(const std::string& n) {
    if (n == kMetadataName && before_) std::exchange(before_, nullptr)();
  }
  std::function<void()> before_;
};

}  // namespace

TEST_CASE("lock: an overwrite commits only over the metadata it found where the store has versions",
          "[lock][checkpoint]") {
  TempDir tmp("fence");
  const std::string dir = tmp.path() + "/ckpt";
  auto store = std::make_shared<VersionedStore>(MakeFileStore(dir));
  StorageOptions so;
  so.overwrite = true;
  so.files_per_rank = 2;
  auto save = [&](std::shared_ptr<Store> through, int version) {
    LocalCommunicator comm;
    auto writer = MakeStoreWriter(std::move(through), so);
    Versioned v = MakeVersion(version, 0, true);
    return Save(v.sd, *writer, comm).metadata;
  };
  save(store, 1);
  // Writer A overwrites; right before its commit, writer B (started after A looked) overwrites
  // and commits. A's commit must then fail, with nothing of it committed, and B's stay.
  Metadata b;
  auto a_store = std::make_shared<BeforeCommitStore>(store, [&] { b = save(store, 3); });
  std::string message;
  try {
    save(a_store, 2);
    FAIL("the writer whose metadata was replaced meanwhile committed over it");
  } catch (const CollectiveError& e) {
    CHECK(e.outcome() == Outcome::kFailed);
    REQUIRE(e.failures().size() == 1);
    CHECK(e.failures()[0].code == ErrorCode::kAlreadyExists);
    message = e.failures()[0].message;
  }
  WARN("the refused writer's error: " << message);
  CHECK_THAT(message,
             Contains("another writer committed at " + store->uri() + " since this save began") &&
                 Contains("nothing of this save was committed"));
  CHECK(store->replacing_publishes == 2);  // B's, then A's refused one
  // B's checkpoint, whole; A's files were removed by its Abort.
  CHECK(ReadMetadata(dir).save_id == b.save_id);
  Versioned back = MakeVersion(0, 0, false);
  Load(back.sd, dir);
  Versioned expect = MakeVersion(3, 0, true);
  for (size_t i = 0; i < back.tensors.size(); ++i) {
    CHECK(SameElements(back.tensors[i], expect.tensors[i]));
  }
  for (const auto& name : store->List()) {
    if (IsDataObjectName(name)) CHECK_THAT(name, Contains(b.save_id));
  }
  // The next overwrite replaces B's metadata at the version it finds: it commits.
  const Metadata c = save(store, 4);
  CHECK(ReadMetadata(dir).save_id == c.save_id);
  CHECK(store->replacing_publishes == 3);
}
