// dcp-bench: dcp against baselines measured in the same run, on the same bytes (random, not zero).
//
//   dcp-bench --async [--size-mib N] [--repeats R] [--dir DIR] [--json]
//     Blocking time of an asynchronous save against a plain memcpy of the same bytes into warm
//     buffers; a synchronous save of the same state; and how much a compute loop slows down while
//     a background save runs. With --json the last line is one JSON object.
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>
#include <vector>

#include "dcp/dcp.h"
#include "tools/fill_random.h"

namespace {

using Clock = std::chrono::steady_clock;
using namespace dcp;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2);
}

void Fill(void* p, size_t n, uint64_t seed) { tools::FillRandomBytes(p, n, seed); }

// A stand-in for a training step: a fixed amount of floating-point work on a small array.
double ComputeStep(std::vector<float>& a) {
  float acc = 0;
  for (int rep = 0; rep < 8; ++rep) {
    for (size_t i = 0; i < a.size(); ++i) {
      a[i] = a[i] * 0.999f + 0.001f * static_cast<float>(i & 7);
      acc += a[i];
    }
  }
  return acc;
}

// Steps per second of ComputeStep over `seconds`, or until `stop` becomes true.
double StepsPerSecond(std::vector<float>& a, double seconds,
                      const std::atomic<bool>* stop = nullptr) {
  const auto t0 = Clock::now();
  int steps = 0;
  volatile double sink = 0;
  while (Since(t0) < seconds && !(stop && stop->load())) {
    sink = sink + ComputeStep(a);
    ++steps;
  }
  return steps / Since(t0);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dcp-bench: dcp against same-run baselines"};
  bool async_mode = false, json = false;
  int64_t size_mib = 1024;
  int repeats = 5;
  std::string dir;
  app.add_flag("--async", async_mode, "measure async-save blocking time against memcpy");
  app.add_option("--size-mib", size_mib, "bytes of state (MiB)")->check(CLI::PositiveNumber);
  app.add_option("--repeats", repeats, "repetitions (medians are reported)")
      ->check(CLI::PositiveNumber);
  app.add_option("--dir", dir, "scratch directory (default: a fresh one under /tmp, removed)");
  app.add_flag("--json", json, "print one JSON object as the last line");
  CLI11_PARSE(app, argc, argv);
  if (!async_mode) {
    std::fprintf(stderr, "dcp-bench: only --async is implemented so far (see issue tracker)\n");
    return 2;
  }

  bool remove_dir = false;
  if (dir.empty()) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "dcp-bench-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return 2;
    dir = tmpl;
    remove_dir = true;
  }

  // The state: 8 tensors of mixed dtypes summing to size_mib, random bytes.
  const size_t total = static_cast<size_t>(size_mib) << 20;
  std::vector<TensorView> tensors, copies;
  StateDict state;
  const DType dtypes[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  for (int i = 0; i < 8; ++i) {
    const DType dt = dtypes[i % 4];
    const int64_t elems = static_cast<int64_t>(total / 8 / ElementSize(dt));
    TensorView t = TensorView::Allocate(dt, {elems / 1024, 1024});
    Fill(t.data, t.nbytes(), i + 1);
    tensors.push_back(t);
    copies.push_back(TensorView::Allocate(dt, t.shape));  // warm destinations for memcpy
    state.Nested("layer" + std::to_string(i)).Set("weight", t);
  }
  uint64_t bytes = 0;
  for (const auto& t : tensors) bytes += t.nbytes();

  // Baseline: memcpy of the same bytes into warm buffers (single thread, as a training loop's
  // own host copy would be).
  std::vector<double> memcpy_s;
  for (int r = 0; r < repeats + 1; ++r) {
    const auto t0 = Clock::now();
    for (size_t i = 0; i < tensors.size(); ++i)
      std::memcpy(copies[i].data, tensors[i].data, tensors[i].nbytes());
    if (r > 0) memcpy_s.push_back(Since(t0));  // the first pass faults the pages in
  }

  // Synchronous save of the same state.
  std::vector<double> sync_s;
  SaveOptions so;
  so.storage.overwrite = true;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = Clock::now();
    Save(state, dir + "/sync", so);
    sync_s.push_back(Since(t0));
  }

  // Asynchronous saves: blocking time, after a first save that allocates the staging.
  std::vector<double> blocking_s, background_s, staging_gbps;
  size_t allocations_after_first = 0;
  double compute_alone = 0, compute_during = 0;
  {
    AsyncOptions ao;
    ao.save = so;
    AsyncCheckpointer saver(std::make_unique<LocalCommunicator>(), ao);
    saver.Save(state, dir + "/async")->Wait();
    const size_t allocated = saver.staging_allocations();
    for (int r = 0; r < repeats; ++r) {
      auto h = saver.Save(state, dir + "/async");
      const SaveMetrics m0 = h->metrics();
      blocking_s.push_back(m0.blocking_s);
      staging_gbps.push_back(m0.staging_gbps);
      h->Wait();
      background_s.push_back(h->metrics().background_s);
    }
    allocations_after_first = saver.staging_allocations() - allocated;

    // Training slowdown: compute steps/s while a background save runs, against steps/s alone
    // measured right after it for as long (interleaved, so both see the same machine load).
    std::vector<float> work(1 << 18, 1.0f);
    std::vector<double> during, alone;
    for (int r = 0; r < std::max(repeats, 3); ++r) {
      auto h = saver.Save(state, dir + "/async");
      std::atomic<bool> done{false};
      std::thread watcher([&] {
        h->WaitFor(std::chrono::minutes(10));
        done = true;
      });
      const auto t0 = Clock::now();
      during.push_back(StepsPerSecond(work, 600.0, &done));
      const double span = std::max(0.2, Since(t0));
      watcher.join();
      h->Wait();
      alone.push_back(StepsPerSecond(work, span));
    }
    compute_alone = Median(alone);
    compute_during = Median(during);
    saver.Close();
  }
  if (remove_dir) std::filesystem::remove_all(dir);

  const double memcpy_med = Median(memcpy_s), blocking_med = Median(blocking_s),
               sync_med = Median(sync_s);
  const double slowdown = compute_alone > 0 ? 1.0 - compute_during / compute_alone : 0;
  std::printf("dcp-bench --async: %.1f MiB in %zu tensors, %d repeats (medians), %u cores\n",
              bytes / 1048576.0, tensors.size(), repeats, std::thread::hardware_concurrency());
  std::printf("  memcpy into warm buffers   %8.3f s  %6.2f GB/s   (baseline)\n", memcpy_med,
              bytes / memcpy_med / 1e9);
  std::printf("  async save, blocking       %8.3f s  %6.2f GB/s   ratio to memcpy %.2f\n",
              blocking_med, bytes / blocking_med / 1e9, blocking_med / memcpy_med);
  std::printf("  async save, background     %8.3f s\n", Median(background_s));
  std::printf("  sync save                  %8.3f s  %6.2f GB/s   blocking saved %.1fx\n", sync_med,
              bytes / sync_med / 1e9, sync_med / blocking_med);
  std::printf("  staging allocations after the first save: %zu\n", allocations_after_first);
  std::printf("  compute loop during a background save: %.1f%% slower (%.1f vs %.1f steps/s)\n",
              slowdown * 100, compute_during, compute_alone);
  if (json) {
    nlohmann::json j = {{"bytes", bytes},
                        {"memcpy_s", memcpy_med},
                        {"async_blocking_s", blocking_med},
                        {"async_blocking_vs_memcpy", blocking_med / memcpy_med},
                        {"async_background_s", Median(background_s)},
                        {"sync_save_s", sync_med},
                        {"staging_gbps", Median(staging_gbps)},
                        {"staging_allocations_after_first", allocations_after_first},
                        {"training_slowdown", slowdown}};
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}
