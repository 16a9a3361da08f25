#include "dcp/communicator.h"

#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>

#include "proto/error.h"

namespace dcp {

namespace {

// Wire frame: 8-byte little-endian sequence number, then the payload.
std::string Frame(uint64_t seq, std::string payload) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((seq >> (8 * i)) & 0xff);
  out += payload;
  return out;
}

bool Unframe(const std::string& frame, uint64_t* seq, std::string* payload) {
  if (frame.size() < 8) return false;
  uint64_t s = 0;
  for (int i = 0; i < 8; ++i)
    s |= static_cast<uint64_t>(static_cast<unsigned char>(frame[i])) << (8 * i);
  *seq = s;
  *payload = frame.substr(8);
  return true;
}

std::string PackVector(const std::vector<std::string>& v) {
  std::string out;
  for (const auto& s : v) {
    const uint64_t n = s.size();
    out.append(reinterpret_cast<const char*>(&n), 8);
    out += s;
  }
  return out;
}

std::vector<std::string> UnpackVector(const std::string& data, size_t count) {
  std::vector<std::string> out;
  size_t pos = 0;
  for (size_t i = 0; i < count; ++i) {
    if (data.size() - pos < 8) throw InternalError("malformed all-gather message");
    uint64_t n;
    std::memcpy(&n, data.data() + pos, 8);
    pos += 8;
    if (data.size() - pos < n) throw InternalError("malformed all-gather message");
    out.push_back(data.substr(pos, n));
    pos += n;
  }
  return out;
}

[[noreturn]] void ThrowTimeout(std::string_view what, const std::vector<int>& ranks,
                               std::chrono::milliseconds timeout, int observer) {
  std::vector<RankFailure> failures;
  for (int r : ranks) {
    failures.push_back({r, ErrorCode::kTimeout,
                        "rank " + std::to_string(r) + " did not answer within " +
                            std::to_string(timeout.count()) + " ms (seen by rank " +
                            std::to_string(observer) + ")",
                        true});
  }
  throw CollectiveError(std::string(what), std::move(failures));
}

// Poll with a short spin, then back off to 1 ms sleeps: control messages are latency-sensitive
// only at the start of a wait.
void Backoff(int& round) {
  if (round < 64) {
    std::this_thread::yield();
  } else {
    std::this_thread::sleep_for(std::chrono::microseconds(round < 256 ? 50 : 1000));
  }
  ++round;
}

}  // namespace

std::string PointToPointCommunicator::Receive(int source, uint64_t seq,
                                              std::chrono::steady_clock::time_point deadline,
                                              std::string_view what) {
  int round = 0;
  while (true) {
    if (auto frame = TryReceive(source, TagFor(seq))) {
      uint64_t got;
      std::string payload;
      if (Unframe(*frame, &got, &payload) && got == seq) return payload;
      continue;  // a stale message of an abandoned collective: drop it
    }
    if (std::chrono::steady_clock::now() >= deadline)
      ThrowTimeout(what, {source}, timeout(), rank());
    Backoff(round);
  }
}

std::vector<std::string> PointToPointCommunicator::Gather(std::string message, int root,
                                                          std::string_view what) {
  const uint64_t seq = NextSeq();
  if (rank() != root) {
    Send(root, TagFor(seq), Frame(seq, std::move(message)));
    return {};
  }
  std::vector<std::string> out(size());
  std::vector<bool> have(size(), false);
  out[root] = std::move(message);
  have[root] = true;
  const auto deadline = std::chrono::steady_clock::now() + timeout();
  int missing = size() - 1, round = 0;
  while (missing > 0) {
    bool progress = false;
    for (int r = 0; r < size(); ++r) {
      if (have[r]) continue;
      if (auto frame = TryReceive(r, TagFor(seq))) {
        uint64_t got;
        std::string payload;
        if (Unframe(*frame, &got, &payload) && got == seq) {
          out[r] = std::move(payload);
          have[r] = true;
          --missing;
        }
        progress = true;
      }
    }
    if (missing == 0) break;
    if (std::chrono::steady_clock::now() >= deadline) {
      std::vector<int> late;
      for (int r = 0; r < size(); ++r) {
        if (!have[r]) late.push_back(r);
      }
      ThrowTimeout(what, late, timeout(), rank());
    }
    if (!progress) Backoff(round);
  }
  return out;
}

std::string PointToPointCommunicator::Scatter(std::vector<std::string> messages, int root,
                                              std::string_view what) {
  const uint64_t seq = NextSeq();
  if (rank() == root) {
    if (static_cast<int>(messages.size()) != size()) {
      throw InvalidArgumentError("scatter needs one message per rank");
    }
    for (int r = 0; r < size(); ++r) {
      if (r != root) Send(r, TagFor(seq), Frame(seq, std::move(messages[r])));
    }
    return std::move(messages[root]);
  }
  return Receive(root, seq, std::chrono::steady_clock::now() + timeout(), what);
}

std::string PointToPointCommunicator::Broadcast(std::string message, int root,
                                                std::string_view what) {
  const uint64_t seq = NextSeq();
  if (rank() == root) {
    for (int r = 0; r < size(); ++r) {
      if (r != root) Send(r, TagFor(seq), Frame(seq, message));
    }
    return message;
  }
  return Receive(root, seq, std::chrono::steady_clock::now() + timeout(), what);
}

std::vector<std::string> PointToPointCommunicator::AllGather(std::string message,
                                                             std::string_view what) {
  auto all = Gather(std::move(message), 0, what);
  std::string packed = Broadcast(rank() == 0 ? PackVector(all) : std::string(), 0, what);
  return UnpackVector(packed, size());
}

void PointToPointCommunicator::Barrier(std::string_view what) { AllGather({}, what); }

std::string LocalCommunicator::Scatter(std::vector<std::string> m, int, std::string_view) {
  if (m.size() != 1) throw InvalidArgumentError("scatter needs one message per rank");
  return std::move(m[0]);
}

// ---------------------------------------------------------------------------------------------
// InProcessGroup: mailboxes keyed by (source, dest, tag).

struct InProcessGroup::State {
  explicit State(int n) : size(n) {}
  int size;
  std::mutex mu;
  std::map<std::tuple<int, int, int>, std::deque<std::string>> mail;
};

namespace {
class InProcessCommunicator : public PointToPointCommunicator {
 public:
  InProcessCommunicator(std::shared_ptr<InProcessGroup::State> s, int rank)
      : state_(std::move(s)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override;

 protected:
  void Send(int dest, int tag, std::string payload) override;
  std::optional<std::string> TryReceive(int source, int tag) override;

 private:
  std::shared_ptr<InProcessGroup::State> state_;
  int rank_;
};
}  // namespace

int InProcessCommunicator::size() const { return state_->size; }

void InProcessCommunicator::Send(int dest, int tag, std::string payload) {
  std::lock_guard<std::mutex> lock(state_->mu);
  state_->mail[{rank_, dest, tag}].push_back(std::move(payload));
}

std::optional<std::string> InProcessCommunicator::TryReceive(int source, int tag) {
  std::lock_guard<std::mutex> lock(state_->mu);
  auto it = state_->mail.find({source, rank_, tag});
  if (it == state_->mail.end() || it->second.empty()) return std::nullopt;
  std::string m = std::move(it->second.front());
  it->second.pop_front();
  if (it->second.empty()) state_->mail.erase(it);
  return m;
}

InProcessGroup::InProcessGroup(int size) : state_(std::make_shared<State>(size)) {
  if (size < 1) throw InvalidArgumentError("group size must be at least 1");
  for (int r = 0; r < size; ++r)
    comms_.push_back(std::make_unique<InProcessCommunicator>(state_, r));
}
InProcessGroup::~InProcessGroup() = default;
int InProcessGroup::size() const { return state_->size; }
Communicator& InProcessGroup::communicator(int rank) {
  if (!comms_.at(rank))
    throw InvalidArgumentError("communicator of rank " + std::to_string(rank) + " was released");
  return *comms_[rank];
}
std::unique_ptr<Communicator> InProcessGroup::Release(int rank) {
  return std::move(comms_.at(rank));
}

}  // namespace dcp
