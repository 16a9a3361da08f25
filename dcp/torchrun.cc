// dcp's collectives over c10d's ProcessGroupGloo, and the bootstrap from torchrun's environment
// (declared in torch_adapter.h; the contract is there).
#include "dcp/torch_adapter.h"

// LibTorch declares ProcessGroupGloo only where the build says Gloo is in (its CMake target
// defines this; a distribution whose target does not is still built with Gloo, or the
// header check in CMakeLists.txt fails first).
#ifndef USE_C10D_GLOO
#define USE_C10D_GLOO
#endif

#include <ATen/ATen.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <list>
#include <mutex>
#include <optional>
#include <thread>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <utility>
#include <vector>

#include "dcp/proto/error.h"

namespace dcp {
namespace {

// What ProcessGroupGloo's send returns: a Work handle (ProcessGroup::Work in LibTorch 1.x,
// c10d::Work in 2.x).
using WorkPtr = decltype(std::declval<c10d::ProcessGroupGloo&>().send(
    std::declval<std::vector<at::Tensor>&>(), 0, 0));

// The most one message may claim: a peer's length field beyond it is a bug or a stranger.
constexpr int64_t kMaxMessageBytes = int64_t{1} << 40;
// The longest a communicator being destroyed waits for its peers to take what it sent.
constexpr std::chrono::milliseconds kFlushBound = std::chrono::seconds(60);

class GlooCommunicator final : public PointToPointCommunicator {
 public:
  GlooCommunicator(const c10::intrusive_ptr<c10d::Store>& store, int rank, int size,
                   std::shared_ptr<::gloo::transport::Device> device,
                   std::chrono::milliseconds timeout)
      : rank_(rank), size_(size), queues_(static_cast<size_t>(size) * kTags) {
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    options->devices.push_back(std::move(device));
    options->threads = 1;  // collectives' thread pool: dcp sends and receives only
    try {
      group_ = c10::make_intrusive<c10d::ProcessGroupGloo>(store, rank, size, options);
    } catch (const std::exception& e) {
      throw IoError("dcp: rank " + std::to_string(rank) + " cannot join the Gloo group of " +
                        std::to_string(size) + " processes: " + e.what(),
                    /*retryable=*/false);
    }
    set_timeout(timeout);
    for (int tag = 0; tag < kTags; ++tag) receivers_.emplace_back([this, tag] { Receive(tag); });
  }

  ~GlooCommunicator() override {
    // What this rank sent must reach its peers before this end goes: the rank that finishes
    // the last collective first would otherwise take the others' last message with it (Gloo
    // drops a send that is aborted). Not after a failure: a peer may be gone.
    if (!stopped() && !poisoned()) {
      const auto deadline = std::chrono::steady_clock::now() +
                            std::min<std::chrono::milliseconds>(timeout(), kFlushBound);
      for (auto& send : sending_) {
        const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
            deadline - std::chrono::steady_clock::now());
        if (left.count() <= 0) break;
        try {
          send.work->wait(left);
        } catch (const std::exception&) {
          // Its peer is gone or the bound passed: nothing more to do for it.
        }
      }
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      closing_ = true;
      for (auto& work : receiving_) {
        if (work) work->abort();
      }
      // Sends no peer took are dropped: a peer that left will never receive them.
      for (auto& send : sending_) {
        if (!send.work->isCompleted()) send.work->abort();
      }
    }
    for (auto& t : receivers_) t.join();
    sending_.clear();
    group_.reset();
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }

 protected:
  void Send(int dest, int tag, std::string payload) override {
    SendShared(dest, tag, std::make_shared<const std::string>(std::move(payload)));
  }

  void SendShared(int dest, int tag, std::shared_ptr<const std::string> payload) override {
    if (dest == rank_) {
      Deliver(dest, tag, std::string(*payload));
      return;
    }
    std::lock_guard<std::mutex> lock(mu_);
    Reap();
    at::Tensor header = at::empty({1}, at::kLong);
    header.data_ptr<int64_t>()[0] = static_cast<int64_t>(payload->size());
    std::vector<at::Tensor> h{header};
    sending_.push_back({group_->send(h, dest, HeaderTag(tag)), payload});
    if (payload->empty()) return;
    // The tensor aliases the shared payload, which the pending send keeps alive.
    std::vector<at::Tensor> p{at::from_blob(const_cast<char*>(payload->data()),
                                            {static_cast<int64_t>(payload->size())},
                                            at::TensorOptions().dtype(at::kByte))};
    sending_.push_back({group_->send(p, dest, PayloadTag(tag)), payload});
  }

  std::optional<std::string> TryReceive(int source, int tag) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto& queue = queues_[Queue(source, tag)];
    if (queue.empty()) return std::nullopt;
    std::string message = std::move(queue.front());
    queue.pop_front();
    return message;
  }

  uint64_t MailMark() override {
    std::lock_guard<std::mutex> lock(mu_);
    return arrivals_;
  }

  void WaitForMail(uint64_t mark, int& round) override {
    ++round;
    std::unique_lock<std::mutex> lock(mu_);
    // A bounded wait: the caller also watches deadlines and poison between polls.
    arrived_.wait_for(lock, std::chrono::milliseconds(50),
                      [&] { return arrivals_ != mark || closing_; });
  }

 private:
  // Gloo tags: each dcp tag's lengths and bytes on tags of their own.
  static constexpr int kTags = 2;  // kTag and kNoticeTag
  static int HeaderTag(int tag) { return 0x6463700 + 2 * tag; }
  static int PayloadTag(int tag) { return 0x6463700 + 2 * tag + 1; }
  size_t Queue(int source, int tag) const {
    return static_cast<size_t>(source) * kTags + static_cast<size_t>(tag);
  }

  struct PendingSend {
    WorkPtr work;
    std::shared_ptr<const std::string> payload;
  };

  // Called under mu_: forgets the sends that completed. A send that failed (its peer is gone)
  // is forgotten too: the collective waiting for that peer fails on its deadline, naming it.
  void Reap() {
    sending_.remove_if([](const PendingSend& s) { return s.work->isCompleted(); });
  }

  void Deliver(int source, int tag, std::string message) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      queues_[Queue(source, tag)].push_back(std::move(message));
      ++arrivals_;
    }
    arrived_.notify_all();
  }

  // Posts `work` as the one this tag's thread waits on (so that closing can abort it); false
  // when closing already.
  bool Track(int tag, const WorkPtr& work) {
    std::lock_guard<std::mutex> lock(mu_);
    if (closing_) {
      work->abort();
      return false;
    }
    receiving_[tag] = work;
    return true;
  }

  // One tag's receiving thread: a length from any peer, then that many bytes from the same
  // peer, delivered in the order each peer sent them (Gloo keeps a pair's order per tag).
  void Receive(int tag) {
    try {
      for (;;) {
        at::Tensor header = at::empty({1}, at::kLong);
        std::vector<at::Tensor> h{header};
        WorkPtr work = group_->recvAnysource(h, HeaderTag(tag));
        if (!Track(tag, work) || !work->wait()) return;  // aborted: closing
        const int source = work->sourceRank();
        const int64_t length = header.data_ptr<int64_t>()[0];
        if (source < 0 || source >= size_ || length < 0 || length > kMaxMessageBytes) return;
        std::string message(static_cast<size_t>(length), '\0');
        if (length > 0) {
          std::vector<at::Tensor> p{
              at::from_blob(message.data(), {length}, at::TensorOptions().dtype(at::kByte))};
          WorkPtr bytes = group_->recv(p, source, PayloadTag(tag));
          if (!Track(tag, bytes) || !bytes->wait()) return;
        }
        Deliver(source, tag, std::move(message));
      }
    } catch (const std::exception&) {
      // Closing, or the transport failed (a peer vanished): from here on nothing arrives on
      // this tag, and each collective waiting for a message fails on its deadline, naming the
      // ranks it waited for.
    }
  }

  const int rank_, size_;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> group_;
  std::mutex mu_;
  std::condition_variable arrived_;
  uint64_t arrivals_ = 0;
  bool closing_ = false;
  std::vector<std::deque<std::string>> queues_;  // by (source, tag)
  std::array<WorkPtr, kTags> receiving_{};
  std::list<PendingSend> sending_;
  std::vector<std::thread> receivers_;
};

bool IsLoopback(const std::string& host) {
  return host == "localhost" || host.rfind("127.", 0) == 0 || host == "::1";
}

std::shared_ptr<::gloo::transport::Device> GlooDevice(const std::string& master) {
  try {
    if (const char* ifname = std::getenv("GLOO_SOCKET_IFNAME"); ifname && *ifname) {
      return c10d::ProcessGroupGloo::createDeviceForInterface(ifname);
    }
    if (IsLoopback(master)) return c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1");
    return c10d::ProcessGroupGloo::createDefaultDevice();
  } catch (const std::exception& e) {
    throw IoError(
        std::string("dcp: no network device for Gloo (set GLOO_SOCKET_IFNAME): ") + e.what(),
        /*retryable=*/false);
  }
}

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') {
    throw InvalidArgumentError(std::string("dcp: ") + name +
                               " is not set: ConnectTorchrun needs the environment torchrun "
                               "gives its processes (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)");
  }
  return v;
}

int64_t EnvNumber(const char* name, std::optional<int64_t> otherwise, int64_t lo, int64_t hi) {
  if (otherwise && (std::getenv(name) == nullptr || *std::getenv(name) == '\0')) {
    return *otherwise;
  }
  const std::string text = Env(name);
  size_t used = 0;
  int64_t value = 0;
  try {
    value = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || value < lo || value > hi) {
    throw InvalidArgumentError(std::string("dcp: ") + name + "='" + text +
                               "' is not a number in [" + std::to_string(lo) + ", " +
                               std::to_string(hi) + "]");
  }
  return value;
}

}  // namespace

struct TorchrunGroup::Connection {
  c10::intrusive_ptr<c10d::Store> store;
  std::shared_ptr<::gloo::transport::Device> device;
  std::chrono::milliseconds timeout;
  int extra = 0;  // communicators made by Connect so far

  std::unique_ptr<Communicator> Make(const std::string& role, int rank, int world_size) const {
    auto prefixed = c10::make_intrusive<c10d::PrefixStore>("dcp/" + role, store);
    return std::make_unique<GlooCommunicator>(prefixed, rank, world_size, device, timeout);
  }
};

TorchrunGroup ConnectStore(const StoreAddress& address, std::chrono::milliseconds timeout) {
  if (address.world_size < 1 || address.rank < 0 || address.rank >= address.world_size) {
    throw InvalidArgumentError("dcp: rank " + std::to_string(address.rank) +
                               " is outside a job of " + std::to_string(address.world_size));
  }
  c10::intrusive_ptr<c10d::Store> store;
  try {
    c10d::TCPStoreOptions so;
    so.port = address.port;
    so.isServer = address.serve;
    so.numWorkers = address.world_size;
    so.waitWorkers = false;
    so.timeout = timeout;
    store = c10::make_intrusive<c10d::TCPStore>(address.host, so);
  } catch (const std::exception& e) {
    throw IoError("dcp: rank " + std::to_string(address.rank) + " cannot " +
                      (address.serve ? "host" : "reach") + " the TCPStore at " + address.host +
                      ":" + std::to_string(address.port) + ": " + e.what(),
                  /*retryable=*/false);
  }
  TorchrunGroup group;
  group.rank = address.rank;
  group.world_size = address.world_size;
  group.connection = std::make_shared<TorchrunGroup::Connection>(
      TorchrunGroup::Connection{store, GlooDevice(address.host), timeout, 0});
  group.comm = group.connection->Make("comm", group.rank, group.world_size);
  group.background = group.connection->Make("background", group.rank, group.world_size);
  return group;
}

std::unique_ptr<Communicator> TorchrunGroup::Connect() {
  if (!connection) throw InvalidArgumentError("dcp: TorchrunGroup::Connect on a group not connected");
  return connection->Make("extra-" + std::to_string(connection->extra++), rank, world_size);
}

TorchrunGroup ConnectTorchrun(std::chrono::milliseconds timeout) {
  StoreAddress address;
  address.world_size = static_cast<int>(EnvNumber("WORLD_SIZE", std::nullopt, 1, 1 << 24));
  address.rank = static_cast<int>(EnvNumber("RANK", std::nullopt, 0, address.world_size - 1));
  address.host = Env("MASTER_ADDR");
  address.port = static_cast<uint16_t>(EnvNumber("MASTER_PORT", std::nullopt, 1, 65535));
  const char* agent_store = std::getenv("TORCHELASTIC_USE_AGENT_STORE");
  address.serve = address.rank == 0 && !(agent_store && std::string(agent_store) == "True");
  TorchrunGroup group = ConnectStore(address, timeout);
  group.local_world_size = static_cast<int>(EnvNumber("LOCAL_WORLD_SIZE", 1, 1, 1 << 24));
  group.local_rank = static_cast<int>(EnvNumber("LOCAL_RANK", 0, 0, group.local_world_size - 1));
  return group;
}

}  // namespace dcp
