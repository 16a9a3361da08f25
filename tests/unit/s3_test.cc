// s3:// against the real test server (Ceph's RADOS Gateway, started by tests/s3/start_rgw.sh):
// multipart uploads and ranged reads, the conditional commit, the lock lease, and the faults
// that apply to an object store: a connection dropped mid-upload, a 5xx retried, a 4xx not
// retried (one injected through the client's test hook, one a real 403 from the server), an
// abandoned upload aborted. Every test SKIPs, printing why, where no server is running.
#include <sys/wait.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <thread>

#include "dcp/dcp.h"
#include "dcp/proto/executor.h"
#include "dcp/storage/format/dcp_layout.h"
#include "dcp/storage/registry.h"
#include "support/s3_test_support.h"
#include "support/test_support.h"
#ifdef DCP_HAVE_S3
#include "dcp/storage/backends/s3/s3_store.h"
#endif

using namespace dcp;
using namespace dcp::testing;
using Catch::Matchers::Contains;

#ifdef DCP_HAVE_S3
namespace {

bool HaveServer() { return S3ServerOrSkip(); }

// Records what the hook saw; `decide` picks the fault for each request.
struct Hook {
  std::mutex mu;
  std::vector<S3RequestInfo> seen;
  std::function<S3Fault(const S3RequestInfo&)> decide;
  explicit Hook(std::function<S3Fault(const S3RequestInfo&)> d) : decide(std::move(d)) {
    SetS3FaultHookForTesting([this](const S3RequestInfo& info) {
      {
        std::lock_guard<std::mutex> lock(mu);
        seen.push_back(info);
      }
      return decide(info);  // unlocked: it may make requests itself
    });
  }
  ~Hook() { SetS3FaultHookForTesting(nullptr); }
  int Count(const std::function<bool(const S3RequestInfo&)>& pred) {
    std::lock_guard<std::mutex> lock(mu);
    int n = 0;
    for (const auto& s : seen) n += pred(s);
    return n;
  }
};

bool IsPart(const S3RequestInfo& i, int part) {
  return i.method == "PUT" && i.query.find("partNumber=" + std::to_string(part) + "&") == 0;
}

struct EnvGuard {
  std::string name;
  EnvGuard(const char* n, const char* v) : name(n) { ::setenv(n, v, 1); }
  ~EnvGuard() { ::unsetenv(name.c_str()); }
};

std::string Pattern(size_t n, uint64_t seed) {
  std::string s(n, '\0');
  FillRandom(s.data(), n, seed);
  return s;
}

// A state with one 12 MiB tensor (two 8 MiB parts) and small ones (single PUTs).
struct BigState {
  TensorView big = RandomTensor(DType::kFloat32, {3 << 20}, 7);
  TensorView small = RandomTensor(DType::kInt64, {33}, 8);
  StateDict sd;
  BigState() { sd.Set("big", big).Set("small", small); }
};
struct BigBack {
  TensorView big = TensorView::Allocate(DType::kFloat32, {3 << 20});
  TensorView small = TensorView::Allocate(DType::kInt64, {33});
  StateDict sd;
  BigBack() { sd.Set("big", big).Set("small", small); }
};

}  // namespace

TEST_CASE("s3: a writer sizes its parts to its buffer limit", "[s3]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("limit");
  auto store = OpenStore(root);
  const std::string bytes = Pattern(48 << 20, 3);
  // Parts of an upload: by default 8 MiB, 6 of them.
  auto parts_of = [&](const std::string& name, std::optional<size_t> limit, bool late) {
    Hook hook([](const S3RequestInfo&) { return S3Fault::kNone; });
    auto w = store->Create(name);
    if (limit && !late) w->LimitBuffers(*limit);
    w->Append(bytes.data(), 1 << 20);
    if (limit && late) w->LimitBuffers(*limit);  // parts are being filled: ignored
    w->Append(bytes.data() + (1 << 20), bytes.size() - (1 << 20));
    w->Close();
    std::string back(bytes.size(), '\0');
    store->Open(name)->ReadAt(0, back.data(), back.size());
    CHECK(back == bytes);
    return hook.Count([](const S3RequestInfo& i) {
      return i.method == "PUT" && i.query.find("partNumber=") == 0;
    });
  };
  CHECK(parts_of("default", std::nullopt, false) == 6);
  // 12 MiB for one part filling and one in flight: 6 MiB parts, 8 of them.
  CHECK(parts_of("limited", size_t{12} << 20, false) == 8);
  // Below two minimum parts: S3's floor of 5 MiB parts.
  CHECK(parts_of("floor", size_t{4} << 20, false) == 10);
  // A roomy limit keeps the 8 MiB parts (and at most parts_in_flight of them in flight).
  CHECK(parts_of("roomy", size_t{1} << 30, false) == 6);
  CHECK(parts_of("late", size_t{12} << 20, true) == 6);
}

TEST_CASE("s3: multipart uploads in parallel parts with ranged and prefetched reads", "[s3]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("objects");
  auto store = OpenStore(root);
  Hook hook([](const S3RequestInfo&) { return S3Fault::kNone; });
  const std::string bytes = Pattern((21 << 20) + 123, 1);  // 3 parts of 8 MiB: 8 + 8 + 5
  {
    auto w = store->Create("big");
    size_t pos = 0, step = 1;
    while (pos < bytes.size()) {  // odd-sized appends across part boundaries
      const size_t n = std::min(bytes.size() - pos, step * 777777 % (3 << 20) + 1);
      w->Append(bytes.data() + pos, n);
      pos += n;
      ++step;
    }
    w->Sync();
    CHECK_FALSE(store->Size("big"));  // invisible until Close
    w->Close();
  }
  CHECK(hook.Count([](const S3RequestInfo& i) {
    return i.method == "POST" && i.query == "uploads=";
  }) == 1);
  CHECK(hook.Count([](const S3RequestInfo& i) {
    return IsPart(i, 1) || IsPart(i, 2) || IsPart(i, 3);
  }) == 3);
  CHECK(hook.Count([](const S3RequestInfo& i) { return IsPart(i, 4); }) == 0);
  REQUIRE(store->Size("big") == bytes.size());
  auto r = store->Open("big");
  std::string back(bytes.size(), '\0');
  r->ReadAt(0, back.data(), back.size());  // split into parallel ranged GETs
  CHECK(back == bytes);
  // Prefetch, then 1 MiB steps as the checkpoint reader does, across part boundaries.
  std::string piece(20 << 20, '\0');
  r->Prefetch(1000, piece.size());
  for (size_t off = 0; off < piece.size(); off += 1 << 20) {
    r->ReadAt(1000 + off, piece.data() + off, std::min<size_t>(1 << 20, piece.size() - off));
  }
  CHECK(piece == bytes.substr(1000, piece.size()));
  char tail[200];
  r->ReadAt(bytes.size() - 200, tail, 200);
  CHECK(std::string(tail, 200) == bytes.substr(bytes.size() - 200));
  CHECK_THROWS_AS(r->ReadAt(bytes.size() - 10, tail, 20), CorruptionError);
  CHECK(store->ListIncomplete().empty());
}

TEST_CASE("s3: the commit is a conditional create so two jobs cannot both commit", "[s3]") {
  if (!HaveServer()) return;
  auto store = OpenStore(S3TestRoot("commit"));
  store->PublishNew("metadata.dcp", "first job");
  CHECK_THROWS_AS(store->PublishNew("metadata.dcp", "second job"), AlreadyExistsError);
  CHECK(store->ReadAll("metadata.dcp", UINT64_MAX) == "first job");
  // A save that passed its "already exists" check while another job committed first loses at
  // the commit: here the other job's metadata appears between SetUp and Finish.
  const std::string root = S3TestRoot("race");
  BigState s;
  std::vector<std::exception_ptr> errors = RunRanks(1, [&](int, Communicator& comm) {
    SaveOptions o;
    o.storage.files_per_rank = 1;
    // The other job commits right after our data is written (hook on our metadata PUT).
    static std::atomic<bool> done{false};
    done = false;
    Hook hook([&](const S3RequestInfo& i) {
      if (i.method == "PUT" && i.key.find("metadata.dcp") != std::string::npos &&
          !done.exchange(true)) {
        OpenStore(root)->PublishAtomically("metadata.dcp", "other job's commit");
      }
      return S3Fault::kNone;
    });
    Save(s.sd, root, comm, o);
  });
  REQUIRE(errors.size() == 1);
  REQUIRE(errors[0]);
  try {
    std::rethrow_exception(errors[0]);
  } catch (const CollectiveError& e) {
    CHECK(e.failures()[0].code == ErrorCode::kAlreadyExists);
  }
  CHECK(OpenStore(root)->ReadAll("metadata.dcp", UINT64_MAX) == "other job's commit");
  for (const auto& n : OpenStore(root)->List()) CHECK_FALSE(IsDataObjectName(n));  // aborted
}

TEST_CASE("s3: an expired lock lease is taken over and a late release frees nothing",
          "[s3][lock]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("lease");
  std::unique_ptr<StoreLock> crashed;
  {
    EnvGuard lease("DCP_S3_LOCK_LEASE_S", "1");
    crashed = OpenStore(root)->TryLock("crashed-job");
    REQUIRE(crashed);
    SuspendS3LockRenewalForTesting(*crashed);  // crashed: its lease is no longer renewed
    CHECK_THROWS_AS(OpenStore(root)->TryLock("next-job"), LockedError);
  }
  std::this_thread::sleep_for(std::chrono::milliseconds(1300));
  auto next = OpenStore(root)->TryLock("next-job");  // the lease expired: taken over
  REQUIRE(next);
  crashed->Release();  // the old holder's late release must not free the new holder's lock
  const std::string msg = MessageOf<LockedError>([&] { OpenStore(root)->TryLock("third"); });
  CHECK_THAT(msg, Contains("next-job") && Contains(root));
  next->Release();
  CHECK(OpenStore(root)->TryLock("third"));
}

TEST_CASE("fault: s3 connection dropped mid-upload is retried and the save completes",
          "[fault][s3]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("drop");
  Hook hook([](const S3RequestInfo& i) {
    // The first attempt of the second part and of the small object's PUT: half the body, cut.
    if (i.attempt == 0 && (IsPart(i, 2) || (i.method == "PUT" && i.query.empty() &&
                                            i.key.find(".data") != std::string::npos))) {
      return S3Fault::kDropMidBody;
    }
    return S3Fault::kNone;
  });
  BigState s;
  SaveOptions so;
  so.storage.files_per_rank = 2;  // the big tensor in one file (multipart), the small in another
  Save(s.sd, root, so);
  const int dropped = hook.Count([](const S3RequestInfo& i) {
    return i.attempt == 0 && (IsPart(i, 2) || (i.method == "PUT" && i.query.empty() &&
                                               i.key.find(".data") != std::string::npos));
  });
  CHECK(dropped == 2);
  CHECK(hook.Count([](const S3RequestInfo& i) { return i.attempt == 1; }) ==
        2);  // each retried once
  BigBack b;
  Load(b.sd, root);
  CHECK(SameElements(b.big, s.big));
  CHECK(SameElements(b.small, s.small));
  CHECK(OpenStore(root)->ListIncomplete().empty());
  WARN("s3 connections dropped mid-upload: " << dropped << ", all retried, checkpoint intact");
}

TEST_CASE("fault: s3 5xx is retried with backoff and save and load complete", "[fault][s3]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("retry");
  Hook hook([](const S3RequestInfo& i) {
    // Twice for every request: parts, the commit, HEADs, ranged GETs, listings.
    return i.attempt < 2 ? S3Fault::kServerError503 : S3Fault::kNone;
  });
  BigState s;
  Save(s.sd, root);
  BigBack b;
  Load(b.sd, root);
  CHECK(SameElements(b.big, s.big));
  const int first = hook.Count([](const S3RequestInfo& i) { return i.attempt == 0; });
  CHECK(first > 5);
  CHECK(hook.Count([](const S3RequestInfo& i) { return i.attempt == 2; }) == first);
  CHECK(hook.Count([](const S3RequestInfo& i) { return i.attempt == 3; }) == 0);
  WARN("s3 requests answered 503 twice then served: " << first);
}

TEST_CASE(
    "fault: s3 persistent 5xx fails the save after bounded retries: the previous "
    "checkpoint stays and no upload is left",
    "[fault][s3]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("fail5xx");
  BigState v1;
  Save(v1.sd, root);
  EnvGuard retries("DCP_S3_MAX_RETRIES", "2");
  BigState v2;
  FillRandom(v2.big.data, v2.big.nbytes(), 99);
  SaveOptions so;
  so.storage.overwrite = true;
  {
    Hook hook([](const S3RequestInfo& i) {
      return IsPart(i, 2) ? S3Fault::kServerError503 : S3Fault::kNone;
    });
    try {
      Save(v2.sd, root, so);
      FAIL("the save succeeded through a persistent 503");
    } catch (const CollectiveError& e) {
      CHECK(e.failures()[0].code == ErrorCode::kIo);
      CHECK_THAT(e.what(), Contains("503") && Contains("after 3 attempts") && Contains(root));
    }
    CHECK(hook.Count([](const S3RequestInfo& i) { return IsPart(i, 2); }) == 3);  // 1 + 2 retries
  }
  BigBack b;
  Load(b.sd, root);
  CHECK(SameElements(b.big, v1.big));  // the previous checkpoint, intact
  auto store = OpenStore(root);
  CHECK(store->ListIncomplete().empty());  // the failed upload was aborted
  int data = 0;
  for (const auto& n : store->List()) data += IsDataObjectName(n);
  CHECK(data == 1);
}

TEST_CASE("fault: s3 4xx is not retried (an injected 400 and a real 403 from the server)",
          "[fault][s3]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("fail4xx");
  {
    Hook hook([](const S3RequestInfo& i) {
      return IsPart(i, 1) ? S3Fault::kClientError400 : S3Fault::kNone;
    });
    BigState s;
    try {
      Save(s.sd, root);
      FAIL("the save succeeded through a 400");
    } catch (const CollectiveError& e) {
      CHECK_THAT(e.what(), Contains("400") && Contains("InvalidRequest"));
    }
    CHECK(hook.Count([](const S3RequestInfo& i) { return IsPart(i, 1); }) == 1);  // no retry
  }
  CHECK(OpenStore(root)->ListIncomplete().empty());
  // Wrong credentials: the server's own 403, once, with the bucket, key and variables named.
  S3Options wrong;
  wrong.secret_access_key = "not-the-secret";
  auto bad = MakeS3Store(root.substr(5), wrong);
  const uint64_t before = S3RequestCountForTesting();
  try {
    bad->Size("metadata.dcp");
    FAIL("a wrong secret was accepted");
  } catch (const IoError& e) {
    CHECK_FALSE(e.retryable());
    CHECK_THAT(e.what(), Contains("403") && Contains(root + "/metadata.dcp") &&
                             Contains("AWS_SECRET_ACCESS_KEY"));
  }
  CHECK(S3RequestCountForTesting() - before == 1);
  CHECK_THROWS_AS(OpenStore(root)->Open("absent"), NotFoundError);  // 404
}

TEST_CASE("s3: a writer destroyed without Close aborts its multipart upload", "[s3]") {
  if (!HaveServer()) return;
  auto store = OpenStore(S3TestRoot("abort"));
  const std::string bytes = Pattern(17 << 20, 3);
  {
    auto w = store->Create("abandoned");
    w->Append(bytes.data(), bytes.size());  // two parts uploaded, the third buffered
    CHECK(store->ListIncomplete().size() == 1);
  }
  CHECK(store->ListIncomplete().empty());
  CHECK_FALSE(store->Size("abandoned"));
}

namespace {
// A multipart upload of `name` left behind as by a process killed mid-save: its writer's abort
// is refused (the hook answers 400), so the upload stays in progress.
void LeaveUnfinishedUpload(Store& store, const std::string& name) {
  Hook hook([](const S3RequestInfo& i) {
    return i.method == "DELETE" && i.query.find("uploadId=") == 0 ? S3Fault::kClientError400
                                                                  : S3Fault::kNone;
  });
  const std::string bytes = Pattern(9 << 20, 5);
  auto w = store.Create(name);
  w->Append(bytes.data(), bytes.size());  // one 8 MiB part uploaded, the rest buffered
}
}  // namespace

TEST_CASE("s3: the next save at a location discards a crashed save's unfinished uploads", "[s3]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("crashed-upload");
  auto store = OpenStore(root);
  store->CreateRoot();
  LeaveUnfinishedUpload(*store, "data-deadbeef-r0-b0.data");
  LeaveUnfinishedUpload(*store, "data-deadbeef-r1-b0.data");
  REQUIRE(store->ListIncomplete() ==
          std::vector<std::string>{"data-deadbeef-r0-b0.data", "data-deadbeef-r1-b0.data"});
  BigState s;
  Save(s.sd, root);  // commits, then discards what is unfinished under its lock
  CHECK(store->ListIncomplete().empty());
  BigBack b;
  Load(b.sd, root);
  CHECK(SameElements(b.big, s.big));
  // An unfinished upload in a sub-location is that location's, not this one's.
  auto child = OpenStore(root + "/child");
  child->CreateRoot();
  LeaveUnfinishedUpload(*child, "data-cafe-r0-b0.data");
  CHECK(store->ListIncomplete().empty());
  CHECK(child->ListIncomplete().size() == 1);
  SaveOptions so;
  so.storage.overwrite = true;
  Save(s.sd, root, so);
  CHECK(child->ListIncomplete().size() == 1);
#ifdef DCP_CLI
  // `dcp incomplete` lists it; --abort is refused while a save holds the location's lock, and
  // discards it once the lock is free.
  auto cli = [](const std::string& args, int* rc) {
    std::string out;
    FILE* p = ::popen((std::string(DCP_CLI) + " " + args + " 2>&1").c_str(), "r");
    REQUIRE(p != nullptr);
    char buf[512];
    while (size_t n = std::fread(buf, 1, sizeof(buf), p)) out.append(buf, n);
    *rc = WEXITSTATUS(::pclose(p));
    return out;
  };
  int rc = -1;
  CHECK_THAT(cli("incomplete " + root + "/child", &rc),
             Contains("unfinished data-cafe-r0-b0.data"));
  CHECK(rc == 0);
  {
    auto lock = child->TryLock("a save in progress");
    REQUIRE(lock);
    CHECK_THAT(cli("incomplete " + root + "/child --abort", &rc), Contains("a save in progress"));
    CHECK(rc == 2);
    CHECK(child->ListIncomplete().size() == 1);
  }
  CHECK_THAT(cli("incomplete " + root + "/child --abort", &rc),
             Contains("aborted data-cafe-r0-b0.data"));
  CHECK(rc == 0);
  CHECK(child->ListIncomplete().empty());
  CHECK_THAT(cli("incomplete " + root + "/child", &rc), Contains("no unfinished writes"));
  // verify warns of one left beside a checkpoint, which stays valid.
  LeaveUnfinishedUpload(*store, "data-feed-r0-b0.data");
  CHECK_THAT(cli("verify " + root, &rc), Contains("unfinished write 'data-feed-r0-b0.data'"));
  CHECK(rc == 0);
#endif
}

TEST_CASE("s3: retention removes a crashed step's unfinished uploads, though it holds no object",
          "[s3]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("crashed-step");
  LocalCommunicator comm;
  ManagerOptions o;
  o.keep_last = 1;
  CheckpointManager m(root, comm, nullptr, o);
  BigState s;
  m.Save(1, s.sd);
  {
    // Step 2 dies mid-upload and its abort never reaches the server: a killed process.
    Hook hook([](const S3RequestInfo& i) {
      return IsPart(i, 2) || (i.method == "DELETE" && i.query.find("uploadId=") == 0)
                 ? S3Fault::kClientError400
                 : S3Fault::kNone;
    });
    CHECK_THROWS_AS(m.Save(2, s.sd), CollectiveError);
  }
  auto step2 = OpenStore(m.PathFor(2));
  REQUIRE(step2->ListIncomplete().size() == 1);
  m.Save(3, s.sd);  // retention: step 2 is a crashed save's leftovers
  CHECK(step2->ListIncomplete().empty());
  CHECK(step2->List().empty());
  CHECK(m.CompleteSteps() == std::vector<int64_t>{3});
}

TEST_CASE("s3: S3CoalesceRanges merges adjacent, overlapping and near ranges into few requests",
          "[s3]") {
  const uint64_t MiB = uint64_t{1} << 20;
  // 64 adjacent 4 KiB items: one request (before: one each).
  std::vector<ByteRange> items;
  for (uint64_t i = 0; i < 64; ++i) items.push_back({1000 + i * 4096, 4096});
  CHECK(S3CoalesceRanges(items, kS3CoalesceGapBytes, 8 * MiB) ==
        std::vector<ByteRange>{{1000, 64 * 4096}});
  // Out of order, overlapping, a small gap read through, a large gap not, empty ones dropped.
  CHECK(S3CoalesceRanges({{5000, 100}, {0, 3000}, {2000, 2000}, {9000, 0}, {4 * MiB, 10}}, 1000,
                         8 * MiB) == std::vector<ByteRange>{{0, 5100}, {4 * MiB, 10}});
  // A long span cut into equal requests of at most the request size (not 8 + 8 + 4).
  CHECK(S3CoalesceRanges({{0, 20 * MiB}}, 0, 8 * MiB) ==
        std::vector<ByteRange>{{0, 20 * MiB / 3 + 1},
                               {20 * MiB / 3 + 1, 20 * MiB / 3 + 1},
                               {2 * (20 * MiB / 3 + 1), 20 * MiB - 2 * (20 * MiB / 3 + 1)}});
  CHECK(S3CoalesceRanges({}, 0, 8 * MiB).empty());
  CHECK_THROWS_AS(S3CoalesceRanges({{0, 1}}, 0, 0), InvalidArgumentError);
}

TEST_CASE("s3: concurrency and prefetch follow the throughput target", "[s3]") {
  S3Options o;
  o.access_key_id = "k";
  o.secret_access_key = "s";
  o.endpoint = "http://127.0.0.1:1";
  o.target_gbps = 25;
  const S3Options a = S3Options::FromEnvironment(o);
  CHECK(a.max_connections == 10);  // 25 / kS3ConnectionGbps
  CHECK(a.parts_in_flight == 10);
  CHECK(a.read_ahead_parts == 10);
  o.target_gbps = 0.5;  // at least 2
  CHECK(S3Options::FromEnvironment(o).max_connections == 2);
  o.max_connections = 3;  // given: kept
  o.read_ahead_parts = 5;
  const S3Options b = S3Options::FromEnvironment(o);
  CHECK(b.max_connections == 3);
  CHECK(b.parts_in_flight == 3);
  CHECK(b.read_ahead_parts == 5);
  // The URI's query takes them (credentials come from the environment).
  if (std::getenv("AWS_ACCESS_KEY_ID") && std::getenv("AWS_SECRET_ACCESS_KEY")) {
    CHECK_NOTHROW(OpenStore("s3://dcp-opt/x?target_gbps=40&max_connections=16"));
  }
  CHECK_THROWS_AS(OpenStore("s3://dcp-opt/x?target_gbps=0"), InvalidArgumentError);
}

TEST_CASE("s3: the part size follows the target and grows past 1000 parts", "[s3]") {
  S3Options o;
  o.access_key_id = "k";
  o.secret_access_key = "s";
  o.endpoint = "http://127.0.0.1:1";
  // What one connection carries in kS3RequestSeconds at its share of the target.
  o.target_gbps = 25;  // 10 connections of 2.5 Gbit/s: 8 MiB, the CRT's size
  CHECK(S3Options::FromEnvironment(o).part_size == uint64_t{8} << 20);
  o.target_gbps = 40;
  o.max_connections = 8;  // 5 Gbit/s each: 16 MiB
  CHECK(S3Options::FromEnvironment(o).part_size == uint64_t{16} << 20);
  o.target_gbps = 400;  // 50 Gbit/s each: at most 64 MiB
  CHECK(S3Options::FromEnvironment(o).part_size == uint64_t{64} << 20);
  o.target_gbps = 0.5;
  o.max_connections = 0;  // 2 connections of 0.25 Gbit/s: S3's 5 MiB minimum
  CHECK(S3Options::FromEnvironment(o).part_size == uint64_t{5} << 20);
  o.part_size = uint64_t{12} << 20;  // given: kept
  CHECK(S3Options::FromEnvironment(o).part_size == uint64_t{12} << 20);
  {
    EnvGuard env("DCP_S3_PART_SIZE_MIB", "6");
    o.part_size = 0;
    CHECK(S3Options::FromEnvironment(o).part_size == uint64_t{6} << 20);
  }
  // Doubled every 1,000 parts: 10,000 parts from 8 MiB hold more than S3's 5 TiB limit, so no
  // object a writer can make fails at part 10,001 (it did with fixed 8 MiB parts past 78 GiB).
  const uint64_t base = uint64_t{8} << 20;
  CHECK(S3PartSize(base, 0) == base);
  CHECK(S3PartSize(base, 999) == base);
  CHECK(S3PartSize(base, 1000) == 2 * base);
  CHECK(S3PartSize(base, 9999) == base << 9);
  uint64_t total = 0, at_100gb = 0;
  for (size_t i = 0; i < kS3MaxParts; ++i) {
    total += S3PartSize(base, i);
    if (at_100gb == 0 && total >= uint64_t{100} * 1000 * 1000 * 1000)
      at_100gb = S3PartSize(base, i);
  }
  CHECK(total > uint64_t{5} << 40);
  CHECK(at_100gb == uint64_t{64} << 20);
}

TEST_CASE("s3: a load of many small adjacent items and a column-sharded load make few requests",
          "[s3]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("coalesce");
  // 64 small tensors in one file, and a 2-D one of 4 KiB rows.
  StateDict sd, back;
  std::vector<TensorView> src, dst;
  for (int i = 0; i < 64; ++i) {
    src.push_back(RandomTensor(DType::kFloat32, {1024}, 100 + i));
    dst.push_back(RandomTensor(DType::kFloat32, {1024}, 999));
    sd.Set("t" + std::to_string(i), src.back());
    back.Set("t" + std::to_string(i), dst.back());
  }
  SaveOptions so;
  so.storage.files_per_rank = 1;
  Save(sd, root, so);
  auto is_data_get = [](const S3RequestInfo& i) {
    return i.method == "GET" && i.key.find("metadata") == std::string::npos && i.query.empty();
  };
  {
    Hook hook([](const S3RequestInfo&) { return S3Fault::kNone; });
    Load(back, root);
    // One ranged GET for all 64 items (before: 64).
    CHECK(hook.Count(is_data_get) <= 2);
  }
  for (size_t i = 0; i < src.size(); ++i) {
    CHECK(std::memcmp(src[i].data, dst[i].data, src[i].nbytes()) == 0);
  }

  // A [4096, 1024] f32 tensor (16 MiB) saved whole, loaded as 4 column blocks (4 ranks' worth
  // in one rank): each block reads the whole stored item through scratch, and its CRC comes with
  // it, so the verify pass does not read it again.
  const std::string root2 = S3TestRoot("columns");
  TensorView full = RandomTensor(DType::kFloat32, {4096, 1024}, 5);
  TensorView got = RandomTensor(DType::kFloat32, {4096, 1024}, 6);
  StateDict one;
  one.Set("w", full);
  Save(one, root2);
  InProcessGroup group(4);
  Hook hook([](const S3RequestInfo&) { return S3Fault::kNone; });
  std::vector<std::thread> ranks;
  std::vector<std::exception_ptr> errors(4);
  for (int r = 0; r < 4; ++r) {
    ranks.emplace_back([&, r] {
      try {
        ShardedTensor st{DType::kFloat32, {4096, 1024}, {}};
        st.local_shards.push_back({got.Narrow({0, 256 * r}, {4096, 256}), {0, 256 * r}});
        StateDict mine;
        mine.Set("w", std::move(st));
        Load(mine, root2, group.communicator(r));
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : ranks) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
  CHECK(std::memcmp(full.data, got.data, full.nbytes()) == 0);
  // Cooperative reads: the item's owner (rank 0, its writer) reads its 16 MiB once in 8 MiB
  // requests and sends each rank its columns = 2, plus one small ranged GET of the data file's
  // index (version 2), which only the owner reads (before: 4 ranks x 2 + 4 indexes).
  CHECK(hook.Count(is_data_get) <= 2 + 1);
}

// The most requests of a kind in flight at once: each one `Holding` selects is held 40 ms in
// the hook, so requests meant to overlap do.
struct Overlap {
  std::atomic<int> now{0}, most{0};
  std::function<S3Fault(const S3RequestInfo&)> Holding(
      std::function<bool(const S3RequestInfo&)> selects) {
    return [this, selects](const S3RequestInfo& i) {
      if (selects(i)) {
        const int n = ++now;
        int seen = most.load();
        while (n > seen && !most.compare_exchange_weak(seen, n)) {
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(40));
        --now;
      }
      return S3Fault::kNone;
    };
  }
};

TEST_CASE(
    "s3: a load streams a file's items with ranged GETs in flight from one item into the next "
    "and queries each file's size once",
    "[s3]") {
  if (!HaveServer()) return;
  // Six items of one 5 MiB part each, read back to back: before ReadManyStreaming, a load read
  // them one at a time, one GET in flight; as one stream they overlap (read_ahead_parts: 4).
  const std::string root = S3TestRoot("many-stream") + "?part_size_mib=5";
  auto store = OpenStore(root);
  constexpr size_t kPart = size_t{5} << 20, kItems = 6;
  std::string bytes(kPart * kItems, '\0');
  for (size_t i = 0; i < bytes.size(); ++i) bytes[i] = static_cast<char>((i * 131) >> 7);
  {
    auto w = store->Create("obj");
    w->Append(bytes.data(), bytes.size());
    w->Close();
  }
  std::vector<std::string> got(kItems, std::string(kPart, '\0'));
  std::vector<ReadTarget> targets;
  for (size_t k = 0; k < kItems; ++k) targets.push_back({k * kPart, got[k].data(), kPart});
  Overlap overlap;
  std::vector<std::pair<size_t, size_t>> landed;  // (target, end of the piece)
  {
    Hook hook(overlap.Holding([](const S3RequestInfo& i) { return i.method == "GET"; }));
    auto in = store->Open("obj");
    in->ReadManyStreaming(targets, 1 << 20, [&](size_t t, size_t pos, size_t len) {
      landed.push_back({t, pos + len});
    });
  }
  for (size_t k = 0; k < kItems; ++k) {
    CHECK(got[k] == bytes.substr(k * kPart, kPart));
  }
  // Every target reported, in order, each to its end.
  REQUIRE(landed.size() >= kItems);
  for (size_t j = 1; j < landed.size(); ++j) CHECK(landed[j - 1].first <= landed[j].first);
  for (size_t k = 0; k < kItems; ++k) {
    CHECK(std::count(landed.begin(), landed.end(), std::pair<size_t, size_t>{k, kPart}) == 1);
  }
  CHECK(overlap.most >= 2);

  // A load of items too large to be coalesced (>= 8 MiB) but each one GET (16 MiB parts), in
  // one file, read by one thread, reads them as one stream too: before, one GET was in flight
  // at a time.
  const std::string ckpt = S3TestRoot("many-stream-load") + "?part_size_mib=16";
  constexpr int64_t kItemFloats = (int64_t{9} << 20) / 4;
  StateDict sd, back;
  std::vector<TensorView> src, dst;
  for (size_t k = 0; k < kItems; ++k) {
    src.push_back(RandomTensor(DType::kFloat32, {kItemFloats}, 40 + k));
    dst.push_back(RandomTensor(DType::kFloat32, {kItemFloats}, 99));
    sd.Set("t" + std::to_string(k), src.back());
    back.Set("t" + std::to_string(k), dst.back());
  }
  SaveOptions so;
  so.storage.files_per_rank = 1;
  {
    // The save asks what the location holds (a checkpoint of each layout) in one round trip,
    // not one HEAD after another.
    Hook hook(overlap.Holding(
        [](const S3RequestInfo& i) { return i.method == "HEAD" && !i.key.empty(); }));
    overlap.most = 0;
    Save(sd, ckpt, so);
    // dcp's metadata, PyTorch DCP's, and safetensors' index and single file (before: 1; then 3,
    // safetensors' two asked one after the other).
    CHECK(overlap.most >= 4);
  }
  LoadOptions lo;
  lo.storage.read_threads = 1;
  overlap.most = 0;
  {
    Hook hook(overlap.Holding([](const S3RequestInfo& i) {
      return i.method == "GET" && i.key.find(".data") != std::string::npos && i.query.empty();
    }));
    Load(back, ckpt, lo);
    // The data file's size comes from the location's listing, made while the metadata is read
    // (Store::ListSizes; before: a HEAD per file after the metadata); its index and its items
    // are read without a HEAD of their own (Store::OpenKnownSize).
    CHECK(hook.Count([](const S3RequestInfo& i) {
      return i.method == "HEAD" && i.key.find(".data") != std::string::npos;
    }) == 0);
    CHECK(hook.Count([](const S3RequestInfo& i) {
      return i.method == "GET" && i.query.find("list-type") != std::string::npos;
    }) == 1);
    // The metadata is one ranged GET, whose answer states its size (Store::ReadPrefix; before:
    // a HEAD, then the GET).
    CHECK(hook.Count([](const S3RequestInfo& i) {
      return i.key.find("metadata.dcp") != std::string::npos;
    }) == 1);
    // The file's index comes with the metadata (DataFile::index_copy; before: one more GET,
    // after the metadata's and before the first item's): a GET per item, nothing else.
    CHECK(hook.Count([](const S3RequestInfo& i) {
      return i.method == "GET" && i.key.find(".data") != std::string::npos && i.query.empty();
    }) == static_cast<int>(kItems));
  }
  for (size_t k = 0; k < kItems; ++k) CHECK(SameElements(src[k], dst[k]));
  CHECK(overlap.most >= 2);
}

TEST_CASE(
    "s3: after its publish a save asks the lock and lists together and the bucket is asked once "
    "per process",
    "[s3]") {
  if (!HaveServer()) return;
  // Round trips before the first upload and after the last are the save's fixed cost on an
  // object store: at 256 MiB they were 6% of a 4-rank save. Before: the lock's check after the
  // publish, then the two listings; and a HEAD of the bucket by every rank of every save.
  const std::string ckpt = S3TestRoot("commit-trips");
  BigState state;
  SaveOptions so;
  so.storage.overwrite = true;
  Save(state.sd, ckpt, so);  // this process has now seen the bucket
  Overlap overlap;
  bool published = false;
  std::mutex mu;
  Hook hook(overlap.Holding([&](const S3RequestInfo& i) {
    std::lock_guard<std::mutex> lock(mu);
    if (i.method == "PUT" && i.key.find("metadata.dcp") != std::string::npos) {
      published = true;
      return false;
    }
    return published && (i.key.find(".dcp.lock") != std::string::npos ||
                         i.query.find("list-type") != std::string::npos ||
                         i.query.find("uploads") != std::string::npos);
  }));
  Save(state.sd, ckpt, so);
  // The lock's check, List and ListIncomplete in flight together (before: 2, the listings).
  CHECK(overlap.most >= 3);
  auto count = [&](const char* method, const std::string& key) {
    return hook.Count([&](const S3RequestInfo& i) {
      return i.method == method && i.key.find(key) != std::string::npos &&
             (!key.empty() || i.key.empty());
    });
  };
  CHECK(count("DELETE", ".dcp.lock") == 1);
  CHECK(count("HEAD", "") == 0);  // before: 1
  // The replaced checkpoint's data files go in one multi-object delete (before: a DELETE each).
  CHECK(count("DELETE", ".data") == 0);
  CHECK(hook.Count([](const S3RequestInfo& i) {
    return i.method == "POST" && i.query.rfind("delete", 0) == 0;
  }) == 1);
  BigBack back;
  Load(back.sd, ckpt);
  CHECK(SameElements(back.big, state.big));
  // The lock was released: another save takes it at once.
  Save(state.sd, ckpt, so);
}

TEST_CASE(
    "s3: ReadPrefix states the size in one GET and ListSizes lists sizes and a load judges a "
    "short or missing data file by its own size",
    "[s3]") {
  if (!HaveServer()) return;
  auto store = OpenStore(S3TestRoot("prefix-sizes"));
  const std::string big = Pattern((size_t{3} << 20) + 5, 11), small = Pattern(10, 12);
  for (const auto& [name, bytes] :
       {std::pair<std::string, const std::string*>{"big", &big}, {"small", &small}}) {
    auto w = store->Create(name);
    w->Append(bytes->data(), bytes->size());
    w->Close();
  }
  store->PublishAtomically("empty", "");
  uint64_t size = 0;
  {
    Hook hook([](const S3RequestInfo&) { return S3Fault::kNone; });
    CHECK(store->ReadPrefix("big", 1 << 20, &size) == big.substr(0, 1 << 20));
    CHECK(size == big.size());
    CHECK(hook.Count([](const S3RequestInfo&) { return true; }) == 1);
  }
  CHECK(store->ReadPrefix("small", 1 << 20, &size) == small);
  CHECK(size == small.size());
  CHECK(store->ReadPrefix("empty", 1 << 20, &size).empty());
  CHECK(size == 0);
  CHECK_THROWS_AS(store->ReadPrefix("absent", 1 << 20, &size), NotFoundError);
  const auto listed = store->ListSizes(100);
  REQUIRE(listed);
  std::map<std::string, uint64_t> sizes(listed->begin(), listed->end());
  CHECK(sizes == std::map<std::string, uint64_t>{{"big", big.size()}, {"empty", 0}, {"small", 10}});
  CHECK_FALSE(store->ListSizes(2));  // more objects than asked for

  // A data file cut short after the save: the listing shows it short, its own size confirms
  // it, and the load names it. One that vanished likewise.
  const std::string ckpt = S3TestRoot("prefix-sizes-ckpt");
  BigState state;
  Save(state.sd, ckpt);
  auto at = OpenStore(ckpt);
  std::string victim;
  for (const auto& n : at->List()) {
    if (IsDataObjectName(n)) victim = n;
  }
  REQUIRE_FALSE(victim.empty());
  at->PublishAtomically(victim, "short");
  BigBack back;
  CHECK_THAT(MessageOf<Error>([&] { Load(back.sd, ckpt); }),
             Contains("truncated data file") && Contains(victim));
  at->Remove(victim);
  CHECK_THAT(MessageOf<Error>([&] { Load(back.sd, ckpt); }),
             Contains("is missing") && Contains(victim));
}

TEST_CASE("s3: connections outlive their store so the next store on the endpoint reuses them",
          "[s3]") {
  if (!HaveServer()) return;
  // Every save and load opens a store of its own: before, each one connected anew (over https,
  // a TLS handshake per connection) and closed its connections at its end.
  const std::string root = S3TestRoot("warm-connections");
  const std::string bytes = Pattern(100000, 5);
  OpenStore(root)->PublishAtomically("obj", bytes);
  const uint64_t before = S3ConnectionsOpenedForTesting();
  for (int i = 0; i < 5; ++i) {
    auto store = OpenStore(root);
    CHECK(store->ReadAll("obj", UINT64_MAX) == bytes);
  }
  CHECK(S3ConnectionsOpenedForTesting() - before == 0);  // before: one per store
  OpenStore(root)->Remove("obj");
}

TEST_CASE("s3: RemoveMany deletes a thousand objects per request and absent ones are no error",
          "[s3]") {
  if (!HaveServer()) return;
  const std::string root = S3TestRoot("remove-many");
  auto store = OpenStore(root);
  std::vector<std::string> names;
  for (int i = 0; i < 1100; ++i) names.push_back("obj-" + std::to_string(i) + "&<'\">");
  ParallelFor(
      names.size(), [&](size_t i) { store->PublishAtomically(names[i], "x"); }, 16);
  REQUIRE(store->List().size() == names.size());
  names.push_back("never-written");
  Hook hook([](const S3RequestInfo&) { return S3Fault::kNone; });
  store->RemoveMany(names);
  CHECK(store->List().empty());
  // Two requests (1,000 keys each at most), no DELETE one by one.
  CHECK(hook.Count([](const S3RequestInfo& i) { return i.method == "POST"; }) == 2);
  CHECK(hook.Count([](const S3RequestInfo& i) { return i.method == "DELETE"; }) == 0);
  store->RemoveMany({});
  // The two POSTs and the listing: nothing for no names.
  CHECK(hook.Count([](const S3RequestInfo&) { return true; }) == 3);
}

TEST_CASE("s3: an object's small tail travels with its last part", "[s3]") {
  if (!HaveServer()) return;
  // A data file is its items, then its index (a few KiB): the index used to be a part of its own,
  // one more PUT before the completion could go.
  auto store = OpenStore(S3TestRoot("tail") + "?part_size_mib=5");
  constexpr size_t kPart = size_t{5} << 20;
  std::string data(3 * kPart + 5000, '\0');
  for (size_t i = 0; i < data.size(); ++i) data[i] = static_cast<char>(i * 7 + (i >> 11));
  auto is_part = [](const S3RequestInfo& i) {
    return i.method == "PUT" && i.query.find("partNumber=") != std::string::npos;
  };
  {
    Hook hook([](const S3RequestInfo&) { return S3Fault::kNone; });
    auto w = store->Create("obj");
    w->Append(data.data(), 3 * kPart);
    w->Append(data.data() + 3 * kPart, 5000);
    w->Close();
    CHECK(hook.Count(is_part) == 3);  // before: 4, the last of 5,000 bytes
  }
  CHECK(store->ReadAll("obj", UINT64_MAX) == data);
  {
    // Exactly one part's worth: one plain PUT (before: an upload of one part).
    Hook hook([](const S3RequestInfo&) { return S3Fault::kNone; });
    auto w = store->Create("one");
    w->Append(data.data(), kPart);
    w->Close();
    CHECK(hook.Count(is_part) == 0);
    CHECK(hook.Count([](const S3RequestInfo& i) { return i.method == "POST"; }) == 0);
  }
  CHECK(store->ReadAll("one", UINT64_MAX) == data.substr(0, kPart));
  {
    // A tail larger than the slack is a part of its own, as before.
    Hook hook([](const S3RequestInfo&) { return S3Fault::kNone; });
    auto w = store->Create("big-tail");
    w->Append(data.data(), 2 * kPart);
    w->Append(data.data() + 2 * kPart, kPart / 2);
    w->Close();
    CHECK(hook.Count(is_part) == 3);
  }
  CHECK(store->ReadAll("big-tail", UINT64_MAX) == data.substr(0, 2 * kPart + kPart / 2));
}

#else
TEST_CASE("s3: backend", "[s3]") { dcp::testing::SkipTestCase(dcp::testing::S3SkipReason()); }
#endif
