// dcp-s3-bench: dcp save/load through s3:// against raw PUT/GET of the same bytes with the same
// client (dcp's S3 store used directly: the same multipart uploads and ranged GETs, no
// checkpoint protocol, no checksums), on the same server in the same run. Prints GB/s (medians
// of --repeats runs), the ratios dcp/raw and the requests each operation made per GiB. Each
// dcp phase runs right before or after its raw phase (alternating), and a ratio is the median
// of the repeats' raw/dcp time ratios (their range in parentheses), so that a noisy spell of a
// shared machine weighs on both sides of a pair.
//
//   dcp-s3-bench --uri s3://bucket/prefix [--size-mib 256] [--files 4] [--repeats 5] [--json]
//
// Configuration of the server and credentials: the AWS_* environment
// (storage/backends/s3/s3_store.h); the store's options (target_gbps, max_connections,
// part_size_mib, ...) may be given in the URI's query, and apply to the raw and the dcp side alike.
// The state is --files 2-D float tensors [rows, 1024] of size/files bytes each.
//   1 rank   one data file per tensor (files_per_rank = --files); raw: --files objects of the
//            same sizes on as many threads, through one store.
//   4 ranks  (an InProcessGroup: 4 threads, each its own store, as 4 processes would have) every
//            tensor row-sharded over the ranks, files_per_rank = --files / 4 (at least 1); raw:
//            4 threads with a store each, --files objects of the same total.
//   reshard  the 4-rank checkpoint loaded column-sharded by 4 ranks (every rank needs a column
//            block of every stored row block), compared with the 4-rank raw GET; and loaded by 1
//            rank (4 files of row blocks into whole tensors), compared with the 1-rank raw GET.
// Every load is cold for the store (new objects opened, nothing cached client-side). Requests
// are counted over the load, everything included (HEADs, metadata), per GiB of state, and so
// are the response bytes received, over the state's bytes ("bytes read": 1.00 x reads each
// stored byte once).
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <functional>
#include <iostream>
#include <mutex>
#include <stdexcept>
#include <thread>

#include "dcp/dcp.h"
#include "dcp/storage/backends/s3/s3_store.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "dcp/storage/registry.h"
#include "tools/bench_util.h"
#include "tools/fill_random.h"

using namespace dcp;
using dcp::bench::Clock;
using dcp::bench::Median;
using dcp::bench::Since;
using dcp::bench::TimeRanks;

namespace {

void RemoveAll(Store& store) {
  for (const auto& n : store.List()) store.Remove(n);
}

template <typename Fn>
void OnThreads(int n, Fn fn) {
  std::vector<std::thread> threads;
  std::vector<std::exception_ptr> errors(n);
  for (int i = 0; i < n; ++i) {
    threads.emplace_back([&, i] {
      try {
        fn(i);
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (auto& e : errors) {
    if (e) std::rethrow_exception(e);
  }
}

constexpr int kRanks = 4;
constexpr int64_t kCols = 1024;  // 4 KiB rows

// The tensors split over `ranks` along `dim` (views of the same memory).
std::vector<StateDict> Sharded(const std::vector<TensorView>& ts, int ranks, size_t dim) {
  std::vector<StateDict> out(static_cast<size_t>(ranks));
  for (size_t i = 0; i < ts.size(); ++i) {
    const TensorView& t = ts[i];
    for (int r = 0; r < ranks; ++r) {
      ShardedTensor st{t.dtype, t.shape, {}};
      const int64_t b = t.shape[dim] * r / ranks, e = t.shape[dim] * (r + 1) / ranks;
      if (e > b) {
        Shape off(t.shape.size(), 0), len = t.shape;
        off[dim] = b;
        len[dim] = e - b;
        st.local_shards.push_back({t.Narrow(off, len), off});
      }
      out[static_cast<size_t>(r)].Set("t" + std::to_string(i), std::move(st));
    }
  }
  return out;
}

// --trace: every request, with the milliseconds since its operation began, on stderr.
bool g_trace = false;
std::mutex g_trace_mu;
Clock::time_point g_trace_t0;

// One measured operation: its times, and the requests it made (summed over the repeats).
struct Phase {
  explicit Phase(const char* n) : name(n) {}
  const char* name;
  std::vector<double> seconds;
  uint64_t requests = 0;
  uint64_t bytes_received = 0;  // response bodies, summed over the repeats
  template <typename Fn>
  void Run(Fn fn) {
    const uint64_t r0 = S3RequestCountForTesting(), b0 = S3BytesReceivedForTesting();
    const auto t0 = Clock::now();
    if (g_trace) {
      std::lock_guard<std::mutex> lock(g_trace_mu);
      g_trace_t0 = t0;
      std::fprintf(stderr, "--- %s\n", name);
    }
    fn();
    seconds.push_back(Since(t0));
    if (g_trace) {
      std::lock_guard<std::mutex> lock(g_trace_mu);
      std::fprintf(stderr, "%8.1f end of %s\n", seconds.back() * 1e3, name);
    }
    requests += S3RequestCountForTesting() - r0;
    bytes_received += S3BytesReceivedForTesting() - b0;
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dcp save/load through s3:// vs raw PUT/GET of the same bytes, same client"};
  std::string uri;
  int size_mib = 256, files = 4, repeats = 5;
  bool json = false;
  app.add_option("--uri", uri, "s3://bucket/prefix[?options] to use (emptied before and after)")
      ->required();
  app.add_option("--size-mib", size_mib, "bytes per save, MiB");
  app.add_option("--files", files, "tensors = data files = raw objects = threads (1 rank)");
  app.add_option("--repeats", repeats, "runs of each measurement (the median is reported)");
  app.add_flag("--json", json, "one JSON line");
  app.add_flag("--trace", g_trace, "print every request (ms into its operation) on stderr");
  CLI11_PARSE(app, argc, argv);
  if (g_trace) {
    SetS3FaultHookForTesting([](const S3RequestInfo& r) {
      std::lock_guard<std::mutex> lock(g_trace_mu);
      std::fprintf(stderr, "%8.1f %-6s %s%s%s\n", Since(g_trace_t0) * 1e3, r.method.c_str(),
                   r.key.c_str(), r.query.empty() ? "" : "?", r.query.c_str());
      return S3Fault::kNone;
    });
  }
  if (uri.rfind("s3://", 0) != 0 || files < 1 || repeats < 1) {
    std::cerr << "dcp-s3-bench: --uri must be s3://bucket/prefix, --files and --repeats >= 1\n";
    return 2;
  }
  std::string query;
  if (const size_t q = uri.find('?'); q != std::string::npos) {
    query = uri.substr(q);
    uri.resize(q);
  }
  try {
    const int64_t rows =
        std::max<int64_t>(kRanks, ((static_cast<int64_t>(size_mib) << 20) / files) / (kCols * 4));
    const size_t per = static_cast<size_t>(rows * kCols * 4);
    const double total = static_cast<double>(per) * files;
    const double gib = total / double(uint64_t{1} << 30);
    std::vector<TensorView> src, dst;
    StateDict sd, back;
    for (int i = 0; i < files; ++i) {
      src.push_back(bench::AlignedTensor(DType::kFloat32, {rows, kCols}));
      tools::FillRandomBytes(src.back().data, per, 100 + i);
      dst.push_back(bench::AlignedTensor(DType::kFloat32, {rows, kCols}));
      sd.Set("t" + std::to_string(i), src.back());
      back.Set("t" + std::to_string(i), dst.back());
    }
    const std::vector<StateDict> src_rows = Sharded(src, kRanks, 0);
    std::vector<StateDict> dst_rows = Sharded(dst, kRanks, 0), dst_cols = Sharded(dst, kRanks, 1);
    InProcessGroup group(kRanks);
    const std::string ckpt1 = uri + "/ckpt1", ckpt4 = uri + "/ckpt4", raw = uri + "/raw";
    for (const std::string& u : {ckpt1, ckpt4, raw}) {
      auto s = OpenStore(u + query);
      s->CreateRoot();
      RemoveAll(*s);
    }
    // A check after every load: what was loaded is what was saved; then clear for the next.
    auto check = [&](const char* what) {
      for (int i = 0; i < files; ++i) {
        if (std::memcmp(dst[i].data, src[i].data, per) != 0) {
          throw std::runtime_error(std::string(what) + " returned different bytes");
        }
        std::memset(dst[i].data, 0, per);
      }
    };

    const int files4 = std::max(1, files / kRanks);  // per rank
    Phase put1{"raw PUT, 1 rank"}, get1{"raw GET, 1 rank"}, save1{"save, 1 rank"},
        load1{"load, 1 rank"}, put4{"raw PUT, 4 ranks"}, get4{"raw GET, 4 ranks"},
        save4{"save, 4 ranks"}, load4{"load, 4 ranks"}, reshard{"column reshard, 4 ranks"},
        reshard1{"load 4 -> 1"};
    SaveOptions so;
    so.storage.files_per_rank = files;
    so.storage.overwrite = true;
    so.storage.memory_budget_bytes = static_cast<size_t>(files) * kWriterStagingBytes;
    LoadOptions lo;
    lo.storage.read_threads = files;
    lo.storage.memory_budget_bytes = static_cast<size_t>(files) * kWriterStagingBytes;
    SaveOptions so4 = so;
    so4.storage.files_per_rank = files4;
    so4.storage.memory_budget_bytes = static_cast<size_t>(files4) * kWriterStagingBytes;
    LoadOptions lo4 = lo;
    lo4.storage.read_threads = files4;
    lo4.storage.memory_budget_bytes = static_cast<size_t>(files4) * kWriterStagingBytes;
    // Each dcp phase is measured next to its raw phase, in alternating order (raw first in even
    // repeats, dcp first in odd ones), and a row's ratio is the median of the repeats' ratios:
    // a shared machine's slow spells then hit both sides of a pair alike.
    auto pair = [&](int rep, Phase& raw_phase, const std::function<void()>& raw_fn,
                    const std::function<void()>& raw_after, Phase& dcp_phase,
                    const std::function<void()>& dcp_fn, const std::function<void()>& dcp_after) {
      if (rep % 2 == 0) {
        raw_phase.Run(raw_fn);
        raw_after();
      }
      dcp_phase.Run(dcp_fn);
      dcp_after();
      if (rep % 2 == 1) {
        raw_phase.Run(raw_fn);
        raw_after();
      }
    };
    auto nothing = [] {};
    for (int rep = 0; rep < repeats; ++rep) {
      // ---- 1 rank: one store, --files threads
      auto store = OpenStore(raw + query);
      pair(
          rep, put1,
          [&] {
            OnThreads(files, [&](int i) {
              auto w = store->Create("obj-" + std::to_string(i));
              w->Append(src[i].data, per);
              w->Close();
            });
          },
          nothing, save1, [&] { Save(sd, ckpt1 + query, so); }, nothing);
      pair(
          rep, get1,
          [&] {
            OnThreads(files, [&](int i) {
              auto r = store->Open("obj-" + std::to_string(i));
              r->ReadAt(0, dst[i].data, per);
            });
          },
          [&] { check("raw GET"); }, load1, [&] { Load(back, ckpt1 + query, lo); },
          [&] { check("load (1 rank)"); });

      // ---- 4 ranks: a store per rank; the raw side the same bytes in --files objects
      std::vector<std::shared_ptr<Store>> stores;
      for (int r = 0; r < kRanks; ++r) stores.push_back(OpenStore(raw + query));
      const int threads = std::max(files, kRanks);
      auto raw_get4 = [&] {
        OnThreads(threads, [&](int t) {
          if (t >= files) return;
          auto r = stores[t % kRanks]->Open("obj-" + std::to_string(t));
          r->ReadAt(0, dst[t].data, per);
        });
      };
      pair(
          rep, put4,
          [&] {
            OnThreads(threads, [&](int t) {
              if (t >= files) return;
              auto w = stores[t % kRanks]->Create("obj-" + std::to_string(t));
              w->Append(src[t].data, per);
              w->Close();
            });
          },
          nothing, save4,
          [&] {
            TimeRanks(group, [&](int r, Communicator& comm) {
              Save(src_rows[static_cast<size_t>(r)], ckpt4 + query, comm, so4);
            });
          },
          nothing);
      pair(
          rep, get4, raw_get4, [&] { check("raw GET (4 ranks)"); }, load4,
          [&] {
            TimeRanks(group, [&](int r, Communicator& comm) {
              Load(dst_rows[static_cast<size_t>(r)], ckpt4 + query, comm, lo4);
            });
          },
          [&] { check("load (4 ranks)"); });
      // The resharding loads against the raw GETs of this repeat.
      reshard.Run([&] {
        TimeRanks(group, [&](int r, Communicator& comm) {
          Load(dst_cols[static_cast<size_t>(r)], ckpt4 + query, comm, lo4);
        });
      });
      check("resharding load (4 ranks, rows -> columns)");
      reshard1.Run([&] { Load(back, ckpt4 + query, lo); });
      check("resharding load (4 ranks -> 1)");
    }
    for (const std::string& u : {ckpt1, ckpt4, raw}) RemoveAll(*OpenStore(u + query));

    auto gbps = [&](const Phase& p) { return total / Median(p.seconds) / 1e9; };
    // The repeats' raw/dcp time ratios: their median, lowest and highest.
    struct Ratio {
      double median, low, high;
    };
    auto ratio = [&](const Phase& dcp_phase, const Phase& raw_phase) {
      std::vector<double> r;
      for (size_t i = 0; i < dcp_phase.seconds.size(); ++i) {
        r.push_back(raw_phase.seconds[i] / dcp_phase.seconds[i]);
      }
      return Ratio{Median(r), *std::min_element(r.begin(), r.end()),
                   *std::max_element(r.begin(), r.end())};
    };
    auto per_gib = [&](const Phase& p) { return double(p.requests) / repeats / gib; };
    // Bytes a phase received over the state's bytes (a load: how often it read the checkpoint).
    auto read_ratio = [&](const Phase& p) { return double(p.bytes_received) / repeats / total; };
    struct Row {
      const char* name;
      const Phase& dcp;
      const Phase& raw;
      const char* raw_name;
    };
    const Row table[] = {{"save_1rank", save1, put1, "PUT"},
                         {"load_1rank", load1, get1, "GET"},
                         {"save_4ranks", save4, put4, "PUT"},
                         {"load_4ranks", load4, get4, "GET"},
                         {"reshard_load_4ranks", reshard, get4, "GET"},
                         {"reshard_load_4to1", reshard1, get1, "GET"}};
    if (json) {
      std::printf("{\"bytes\":%.0f,\"files\":%d,\"repeats\":%d", total, files, repeats);
      for (const Row& r : table) {
        const Ratio q = ratio(r.dcp, r.raw);
        std::printf(
            ",\"%s\":{\"gbps\":%.4f,\"raw_gbps\":%.4f,\"ratio\":%.3f,\"ratio_low\":%.3f,"
            "\"ratio_high\":%.3f,\"requests_per_gib\":%.1f,\"raw_requests_per_gib\":%.1f,"
            "\"read_bytes_ratio\":%.3f}",
            r.name, gbps(r.dcp), gbps(r.raw), q.median, q.low, q.high, per_gib(r.dcp),
            per_gib(r.raw), read_ratio(r.dcp));
      }
      std::printf("}\n");
    } else {
      std::printf("dcp-s3-bench: %.0f MiB in %d tensors [%lld x %lld] f32, median of %d, %s%s\n",
                  total / (1 << 20), files, static_cast<long long>(rows),
                  static_cast<long long>(kCols), repeats, uri.c_str(), query.c_str());
      for (const Row& r : table) {
        const Ratio q = ratio(r.dcp, r.raw);
        std::printf(
            "  %-20s %.3f GB/s  raw %s %.3f GB/s  ratio %.2f (%.2f-%.2f)  requests/GiB %.1f (raw "
            "%.1f)  bytes read %.2f x\n",
            r.name, gbps(r.dcp), r.raw_name, gbps(r.raw), q.median, q.low, q.high, per_gib(r.dcp),
            per_gib(r.raw), read_ratio(r.dcp));
      }
    }
  } catch (const std::exception& e) {
    std::cerr << "dcp-s3-bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
