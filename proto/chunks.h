// Internal (not installed): chunk geometry shared by metadata validation (proto/schema) and the
// save planner (planner/default_planner.cc): finding two chunks of one tensor that overlap.
#pragma once

#include <cstddef>
#include <optional>
#include <utility>
#include <vector>

#include "dcp/proto/tensor.h"

namespace dcp {

/// Two non-empty chunks of a tensor that overlap, if any, as indices into `chunks`. Every chunk
/// must have the rank of `shape` and lie inside it (callers check that first). Near
/// O(n log n) in the chunks for tensors split along at most two dimensions (and for grids of
/// at most 2^24 cells beyond), so that untrusted metadata with a million chunks is checked in
/// seconds. A layout irregular along 3 or more dimensions that would take more than 2^27 chunk
/// comparisons is refused with InvalidArgumentError (its message says so, naming the counts);
/// no real sharding is like that. Thread-safe (reads its arguments only).
std::optional<std::pair<size_t, size_t>> FindOverlap(const std::vector<ChunkMeta>& chunks,
                                                     const Shape& shape);

}  // namespace dcp
