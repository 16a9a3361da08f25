// dcp-s3-bench: dcp save/load through s3:// against raw PUT/GET of the same bytes with the same
// client (dcp's S3 store used directly: the same multipart uploads and ranged GETs, no
// checkpoint protocol, no checksums), on the same server in the same run. Medians of
// --repeats runs; prints GB/s and the ratios dcp/raw.
//
//   dcp-s3-bench --uri s3://bucket/prefix [--size-mib 256] [--files 4] [--repeats 3] [--json]
//
// Configuration of the server and credentials: the AWS_* environment (storage/backends/s3/s3_store.h).
// The state is --files tensors of size/files bytes each, one data file each (files_per_rank =
// --files), and the raw baseline writes and reads --files objects of the same sizes on as many
// threads, so both sides have the same parallelism.
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <iostream>
#include <thread>

#include "dcp/dcp.h"
#include "dcp/storage/registry.h"
#include "dcp/storage/checkpoint/store_checkpoint.h"
#include "tools/bench_util.h"
#include "tools/fill_random.h"

using namespace dcp;
using dcp::bench::Clock;
using dcp::bench::Median;
using dcp::bench::Since;

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

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dcp save/load through s3:// vs raw PUT/GET of the same bytes, same client"};
  std::string uri;
  int size_mib = 256, files = 4, repeats = 3;
  bool json = false;
  app.add_option("--uri", uri, "s3://bucket/prefix to use (emptied before and after)")->required();
  app.add_option("--size-mib", size_mib, "bytes per save, MiB");
  app.add_option("--files", files, "tensors = data files = raw objects = threads");
  app.add_option("--repeats", repeats, "runs of each measurement (the median is reported)");
  app.add_flag("--json", json, "one JSON line");
  CLI11_PARSE(app, argc, argv);
  if (uri.rfind("s3://", 0) != 0) {
    std::cerr << "dcp-s3-bench: --uri must be s3://bucket/prefix\n";
    return 2;
  }
  try {
    const size_t per = (static_cast<size_t>(size_mib) << 20) / files / 4 * 4;
    const double total = static_cast<double>(per) * files;
    std::vector<TensorView> src, dst;
    StateDict sd, back;
    for (int i = 0; i < files; ++i) {
      src.push_back(bench::AlignedTensor(DType::kFloat32, {static_cast<int64_t>(per / 4)}));
      tools::FillRandomBytes(src.back().data, per, 100 + i);
      dst.push_back(bench::AlignedTensor(DType::kFloat32, {static_cast<int64_t>(per / 4)}));
      sd.Set("t" + std::to_string(i), src.back());
      back.Set("t" + std::to_string(i), dst.back());
    }
    const std::string ckpt = uri + "/ckpt", raw = uri + "/raw";
    auto ckpt_store = OpenStore(ckpt);
    auto raw_store = OpenStore(raw);
    ckpt_store->CreateRoot();
    RemoveAll(*ckpt_store);
    RemoveAll(*raw_store);

    std::vector<double> save_s, load_s, put_s, get_s;
    SaveOptions so;
    so.storage.files_per_rank = files;
    so.storage.overwrite = true;
    so.storage.memory_budget_bytes = static_cast<size_t>(files) * kWriterStagingBytes;
    LoadOptions lo;
    lo.storage.read_threads = files;
    lo.storage.memory_budget_bytes = static_cast<size_t>(files) * kWriterStagingBytes;
    for (int rep = 0; rep < repeats; ++rep) {
      auto t = Clock::now();
      OnThreads(files, [&](int i) {
        auto w = raw_store->Create("obj-" + std::to_string(i));
        w->Append(src[i].data, per);
        w->Close();
      });
      put_s.push_back(Since(t));
      t = Clock::now();
      OnThreads(files, [&](int i) {
        auto r = raw_store->Open("obj-" + std::to_string(i));
        r->ReadAt(0, dst[i].data, per);
      });
      get_s.push_back(Since(t));
      for (int i = 0; i < files; ++i) {
        if (std::memcmp(dst[i].data, src[i].data, per) != 0) {
          std::cerr << "dcp-s3-bench: raw GET returned different bytes\n";
          return 1;
        }
        std::memset(dst[i].data, 0, per);
      }

      t = Clock::now();
      Save(sd, ckpt, so);
      save_s.push_back(Since(t));
      t = Clock::now();
      Load(back, ckpt, lo);
      load_s.push_back(Since(t));
      for (int i = 0; i < files; ++i) {
        if (std::memcmp(dst[i].data, src[i].data, per) != 0) {
          std::cerr << "dcp-s3-bench: load returned different bytes\n";
          return 1;
        }
        std::memset(dst[i].data, 0, per);
      }
    }
    RemoveAll(*ckpt_store);
    RemoveAll(*raw_store);
    auto gbps = [&](const std::vector<double>& s) { return total / Median(s) / 1e9; };
    const double save = gbps(save_s), load = gbps(load_s), put = gbps(put_s), get = gbps(get_s);
    if (json) {
      std::printf(
          "{\"bytes\":%.0f,\"files\":%d,\"repeats\":%d,\"save_gbps\":%.4f,\"raw_put_gbps\":%.4f,"
          "\"load_gbps\":%.4f,\"raw_get_gbps\":%.4f,\"save_vs_put\":%.3f,\"load_vs_get\":%.3f}\n",
          total, files, repeats, save, put, load, get, save / put, load / get);
    } else {
      std::printf("dcp-s3-bench: %.0f MiB in %d tensors/objects, median of %d, %s\n",
                  total / (1 << 20), files, repeats, uri.c_str());
      std::printf("  save  %.3f GB/s   raw PUT %.3f GB/s   save/PUT %.2f\n", save, put, save / put);
      std::printf("  load  %.3f GB/s   raw GET %.3f GB/s   load/GET %.2f\n", load, get, load / get);
    }
  } catch (const std::exception& e) {
    std::cerr << "dcp-s3-bench: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
