#include "dcp/communicator.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "dcp/proto/error.h"

namespace dcp {

namespace {

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
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

void PointToPointCommunicator::WaitForMail(uint64_t /*mark*/, int& round) { Backoff(round); }

namespace {

uint64_t NewOperationId() {
  static std::atomic<uint64_t> counter{0};
  std::random_device rd;
  const uint64_t r = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  // Never 0 (0 means "no operation"); the counter keeps ids of one process distinct.
  return (r ^ (++counter * 0x9e3779b97f4a7c15ull)) | 1;
}

std::string OpName(uint64_t op) {
  if (op == 0) return "no operation";
  char buf[32];
  std::snprintf(buf, sizeof(buf), "operation %016llx", static_cast<unsigned long long>(op));
  return buf;
}

// An all-to-all takes one message per rank.
void CheckAllToAllMessages(size_t messages, int ranks, std::string_view what) {
  if (messages != static_cast<size_t>(ranks)) {
    throw InvalidArgumentError("all-to-all '" + std::string(what) + "' needs " +
                               std::to_string(ranks) + " messages, got " +
                               std::to_string(messages));
  }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Communicator: operations and poisoning.

std::vector<std::string> Communicator::AllToAll(std::vector<std::string> messages,
                                                std::string_view what) {
  CheckAllToAllMessages(messages.size(), size(), what);
  std::vector<std::string> out(size());
  for (int root = 0; root < size(); ++root) {
    out[root] =
        Scatter(root == rank() ? std::move(messages) : std::vector<std::string>{}, root, what);
    if (root == rank()) messages.clear();
  }
  return out;
}

void Communicator::ExchangeBytes(const std::vector<BulkSend>& sends,
                                 const std::vector<BulkReceive>& receives, std::string_view what) {
  std::vector<std::string> messages(size());
  std::vector<size_t> total(size(), 0);
  for (const auto& s : sends) {
    if (s.peer < 0 || s.peer >= size()) {
      throw InvalidArgumentError("bulk exchange '" + std::string(what) + "': no rank " +
                                 std::to_string(s.peer));
    }
    total[s.peer] += s.size;
  }
  // Each message is sized once: growing it piece by piece would copy (and fault in) it again.
  for (int peer = 0; peer < size(); ++peer) messages[peer].reserve(total[peer]);
  for (const auto& s : sends) {
    if (s.size > 0) messages[s.peer].append(s.data, s.size);  // an empty piece may have no data
  }
  auto got = AllToAll(std::move(messages), what);
  std::vector<size_t> used(size(), 0);
  for (const auto& r : receives) {
    if (r.peer < 0 || r.peer >= size()) {
      throw InvalidArgumentError("bulk exchange '" + std::string(what) + "': no rank " +
                                 std::to_string(r.peer));
    }
    const std::string& from = got[r.peer];
    if (r.size > from.size() - used[r.peer]) {
      throw CollectiveError(
          std::string(what),
          {{r.peer, ErrorCode::kInternal,
            "rank " + std::to_string(r.peer) + " sent " + std::to_string(from.size()) +
                " bytes, fewer than rank " + std::to_string(rank()) + " expects",
            false}});
    }
    if (r.size > 0) std::memcpy(r.data, from.data() + used[r.peer], r.size);
    used[r.peer] += r.size;
  }
  for (int peer = 0; peer < size(); ++peer) {
    if (used[peer] != got[peer].size()) {
      throw CollectiveError(
          std::string(what),
          {{peer, ErrorCode::kInternal,
            "rank " + std::to_string(peer) + " sent " + std::to_string(got[peer].size()) +
                " bytes, rank " + std::to_string(rank()) + " expects " + std::to_string(used[peer]),
            false}});
    }
  }
}

uint64_t Communicator::OpenOperation(std::string_view name, std::string_view target) {
  const std::string what = std::string(name) + "/open";
  std::string msg;
  if (rank() == 0) {
    PutU64(msg, NewOperationId());
    msg.append(target);
  }
  msg = Broadcast(std::move(msg), 0, what);
  if (msg.size() < 8) throw InternalError("malformed operation id");
  CheckTarget(what, msg.substr(8), target);
  return GetU64(msg.data());
}

void Communicator::CheckTarget(std::string_view what, std::string_view roots,
                               std::string_view mine) {
  if (roots == mine) return;
  const std::string reason = "rank 0 opened '" + std::string(what) + "' on " + std::string(roots) +
                             " while rank " + std::to_string(rank()) + " opened it on " +
                             std::string(mine) +
                             ": the ranks are not running the same operation (did a rank skip "
                             "or repeat one?)";
  Poison(reason);
  throw CollectiveError(std::string(what), {{rank(), ErrorCode::kCollective, reason, false}});
}

void Communicator::Poison(const std::string& reason) noexcept {
  try {
    std::lock_guard<std::mutex> lock(poison_mu_);
    if (poisoned_.load(std::memory_order_relaxed)) return;
    poison_reason_ = reason;
    poisoned_.store(true, std::memory_order_release);
  } catch (...) {
    poisoned_.store(true, std::memory_order_release);  // the reason is lost, not the poison
  }
}

void Communicator::Stop(const std::string& reason) noexcept {
  Poison(reason);
  // Under the transport lock: a transport call already past its stopped() check completes
  // first, so once this returns the caller may tear the transport down (MPI_Finalize).
  std::lock_guard<std::mutex> lock(transport_mu_);
  stopped_.store(true, std::memory_order_release);
}

std::string Communicator::poison_reason() const {
  std::lock_guard<std::mutex> lock(poison_mu_);
  return poison_reason_;
}

// Not virtual: a virtual function added to Communicator would move the slots of
// PointToPointCommunicator's own (Send, TryReceive, ...), which built transport plugins use.
void Communicator::NotifyPeersOfPoison() noexcept {
  if (auto* p2p = dynamic_cast<PointToPointCommunicator*>(this)) p2p->AnnounceOpenFailure();
}

void Communicator::ThrowIfPoisoned(std::string_view what) const {
  if (!poisoned()) return;
  throw CollectiveError(
      std::string(what),
      {{rank(), ErrorCode::kCollective,
        "this communicator is unusable since an earlier failure (" + poison_reason() +
            "); messages of that operation may still be in flight, so no later collective can "
            "be trusted on it: create a new communicator (e.g. a new MpiCommunicator, "
            "collectively)",
        false}});
}

// ---------------------------------------------------------------------------------------------
// PointToPointCommunicator.
//
// Wire frame: sequence number (u64 LE), operation id (u64 LE), kind (u8), phase name length
// (u16 LE), the phase name, then the payload. The checks in Accept are what turn a rank that
// skipped or added a collective into an immediate, named error instead of a silent pairing of
// different saves. A failure frame's payload is the failure list (EncodeFailures): a broadcast's
// forwarding rank sends it down the tree instead of the message it could not get, so its subtree
// fails at once with the real cause rather than each rank waiting for its own timeout. A poison
// notice (kind 2, on kNoticeTag, sequence number 0) carries the same list: it is a statement
// about the sender ("I will never take part again, because..."), true whatever collective the
// receiver is in, hence outside the sequence.

namespace {

constexpr size_t kFrameHeader = 19;
constexpr uint8_t kDataFrame = 0;
constexpr uint8_t kFailureFrame = 1;
constexpr uint8_t kNoticeFrame = 2;

std::string EncodeFailures(const std::vector<RankFailure>& failures) {
  std::string out;
  PutU64(out, failures.size());
  for (const auto& f : failures) {
    PutU64(out, static_cast<uint64_t>(static_cast<int64_t>(f.rank)));
    PutU64(out, static_cast<uint64_t>(f.code));
    PutU64(out, f.retryable ? 1 : 0);
    PutU64(out, f.message.size());
    out += f.message;
  }
  return out;
}

bool DecodeFailures(std::string_view in, std::vector<RankFailure>* out) {
  auto take = [&](uint64_t* v) {
    if (in.size() < 8) return false;
    *v = GetU64(in.data());
    in.remove_prefix(8);
    return true;
  };
  uint64_t count = 0;
  if (!take(&count) || count == 0 || count > in.size() / 32) return false;
  for (uint64_t i = 0; i < count; ++i) {
    uint64_t rank, code, retryable, len;
    if (!take(&rank) || !take(&code) || !take(&retryable) || !take(&len) || len > in.size())
      return false;
    out->push_back({static_cast<int>(static_cast<int64_t>(rank)), static_cast<ErrorCode>(code),
                    std::string(in.substr(0, len)), retryable != 0});
    in.remove_prefix(len);
  }
  return in.empty();
}

// The broadcast tree: a binomial tree over virtual ranks v = (rank - root) mod n. The parent of
// v > 0 is v with its lowest set bit cleared; its children are v + m for each power of two m
// below that bit (every m < n for the root), so the root sends ceil(log2 n) frames, every rank
// receives one, and the depth of v is popcount(v) <= ceil(log2 n).
int LowBit(int v) { return v & -v; }

int TreeParent(int rank, int root, int n) {
  const int v = (rank - root + n) % n;
  return (v - LowBit(v) + root) % n;
}

// Largest subtree first, so that the deepest branch starts earliest.
std::vector<int> TreeChildren(int rank, int root, int n) {
  const int v = (rank - root + n) % n;
  int limit = v == 0 ? n : LowBit(v);
  int m = 1;
  while (m * 2 < limit) m *= 2;
  std::vector<int> out;
  for (; m >= 1; m /= 2) {
    if (m < limit && v + m < n) out.push_back((v + m + root) % n);
  }
  return out;
}

int TreeDepth(int rank, int root, int n) {
  return __builtin_popcount(static_cast<unsigned>((rank - root + n) % n));
}

}  // namespace

struct PointToPointCommunicator::Frame {
  uint64_t seq = 0, op = 0;
  uint8_t kind = kDataFrame;
  std::string what;
  size_t payload_at = 0;  // the payload is bytes[payload_at..]
  static bool Parse(const std::string& bytes, Frame* f) {
    if (bytes.size() < kFrameHeader) return false;
    f->seq = GetU64(bytes.data());
    f->op = GetU64(bytes.data() + 8);
    f->kind = static_cast<uint8_t>(bytes[16]);
    const size_t n = static_cast<unsigned char>(bytes[17]) |
                     (static_cast<size_t>(static_cast<unsigned char>(bytes[18])) << 8);
    if (bytes.size() - kFrameHeader < n) return false;
    if (f->kind != kDataFrame && f->kind != kFailureFrame && f->kind != kNoticeFrame) return false;
    f->what = bytes.substr(kFrameHeader, n);
    f->payload_at = kFrameHeader + n;
    return true;
  }
};

std::string PointToPointCommunicator::MakeFrame(uint64_t seq, std::string_view what,
                                                std::string_view payload, uint8_t kind) const {
  std::string out;
  const size_t n = std::min<size_t>(what.size(), 0xffff);
  out.reserve(kFrameHeader + n + payload.size());
  PutU64(out, seq);
  PutU64(out, op_);
  out.push_back(static_cast<char>(kind));
  out.push_back(static_cast<char>(n & 0xff));
  out.push_back(static_cast<char>(n >> 8));
  out.append(what.data(), n);
  out.append(payload.data(), payload.size());
  return out;
}

bool PointToPointCommunicator::Transmit(int dest, int tag, std::string payload) {
  std::lock_guard<std::mutex> lock(transport_mutex());
  if (stopped()) return false;
  Send(dest, tag, std::move(payload));
  return true;
}

bool PointToPointCommunicator::TransmitShared(int dest, int tag,
                                              const std::shared_ptr<const std::string>& payload) {
  std::lock_guard<std::mutex> lock(transport_mutex());
  if (stopped()) return false;
  SendShared(dest, tag, payload);
  return true;
}

std::optional<std::string> PointToPointCommunicator::Poll(int source, int tag) {
  std::lock_guard<std::mutex> lock(transport_mutex());
  if (stopped()) return std::nullopt;
  return TryReceive(source, tag);
}

std::optional<std::string> PointToPointCommunicator::PollFrameOrNotice(int source) {
  if (auto frame = Poll(source, kTag)) return frame;
  return Poll(source, kNoticeTag);
}

void PointToPointCommunicator::AnnouncePoison(const std::vector<int>& dests) noexcept {
  if (!poisoned() || stopped()) return;
  try {
    if (told_.size() != static_cast<size_t>(size()))
      told_.assign(static_cast<size_t>(size()), false);
    std::shared_ptr<const std::string> frame;
    for (int d : dests) {
      if (d == rank() || d < 0 || d >= size() || told_[static_cast<size_t>(d)]) continue;
      if (!frame) {
        // Poisoned by another rank's notice: pass on the failures naming that rank.
        std::string failures = cause_;
        if (failures.empty()) {
          failures = EncodeFailures(
              {{rank(), ErrorCode::kCollective,
                "rank " + std::to_string(rank()) +
                    " cannot take part: its communicator is unusable since an earlier failure (" +
                    poison_reason() + ")",
                false}});
        }
        frame = std::make_shared<const std::string>(
            MakeFrame(0, "poison notice", failures, kNoticeFrame));
      }
      if (!TransmitShared(d, kNoticeTag, frame)) return;
      told_[static_cast<size_t>(d)] = true;
    }
  } catch (...) {
    // Best effort: a rank that misses the notice still fails, at its own deadline.
  }
}

void PointToPointCommunicator::AnnounceOpenFailure() noexcept {
  try {
    std::vector<int> dests = TreeChildren(rank(), 0, size());
    if (rank() != 0) dests.push_back(0);
    AnnouncePoison(dests);
  } catch (...) {
  }
}

void PointToPointCommunicator::SendFrame(int dest, uint64_t seq, std::string_view what,
                                         std::string payload) {
  if (stopped()) ThrowIfPoisoned(what);  // a shutdown forbade any further transport call
  if (!Transmit(dest, kTag, MakeFrame(seq, what, payload, kDataFrame))) ThrowIfPoisoned(what);
}

void PointToPointCommunicator::SendFailure(const std::vector<int>& dests, uint64_t seq,
                                           std::string_view what,
                                           const std::vector<RankFailure>& failures) noexcept {
  // Best effort: the caller is already failing with `failures`; a child that does not get the
  // notice still fails, after its own deadline.
  if (dests.empty() || stopped()) return;
  try {
    auto frame = std::make_shared<const std::string>(
        MakeFrame(seq, what, EncodeFailures(failures), kFailureFrame));
    for (int d : dests) {
      if (!TransmitShared(d, kTag, frame)) return;
    }
  } catch (...) {
  }
}

void PointToPointCommunicator::FailMismatch(int source, std::string_view what,
                                            const std::string& detail) {
  const std::string reason = "rank " + std::to_string(rank()) + " waited for '" +
                             std::string(what) + "' (" + OpName(op_) + ") from rank " +
                             std::to_string(source) + " but received " + detail +
                             ": the ranks are not running the same collective";
  Poison(reason);
  throw CollectiveError(std::string(what), {{source, ErrorCode::kCollective, reason, false}});
}

void PointToPointCommunicator::FailTimeout(std::string_view what, const std::vector<int>& ranks) {
  std::string names;
  for (int r : ranks) names += (names.empty() ? "" : ", ") + std::to_string(r);
  // Inside an operation the usual cause is a rank that never called it (only rank 0 saving,
  // one rank saving while another loads): say so, since no rank can tell it from a stall. (Each
  // failure names its own rank only: thousands of late ranks must not make the error quadratic.)
  const bool in_op = op_ != 0 || adopting_op_;
  const std::string rule =
      "every rank must call dcp::Save and dcp::Load collectively, in the same order";
  std::vector<RankFailure> failures;
  for (int r : ranks) {
    failures.push_back({r, ErrorCode::kTimeout,
                        "rank " + std::to_string(r) + " did not answer within " +
                            std::to_string(timeout().count()) + " ms (seen by rank " +
                            std::to_string(rank()) + ")" +
                            (in_op ? ": it did not join '" + std::string(what) + "'; " + rule +
                                         " (otherwise it stalled or died)"
                                   : std::string()),
                        true});
  }
  Poison("rank(s) " + names + " did not answer '" + std::string(what) + "' within " +
         std::to_string(timeout().count()) + " ms" +
         (in_op ? ": " + rule + "; rank(s) " + names + " did not join" : std::string()));
  throw CollectiveError(std::string(what), std::move(failures));
}

std::optional<size_t> PointToPointCommunicator::Accept(const std::string& bytes, int source,
                                                       uint64_t seq, std::string_view what) {
  Frame f;
  if (!Frame::Parse(bytes, &f)) FailMismatch(source, what, "an unreadable message");
  if (f.kind == kNoticeFrame) {
    // `source` will never take part again (see the header comment): fail now, naming the rank
    // that really failed, whatever collective either side is in.
    std::vector<RankFailure> failures;
    const std::string_view list = std::string_view(bytes).substr(f.payload_at);
    if (!DecodeFailures(list, &failures)) FailMismatch(source, what, "an unreadable poison notice");
    cause_ = std::string(list);
    Poison("rank " + std::to_string(source) + " cannot take part in '" + std::string(what) +
           "': " + failures.front().message);
    throw CollectiveError(std::string(what), std::move(failures));
  }
  if (f.seq < seq) return std::nullopt;  // a late message of an abandoned collective: drop it
  const std::string got =
      "'" + f.what + "' (" + OpName(f.op) + ", collective #" + std::to_string(f.seq) + ")";
  if (f.seq > seq) {
    FailMismatch(source, what, got + " while expecting collective #" + std::to_string(seq));
  }
  if (f.kind == kFailureFrame) {
    // The sender could not take part in this collective (it is this rank's parent in a broadcast
    // tree): fail with its failures, which name the rank that really failed. Its phase may differ
    // from ours (the sender may be the rank that mismatched): the sequence number is what ties
    // the notice to this collective.
    std::vector<RankFailure> failures;
    if (!DecodeFailures(std::string_view(bytes).substr(f.payload_at), &failures)) {
      FailMismatch(source, what, "an unreadable failure notice");
    }
    cause_ = bytes.substr(f.payload_at);
    std::string names;
    for (const auto& x : failures) names += (names.empty() ? "" : ", ") + std::to_string(x.rank);
    Poison("rank " + std::to_string(source) + " reported that '" + std::string(what) +
           "' failed (rank(s) " + names + "): " + failures.front().message);
    throw CollectiveError(std::string(what), std::move(failures));
  }
  if (f.what != what) FailMismatch(source, what, got);
  if (adopting_op_) {
    op_ = f.op;
    adopting_op_ = false;
  } else if (f.op != op_) {
    FailMismatch(source, what, got);
  }
  return f.payload_at;
}

std::string PointToPointCommunicator::ReceiveFrame(int source, uint64_t seq,
                                                   std::chrono::steady_clock::time_point deadline,
                                                   std::string_view what, size_t* payload_at) {
  int round = 0;
  while (true) {
    ThrowIfPoisoned(what);  // e.g. a shutdown stopping this collective from another thread
    const uint64_t mark = MailMark();
    if (auto frame = PollFrameOrNotice(source)) {
      if (auto at = Accept(*frame, source, seq, what)) {
        *payload_at = *at;
        return std::move(*frame);
      }
      continue;
    }
    if (std::chrono::steady_clock::now() >= deadline) FailTimeout(what, {source});
    WaitForMail(mark, round);
  }
}

std::string PointToPointCommunicator::Receive(int source, uint64_t seq,
                                              std::chrono::steady_clock::time_point deadline,
                                              std::string_view what) {
  size_t at = 0;
  std::string frame = ReceiveFrame(source, seq, deadline, what, &at);
  frame.erase(0, at);
  return frame;
}

uint64_t PointToPointCommunicator::OpenOperation(std::string_view name, std::string_view target) {
  const std::string what = std::string(name) + "/open";
  try {
    ThrowIfPoisoned(what);
    if (rank() == 0) {
      op_ = NewOperationId();
      std::string msg;
      PutU64(msg, op_);
      msg.append(target);
      Broadcast(std::move(msg), 0, what);
      return op_;
    }
    op_ = 0;
    adopting_op_ = true;  // the open message carries the id this rank adopts
    std::string msg = Broadcast({}, 0, what);
    adopting_op_ = false;
    if (msg.size() < 8) FailMismatch(0, what, "a malformed operation id");
    CheckTarget(what, std::string_view(msg).substr(8), target);
    return op_;
  } catch (...) {
    adopting_op_ = false;
    // Rank 0 would wait a whole timeout for this rank in the operation's first phase, and this
    // rank's children in the open tree for the message it does not forward: tell them now.
    AnnounceOpenFailure();
    throw;
  }
}

std::vector<std::string> PointToPointCommunicator::Gather(std::string message, int root,
                                                          std::string_view what) {
  const uint64_t seq = NextSeq();
  if (rank() != root) {
    SendFrame(root, seq, what, std::move(message));
    return {};
  }
  ThrowIfPoisoned(what);
  std::vector<std::string> out(size());
  std::vector<bool> have(size(), false);
  out[root] = std::move(message);
  have[root] = true;
  const auto deadline = std::chrono::steady_clock::now() + timeout();
  int missing = size() - 1, round = 0;
  auto take = [&](int r, std::string frame) {
    if (auto at = Accept(frame, r, seq, what)) {
      frame.erase(0, *at);
      out[r] = std::move(frame);
      have[r] = true;
      --missing;
    }
  };
  while (missing > 0) {
    ThrowIfPoisoned(what);
    const uint64_t mark = MailMark();
    bool progress = false;
    for (int r = 0; r < size(); ++r) {
      if (have[r]) continue;
      if (auto frame = Poll(r, kTag)) {
        take(r, std::move(*frame));
        progress = true;
      }
    }
    if (missing == 0) break;
    if (!progress) {
      // Idle: has a rank this one still waits for sent a poison notice? (Only when idle: the
      // notice tag costs one more probe per missing rank.) Every notice present is reported.
      std::vector<RankFailure> failures;
      for (int r = 0; r < size(); ++r) {
        if (have[r]) continue;
        auto frame = Poll(r, kNoticeTag);
        if (!frame) continue;
        Frame f;
        if (!Frame::Parse(*frame, &f) || f.kind != kNoticeFrame) {
          take(r, std::move(*frame));  // a transport that does not keep tags apart
          continue;
        }
        try {
          Accept(*frame, r, seq, what);
        } catch (const CollectiveError& e) {
          for (const auto& x : e.failures()) {
            const bool seen = std::any_of(failures.begin(), failures.end(),
                                          [&](const RankFailure& y) { return y.rank == x.rank; });
            if (!seen) failures.push_back(x);
          }
        }
      }
      if (!failures.empty()) {
        cause_ = EncodeFailures(failures);
        throw CollectiveError(std::string(what), std::move(failures));
      }
      if (missing == 0) break;
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      std::vector<int> late;
      for (int r = 0; r < size(); ++r) {
        if (!have[r]) late.push_back(r);
      }
      FailTimeout(what, late);
    }
    if (!progress) WaitForMail(mark, round);
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
      if (r != root) SendFrame(r, seq, what, std::move(messages[r]));
    }
    return std::move(messages[root]);
  }
  return Receive(root, seq, std::chrono::steady_clock::now() + timeout(), what);
}

std::chrono::milliseconds PointToPointCommunicator::TreeMargin(std::chrono::milliseconds t) {
  return std::min<std::chrono::milliseconds>(t / 10, std::chrono::seconds(1));
}

std::string PointToPointCommunicator::Broadcast(std::string message, int root,
                                                std::string_view what) {
  const uint64_t seq = NextSeq();
  const int n = size();
  if (root < 0 || root >= n) {
    throw InvalidArgumentError("broadcast root " + std::to_string(root) + " is not a rank");
  }
  const std::vector<int> children = TreeChildren(rank(), root, n);
  if (rank() == root) {
    // A poisoned root still sends (a coordinator announcing the verdict of a failed phase);
    // only a stopped one may make no transport call.
    if (stopped()) ThrowIfPoisoned(what);
    // One frame for every child: the frame has nothing rank-specific, and a large broadcast
    // (the metadata) must not cost the root one copy per child.
    auto frame = std::make_shared<const std::string>(MakeFrame(seq, what, message, kDataFrame));
    for (int c : children) {
      if (!TransmitShared(c, kTag, frame)) ThrowIfPoisoned(what);
    }
    return message;
  }
  // Deeper ranks wait a little longer, so that when a rank above fails, its notice (a failure
  // frame, sent when that rank's own deadline passes) arrives before this rank's deadline and
  // the whole subtree names the rank that really failed.
  const int depth = TreeDepth(rank(), root, n);
  const auto deadline =
      std::chrono::steady_clock::now() + timeout() + (depth - 1) * TreeMargin(timeout());
  const int parent = TreeParent(rank(), root, n);
  // A leaf (about half the ranks) forwards nothing: strip the header in place.
  if (children.empty()) return Receive(parent, seq, deadline, what);
  size_t at = 0;
  std::shared_ptr<const std::string> frame;
  try {
    frame = std::make_shared<const std::string>(ReceiveFrame(parent, seq, deadline, what, &at));
  } catch (const CollectiveError& e) {
    // A timeout, a mismatch, a notice from above or this rank's poison: the children cannot get
    // the message through this rank, so tell them why now rather than at their deadline.
    SendFailure(children, seq, what, e.failures());
    throw;
  } catch (...) {
    SendFailure(children, seq, what, {CurrentExceptionAsFailure(rank())});
    throw;
  }
  // Forward root's frame itself, one shared buffer for every child (the frame carries root's
  // operation id, so each child checks it against its own as if it came from root).
  size_t sent = 0;
  try {
    if (stopped()) ThrowIfPoisoned(what);
    for (; sent < children.size(); ++sent) {
      if (!TransmitShared(children[sent], kTag, frame)) ThrowIfPoisoned(what);
    }
  } catch (...) {
    SendFailure({children.begin() + static_cast<std::ptrdiff_t>(sent), children.end()}, seq, what,
                {CurrentExceptionAsFailure(rank())});
    throw;
  }
  return frame->substr(at);
}

std::vector<std::string> PointToPointCommunicator::AllGather(std::string message,
                                                             std::string_view what) {
  auto all = Gather(std::move(message), 0, what);
  std::string packed = Broadcast(rank() == 0 ? PackVector(all) : std::string(), 0, what);
  return UnpackVector(packed, size());
}

void PointToPointCommunicator::Barrier(std::string_view what) { AllGather({}, what); }

// Sends first, then receives: Send never blocks on the receiver, so every rank's sends are out
// before any rank waits, and no pair of ranks can wait on each other.
std::vector<std::string> PointToPointCommunicator::AllToAll(std::vector<std::string> messages,
                                                            std::string_view what) {
  CheckAllToAllMessages(messages.size(), size(), what);
  const uint64_t seq = NextSeq();
  ThrowIfPoisoned(what);
  const int me = rank();
  // Staggered order: rank r sends to r+1 first, so no rank receives every first frame at once.
  for (int k = 1; k < size(); ++k) {
    const int dest = (me + k) % size();
    SendFrame(dest, seq, what, std::move(messages[dest]));
  }
  std::vector<std::string> out(size());
  out[me] = std::move(messages[me]);
  const auto deadline = std::chrono::steady_clock::now() + timeout();
  for (int k = 1; k < size(); ++k) {
    const int source = (me - k + size()) % size();
    out[source] = Receive(source, seq, deadline, what);
  }
  return out;
}

std::string LocalCommunicator::Scatter(std::vector<std::string> m, int, std::string_view) {
  if (m.size() != 1) throw InvalidArgumentError("scatter needs one message per rank");
  return std::move(m[0]);
}

// ---------------------------------------------------------------------------------------------
// InProcessGroup: mailboxes keyed by (source, dest, tag).

struct InProcessGroup::State {
  explicit State(int n) : size(n), arrived(static_cast<size_t>(n), 0) {}
  int size;
  std::mutex mu;
  std::condition_variable cv;  // signalled at every arrival
  std::map<std::tuple<int, int, int>, std::deque<std::string>> mail;
  std::vector<uint64_t> arrived;  // messages sent to each rank so far
  // Duplicate(): the k-th call of every rank gets duplicates[k] (the first to call makes it).
  std::vector<std::shared_ptr<State>> duplicates;
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
  uint64_t MailMark() override;
  void WaitForMail(uint64_t mark, int& round) override;

 public:
  void ExchangeBytes(const std::vector<BulkSend>& sends, const std::vector<BulkReceive>& receives,
                     std::string_view what) override;
  std::unique_ptr<Communicator> Duplicate() override;

 private:
  std::shared_ptr<InProcessGroup::State> state_;
  int rank_;
  size_t duplicates_made_ = 0;
};
}  // namespace

int InProcessCommunicator::size() const { return state_->size; }

void InProcessCommunicator::Send(int dest, int tag, std::string payload) {
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    state_->mail[{rank_, dest, tag}].push_back(std::move(payload));
    ++state_->arrived.at(static_cast<size_t>(dest));
  }
  state_->cv.notify_all();
}

std::unique_ptr<Communicator> InProcessCommunicator::Duplicate() {
  ThrowIfPoisoned("duplicate");
  std::shared_ptr<InProcessGroup::State> group;
  {
    std::lock_guard<std::mutex> lock(state_->mu);
    auto& made = state_->duplicates;
    if (made.size() <= duplicates_made_) {
      made.push_back(std::make_shared<InProcessGroup::State>(state_->size));
    }
    group = made[duplicates_made_++];
  }
  auto copy = std::make_unique<InProcessCommunicator>(std::move(group), rank_);
  copy->set_timeout(timeout());
  return copy;
}

uint64_t InProcessCommunicator::MailMark() {
  std::lock_guard<std::mutex> lock(state_->mu);
  return state_->arrived[static_cast<size_t>(rank_)];
}

// Threads of one process: a waiting rank sleeps until a message for it arrives (polls found
// every message counted by `mark`), and wakes every millisecond for deadlines and poison.
void InProcessCommunicator::WaitForMail(uint64_t mark, int& round) {
  ++round;
  std::unique_lock<std::mutex> lock(state_->mu);
  state_->cv.wait_for(lock, std::chrono::milliseconds(1),
                      [&] { return state_->arrived[static_cast<size_t>(rank_)] != mark; });
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

// Ranks that are threads of one process copy bulk bytes straight from the sender's memory: each
// rank tells each peer where its pieces lie (an AllToAll of addresses), every receiver copies
// them into its own buffers, and a barrier keeps the senders' buffers valid until all receivers
// are done. One copy per byte, into memory the receiver owns and reuses; through AllToAll the
// bytes would be copied into a message, again into a frame, and out again, each into freshly
// allocated (page-faulting) memory.
void InProcessCommunicator::ExchangeBytes(const std::vector<BulkSend>& sends,
                                          const std::vector<BulkReceive>& receives,
                                          std::string_view what) {
  const int n = size();
  std::vector<std::string> where(n);
  for (const auto& s : sends) {
    if (s.peer < 0 || s.peer >= n) {
      throw InvalidArgumentError("bulk exchange '" + std::string(what) + "': no rank " +
                                 std::to_string(s.peer));
    }
    PutU64(where[s.peer], reinterpret_cast<uintptr_t>(s.data));
    PutU64(where[s.peer], s.size);
  }
  for (const auto& r : receives) {
    if (r.peer < 0 || r.peer >= n) {
      throw InvalidArgumentError("bulk exchange '" + std::string(what) + "': no rank " +
                                 std::to_string(r.peer));
    }
  }
  const std::vector<std::string> got = AllToAll(std::move(where), what);
  // Each peer's pieces form one byte stream, cut into this rank's receives from that peer in
  // order (the two sides' cuts may differ, as through AllToAll); a peer that sent more or fewer
  // bytes than expected is named after the barrier, which every rank must still reach.
  std::string mismatch;
  std::vector<size_t> piece(n, 0);
  std::vector<uint64_t> piece_used(n, 0), expected(n, 0), sent(n, 0);
  for (int peer = 0; peer < n; ++peer) {
    for (size_t at = 0; at + 16 <= got[peer].size(); at += 16)
      sent[peer] += GetU64(got[peer].data() + at + 8);
  }
  for (const auto& r : receives) {
    const std::string& list = got[r.peer];
    expected[r.peer] += r.size;
    if (expected[r.peer] > sent[r.peer]) continue;  // reported below
    size_t copied = 0;
    while (copied < r.size) {
      const char* base = reinterpret_cast<const char*>(GetU64(list.data() + 16 * piece[r.peer]));
      const uint64_t len = GetU64(list.data() + 16 * piece[r.peer] + 8);
      const size_t take =
          static_cast<size_t>(std::min<uint64_t>(len - piece_used[r.peer], r.size - copied));
      if (take > 0) std::memcpy(r.data + copied, base + piece_used[r.peer], take);
      copied += take;
      piece_used[r.peer] += take;
      if (piece_used[r.peer] == len) {
        ++piece[r.peer];
        piece_used[r.peer] = 0;
      }
    }
  }
  Barrier(what);
  for (int peer = 0; peer < n; ++peer) {
    if (expected[peer] != sent[peer]) {
      throw CollectiveError(std::string(what), {{peer, ErrorCode::kInternal,
                                                 "rank " + std::to_string(peer) + " sent " +
                                                     std::to_string(sent[peer]) + " bytes, rank " +
                                                     std::to_string(rank()) + " expects " +
                                                     std::to_string(expected[peer]),
                                                 false}});
    }
  }
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
