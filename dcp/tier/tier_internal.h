// The memory tier's private vocabulary, shared by its sources in dcp/tier/ (not installed): the
// messages its ranks exchange (little-endian fields, read back by MessageReader), how a rank's
// failure travels in a vote, and what the nodes report of the steps they hold.
//
// Everything here is called on one thread per rank; errors are dcp Errors (proto/error.h).
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <exception>
#include <map>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "dcp/communicator.h"
#include "dcp/memory_tier.h"
#include "dcp/proto/error.h"

namespace dcp::tier_detail {

// I/O failures of the tier's own files (tmpfs): not retryable, with the errno of the call.
inline IoError TierIoError(const std::string& message) { return IoError(message, false, errno); }

inline double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Little-endian fields for the tier's messages (reports, needs, file records).
inline void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
inline void PutString(std::string& out, std::string_view s) {
  PutU64(out, s.size());
  out.append(s);
}

// Reads what Put* wrote; a peer's message that ends early or claims more than it holds is a
// CorruptionError naming `source` (a bug or a foreign sender, never trusted blindly).
class MessageReader {
 public:
  MessageReader(std::string_view bytes, std::string source)
      : bytes_(bytes), source_(std::move(source)) {}
  bool done() const { return at_ == bytes_.size(); }
  uint64_t U64() {
    Need(8);
    uint64_t v = 0;
    for (int i = 0; i < 8; ++i)
      v |= static_cast<uint64_t>(static_cast<uint8_t>(bytes_[at_ + i])) << (8 * i);
    at_ += 8;
    return v;
  }
  std::string_view Bytes(uint64_t n) {
    Need(n);
    std::string_view v = bytes_.substr(at_, n);
    at_ += n;
    return v;
  }
  std::string String() { return std::string(Bytes(U64())); }

 private:
  void Need(uint64_t n) const {
    if (n > bytes_.size() - at_) {
      throw CorruptionError("memory tier: a malformed message from " + source_ + " (it needs " +
                            std::to_string(n) + " more bytes at " + std::to_string(at_) + " of " +
                            std::to_string(bytes_.size()) + ")");
    }
  }
  std::string_view bytes_;
  std::string source_;
  size_t at_ = 0;
};

// A file name a peer may send: one plain path component, as the dcp layout names its files.
inline bool IsPlainName(std::string_view name) {
  return !name.empty() && name.size() <= 255 && name != "." && name != ".." &&
         name.find('/') == std::string_view::npos && name.find('\0') == std::string_view::npos;
}

// A rank's failure as a vote carries it: "<ErrorCode>:<message>", so that every rank raises
// the category the failing rank met (a refused directory is not an I/O error).
std::string ErrorText(const std::exception& e);
std::string IoText(const std::string& message);
RankFailure DecodeFailure(int rank, const std::string& text);

// Every rank's error text ("" for none) gathered over `comm`; CollectiveError naming `phase`
// and each failing rank when any rank failed.
void Vote(Communicator& comm, const std::string& my_error, std::string_view phase);

// A rank's partners, which keep replicas of its files: the rank at its position (modulo their
// size) on each of the next `replicas` nodes of `nodes` (ranks of each node, ascending).
std::vector<int> PartnersOf(const std::vector<std::vector<int>>& nodes, int node, int rank,
                            int replicas);

// One node's committed copy of a step, as its first rank reports it.
struct StepReport {
  int node = 0;
  int64_t step = 0;
  uint64_t metadata_hash = 0;  // CRC32C of metadata.dcp: nodes holding other bytes differ
  uint64_t referenced = 0;     // data files the metadata names
  std::map<std::string, uint64_t> present;  // referenced files present and long enough: size
};

// One file this rank sends: `name` of the step, to rank `dest`.
struct Transfer {
  int dest = 0;
  std::string name;
};

// Who exchanges file headers with whom in a transfer: the ranks this one sends to (each gets
// a header, maybe empty) and those it receives from.
struct Pairs {
  std::vector<int> to, from;
};

// A step's copies with one metadata: complete when its files, over every node that committed
// it, number what the metadata names.
struct Candidate {
  int64_t step = 0;
  uint64_t hash = 0;
  uint64_t referenced = 0;
  std::map<std::string, std::vector<int>> holders;  // file -> nodes holding it
  std::vector<int> nodes;                           // nodes that committed it
  bool complete() const { return holders.size() == referenced; }
};

// The steps the reports show, one Candidate per (step, metadata), newest first.
std::vector<Candidate> Candidates(const std::vector<StepReport>& reports);

}  // namespace dcp::tier_detail

namespace dcp {

// Marks a commit, drain or restore under way on this rank, from Enter() to its destruction
// (MemoryTier::SettleForPreemption waits for none to be).
class MemoryTier::BusyScope {
 public:
  explicit BusyScope(MemoryTier& tier) : tier_(tier) {}
  BusyScope(const BusyScope&) = delete;
  BusyScope& operator=(const BusyScope&) = delete;
  void Enter() {
    if (entered_) return;
    std::lock_guard<std::mutex> lock(tier_.mu_);
    ++tier_.busy_;
    entered_ = true;
  }
  ~BusyScope() {
    if (!entered_) return;
    std::lock_guard<std::mutex> lock(tier_.mu_);
    if (--tier_.busy_ == 0) tier_.settled_.notify_all();
  }

 private:
  MemoryTier& tier_;
  bool entered_ = false;
};

}  // namespace dcp
