// Why it is built this way:
// - Staging buffers are keyed by (fqn, shard offsets) and kept across saves, so after the first
//   save no memory is allocated and every copy lands in warm, already-faulted pages (first-touch
//   page faults cost ~25x a warm memcpy on this class of machine).
// - One persistent background thread runs the saves. A shutdown that gives up on a stuck save
//   first stops the background communicator, so a save waiting on a peer fails within a poll
//   interval and the thread is joined: it must never go on polling MPI after the application
//   finalises it. Only a thread stuck inside storage (not the communicator) is detached after a
//   bounded wait; it owns a shared_ptr to everything it uses. Stop() returns only once no
//   transport call is in progress, and a stopped communicator makes none afterwards, its
//   destructor included (which may run on the detached thread after MPI_Finalize); staging
//   buffers registered with a device runtime are then leaked rather than unregistered.
// - A snapshot failure (say, a tensor that cannot be copied) still enters the protocol (the
//   background save fails in its first phase), so every rank sees the same outcome.
#include "dcp/async_checkpointer.h"

#include <sys/mman.h>

#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <mutex>
#include <sstream>

#include "dcp/planner/default_planner.h"
#include "dcp/planner/planner.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/staging.h"

namespace dcp {

namespace {

using Clock = std::chrono::steady_clock;
double Since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// A tensor's staging: a host buffer from the process-wide pool (4 KiB-aligned, pre-faulted),
// optionally page-locked.
struct StagingBuffer {
  HostBuffer memory;
  void* data = nullptr;
  size_t capacity = 0;
  bool locked = false;
  // Set when the buffer is page-locked with a device runtime, so device-to-host snapshot copies
  // run at DMA speed instead of through the runtime's own bounce buffers.
  std::shared_ptr<DeviceBackend> pinned_by;
  StagingBuffer() = default;
  StagingBuffer(const StagingBuffer&) = delete;
  ~StagingBuffer() {
    if (pinned_by) pinned_by->UnregisterHost(data);
    if (locked) ::munlock(data, capacity);
  }
};

// Rethrows a snapshot failure from the planner, so it travels through the protocol.
class FailedSnapshotPlanner : public DefaultSavePlanner {
 public:
  explicit FailedSnapshotPlanner(std::exception_ptr e) : e_(e) {}
  void SetUp(const StateDict&, const PlannerContext&) override { std::rethrow_exception(e_); }

 private:
  std::exception_ptr e_;
};

}  // namespace

std::string SaveMetrics::ToString() const {
  char buf[512];
  std::snprintf(
      buf, sizeof(buf),
      "dcp async save %s: %s; blocked %.3f s (waiting %.3f s, staging %.3f s for %.1f MiB "
      "at %.2f GB/s, %.1f MiB from device, %zu allocations); background %.3f s, %.1f MiB "
      "written; training time saved ~%.3f s",
      uri.c_str(), succeeded ? "ok" : ("FAILED: " + error).c_str(), blocking_s, wait_previous_s,
      staging_s, staged_bytes / 1048576.0, staging_gbps, device_bytes / 1048576.0,
      staging_allocations, background_s, bytes_written / 1048576.0, training_time_saved_s);
  return buf;
}

// ---------------------------------------------------------------------------------------------

struct AsyncSave::State {
  mutable std::mutex mu;
  mutable std::condition_variable cv;
  bool done = false;
  bool error_reported = false;
  Metadata metadata;
  std::exception_ptr error;
  SaveMetrics metrics;
};

bool AsyncSave::done() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->done;
}

bool AsyncSave::WaitFor(std::chrono::milliseconds timeout) const {
  std::unique_lock<std::mutex> lock(state_->mu);
  return state_->cv.wait_for(lock, timeout, [&] { return state_->done; });
}

Metadata AsyncSave::Wait() {
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait(lock, [&] { return state_->done; });
  if (state_->error) {
    state_->error_reported = true;
    std::rethrow_exception(state_->error);
  }
  return state_->metadata;
}

std::shared_ptr<AsyncSave> AsyncSave::Completed(Metadata metadata, SaveMetrics metrics) {
  auto s = std::make_shared<State>();
  s->done = true;
  s->metadata = std::move(metadata);
  s->metrics = std::move(metrics);
  s->metrics.succeeded = true;
  return std::make_shared<AsyncSave>(s);
}

SaveMetrics AsyncSave::metrics() const {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->metrics;
}

// ---------------------------------------------------------------------------------------------

struct AsyncCheckpointer::Impl {
  std::unique_ptr<Communicator> comm;
  AsyncOptions options;

  // Staging: touched only by the caller's thread while no save is in flight, and by the
  // background thread (read-only, through the staged state dict) while one is.
  std::map<std::string, std::unique_ptr<StagingBuffer>> staging;
  size_t total_allocations = 0;
  uint64_t staging_bytes = 0;

  // The job queue (at most one job).
  std::mutex mu;
  std::condition_variable cv;
  bool stop = false;
  struct Job {
    StateDict staged;
    std::string uri;
    SaveOptions save;
    std::exception_ptr snapshot_error;
    std::shared_ptr<AsyncSave::State> result;
    AsyncCheckpointer::SaveRunner run;  // empty: dcp::Save to uri
  };
  std::optional<Job> job;
  std::shared_ptr<AsyncSave::State> last;  // the most recent save, running or ended
  Task<void> worker;
  bool closed = false;
  // Set when Close gave up on the thread: whatever it destroys last must make no device call.
  std::atomic<bool> detached{false};

  ~Impl() {
    if (!detached.load()) return;
    for (auto& [key, buffer] : staging) {
      if (buffer && buffer->pinned_by) (void)buffer.release();  // NOLINT: see `detached`
    }
  }

  void* Buffer(const std::string& key, size_t bytes, size_t* allocations, const Device& source) {
    auto& slot = staging[key];
    if (!slot || slot->capacity < bytes) Allocate(slot, bytes, allocations);
    if (!source.is_cpu()) {
      auto backend = DeviceBackendFor(source, "tensor '" + key + "'");
      if (slot->pinned_by != backend) {
        if (slot->pinned_by) slot->pinned_by->UnregisterHost(slot->data);
        slot->pinned_by.reset();
        if (backend->RegisterHost(slot->data, slot->capacity)) slot->pinned_by = backend;
      }
    }
    return slot->data;
  }

  void Allocate(std::unique_ptr<StagingBuffer>& slot, size_t bytes, size_t* allocations) {
    if (slot) {
      staging_bytes -= slot->capacity;
      slot.reset();  // back to the pool first: the new lease may reuse its memory
    }
    auto buf = std::make_unique<StagingBuffer>();
    buf->memory.Reserve(bytes);  // pre-faulted: no page fault during a copy
    buf->data = buf->memory.data();
    buf->capacity = buf->memory.size();
    if (options.lock_staging) buf->locked = ::mlock(buf->data, buf->capacity) == 0;
    staging_bytes += buf->capacity;
    slot = std::move(buf);
    ++*allocations;
    ++total_allocations;
  }

  // Copy `state` into staging; returns the staged state dict (same structure, views of staging).
  StateDict Snapshot(const StateDict& state, SaveMetrics& m) {
    struct Copy {
      TensorView dst, src;
      std::string name;  // the entry, for messages
    };
    std::vector<Copy> copies, device_copies;
    StateDict staged;
    for (const auto& [fqn, entry] : FlattenStateDict(state)) {
      const StateValue& v = *entry.value;
      auto stage = [&](const std::string& key, const TensorView& src) {
        TensorView dst = TensorView::FromContiguous(
            src.numel() ? Buffer(key, src.nbytes(), &m.staging_allocations, src.device) : nullptr,
            src.dtype, src.shape);
        if (src.device.is_cpu()) {
          copies.push_back({dst, src, key});
        } else {
          device_copies.push_back({dst, src, key});
          m.device_bytes += src.nbytes();
        }
        m.staged_bytes += src.nbytes();
        return dst;
      };
      if (const auto* t = std::get_if<TensorView>(&v)) {
        InsertAtPath(staged, entry.path, stage(fqn, *t));
      } else if (const auto* st = std::get_if<ShardedTensor>(&v)) {
        ShardedTensor copy{st->dtype, st->global_shape, {}};
        for (const auto& shard : st->local_shards) {
          copy.local_shards.push_back(
              {stage(fqn + "@" + ShapeToString(shard.offsets), shard.view), shard.offsets});
        }
        InsertAtPath(staged, entry.path, std::move(copy));
      } else if (const auto* b = std::get_if<Blob>(&v)) {
        InsertAtPath(staged, entry.path, *b);
        m.staged_bytes += b->bytes.size();
      }
    }
    // Device tensors: queue every device-to-host copy first (one stream per device), so the
    // transfers run while the host threads below copy host tensors; wait for them at the end.
    std::map<std::pair<int, int>, std::unique_ptr<DeviceStream>> streams;
    for (auto& c : device_copies) {
      auto& stream = streams[{static_cast<int>(c.src.device.type), c.src.device.index}];
      if (!stream) {
        stream = DeviceBackendFor(c.src.device, "tensor " + c.src.ToString())
                     ->NewStream(c.src.device.index);
      }
      try {
        CopyTensorAsync(c.dst, c.src, *stream);
      } catch (const DeviceError& e) {
        throw DeviceError("snapshot of '" + c.name + "': " + e.what());
      }
    }
    // Copy: big tensors are split by rows across threads so both cores stream memory.
    const int threads = std::max(1, options.copy_threads);
    std::vector<Copy> pieces;
    const uint64_t target = std::max<uint64_t>(m.staged_bytes / (threads * 4), 1 << 20);
    for (auto& c : copies) {
      if (c.src.nbytes() <= target || c.src.dim() == 0 || c.src.shape[0] < 2) {
        pieces.push_back(c);
        continue;
      }
      const int64_t rows = c.src.shape[0];
      const int64_t per =
          std::max<int64_t>(1, static_cast<int64_t>(target / (c.src.nbytes() / rows)));
      for (int64_t r = 0; r < rows; r += per) {
        Shape off(c.src.shape.size(), 0), size = c.src.shape;
        off[0] = r;
        size[0] = std::min(per, rows - r);
        pieces.push_back({c.dst.Narrow(off, size), c.src.Narrow(off, size), c.name});
      }
    }
    std::exception_ptr err;
    try {
      ParallelFor(
          pieces.size(), [&](size_t i) { CopyTensor(pieces[i].dst, pieces[i].src); },
          static_cast<size_t>(threads));
    } catch (...) {
      err = std::current_exception();  // after the device copies below have ended
    }
    for (auto& [device, stream] : streams) stream->Synchronize();
    if (err) std::rethrow_exception(err);
    return staged;
  }

  void Run() {
    while (true) {
      Job j;
      {
        std::unique_lock<std::mutex> lock(mu);
        cv.wait(lock, [&] { return stop || job.has_value(); });
        if (!job) return;  // stop requested and nothing to do
        j = std::move(*job);
        job.reset();
      }
      const auto t0 = Clock::now();
      Metadata md;
      std::exception_ptr error;
      try {
        std::optional<FailedSnapshotPlanner> failed;
        SaveOptions so = j.save;
        if (j.snapshot_error) {
          failed.emplace(j.snapshot_error);
          so.planner = &*failed;
        }
        md = j.run ? j.run(j.staged, *comm, so) : dcp::Save(j.staged, j.uri, *comm, so).metadata;
      } catch (...) {
        error = std::current_exception();
      }
      SaveMetrics m;
      {
        std::lock_guard<std::mutex> lock(j.result->mu);
        m = j.result->metrics;
        m.background_s = Since(t0);
        m.succeeded = !error;
        if (error) {
          try {
            std::rethrow_exception(error);
          } catch (const std::exception& e) {
            m.error = e.what();
          }
        } else {
          m.bytes_written = md.TotalStoredBytes();
        }
        m.training_time_saved_s = std::max(0.0, m.background_s - m.blocking_s);
        j.result->metrics = m;
        j.result->metadata = std::move(md);
        j.result->error = error;
        j.result->done = true;
      }
      j.result->cv.notify_all();
      if (options.on_complete) {
        try {
          options.on_complete(m);
        } catch (...) {
          // A logging callback must not take the saver down; the save's own outcome stands.
        }
      } else if (std::getenv("DCP_LOG") != nullptr && comm->rank() == 0) {
        std::fprintf(stderr, "%s\n", m.ToString().c_str());
      }
    }
  }

  // Wait for the last save; rethrow its error unless already reported.
  std::optional<Metadata> WaitLast() {
    std::shared_ptr<AsyncSave::State> s = last;
    if (!s) return std::nullopt;
    std::unique_lock<std::mutex> lock(s->mu);
    s->cv.wait(lock, [&] { return s->done; });
    if (s->error && !s->error_reported) {
      s->error_reported = true;
      std::rethrow_exception(s->error);
    }
    if (s->error) return std::nullopt;
    return s->metadata;
  }
};

AsyncCheckpointer::AsyncCheckpointer(std::unique_ptr<Communicator> background_comm,
                                     AsyncOptions options)
    : impl_(std::make_shared<Impl>()) {
  if (!background_comm) throw InvalidArgumentError("AsyncCheckpointer needs a communicator");
  if (std::string problem = background_comm->ConcurrentUseProblem(); !problem.empty()) {
    throw UnsupportedError("AsyncCheckpointer cannot save in the background: " + problem);
  }
  impl_->comm = std::move(background_comm);
  impl_->options = std::move(options);
  // The thread holds its own reference, so giving up on it at shutdown is safe.
  std::shared_ptr<Impl> impl = impl_;
  impl_->worker = Spawn([impl] { impl->Run(); });
}

AsyncCheckpointer::~AsyncCheckpointer() {
  try {
    Close(impl_->options.close_timeout);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "dcp: AsyncCheckpointer shut down with a checkpoint NOT completed: %s\n",
                 e.what());
  }
}

std::shared_ptr<AsyncSave> AsyncCheckpointer::Save(const StateDict& state, const std::string& uri,
                                                   const SaveOptions& options) {
  return SaveWith(state, uri, options, nullptr);
}

std::shared_ptr<AsyncSave> AsyncCheckpointer::SaveWith(const StateDict& state,
                                                       const std::string& uri,
                                                       const SaveOptions& options, SaveRunner run) {
  if (impl_->closed) throw InvalidArgumentError("AsyncCheckpointer is closed");
  const auto t0 = Clock::now();
  impl_->WaitLast();  // one save in flight at most; surfaces its unreported error
  auto result = std::make_shared<AsyncSave::State>();
  SaveMetrics& m = result->metrics;
  m.uri = uri;
  m.wait_previous_s = Since(t0);
  const auto t1 = Clock::now();
  Impl::Job job;
  try {
    // Bound views (LibTorch parameters, optimizer fields) are snapshotted as they are now.
    job.staged =
        HasBindings(state) ? impl_->Snapshot(ResolveBindings(state), m) : impl_->Snapshot(state, m);
  } catch (...) {
    job.snapshot_error = std::current_exception();
  }
  m.staging_s = Since(t1);
  m.staging_gbps = m.staging_s > 0 ? m.staged_bytes / m.staging_s / 1e9 : 0;
  m.blocking_s = Since(t0);
  job.uri = uri;
  job.save = options;
  job.result = result;
  job.run = std::move(run);
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->job = std::move(job);
    impl_->last = result;
  }
  impl_->cv.notify_all();
  return std::make_shared<AsyncSave>(result);
}

std::optional<Metadata> AsyncCheckpointer::Wait() { return impl_->WaitLast(); }

void AsyncCheckpointer::Close(std::chrono::milliseconds timeout) {
  if (impl_->closed) return;
  impl_->closed = true;
  std::shared_ptr<AsyncSave::State> s = impl_->last;
  bool finished = true;
  std::string uri;  // copied under the save's mutex: the worker rewrites its metrics when it ends
  if (s) {
    std::unique_lock<std::mutex> lock(s->mu);
    finished = s->cv.wait_for(lock, timeout, [&] { return s->done; });
    uri = s->metrics.uri;
  }
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    impl_->stop = true;
  }
  impl_->cv.notify_all();
  if (!finished) {
    // The save is stuck (a peer or the storage hangs). Stop its collectives, then join the
    // thread if it ends within a grace period (it does unless it hangs inside storage).
    impl_->comm->Stop("the AsyncCheckpointer was closed while a save to " + uri +
                      " was still running");
    // A collective notices within a poll interval; a thread inside storage does not end here.
    std::unique_lock<std::mutex> lock(s->mu);
    const bool ended =
        s->cv.wait_for(lock, std::chrono::milliseconds(200), [&] { return s->done; });
    lock.unlock();
    if (ended) {
      impl_->worker.Wait();
    } else {
      // Stuck in storage. The communicator is stopped: the thread makes no further transport
      // call, even when it ends after MPI_Finalize and destroys the communicator.
      impl_->detached = true;
      impl_->worker.Abandon();
    }
    throw Error(ErrorCode::kIo,
                "checkpoint " + uri + " is unfinished: the background save did not end within " +
                    std::to_string(timeout.count()) +
                    " ms; it has no metadata unless it completes later",
                true);
  }
  impl_->worker.Wait();
  impl_->WaitLast();
}

void AsyncCheckpointer::Abandon(const std::string& reason) noexcept {
  impl_->comm->Poison(reason);  // thread-safe: a save running now fails at its next receive
  // The notice is a transport call, and one thread at a time may use the communicator: sent
  // here only while the background thread runs no save (holding the queue's lock keeps it from
  // starting one). A queued save fails at its open, which sends the same notice.
  try {
    std::lock_guard<std::mutex> lock(impl_->mu);
    if (impl_->job) return;
    if (std::shared_ptr<AsyncSave::State> s = impl_->last) {
      std::lock_guard<std::mutex> done_lock(s->mu);
      if (!s->done) return;
    }
    impl_->comm->NotifyPeersOfPoison();
  } catch (...) {
    // A lock that could not be taken: the peers fail at their deadline instead.
  }
}

uint64_t AsyncCheckpointer::staging_bytes() const { return impl_->staging_bytes; }
size_t AsyncCheckpointer::staging_allocations() const { return impl_->total_allocations; }

}  // namespace dcp
