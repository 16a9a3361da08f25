// plan-bench: how long the default planners take to plan a save and a resharding load, for the
// planning work of all ranks of a job simulated in one process (no I/O, no communication).
//
//   plan-bench [--ranks 4] [--runs 5] [--naive] [--validate-only]
//
// Scenarios:
//   tensors: 10,000 tensors of [64, 32] floats, row-sharded over the ranks on save, loaded
//            column-sharded (every local chunk overlaps every saved chunk of its tensor).
//   chunks:  one [100000, 16] tensor saved as 100,000 one-row chunks (25,000 per rank at 4
//            ranks), loaded as 4-row chunks shifted by 2 rows (each overlaps 4-5 saved chunks).
// Prints the median over --runs of (thread CPU time, in ms): save planning (every rank's local plan
// + the global plan: dedup, metadata, chunk validation) and load planning (every rank's local plan,
// summed).
// Then metadata validation (ValidateMetadata, what every load, inspect, verify and convert runs
// on untrusted metadata) of one tensor in 12,500 / 100,000 / 200,000 / 1,000,000 chunks: split
// into rows ("rows", one split dimension), into a square grid of blocks ("grid", two) and into
// a cube of blocks ("cube", three); one run each, thread CPU time in ms.
// --naive also times the reference overlap algorithm (local chunks x saved chunks) for loads,
// on the tensors scenario and on "chunks10k" (the chunks scenario with 10,000 rows).
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "dcp/planner/default_planner.h"
#include "dcp/proto/schema/codec.h"

using namespace dcp;
// Thread CPU time: on a shared machine it is steadier than wall time (planning is
// single-threaded), so that is what is reported.
struct Clock {
  using duration = std::chrono::nanoseconds;
  struct time_point {
    int64_t ns;
    duration operator-(const time_point& o) const { return duration(ns - o.ns); }
  };
  static time_point now() {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return {int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec};
  }
};

namespace {

struct Layout {
  std::vector<StateDict> per_rank;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// One dummy buffer large enough for every view: planning never touches the data.
std::vector<char>& Buffer() {
  static std::vector<char> b(1 << 20);
  return b;
}

TensorView View(const Shape& sizes) {
  return TensorView::FromContiguous(Buffer().data(), DType::kFloat32, sizes);
}

std::pair<int64_t, int64_t> Range(int64_t n, int r, int w) {
  const int64_t base = n / w, extra = n % w;
  const int64_t b = r * base + std::min<int64_t>(r, extra);
  return {b, b + base + (r < extra ? 1 : 0)};
}

void TensorsScenario(int ranks, bool rows, std::vector<StateDict>& sds) {
  const int64_t kTensors = 10000, kRows = 64, kCols = 32;
  sds.assign(ranks, {});
  for (int r = 0; r < ranks; ++r) {
    for (int64_t t = 0; t < kTensors; ++t) {
      ShardedTensor st{DType::kFloat32, {kRows, kCols}, {}};
      auto [b, e] = Range(rows ? kRows : kCols, r, ranks);
      if (rows) {
        st.local_shards.push_back({View({e - b, kCols}), {b, 0}});
      } else {
        st.local_shards.push_back({View({kRows, e - b}), {0, b}});
      }
      sds[r].Nested("layer" + std::to_string(t / 10)).Set("w" + std::to_string(t % 10), st);
    }
  }
}

void ChunksScenario(int ranks, bool save, std::vector<StateDict>& sds, int64_t kRows) {
  const int64_t kCols = 16;
  sds.assign(ranks, {});
  for (int r = 0; r < ranks; ++r) {
    ShardedTensor st{DType::kFloat32, {kRows, kCols}, {}};
    auto [b, e] = Range(kRows, r, ranks);
    if (save) {
      for (int64_t row = b; row < e; ++row) st.local_shards.push_back({View({1, kCols}), {row, 0}});
    } else {
      // 4-row chunks starting at row 2 (plus the 2-row head on rank 0 and the tail).
      for (int64_t row = 0; row < kRows;) {
        const int64_t start = row, len = row == 0 ? 2 : std::min<int64_t>(4, kRows - row);
        row += len;
        if (start < b || start >= e) continue;
        st.local_shards.push_back({View({len, kCols}), {start, 0}});
      }
    }
    sds[r].Set("big", st);
  }
}

struct Times {
  double save_ms, load_ms, naive_ms = -1;
  size_t read_items = 0;
};

Times Run(std::vector<StateDict>& save_sds, std::vector<StateDict>& load_sds, bool naive) {
  const int ranks = static_cast<int>(save_sds.size());
  Times t;
  auto t0 = Clock::now();
  std::vector<DefaultSavePlanner> sp(ranks);
  std::vector<SavePlan> plans;
  for (int r = 0; r < ranks; ++r) {
    sp[r].SetUp(save_sds[r], {r, ranks, r == 0});
    plans.push_back(sp[r].CreateLocalPlan());
  }
  auto [global, md] = sp[0].CreateGlobalPlan(std::move(plans));
  t.save_ms = Ms(Clock::now() - t0);

  auto load = [&](bool use_naive) {
    LoadPlannerOptions o;
    o.naive_overlaps = use_naive;
    size_t items = 0;
    auto s = Clock::now();
    for (int r = 0; r < ranks; ++r) {
      DefaultLoadPlanner lp(o);
      lp.SetUp(load_sds[r], md, {r, ranks, r == 0});
      items += lp.CreateLocalPlan().items.size();
    }
    t.read_items = items;
    return Ms(Clock::now() - s);
  };
  t.load_ms = load(false);
  if (naive) t.naive_ms = load(true);
  return t;
}

// Metadata of one float32 tensor cut into `n` chunks: rows of a [n, 4] tensor, or a grid of
// k x k (or k x k x k) blocks of 2 elements a side (n rounded to the nearest full grid).
Metadata ChunkedMetadata(const char* layout, int64_t n) {
  const size_t dims = !std::strcmp(layout, "rows") ? 1 : !std::strcmp(layout, "grid") ? 2 : 3;
  const int64_t k = dims == 1 ? n : static_cast<int64_t>(std::llround(std::pow(n, 1.0 / dims)));
  Shape shape, block;
  if (dims == 1) {
    shape = {n, 4}, block = {1, 4};
  } else {
    shape.assign(dims, 2 * k), block.assign(dims, 2);
  }
  Metadata md;
  TensorMetadata t{DType::kFloat32, shape, {}};
  const int64_t count = dims == 1 ? n : static_cast<int64_t>(std::pow(k, dims));
  t.chunks.reserve(count);
  const uint64_t bytes = static_cast<uint64_t>(NumElements(block)) * 4;
  for (int64_t i = 0; i < count; ++i) {
    Shape at(shape.size(), 0);
    int64_t rest = i;
    for (size_t d = dims; d-- > 0;) at[d] = (rest % (dims == 1 ? n : k)) * block[d], rest /= k;
    StorageInfo info;
    info.relative_path = "data-0000000000000000-r0-b0.data";
    info.offset = static_cast<uint64_t>(i) * bytes;
    info.length = info.raw_length = bytes;
    info.crc32c = 0;
    md.storage.emplace(MetadataIndex{"t", at, {}}, info);
    t.chunks.push_back({std::move(at), block});
  }
  md.entries.emplace("t", std::move(t));
  return md;
}

}  // namespace

int main(int argc, char** argv) {
  int ranks = 4, runs = 5;
  bool naive = false, validate_only = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--ranks") && i + 1 < argc) {
      ranks = std::stoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--runs") && i + 1 < argc) {
      runs = std::stoi(argv[++i]);
    } else if (!std::strcmp(argv[i], "--naive")) {
      naive = true;
    } else if (!std::strcmp(argv[i], "--validate-only")) {
      validate_only = true;
    } else {
      std::fprintf(stderr, "usage: %s [--ranks N] [--runs N] [--naive] [--validate-only]\n",
                   argv[0]);
      return 2;
    }
  }
  std::vector<const char*> scenarios = {"tensors", "chunks"};
  if (naive) scenarios.push_back("chunks10k");  // naive on 100k chunks would take minutes
  if (validate_only) scenarios.clear();
  for (const char* scenario : scenarios) {
    std::vector<StateDict> save_sds, load_sds;
    if (!std::strcmp(scenario, "tensors")) {
      TensorsScenario(ranks, true, save_sds);
      TensorsScenario(ranks, false, load_sds);
    } else {
      const int64_t rows = std::strcmp(scenario, "chunks") ? 10000 : 100000;
      ChunksScenario(ranks, true, save_sds, rows);
      ChunksScenario(ranks, false, load_sds, rows);
    }
    const bool time_naive = naive && std::strcmp(scenario, "chunks");
    std::vector<double> save, load, nv;
    size_t items = 0;
    for (int i = 0; i < runs; ++i) {
      const Times t = Run(save_sds, load_sds, time_naive);
      save.push_back(t.save_ms);
      load.push_back(t.load_ms);
      nv.push_back(t.naive_ms);
      items = t.read_items;
    }
    std::printf("%-8s ranks=%d  save plan %9.1f ms  load plan %9.1f ms (%zu read items)", scenario,
                ranks, Median(save), Median(load), items);
    if (time_naive) std::printf("  naive load plan %9.1f ms", Median(nv));
    std::printf("   [median of %d]\n", runs);
  }
  for (const char* layout : {"rows", "grid", "cube"}) {
    for (int64_t n : {12500, 100000, 200000, 1000000}) {
      const Metadata md = ChunkedMetadata(layout, n);
      const auto t0 = Clock::now();
      ValidateMetadata(md, "plan-bench");
      const double ms = Ms(Clock::now() - t0);
      std::printf("validate %-4s %8zu chunks  %9.1f ms\n", layout,
                  std::get<TensorMetadata>(md.entries.at("t")).chunks.size(), ms);
    }
  }
  return 0;
}
