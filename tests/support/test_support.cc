#include "support/test_support.h"

#include <unistd.h>

#include <atomic>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "tools/fill_random.h"

namespace dcp::testing {

void FillRandom(void* data, size_t n, uint64_t seed) { tools::FillRandomBytes(data, n, seed); }

TempDir::TempDir(const std::string& tag) {
  const char* base = std::getenv("DCP_TEST_TMPDIR");
  std::string root = base ? base : std::filesystem::temp_directory_path().string();
  std::filesystem::create_directories(root);
  static std::atomic<int> counter{0};
  path_ = root + "/dcp-" + tag + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++);
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  if (std::getenv("DCP_KEEP_TEST_DIRS") == nullptr) {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
}

TensorView RandomTensor(DType dtype, const Shape& shape, uint64_t seed) {
  TensorView t = TensorView::Allocate(dtype, shape);
  FillRandom(t.data, t.nbytes(), seed);
  if (dtype == DType::kBool) {  // keep bools canonical (0 or 1)
    auto* p = static_cast<unsigned char*>(t.data);
    for (size_t i = 0; i < t.nbytes(); ++i) p[i] &= 1;
  }
  return t;
}

TensorView Clone(const TensorView& v) {
  TensorView out = TensorView::Allocate(v.dtype, v.shape);
  CopyTensor(out, v);
  return out;
}

bool SameElements(const TensorView& a, const TensorView& b) {
  if (a.shape != b.shape || a.dtype != b.dtype) return false;
  TensorView ca = Clone(a), cb = Clone(b);
  return std::memcmp(ca.data, cb.data, ca.nbytes()) == 0;
}

std::pair<int64_t, int64_t> RowRange(int64_t n, int rank, int world) {
  const int64_t base = n / world, extra = n % world;
  const int64_t begin = rank * base + std::min<int64_t>(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

std::vector<std::exception_ptr> RunRanks(int n, const std::function<void(int, Communicator&)>& fn,
                                         std::chrono::milliseconds timeout) {
  InProcessGroup group(n);
  std::vector<std::exception_ptr> errors(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      Communicator& comm = group.communicator(r);
      comm.set_timeout(timeout);
      try {
        fn(r, comm);
      } catch (...) {
        errors[r] = std::current_exception();
      }
    });
  }
  for (auto& t : threads) t.join();
  return errors;
}

void FailNoException() {
  FAIL("expected an exception");
  throw std::logic_error("unreachable");
}

void Expect(bool ok, const std::string& what) {
  if (!ok) throw std::runtime_error("expectation failed: " + what);
}

void RequireNoErrors(const std::vector<std::exception_ptr>& errors) {
  for (size_t r = 0; r < errors.size(); ++r) {
    if (!errors[r]) continue;
    try {
      std::rethrow_exception(errors[r]);
    } catch (const std::exception& e) {
      FAIL("rank " << r << " failed: " << e.what());
    }
  }
}

std::string ReadFileBytes(const std::string& path) {
  // One read of the whole file: tests compare objects of tens of MiB, and a stream copy is slow
  // at the -O0 the sanitizer builds compile tests with.
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  REQUIRE(in.good());
  std::string bytes(static_cast<size_t>(in.tellg()), '\0');
  in.seekg(0);
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(in.gcount() == static_cast<std::streamsize>(bytes.size()));
  return bytes;
}

std::map<std::string, std::string> ReadSafetensors(const std::string& path) {
  const std::string bytes = ReadFileBytes(path);
  uint64_t n = 0;
  std::memcpy(&n, bytes.data(), 8);
  const nlohmann::json header = nlohmann::json::parse(bytes.substr(8, n));
  std::map<std::string, std::string> out;
  for (const auto& [name, v] : header.items()) {
    if (name == "__metadata__") continue;
    const uint64_t b = v["data_offsets"][0], e = v["data_offsets"][1];
    out[name] = bytes.substr(8 + n + b, e - b);
  }
  return out;
}

std::map<std::string, ExpectedTensor> ReadSafetensorsExpected(const std::string& fixtures,
                                                              const std::string& which) {
  const nlohmann::json all = nlohmann::json::parse(ReadFileBytes(fixtures + "/expected.json"));
  std::map<std::string, ExpectedTensor> out;
  for (const auto& [name, v] : all.at(which).items()) {
    ExpectedTensor& t = out[name];
    const std::string dtype = v.at("dtype").get<std::string>();
    const std::map<std::string, DType> names = {{"BOOL", DType::kBool},
                                                {"U8", DType::kUInt8},
                                                {"I8", DType::kInt8},
                                                {"I16", DType::kInt16},
                                                {"I32", DType::kInt32},
                                                {"I64", DType::kInt64},
                                                {"F16", DType::kFloat16},
                                                {"BF16", DType::kBFloat16},
                                                {"F32", DType::kFloat32},
                                                {"F64", DType::kFloat64},
                                                {"F8_E4M3", DType::kFloat8_e4m3fn},
                                                {"F8_E5M2", DType::kFloat8_e5m2}};
    t.dtype = names.at(dtype);
    t.shape = v.at("shape").get<Shape>();
    t.file = v.at("file").get<std::string>();
    const std::string hex = v.at("hex").get<std::string>();
    for (size_t i = 0; i + 1 < hex.size(); i += 2) {
      t.bytes.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
    }
  }
  return out;
}

std::string RowSlice(const std::string& bytes, const Shape& shape, size_t esize, int64_t b,
                     int64_t e) {
  if (shape.empty()) return bytes;
  size_t row = esize;
  for (size_t k = 1; k < shape.size(); ++k) row *= static_cast<size_t>(shape[k]);
  return bytes.substr(static_cast<size_t>(b) * row, static_cast<size_t>(e - b) * row);
}

StepState::StepState() { sd.Nested("model").Set("w", w).Set("step", step); }

void StepState::Fill(int64_t s) {
  FillRandom(w.data, w.nbytes(), static_cast<uint64_t>(s));
  *static_cast<int64_t*>(step.data) = s;
}

bool StepState::Holds(int64_t s) const {
  TensorView expect = RandomTensor(DType::kFloat32, {32, 8}, static_cast<uint64_t>(s));
  return *static_cast<int64_t*>(step.data) == s && SameElements(w, expect);
}

namespace {
std::atomic<bool> g_test_case_skipped{false};
}  // namespace

void SkipTestCase(const std::string& reason) {
  WARN("SKIPPED: " << reason);
  g_test_case_skipped = true;
}

bool TakeTestCaseSkipped() { return g_test_case_skipped.exchange(false); }

}  // namespace dcp::testing
