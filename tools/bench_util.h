// Helpers shared by dcp's benchmark tools (dcp-bench, dcp-s3-bench, dcp-gpu-bench, dcp-soak):
// timing, medians, ranks on threads, page cache eviction, peak-RSS probes and the raw-disk
// baselines every dcp figure is compared against.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>

#include "dcp/communicator.h"
#include "dcp/proto/tensor.h"
#include "tools/drop_caches.h"

namespace dcp::bench {

using Clock = std::chrono::steady_clock;
inline double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}
double Median(std::vector<double> v);
/// Seconds for fn(rank, comm) on every rank of `group` at once, each on its own thread.
/// Rethrows the first rank's error after every thread ended.
double TimeRanks(InProcessGroup& group, const std::function<void(int, Communicator&)>& fn);

constexpr size_t kPage = 4096;
constexpr size_t kRawBlock = 64 << 20;  // raw baseline I/O size

/// 4 KiB-aligned, pre-touched host memory owned by the view (as pinned allocators give).
TensorView AlignedTensor(DType dtype, Shape shape);

using tools::DropCaches;  // tools/drop_caches.h (header-only: the LibTorch peer shares it)
std::vector<std::string> FilesUnder(const std::string& dir);

/// Peak-memory probes (Linux /proc/self): ResetPeakRss makes the peak equal to the current RSS
/// (clear_refs "5"); both return 0 where unavailable.
bool ResetPeakRss();
uint64_t RssBytes();
uint64_t PeakRssBytes();
/// Bytes this process has asked read(2)/pread(2) for so far, page cache or not (/proc/self/io
/// rchar: every thread's, an InProcessGroup's ranks included); 0 where unavailable.
uint64_t ReadCallBytes();

/// Print "<tool>: <what>: strerror(errno)" and exit(1).
[[noreturn]] void Die(const std::string& what);

/// Raw baseline: the tensors' bytes concatenated into one file with O_DIRECT, 64 MiB writes
/// straight from (4 KiB-aligned) host memory; from the first unaligned piece on, buffered.
/// Then fsync.
void RawWrite(const std::string& path, const std::vector<TensorView>& tensors);
/// Raw read of that file into the (pre-touched) host tensors, 64 MiB preads.
void RawRead(const std::string& path, const std::vector<TensorView>& tensors);

}  // namespace dcp::bench
