// dcp-bench: dcp against baselines measured in the same run, on the same bytes (random, not zero).
//
//   dcp-bench [--size-mib N] [--repeats R] [--dir DIR] [--files-per-rank F] [--python PY]
//             [--torch-peer EXE] [--json]
//     Disk mode (default): raw O_DIRECT write+fsync of the state's bytes in large aligned blocks,
//     raw cold (page cache dropped) and warm reads into preallocated memory; dcp save (fsync) and
//     cold/warm load through file:// at 1 rank (the state in one process) and at 4 ranks (an
//     InProcessGroup: 4 threads, every tensor row-sharded so each rank saves and loads its
//     quarter); that 4-rank checkpoint loaded column-sharded (2-D tensors split along their
//     second dimension) at 4 and at 2 ranks, cold, against the raw cold read, with the bytes the
//     load read over the checkpoint's (reshard_read_bytes_ratio); LibTorch torch::save (+fsync) and
//     cold/warm torch::load, run by the peer program EXE (default: dcp-bench-torch-peer next to
//     this executable, built with LibTorch); and, when PY (default /usr/bin/python3) imports torch,
//     PyTorch DCP (single_file_per_rank, no_dist) and Python torch.save/torch.load. All on the same
//     bytes in the same directory; a peer that is absent has null keys. Medians over R runs (a
//     ratio to raw: the median of the per-run ratios); with --json the last line is one JSON
//     object.
//
//   dcp-bench --safetensors [--ranks 2,4] [--size-mib N] [--repeats R] [--dir DIR] [--json]
//     For each rank count N (an InProcessGroup: N threads, every tensor of the disk mode's mixed
//     state row-sharded): an N-rank save (fsync) into safetensors (whole tensors, shards exchanged
//     among the ranks, each file written by one rank) against a dcp save of the same bytes, runs
//     interleaved; the ratio is the median over repeats of dcp's time over safetensors' in the
//     same repeat (1.0: as fast as dcp). One load of the safetensors checkpoint is checked
//     bit-exact.
//
//   dcp-bench --incremental [--size-mib N] [--repeats R] [--dir DIR] [--json]
//     A LoRA-shaped state: N MiB (default 2048) of frozen bf16 weights in 16 matrices, trainable
//     adapters of 1% of their parameters (two bf16 matrices per layer) and Adam's two moments for
//     them (bf16): 3% of the weights' bytes change per step. 10 synchronous saves through a
//     CheckpointManager (incremental, keep_last 1, the weights declared frozen), each after a
//     training step that rewrites the adapters and moments; then step 10 loaded bit-exact once
//     retention removed steps 1-9. incremental_bytes_ratio: the most bytes any of saves 2-10
//     wrote over save 1's; incremental_time_ratio: the same for time. The same 10 saves without
//     declaring the weights frozen (every item hashed): incremental_time_ratio_hashed. Then the
//     hash's cost where nothing repeats: R pairs of a save with content hashes against the
//     previous save of that kind (every item changed: each one's first block differs) and a
//     plain save of the same bytes, interleaved; incremental_hash_overhead is the median of
//     (hashed time / plain time - 1).
//
//   dcp-bench --async [--size-mib N] [--repeats R] [--dir DIR] [--json]
//     Blocking time of an asynchronous save against a plain memcpy of the same bytes into warm
//     buffers; a synchronous save of the same state; and how much a compute loop slows down while
//     a background save runs. With --json the last line is one JSON object.
#include <fcntl.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <thread>
#include <vector>

#include "dcp/dcp.h"
#include "tools/bench_util.h"
#include "tools/fill_random.h"

namespace {

using namespace dcp;
using namespace dcp::bench;

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

// ---- Disk mode ---------------------------------------------------------------------------------

// A mixed state: ~90 % in 8 large float32/bf16/fp16 tensors (4 KiB multiples), ~10 % in 16
// medium odd-sized uint8 tensors, plus 40 small odd ones (1 byte to ~300 KiB).
std::vector<TensorView> MakeMixedTensors(size_t total) {
  std::vector<TensorView> ts;
  const DType big[] = {DType::kFloat32, DType::kBFloat16, DType::kFloat16, DType::kFloat32};
  for (int i = 0; i < 8; ++i) {
    const DType dt = big[i % 4];
    const size_t pages = std::max<size_t>(1, total * 9 / 10 / 8 / kPage);
    const int64_t rows = static_cast<int64_t>(pages * kPage / ElementSize(dt) / 1024);
    ts.push_back(AlignedTensor(dt, {rows, 1024}));
  }
  for (int i = 0; i < 16; ++i) {
    ts.push_back(
        AlignedTensor(DType::kUInt8, {static_cast<int64_t>(total / 10 / 16 + 13 * i + 1)}));
  }
  for (int i = 0; i < 40; ++i) {
    ts.push_back(AlignedTensor(DType::kUInt8, {static_cast<int64_t>((i * 7919u) % 300000 + 1)}));
  }
  return ts;
}

bool SameBytes(const std::vector<TensorView>& a, const std::vector<TensorView>& b) {
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::memcmp(a[i].data, b[i].data, a[i].nbytes()) != 0) return false;
  }
  return true;
}

// The PyTorch peers, run by `python` on the raw file's bytes (the same bytes dcp saves).
// Prints one JSON line of median seconds.
constexpr const char* kPeerScript = R"PY(
import copy, dataclasses, json, os, sys, time, shutil, statistics
_orig = dataclasses._get_field
def _get_field(cls, a_name, a_type, *rest):
    d = cls.__dict__.get(a_name, dataclasses.MISSING)
    val = d.default if isinstance(d, dataclasses.Field) else d
    if val is not dataclasses.MISSING and dataclasses.is_dataclass(val) and type(val).__hash__ is None:
        setattr(cls, a_name, dataclasses.field(default_factory=lambda v=val: copy.deepcopy(v)))
    return _orig(cls, a_name, a_type, *rest)
dataclasses._get_field = _get_field
import torch
try:
    import torch.distributed.checkpoint as dcp
except ImportError:
    import torch.distributed._shard.checkpoint as dcp
dataclasses._get_field = _orig
spec = json.load(open(sys.argv[1]))
raw, work, repeats = spec["raw"], spec["dir"], spec["repeats"]
dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
          "uint8": torch.uint8}
blob = torch.from_file(raw, shared=False, size=os.path.getsize(raw), dtype=torch.uint8)
sd, off = {}, 0
for i, t in enumerate(spec["tensors"]):
    n = t["nbytes"]
    sd["t%d" % i] = blob[off:off + n].clone().view(dtypes[t["dtype"]]).reshape(t["shape"])
    off += n
del blob
def drop(paths):
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f: f.write("1")
        return
    except OSError:
        pass
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
def files(d):
    return [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
res = {k: [] for k in ["torch_save", "torch_load_cold", "torch_load_warm", "dcp_save",
                       "dcp_load_cold", "dcp_load_warm"]}
dst = {k: torch.zeros_like(v) for k, v in sd.items()}
for r in range(repeats):
    p = os.path.join(work, "torch.pt")
    t0 = time.perf_counter()
    with open(p, "wb") as f:
        torch.save(sd, f); f.flush(); os.fsync(f.fileno())
    res["torch_save"].append(time.perf_counter() - t0)
    drop([p])
    t0 = time.perf_counter(); x = torch.load(p); res["torch_load_cold"].append(time.perf_counter() - t0)
    del x
    t0 = time.perf_counter(); x = torch.load(p); res["torch_load_warm"].append(time.perf_counter() - t0)
    del x
    os.remove(p)
    d = os.path.join(work, "ptdcp")
    shutil.rmtree(d, ignore_errors=True)
    t0 = time.perf_counter()
    dcp.save_state_dict(sd, dcp.FileSystemWriter(d, single_file_per_rank=True), no_dist=True)
    res["dcp_save"].append(time.perf_counter() - t0)
    drop(files(d))
    t0 = time.perf_counter(); dcp.load_state_dict(dst, dcp.FileSystemReader(d), no_dist=True)
    res["dcp_load_cold"].append(time.perf_counter() - t0)
    t0 = time.perf_counter(); dcp.load_state_dict(dst, dcp.FileSystemReader(d), no_dist=True)
    res["dcp_load_warm"].append(time.perf_counter() - t0)
    shutil.rmtree(d, ignore_errors=True)
assert all(torch.equal(dst[k].view(torch.uint8), sd[k].view(torch.uint8)) for k in sd)
print(json.dumps({k: statistics.median(v) for k, v in res.items()}))
)PY";

// The peers' input: the raw file (the state's bytes back to back, in tensor order), the scratch
// directory, the repeat count and each tensor's dtype, shape and size. Written to DIR/peers.json.
std::string WritePeerSpec(const std::string& dir, const std::string& raw,
                          const std::vector<TensorView>& ts, int repeats) {
  nlohmann::json spec = {{"raw", raw}, {"dir", dir}, {"repeats", repeats}};
  for (const auto& t : ts) {
    spec["tensors"].push_back({{"dtype", t.dtype == DType::kFloat32    ? "float32"
                                         : t.dtype == DType::kBFloat16 ? "bfloat16"
                                         : t.dtype == DType::kFloat16  ? "float16"
                                                                       : "uint8"},
                               {"shape", t.shape},
                               {"nbytes", t.nbytes()}});
  }
  const std::string path = dir + "/peers.json";
  std::ofstream(path) << spec.dump();
  return path;
}

// Run a peer command (stderr to `err`); its last stdout line is a JSON object of median seconds.
// nullopt (with the tail of its stderr printed) when it fails.
std::optional<nlohmann::json> RunPeer(const std::string& what, const std::string& cmd,
                                      const std::string& err) {
  FILE* f = ::popen((cmd + " 2>" + err).c_str(), "r");
  if (f == nullptr) return std::nullopt;
  std::string out;
  char buf[4096];
  while (size_t n = std::fread(buf, 1, sizeof(buf), f)) out.append(buf, n);
  const int status = ::pclose(f);
  if (status == 0) {
    const size_t nl = out.find_last_of('\n', out.size() >= 2 ? out.size() - 2 : 0);
    auto j = nlohmann::json::parse(nl == std::string::npos ? out : out.substr(nl + 1), nullptr,
                                   /*allow_exceptions=*/false);
    if (j.is_object()) return j;
  }
  std::ifstream in(err);
  std::stringstream ss;
  ss << in.rdbuf();
  std::string e = ss.str();
  if (e.size() > 600) e = e.substr(e.size() - 600);
  std::fprintf(stderr, "dcp-bench: %s unavailable (exit status %d): %s\n", what.c_str(), status,
               e.c_str());
  return std::nullopt;
}

std::optional<nlohmann::json> RunPythonPeers(const std::string& python, const std::string& dir,
                                             const std::string& spec) {
  if (python.empty() || ::access(python.c_str(), X_OK) != 0) return std::nullopt;
  std::ofstream(dir + "/peers.py") << kPeerScript;
  return RunPeer("PyTorch peers (" + python + ")", python + " " + dir + "/peers.py " + spec,
                 dir + "/peers.err");
}

// The LibTorch peer (tools/torch_save_peer.cc) on the same spec; nullopt when `exe` is absent.
std::optional<nlohmann::json> RunTorchPeer(const std::string& exe, const std::string& dir,
                                           const std::string& spec) {
  if (exe.empty() || ::access(exe.c_str(), X_OK) != 0) return std::nullopt;
  return RunPeer("LibTorch peer (" + exe + ")", exe + " " + spec, dir + "/torch_peer.err");
}

// dcp-bench-torch-peer in the directory of this executable.
std::string DefaultTorchPeer() {
  std::error_code ec;
  const auto self = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return "";
  return (self.parent_path() / "dcp-bench-torch-peer").string();
}

// Per-rank state dicts over the same memory for `ranks` ranks: every tensor is split along its
// first dimension into `ranks` near-equal row ranges (a rank whose range is empty holds no shard
// of it), each rank's shard a view of its rows.
std::vector<StateDict> ShardedStates(const std::vector<TensorView>& ts, int ranks) {
  std::vector<StateDict> out(static_cast<size_t>(ranks));
  for (size_t i = 0; i < ts.size(); ++i) {
    const TensorView& t = ts[i];
    const int64_t rows = t.shape[0];
    for (int r = 0; r < ranks; ++r) {
      ShardedTensor st{t.dtype, t.shape, {}};
      const int64_t b = rows * r / ranks, e = rows * (r + 1) / ranks;
      if (e > b) {
        Shape off(t.shape.size(), 0), len = t.shape;
        off[0] = b;
        len[0] = e - b;
        st.local_shards.push_back({t.Narrow(off, len), off});
      }
      out[static_cast<size_t>(r)].Set("t" + std::to_string(i), std::move(st));
    }
  }
  return out;
}

// The same tensors column-sharded over `ranks` ranks (a tensor parallelism change on resume): every
// 2-D tensor split along its second dimension into near-equal column ranges, 1-D ones into row
// ranges. Each shard is a strided view of its columns.
std::vector<StateDict> ColumnStates(const std::vector<TensorView>& ts, int ranks) {
  std::vector<StateDict> out(static_cast<size_t>(ranks));
  for (size_t i = 0; i < ts.size(); ++i) {
    const TensorView& t = ts[i];
    const size_t dim = t.shape.size() >= 2 ? 1 : 0;
    const int64_t n = t.shape[dim];
    for (int r = 0; r < ranks; ++r) {
      ShardedTensor st{t.dtype, t.shape, {}};
      const int64_t b = n * r / ranks, e = n * (r + 1) / ranks;
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

constexpr int kMultiRanks = 4;    // the second dcp configuration: 4 ranks as threads
constexpr int kReshardSmall = 2;  // the reshard case also loads column-sharded at 2 ranks

int RunDisk(size_t total, int repeats, const std::string& dir, int files_per_rank,
            const std::string& python, const std::string& torch_peer, bool json) {
  std::vector<TensorView> src = MakeMixedTensors(total), dst;
  StateDict state, back;
  uint64_t bytes = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    Fill(src[i].data, src[i].nbytes(), i + 1);
    dst.push_back(AlignedTensor(src[i].dtype, src[i].shape));
    state.Set("t" + std::to_string(i), src[i]);
    back.Set("t" + std::to_string(i), dst.back());
    bytes += src[i].nbytes();
  }
  // The same tensors row-sharded over kMultiRanks ranks (views of the same memory).
  std::vector<StateDict> states_n = ShardedStates(src, kMultiRanks),
                         backs_n = ShardedStates(dst, kMultiRanks);
  InProcessGroup group(kMultiRanks), group_small(kReshardSmall);
  // The 4-rank row-sharded checkpoint loaded column-sharded at 4 and at 2 ranks, cold.
  std::vector<StateDict> columns_n = ColumnStates(dst, kMultiRanks),
                         columns_small = ColumnStates(dst, kReshardSmall);
  const std::string raw = dir + "/raw.bin", ckpt = dir + "/dcp", ckpt_n = dir + "/dcp-4ranks",
                    ckpt_t = dir + "/torchdcp";
  SaveOptions so;
  so.storage.overwrite = true;
  so.storage.files_per_rank = files_per_rank;
  std::vector<double> raw_w, raw_cold, raw_warm, save, load_cold, load_warm, save_n, load_cold_n,
      load_warm_n, save_t, load_cold_t, load_warm_t, reshard_n, reshard_small, reshard_n_read,
      reshard_small_read;
  uint64_t stored_bytes = 0;
  std::string drop_method;
  uint64_t save_peak_extra = 0, load_peak_extra = 0;
  bool ok = true;
  auto clear_dst = [&] {
    for (auto& t : dst) std::memset(t.data, 0, t.nbytes());
  };
  for (int r = 0; r < repeats; ++r) {
    auto t0 = Clock::now();
    RawWrite(raw, src);
    raw_w.push_back(Since(t0));
    drop_method = DropCaches({raw});
    t0 = Clock::now();
    RawRead(raw, dst);
    raw_cold.push_back(Since(t0));
    t0 = Clock::now();
    RawRead(raw, dst);
    raw_warm.push_back(Since(t0));
    ok = ok && SameBytes(src, dst);

    // Peak extra memory of the first (cold-pool) save and load: RSS high-water mark minus RSS
    // before, with the peak reset first.
    const bool measure_memory = r == 0 && ResetPeakRss();
    uint64_t rss_before = RssBytes();
    t0 = Clock::now();
    Save(state, ckpt, so);
    save.push_back(Since(t0));
    if (measure_memory) save_peak_extra = PeakRssBytes() - std::min(PeakRssBytes(), rss_before);
    clear_dst();
    DropCaches(FilesUnder(ckpt));
    if (measure_memory) ResetPeakRss();
    rss_before = RssBytes();
    t0 = Clock::now();
    Load(back, ckpt);
    load_cold.push_back(Since(t0));
    if (measure_memory) load_peak_extra = PeakRssBytes() - std::min(PeakRssBytes(), rss_before);
    ok = ok && SameBytes(src, dst);
    t0 = Clock::now();
    Load(back, ckpt);
    load_warm.push_back(Since(t0));

    // The same state in PyTorch DCP's layout (torch.save records, pickled .metadata).
    t0 = Clock::now();
    Save(state, "torchdcp://" + ckpt_t, so);
    save_t.push_back(Since(t0));
    clear_dst();
    DropCaches(FilesUnder(ckpt_t));
    t0 = Clock::now();
    Load(back, ckpt_t);
    load_cold_t.push_back(Since(t0));
    ok = ok && SameBytes(src, dst);
    t0 = Clock::now();
    Load(back, ckpt_t);
    load_warm_t.push_back(Since(t0));

    save_n.push_back(TimeRanks(group, [&](int rank, Communicator& comm) {
      Save(states_n[static_cast<size_t>(rank)], ckpt_n, comm, so);
    }));
    clear_dst();
    DropCaches(FilesUnder(ckpt_n));
    auto load_n = [&](int rank, Communicator& comm) {
      Load(backs_n[static_cast<size_t>(rank)], ckpt_n, comm);
    };
    load_cold_n.push_back(TimeRanks(group, load_n));
    ok = ok && SameBytes(src, dst);
    load_warm_n.push_back(TimeRanks(group, load_n));

    // Reshard: the row-sharded checkpoint into column shards, cold; the bytes the load asked the
    // file system for, over the checkpoint's stored bytes.
    if (r == 0) stored_bytes = ReadMetadata(ckpt_n).TotalStoredBytes();
    auto reshard = [&](InProcessGroup& g, std::vector<StateDict>& columns,
                       std::vector<double>& seconds, std::vector<double>& read_ratio) {
      clear_dst();
      DropCaches(FilesUnder(ckpt_n));
      const uint64_t read_before = ReadCallBytes();
      seconds.push_back(TimeRanks(g, [&](int rank, Communicator& comm) {
        Load(columns[static_cast<size_t>(rank)], ckpt_n, comm);
      }));
      read_ratio.push_back(static_cast<double>(ReadCallBytes() - read_before) /
                           static_cast<double>(std::max<uint64_t>(stored_bytes, 1)));
      ok = ok && SameBytes(src, dst);
    };
    reshard(group, columns_n, reshard_n, reshard_n_read);
    reshard(group_small, columns_small, reshard_small, reshard_small_read);
  }
  if (!ok) {
    std::fprintf(stderr, "dcp-bench: loaded bytes differ from the saved ones\n");
    return 1;
  }
  std::filesystem::remove_all(ckpt);
  std::filesystem::remove_all(ckpt_n);
  std::filesystem::remove_all(ckpt_t);
  const std::string spec = WritePeerSpec(dir, raw, src, repeats);
  std::optional<nlohmann::json> libtorch = RunTorchPeer(torch_peer, dir, spec);
  std::optional<nlohmann::json> peers = RunPythonPeers(python, dir, spec);
  std::filesystem::remove(raw);

  auto gbps = [&](double s) { return bytes / s / 1e9; };
  // A dcp figure against a raw one: the median over repeats of their ratio within each repeat.
  // The two ran seconds apart, so a neighbour's burst on this shared machine moves both; a ratio
  // of the medians could pair a quiet raw run with a loud dcp run.
  auto paired = [](const std::vector<double>& raw_s, const std::vector<double>& ours_s) {
    std::vector<double> r;
    for (size_t i = 0; i < raw_s.size() && i < ours_s.size(); ++i)
      r.push_back(raw_s[i] / ours_s[i]);
    return Median(std::move(r));
  };
  const double save_vs_raw = paired(raw_w, save), load_cold_vs_raw = paired(raw_cold, load_cold),
               load_warm_vs_raw = paired(raw_warm, load_warm),
               save_n_vs_raw = paired(raw_w, save_n),
               load_cold_n_vs_raw = paired(raw_cold, load_cold_n),
               load_warm_n_vs_raw = paired(raw_warm, load_warm_n),
               reshard_n_vs_raw = paired(raw_cold, reshard_n),
               reshard_small_vs_raw = paired(raw_cold, reshard_small),
               reshard_n_vs_load = paired(load_cold_n, reshard_n);
  const double reshard_n_read_ratio = Median(reshard_n_read),
               reshard_small_read_ratio = Median(reshard_small_read);
  const double raw_w_g = gbps(Median(raw_w)), raw_cold_g = gbps(Median(raw_cold)),
               raw_warm_g = gbps(Median(raw_warm)), save_g = gbps(Median(save)),
               load_cold_g = gbps(Median(load_cold)), load_warm_g = gbps(Median(load_warm)),
               save_n_g = gbps(Median(save_n)), load_cold_n_g = gbps(Median(load_cold_n)),
               load_warm_n_g = gbps(Median(load_warm_n)), save_t_g = gbps(Median(save_t)),
               load_cold_t_g = gbps(Median(load_cold_t)), load_warm_t_g = gbps(Median(load_warm_t));
  std::printf(
      "dcp-bench: %.1f MiB in %zu tensors (4 KiB-aligned memory), %d repeats (medians; a ratio "
      "to raw is the median of the ratios within each repeat), %u cores, cold = %s\n",
      bytes / 1048576.0, src.size(), repeats, std::thread::hardware_concurrency(),
      drop_method.c_str());
  std::printf("  %-34s %8s %8s %s\n", "", "s", "GB/s", "ratio");
  auto row = [](const char* name, double s, double g, const char* ratio_name, double ratio) {
    if (ratio_name) {
      std::printf("  %-34s %8.3f %8.2f %.2f x %s\n", name, s, g, ratio, ratio_name);
    } else {
      std::printf("  %-34s %8.3f %8.2f\n", name, s, g);
    }
  };
  row("raw O_DIRECT write+fsync", Median(raw_w), raw_w_g, nullptr, 0);
  row("raw read, cold", Median(raw_cold), raw_cold_g, nullptr, 0);
  row("raw read, warm", Median(raw_warm), raw_warm_g, nullptr, 0);
  row("dcp save (1 rank, fsync)", Median(save), save_g, "raw write", save_vs_raw);
  row("dcp load, cold", Median(load_cold), load_cold_g, "raw cold read", load_cold_vs_raw);
  row("dcp load, warm", Median(load_warm), load_warm_g, "raw warm read", load_warm_vs_raw);
  std::printf(
      "  peak extra memory (1 rank, first save/load): save %.0f MiB, load %.0f MiB "
      "(budget %zu MiB)\n",
      save_peak_extra / 1048576.0, load_peak_extra / 1048576.0,
      so.storage.memory_budget_bytes >> 20);
  row("PyTorch DCP layout save (1 rank)", Median(save_t), save_t_g, "dcp save", save_t_g / save_g);
  row("PyTorch DCP layout load, cold", Median(load_cold_t), load_cold_t_g, "dcp load, cold",
      load_cold_t_g / load_cold_g);
  row("PyTorch DCP layout load, warm", Median(load_warm_t), load_warm_t_g, "dcp load, warm",
      load_warm_t_g / load_warm_g);
  row("dcp save (4 ranks, fsync)", Median(save_n), save_n_g, "raw write", save_n_vs_raw);
  row("dcp load, cold (4 ranks)", Median(load_cold_n), load_cold_n_g, "raw cold read",
      load_cold_n_vs_raw);
  row("dcp load, warm (4 ranks)", Median(load_warm_n), load_warm_n_g, "raw warm read",
      load_warm_n_vs_raw);
  row("reshard rows->columns, 4 ranks, cold", Median(reshard_n), gbps(Median(reshard_n)),
      "raw cold read", reshard_n_vs_raw);
  row("reshard rows->columns, 2 ranks, cold", Median(reshard_small), gbps(Median(reshard_small)),
      "raw cold read", reshard_small_vs_raw);
  std::printf("  %-34s %.2f x the checkpoint's bytes at 4 ranks, %.2f x at 2 (read calls)\n",
              "reshard bytes read", reshard_n_read_ratio, reshard_small_read_ratio);
  // The raw read above is one buffered stream; a same-layout dcp load reads in parallel with
  // O_DIRECT. Against that load, the reshard's own cost (exchange, packing) shows.
  std::printf("  %-34s %.2f x dcp load, cold (4 ranks, the saved layout)\n", "reshard, 4 ranks",
              reshard_n_vs_load);
  nlohmann::json null_j;
  auto peer_g = [&](const std::optional<nlohmann::json>& p, const char* key) -> nlohmann::json {
    if (!p || !p->contains(key) || !(*p)[key].is_number()) return null_j;
    return gbps((*p)[key].get<double>());
  };
  auto ratio = [&](double ours, const nlohmann::json& theirs) -> nlohmann::json {
    if (theirs.is_null()) return null_j;
    return ours / theirs.get<double>();
  };
  // Each peer row: its time, GB/s, and how many times faster (>1) dcp's 1-rank figure is.
  auto prow = [&](const std::optional<nlohmann::json>& p, const char* name, const char* key,
                  double ours, const char* what) {
    const double s = (*p)[key].get<double>();
    std::printf("  %-34s %8.3f %8.2f dcp is %.2f x (%s)\n", name, s, gbps(s), ours / gbps(s), what);
  };
  const nlohmann::json lt_save = peer_g(libtorch, "torch_save"),
                       lt_load = peer_g(libtorch, "torch_load_cold"),
                       lt_load_warm = peer_g(libtorch, "torch_load_warm");
  if (libtorch && !lt_save.is_null() && !lt_load.is_null() && !lt_load_warm.is_null()) {
    prow(libtorch, "LibTorch torch::save (+fsync)", "torch_save", save_g, "save");
    prow(libtorch, "LibTorch torch::load, cold", "torch_load_cold", load_cold_g, "cold load");
    prow(libtorch, "LibTorch torch::load, warm", "torch_load_warm", load_warm_g, "warm load");
  } else {
    std::printf("  LibTorch torch::save/torch::load: not measured (%s)\n",
                torch_peer.empty() ? "--torch-peer ''"
                : libtorch         ? "the peer's output lacks a figure"
                : ::access(torch_peer.c_str(), X_OK) != 0
                    ? ("no peer program " + torch_peer + "; it is built with LibTorch").c_str()
                    : ("the peer " + torch_peer + " failed").c_str());
  }
  const nlohmann::json pt_save = peer_g(peers, "dcp_save"),
                       pt_load = peer_g(peers, "dcp_load_cold"),
                       pt_load_warm = peer_g(peers, "dcp_load_warm"),
                       py_save = peer_g(peers, "torch_save"),
                       py_load = peer_g(peers, "torch_load_cold"),
                       py_load_warm = peer_g(peers, "torch_load_warm");
  if (peers) {
    prow(peers, "PyTorch DCP save (1.13, 1 file)", "dcp_save", save_g, "save");
    prow(peers, "PyTorch DCP load, cold", "dcp_load_cold", load_cold_g, "cold load");
    prow(peers, "PyTorch DCP load, warm", "dcp_load_warm", load_warm_g, "warm load");
    prow(peers, "Python torch.save (+fsync)", "torch_save", save_g, "save");
    prow(peers, "Python torch.load, cold", "torch_load_cold", load_cold_g, "cold load");
    prow(peers, "Python torch.load, warm", "torch_load_warm", load_warm_g, "warm load");
  } else {
    std::printf("  PyTorch peers: not measured (%s)\n",
                python.empty() ? "--python ''" : ("no usable torch in " + python).c_str());
  }
  if (json) {
    nlohmann::json j = {{"bytes", bytes},
                        {"repeats", repeats},
                        {"cold_method", drop_method},
                        {"raw_write_gbps", raw_w_g},
                        {"raw_read_cold_gbps", raw_cold_g},
                        {"raw_read_warm_gbps", raw_warm_g},
                        {"save_gbps", save_g},
                        {"load_cold_gbps", load_cold_g},
                        {"load_warm_gbps", load_warm_g},
                        {"save_vs_raw", save_vs_raw},
                        {"load_cold_vs_raw", load_cold_vs_raw},
                        {"load_warm_vs_raw", load_warm_vs_raw},
                        {"memory_budget_mib", so.storage.memory_budget_bytes >> 20},
                        {"save_peak_extra_mib", save_peak_extra / 1048576.0},
                        {"load_peak_extra_mib", load_peak_extra / 1048576.0},
                        {"torchdcp_save_gbps", save_t_g},
                        {"torchdcp_load_cold_gbps", load_cold_t_g},
                        {"torchdcp_load_warm_gbps", load_warm_t_g},
                        {"torchdcp_save_vs_dcp", save_t_g / save_g},
                        {"torchdcp_load_cold_vs_dcp", load_cold_t_g / load_cold_g},
                        {"save_4rank_gbps", save_n_g},
                        {"load_cold_4rank_gbps", load_cold_n_g},
                        {"load_warm_4rank_gbps", load_warm_n_g},
                        {"save_4rank_vs_raw", save_n_vs_raw},
                        {"load_cold_4rank_vs_raw", load_cold_n_vs_raw},
                        {"load_warm_4rank_vs_raw", load_warm_n_vs_raw},
                        {"reshard_cold_gbps", gbps(Median(reshard_n))},
                        {"reshard_cold_vs_raw", reshard_n_vs_raw},
                        {"reshard_read_bytes_ratio", reshard_n_read_ratio},
                        {"reshard_vs_load_cold", reshard_n_vs_load},
                        {"reshard_2rank_cold_vs_raw", reshard_small_vs_raw},
                        {"reshard_2rank_read_bytes_ratio", reshard_small_read_ratio},
                        {"torch_save_gbps", lt_save},
                        {"torch_load_gbps", lt_load},
                        {"torch_load_warm_gbps", lt_load_warm},
                        {"save_vs_torch_save", ratio(save_g, lt_save)},
                        {"load_vs_torch_load", ratio(load_cold_g, lt_load)},
                        {"pytorch_dcp_save_gbps", pt_save},
                        {"pytorch_dcp_load_cold_gbps", pt_load},
                        {"pytorch_dcp_load_warm_gbps", pt_load_warm},
                        {"save_vs_pytorch_dcp", ratio(save_g, pt_save)},
                        {"load_vs_pytorch_dcp", ratio(load_cold_g, pt_load)},
                        {"python_torch_save_gbps", py_save},
                        {"python_torch_load_cold_gbps", py_load},
                        {"python_torch_load_warm_gbps", py_load_warm},
                        {"save_vs_python_torch_save", ratio(save_g, py_save)},
                        {"load_vs_python_torch_load", ratio(load_cold_g, py_load)}};
    std::printf("%s\n", j.dump().c_str());
  }
  return 0;
}

// ---- safetensors mode --------------------------------------------------------------------------

// --incremental (see the header comment).
struct LoraBenchState {
  std::vector<TensorView> base, trainable;  // trainable: adapters and Adam moments
  StateDict sd;
  uint64_t base_bytes = 0, trainable_bytes = 0;

  explicit LoraBenchState(size_t total) {
    constexpr int kLayers = 16;
    constexpr int64_t kCols = 4096;
    const int64_t rows = std::max<int64_t>(1, static_cast<int64_t>(total / kLayers / 2 / kCols));
    // Rank r of A (r x cols) and B (rows x r) with 2 r (rows + cols) = 1% of rows x cols... per
    // matrix, as parameters; its two Adam moments the same shapes.
    const int64_t rank = std::max<int64_t>(1, rows * kCols / 100 / (rows + kCols));
    for (int l = 0; l < kLayers; ++l) {
      TensorView w = AlignedTensor(DType::kBFloat16, {rows, kCols});
      tools::FillRandomBytes(w.data, w.nbytes(), 1000 + static_cast<uint64_t>(l));
      base.push_back(w);
      base_bytes += w.nbytes();
      const std::string layer = "layers." + std::to_string(l);
      sd.Nested("base").Nested(layer).Set("weight", w);
      StateDict& lora = sd.Nested("lora").Nested(layer);
      StateDict& adam = sd.Nested("optim").Nested(layer);
      for (const char* name : {"a", "b"}) {
        const Shape shape = name[0] == 'a' ? Shape{rank, kCols} : Shape{rows, rank};
        for (StateDict* d : {&lora, &adam.Nested("exp_avg"), &adam.Nested("exp_avg_sq")}) {
          TensorView t = AlignedTensor(DType::kBFloat16, shape);
          d->Set(name, t);
          trainable.push_back(t);
          trainable_bytes += t.nbytes();
        }
      }
    }
    Train(0);
  }
  // A training step: every adapter and moment changes.
  void Train(int64_t step) {
    for (size_t i = 0; i < trainable.size(); ++i) {
      tools::FillRandomBytes(trainable[i].data, trainable[i].nbytes(),
                             static_cast<uint64_t>(step) * 7919 + i);
    }
  }
  // A new value in every 4 KiB of the weights: nothing repeats, every item's first block
  // differs (as after any dense update).
  void Perturb(uint64_t round) {
    for (TensorView& t : base) {
      auto* p = static_cast<char*>(t.data);
      for (size_t off = 0; off + 8 <= t.nbytes(); off += 4096) {
        std::memcpy(p + off, &round, 8);
      }
    }
  }
};

struct IncrementalRun {
  std::vector<uint64_t> bytes;
  std::vector<double> seconds;
  bool step10_exact = false;
  bool retention_ok = false;
};

IncrementalRun RunIncrementalSaves(LoraBenchState& s, const std::string& root, bool frozen) {
  IncrementalRun run;
  std::filesystem::remove_all(root);
  LocalCommunicator comm;
  ManagerOptions o;
  o.incremental = true;
  o.keep_last = 1;
  if (frozen) o.save.storage.frozen_prefixes = {"base"};
  std::string step10;
  {
    CheckpointManager m(root, comm, nullptr, o);
    for (int64_t step = 1; step <= 10; ++step) {
      s.Train(step);
      const auto t0 = Clock::now();
      auto h = m.Save(step, s.sd);
      run.seconds.push_back(Since(t0));
      run.bytes.push_back(h->metrics().bytes_written);
    }
    run.retention_ok = m.CompleteSteps() == std::vector<int64_t>{10};
    step10 = m.PathFor(10);
    m.CloseOrThrow();
  }
  // Step 10 alone, into zeroed copies.
  std::vector<TensorView> got;
  StateDict back;
  std::function<void(const StateDict&, StateDict&)> copy = [&](const StateDict& from,
                                                               StateDict& to) {
    for (const auto& [key, value] : from.items()) {
      if (const auto* t = std::get_if<TensorView>(&value)) {
        TensorView z = AlignedTensor(t->dtype, t->shape);
        std::memset(z.data, 0, z.nbytes());
        got.push_back(z);
        to.Set(key, z);
      } else if (const auto* d = std::get_if<std::shared_ptr<StateDict>>(&value)) {
        copy(**d, to.Nested(key));
      }
    }
  };
  copy(s.sd, back);
  Load(back, step10);
  std::vector<TensorView> want;
  std::function<void(const StateDict&)> collect = [&](const StateDict& d) {
    for (const auto& [key, value] : d.items()) {
      if (const auto* t = std::get_if<TensorView>(&value)) want.push_back(*t);
      if (const auto* n = std::get_if<std::shared_ptr<StateDict>>(&value)) collect(**n);
    }
  };
  collect(s.sd);
  run.step10_exact = SameBytes(want, got);
  return run;
}

int RunIncremental(size_t total, int repeats, const std::string& dir, bool json) {
  LoraBenchState s(total);
  const double changed = static_cast<double>(s.trainable_bytes) /
                         static_cast<double>(s.base_bytes + s.trainable_bytes);
  std::printf(
      "dcp-bench --incremental: %.1f MiB frozen bf16 weights, %.1f MiB adapters + Adam "
      "(%.2f%% of a save changes per step), %u cores\n",
      s.base_bytes / 1048576.0, s.trainable_bytes / 1048576.0, changed * 100,
      std::thread::hardware_concurrency());
  const IncrementalRun frozen = RunIncrementalSaves(s, dir + "/frozen", true);
  const IncrementalRun hashed = RunIncrementalSaves(s, dir + "/hashed", false);
  auto worst = [](const IncrementalRun& r, bool time) {
    double most = 0;
    for (size_t i = 1; i < r.bytes.size(); ++i) {
      most =
          std::max(most, time ? r.seconds[i] / r.seconds[0]
                              : static_cast<double>(r.bytes[i]) / static_cast<double>(r.bytes[0]));
    }
    return most;
  };
  for (const auto* r : {&frozen, &hashed}) {
    std::printf(
        "  %s: save 1 %.3f s %.1f MiB; saves 2-10 at most %.3f s %.2f MiB (bytes %.4f, "
        "time %.4f of save 1); step 10 after retention %s\n",
        r == &frozen ? "weights frozen  " : "everything hashed", r->seconds[0],
        r->bytes[0] / 1048576.0, *std::max_element(r->seconds.begin() + 1, r->seconds.end()),
        *std::max_element(r->bytes.begin() + 1, r->bytes.end()) / 1048576.0, worst(*r, false),
        worst(*r, true), r->step10_exact && r->retention_ok ? "bit-exact" : "MISMATCH");
  }
  // Where nothing repeats: a save with content hashes (against the previous such save, whose
  // every item changed) against a plain save of the same bytes.
  std::vector<double> overhead, hashed_s, plain_s;
  SaveOptions plain;
  plain.storage.overwrite = true;
  SaveOptions with_hash = plain;
  with_hash.storage.content_hashes = true;
  const std::string nr = dir + "/norepeat";
  std::filesystem::create_directories(nr);
  for (int r = 0; r < repeats + 1; ++r) {
    s.Perturb(static_cast<uint64_t>(r) + 1);
    s.Train(100 + r);
    with_hash.storage.incremental_base = r == 0 ? "" : (r % 2 ? "h0" : "h1");
    // Each pair in the other order than the last, so that neither save always follows the
    // other (the disk's state after a 2 GiB write differs from after a pause).
    double h = 0, p = 0;
    for (int k = 0; k < 2; ++k) {
      const bool hashed = (k == 0) == (r % 2 == 0);
      const auto t0 = Clock::now();
      Save(s.sd, hashed ? nr + (r % 2 ? "/h1" : "/h0") : nr + "/plain", hashed ? with_hash : plain);
      (hashed ? h : p) = Since(t0);
    }
    if (r == 0) continue;  // the first pair has no base (and warms the page cache alike)
    hashed_s.push_back(h);
    plain_s.push_back(p);
    overhead.push_back(h / p - 1);
  }
  const double overhead_med = Median(overhead);
  std::printf(
      "  nothing repeats: hashed save %.3f s, plain save %.3f s: hash overhead %+.1f%% "
      "(median of %d pairs)\n",
      Median(hashed_s), Median(plain_s), overhead_med * 100, repeats);
  const bool ok =
      frozen.step10_exact && frozen.retention_ok && hashed.step10_exact && hashed.retention_ok;
  if (json) {
    nlohmann::json j = {{"base_bytes", s.base_bytes},
                        {"trainable_bytes", s.trainable_bytes},
                        {"changed_fraction", changed},
                        {"save1_bytes", frozen.bytes[0]},
                        {"save1_s", frozen.seconds[0]},
                        {"incremental_bytes_ratio", worst(frozen, false)},
                        {"incremental_time_ratio", worst(frozen, true)},
                        {"incremental_bytes_ratio_hashed", worst(hashed, false)},
                        {"incremental_time_ratio_hashed", worst(hashed, true)},
                        {"incremental_hash_overhead", overhead_med},
                        {"step10_bit_exact", frozen.step10_exact && hashed.step10_exact}};
    std::printf("%s\n", j.dump().c_str());
  }
  return ok ? 0 : 1;
}

int RunSafetensors(size_t total, int repeats, const std::string& dir, const std::vector<int>& ranks,
                   bool json) {
  std::vector<TensorView> src = MakeMixedTensors(total), dst;
  uint64_t bytes = 0;
  for (size_t i = 0; i < src.size(); ++i) {
    Fill(src[i].data, src[i].nbytes(), i + 1);
    dst.push_back(AlignedTensor(src[i].dtype, src[i].shape));
    bytes += src[i].nbytes();
  }
  std::printf("dcp-bench --safetensors: %.1f MiB in %zu tensors, %d repeats (medians), %u cores\n",
              bytes / 1048576.0, src.size(), repeats, std::thread::hardware_concurrency());
  nlohmann::json rows = nlohmann::json::array();
  bool ok = true;
  for (int n : ranks) {
    std::vector<StateDict> states = ShardedStates(src, n), backs = ShardedStates(dst, n);
    InProcessGroup group(n);
    const std::string st = dir + "/st-" + std::to_string(n),
                      native = dir + "/dcp-" + std::to_string(n);
    SaveOptions so;
    so.storage.overwrite = true;
    std::vector<double> st_s, dcp_s, ratios;
    for (int r = 0; r < repeats; ++r) {
      dcp_s.push_back(TimeRanks(group, [&](int rank, Communicator& comm) {
        Save(states[static_cast<size_t>(rank)], native, comm, so);
      }));
      st_s.push_back(TimeRanks(group, [&](int rank, Communicator& comm) {
        Save(states[static_cast<size_t>(rank)], "file://" + st + "?format=safetensors", comm, so);
      }));
      ratios.push_back(dcp_s.back() / st_s.back());
    }
    for (auto& t : dst) std::memset(t.data, 0, t.nbytes());
    TimeRanks(group, [&](int rank, Communicator& comm) {
      Load(backs[static_cast<size_t>(rank)], st, comm);
    });
    const bool same = SameBytes(src, dst);
    ok = ok && same;
    const double st_med = Median(st_s), dcp_med = Median(dcp_s), ratio = Median(ratios);
    std::printf(
        "  %d ranks: safetensors save %7.3f s %6.2f GB/s | dcp save %7.3f s %6.2f GB/s | "
        "ratio %.2f%s\n",
        n, st_med, bytes / st_med / 1e9, dcp_med, bytes / dcp_med / 1e9, ratio,
        same ? "" : "  LOAD MISMATCH");
    rows.push_back({{"ranks", n},
                    {"safetensors_save_s", st_med},
                    {"dcp_save_s", dcp_med},
                    {"ratio", ratio},
                    {"load_matches", same}});
  }
  if (json) {
    std::printf("%s\n", nlohmann::json{{"bytes", bytes}, {"safetensors", rows}}.dump().c_str());
  }
  return ok ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"dcp-bench: dcp against same-run baselines"};
  bool async_mode = false, json = false;
  int64_t size_mib = 0;
  int repeats = 0;  // default: 5 with --async, 3 otherwise
  int files_per_rank = 1;
  std::string dir, python = "/usr/bin/python3", torch_peer = DefaultTorchPeer();
  app.add_flag("--async", async_mode, "measure async-save blocking time against memcpy");
  bool st_mode = false, incremental_mode = false;
  app.add_flag("--incremental", incremental_mode,
               "incremental saves of a LoRA-shaped state, and the hash's cost");
  std::vector<int> st_ranks = {2, 4};
  app.add_flag("--safetensors", st_mode, "N-rank safetensors save against a dcp save");
  app.add_option("--ranks", st_ranks, "rank counts of --safetensors (default 2,4)")
      ->delimiter(',')
      ->check(CLI::PositiveNumber);
  app.add_option("--size-mib", size_mib, "bytes of state (MiB; default 1024 --async, 2048 disk)")
      ->check(CLI::PositiveNumber);
  app.add_option("--files-per-rank", files_per_rank, "dcp data files per rank (disk mode)")
      ->check(CLI::PositiveNumber);
  app.add_option("--python", python, "python with torch for the PyTorch peers ('' skips them)");
  app.add_option("--torch-peer", torch_peer,
                 "the LibTorch torch::save/load peer program ('' skips it; default: "
                 "dcp-bench-torch-peer next to dcp-bench)");
  app.add_option("--repeats", repeats, "repetitions (medians are reported)")
      ->check(CLI::PositiveNumber);
  app.add_option("--dir", dir, "scratch directory (default: a fresh one under /tmp, removed)");
  app.add_flag("--json", json, "print one JSON object as the last line");
  CLI11_PARSE(app, argc, argv);
  if (repeats == 0) repeats = async_mode ? 5 : 3;
  if (size_mib == 0) size_mib = async_mode ? 1024 : 2048;

  bool remove_dir = false;
  if (dir.empty()) {
    std::string tmpl = (std::filesystem::temp_directory_path() / "dcp-bench-XXXXXX").string();
    if (::mkdtemp(tmpl.data()) == nullptr) return 2;
    dir = tmpl;
    remove_dir = true;
  }
  if (incremental_mode) {
    const int rc = RunIncremental(static_cast<size_t>(size_mib) << 20, repeats, dir, json);
    if (remove_dir) std::filesystem::remove_all(dir);
    return rc;
  }
  if (st_mode) {
    const int rc =
        RunSafetensors(static_cast<size_t>(size_mib) << 20, repeats, dir, st_ranks, json);
    if (remove_dir) std::filesystem::remove_all(dir);
    return rc;
  }
  if (!async_mode) {
    const int rc = RunDisk(static_cast<size_t>(size_mib) << 20, repeats, dir, files_per_rank,
                           python, torch_peer, json);
    if (remove_dir) std::filesystem::remove_all(dir);
    return rc;
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
    AsyncCheckpointer saver(std::make_unique<LocalCommunicator>(), ao);
    saver.Save(state, dir + "/async", so)->Wait();
    const size_t allocated = saver.staging_allocations();
    for (int r = 0; r < repeats; ++r) {
      auto h = saver.Save(state, dir + "/async", so);
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
      auto h = saver.Save(state, dir + "/async", so);
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
