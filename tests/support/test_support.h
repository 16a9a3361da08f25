// Helpers shared by dcp's tests.
#pragma once

#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "dcp/dcp.h"

// Defined in builds with AddressSanitizer or ThreadSanitizer (g++ spells it __SANITIZE_*__,
// clang __has_feature), for tests too slow or too memory-hungry to run under them.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define DCP_UNDER_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer)
#define DCP_UNDER_SANITIZER 1
#endif
#endif
// ThreadSanitizer alone: for tests that check what the I/O does (counts, sizes) rather than its
// threads, and that it slows most (the main and ASan builds run them).
#if defined(__SANITIZE_THREAD__)
#define DCP_UNDER_THREAD_SANITIZER 1
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DCP_UNDER_THREAD_SANITIZER 1
#endif
#endif

namespace dcp::testing {

/// Fill `n` bytes with a deterministic pseudo-random pattern derived from `seed`.
void FillRandom(void* data, size_t n, uint64_t seed);

/// A fresh, empty directory under $DCP_TEST_TMPDIR (or the system temp dir); removed by the
/// destructor unless DCP_KEEP_TEST_DIRS is set.
class TempDir {
 public:
  explicit TempDir(const std::string& tag = "t");
  ~TempDir();
  TempDir(const TempDir&) = delete;
  const std::string& path() const { return path_; }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

/// An allocated tensor filled from `seed`.
TensorView RandomTensor(DType dtype, const Shape& shape, uint64_t seed);

/// Byte-wise equality of the elements of two host views of the same shape and dtype.
bool SameElements(const TensorView& a, const TensorView& b);

/// Contiguous copy of a (possibly strided) view.
TensorView Clone(const TensorView& v);

/// Row range [begin, end) of `n` rows for `rank` of `world` (uneven when n % world != 0).
std::pair<int64_t, int64_t> RowRange(int64_t n, int rank, int world);

/// A small training state whose values follow from a step: "model.w" (float32 32x8, random
/// values seeded by the step) and "model.step" (an int64 scalar), for checkpoint-lifecycle tests.
struct StepState {
  TensorView w = TensorView::Allocate(DType::kFloat32, {32, 8});
  TensorView step = TensorView::Allocate(DType::kInt64, {});
  StateDict sd;
  StepState();
  void Fill(int64_t s);
  /// The state holds exactly what Fill(s) put there.
  bool Holds(int64_t s) const;
};

/// Run fn(rank, comm) for `n` ranks as threads of an InProcessGroup; returns each rank's
/// exception (nullptr when it succeeded).
std::vector<std::exception_ptr> RunRanks(
    int n, const std::function<void(int, Communicator&)>& fn,
    std::chrono::milliseconds timeout = std::chrono::seconds(30));

/// Inside rank threads (Catch2 assertions are not thread-safe): throw when `ok` is false; the
/// failure reaches the test through RunRanks' per-rank errors.
void Expect(bool ok, const std::string& what);

/// Fail the current test (Catch2 FAIL) with "expected an exception".
[[noreturn]] void FailNoException();

/// The message of the exception of type E that `f` throws; fails the test if it throws nothing.
template <typename E, typename F>
std::string MessageOf(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  FailNoException();
}

/// The whole contents of a file (fails the test when it cannot be read).
std::string ReadFileBytes(const std::string& path);

/// Every tensor of a safetensors file: name -> its raw bytes.
std::map<std::string, std::string> ReadSafetensors(const std::string& path);

/// One tensor of the safetensors fixtures (tests/fixtures/safetensors/expected.json): what a
/// reader must produce, written by numpy apart from the files.
struct ExpectedTensor {
  DType dtype = DType::kFloat32;
  Shape shape;
  std::string file;   // the safetensors file holding it
  std::string bytes;  // row-major little-endian
};
/// The fixture case `which` ("sharded", "single") of expected.json in `fixtures`, by name.
std::map<std::string, ExpectedTensor> ReadSafetensorsExpected(const std::string& fixtures,
                                                              const std::string& which);
/// The bytes of rows [b, e) of a row-major tensor of `shape` (dimension 0; the whole tensor
/// when it is 0-d).
std::string RowSlice(const std::string& bytes, const Shape& shape, size_t esize, int64_t b,
                     int64_t e);

/// Skip the running test case: prints "SKIPPED: <reason>" (a Catch2 WARN) and records the skip.
/// The caller then returns from the test case. A unit-test binary whose test cases all skipped
/// exits 77 (tests/unit/main.cc), which CTest reports as "Skipped" (SKIP_RETURN_CODE), never
/// as passed. A test case that runs some of its parts and skips others (an s3:// row of a
/// suite) does not call it: it says what it left out in a plain WARN.
void SkipTestCase(const std::string& reason);
/// Whether SkipTestCase was called since the last call of this (and clears it). For a test
/// runner's main.
bool TakeTestCaseSkipped();

/// Fail the current test if any rank failed, with that rank's message.
void RequireNoErrors(const std::vector<std::exception_ptr>& errors);

/// A StorageWriter that forwards every call, capabilities included, to `inner`: a test writer
/// derives from it and overrides only what it changes (a delay, a failure), so the protocol
/// under test takes the same path as with the inner writer alone.
class ForwardingWriter : public StorageWriter {
 public:
  explicit ForwardingWriter(std::unique_ptr<StorageWriter> inner) : inner_(std::move(inner)) {}
  std::string uri() const override { return inner_->uri(); }
  void SetUp(const StorageContext& c) override { inner_->SetUp(c); }
  SavePlan PrepareLocalPlan(SavePlan p) override { return inner_->PrepareLocalPlan(std::move(p)); }
  std::vector<SavePlan> PrepareGlobalPlan(std::vector<SavePlan> p) override {
    return inner_->PrepareGlobalPlan(std::move(p));
  }
  bool GlobalPlanOnlyNamesFiles() const override { return inner_->GlobalPlanOnlyNamesFiles(); }
  std::future<std::vector<WriteResult>> WriteData(const SavePlan& p,
                                                  const SavePlanner& pl) override {
    return inner_->WriteData(p, pl);
  }
  void Finish(Metadata& md, const std::vector<std::vector<WriteResult>>& r) override {
    inner_->Finish(md, r);
  }
  bool FinishTakesFilledStorage() const override { return inner_->FinishTakesFilledStorage(); }
  void AfterCommitDelivered() noexcept override { inner_->AfterCommitDelivered(); }
  void Abort() noexcept override { inner_->Abort(); }
  bool WritesFileIndexes() const override { return inner_->WritesFileIndexes(); }
  std::vector<DataFile> TakeDataFiles() override { return inner_->TakeDataFiles(); }

 protected:
  std::unique_ptr<StorageWriter> inner_;
};

}  // namespace dcp::testing
