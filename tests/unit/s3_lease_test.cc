// The s3:// writer lock's lease against the real test server: renewed while held (a lock
// outlives many short leases), fenced at the commit (a holder whose lease was taken over fails
// its save on every rank and the other job's checkpoint stays; a writer paused between that
// check and its publish cannot replace the commit of the job that took over, and one resuming
// before that job commits makes that job's commit fail), released only while it is still ours,
// freed one lease after its holder is killed, and SIGKILLs of overlapping jobs with short leases
// never leave a torn checkpoint nor lose a committed one. Every test skips, printing why, where
// no server is running.
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <map>
#include <random>
#include <set>
#include <sstream>
#include <string_view>
#include <thread>
#include <utility>
#include <vector>

#include "dcp/dcp.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/registry.h"
#include "dcp/storage/store.h"
#include "support/s3_test_support.h"
#include "support/test_support.h"
#ifdef DCP_HAVE_S3
#include "dcp/storage/backends/s3/s3_store.h"
#endif

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

#ifdef DCP_HAVE_S3
namespace {

bool HaveServer() { return S3ServerOrSkip(); }

struct LeaseGuard {
  explicit LeaseGuard(const char* seconds) { ::setenv("DCP_S3_LOCK_LEASE_S", seconds, 1); }
  ~LeaseGuard() { ::unsetenv("DCP_S3_LOCK_LEASE_S"); }
};

int64_t Ms(Clock::duration d) { return std::chrono::duration_cast<milliseconds>(d).count(); }

// A job's state at save `id`: every value derives from id, so a mix of two saves is detected.
struct Job {
  TensorView a = TensorView::Allocate(DType::kFloat32, {256, 1024});
  TensorView b = TensorView::Allocate(DType::kInt64, {1000});
  StateDict sd;
  explicit Job(int64_t id) {
    if (id >= 0) {
      FillRandom(a.data, a.nbytes(), static_cast<uint64_t>(id) * 10 + 1);
      FillRandom(b.data, b.nbytes(), static_cast<uint64_t>(id) * 10 + 2);
    }
    sd.Set("a", a).Set("b", b).Set("id", Blob{id >= 0 ? std::to_string(id) : ""});
  }
};

// The id of the checkpoint at `uri`, verified value by value; -1 when there is none. Throws
// when the checkpoint is torn (metadata present, content unreadable or of several saves).
int64_t CheckpointId(const std::string& uri) {
  // Present metadata is a checkpoint: whatever then fails to load (a missing data file
  // included, which ReadMetadata reports as NotFoundError) is a torn one.
  if (!OpenStore(uri)->Size(kMetadataName)) return -1;
  Job back(-1);
  Load(back.sd, uri);  // checksums verified
  const int64_t id = std::stoll(std::get<Blob>(*back.sd.Find("id")).bytes);
  Job expect(id);
  if (!SameElements(back.a, expect.a) || !SameElements(back.b, expect.b)) {
    throw std::runtime_error("torn: the values are not those of save " + std::to_string(id));
  }
  return id;
}

void SaveJob(int64_t id, const std::string& uri, Communicator& comm) {
  Job j(id);
  SaveOptions so;
  so.storage.overwrite = true;
  so.storage.files_per_rank = 2;
  Save(j.sd, uri, comm, so);
}

// Runs `before` once, right before the first publish of the checkpoint's metadata is forwarded
// (after the writer's lock check, StoreWriter::Finish's CheckHeld).
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

// Job `id`'s 1-rank overwrite of `uri` through `store` (a wrapper of OpenStore(uri)), retried
// while another job's lock holds the location (a paused writer's, until its lease runs out).
void SaveWhenUnlocked(int64_t id, const std::shared_ptr<Store>& store) {
  const auto start = Clock::now();
  for (;;) {
    Job j(id);
    SaveOptions so;
    so.storage.overwrite = true;
    so.storage.files_per_rank = 2;
    auto writer = MakeStoreWriter(store, so.storage);
    LocalCommunicator comm;
    try {
      Save(j.sd, *writer, comm, so);
      return;
    } catch (const CollectiveError& e) {
      const bool locked = !e.failures().empty() &&
                          e.failures()[0].message.find("is locked by") != std::string::npos;
      if (!locked || Clock::now() - start > std::chrono::seconds(15)) throw;
    }
    std::this_thread::sleep_for(milliseconds(100));
  }
}

// How a save in a child process ended: 'C' committed, 'F' failed with nothing committed, 'U'
// outcome unknown, 'K' committed then failed, 'E' another error; and the first failure's message.
struct SaveReport {
  char code = '?';
  std::string message;
};

// A forked child whose job `id` overwrites `root` and stops itself (SIGSTOP) right before the
// publish of its metadata, after its lock check: a writer frozen between its check and its PUT
// (a debugger, a cgroup freezer, an overloaded host). Killed on destruction if still there.
class PausedWriter {
 public:
  PausedWriter(int64_t id, const std::string& root) {
    int fds[2];
    if (::pipe(fds) != 0) throw std::runtime_error("pipe failed");
    pid_ = ::fork();
    if (pid_ < 0) throw std::runtime_error("fork failed");
    if (pid_ == 0) {
      ::close(fds[0]);
      Child(id, root, fds[1]);
    }
    ::close(fds[1]);
    fd_ = fds[0];
  }
  ~PausedWriter() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
    if (fd_ >= 0) ::close(fd_);
  }
  PausedWriter(const PausedWriter&) = delete;

  // True once it stopped at its publish; false when it ended before (its report says why).
  bool WaitStopped() {
    int status = 0;
    while (::waitpid(pid_, &status, WUNTRACED) < 0) {
      if (errno != EINTR) return false;
    }
    if (WIFSTOPPED(status)) return true;
    pid_ = -1;
    return false;
  }
  void Continue() { ::kill(pid_, SIGCONT); }
  // Its report, once it ended.
  SaveReport Wait() {
    int status = 0;
    while (pid_ > 0 && ::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
    }
    pid_ = -1;
    return Report();
  }
  SaveReport Report() {
    std::string all;
    char buf[4096];
    for (ssize_t n; (n = ::read(fd_, buf, sizeof buf)) > 0;)
      all.append(buf, static_cast<size_t>(n));
    SaveReport r;
    if (!all.empty()) {
      r.code = all[0];
      r.message = all.substr(1);
    }
    return r;
  }

 private:
  [[noreturn]] static void Child(int64_t id, const std::string& root, int fd) {
    SaveReport r;
    r.code = 'E';
    try {
      Job j(id);
      SaveOptions so;
      so.storage.overwrite = true;
      so.storage.files_per_rank = 2;
      auto store = std::make_shared<BeforeCommitStore>(OpenStore(root), [] { ::raise(SIGSTOP); });
      auto writer = MakeStoreWriter(store, so.storage);
      LocalCommunicator comm;
      Save(j.sd, *writer, comm, so);
      r.code = 'C';
    } catch (const CollectiveError& e) {
      r.code = e.outcome() == Outcome::kFailed ? 'F' : e.outcome() == Outcome::kUnknown ? 'U' : 'K';
      r.message = e.failures().empty() ? e.what() : e.failures()[0].message;
    } catch (const std::exception& e) {
      r.message = e.what();
    }
    const std::string line = r.code + r.message;
    if (::write(fd, line.data(), line.size()) < 0) ::_exit(4);  // the pipe holds it whole
    ::_exit(0);
  }

  pid_t pid_ = -1;
  int fd_ = -1;
};

// The data files of the location that its checkpoint does not reference.
std::vector<std::string> UnreferencedDataFiles(const std::string& uri) {
  const Metadata md = ReadMetadata(uri);
  std::set<std::string> referenced;
  for (const auto& [index, info] : md.storage) referenced.insert(info.relative_path);
  std::vector<std::string> extra;
  for (const auto& n : OpenStore(uri)->List()) {
    if (IsDataObjectName(n) && referenced.count(n) == 0) extra.push_back(n);
  }
  return extra;
}

}  // namespace

TEST_CASE("s3 lease: a held lock is renewed and outlives many short leases", "[s3][lock]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("renew");
  LeaseGuard lease("2");
  auto lock = OpenStore(root)->TryLock("long-save");
  REQUIRE(lock);
  // 7 s = 3.5 leases: without renewal the second TryLock would take it over after 2 s.
  const auto start = Clock::now();
  int refused = 0;
  while (Clock::now() - start < milliseconds(7000)) {
    const std::string msg = MessageOf<LockedError>([&] { OpenStore(root)->TryLock("other"); });
    CHECK_THAT(msg, Contains("long-save"));
    ++refused;
    std::this_thread::sleep_for(milliseconds(400));
  }
  CHECK(refused >= 10);
  CHECK_NOTHROW(lock->CheckHeld());
  lock->Release();
  CHECK(OpenStore(root)->TryLock("other"));
}

TEST_CASE("s3 lease: a lock whose create outlasted its lease is renewed before TryLock returns",
          "[s3][lock]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("slowcreate");
  LeaseGuard lease("2");
  OpenStore(root)->CreateRoot();
  std::atomic<bool> slowed{false};
  SetS3FaultHookForTesting([&](const S3RequestInfo& i) {
    if (i.method == "PUT" && i.key.find(kLockObjectName) != std::string::npos &&
        !slowed.exchange(true)) {
      std::this_thread::sleep_for(milliseconds(2500));  // the create takes longer than the lease
    }
    return S3Fault::kNone;
  });
  std::unique_ptr<StoreLock> lock;
  try {
    lock = OpenStore(root)->TryLock("slow-create");
  } catch (...) {
    SetS3FaultHookForTesting(nullptr);
    throw;
  }
  SetS3FaultHookForTesting(nullptr);
  REQUIRE(lock);
  // Unrenewed, the record it wrote ran out 0.5 s ago and this contender would take it over.
  const std::string msg = MessageOf<LockedError>([&] { OpenStore(root)->TryLock("other"); });
  CHECK_THAT(msg, Contains("slow-create"));
  CHECK_NOTHROW(lock->CheckHeld());
  lock->Release();
}

TEST_CASE(
    "s3 lease: a holder whose lease was taken over fails its commit on every rank and the other "
    "job's checkpoint stays",
    "[s3][lock]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("fence");
  RequireNoErrors(RunRanks(1, [&](int, Communicator& comm) { SaveJob(1, root, comm); }));
  // Job A (2 ranks) overwrites it. While A writes its data, A is taken over: its lock object is
  // replaced by an expired record (as if A had been frozen past its lease), and job B takes the
  // lock over, saves, commits and releases. A must then fail its commit, on every rank.
  std::atomic<bool> fired{false};
  std::vector<std::exception_ptr> b_errors;
  SetS3FaultHookForTesting([&](const S3RequestInfo& i) {
    if (i.method == "PUT" && i.key.find("/data-") != std::string::npos && !fired.exchange(true)) {
      auto store = OpenStore(root);
      store->PublishAtomically(kLockObjectName, "1\nfrozen job A's lease, run out");
      b_errors = RunRanks(1, [&](int, Communicator& comm) { SaveJob(2, root, comm); });
    }
    return S3Fault::kNone;
  });
  std::vector<std::exception_ptr> a_errors =
      RunRanks(2, [&](int, Communicator& comm) { SaveJob(3, root, comm); });
  SetS3FaultHookForTesting(nullptr);
  REQUIRE(fired);
  RequireNoErrors(b_errors);
  REQUIRE(a_errors.size() == 2);
  for (const auto& e : a_errors) {
    REQUIRE(e);
    try {
      std::rethrow_exception(e);
    } catch (const CollectiveError& c) {
      CHECK(c.outcome() == Outcome::kFailed);
      REQUIRE(c.failures().size() >= 1);
      CHECK(c.failures()[0].code == ErrorCode::kAlreadyExists);
      CHECK_THAT(c.failures()[0].message, Contains("was lost"));
    }
  }
  CHECK(CheckpointId(root) == 2);  // B's checkpoint, whole
  const Metadata md = ReadMetadata(root);
  std::set<std::string> referenced;
  for (const auto& [index, info] : md.storage) referenced.insert(info.relative_path);
  for (const auto& n : OpenStore(root)->List()) {
    if (IsDataObjectName(n)) CHECK(referenced.count(n) == 1);  // A's files were aborted
  }
}

TEST_CASE("s3 lease: release deletes only its own lock and a lost lock says so", "[s3][lock]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("release");
  LeaseGuard lease("2");
  auto a = OpenStore(root)->TryLock("job-a");
  REQUIRE(a);
  SuspendS3LockRenewalForTesting(*a);  // frozen: its lease runs out
  std::this_thread::sleep_for(milliseconds(2300));
  auto b = OpenStore(root)->TryLock("job-b");  // taken over
  REQUIRE(b);
  std::string lost;
  try {
    a->CheckHeld();
  } catch (const LeaseLostError& e) {
    lost = e.what();
    CHECK_THAT(e.holder(), Contains("job-b"));
  }
  CHECK_THAT(lost, Contains("was lost") && Contains(root));
  a->Release();  // must not free B's lock
  const std::string msg = MessageOf<LockedError>([&] { OpenStore(root)->TryLock("job-c"); });
  CHECK_THAT(msg, Contains("job-b"));
  // B's renewals go on after A's late release.
  std::this_thread::sleep_for(milliseconds(2500));
  CHECK_NOTHROW(b->CheckHeld());
  CHECK_THROWS_AS(OpenStore(root)->TryLock("job-c"), LockedError);
  b->Release();
  CHECK(OpenStore(root)->TryLock("job-c"));
}

TEST_CASE("s3 lease: a killed holder's lock is taken over one lease after its last renewal",
          "[s3][lock]") {
  if (!HaveServer()) return;
  {
    // A crashed job's lock must be free in minutes, not a day.
    ::unsetenv("DCP_S3_LOCK_LEASE_S");
    const int64_t lease = S3Options::FromEnvironment({}).lock_lease_seconds;
    CHECK(lease >= 10);
    CHECK(lease <= 300);
  }
  const std::string root = S3TestRoot("killed");
  LeaseGuard lease("2");
  int ready[2];
  REQUIRE(::pipe(ready) == 0);
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    ::close(ready[0]);
    try {
      auto lock = OpenStore(root)->TryLock("killed-job");
      const char ok = lock ? '1' : '0';
      if (::write(ready[1], &ok, 1) != 1) ::_exit(4);
      for (;;) std::this_thread::sleep_for(milliseconds(1000));  // holds it until killed
    } catch (...) {
      ::_exit(3);
    }
  }
  ::close(ready[1]);
  char ok = 0;
  REQUIRE(::read(ready[0], &ok, 1) == 1);
  ::close(ready[0]);
  REQUIRE(ok == '1');
  // Alive, it keeps the lock across 2.5 leases (its own process renews it).
  const auto start = Clock::now();
  while (Clock::now() - start < milliseconds(5000)) {
    CHECK_THROWS_AS(OpenStore(root)->TryLock("next-job"), LockedError);
    std::this_thread::sleep_for(milliseconds(500));
  }
  ::kill(pid, SIGKILL);
  int status = 0;
  ::waitpid(pid, &status, 0);
  REQUIRE((WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL));
  const auto killed = Clock::now();
  std::unique_ptr<StoreLock> next;
  while (!next && Clock::now() - killed < milliseconds(10000)) {
    try {
      next = OpenStore(root)->TryLock("next-job");
    } catch (const LockedError&) {
      std::this_thread::sleep_for(milliseconds(100));
    }
  }
  REQUIRE(next);
  const int64_t waited = Ms(Clock::now() - killed);
  WARN("the killed holder's lock was taken over " << waited << " ms after the kill (lease 2 s)");
  CHECK(waited <= 3500);  // at most one lease after its last renewal, plus the polling
}

// Store::TryLockOver: a holder proved gone (the memory tier's drain proves it by its node lock)
// is taken over at once, not one lease later; any other holder is still refused, and the holder
// taken over learns it lost the lock at its next check.
TEST_CASE("s3 lease: TryLockOver takes the named holder's lease over at once and no other's",
          "[s3][lock]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("lockover");
  LeaseGuard lease("60");
  auto store = OpenStore(root);
  auto gone = store->TryLock("killed-drain");
  REQUIRE(gone);
  std::string held_by;
  try {
    store->TryLock("next-drain");
    FAIL("a held lock is refused");
  } catch (const LockedError& e) {
    held_by = e.holder();
  }
  CHECK_THAT(held_by, Contains("killed-drain"));
  CHECK_THROWS_AS(store->TryLockOver("next-drain", "another-drain lock=0"), LockedError);
  const auto start = Clock::now();
  auto next = store->TryLockOver("next-drain", held_by);
  REQUIRE(next);
  CHECK(Ms(Clock::now() - start) < 10000);  // at once, not after the 60 s lease
  CHECK_THROWS_AS(gone->CheckHeld(), LeaseLostError);
  // The new holder's lease is not the one named: refused.
  CHECK_THROWS_AS(OpenStore(root)->TryLockOver("third-drain", held_by), LockedError);
  gone.reset();  // its release deletes only its own lock
  CHECK_THROWS_AS(OpenStore(root)->TryLock("third-drain"), LockedError);
  next->Release();
  CHECK(OpenStore(root)->TryLock("third-drain"));
}

// Two jobs at once save repeatedly to one location, each save with its own values; both are
// killed at random moments; the next trial's jobs find the killed ones' locks (taken over after
// the 1 s lease) and their unfinished saves. After each trial the location must hold a whole
// checkpoint of one save (not torn), one that is not older than any save reported committed
// (not lost), and never one whose save was reported failed.
TEST_CASE(
    "fault: s3 SIGKILL of overlapping jobs with short leases never tears or loses a "
    "checkpoint",
    "[fault][s3][crash]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("sigkill");
  LeaseGuard lease("1");
  TempDir dir("s3kill");
  // A new seed each run (DCP_TEST_SEED repeats one): CI's runs add up to many more kill moments
  // than one run's trials.
  const char* seed_env = std::getenv("DCP_TEST_SEED");
  const unsigned seed =
      seed_env ? static_cast<unsigned>(std::stoul(seed_env)) : std::random_device{}();
  WARN("s3 SIGKILL trials: seed " << seed << " (DCP_TEST_SEED=" << seed << " repeats this run)");
  std::mt19937 rng(seed);
  const auto start = Clock::now();
  const auto now_ns = [] {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch())
        .count();
  };
  // What is known of every save: started (ns, steady clock: one clock for every process of the
  // host), ended and how, and the kill time of its job.
  struct Known {
    int64_t started = -1, ended = -1, killed = -1;
    char result = '?';  // C committed, F failed (nothing committed), U unknown, ? not reported
  };
  std::map<int64_t, Known> saves;
  int trials = 0, torn = 0, lost = 0, failed_but_there = 0, found = 0, none = 0;
  int committed = 0, failed = 0, lock_refused = 0;
  int64_t ever_committed = 0;
  const auto elapsed = [&] { return Clock::now() - start; };
  constexpr int kMinTrials = 16;
  while ((trials < kMinTrials || (elapsed() < std::chrono::seconds(20) && trials < 200)) &&
         elapsed() < std::chrono::seconds(120)) {
    int fds[2];
    REQUIRE(::pipe(fds) == 0);
    pid_t pids[2];
    for (int j = 0; j < 2; ++j) {
      pids[j] = ::fork();
      REQUIRE(pids[j] >= 0);
      if (pids[j] != 0) continue;
      ::close(fds[0]);
      // The job: save, report, save again, until killed. Lines are short single writes to a
      // pipe, so they arrive whole.
      auto report = [&](char what, int64_t id) {
        char line[64];
        const int n = std::snprintf(line, sizeof line, "%c %lld %lld\n", what,
                                    static_cast<long long>(id), static_cast<long long>(now_ns()));
        if (::write(fds[1], line, static_cast<size_t>(n)) != n) ::_exit(4);
      };
      try {
        std::mt19937 jitter(seed + static_cast<unsigned>(trials * 2 + j));
        // One save in three stalls for longer than the lease before its first data upload (a
        // slow disk, a paused process): its lock must stay held through the stall, or the
        // other job takes over and each removes what the other wrote.
        static std::atomic<bool> stall{false};
        SetS3FaultHookForTesting([](const S3RequestInfo& i) {
          if (i.method == "PUT" && i.key.find("/data-") != std::string::npos &&
              stall.exchange(false)) {
            std::this_thread::sleep_for(milliseconds(1400));
          }
          return S3Fault::kNone;
        });
        for (int64_t id = (int64_t{trials} * 2 + j) * 100000;; ++id) {
          stall = std::uniform_int_distribution<int>(0, 2)(jitter) == 0;
          report('S', id);
          try {
            LocalCommunicator comm;
            SaveJob(id, root, comm);
            report('C', id);
          } catch (const CollectiveError& e) {
            // L: refused by the other job's lock (nothing written); F: failed, nothing
            // committed; U: the outcome is unknown.
            const bool locked = e.failures()[0].code == ErrorCode::kAlreadyExists &&
                                e.failures()[0].message.find("is locked by") != std::string::npos;
            report(e.outcome() != Outcome::kFailed ? 'U' : locked ? 'L' : 'F', id);
            std::this_thread::sleep_for(
                milliseconds(std::uniform_int_distribution<int>(20, 120)(jitter)));
          }
        }
      } catch (const std::exception& e) {
        if (std::FILE* f = std::fopen((dir.path() + "/child-error").c_str(), "w")) {
          std::fputs(e.what(), f);
          std::fclose(f);
        }
        ::_exit(3);
      }
    }
    ::close(fds[1]);
    // Kill each job at its own random moment.
    int64_t kill_at[2];
    // One job at any moment, the other late enough that a save stalled past the lease early
    // in the trial can see the other job take over (and then resume) before the kill.
    kill_at[0] = std::uniform_int_distribution<int64_t>(100, 2500)(rng);
    kill_at[1] = std::uniform_int_distribution<int64_t>(1200, 2500)(rng);
    if (rng() % 2) std::swap(kill_at[0], kill_at[1]);
    const int first = kill_at[0] <= kill_at[1] ? 0 : 1;
    const auto trial_start = Clock::now();
    int64_t killed_ns[2];
    for (int k = 0; k < 2; ++k) {
      const int j = k == 0 ? first : 1 - first;
      std::this_thread::sleep_until(trial_start + milliseconds(kill_at[j]));
      ::kill(pids[j], SIGKILL);
      killed_ns[j] = now_ns();
    }
    for (int j = 0; j < 2; ++j) {
      int status = 0;
      ::waitpid(pids[j], &status, 0);
      if (!(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL)) {
        std::string why;
        if (std::FILE* f = std::fopen((dir.path() + "/child-error").c_str(), "r")) {
          char buf[4096];
          why.assign(buf, std::fread(buf, 1, sizeof buf, f));
          std::fclose(f);
        }
        ::close(fds[0]);
        FAIL("a saving job ended with status " << status << " instead of the kill: " << why);
      }
    }
    std::string lines;
    char buf[4096];
    for (ssize_t n; (n = ::read(fds[0], buf, sizeof buf)) > 0;) lines.append(buf, n);
    ::close(fds[0]);
    std::istringstream in(lines);
    char what;
    long long id, t;
    while (in >> what >> id >> t) {
      Known& k = saves[id];
      k.killed = killed_ns[(id / 100000) % 2];
      if (what == 'S') {
        k.started = t;
      } else if (what == 'L') {
        ++lock_refused;
        k.ended = t;
        k.result = 'F';
      } else {
        k.ended = t;
        k.result = what;
        committed += what == 'C';
        failed += what == 'F';
        if (what == 'C') ++ever_committed;
      }
    }
    ++trials;
    int64_t in_place = -1;
    try {
      in_place = CheckpointId(root);
    } catch (const std::exception& e) {
      ++torn;
      FAIL_CHECK("trial " << trials << ": torn checkpoint: " << e.what());
      continue;
    }
    if (in_place < 0) {
      ++none;
      if (ever_committed > 0) {
        ++lost;
        FAIL_CHECK("trial " << trials << ": a committed checkpoint was lost: none is in place");
      }
      continue;
    }
    ++found;
    const auto it = saves.find(in_place);
    if (it == saves.end()) {
      FAIL_CHECK("trial " << trials << ": the checkpoint in place, save " << in_place
                          << ", was never started");
      continue;
    }
    if (it->second.result == 'F') {
      ++failed_but_there;
      FAIL_CHECK("trial " << trials << ": save " << in_place
                          << " was reported failed but is the checkpoint in place");
    }
    // Its commit happened before it reported, or before its job was killed; a save reported
    // committed that started after that moment committed later, so it must be what is there.
    const int64_t committed_by = it->second.ended >= 0 ? it->second.ended : it->second.killed;
    for (const auto& [other, k] : saves) {
      if (other != in_place && k.result == 'C' && k.started > committed_by) {
        ++lost;
        FAIL_CHECK("trial " << trials << ": save " << other << " was reported committed after save "
                            << in_place << " committed, but " << in_place << " is in place");
        break;
      }
    }
  }
  WARN("s3 SIGKILL trials: " << trials << " in " << Ms(elapsed()) / 1000 << " s; saves reported "
                             << "committed " << committed << ", failed " << failed
                             << ", refused by the lock " << lock_refused
                             << "; checkpoint found after " << found << " trials, none yet " << none
                             << "; torn " << torn << ", lost " << lost << ", failed-but-in-place "
                             << failed_but_there);
  CHECK(trials >= kMinTrials);
  CHECK(torn == 0);
  CHECK(lost == 0);
  CHECK(failed_but_there == 0);
  CHECK(committed > 0);
}
// Issue 43: a writer paused (SIGSTOP) past its lease between its lock check and the publish of
// its metadata; meanwhile the next job takes the lock over, overwrites, is told OK and removes
// the paused writer's files. Resumed, the paused writer's PUT must not replace that commit: it
// is conditional on the metadata's ETag the writer saw under its lock (If-Match), so the server
// refuses it and the paused save fails with nothing committed. Before, its plain PUT replaced
// the other job's metadata with one naming the data files that job had removed: an unloadable
// location, after a save reported committed.
TEST_CASE(
    "s3 lease: a writer paused past its lease before its publish cannot overwrite the next "
    "job's commit",
    "[s3][lock]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("paused");
  LeaseGuard lease("1");
  RequireNoErrors(RunRanks(1, [&](int, Communicator& comm) { SaveJob(1, root, comm); }));
  constexpr int kTrials = 8;
  int overwritten = 0, failed_cleanly = 0;
  const auto start = Clock::now();
  for (int trial = 0; trial < kTrials; ++trial) {
    const int64_t paused_id = 1000 + 2 * trial, next_id = 1001 + 2 * trial;
    INFO("trial " << trial);
    PausedWriter paused(paused_id, root);
    if (!paused.WaitStopped())
      FAIL("the writer ended before its publish: " << paused.Report().message);
    // Its lock is free one lease after the renewal its check made; the next job takes it over.
    SaveWhenUnlocked(next_id, OpenStore(root));
    paused.Continue();
    const SaveReport r = paused.Wait();
    if (trial == 0) WARN("the paused writer's save: [" << r.code << "] " << r.message);
    CHECK(r.code == 'F');
    CHECK_THAT(r.message, Contains("another writer committed at " + root +
                                   " after this save's lease ran out") &&
                              Contains("nothing of this save was committed"));
    failed_cleanly += r.code == 'F';
    int64_t in_place = -1;
    try {
      in_place = CheckpointId(root);  // the values, bit-exact
    } catch (const std::exception& e) {
      FAIL_CHECK("the location does not load: " << e.what());
    }
    CHECK(in_place == next_id);
    overwritten += in_place != next_id;
    if (in_place == next_id) CHECK(UnreferencedDataFiles(root).empty());  // the paused one's went
  }
  WARN("paused-writer trials: " << kTrials << " in " << Ms(Clock::now() - start) / 1000
                                << " s; the next job's commit overwritten " << overwritten
                                << " times; paused writers failed cleanly " << failed_cleanly);
  CHECK(overwritten == 0);
  CHECK(failed_cleanly == kTrials);
}

// The other order: the paused writer resumes while the next job holds the lock but has not
// committed yet. The paused writer's conditional PUT finds the metadata it saw and lands: a
// commit (nobody committed since it looked), which it reports once it finds its metadata in
// place (its lock was lost, so its own check cannot vouch for it). The next job's conditional
// PUT, on the same ETag, must then fail cleanly, leaving the paused writer's checkpoint whole.
// Before, the next job's plain PUT replaced a commit its writer had been told of.
TEST_CASE(
    "s3 lease: a paused writer resuming before the next job commits makes that commit fail "
    "cleanly",
    "[s3][lock]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("paused-first");
  LeaseGuard lease("1");
  RequireNoErrors(RunRanks(1, [&](int, Communicator& comm) { SaveJob(1, root, comm); }));
  constexpr int kTrials = 5;
  for (int trial = 0; trial < kTrials; ++trial) {
    const int64_t paused_id = 2000 + 2 * trial, next_id = 2001 + 2 * trial;
    INFO("trial " << trial);
    std::set<std::string> before;  // the location's data files before the trial
    for (const auto& n : OpenStore(root)->List()) {
      if (IsDataObjectName(n)) before.insert(n);
    }
    PausedWriter paused(paused_id, root);
    if (!paused.WaitStopped())
      FAIL("the writer ended before its publish: " << paused.Report().message);
    SaveReport a;
    // The next job, holding the lock, lets the paused writer finish right before its own
    // metadata's publish.
    auto store = std::make_shared<BeforeCommitStore>(OpenStore(root), [&] {
      paused.Continue();
      a = paused.Wait();
    });
    std::string b_message;
    try {
      SaveWhenUnlocked(next_id, store);
      FAIL_CHECK("the next job committed over the paused writer's commit");
    } catch (const CollectiveError& e) {
      CHECK(e.outcome() == Outcome::kFailed);
      REQUIRE(!e.failures().empty());
      CHECK(e.failures()[0].code == ErrorCode::kAlreadyExists);
      b_message = e.failures()[0].message;
    }
    if (trial == 0) {
      WARN("the paused writer's save: [" << a.code << "] " << a.message);
      WARN("the next job's save: " << b_message);
    }
    // Its lock was lost meanwhile, so its commit's outcome was unknown to it, which it settled
    // from the metadata in place: its own.
    CHECK(a.code == 'C');
    CHECK_THAT(b_message,
               Contains("another writer committed at " + root + " since this save began") &&
                   Contains("nothing of this save was committed"));
    CHECK(CheckpointId(root) == paused_id);  // the paused writer's, bit-exact
    // The next job's files were aborted. The paused writer, its lock lost, removed nothing: the
    // replaced checkpoints' files wait for the next locked save's clean-up.
    for (const auto& n : UnreferencedDataFiles(root)) CHECK(before.count(n) == 1);
  }
}
#else
TEST_CASE("s3 lease: backend", "[s3]") { dcp::testing::SkipTestCase(dcp::testing::S3SkipReason()); }
#endif
