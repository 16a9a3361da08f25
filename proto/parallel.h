// ParallelFor: independent work items over a few threads (the coordinator's per-rank decoding
// and encoding of plans, which grows with the world size).
#pragma once

#include <cstddef>
#include <functional>

namespace dcp {

/// Run fn(i) for every i in [0, n) on up to `threads` threads (0: the hardware's concurrency,
/// at most 16), the calling thread among them. Calls for different i must be independent.
/// Returns when every call has finished; if any threw, the first exception is rethrown (the
/// remaining items are skipped). Runs inline when n or the thread count is 1.
void ParallelFor(size_t n, const std::function<void(size_t)>& fn, size_t threads = 0);

}  // namespace dcp
