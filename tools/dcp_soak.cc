// dcp-soak: does a long-running job's memory and handle use stay flat across checkpoints?
// (issue 27). Two modes.
//
// Soak (the default): --cycles checkpoint cycles through a CheckpointManager with asynchronous
// saves and retention (--keep), in one process (a world of one: LocalCommunicator, and a second
// one for the background saver), under <--uri>/dcp-soak (--uri: file://DIR, a plain path or
// s3://bucket/prefix, default a fresh directory under /tmp; the folder is emptied before and
// after). The manager's root is "soakfault://soak", a scheme this tool registers that opens the
// real backend at the same place (and a fault-injecting wrapper for the one step armed to fail).
// Each cycle changes one tensor of the state (and the "step" tensor) and saves it as step = cycle.
// Every --load-every cycles the manager restores the newest step into a second copy of the state
// and its bytes are compared with what was saved (CRC32C per tensor). Every --fail-every cycles the
// save's first data append fails (an injected EIO through a FaultInjectionStore,
// storage/backends/fault_store.h, wrapped around the real store for that step only): the next call
// on the manager must raise it, no step may be lost, the newest complete step must be the one
// before, every complete step must still load with its bytes, and the cycles go on. At cycles 10,
// 100, 1000 (and the last) it probes the process
// (/proc/self): current RSS (VmRSS), peak RSS (VmHWM), open file descriptors (/proc/self/fd),
// threads (Threads:), page-locked bytes (VmLck: the async staging's mlock), pinned device-staging
// bytes (PinnedBytesAllocated) and the host buffer pool's allocations (HostStagingBytesAllocated),
// and prints them as a table with the growth from cycle --warmup to the last cycle. It fails
// (exit 1) when RSS, locked or pinned bytes grow by more than --max-growth-pct, or when file
// descriptors or threads grow at all. Under AddressSanitizer/ThreadSanitizer the numbers are the
// sanitizer's (quarantine, shadow memory): they are printed but not judged.
//
//   dcp-soak [--uri file:///tmp/x | s3://bucket/prefix] [--cycles 1000] [--state-mib 64]
//            [--tensors 8] [--keep 2] [--fail-every 50] [--load-every 5] [--warmup 10]
//            [--max-growth-pct 1] [--probe-every N] [--json]
//
// Budget (--budget-check): host memory of one save and one load of a state of
// --budget-factor (8) x --budget-mib (32) MiB with StorageOptions::memory_budget_bytes =
// --budget-mib. The state (and the tensors a load writes into) is allocated and touched first;
// each phase's peak RSS (VmHWM, reset through /proc/self/clear_refs) above that baseline must
// stay within memory_budget_bytes + the staging the caller asked for + --slack-mib (printed with
// its reason). Phases: a synchronous dcp::Save (no staging asked), a dcp::Load (none), and an
// asynchronous save through the CheckpointManager (its staging is one copy of the state, by
// design: AsyncCheckpointer). The phases share the process, as a job's saves and loads do: buffers
// the host pool keeps after one phase are in the next one's peak (the "vs start" column gives the
// phase's own increase).
//
//   dcp-soak --budget-check [--uri ...] [--budget-mib 32] [--budget-factor 8] [--slack-mib 8]
//
// S3: the AWS_* environment configures the server and credentials (storage/backends/s3/
// s3_store.h). Exit status: 0 passed, 1 a check failed or an error, 2 bad arguments.
#include <dirent.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "dcp/dcp.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/staging.h"
#include "dcp/storage/backends/fault_store.h"
#include "dcp/storage/registry.h"
#include "tools/bench_util.h"
#include "tools/fill_random.h"

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DCP_SOAK_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DCP_SOAK_SANITIZER 1
#endif
#endif

using namespace dcp;
using dcp::bench::Clock;
using dcp::bench::Since;

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

// ---- /proc/self probes ----------------------------------------------------------------------

struct Probe {
  int64_t cycle = 0;
  uint64_t rss = 0;        // VmRSS, bytes
  uint64_t peak_rss = 0;   // VmHWM, bytes
  uint64_t fds = 0;        // entries of /proc/self/fd (the listing's own descriptor excluded)
  uint64_t threads = 0;    // Threads:
  uint64_t locked = 0;     // VmLck, bytes (mlock: the async staging)
  uint64_t pinned = 0;     // device-pinned staging pool, bytes allocated (proto/device/device.h)
  uint64_t host_pool = 0;  // host buffer pool, bytes allocated since start (proto/staging.h)
};

std::map<std::string, uint64_t> ReadStatus() {
  std::map<std::string, uint64_t> out;
  std::FILE* f = std::fopen("/proc/self/status", "r");
  if (f == nullptr) throw IoError("cannot open /proc/self/status", false, errno);
  char line[256];
  while (std::fgets(line, sizeof line, f)) {
    const char* colon = std::strchr(line, ':');
    if (colon == nullptr) continue;
    out[std::string(line, static_cast<size_t>(colon - line))] =
        std::strtoull(colon + 1, nullptr, 10);
  }
  std::fclose(f);
  return out;
}

uint64_t OpenFds() {
  DIR* d = ::opendir("/proc/self/fd");
  if (d == nullptr) throw IoError("cannot list /proc/self/fd", false, errno);
  uint64_t n = 0;
  while (const dirent* e = ::readdir(d)) {
    if (e->d_name[0] != '.') ++n;
  }
  ::closedir(d);
  return n - 1;  // the listing's own descriptor
}

Probe TakeProbe(int64_t cycle) {
  Probe p;
  p.cycle = cycle;
  auto s = ReadStatus();
  p.rss = s["VmRSS"] << 10;
  p.peak_rss = s["VmHWM"] << 10;
  p.threads = s["Threads"];
  p.locked = s["VmLck"] << 10;
  p.fds = OpenFds();
  p.pinned = PinnedBytesAllocated();
  p.host_pool = HostStagingBytesAllocated();
  return p;
}

// ---- the state ------------------------------------------------------------------------------

struct State {
  std::vector<TensorView> tensors;  // "t<i>"
  TensorView step;                  // int64[1]
  StateDict sd;
  void Allocate(int n, size_t bytes_each) {
    for (int i = 0; i < n; ++i) {
      tensors.push_back(
          bench::AlignedTensor(DType::kFloat32, {static_cast<int64_t>(bytes_each / 4)}));
      sd.Set("t" + std::to_string(i), tensors.back());
    }
    step = bench::AlignedTensor(DType::kInt64, {1});
    sd.Set("step", step);
  }
  int64_t step_value() const { return *static_cast<const int64_t*>(step.data); }
};

uint32_t Crc(const TensorView& t) { return Crc32c(0, t.data, t.nbytes()); }

// What step N holds: the step value and each tensor's CRC32C.
struct Expected {
  int64_t step = 0;
  std::vector<uint32_t> crcs;
};

Expected Summarise(const State& s) {
  Expected e;
  e.step = s.step_value();
  for (const auto& t : s.tensors) e.crcs.push_back(Crc(t));
  return e;
}

void Verify(const State& loaded, const Expected& want, const std::string& what) {
  if (loaded.step_value() != want.step) {
    throw CorruptionError(what + ": step tensor holds " + std::to_string(loaded.step_value()) +
                          ", expected " + std::to_string(want.step));
  }
  for (size_t i = 0; i < loaded.tensors.size(); ++i) {
    const uint32_t crc = Crc(loaded.tensors[i]);
    if (crc != want.crcs[i]) {
      throw CorruptionError(what + ": tensor t" + std::to_string(i) +
                            " differs from what was saved");
    }
  }
}

// ---- fault injection by URI -----------------------------------------------------------------

// "soakfault://soak/<rest>" opens the real store at JoinUri(<inner root>, <rest>). Only the
// location armed for a failure gets a FaultInjectionStore (whose first append fails); every other
// one is the real backend, exactly as a job gets it.
struct FaultScheme {
  std::mutex mu;
  std::string inner_root;
  std::string armed_location;  // "soak/step-..." or empty
  int stores_made = 0;         // fault stores handed out for the armed location
};
FaultScheme& Faults() {
  static FaultScheme* f = new FaultScheme;  // outlives the registry's use at exit
  return *f;
}
constexpr const char* kFaultRoot = "soakfault://soak";

void RegisterSoakFaults(const std::string& inner_root) {
  Faults().inner_root = inner_root;
  RegisterBackend(
      "soakfault",
      [](const std::string& location) -> std::shared_ptr<Store> {
        FaultScheme& f = Faults();
        std::string inner, armed;
        {
          std::lock_guard<std::mutex> lock(f.mu);
          inner = f.inner_root;
          armed = f.armed_location;
        }
        const std::string prefix = "soak";
        if (location.rfind(prefix, 0) != 0) {
          throw InvalidArgumentError("soakfault:// location must start with soak/: " + location);
        }
        std::string rest = location.substr(prefix.size());
        while (!rest.empty() && rest.front() == '/') rest.erase(0, 1);
        auto store = OpenStore(rest.empty() ? inner : JoinUri(inner, rest));
        if (armed.empty() || location != armed) return store;
        auto faulty = std::make_shared<FaultInjectionStore>(store);
        faulty->FailNth(FaultOp::kAppend, 1, FaultKind::kIoError);
        std::lock_guard<std::mutex> lock(f.mu);
        ++f.stores_made;
        return faulty;
      },
      /*replace=*/true);
}

void Arm(const std::string& step_uri) {
  std::lock_guard<std::mutex> lock(Faults().mu);
  Faults().armed_location = SplitUri(step_uri).second;
}
void Disarm() {
  std::lock_guard<std::mutex> lock(Faults().mu);
  Faults().armed_location.clear();
}

// ---- options, output ------------------------------------------------------------------------

struct Config {
  std::string uri;
  int64_t cycles = 1000;
  int state_mib = 64;
  int tensors = 8;
  int keep = 2;
  int fail_every = 50;
  int load_every = 5;
  int64_t warmup = 10;
  int64_t probe_every = 0;
  double max_growth_pct = 1.0;
  bool json = false;
  bool budget_check = false;
  int budget_mib = 32;
  int budget_factor = 8;
  int slack_mib = 8;
};

std::string Mib(uint64_t b) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1f", b / kMiB);
  return buf;
}

double GrowthPct(uint64_t from, uint64_t to) {
  if (from == 0) return to == 0 ? 0.0 : 100.0;
  return (static_cast<double>(to) - static_cast<double>(from)) * 100.0 / static_cast<double>(from);
}

// Remove everything the tool wrote under `uri` (its own folder under --uri): a directory tree for
// file://; otherwise (a store lists one level) every object, the folders `subfolders` and every
// step folder the manager's index entries ("<step>.step") name, recursively.
void CleanRoot(const std::string& uri, const std::vector<std::string>& subfolders = {}) {
  const auto [scheme, location] = SplitUri(uri);
  if (scheme == "file") {
    std::error_code ec;
    std::filesystem::remove_all(location, ec);
    if (ec) throw IoError("cannot remove " + location + ": " + ec.message(), false, ec.value());
    return;
  }
  auto store = OpenStore(uri);
  std::vector<std::string> folders = subfolders;
  for (const auto& name : store->List()) {
    const std::string suffix = ".step";
    if (name.size() > suffix.size() && name.ends_with(suffix)) {
      folders.push_back(name.substr(0, name.size() - suffix.size()));
    }
    store->Remove(name);
  }
  for (const auto& f : folders) CleanRoot(JoinUri(uri, f));
}

// ---- the soak -------------------------------------------------------------------------------

class Soak {
 public:
  explicit Soak(const Config& c) : c_(c) {}

  int Run() {
    const std::string root = JoinUri(c_.uri, "dcp-soak");
    RegisterSoakFaults(root);
    OpenStore(root)->CreateRoot();  // s3://: the bucket
    CleanRoot(root);
    OpenStore(root)->CreateRoot();
    const size_t each = (static_cast<size_t>(c_.state_mib) << 20) / c_.tensors / 4 * 4;
    train_.Allocate(c_.tensors, each);
    restored_.Allocate(c_.tensors, each);
    for (int i = 0; i < c_.tensors; ++i) {
      tools::FillRandomBytes(train_.tensors[i].data, each, 1000 + i);
    }
    std::set<int64_t> report = {c_.warmup, 10, 100, 1000, c_.cycles};
    for (int64_t k = c_.probe_every; c_.probe_every > 0 && k <= c_.cycles; k += c_.probe_every) {
      report.insert(k);
    }
    ManagerOptions mo;
    mo.keep_last = c_.keep;
    LocalCommunicator comm;
    const auto t0 = Clock::now();
    {
      CheckpointManager m(kFaultRoot, comm, std::make_unique<LocalCommunicator>(), mo);
      m_ = &m;
      for (int64_t cycle = 1; cycle <= c_.cycles; ++cycle) {
        Cycle(cycle);
        if (report.count(cycle)) {
          Call("Wait", [&] { m.Wait(); });
          probes_.push_back(TakeProbe(cycle));
          if (!c_.json) {
            std::fprintf(stderr, "dcp-soak: cycle %" PRId64 " (%.1f s)\n", cycle, Since(t0));
          }
        }
      }
      Call("Wait", [&] { m.Wait(); });
      if (failure_pending_) Expect(false, "the injected failure was never raised");
      CheckAllLoadable("end");
      m.CloseOrThrow();
      m_ = nullptr;
    }
    const double seconds = Since(t0);
    CleanRoot(root);
    return Report(seconds);
  }

 private:
  void Expect(bool ok, const std::string& what) {
    if (!ok) throw InternalError("dcp-soak: " + what);
  }

  // A call on the manager. When a save failed by injection, the first call after it must raise
  // that failure; the call is then checked and repeated, as a job that handles the error would.
  void Call(const char* what, const std::function<void()>& f) {
    if (!failure_pending_) {
      f();
      return;
    }
    try {
      f();
    } catch (const Error& e) {
      const std::string msg = e.what();
      if (msg.find("injected") == std::string::npos) throw;
      failure_pending_ = false;
      ++failures_raised_;
      Disarm();
      {
        std::lock_guard<std::mutex> lock(Faults().mu);
        Expect(Faults().stores_made > stores_before_failure_,
               "the failure was not raised through the fault store");
      }
      if (!c_.json && failures_raised_ == 1) {
        std::fprintf(stderr, "dcp-soak: step %" PRId64 "'s injected failure, raised by %s: %s\n",
                     failed_step_, what, msg.c_str());
      }
      expected_.erase(failed_step_);
      AfterFailure(what);
      f();
      return;
    }
    Expect(false, std::string(what) + " after the failed save of step " +
                      std::to_string(failed_step_) + " did not raise its error");
  }

  // After the injected failure: the newest complete step is the last good one, the failed one is
  // not complete, and every complete step loads with its bytes.
  void AfterFailure(const char* what) {
    const auto latest = m_->LatestStep();
    Expect(latest && *latest == last_good_,
           "after the failed save of step " + std::to_string(failed_step_) + " (raised by " + what +
               ") the latest step is " + (latest ? std::to_string(*latest) : "none") +
               ", expected " + std::to_string(last_good_));
    CheckAllLoadable("after failed step " + std::to_string(failed_step_));
  }

  void CheckAllLoadable(const std::string& when) {
    const auto steps = m_->CompleteSteps();
    Expect(!steps.empty(), when + ": no complete step");
    LocalCommunicator comm;
    for (int64_t s : steps) {
      auto it = expected_.find(s);
      Expect(it != expected_.end(), when + ": step " + std::to_string(s) + " is complete but " +
                                        (s == failed_step_ ? "its save failed" : "unknown"));
      Load(restored_.sd, m_->PathFor(s), comm);
      Verify(restored_, it->second, when + ": step " + std::to_string(s));
      ++loads_;
    }
    // Only the steps retention may still keep need their expectations.
    while (!expected_.empty() && expected_.begin()->first < steps.front()) {
      expected_.erase(expected_.begin());
    }
  }

  void Cycle(int64_t cycle) {
    // Training changed one tensor (and the step) since the last checkpoint.
    const size_t i = static_cast<size_t>(cycle % c_.tensors);
    tools::FillRandomBytes(train_.tensors[i].data, train_.tensors[i].nbytes(),
                           static_cast<uint64_t>(cycle) * 7919);
    *static_cast<int64_t*>(train_.step.data) = cycle;
    const bool fail = c_.fail_every > 0 && cycle % c_.fail_every == 0;
    Call("Save", [&] {
      if (fail) {
        std::lock_guard<std::mutex> lock(Faults().mu);
        stores_before_failure_ = Faults().stores_made;
      }
      if (fail) Arm(m_->PathFor(cycle));
      m_->Save(cycle, train_.sd);
    });
    // The background save opens the step's store later: the fault stays armed (for this step's
    // location only) until the failure is raised.
    // Expectations: the step's bytes (kept only while the step may be loadable).
    expected_[cycle] = Summarise(train_);
    if (fail) {
      failure_pending_ = true;
      failed_step_ = cycle;
      ++failures_injected_;
    } else {
      last_good_ = cycle;  // provisionally: a failure would have been injected
    }
    if (!fail && c_.load_every > 0 && cycle % c_.load_every == 0) {
      std::optional<int64_t> got;
      Call("Restore", [&] { got = m_->Restore(restored_.sd); });
      Expect(got && *got == cycle, "Restore at cycle " + std::to_string(cycle) + " loaded step " +
                                       (got ? std::to_string(*got) : "none"));
      Verify(restored_, expected_[cycle], "restore of step " + std::to_string(cycle));
      ++restores_;
    }
  }

  int Report(double seconds) {
    const Probe* base = nullptr;
    for (const auto& p : probes_) {
      if (p.cycle == c_.warmup) base = &p;
    }
    const Probe& last = probes_.back();
    if (base == nullptr) base = &probes_.front();
    struct Metric {
      const char* name;
      uint64_t Probe::*field;
      bool bytes;
      double allowed_pct;  // < 0: reported, not judged
    };
    const std::vector<Metric> metrics = {
        {"rss_bytes", &Probe::rss, true, c_.max_growth_pct},
        {"peak_rss_bytes", &Probe::peak_rss, true, -1},
        {"open_fds", &Probe::fds, false, 0},
        {"threads", &Probe::threads, false, 0},
        {"locked_bytes", &Probe::locked, true, c_.max_growth_pct},
        {"pinned_bytes", &Probe::pinned, true, c_.max_growth_pct},
        {"host_pool_allocated_bytes", &Probe::host_pool, true, -1},
    };
#ifdef DCP_SOAK_SANITIZER
    const bool judged = false;
#else
    const bool judged = true;
#endif
    bool ok = true;
    std::vector<std::pair<const Metric*, double>> growth;
    for (const auto& m : metrics) {
      const double g = GrowthPct(base->*m.field, last.*m.field);
      growth.push_back({&m, g});
      if (judged && m.allowed_pct >= 0 && g > m.allowed_pct + 1e-9) ok = false;
    }
    if (c_.json) {
      std::printf("{\"uri\":\"%s\",\"cycles\":%" PRId64
                  ",\"state_bytes\":%zu,\"seconds\":%.2f,\"saves_failed_by_injection\":%d,"
                  "\"failures_raised\":%d,\"restores_verified\":%d,\"loads_verified\":%d,"
                  "\"probes\":[",
                  c_.uri.c_str(), c_.cycles, StateBytes(), seconds, failures_injected_,
                  failures_raised_, restores_, loads_);
      for (size_t i = 0; i < probes_.size(); ++i) {
        const Probe& p = probes_[i];
        std::printf("%s{\"cycle\":%" PRId64 ",\"rss_bytes\":%" PRIu64 ",\"peak_rss_bytes\":%" PRIu64
                    ",\"open_fds\":%" PRIu64 ",\"threads\":%" PRIu64 ",\"locked_bytes\":%" PRIu64
                    ",\"pinned_bytes\":%" PRIu64 ",\"host_pool_allocated_bytes\":%" PRIu64 "}",
                    i ? "," : "", p.cycle, p.rss, p.peak_rss, p.fds, p.threads, p.locked, p.pinned,
                    p.host_pool);
      }
      std::printf("],\"growth_from_cycle\":%" PRId64 ",\"growth_pct\":{", base->cycle);
      for (size_t i = 0; i < growth.size(); ++i) {
        std::printf("%s\"%s\":%.3f", i ? "," : "", growth[i].first->name, growth[i].second);
      }
      std::printf("},\"judged\":%s,\"passed\":%s}\n", judged ? "true" : "false",
                  ok ? "true" : "false");
      return ok ? 0 : 1;
    }
    std::printf("dcp-soak: %" PRId64 " cycles of %.1f MiB (%d tensors) on %s in %.1f s\n",
                c_.cycles, StateBytes() / kMiB, c_.tensors, c_.uri.c_str(), seconds);
    std::printf(
        "  async saves through CheckpointManager (keep_last %d); %d restores and %d loads "
        "verified; %d saves failed by injection, %d raised by the next call\n",
        c_.keep, restores_, loads_, failures_injected_, failures_raised_);
    std::printf("  %8s %10s %10s %6s %7s %10s %10s %14s\n", "cycle", "RSS MiB", "peak MiB", "fds",
                "threads", "locked MiB", "pinned MiB", "host pool MiB");
    for (const auto& p : probes_) {
      std::printf("  %8" PRId64 " %10s %10s %6" PRIu64 " %7" PRIu64 " %10s %10s %14s\n", p.cycle,
                  Mib(p.rss).c_str(), Mib(p.peak_rss).c_str(), p.fds, p.threads,
                  Mib(p.locked).c_str(), Mib(p.pinned).c_str(), Mib(p.host_pool).c_str());
    }
    std::printf("  growth from cycle %" PRId64 " to %" PRId64 ":\n", base->cycle, last.cycle);
    for (const auto& [m, g] : growth) {
      const char* verdict = m->allowed_pct < 0          ? "(reported)"
                            : !judged                   ? "(not judged under a sanitizer)"
                            : g > m->allowed_pct + 1e-9 ? "FAIL"
                                                        : "ok";
      const double from = static_cast<double>(base->*(m->field));
      const double to = static_cast<double>(last.*(m->field));
      const std::string delta = m->bytes
                                    ? Mib(static_cast<uint64_t>(std::abs(to - from))) + " MiB"
                                    : std::to_string(static_cast<int64_t>(std::abs(to - from)));
      std::printf(
          "    %-26s %+8.3f %%  (%s%s)  limit %s  %s\n", m->name, g, to < from ? "-" : "+",
          delta.c_str(),
          m->allowed_pct < 0 ? "-" : (std::to_string(m->allowed_pct).substr(0, 4) + " %").c_str(),
          verdict);
    }
    std::printf("dcp-soak: %s\n", ok ? "PASSED" : "FAILED: growth after warm-up over the limit");
    return ok ? 0 : 1;
  }

  size_t StateBytes() const {
    size_t n = train_.step.nbytes();
    for (const auto& t : train_.tensors) n += t.nbytes();
    return n;
  }

  const Config& c_;
  CheckpointManager* m_ = nullptr;
  State train_, restored_;
  std::map<int64_t, Expected> expected_;
  std::vector<Probe> probes_;
  bool failure_pending_ = false;
  int64_t failed_step_ = -1, last_good_ = -1;
  int failures_injected_ = 0, failures_raised_ = 0, restores_ = 0, loads_ = 0;
  int stores_before_failure_ = 0;
};

// ---- the budget check -----------------------------------------------------------------------

struct Phase {
  std::string name;
  uint64_t staging_asked = 0;
  uint64_t peak_over_baseline = 0;  // the phase's VmHWM above the state-allocated baseline
  uint64_t peak_over_start = 0;     // ... above the RSS when the phase began
  double seconds = 0;
  bool ok = true;
};

int BudgetCheck(const Config& c) {
  const size_t budget = static_cast<size_t>(c.budget_mib) << 20;
  const size_t state_bytes = budget * static_cast<size_t>(c.budget_factor);
  const size_t slack = static_cast<size_t>(c.slack_mib) << 20;
  const int tensors = std::max(1, c.tensors);
  const size_t each = state_bytes / tensors / 4 * 4;
  const std::string root = JoinUri(c.uri, "dcp-soak-budget");
  const std::vector<std::string> folders = {"warmup", "sync", "managed"};
  OpenStore(root)->CreateRoot();  // s3://: the bucket
  CleanRoot(root, folders);
  OpenStore(root)->CreateRoot();
  if (!bench::ResetPeakRss()) {
    throw UnsupportedError("cannot reset the peak RSS (/proc/self/clear_refs): Linux only");
  }
  LocalCommunicator comm;
  SaveOptions so;
  so.storage.memory_budget_bytes = budget;
  so.storage.overwrite = true;
  LoadOptions lo;
  lo.storage.memory_budget_bytes = budget;

  // Warm-up on a small state: loads the code, starts the threads the library keeps, so the
  // baseline holds them (their cost does not depend on the state's size).
  {
    State small;
    small.Allocate(2, 1 << 20);
    Save(small.sd, JoinUri(root, "warmup"), comm, so);
    Load(small.sd, JoinUri(root, "warmup"), comm, lo);
  }
  State s, back;
  s.Allocate(tensors, each);
  back.Allocate(tensors, each);  // pre-touched: the load's destination is the caller's memory
  for (int i = 0; i < tensors; ++i) tools::FillRandomBytes(s.tensors[i].data, each, 77 + i);
  *static_cast<int64_t*>(s.step.data) = 8;
  const Expected want = Summarise(s);
  const uint64_t baseline = bench::RssBytes();

  std::vector<Phase> phases;
  auto measure = [&](const std::string& name, uint64_t staging, const std::function<void()>& f) {
    Phase p;
    p.name = name;
    p.staging_asked = staging;
    bench::ResetPeakRss();
    const uint64_t start = bench::RssBytes();
    const auto t = Clock::now();
    f();
    p.seconds = Since(t);
    const uint64_t peak = bench::PeakRssBytes();
    p.peak_over_baseline = peak > baseline ? peak - baseline : 0;
    p.peak_over_start = peak > start ? peak - start : 0;
    p.ok = p.peak_over_baseline <= budget + staging + slack;
    phases.push_back(p);
  };
  const std::string sync_uri = JoinUri(root, "sync");
  measure("save (dcp::Save)", 0, [&] { Save(s.sd, sync_uri, comm, so); });
  measure("load (dcp::Load)", 0, [&] {
    Load(back.sd, sync_uri, comm, lo);
    Verify(back, want, "budget load");
  });
  // The manager's asynchronous save: the staging asked for is one copy of the state (every
  // tensor, rounded up to the pool's 4 KiB pages).
  uint64_t staging = 0;
  std::string managed_step;
  for (const auto& t : s.tensors) staging += (t.nbytes() + 4095) / 4096 * 4096;
  staging += 4096;  // the step tensor
  {
    ManagerOptions mo;
    mo.save = so;
    mo.save.storage.overwrite = false;  // the manager sets it itself
    mo.keep_last = 1;
    CheckpointManager m(JoinUri(root, "managed"), comm, std::make_unique<LocalCommunicator>(), mo);
    managed_step = m.PathFor(1);
    measure("async save (CheckpointManager)", staging, [&] {
      m.Save(1, s.sd);
      m.Wait();
    });
    m.CloseOrThrow();
  }
  Load(back.sd, managed_step, comm, lo);
  Verify(back, want, "budget async save");
  CleanRoot(root, folders);

  bool ok = true;
  for (const auto& p : phases) ok = ok && p.ok;
  if (c.json) {
    std::printf(
        "{\"uri\":\"%s\",\"budget_bytes\":%zu,\"state_bytes\":%zu,\"slack_bytes\":%zu,"
        "\"baseline_rss_bytes\":%" PRIu64 ",\"phases\":[",
        c.uri.c_str(), budget, state_bytes, slack, baseline);
    for (size_t i = 0; i < phases.size(); ++i) {
      const auto& p = phases[i];
      std::printf("%s{\"name\":\"%s\",\"staging_asked_bytes\":%" PRIu64
                  ",\"peak_over_baseline_bytes\":%" PRIu64 ",\"peak_over_start_bytes\":%" PRIu64
                  ",\"limit_bytes\":%" PRIu64 ",\"seconds\":%.3f,\"ok\":%s}",
                  i ? "," : "", p.name.c_str(), p.staging_asked, p.peak_over_baseline,
                  p.peak_over_start, budget + p.staging_asked + slack, p.seconds,
                  p.ok ? "true" : "false");
    }
    std::printf("],\"passed\":%s}\n", ok ? "true" : "false");
    return ok ? 0 : 1;
  }
  std::printf("dcp-soak --budget-check: state %.0f MiB (%d x memory_budget_bytes %.0f MiB) on %s\n",
              state_bytes / kMiB, c.budget_factor, budget / kMiB, c.uri.c_str());
  std::printf("  baseline RSS %.1f MiB (state + load destination allocated and touched)\n",
              baseline / kMiB);
  std::printf(
      "  slack %d MiB for costs that do not scale with the state: stacks and malloc arenas of the "
      "I/O threads, plan and metadata buffers, the storage client's connections; the column "
      "'over budget+staging' shows how much of it each phase used\n",
      c.slack_mib);
  std::printf("  %-32s %12s %14s %11s %21s %10s\n", "phase", "staging MiB", "peak-base MiB",
              "(vs start)", "over budget+staging", "limit MiB");
  for (const auto& p : phases) {
    const double over = static_cast<double>(p.peak_over_baseline) - static_cast<double>(budget) -
                        static_cast<double>(p.staging_asked);
    std::printf("  %-32s %12.1f %14.1f %11.1f %21.1f %10.1f %s\n", p.name.c_str(),
                p.staging_asked / kMiB, p.peak_over_baseline / kMiB, p.peak_over_start / kMiB,
                std::max(0.0, over) / kMiB, (budget + p.staging_asked + slack) / kMiB,
                p.ok ? "ok" : "OVER");
  }
  if (budget < kWriterStagingBytes) {
    std::printf(
        "  note: memory_budget_bytes is below one writer's staging (kWriterStagingBytes, "
        "%.0f MiB), and one writer and one reader always run: their backend's buffers "
        "(s3://: part_size x parts in flight or read ahead) are the floor, whatever the "
        "budget says (dcp/storage/storage.h)\n",
        kWriterStagingBytes / kMiB);
  }
  std::printf("dcp-soak --budget-check: %s\n",
              ok ? "PASSED" : "FAILED: host memory over memory_budget_bytes + staging + slack");
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dcp soak: checkpoint cycles, memory and handles that stay flat"};
  Config c;
  app.add_option(
      "--uri", c.uri,
      "where to write: file://DIR, a path or s3://bucket/prefix; the tool uses (and empties "
      "before and after) <uri>/dcp-soak[-budget] (default: a new directory under /tmp)");
  app.add_option("--cycles", c.cycles, "checkpoint cycles")->check(CLI::PositiveNumber);
  app.add_option("--state-mib", c.state_mib, "state size, MiB")->check(CLI::PositiveNumber);
  app.add_option("--tensors", c.tensors, "tensors in the state")->check(CLI::PositiveNumber);
  app.add_option("--keep", c.keep, "ManagerOptions::keep_last")->check(CLI::PositiveNumber);
  app.add_option("--fail-every", c.fail_every, "inject a failed save every N cycles (0: never)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--load-every", c.load_every, "restore and verify every N cycles (0: never)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--warmup", c.warmup, "the cycle growth is measured from")
      ->check(CLI::PositiveNumber);
  app.add_option("--probe-every", c.probe_every, "also probe every N cycles (0: never)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--max-growth-pct", c.max_growth_pct,
                 "allowed growth of RSS, locked and pinned bytes after warm-up (fds, threads: 0)");
  app.add_flag("--json", c.json, "one JSON line instead of the table");
  app.add_flag("--budget-check", c.budget_check,
               "measure a save's and a load's host memory against memory_budget_bytes instead");
  app.add_option("--budget-mib", c.budget_mib, "memory_budget_bytes of --budget-check, MiB")
      ->check(CLI::PositiveNumber);
  app.add_option("--budget-factor", c.budget_factor, "--budget-check's state, x the budget")
      ->check(CLI::PositiveNumber);
  app.add_option("--slack-mib", c.slack_mib, "--budget-check's allowance for fixed costs, MiB")
      ->check(CLI::NonNegativeNumber);
  CLI11_PARSE(app, argc, argv);
  if (!c.budget_check && c.warmup > c.cycles) {
    std::cerr << "dcp-soak: --warmup must not exceed --cycles\n";
    return 2;
  }
  std::string tmp_dir;
  if (c.uri.empty()) {
    char templ[] = "/tmp/dcp-soak-XXXXXX";
    if (::mkdtemp(templ) == nullptr) bench::Die("dcp-soak: mkdtemp");
    tmp_dir = templ;
    c.uri = "file://" + tmp_dir;
  }
  int rc = 1;
  try {
    rc = c.budget_check ? BudgetCheck(c) : Soak(c).Run();
  } catch (const std::exception& e) {
    std::cerr << "dcp-soak: " << e.what() << "\n";
    rc = 1;
  }
  if (!tmp_dir.empty()) {
    std::error_code ec;
    std::filesystem::remove_all(tmp_dir, ec);
  }
  return rc;
}
