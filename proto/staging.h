// Host staging buffers: a process-wide pool, so steady-state saves and loads allocate (and
// page-fault) no staging memory. Freshly allocated memory costs a page fault per 4 KiB on first
// touch (~0.4 GB/s on the reference machine against ~10 GB/s for a warm memcpy), so reuse is
// most of the speed of any copy through a staging buffer.
//
// The one host buffer pool of the libraries: direct-I/O write buffers (file store), read
// scratch (store reader, zstd), S3 part buffers and the async checkpointer's staging all lease
// from it. (Page-locked device staging is the device layer's: proto/device/device.h.) An idle
// process keeps at most 16 buffers and 1 GiB in it.
#pragma once

#include <cstddef>
#include <cstdint>

namespace dcp {

/// A 4 KiB-aligned, pre-faulted host buffer leased from the pool. Move-only; the destructor
/// returns it. Thread-safe (the pool is shared; one lease is used by one thread at a time).
class HostBuffer {
 public:
  HostBuffer() = default;
  /// The smallest idle pooled buffer of at least `bytes` and at most twice that, or a new one
  /// (whole pages; from 1 MiB up, whole MiB) (std::bad_alloc when memory is exhausted).
  explicit HostBuffer(size_t bytes);
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  ~HostBuffer();
  char* data() const { return data_; }
  size_t size() const { return size_; }
  /// Make the buffer at least `bytes` (the old contents are not kept).
  void Reserve(size_t bytes);

 private:
  void Release() noexcept;
  char* data_ = nullptr;
  size_t size_ = 0;
};

/// Bytes of host staging the pool has allocated since the process started (for tests and
/// benchmarks: it stops growing once the working set is pooled).
uint64_t HostStagingBytesAllocated();

}  // namespace dcp
