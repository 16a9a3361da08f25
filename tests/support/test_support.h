// Helpers shared by dcp's tests.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "dcp/dcp.h"

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

}  // namespace dcp::testing
