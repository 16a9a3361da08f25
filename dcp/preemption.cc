// Saving on preemption (CheckpointManager::HandlePreemption): the notice, the handler's thread,
// and what it does.
//
// The notice must be async-signal-safe: the SIGTERM handler (and NotifyPreemption) only writes a
// byte into each registered handler's pipe. Each manager's handler thread sleeps on its pipe and
// does the work with ordinary code: locks, collectives, I/O. It runs on a communicator of its
// own, so it never joins a collective of the job's threads, which may be anywhere (inside a
// save, a training step's all-reduce, or compute that lasts longer than the window: a handler
// that waited for the next step boundary would miss the window there).
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <mutex>
#include <thread>

#include "dcp/checkpoint_manager.h"
#include "dcp/proto/error.h"

namespace dcp {

namespace {

using Clock = std::chrono::steady_clock;

// The write ends of the handlers' pipes, plus one (0: a free slot): what the signal handler may
// touch, lock-free.
constexpr int kMaxHandlers = 256;
std::atomic<int> g_notice_fds[kMaxHandlers];

// SIGTERM's previous disposition, while any handler has the signal (under g_install_mu).
std::mutex g_install_mu;
int g_sigterm_users = 0;
struct sigaction g_previous_sigterm;

void OnSigterm(int) {
  const int saved = errno;
  NotifyPreemption();
  errno = saved;
}

void InstallSigterm() {
  std::lock_guard<std::mutex> lock(g_install_mu);
  if (g_sigterm_users++ > 0) return;
  struct sigaction sa {};
  sa.sa_handler = OnSigterm;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = SA_RESTART;
  if (::sigaction(SIGTERM, &sa, &g_previous_sigterm) != 0) {
    --g_sigterm_users;
    throw MakeIoError("sigaction(SIGTERM)", "the preemption handler", errno);
  }
}

void UninstallSigterm() noexcept {
  std::lock_guard<std::mutex> lock(g_install_mu);
  if (--g_sigterm_users == 0) ::sigaction(SIGTERM, &g_previous_sigterm, nullptr);
}

double SecondsBetween(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

void NotifyPreemption() noexcept {
  for (auto& slot : g_notice_fds) {
    const int fd = slot.load(std::memory_order_acquire) - 1;
    if (fd < 0) continue;
    const char byte = 'p';
    // Non-blocking: a full pipe already holds a notice.
    [[maybe_unused]] ssize_t n = ::write(fd, &byte, 1);
  }
}

// One manager's handler: its pipe, its thread and its report.
class PreemptionWatcher {
 public:
  PreemptionWatcher(CheckpointManager& manager, std::unique_ptr<Communicator> comm,
                    PreemptionOptions options)
      : manager_(manager), comm_(std::move(comm)), options_(options) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0) {
      throw MakeIoError("pipe2", "the preemption handler", errno);
    }
    read_fd_ = fds[0];
    write_fd_ = fds[1];
    for (auto& slot : g_notice_fds) {
      int expected = 0;
      if (slot.compare_exchange_strong(expected, write_fd_ + 1)) {
        slot_ = &slot;
        break;
      }
    }
    if (!slot_) {
      CloseFds();
      throw InvalidArgumentError("more than " + std::to_string(kMaxHandlers) +
                                 " preemption handlers in one process");
    }
    try {
      if (options_.on_sigterm) InstallSigterm();
    } catch (...) {
      slot_->store(0);
      CloseFds();
      throw;
    }
    thread_ = std::thread([this] { Run(); });
  }

  ~PreemptionWatcher() { Stop(); }

  // Ends the thread: a drain under way is waited for (it ends by its deadline).
  void Stop() noexcept {
    if (!thread_.joinable()) return;
    stopping_.store(true);
    const char byte = 's';
    [[maybe_unused]] ssize_t n = ::write(write_fd_, &byte, 1);
    thread_.join();
    slot_->store(0, std::memory_order_release);
    if (options_.on_sigterm) UninstallSigterm();
    CloseFds();
  }

  bool noticed() const { return noticed_.load(); }

  PreemptionReport Wait(std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait_for(lock, timeout, [&] { return report_.done; });
    return report_;
  }

 private:
  void Run() {
    for (;;) {
      pollfd p{read_fd_, POLLIN, 0};
      if (::poll(&p, 1, -1) < 0 && errno != EINTR) return;
      char bytes[64];
      const ssize_t n = ::read(read_fd_, bytes, sizeof(bytes));
      if (stopping_.load()) return;
      if (n > 0) break;
    }
    const auto notice = Clock::now();
    noticed_.store(true);
    PreemptionReport report;
    report.noticed = true;
    const auto deadline = notice + options_.grace_period;
    try {
      manager_.DrainOnPreemption(*comm_, notice + options_.next_step_within, deadline, report);
    } catch (const std::exception& e) {
      report.error = e.what();
    }
    report.seconds = SecondsBetween(notice, Clock::now());
    report.window_left_s = SecondsBetween(Clock::now(), deadline);
    report.done = true;
    if (comm_->rank() == 0) Say(report);
    std::lock_guard<std::mutex> lock(mu_);
    report_ = std::move(report);
    done_cv_.notify_all();
  }

  void Say(const PreemptionReport& r) const {
    const double window = std::chrono::duration<double>(options_.grace_period).count();
    if (!r.error.empty()) {
      std::fprintf(stderr, "dcp: preemption: the drain failed after %.2f s (%.2f s of the %.1f s "
                   "window left): %s\n", r.seconds, r.window_left_s, window, r.error.c_str());
    } else if (r.step < 0) {
      std::fprintf(stderr, "dcp: preemption: no step complete in memory to drain "
                   "(%.2f s; %.2f s of the %.1f s window left)\n", r.seconds, r.window_left_s,
                   window);
    } else {
      std::fprintf(stderr, "dcp: preemption: step %lld %s %s in %.2f s (%.2f s of the %.1f s "
                   "window left)\n", static_cast<long long>(r.step),
                   r.drained ? "drained to" : "was already durable at", r.where.c_str(),
                   r.seconds, r.window_left_s, window);
    }
  }

  void CloseFds() noexcept {
    if (read_fd_ >= 0) ::close(read_fd_);
    if (write_fd_ >= 0) ::close(write_fd_);
    read_fd_ = write_fd_ = -1;
  }

  CheckpointManager& manager_;
  std::unique_ptr<Communicator> comm_;
  PreemptionOptions options_;
  int read_fd_ = -1, write_fd_ = -1;
  std::atomic<int>* slot_ = nullptr;
  std::atomic<bool> stopping_{false};
  std::atomic<bool> noticed_{false};
  std::mutex mu_;
  std::condition_variable done_cv_;
  PreemptionReport report_;
  std::thread thread_;  // last: started once the members it uses exist
};

void CheckpointManager::HandlePreemption(std::unique_ptr<Communicator> comm,
                                         PreemptionOptions options) {
  if (closed_) throw InvalidArgumentError("CheckpointManager is closed");
  if (!tier_) {
    throw InvalidArgumentError(
        "CheckpointManager::HandlePreemption drains the memory tier's newest step: set "
        "ManagerOptions::memory_tier");
  }
  if (!MemoryTier::DrainCopies(options_.save.storage)) {
    throw InvalidArgumentError(
        "CheckpointManager::HandlePreemption copies the tier's files to the root, which holds "
        "another format or compression (ManagerOptions::save.storage): use the dcp format, "
        "uncompressed");
  }
  if (preemption_) throw InvalidArgumentError("CheckpointManager::HandlePreemption called twice");
  if (!comm || comm->size() != comm_->size() || comm->rank() != comm_->rank()) {
    throw InvalidArgumentError(
        "CheckpointManager::HandlePreemption needs a communicator over the job's ranks");
  }
  if (options.grace_period.count() <= 0) {
    throw InvalidArgumentError("PreemptionOptions::grace_period must be positive");
  }
  if (options.next_step_within.count() < 0 || options.next_step_within >= options.grace_period) {
    throw InvalidArgumentError(
        "PreemptionOptions::next_step_within must be at least 0 and less than grace_period");
  }
  preemption_.reset(new PreemptionWatcher(*this, std::move(comm), options));
}

bool CheckpointManager::preempted() const { return preemption_ && preemption_->noticed(); }

PreemptionReport CheckpointManager::WaitForPreemption(std::chrono::milliseconds timeout) {
  if (!preemption_) return {};
  return preemption_->Wait(timeout);
}

void CheckpointManager::StopPreemptionHandler() noexcept {
  if (preemption_) preemption_->Stop();
}

void PreemptionWatcherDeleter::operator()(PreemptionWatcher* watcher) const noexcept {
  delete watcher;
}

}  // namespace dcp
