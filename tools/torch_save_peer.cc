// dcp-bench-torch-peer: the LibTorch torch::save / torch::load peer of dcp-bench (a separate
// program so that dcp-bench itself links no LibTorch).
//
//   dcp-bench-torch-peer SPEC.json
//
// SPEC (written by dcp-bench) names the raw file holding the state's bytes back to back ("raw"),
// a scratch directory ("dir"), the repeat count ("repeats") and the tensors ("tensors": dtype,
// shape, nbytes, in file order). The peer reads those bytes into LibTorch tensors of the same
// dtypes and shapes, then per repeat: torch::save(std::vector<Tensor>) to DIR/torch_peer.pt and
// fsync (dcp's save is durable too), drop the page cache the way dcp-bench does
// (tools/drop_caches.h), torch::load cold, then torch::load again warm. torch::load allocates its
// output (that is its API). The first cold load is checked bit for bit against the source.
// Prints one JSON line of median seconds: torch_save, torch_load_cold, torch_load_warm (and
// cold_method). Exit status 1 with a message on stderr on any failure.
#include <fcntl.h>
#include <torch/serialize.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <vector>

#include "tools/drop_caches.h"

namespace {

using Clock = std::chrono::steady_clock;

double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n == 0 ? 0 : (n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2);
}

c10::ScalarType ParseDType(const std::string& s) {
  if (s == "float32") return torch::kFloat32;
  if (s == "bfloat16") return torch::kBFloat16;
  if (s == "float16") return torch::kFloat16;
  if (s == "uint8") return torch::kUInt8;
  throw std::runtime_error("unknown dtype '" + s + "'");
}

void Fsync(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) throw std::runtime_error("open " + path + ": " + std::strerror(errno));
  const bool ok = ::fsync(fd) == 0;
  const int err = errno;
  ::close(fd);
  if (!ok) throw std::runtime_error("fsync " + path + ": " + std::strerror(err));
}

bool SameBytes(const std::vector<torch::Tensor>& a, const std::vector<torch::Tensor>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].scalar_type() != b[i].scalar_type() || a[i].sizes() != b[i].sizes() ||
        !b[i].is_contiguous() ||
        std::memcmp(a[i].data_ptr(), b[i].data_ptr(), a[i].nbytes()) != 0) {
      return false;
    }
  }
  return true;
}

int Run(const std::string& spec_path) {
  std::ifstream spec_in(spec_path);
  if (!spec_in) throw std::runtime_error("cannot read " + spec_path);
  const nlohmann::json spec = nlohmann::json::parse(spec_in);
  const std::string raw = spec.at("raw"), dir = spec.at("dir");
  const int repeats = spec.at("repeats");

  // The state: the raw file's bytes in tensors of the listed dtypes and shapes.
  std::vector<torch::Tensor> tensors;
  std::ifstream in(raw, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + raw);
  for (const auto& t : spec.at("tensors")) {
    const std::vector<int64_t> shape = t.at("shape");
    torch::Tensor x = torch::empty(shape, torch::TensorOptions().dtype(ParseDType(t.at("dtype"))));
    const uint64_t n = t.at("nbytes");
    if (x.nbytes() != n) throw std::runtime_error("tensor size does not match nbytes");
    if (!in.read(static_cast<char*>(x.data_ptr()), static_cast<std::streamsize>(n))) {
      throw std::runtime_error(raw + " is shorter than the tensors");
    }
    tensors.push_back(std::move(x));
  }

  const std::string path = dir + "/torch_peer.pt";
  std::vector<double> save_s, cold_s, warm_s;
  std::string cold_method;
  for (int r = 0; r < repeats; ++r) {
    std::filesystem::remove(path);
    auto t0 = Clock::now();
    torch::save(tensors, path);
    Fsync(path);
    save_s.push_back(Since(t0));

    cold_method = dcp::tools::DropCaches({path});
    std::vector<torch::Tensor> loaded;
    t0 = Clock::now();
    torch::load(loaded, path);
    cold_s.push_back(Since(t0));
    if (r == 0 && !SameBytes(tensors, loaded)) {
      throw std::runtime_error("torch::load returned different bytes than torch::save was given");
    }
    loaded.clear();
    t0 = Clock::now();
    torch::load(loaded, path);
    warm_s.push_back(Since(t0));
    loaded.clear();
  }
  std::filesystem::remove(path);
  const nlohmann::json out = {{"torch_save", Median(save_s)},
                              {"torch_load_cold", Median(cold_s)},
                              {"torch_load_warm", Median(warm_s)},
                              {"cold_method", cold_method}};
  std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s SPEC.json (run by dcp-bench)\n", argv[0]);
    return 2;
  }
  try {
    return Run(argv[1]);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcp-bench-torch-peer: %s\n", e.what());
    return 1;
  }
}
