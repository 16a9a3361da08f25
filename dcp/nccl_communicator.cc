// NCCL collectives for dcp's control messages.
//
// Why non-blocking NCCL and polling: a blocking NCCL call waits forever for a peer that died,
// which would turn one crashed rank into a hung job. With ncclConfig_t.blocking = 0 every call
// returns at once, and completion is observed by polling the stream and the communicator's
// async error against the deadline; on timeout ncclCommAbort releases the GPU resources.
//
// Why sizes first: NCCL moves fixed-size buffers, dcp moves byte strings of any size. Every
// collective first exchanges the sizes (a few bytes per rank), then the payload through a
// device buffer that grows to the largest message seen and is reused afterwards.
#include "dcp/nccl_communicator.h"

#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <numeric>
#include <thread>

#include "dcp/proto/device/cuda_util.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"

namespace dcp {

using cuda::DeviceScope;
using Clock = std::chrono::steady_clock;

struct NcclCommunicator::Impl {
  Communicator* self = nullptr;  // for timeout()
  int rank = 0, size = 1, device = 0;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;
  bool aborted = false;
  std::string abort_reason;
  char* dev_buf = nullptr;
  char* host_buf = nullptr;  // pinned
  size_t capacity = 0;

  ~Impl() {
    // Stopped (e.g. a saver detached at shutdown, ending after the application tore NCCL and
    // CUDA down): no further NCCL or CUDA call, so the resources are left to process exit.
    if (!MayCallNccl()) return;
    DeviceScope scope(device, std::nothrow);  // a destructor must not throw
    if (comm && !aborted) {  // (an aborted communicator was released by ncclCommAbort)
      // Non-blocking finalize: wait a bounded time for it, abort if a peer never joins.
      ncclResult_t r = ncclCommFinalize(comm);
      const auto until = Clock::now() + std::chrono::seconds(10);
      while (r == ncclInProgress && Clock::now() < until) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));
        if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) break;
      }
      if (r == ncclSuccess) {
        (void)ncclCommDestroy(comm);
      } else {
        (void)ncclCommAbort(comm);
      }
    }
    if (stream) (void)cudaStreamDestroy(stream);
    if (dev_buf) (void)cudaFree(dev_buf);
    if (host_buf) (void)cudaFreeHost(host_buf);
  }

  // Every other rank, as the failures of a collective we cannot attribute to one peer.
  [[noreturn]] void Fail(std::string_view what, ErrorCode code, const std::string& message,
                         bool retryable) {
    std::vector<RankFailure> failures;
    for (int r = 0; r < size; ++r) {
      if (r != rank || size == 1) failures.push_back({r, code, message, retryable});
    }
    throw CollectiveError(std::string(what), std::move(failures));
  }

  // A stopped communicator makes no NCCL call: its resources are left to process exit.
  bool MayCallNccl() const { return !(self && self->stopped()); }

  [[noreturn]] void Abort(std::string_view what, ErrorCode code, const std::string& message) {
    if (comm && !aborted && MayCallNccl()) (void)ncclCommAbort(comm);
    aborted = true;
    abort_reason = std::string(what) + ": " + message;
    if (self) self->Poison(abort_reason);  // the base contract: later collectives fail at once
    Fail(what, code, message + " (the NCCL communicator was aborted)", code == ErrorCode::kTimeout);
  }

  void CheckUsable(std::string_view what) {
    if (!aborted && self && self->poisoned()) {
      // Poisoned from outside (e.g. a shutdown stopping a background saver): release NCCL too,
      // unless stopped (the application may have torn NCCL down already).
      if (comm && MayCallNccl()) (void)ncclCommAbort(comm);
      aborted = true;
      abort_reason = self->poison_reason();
    }
    if (aborted) {
      Fail(what, ErrorCode::kCollective,
           "the NCCL communicator was aborted earlier (" + abort_reason + ")", false);
    }
  }

  // Another thread poisoned the communicator (e.g. a shutdown): stop waiting at once.
  void StopIfPoisoned(std::string_view what) {
    if (self && self->poisoned()) {
      Abort(what, ErrorCode::kCollective, "stopped: " + self->poison_reason());
    }
  }

  Clock::time_point Deadline() const { return Clock::now() + self->timeout(); }

  std::string TimeoutMessage(std::string_view what) const {
    return "no completion of '" + std::string(what) + "' over NCCL within " +
           std::to_string(self->timeout().count()) + " ms; NCCL cannot tell which peer is missing";
  }

  // Wait until the communicator has no call in progress (non-blocking NCCL).
  void Settle(ncclResult_t r, std::string_view what, Clock::time_point deadline) {
    while (true) {
      if (r == ncclSuccess) return;
      if (r != ncclInProgress) {
        Abort(what, ErrorCode::kCollective,
              std::string("NCCL error: ") + ncclGetErrorString(r) + " (" + ncclGetLastError(comm) +
                  ")");
      }
      if (Clock::now() > deadline) Abort(what, ErrorCode::kTimeout, TimeoutMessage(what));
      StopIfPoisoned(what);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
      if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) r = ncclInternalError;
    }
  }

  // Wait for the stream (the collective and its copies) with the deadline.
  void Wait(std::string_view what, Clock::time_point deadline) {
    while (true) {
      const cudaError_t e = cudaStreamQuery(stream);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) {
        (void)cudaGetLastError();
        Abort(what, ErrorCode::kDevice, "CUDA error while waiting: " + cuda::Describe(e));
      }
      ncclResult_t async = ncclSuccess;
      if (ncclCommGetAsyncError(comm, &async) == ncclSuccess && async != ncclSuccess &&
          async != ncclInProgress) {
        Settle(async, what, deadline);  // throws
      }
      if (Clock::now() > deadline) Abort(what, ErrorCode::kTimeout, TimeoutMessage(what));
      StopIfPoisoned(what);
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  void Reserve(size_t bytes) {
    if (bytes <= capacity) return;
    const size_t n = std::max<size_t>(bytes, std::max<size_t>(capacity * 2, 1 << 20));
    if (dev_buf) (void)cudaFree(dev_buf);
    if (host_buf) (void)cudaFreeHost(host_buf);
    dev_buf = host_buf = nullptr;
    capacity = 0;
    cuda::Check(cudaMalloc(&dev_buf, n), "cudaMalloc (NCCL message buffer)", device);
    cuda::Check(cudaHostAlloc(&host_buf, n, cudaHostAllocDefault), "cudaHostAlloc", device);
    capacity = n;
  }

  void ToDevice(size_t offset, size_t n) {
    if (n == 0) return;
    cuda::Check(
        cudaMemcpyAsync(dev_buf + offset, host_buf + offset, n, cudaMemcpyHostToDevice, stream),
        "cudaMemcpyAsync", device);
  }
  void ToHost(size_t offset, size_t n) {
    if (n == 0) return;
    cuda::Check(
        cudaMemcpyAsync(host_buf + offset, dev_buf + offset, n, cudaMemcpyDeviceToHost, stream),
        "cudaMemcpyAsync", device);
  }

  // Every rank's uint64 value (in-place all-gather).
  std::vector<uint64_t> AllGatherU64(uint64_t mine, std::string_view what,
                                     Clock::time_point deadline) {
    Reserve(sizeof(uint64_t) * size);
    std::memcpy(host_buf + rank * sizeof(uint64_t), &mine, sizeof mine);
    ToDevice(rank * sizeof(uint64_t), sizeof mine);
    Settle(ncclAllGather(dev_buf + rank * sizeof(uint64_t), dev_buf, 1, ncclUint64, comm, stream),
           what, deadline);
    ToHost(0, sizeof(uint64_t) * size);
    Wait(what, deadline);
    std::vector<uint64_t> v(size);
    std::memcpy(v.data(), host_buf, sizeof(uint64_t) * size);
    return v;
  }

  // Root's vector of uint64 values, on every rank.
  std::vector<uint64_t> BroadcastU64(std::vector<uint64_t> values, size_t count, int root,
                                     std::string_view what, Clock::time_point deadline) {
    Reserve(sizeof(uint64_t) * count);
    if (rank == root) {
      std::memcpy(host_buf, values.data(), sizeof(uint64_t) * count);
      ToDevice(0, sizeof(uint64_t) * count);
    }
    Settle(ncclBroadcast(dev_buf, dev_buf, count, ncclUint64, root, comm, stream), what, deadline);
    ToHost(0, sizeof(uint64_t) * count);
    Wait(what, deadline);
    values.resize(count);
    std::memcpy(values.data(), host_buf, sizeof(uint64_t) * count);
    return values;
  }
};

namespace {

int LocalRank(MPI_Comm comm) {
  MPI_Comm node;
  MPI_Comm_split_type(comm, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node);
  int r = 0;
  MPI_Comm_rank(node, &r);
  MPI_Comm_free(&node);
  return r;
}

// Every rank learns whether all succeeded, so a collective constructor fails everywhere alike.
void AgreeOrThrow(MPI_Comm comm, bool ok, const std::string& local_error, int rank, int size,
                  const char* phase) {
  int mine = ok ? 1 : 0, all = 0;
  MPI_Allreduce(&mine, &all, 1, MPI_INT, MPI_MIN, comm);
  if (all) return;
  std::vector<int> oks(size);
  MPI_Allgather(&mine, 1, MPI_INT, oks.data(), 1, MPI_INT, comm);
  std::vector<RankFailure> failures;
  for (int r = 0; r < size; ++r) {
    if (!oks[r]) {
      failures.push_back({r, ErrorCode::kCollective,
                          r == rank ? local_error : "failed to set up NCCL (see that rank)",
                          false});
    }
  }
  throw CollectiveError(phase, std::move(failures));
}

}  // namespace

bool NcclUsable(int ranks_per_node, std::string* why) {
  auto backend = FindDeviceBackend(Device::Type::kCUDA);
  if (!backend) {
    if (why) *why = "this build has no CUDA backend";
    return false;
  }
  const int n = backend->device_count();
  if (n < ranks_per_node) {
    if (why) {
      *why = n == 0 ? backend->unavailable_reason()
                    : std::to_string(n) + " CUDA device(s) for " + std::to_string(ranks_per_node) +
                          " ranks on this node (NCCL needs one device per rank)";
    }
    return false;
  }
  return true;
}

NcclCommunicator::NcclCommunicator(MPI_Comm bootstrap, int device,
                                   std::chrono::milliseconds init_timeout)
    : impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.self = this;
  MPI_Comm_rank(bootstrap, &m.rank);
  MPI_Comm_size(bootstrap, &m.size);
  const int local = LocalRank(bootstrap);
  // 1. A device on every rank.
  std::string error;
  try {
    auto backend = FindDeviceBackend(Device::Type::kCUDA);
    const int n = backend ? backend->device_count() : 0;
    m.device = device >= 0 ? device : (n > 0 ? local % n : 0);
    DeviceBackendFor(Device{Device::Type::kCUDA, m.device},
                     "the NCCL communicator of rank " + std::to_string(m.rank));
    DeviceScope scope(m.device);
    cuda::Check(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking), "cudaStreamCreate",
                m.device);
  } catch (const std::exception& e) {
    error = e.what();
  }
  AgreeOrThrow(bootstrap, error.empty(), error, m.rank, m.size, "NCCL setup (device)");
  // 2. The unique id, from rank 0 over MPI.
  ncclUniqueId id;
  std::memset(&id, 0, sizeof id);
  ncclResult_t r = ncclSuccess;
  if (m.rank == 0) r = ncclGetUniqueId(&id);
  AgreeOrThrow(bootstrap, r == ncclSuccess,
               std::string("ncclGetUniqueId failed: ") + ncclGetErrorString(r), m.rank, m.size,
               "NCCL setup (unique id)");
  MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, bootstrap);
  // 3. The communicator, non-blocking, within init_timeout.
  try {
    DeviceScope scope(m.device);
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    r = ncclCommInitRankConfig(&m.comm, m.size, id, m.rank, &config);
    if (r != ncclSuccess && r != ncclInProgress) {
      throw DeviceError(std::string("ncclCommInitRankConfig failed: ") + ncclGetErrorString(r) +
                        " (" + ncclGetLastError(m.comm) + ")");
    }
    const auto saved = timeout();
    set_timeout(init_timeout);
    try {
      m.Settle(r, "NCCL init", m.Deadline());
    } catch (...) {
      set_timeout(saved);
      throw;
    }
    set_timeout(saved);
    error.clear();
  } catch (const std::exception& e) {
    error = e.what();
  }
  AgreeOrThrow(bootstrap, error.empty(), error, m.rank, m.size, "NCCL setup (communicator)");
}

NcclCommunicator::~NcclCommunicator() = default;

int NcclCommunicator::rank() const { return impl_->rank; }
int NcclCommunicator::size() const { return impl_->size; }
int NcclCommunicator::device() const { return impl_->device; }

std::vector<std::string> NcclCommunicator::Gather(std::string message, int root,
                                                  std::string_view what) {
  Impl& m = *impl_;
  m.CheckUsable(what);
  DeviceScope scope(m.device);
  const auto deadline = m.Deadline();
  const std::vector<uint64_t> sizes = m.AllGatherU64(message.size(), what, deadline);
  std::vector<uint64_t> offsets(m.size, 0);
  for (int r = 1; r < m.size; ++r) offsets[r] = offsets[r - 1] + sizes[r - 1];
  const uint64_t total = offsets.back() + sizes.back();
  if (m.rank == root) {
    m.Reserve(total);
    m.Settle(ncclGroupStart(), what, deadline);
    for (int r = 0; r < m.size; ++r) {
      if (r != root && sizes[r] > 0) {
        ncclResult_t res =
            ncclRecv(m.dev_buf + offsets[r], sizes[r], ncclUint8, r, m.comm, m.stream);
        if (res != ncclSuccess && res != ncclInProgress) m.Settle(res, what, deadline);
      }
    }
    m.Settle(ncclGroupEnd(), what, deadline);
    m.ToHost(0, total);
    m.Wait(what, deadline);
    std::vector<std::string> out(m.size);
    for (int r = 0; r < m.size; ++r) {
      out[r] = r == root ? std::move(message) : std::string(m.host_buf + offsets[r], sizes[r]);
    }
    return out;
  }
  if (!message.empty()) {
    m.Reserve(message.size());
    std::memcpy(m.host_buf, message.data(), message.size());
    m.ToDevice(0, message.size());
    m.Settle(ncclSend(m.dev_buf, message.size(), ncclUint8, root, m.comm, m.stream), what,
             deadline);
    m.Wait(what, deadline);
  }
  return {};
}

std::string NcclCommunicator::Scatter(std::vector<std::string> messages, int root,
                                      std::string_view what) {
  Impl& m = *impl_;
  m.CheckUsable(what);
  if (m.rank == root && messages.size() != static_cast<size_t>(m.size)) {
    throw InvalidArgumentError("Scatter at the root needs one message per rank (" +
                               std::to_string(m.size) + "), got " +
                               std::to_string(messages.size()));
  }
  DeviceScope scope(m.device);
  const auto deadline = m.Deadline();
  std::vector<uint64_t> sizes(m.size, 0);
  if (m.rank == root) {
    for (int r = 0; r < m.size; ++r) sizes[r] = messages[r].size();
  }
  sizes = m.BroadcastU64(std::move(sizes), m.size, root, what, deadline);
  if (m.rank == root) {
    std::vector<uint64_t> offsets(m.size, 0);
    for (int r = 1; r < m.size; ++r) offsets[r] = offsets[r - 1] + sizes[r - 1];
    const uint64_t total = offsets.back() + sizes.back();
    m.Reserve(total);
    for (int r = 0; r < m.size; ++r) {
      if (r != root) std::memcpy(m.host_buf + offsets[r], messages[r].data(), sizes[r]);
    }
    m.ToDevice(0, total);
    m.Settle(ncclGroupStart(), what, deadline);
    for (int r = 0; r < m.size; ++r) {
      if (r != root && sizes[r] > 0) {
        ncclResult_t res =
            ncclSend(m.dev_buf + offsets[r], sizes[r], ncclUint8, r, m.comm, m.stream);
        if (res != ncclSuccess && res != ncclInProgress) m.Settle(res, what, deadline);
      }
    }
    m.Settle(ncclGroupEnd(), what, deadline);
    m.Wait(what, deadline);
    return std::move(messages[root]);
  }
  const uint64_t n = sizes[m.rank];
  if (n == 0) return {};
  m.Reserve(n);
  m.Settle(ncclRecv(m.dev_buf, n, ncclUint8, root, m.comm, m.stream), what, deadline);
  m.ToHost(0, n);
  m.Wait(what, deadline);
  return std::string(m.host_buf, n);
}

std::string NcclCommunicator::Broadcast(std::string message, int root, std::string_view what) {
  Impl& m = *impl_;
  m.CheckUsable(what);
  DeviceScope scope(m.device);
  const auto deadline = m.Deadline();
  const uint64_t n =
      m.BroadcastU64({static_cast<uint64_t>(message.size())}, 1, root, what, deadline)[0];
  if (n == 0) return {};
  m.Reserve(n);
  if (m.rank == root) {
    std::memcpy(m.host_buf, message.data(), n);
    m.ToDevice(0, n);
  }
  m.Settle(ncclBroadcast(m.dev_buf, m.dev_buf, n, ncclUint8, root, m.comm, m.stream), what,
           deadline);
  if (m.rank == root) {
    m.Wait(what, deadline);
    return message;
  }
  m.ToHost(0, n);
  m.Wait(what, deadline);
  return std::string(m.host_buf, n);
}

std::vector<std::string> NcclCommunicator::AllGather(std::string message, std::string_view what) {
  Impl& m = *impl_;
  m.CheckUsable(what);
  DeviceScope scope(m.device);
  const auto deadline = m.Deadline();
  const std::vector<uint64_t> sizes = m.AllGatherU64(message.size(), what, deadline);
  const uint64_t slot = *std::max_element(sizes.begin(), sizes.end());
  std::vector<std::string> out(m.size);
  if (slot == 0) return out;
  // Equal slots of the largest size: one in-place ncclAllGather.
  m.Reserve(slot * m.size);
  std::memcpy(m.host_buf + m.rank * slot, message.data(), message.size());
  m.ToDevice(m.rank * slot, slot);
  m.Settle(ncclAllGather(m.dev_buf + m.rank * slot, m.dev_buf, slot, ncclUint8, m.comm, m.stream),
           what, deadline);
  m.ToHost(0, slot * m.size);
  m.Wait(what, deadline);
  for (int r = 0; r < m.size; ++r) out[r] = std::string(m.host_buf + r * slot, sizes[r]);
  return out;
}

void NcclCommunicator::Barrier(std::string_view what) {
  Impl& m = *impl_;
  m.CheckUsable(what);
  DeviceScope scope(m.device);
  m.AllGatherU64(0, what, m.Deadline());
}

}  // namespace dcp
