// dcp-gpu-bench: what a GPU job pays for a checkpoint, against baselines measured in the same
// run on the same bytes.
//
//   D2H staging: dcp's pinned pipeline (StreamToHost, 16 MiB pieces, two buffers) draining a
//     CUDA tensor, vs one cudaMemcpyAsync of the same bytes into pinned memory (the peak).
//   Save: dcp save of CUDA tensors to a directory (fsync), vs raw O_DIRECT write+fsync of the
//     same bytes from host memory; and vs "copy to host, then raw write" done serially.
//   Load: dcp cold load into CUDA tensors, vs raw cold read of the same bytes into host memory.
//   Async: how long AsyncCheckpointer::Save blocks for CUDA tensors, vs the pinned D2H peak.
// Medians over --repeats. Needs a CUDA device: without one it says so and exits 77.
// With --json the last line is one JSON object.
#include <cuda_runtime_api.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "dcp/dcp.h"
#include "dcp/proto/device/device.h"
#include "tools/bench_util.h"
#include "tools/fill_random.h"

using namespace dcp;
using namespace dcp::bench;

namespace {

void CheckCuda(cudaError_t e, const char* what) {
  if (e != cudaSuccess) {
    std::fprintf(stderr, "dcp-gpu-bench: %s: %s\n", what, cudaGetErrorString(e));
    std::exit(1);
  }
}

struct DeviceTensors {
  std::vector<TensorView> device, host;  // same shapes; host holds the bytes uploaded
};

// 8 bf16/fp32 tensors of total/8 bytes each (rows of 4096 elements), random bytes.
DeviceTensors Make(const std::shared_ptr<DeviceBackend>& cuda, size_t total, int device) {
  DeviceTensors t;
  for (int i = 0; i < 8; ++i) {
    const DType dt = i % 2 ? DType::kBFloat16 : DType::kFloat32;
    const int64_t rows = static_cast<int64_t>(total / 8 / ElementSize(dt) / 4096);
    TensorView h = AlignedTensor(dt, {rows, 4096});
    tools::FillRandomBytes(h.data, h.nbytes(), 100 + i);
    TensorView d;
    d.dtype = dt;
    d.shape = h.shape;
    d.device = Device{Device::Type::kCUDA, device};
    d.data = cuda->AllocDevice(device, h.nbytes());
    d.owner =
        std::shared_ptr<void>(d.data, [cuda, device](void* p) { cuda->FreeDevice(device, p); });
    CopyTensor(d, h);
    t.device.push_back(d);
    t.host.push_back(h);
  }
  return t;
}

uint64_t Bytes(const std::vector<TensorView>& ts) {
  uint64_t n = 0;
  for (const auto& t : ts) n += t.nbytes();
  return n;
}

StateDict AsState(const std::vector<TensorView>& ts) {
  StateDict sd;
  for (size_t i = 0; i < ts.size(); ++i) sd.Set("layer" + std::to_string(i) + ".weight", ts[i]);
  return sd;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "dcp-gpu-bench: checkpoint cost of CUDA tensors vs pinned-copy and raw-disk "
      "baselines"};
  size_t size_mib = 2048;
  int repeats = 3, device = 0;
  std::string dir;
  bool json = false;
  app.add_option("--size-mib", size_mib, "state size in MiB")->capture_default_str();
  app.add_option("--repeats", repeats, "repetitions (medians are printed)")->capture_default_str();
  app.add_option("--device", device, "CUDA device")->capture_default_str();
  app.add_option("--dir", dir, "directory on the disk to measure (default: a temp dir)");
  app.add_flag("--json", json, "print one JSON object as the last line");
  CLI11_PARSE(app, argc, argv);

  auto cuda = FindDeviceBackend(Device::Type::kCUDA);
  if (!cuda || cuda->device_count() <= device) {
    std::printf("dcp-gpu-bench: no CUDA device %d: %s\n", device,
                cuda ? cuda->unavailable_reason().c_str() : "this build has no CUDA backend");
    return 77;
  }
  cudaDeviceProp prop{};
  CheckCuda(cudaGetDeviceProperties(&prop, device), "cudaGetDeviceProperties");
  CheckCuda(cudaSetDevice(device), "cudaSetDevice");
  if (dir.empty()) {
    std::string tmpl = std::filesystem::temp_directory_path().string() + "/dcp-gpu-bench-XXXXXX";
    if (::mkdtemp(tmpl.data()) == nullptr) Die("mkdtemp");
    dir = tmpl;
  }
  std::filesystem::create_directories(dir);
  const size_t total = size_mib << 20;
  DeviceTensors t = Make(cuda, total, device);
  const double gb = Bytes(t.host) / 1e9;
  std::printf("dcp-gpu-bench: %s, %.2f GB in %zu CUDA tensors, dir %s, %d repeats\n", prop.name, gb,
              t.device.size(), dir.c_str(), repeats);

  // Pinned host memory for the peak D2H copy (and the raw baselines' source).
  void* pinned = nullptr;
  CheckCuda(cudaHostAlloc(&pinned, t.device[0].nbytes(), cudaHostAllocDefault), "cudaHostAlloc");
  cudaStream_t stream;
  CheckCuda(cudaStreamCreate(&stream), "cudaStreamCreate");

  std::vector<double> peak, staged, raw_w, dcp_save, serial_save, raw_cold, dcp_cold, async_block;
  const std::string raw = dir + "/raw.bin", ckpt = dir + "/ckpt";
  for (int rep = 0; rep < repeats; ++rep) {
    // 1. Peak: every tensor by one cudaMemcpyAsync into the same pinned buffer.
    auto t0 = Clock::now();
    for (const auto& d : t.device) {
      CheckCuda(cudaMemcpyAsync(pinned, d.data, d.nbytes(), cudaMemcpyDeviceToHost, stream),
                "cudaMemcpyAsync");
    }
    CheckCuda(cudaStreamSynchronize(stream), "cudaStreamSynchronize");
    peak.push_back(Since(t0));
    // 2. dcp's staging pipeline, consuming nothing.
    t0 = Clock::now();
    volatile char sink = 0;
    for (const auto& d : t.device) {
      StreamToHost(d, kDevicePieceBytes,
                   [&](const void* p, size_t) { sink = *static_cast<const char*>(p); });
    }
    staged.push_back(Since(t0));
    // 3. Raw disk write of the same bytes from host memory.
    std::filesystem::remove(raw);
    t0 = Clock::now();
    RawWrite(raw, t.host);
    raw_w.push_back(Since(t0));
    // 4. dcp save from CUDA tensors.
    std::filesystem::remove_all(ckpt);
    LocalCommunicator comm;
    t0 = Clock::now();
    Save(AsState(t.device), ckpt, comm);
    dcp_save.push_back(Since(t0));
    // 5. The naive serial alternative: whole D2H copy, then the raw write.
    t0 = Clock::now();
    for (size_t i = 0; i < t.device.size(); ++i) CopyTensor(t.host[i], t.device[i]);
    RawWrite(raw, t.host);
    serial_save.push_back(Since(t0));
    // 6. Cold reads: raw into host memory, dcp into the CUDA tensors.
    DropCaches({raw});
    t0 = Clock::now();
    RawRead(raw, t.host);
    raw_cold.push_back(Since(t0));
    DropCaches(FilesUnder(ckpt));
    StateDict into = AsState(t.device);
    t0 = Clock::now();
    Load(into, ckpt, comm);
    dcp_cold.push_back(Since(t0));
    // 7. Async save: time blocked for the snapshot.
    {
      AsyncCheckpointer async(std::make_unique<LocalCommunicator>());
      async.Save(AsState(t.device), ckpt + "-async-warmup")->Wait();  // allocate staging
      auto h = async.Save(AsState(t.device), ckpt + "-async");
      async_block.push_back(h->metrics().blocking_s);
      h->Wait();
      async.Close();
      std::filesystem::remove_all(ckpt + "-async");
      std::filesystem::remove_all(ckpt + "-async-warmup");
    }
  }
  // Correctness: what dcp loaded into the device equals the bytes written.
  for (size_t i = 0; i < t.device.size(); ++i) {
    TensorView back = AlignedTensor(t.device[i].dtype, t.device[i].shape);
    CopyTensor(back, t.device[i]);
    std::vector<char> expect(back.nbytes());
    tools::FillRandomBytes(expect.data(), expect.size(), 100 + i);
    if (std::memcmp(back.data, expect.data(), expect.size()) != 0) {
      std::fprintf(stderr, "dcp-gpu-bench: tensor %zu differs after load\n", i);
      return 1;
    }
  }
  auto gbps = [&](const std::vector<double>& s) { return gb / Median(s); };
  const double peak_g = gbps(peak), staged_g = gbps(staged), raw_w_g = gbps(raw_w),
               save_g = gbps(dcp_save), serial_g = gbps(serial_save), raw_r_g = gbps(raw_cold),
               load_g = gbps(dcp_cold);
  std::printf("%-44s %8s %8s\n", "", "GB/s", "ratio");
  std::printf("%-44s %8.2f\n", "pinned cudaMemcpy D2H (peak)", peak_g);
  std::printf("%-44s %8.2f %8.2f  vs peak\n", "dcp D2H staging pipeline", staged_g,
              staged_g / peak_g);
  std::printf("%-44s %8.2f\n", "raw O_DIRECT write+fsync (host bytes)", raw_w_g);
  std::printf("%-44s %8.2f %8.2f  vs raw write\n", "dcp save from CUDA tensors", save_g,
              save_g / raw_w_g);
  std::printf("%-44s %8.2f %8.2f  dcp vs this\n", "serial: whole D2H copy, then raw write",
              serial_g, save_g / serial_g);
  std::printf("%-44s %8.2f\n", "raw read, cold (into host memory)", raw_r_g);
  std::printf("%-44s %8.2f %8.2f  vs raw cold read\n", "dcp load cold into CUDA tensors", load_g,
              load_g / raw_r_g);
  std::printf("%-44s %8.3f s  (%.2fx the pinned D2H time %.3f s)\n", "async save blocked",
              Median(async_block), Median(async_block) / Median(peak), Median(peak));
  if (json) {
    nlohmann::json j = {{"gpu", prop.name},
                        {"bytes", Bytes(t.host)},
                        {"d2h_peak_gbps", peak_g},
                        {"d2h_staging_gbps", staged_g},
                        {"d2h_staging_vs_peak", staged_g / peak_g},
                        {"raw_write_gbps", raw_w_g},
                        {"save_gbps", save_g},
                        {"save_vs_raw", save_g / raw_w_g},
                        {"serial_d2h_then_write_gbps", serial_g},
                        {"raw_read_cold_gbps", raw_r_g},
                        {"load_cold_gbps", load_g},
                        {"load_cold_vs_raw", load_g / raw_r_g},
                        {"async_blocking_s", Median(async_block)},
                        {"async_blocking_vs_d2h_peak", Median(async_block) / Median(peak)}};
    std::printf("%s\n", j.dump().c_str());
  }
  cudaFreeHost(pinned);
  cudaStreamDestroy(stream);
  std::filesystem::remove_all(ckpt);
  std::filesystem::remove(raw);
  return 0;
}
