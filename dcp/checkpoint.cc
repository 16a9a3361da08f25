#include "dcp/checkpoint.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <string_view>
#include <typeinfo>

#include "dcp/planner/compact_plan.h"
#include "dcp/planner/default_planner.h"
#include "dcp/planner/read_sharing.h"
#include "dcp/proto/checksum.h"
#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"
#include "dcp/proto/executor.h"
#include "dcp/proto/schema/codec.h"
#include "dcp/storage/checkpoint/file_index.h"
#include "dcp/storage/format/layout.h"
#include "dcp/storage/registry.h"
#include "dcp_version.h"
#include "schema/dcp.pb.h"  // generated from proto/schema/dcp.proto

namespace dcp {

namespace {

// The first byte of a protocol message says what follows; each byte has one meaning.
enum class Tag : char {
  kCacheHit = 'H',        // plan cache: every rank's cached plan stands; its files follow
  kCacheMiss = 'M',       // plan cache: plan anew
  kCompactPlan = 'C',     // a compact save plan (planner/compact_plan.h), or the reply to one
  kFullPlan = 'P',        // a save plan item by item, or the reply to one
  kRetryFull = 'F',       // coordinator: the ranks did not agree; plan again, in full
  kRetryDeclared = 'D',   // coordinator: plan compactly again, every declaration in full
  kBatchFailed = 'X',     // read-once: the batch's reader failed; an ErrorReport follows
  kRequestSummary = 'R',  // load: a rank's request summary (planner/read_sharing.h)
  kShareSchedule = 'S',   // load: the coordinator's read-once schedule, the same for every rank
};
std::string TagString(Tag tag) { return std::string(1, static_cast<char>(tag)); }
bool HasTag(std::string_view message, Tag tag) {
  return !message.empty() && message[0] == static_cast<char>(tag);
}

// Every rank knows the save's operation id, so the save id derives from it.
std::string SaveIdOf(uint64_t operation_id) {
  char buf[17];
  snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(operation_id));
  return buf;
}

std::string NewSaveId() {
  std::random_device rd;
  std::mt19937_64 rng(
      (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  char buf[17];
  snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return buf;
}

pb::ErrorReport ToReport(const RankFailure& f) {
  pb::ErrorReport e;
  e.set_rank(f.rank);
  e.set_code(static_cast<int>(f.code));
  e.set_message(f.message);
  e.set_retryable(f.retryable);
  return e;
}

RankFailure FromReport(const pb::ErrorReport& e) {
  return {e.rank(), static_cast<ErrorCode>(e.code()), e.message(), e.retryable()};
}

using LocalStep = std::function<std::string()>;
using GlobalStep = std::function<std::vector<std::string>(std::vector<std::string>)>;

// A phase's failure on every rank: poisons the communicator when any rank timed out, since the
// ranks' collective sequences may now differ (docs/PROTOCOL.md, "Failure semantics").
[[noreturn]] void FailPhase(Communicator& comm, const std::string& phase,
                            std::vector<RankFailure> failures, Outcome outcome) {
  CollectiveError error(phase, std::move(failures), outcome);
  if (error.timed_out()) comm.Poison(error.what());
  throw error;
}

// One phase of the protocol: every rank runs `local`; the coordinator gathers the outcomes and,
// if all succeeded, runs `global` to produce one reply per rank; the replies (or the complete
// list of failures) are scattered back. Returns this rank's reply, or throws the same
// CollectiveError on every rank.
//
// `decides_commit` marks the phase whose global step commits a save (save/write). Its verdict
// defines the save's outcome: a rank that reported success and then cannot receive the verdict
// throws with Outcome::kUnknown (it must keep its data), and a global step that failed after
// the commit (CommitError) makes every rank throw with that outcome.
// `same_reply`: the global step returns one reply for every rank, which is broadcast from one
// buffer instead of scattered as one copy per rank (the metadata of a large job is big).
std::vector<std::string> CoordinatePhase(Communicator& comm, const std::string& phase,
                                         const pb::PhaseMessage& mine, const GlobalStep& global,
                                         bool same_reply);
std::string ReceiveVerdict(Communicator& comm, const std::string& phase,
                           std::vector<std::string> replies, bool unknown_if_lost, bool same_reply);

std::string RunPhase(Communicator& comm, const std::string& phase, const LocalStep& local,
                     const GlobalStep& global, bool decides_commit = false,
                     bool same_reply = false) {
  const int rank = comm.rank();
  pb::PhaseMessage mine;
  try {
    mine.set_payload(local());
  } catch (...) {
    *mine.mutable_error() = ToReport(CurrentExceptionAsFailure(rank));
  }
  // Having reported its writes, a rank that misses the verdict cannot tell whether rank 0
  // committed them.
  const bool unknown_if_lost = decides_commit && !mine.has_error();
  std::vector<std::string> replies;
  if (rank != 0) {
    try {
      comm.Gather(mine.SerializeAsString(), 0, phase);  // a send: never blocks
    } catch (const CollectiveError& e) {
      throw CollectiveError(e.phase(), e.failures());  // e.g. poisoned: nothing was reported
    }
  } else {
    replies = CoordinatePhase(comm, phase, mine, global, same_reply);
  }
  return ReceiveVerdict(comm, phase, std::move(replies), unknown_if_lost, same_reply);
}

// Rank 0: gather every rank's outcome, run the global step when all succeeded, and encode the
// replies: the global step's, or the complete list of failures.
std::vector<std::string> CoordinatePhase(Communicator& comm, const std::string& phase,
                                         const pb::PhaseMessage& mine, const GlobalStep& global,
                                         bool same_reply) {
  const int size = comm.size();
  std::vector<RankFailure> failures;
  std::vector<std::string> payloads(size);
  Outcome outcome = Outcome::kFailed;
  try {
    auto gathered = comm.Gather(mine.SerializeAsString(), 0, phase);
    for (int r = 0; r < size; ++r) {
      pb::PhaseMessage m;
      if (!m.ParseFromString(gathered[r])) {
        failures.push_back({r, ErrorCode::kInternal, "unreadable phase message", false});
      } else if (m.has_error()) {
        failures.push_back(FromReport(m.error()));
      } else {
        payloads[r] = std::move(*m.mutable_payload());
      }
    }
  } catch (const CollectiveError& e) {  // some rank did not answer in time, or a mismatch
    failures = e.failures();
  }
  if (failures.empty()) {
    try {
      payloads = global(std::move(payloads));
      const size_t expected = same_reply ? 1 : static_cast<size_t>(size);
      if (payloads.size() != expected) {
        throw InternalError("global step of " + phase + " returned " +
                            std::to_string(payloads.size()) + " replies, expected " +
                            std::to_string(expected));
      }
    } catch (const CommitError& e) {
      failures.push_back(CurrentExceptionAsFailure(0));
      outcome = e.outcome();
    } catch (...) {
      failures.push_back(CurrentExceptionAsFailure(0));
    }
  }
  std::vector<std::string> replies(same_reply ? 1 : size);
  for (size_t r = 0; r < replies.size(); ++r) {
    pb::PhaseOutcome out;
    out.set_phase(phase);
    if (failures.empty()) {
      out.set_payload(std::move(payloads[r]));
    } else {
      for (const auto& f : failures) *out.add_failures() = ToReport(f);
      out.set_outcome(static_cast<int>(outcome));
    }
    replies[r] = out.SerializeAsString();
  }
  return replies;
}

// Every rank: deliver rank 0's replies (rank 0 sends them) and turn this rank's into its payload
// or the phase's CollectiveError.
std::string ReceiveVerdict(Communicator& comm, const std::string& phase,
                           std::vector<std::string> replies, bool unknown_if_lost,
                           bool same_reply) {
  auto deliver = [&](std::vector<std::string> r) {
    return same_reply ? comm.Broadcast(r.empty() ? std::string() : std::move(r[0]), 0, phase)
                      : comm.Scatter(std::move(r), 0, phase);
  };
  const Outcome if_lost = unknown_if_lost ? Outcome::kUnknown : Outcome::kFailed;
  std::string reply;
  if (comm.rank() == 0) {
    // Sends only: a communicator poisoned by this phase's gather still tells the peers.
    reply = deliver(std::move(replies));
  } else {
    // Rank 0 may itself wait up to one timeout for a slow peer before answering, so wait for
    // it longer than that: then a stalled peer is reported as such, not as rank 0.
    const auto saved = comm.timeout();
    comm.set_timeout(saved * 2 + std::chrono::seconds(5));
    try {
      reply = deliver({});
    } catch (const CollectiveError& e) {
      comm.set_timeout(saved);
      FailPhase(comm, e.phase(), e.failures(), if_lost);
    } catch (...) {
      comm.set_timeout(saved);
      throw;
    }
    comm.set_timeout(saved);
  }
  pb::PhaseOutcome out;
  if (!out.ParseFromString(reply)) {
    FailPhase(comm, phase, {{0, ErrorCode::kInternal, "unreadable reply from rank 0", false}},
              if_lost);
  }
  if (out.failures_size() > 0) {
    std::vector<RankFailure> failures;
    for (const auto& f : out.failures()) failures.push_back(FromReport(f));
    FailPhase(comm, phase, std::move(failures), static_cast<Outcome>(out.outcome()));
  }
  return std::move(*out.mutable_payload());
}

// Plan caching (SavePlanCache): a 64-bit hash of an encoded local plan (two CRC32Cs with
// different seeds and the length: equal plans hash equal on every rank, and a changed plan is
// caught with overwhelming probability; a false hit would still fail the save's validation
// rather than write wrongly placed data).
uint64_t PlanHash(std::string_view plan) {
  const uint64_t a = Crc32c(0, plan.data(), plan.size());
  const uint64_t b = Crc32c(0x9E3779B9u, plan.data(), plan.size());
  return ((a << 32) | b) ^ (static_cast<uint64_t>(plan.size()) * 0x9E3779B97F4A7C15ull);
}

std::string PackId(uint64_t v) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
  return s;
}

uint64_t UnpackId(std::string_view s) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(s[static_cast<size_t>(i)]);
  return v;
}

struct CacheProbe {
  bool usable = false;
  uint64_t hash = 0, plan_id = 0;
};

std::string PackCacheProbe(bool usable, uint64_t hash, uint64_t plan_id) {
  return std::string(1, usable ? 'U' : '-') + PackId(hash) + PackId(plan_id);
}

CacheProbe UnpackCacheProbe(std::string_view s) {
  if (s.size() != 17) throw InternalError("malformed plan cache probe");
  return {s[0] == 'U', UnpackId(s.substr(1, 8)), UnpackId(s.substr(9, 8))};
}

// Opens an operation on the communicator for the scope of one Save or Load; the id tags every
// message (see Communicator::OpenOperation).
class OperationScope {
 public:
  OperationScope(Communicator& comm, std::string_view name, std::string_view target)
      : comm_(comm), id_(comm.OpenOperation(name, target)) {}
  uint64_t id() const { return id_; }
  ~OperationScope() { comm_.EndOperation(); }
  OperationScope(const OperationScope&) = delete;
  OperationScope& operator=(const OperationScope&) = delete;

 private:
  Communicator& comm_;
  uint64_t id_;
};

// After an unknown verdict: the save is committed when the metadata in place names this save
// (its id is on every rank), which a rank sharing the store can read itself.
std::optional<Metadata> CommittedMetadata(const StorageWriter& writer, const std::string& save_id,
                                          const StorageOptions& options) noexcept {
  if (save_id.empty()) return std::nullopt;
  try {
    Metadata md = ReadMetadata(writer.uri(), options);
    if (md.save_id == save_id) return md;
  } catch (...) {
    // Not readable from this rank (a store it does not share, no metadata): still unknown.
  }
  return std::nullopt;
}

// ---------------------------------------------------------------------------------------------
// Read-once on load (planner/read_sharing.h): the root of a batch reads its items through a
// CapturingPlanner, which copies each one's bytes out as it is committed; one Broadcast per batch
// delivers them; receivers place them as a read would have (ResolveTensor, copy, CommitTensor).

// One read item within a rank's plan.
// Version 2: every chunk and byte entry of `md` records the rank that writes it, and every item
// of the global plans its chunk ordinal (the data files' indexes are keyed by it). The default
// planner records both as it merges; for other planners they are read off the global plans
// here. Entries nobody writes are an InternalError (ValidateMetadata would refuse them too).
void AssignWriters(Metadata& md, std::vector<SavePlan>& plans) {
  bool complete = true;
  for (const auto& [fqn, entry] : md.entries) {
    if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
      complete = complete && (t->regular || t->chunk_writers.size() == t->chunks.size());
    } else {
      complete = complete && std::get<BytesMetadata>(entry).writer >= 0;
    }
  }
  if (complete) return;
  for (auto& [fqn, entry] : md.entries) {
    if (auto* t = std::get_if<TensorMetadata>(&entry); t && !t->regular) {
      t->chunk_writers.assign(t->chunks.size(), -1);
    }
  }
  for (size_t r = 0; r < plans.size(); ++r) {
    for (WriteItem& item : plans[r].items) {
      auto e = md.entries.find(item.index.fqn);
      if (e == md.entries.end()) {
        throw InternalError("global plan of rank " + std::to_string(r) + " writes " +
                            item.index.ToString() + ", which the metadata does not list");
      }
      if (auto* t = std::get_if<TensorMetadata>(&e->second)) {
        const auto k = ChunkOrdinal(*t, item.index.offset, item.index.index);
        if (!k) {
          throw InternalError("global plan of rank " + std::to_string(r) + " writes " +
                              item.index.ToString() + ", which is no chunk of its tensor");
        }
        item.index.index = static_cast<int32_t>(*k);
        if (!t->regular) t->chunk_writers[*k] = static_cast<int32_t>(r);
      } else {
        item.index.index = 0;
        std::get<BytesMetadata>(e->second).writer = static_cast<int32_t>(r);
        std::get<BytesMetadata>(e->second).size = item.size_bytes;
      }
    }
  }
  for (const auto& [fqn, entry] : md.entries) {
    const auto* t = std::get_if<TensorMetadata>(&entry);
    const bool unwritten = t ? std::find(t->chunk_writers.begin(), t->chunk_writers.end(), -1) !=
                                   t->chunk_writers.end()
                             : std::get<BytesMetadata>(entry).writer < 0;
    if (unwritten) {
      throw InternalError("no rank's global plan writes (all of) '" + fqn + "'");
    }
  }
}

// Version 2: the items rank r writes: its global plan's (the residual ones, in compact
// planning) plus chunk r of every rule that has one.
std::vector<uint64_t> ExpectedItemsPerRank(const Metadata& md, const std::vector<SavePlan>& plans) {
  std::vector<int64_t> starts(plans.size() + 1, 0);
  for (const auto& [fqn, entry] : md.entries) {
    const auto* t = std::get_if<TensorMetadata>(&entry);
    if (t == nullptr || !t->regular) continue;
    starts[0] += 1;
    starts[std::min(ChunkCount(*t), plans.size())] -= 1;
  }
  std::vector<uint64_t> out(plans.size());
  int64_t running = 0;
  for (size_t r = 0; r < plans.size(); ++r) {
    running += starts[r];
    out[r] = plans[r].items.size() + static_cast<uint64_t>(running);
  }
  return out;
}

std::string ItemIdentity(const ReadItem& item) {
  std::string id = item.dest_index.ToString() + "@";
  for (int64_t v : item.dest_offsets) id += std::to_string(v) + ",";
  id += "<" + item.storage_index.ToString() + "@";
  for (int64_t v : item.storage_offsets) id += std::to_string(v) + ",";
  id += "+";
  for (int64_t v : item.lengths) id += std::to_string(v) + ",";
  return id;
}

class CapturingPlanner : public LoadPlanner {
 public:
  explicit CapturingPlanner(LoadPlanner& inner) : inner_(inner) {}

  /// Copy `item`'s bytes out when it is read, as segment `segment` of batch `batch`.
  void Expect(const ReadItem& item, size_t batch, size_t segment) {
    std::lock_guard<std::mutex> lock(mu_);
    expected_[ItemIdentity(item)] = {batch, segment};
  }
  /// The message of batch `batch`: "K", then per segment its u64 length and bytes. Releases them.
  std::string Pack(size_t batch, size_t segments) {
    std::lock_guard<std::mutex> lock(mu_);
    uint64_t total = 1;
    for (size_t k = 0; k < segments; ++k) {
      auto it = captured_.find({batch, k});
      if (it == captured_.end()) {
        throw InternalError("read-once: item " + std::to_string(k) + " of batch " +
                            std::to_string(batch) + " was not read");
      }
      total += 8 + it->second.size();
    }
    std::string msg;
    msg.reserve(total);
    msg.push_back('K');
    for (size_t k = 0; k < segments; ++k) {
      auto it = captured_.find({batch, k});
      const uint64_t n = it->second.size();
      msg.append(reinterpret_cast<const char*>(&n), 8);
      msg.append(it->second);
      captured_.erase(it);
    }
    return msg;
  }

  void SetUp(StateDict& sd, const Metadata& md, const PlannerContext& ctx) override {
    inner_.SetUp(sd, md, ctx);
  }
  LoadPlan CreateLocalPlan() override { return inner_.CreateLocalPlan(); }
  std::vector<LoadPlan> CreateGlobalPlan(std::vector<LoadPlan> plans) override {
    return inner_.CreateGlobalPlan(std::move(plans));
  }
  LoadPlan FinishPlan(LoadPlan plan) override { return inner_.FinishPlan(std::move(plan)); }
  void LoadBytes(const ReadItem& item, std::string bytes) override {
    if (auto where = Expected(item)) Store(*where, bytes);
    inner_.LoadBytes(item, std::move(bytes));
  }
  TensorView ResolveTensor(const ReadItem& item) override { return inner_.ResolveTensor(item); }
  void CommitTensor(const ReadItem& item, const TensorView& tensor) override {
    if (auto where = Expected(item)) {
      std::string bytes;
      bytes.reserve(tensor.nbytes());
      StreamToHost(tensor, kDevicePieceBytes, [&](const void* data, size_t n) {
        bytes.append(static_cast<const char*>(data), n);
      });
      Store(*where, std::move(bytes));
    }
    inner_.CommitTensor(item, tensor);
  }

 private:
  std::optional<std::pair<size_t, size_t>> Expected(const ReadItem& item) {
    std::lock_guard<std::mutex> lock(mu_);
    if (expected_.empty()) return std::nullopt;  // most commits: no identity string to build
    auto it = expected_.find(ItemIdentity(item));
    if (it == expected_.end()) return std::nullopt;
    return it->second;
  }
  void Store(std::pair<size_t, size_t> where, std::string bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    captured_[where] = std::move(bytes);
  }

  LoadPlanner& inner_;
  std::mutex mu_;  // storage reads commit from several threads
  std::map<std::string, std::pair<size_t, size_t>> expected_;
  std::map<std::pair<size_t, size_t>, std::string> captured_;
};

// A root that could not read a batch sends kBatchFailed and its error instead, so that its
// receivers fail at once with the cause (and every rank still takes part in every broadcast).
std::string FailedBatchMessage(int rank) {
  return TagString(Tag::kBatchFailed) +
         ToReport(CurrentExceptionAsFailure(rank)).SerializeAsString();
}

// Place a received batch into this rank's destinations.
void ReceiveBatch(const std::string& msg, const SharedReadBatch& batch, const LoadPlan& plan,
                  LoadPlanner& planner, LoadStats& stats) {
  const std::string from = "rank " + std::to_string(batch.root);
  if (HasTag(msg, Tag::kBatchFailed)) {
    pb::ErrorReport e;
    if (!e.ParseFromArray(msg.data() + 1, static_cast<int>(msg.size() - 1))) {
      throw CorruptionError("read-once: unreadable failure report from " + from);
    }
    ThrowError(static_cast<ErrorCode>(e.code()),
               from + " could not read the items it reads for this rank: " + e.message(),
               e.retryable());
  }
  if (msg.empty() || msg[0] != 'K') {
    throw CorruptionError("read-once: malformed batch message from " + from);
  }
  std::vector<std::string_view> segments;
  for (size_t pos = 1; pos < msg.size();) {
    uint64_t n = 0;
    if (msg.size() - pos < 8) throw CorruptionError("read-once: truncated batch from " + from);
    std::memcpy(&n, msg.data() + pos, 8);
    pos += 8;
    if (msg.size() - pos < n) throw CorruptionError("read-once: truncated batch from " + from);
    segments.emplace_back(msg.data() + pos, n);
    pos += n;
  }
  for (size_t k = 0; k < batch.recv_items.size(); ++k) {
    const auto seg = static_cast<size_t>(batch.recv_segments[k]);
    const ReadItem& item = plan.items[batch.recv_items[k]];
    if (seg >= segments.size()) {
      throw CorruptionError("read-once: " + from + " sent " + std::to_string(segments.size()) +
                            " items, " + item.dest_index.ToString() + " is number " +
                            std::to_string(seg));
    }
    const std::string_view bytes = segments[seg];
    if (item.type == ReadItemType::kBytes) {
      planner.LoadBytes(item, std::string(bytes));
    } else {
      TensorView dst = planner.ResolveTensor(item);
      const uint64_t want =
          static_cast<uint64_t>(NumElements(item.lengths)) * ElementSize(dst.dtype);
      if (bytes.size() != want) {
        throw CorruptionError("read-once: " + from + " sent " + std::to_string(bytes.size()) +
                              " bytes for " + item.dest_index.ToString() + ", which takes " +
                              std::to_string(want));
      }
      const TensorView src =
          TensorView::FromContiguous(const_cast<char*>(bytes.data()), dst.dtype, item.lengths);
      CopyTensor(dst, src);
      planner.CommitTensor(item, dst);
    }
    stats.items_received += 1;
    stats.bytes_received += bytes.size();
  }
}

// This rank's part of the "load/read" phase when some reads are shared: read its own items (and,
// within the memory budget, those it reads for others), then take part in every batch's
// broadcast in order. An error does not stop the broadcasts (the others would wait for this
// rank); the first one is rethrown at the end.
void ReadWithSharing(const LoadPlan& plan, const Metadata& md,
                     const std::vector<SharedReadBatch>& batches, StorageReader& reader,
                     LoadPlanner& planner, Communicator& comm, uint64_t budget, LoadStats& stats) {
  const int rank = comm.rank();
  std::vector<char> skip(plan.items.size(), 0);  // received, or read for others later
  std::vector<bool> early(batches.size(), false);
  CapturingPlanner capture(planner);
  uint64_t held = 0;
  for (size_t b = 0; b < batches.size(); ++b) {
    for (int32_t i : batches[b].recv_items) skip[i] = 1;
    if (batches[b].root != rank) continue;
    early[b] = held + batches[b].bytes <= budget;
    if (early[b]) held += batches[b].bytes;
    for (size_t k = 0; k < batches[b].send_items.size(); ++k) {
      const int32_t i = batches[b].send_items[k];
      if (early[b]) {
        capture.Expect(plan.items[i], b, k);
      } else {
        skip[i] = 1;
      }
    }
  }
  auto subplan = [&](auto keep) {
    LoadPlan p;
    p.storage_data = plan.storage_data;
    p.planner_data = plan.planner_data;
    for (size_t i = 0; i < plan.items.size(); ++i) {
      if (keep(i)) p.items.push_back(plan.items[i]);
    }
    return p;
  };
  // Batches name plain items only; spans are expanded a bounded part at a time.
  auto read = [&](const LoadPlan& p) {
    ForEachExpandedPart(p, md, kMaxExpandedItems,
                        [&](const LoadPlan& part) { reader.ReadData(part, capture).get(); });
  };
  std::exception_ptr error;
  try {
    read(subplan([&](size_t i) { return skip[i] == 0; }));
  } catch (...) {
    error = std::current_exception();
  }
  for (size_t b = 0; b < batches.size(); ++b) {
    const SharedReadBatch& batch = batches[b];
    std::string msg;
    if (batch.root == rank) {
      try {
        if (error) std::rethrow_exception(error);
        if (!early[b]) {
          std::vector<char> mine(plan.items.size(), 0);
          for (size_t k = 0; k < batch.send_items.size(); ++k) {
            mine[batch.send_items[k]] = 1;
            capture.Expect(plan.items[batch.send_items[k]], b, k);
          }
          read(subplan([&](size_t i) { return mine[i] != 0; }));
        }
        msg = capture.Pack(b, batch.send_items.size());
        stats.bytes_sent += msg.size() - 1 - 8 * batch.send_items.size();
      } catch (...) {
        if (!error) error = std::current_exception();
        msg = FailedBatchMessage(rank);
      }
    }
    msg = comm.Broadcast(std::move(msg), batch.root, "load/share");
    stats.shared_batches += 1;
    if (batch.root != rank && !batch.recv_items.empty()) {
      try {
        ReceiveBatch(msg, batch, plan, planner, stats);
      } catch (...) {
        if (!error) error = std::current_exception();
      }
    }
  }
  if (error) std::rethrow_exception(error);
}

}  // namespace

const char* LibraryVersion() { return DCP_VERSION_STRING; }

void SavePlanCache::Clear() { entry = Entry{}; }

namespace {

// The writer's exchange among ranks (StorageContext::exchange) as one Gather per destination:
// a non-root's Gather only sends, so every rank posts its messages, then collects its own at its
// turn. Runs inside the save's operation, so each message carries its id and phase.
class CommunicatorExchange : public RankExchange {
 public:
  explicit CommunicatorExchange(Communicator& comm) : comm_(comm) {}
  std::vector<std::string> AllToAll(std::vector<std::string> to, std::string_view what) override {
    const int n = comm_.size();
    if (to.size() != static_cast<size_t>(n)) {
      throw InternalError("exchange " + std::string(what) + ": " + std::to_string(to.size()) +
                          " messages for " + std::to_string(n) + " ranks");
    }
    std::vector<std::string> got;
    for (int r = 0; r < n; ++r) {
      std::vector<std::string> in = comm_.Gather(std::move(to[static_cast<size_t>(r)]), r, what);
      if (r == comm_.rank()) got = std::move(in);
    }
    return got;
  }

 private:
  Communicator& comm_;
};

// One rank's part of one save: the state machine of docs/PROTOCOL.md as named steps.
//   Run:  open the operation -> TryPlanCache -> Plan -> WriteAndCommit
// Every local step runs inside a phase (RunPhase), so an error on one rank is everyone's; only
// a verdict of kFailed lets a rank remove what it wrote (Run's handlers).
class SaveOperation {
 public:
  SaveOperation(const StateDict& state_dict, StorageWriter& writer, Communicator& comm,
                const SaveOptions& options)
      : state_dict_(state_dict),
        writer_(writer),
        comm_(comm),
        options_(options),
        rank_(comm.rank()),
        size_(comm.size()),
        planner_(options.planner ? *options.planner : default_planner_),
        planner_type_(typeid(planner_).name()),
        cache_(options.plan_cache.get()),
        exchange_(comm),
        sctx_{rank_, size_, rank_ == 0, std::string(), &exchange_} {}

  SaveResult Run() {
    try {
      // The step is part of what every rank must open alike (SaveOptions::step).
      OperationScope op(comm_, "save",
                        options_.step
                            ? writer_.uri() + " (step " + std::to_string(*options_.step) + ")"
                            : writer_.uri());
      sctx_.save_id = SaveIdOf(op.id());
      if (!(cache_ && TryPlanCache())) Plan();
      WriteAndCommit();
      // The verdict is out: only now the coordinator's post-commit housekeeping.
      if (committed_) writer_.AfterCommitDelivered();
    } catch (const CollectiveError& e) {
      if (committed_) {  // the coordinator could not deliver a verdict of a committed save
        writer_.AfterCommitDelivered();
        throw CollectiveError(e.phase(), e.failures(), Outcome::kCommitted);
      }
      // A rank that reported its writes and missed the verdict settles it from the commit
      // record where it shares the store.
      if (e.outcome() == Outcome::kUnknown) {
        if (auto md = CommittedMetadata(writer_, sctx_.save_id, options_.storage)) {
          return SaveResult{std::move(*md), stats_};
        }
      }
      // Only a save known not to be committed may remove data (docs/PROTOCOL.md).
      if (e.outcome() == Outcome::kFailed) writer_.Abort();
      throw;
    } catch (...) {
      if (committed_) {
        writer_.AfterCommitDelivered();
        throw;
      }
      writer_.Abort();
      throw;
    }
    // Committed: whatever fails from here on removes nothing.
    return SaveResult{DecodeMetadata(md_bytes_, writer_.uri()), stats_};
  }

 private:
  // The forms a plan exchange can take: compact with the declarations of short tensors hashed;
  // compact with every declaration in full (after kRetryDeclared); item by item (kRetryFull,
  // or when compact planning does not apply).
  enum class PlanForm { kCompactHashed, kCompact, kFull };

  // This rank's local plan, made once (the plan cache, compact and full planning all start
  // from it).
  const SavePlan& LocalPlan() {
    if (!have_local_) {
      writer_.SetUp(sctx_);
      planner_.SetUp(state_dict_, PlannerContext{rank_, size_, rank_ == 0});
      my_full_ = writer_.PrepareLocalPlan(planner_.CreateLocalPlan());
      have_local_ = true;
    }
    return my_full_;
  }

  // Plan caching: every rank hashes its local plan; rank 0 says whether all match the cached
  // global plan. On a hit each rank gets only its data file names, and this returns true.
  bool TryPlanCache() {
    std::vector<uint64_t> hashes;  // rank 0: every rank's, for the cache on a miss
    const std::string verdict = RunPhase(
        comm_, "save/plan-cache",
        [&] {
          my_local_ = EncodeSavePlan(LocalPlan());
          my_hash_ = PlanHash(my_local_);
          const SavePlanCache::Entry& e = cache_->entry;
          const bool usable = e.valid && e.world_size == size_ && e.planner == planner_type_;
          std::string probe = PackCacheProbe(usable, my_hash_, usable ? e.plan_id : 0);
          stats_.plan_bytes_sent += probe.size();
          return probe;
        },
        [&](std::vector<std::string> probes) { return JudgeCacheProbes(probes, hashes); });
    if (HasTag(verdict, Tag::kCacheHit)) {
      central_ = cache_->entry.central;
      central_.storage_data = verdict.substr(1);
      stats_.cached_plan = true;
      ++cache_->hits_;
      return true;
    }
    ++cache_->misses_;
    cache_->entry.valid = false;  // refreshed by Plan once the full plan is known
    if (rank_ == 0) cache_->entry.hashes = std::move(hashes);
    return false;
  }

  // Coordinator: a hit when every rank's probe matches the cache; then the writer names this
  // save's files and each rank's reply carries them.
  std::vector<std::string> JudgeCacheProbes(const std::vector<std::string>& probes,
                                            std::vector<uint64_t>& hashes) {
    SavePlanCache::Entry& e = cache_->entry;
    bool hit = e.valid && e.hashes.size() == static_cast<size_t>(size_) &&
               e.global_plans.size() == static_cast<size_t>(size_);
    for (int r = 0; r < size_; ++r) {
      const CacheProbe p = UnpackCacheProbe(probes[static_cast<size_t>(r)]);
      hashes.push_back(p.hash);
      hit = hit && p.usable && p.hash == e.hashes[static_cast<size_t>(r)] && p.plan_id == e.plan_id;
    }
    std::vector<std::string> out(static_cast<size_t>(size_), TagString(Tag::kCacheMiss));
    if (!hit) return out;
    // The cached plans are moved through the writer, not copied (they are every rank's plan);
    // what comes back is cached again, so a writer's PrepareGlobalPlan must accept its own
    // output (it only sets storage).
    e.global_plans = writer_.PrepareGlobalPlan(std::move(e.global_plans));
    if (e.global_plans.size() != static_cast<size_t>(size_)) {
      e.valid = false;
      throw InternalError("the storage writer returned " + std::to_string(e.global_plans.size()) +
                          " plans for " + std::to_string(size_) + " ranks");
    }
    global_md_ = e.skeleton;
    expected_items_ = ExpectedItemsPerRank(global_md_, e.global_plans);
    for (int r = 0; r < size_; ++r) {
      out[static_cast<size_t>(r)] =
          TagString(Tag::kCacheHit) + e.global_plans[static_cast<size_t>(r)].storage_data;
    }
    return out;
  }

  // The plan exchange. Every plan message starts with its form: kCompactPlan (planner/
  // compact_plan.h: regularly sharded tensors described once, not once per rank) or kFullPlan.
  // A rank sends a compact plan when it plans with the default planner and its writer only
  // names files. The coordinator merges compactly when every rank sent one, in full when none
  // did, and otherwise (ranks that differ, or regular shards the ranks do not all describe
  // alike) answers kRetryFull: every rank then plans again in full.
  void Plan() {
    const bool can_compact =
        options_.planner == nullptr && size_ > 1 && writer_.GlobalPlanOnlyNamesFiles();
    PlanForm form = can_compact ? PlanForm::kCompactHashed : PlanForm::kFull;
    for (int attempt = 0;; ++attempt) {
      if (attempt > 2) throw InternalError("save planning did not converge");
      const std::string reply = RunPhase(
          comm_,
          attempt == 0              ? "save/plan"
          : form == PlanForm::kFull ? "save/plan-full"
                                    : "save/plan-declared",
          [&] { return PlanMessage(form); },
          [&](std::vector<std::string> locals) { return MergePlans(locals); });
      if (AcceptPlanReply(reply, form)) return;
    }
  }

  // This rank's plan message in `form`.
  std::string PlanMessage(PlanForm form) {
    std::string msg;
    if (form != PlanForm::kFull) {
      split_ = SplitRegularShards(LocalPlan(), rank_, size_, form == PlanForm::kCompactHashed);
      msg = TagString(Tag::kCompactPlan) + EncodeCompactSavePlan(split_);
    } else {
      msg = TagString(Tag::kFullPlan) + (cache_ ? my_local_ : EncodeSavePlan(LocalPlan()));
    }
    stats_.plan_bytes_sent += msg.size();
    ++stats_.plan_rounds;
    return msg;
  }

  // Coordinator: merge every rank's plan message (see Plan for the forms).
  std::vector<std::string> MergePlans(std::vector<std::string>& locals) {
    size_t compact_ranks = 0;
    for (const auto& m : locals) {
      if (!HasTag(m, Tag::kCompactPlan) && !HasTag(m, Tag::kFullPlan)) {
        throw InternalError("a save plan message of unknown form");
      }
      compact_ranks += HasTag(m, Tag::kCompactPlan);
    }
    if (compact_ranks == locals.size()) return MergeCompact(locals);
    if (compact_ranks == 0) return MergeFull(locals);
    return std::vector<std::string>(locals.size(), TagString(Tag::kRetryFull));
  }

  std::vector<std::string> MergeFull(std::vector<std::string>& locals) {
    // Per-rank decoding and encoding grow with the world: spread them over threads, and free
    // each message as soon as it is decoded (or each plan once encoded).
    std::vector<SavePlan> plans(locals.size());
    ParallelFor(locals.size(), [&](size_t r) {
      plans[r] = DecodeSavePlan(std::string_view(locals[r]).substr(1));
      std::string().swap(locals[r]);
    });
    auto [global_plans, md] = planner_.CreateGlobalPlan(std::move(plans));
    return ReplyPlans(std::move(global_plans), std::move(md), Tag::kFullPlan);
  }

  std::vector<std::string> MergeCompact(std::vector<std::string>& locals) {
    std::vector<CompactSavePlan> got(locals.size());
    ParallelFor(locals.size(), [&](size_t r) {
      got[r] = DecodeCompactSavePlan(std::string_view(locals[r]).substr(1), static_cast<int>(r));
      std::string().swap(locals[r]);
    });
    CompactMerge merged = MergeCompactPlans(default_planner_, my_full_, split_, std::move(got));
    if (merged.outcome != RegularAgreement::kAgreed) {
      return std::vector<std::string>(
          static_cast<size_t>(size_),
          TagString(merged.outcome == RegularAgreement::kDeclarationsDiffer ? Tag::kRetryDeclared
                                                                            : Tag::kRetryFull));
    }
    return ReplyPlans(std::move(merged.plans), std::move(merged.md), Tag::kCompactPlan);
  }

  // Coordinator: cache the global plans and metadata skeleton, have the writer name the files,
  // and encode each rank's reply (`tag`, the plan id with a cache, the plan).
  std::vector<std::string> ReplyPlans(std::vector<SavePlan> global_plans, Metadata md, Tag tag) {
    if (writer_.WritesFileIndexes()) {
      AssignWriters(md, global_plans);
      expected_items_ = ExpectedItemsPerRank(md, global_plans);
    }
    if (cache_) {
      cache_->entry.global_plans = global_plans;
      cache_->entry.skeleton = md;
    }
    global_plans = writer_.PrepareGlobalPlan(std::move(global_plans));
    if (global_plans.size() != static_cast<size_t>(size_)) {
      throw InternalError("the storage writer returned " + std::to_string(global_plans.size()) +
                          " plans for " + std::to_string(size_) + " ranks");
    }
    global_md_ = std::move(md);
    const uint64_t plan_id = std::stoull(NewSaveId(), nullptr, 16);
    std::vector<std::string> out(global_plans.size());
    ParallelFor(global_plans.size(), [&](size_t r) {
      out[r] = TagString(tag) + (cache_ ? PackId(plan_id) : std::string()) +
               EncodeSavePlan(global_plans[r]);
      global_plans[r] = SavePlan();
    });
    return out;
  }

  // Takes this rank's central plan from the coordinator's reply; false when the coordinator
  // asked for another attempt (and `form` is the form to try next).
  bool AcceptPlanReply(const std::string& reply, PlanForm& form) {
    if (reply.empty()) throw InternalError("empty save plan reply");
    const bool compact = form != PlanForm::kFull;
    const std::string_view body = std::string_view(reply).substr(1);
    const size_t id_bytes = cache_ ? 8 : 0;
    if (HasTag(reply, Tag::kRetryFull)) {
      form = PlanForm::kFull;
      return false;
    }
    if (HasTag(reply, Tag::kRetryDeclared)) {
      if (form != PlanForm::kCompactHashed)
        throw InternalError("save plan reply of the wrong form");
      form = PlanForm::kCompact;
      return false;
    }
    if (HasTag(reply, Tag::kCompactPlan) && compact) {
      central_ = RebuildGlobalPlan(my_full_, split_, DecodeSavePlan(body.substr(id_bytes)), rank_);
      stats_.compact_plan = true;
      stats_.regular_items = split_.regular.size();
    } else if (HasTag(reply, Tag::kFullPlan) && !compact) {
      central_ = DecodeSavePlan(body.substr(id_bytes));
    } else {
      throw InternalError("save plan reply of the wrong form");
    }
    RememberPlan(body);
    return true;
  }

  // What the plan cache keeps of a plan that came from the coordinator.
  void RememberPlan(std::string_view reply) {
    if (!cache_) return;
    if (reply.size() < 8) throw InternalError("save plan reply without its plan id");
    SavePlanCache::Entry& e = cache_->entry;
    e.valid = true;
    e.hash = my_hash_;
    e.plan_id = UnpackId(reply);
    e.world_size = size_;
    e.planner = planner_type_;
    e.central = central_;
  }

  // Every rank writes its items; the coordinator commits the metadata (the phase that decides
  // the save's outcome) and every rank gets it back.
  void WriteAndCommit() {
    SavePlan plan;
    md_bytes_ = RunPhase(
        comm_, "save/write",
        [&] {
          plan = planner_.FinishPlan(std::move(central_));
          std::vector<WriteResult> results = writer_.WriteData(plan, planner_).get();
          if (!writer_.WritesFileIndexes()) return EncodeWriteResults(results);
          // Version 2: where each item lies stays in this rank's files' indexes; the
          // coordinator gets the files only.
          if (results.size() != plan.items.size()) {
            throw InternalError("the storage writer reported " + std::to_string(results.size()) +
                                " results for " + std::to_string(plan.items.size()) + " items");
          }
          return EncodeDataFiles(writer_.TakeDataFiles());
        },
        [&](std::vector<std::string> locals) { return Commit(locals); },
        /*decides_commit=*/true, /*same_reply=*/true);
  }

  // Coordinator: complete the metadata with every rank's write results and have the writer
  // commit it.
  std::vector<std::string> Commit(std::vector<std::string>& locals) {
    global_md_.checkpoint_id =
        options_.checkpoint_id.empty() ? writer_.uri() : options_.checkpoint_id;
    global_md_.save_id = sctx_.save_id;
    global_md_.world_size = size_;
    global_md_.created_unix_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::system_clock::now().time_since_epoch())
                                     .count();
    global_md_.library_version = DCP_VERSION_STRING;
    if (writer_.WritesFileIndexes()) {
      global_md_.format_version = 2;
      global_md_.files.clear();
      for (size_t r = 0; r < locals.size(); ++r) {
        // The items each rank's indexes list must be those its plan gave it (a count check:
        // where they lie is the rank's own business, but a rank that wrote more or fewer items
        // than the metadata expects of it would commit a checkpoint that cannot load).
        uint64_t items = 0;
        for (DataFile& f : DecodeDataFiles(locals[r], static_cast<int>(r))) {
          items += (f.index_length - std::min(f.index_length, kFileIndexHeaderBytes)) /
                   kFileIndexItemBytes;
          global_md_.files.push_back(std::move(f));
        }
        if (r < expected_items_.size() && items != expected_items_[r]) {
          throw InternalError("rank " + std::to_string(r) + " indexed " + std::to_string(items) +
                              " items, its plan gave it " + std::to_string(expected_items_[r]));
        }
        std::string().swap(locals[r]);
      }
      // Index copies past the budget (from a writer that ignored its share) are all dropped:
      // a load reads the index of a file without a copy from the file, one round trip more.
      uint64_t copies = 0;
      for (const DataFile& f : global_md_.files) copies += f.index_copy.size();
      if (copies > kMetadataIndexCopyBytes) {
        for (DataFile& f : global_md_.files) std::string().swap(f.index_copy);
      }
      writer_.Finish(global_md_, {});
    } else if (writer_.FinishTakesFilledStorage()) {
      global_md_.format_version = 1;
      // Each result moves from its rank's payload into the metadata (never all of them decoded
      // beside the map they fill: at thousands of ranks that was most of the coordinator's
      // memory).
      FillStorageFromEncoded(global_md_, locals);
      writer_.Finish(global_md_, {});
    } else {
      global_md_.format_version = 1;
      std::vector<std::vector<WriteResult>> results(locals.size());
      ParallelFor(locals.size(), [&](size_t r) {
        results[r] = DecodeWriteResults(locals[r]);
        std::string().swap(locals[r]);
      });
      writer_.Finish(global_md_, results);
    }
    committed_ = true;
    std::vector<std::string> reply{EncodeMetadata(global_md_)};
    global_md_ = Metadata();  // every rank, this one too, decodes the reply
    return reply;
  }

  const StateDict& state_dict_;
  StorageWriter& writer_;
  Communicator& comm_;
  const SaveOptions& options_;
  const int rank_, size_;
  DefaultSavePlanner default_planner_;
  SavePlanner& planner_;
  const std::string planner_type_;
  SavePlanCache* cache_;
  CommunicatorExchange exchange_;
  StorageContext sctx_;  // its save id is set from the operation's id once it is open
  SaveStats stats_;
  SavePlan my_full_;  // this rank's local plan (LocalPlan)
  bool have_local_ = false;
  std::string my_local_;  // with a plan cache: the local plan, encoded, and its hash
  uint64_t my_hash_ = 0;
  PlanSplit split_;     // compact planning: this rank's plan split into regular and other items
  SavePlan central_;    // this rank's plan from the coordinator
  Metadata global_md_;  // built on the coordinator
  std::vector<uint64_t> expected_items_;  // coordinator, version 2: items each rank writes
  std::string md_bytes_;                  // the committed metadata, as every rank received it
  bool committed_ = false;                // the coordinator's Finish committed
};

}  // namespace

SaveResult Save(const StateDict& state_dict, StorageWriter& writer, Communicator& comm,
                const SaveOptions& options) {
  // Views bound to memory that may have moved (LibTorch parameters, optimizer fields): save
  // what they are now.
  if (HasBindings(state_dict)) return Save(ResolveBindings(state_dict), writer, comm, options);
  return SaveOperation(state_dict, writer, comm, options).Run();
}

namespace {

// Loads tensors only: a copy of the state dict's structure without its blobs. Its views alias
// the caller's memory, so loading into it still happens in place.
StateDict WithoutBlobs(const StateDict& state) {
  StateDict out;
  for (const auto& [key, value] : state.items()) {
    if (std::holds_alternative<Blob>(value)) continue;
    if (const auto* nested = std::get_if<std::shared_ptr<StateDict>>(&value)) {
      StateDict child = WithoutBlobs(**nested);
      if (!child.empty()) out.Set(key, std::make_shared<StateDict>(std::move(child)));
      continue;
    }
    out.Set(key, value);
  }
  return out;
}

// One rank's part of one load, as named steps:
//   Run:  open the operation -> ExchangeMetadata -> Plan -> Read
// `load_all`: the state dict is replaced by every entry of the checkpoint (LoadAll).
class LoadOperation {
 public:
  LoadOperation(StateDict& state_dict, StorageReader& reader, Communicator& comm,
                const LoadOptions& options, bool load_all)
      : state_dict_(state_dict),
        reader_(reader),
        comm_(comm),
        options_(options),
        rank_(comm.rank()),
        size_(comm.size()),
        default_planner_(PlannerOptions(options, load_all)),
        planner_(options.planner ? *options.planner : default_planner_),
        // Read-once needs the default planner: a custom one may reorder its plan in FinishPlan
        // or do anything in CommitTensor, so its rank reads all of its own items.
        can_share_(options.read_once && options.planner == nullptr && size_ > 1) {}

  LoadResult Run() {
    OperationScope op(comm_, "load", reader_.uri());
    const std::string md_bytes = ExchangeMetadata();
    Plan(md_bytes);
    Read();
    LoadResult result;
    result.metadata = std::move(md_);
    result.stats = stats_;
    if (!options_.planner) result.unrequested_keys = default_planner_.extra_keys();
    return result;
  }

 private:
  static LoadPlannerOptions PlannerOptions(const LoadOptions& options, bool load_all) {
    LoadPlannerOptions planner_options;
    planner_options.allow_partial_load = options.allow_partial_load;
    planner_options.load_all = load_all;
    planner_options.cast_dtypes = options.cast_dtypes;
    return planner_options;
  }

  // The coordinator alone reads (and validates) the metadata; everyone else receives it: the
  // bytes of the file as read when they are its wire encoding (the dcp format), so that it is
  // not encoded again, and the coordinator keeps what it decoded instead of decoding it twice.
  std::string ExchangeMetadata() {
    return RunPhase(
        comm_, "load/metadata", [] { return std::string(); },
        [&](std::vector<std::string>) {
          Metadata md = reader_.ReadMetadata();
          std::string encoded = reader_.TakeEncodedMetadata();
          if (encoded.empty()) encoded = EncodeMetadata(md);
          coordinator_md_ = std::move(md);
          return std::vector<std::string>{std::move(encoded)};
        },
        /*decides_commit=*/false, /*same_reply=*/true);
  }

  // Every rank plans what it reads, alone. What crosses the wire is a summary of each rank's
  // request (planner/read_sharing.h: which whole-value items it reads, for read-once), and back
  // one schedule of shared reads for all: O(ranks x replicated entries) bits, never a plan, so
  // an all-to-all reshard at thousands of ranks plans in O(own reads) per rank. Only when the
  // coordinator's planner or reader has a global step that may change the plans (a custom
  // planner, a reader without GlobalPlanChangesNothing) does it answer kRetryFull, and every
  // rank sends its plan in full for that step (PlanInFull).
  void Plan(const std::string& md_bytes) {
    const std::string reply = RunPhase(
        comm_, "load/plan",
        [&] {
          if (coordinator_md_) {
            md_ = std::move(*coordinator_md_);
            coordinator_md_.reset();
          } else {
            md_ = DecodeMetadata(md_bytes, reader_.uri());
          }
          reader_.SetUp(md_, StorageContext{rank_, size_, rank_ == 0, {}, nullptr});
          planner_.SetUp(state_dict_, md_, PlannerContext{rank_, size_, rank_ == 0});
          local_ = reader_.PrepareLocalPlan(planner_.CreateLocalPlan());
          candidates_ = ShareCandidates(md_);
          candidate_items_ = CandidateItems(local_, candidates_, md_);
          summary_ = SummarizeRequest(local_, candidate_items_, md_, can_share_);
          return CountPlanMessage(TagString(Tag::kRequestSummary) +
                                  EncodeReadRequestSummary(summary_));
        },
        [&](std::vector<std::string> summaries) { return ScheduleSharedReads(summaries); },
        /*decides_commit=*/false, /*same_reply=*/true);
    if (HasTag(reply, Tag::kRetryFull)) return PlanInFull();
    if (!HasTag(reply, Tag::kShareSchedule)) {
      throw CorruptionError("load/plan: a reply of unknown form from the coordinator");
    }
    stats_.rank_local_plan = true;
    const ShareSchedule schedule =
        DecodeShareSchedule(std::string_view(reply).substr(1), candidates_.size());
    batches_ = BatchesFor(schedule, summary_, candidate_items_, rank_);
    central_ = std::move(local_);
  }

  std::string CountPlanMessage(std::string msg) {
    stats_.plan_bytes_sent += msg.size();
    ++stats_.plan_rounds;
    return msg;
  }

  // Coordinator: the read-once schedule from every rank's summary, or kRetryFull when its own
  // planner or reader must see every plan.
  std::vector<std::string> ScheduleSharedReads(std::vector<std::string>& summaries) {
    if (options_.planner != nullptr || !reader_.GlobalPlanChangesNothing()) {
      return {TagString(Tag::kRetryFull)};
    }
    std::vector<ReadRequestSummary> got(summaries.size());
    for (size_t r = 0; r < summaries.size(); ++r) {
      if (!HasTag(summaries[r], Tag::kRequestSummary)) {
        throw InternalError("load/plan: rank " + std::to_string(r) +
                            " sent a message of unknown form");
      }
      got[r] = DecodeReadRequestSummary(std::string_view(summaries[r]).substr(1),
                                        candidates_.size(), static_cast<int>(r));
      std::string().swap(summaries[r]);
    }
    ShareSchedule schedule;
    if (std::count_if(got.begin(), got.end(), [](const auto& g) { return g.can_share; }) > 1) {
      schedule = ScheduleCandidates(got, CandidateBytes(candidates_, md_),
                                    options_.storage.memory_budget_bytes);
    }
    return {TagString(Tag::kShareSchedule) + EncodeShareSchedule(schedule)};
  }

  // Every plan to the coordinator, for its planner's and reader's global steps; each rank gets
  // back its plan and its read-once batches.
  void PlanInFull() {
    const std::string assignment = RunPhase(
        comm_, "load/plan-full",
        [&] { return CountPlanMessage(EncodeLocalLoadPlan(local_, can_share_)); },
        [&](std::vector<std::string> locals) { return MergePlans(locals); });
    local_ = LoadPlan();
    auto [central, batches] = DecodeLoadAssignment(assignment);
    central_ = std::move(central);
    batches_ = std::move(batches);
  }

  // Coordinator: the global plan, and the read-once batches of the ranks that share reads.
  std::vector<std::string> MergePlans(std::vector<std::string>& locals) {
    std::vector<LoadPlan> plans(locals.size());
    std::vector<char> shares(locals.size());
    ParallelFor(locals.size(), [&](size_t r) {
      auto decoded = DecodeLocalLoadPlan(locals[r]);
      plans[r] = std::move(decoded.first);
      shares[r] = decoded.second;
      std::string().swap(locals[r]);
    });
    std::vector<bool> sharing(shares.begin(), shares.end());
    plans = reader_.PrepareGlobalPlan(planner_.CreateGlobalPlan(std::move(plans)));
    std::vector<std::vector<SharedReadBatch>> batches(plans.size());
    if (std::count(sharing.begin(), sharing.end(), true) > 1) {
      batches = PlanSharedReads(plans, md_, sharing, options_.storage.memory_budget_bytes);
    }
    std::vector<std::string> out(plans.size());
    ParallelFor(plans.size(), [&](size_t r) {
      out[r] = EncodeLoadAssignment(plans[r], batches[r]);
      plans[r] = LoadPlan();
    });
    return out;
  }

  // Every rank reads its items (sharing what the batches say); the phase ends when all did.
  void Read() {
    RunPhase(
        comm_, "load/read",
        [&] {
          const LoadPlan plan = planner_.FinishPlan(std::move(central_));
          if (batches_.empty()) {
            // Readers see plain items only: spans become one item per stored chunk here, a
            // bounded part at a time (each part's indexes are read before the next expands).
            ForEachExpandedPart(plan, md_, kMaxExpandedItems, [&](const LoadPlan& pieces) {
              reader_.ReadData(pieces, planner_).get();
            });
          } else {
            ReadWithSharing(plan, md_, batches_, reader_, planner_, comm_,
                            options_.storage.memory_budget_bytes, stats_);
          }
          return std::string();
        },
        [&](std::vector<std::string>) { return std::vector<std::string>(1); },
        /*decides_commit=*/false, /*same_reply=*/true);
  }

  StateDict& state_dict_;
  StorageReader& reader_;
  Communicator& comm_;
  const LoadOptions& options_;
  const int rank_, size_;
  DefaultLoadPlanner default_planner_;
  LoadPlanner& planner_;
  const bool can_share_;
  std::optional<Metadata> coordinator_md_;  // rank 0: the metadata as ReadMetadata decoded it
  Metadata md_;
  LoadPlan local_;    // this rank's plan, as its planner and reader made it
  LoadPlan central_;  // what it reads: its local plan, or the coordinator's global step's
  std::vector<MetadataIndex> candidates_;  // stored items read-once may share (ShareCandidates)
  std::vector<int32_t> candidate_items_;   // which item of local_ reads each, or -1
  ReadRequestSummary summary_;
  std::vector<SharedReadBatch> batches_;
  LoadStats stats_;
};

void CheckLoadOptions(const LoadOptions& options, bool load_all) {
  if (options.planner && options.allow_partial_load) {
    throw InvalidArgumentError(
        "LoadOptions::allow_partial_load applies to the default planner; a custom planner "
        "decides what a missing key means");
  }
  if (options.planner && options.cast_dtypes) {
    throw InvalidArgumentError(
        "LoadOptions::cast_dtypes applies to the default planner; a custom planner resolves "
        "destinations itself");
  }
  if (options.planner && load_all) {
    throw InvalidArgumentError("LoadAll allocates through the default planner; pass no planner");
  }
}

LoadResult LoadInto(StateDict& state_dict, StorageReader& reader, Communicator& comm,
                    const LoadOptions& options, bool load_all) {
  CheckLoadOptions(options, load_all);
  if (!load_all && options.weights_only) {
    StateDict tensors = WithoutBlobs(state_dict);
    LoadOptions rest = options;
    rest.weights_only = false;
    return LoadInto(tensors, reader, comm, rest, false);
  }
  if (!load_all && HasBindings(state_dict)) {
    // Load into what the bound views are now, then let each binding take its value back.
    StateDict resolved = ResolveBindings(state_dict);
    LoadResult result = LoadInto(resolved, reader, comm, options, false);
    FinishBoundLoad(state_dict, resolved);
    return result;
  }
  LoadResult result = LoadOperation(state_dict, reader, comm, options, load_all).Run();
  if (load_all && options.weights_only) state_dict = WithoutBlobs(state_dict);
  return result;
}

}  // namespace

LoadResult Load(StateDict& state_dict, StorageReader& reader, Communicator& comm,
                const LoadOptions& options) {
  return LoadInto(state_dict, reader, comm, options, /*load_all=*/false);
}

StateDict LoadAll(StorageReader& reader, Communicator& comm, const LoadOptions& options) {
  StateDict state;
  LoadInto(state, reader, comm, options, /*load_all=*/true);
  return state;
}

// A backend factory can fail on some ranks only (a custom scheme, a permission problem). These
// stand-ins carry such a failure into the protocol's first phase, so every rank reports it.
class FailedWriter : public StorageWriter {
 public:
  FailedWriter(std::string uri, std::exception_ptr e) : uri_(std::move(uri)), e_(e) {}
  std::string uri() const override { return uri_; }
  void SetUp(const StorageContext&) override { std::rethrow_exception(e_); }
  SavePlan PrepareLocalPlan(SavePlan) override { std::rethrow_exception(e_); }
  std::vector<SavePlan> PrepareGlobalPlan(std::vector<SavePlan>) override {
    std::rethrow_exception(e_);
  }
  std::future<std::vector<WriteResult>> WriteData(const SavePlan&, const SavePlanner&) override {
    std::rethrow_exception(e_);
  }
  void Finish(Metadata&, const std::vector<std::vector<WriteResult>>&) override {
    std::rethrow_exception(e_);
  }
  void Abort() noexcept override {}

 private:
  std::string uri_;
  std::exception_ptr e_;
};

class FailedReader : public StorageReader {
 public:
  FailedReader(std::string uri, std::exception_ptr e) : uri_(std::move(uri)), e_(e) {}
  std::string uri() const override { return uri_; }
  Metadata ReadMetadata() override { std::rethrow_exception(e_); }
  void SetUp(const Metadata&, const StorageContext&) override { std::rethrow_exception(e_); }
  LoadPlan PrepareLocalPlan(LoadPlan) override { std::rethrow_exception(e_); }
  std::vector<LoadPlan> PrepareGlobalPlan(std::vector<LoadPlan>) override {
    std::rethrow_exception(e_);
  }
  std::future<void> ReadData(const LoadPlan&, LoadPlanner&) override { std::rethrow_exception(e_); }

 private:
  std::string uri_;
  std::exception_ptr e_;
};

namespace {
std::unique_ptr<StorageWriter> WriterFor(const std::string& uri, const StorageOptions& options) {
  try {
    return OpenStorageWriter(uri, options);
  } catch (...) {
    return std::make_unique<FailedWriter>(uri, std::current_exception());
  }
}
std::unique_ptr<StorageReader> ReaderFor(const std::string& uri, const StorageOptions& options) {
  try {
    return OpenStorageReader(uri, options);
  } catch (...) {
    return std::make_unique<FailedReader>(uri, std::current_exception());
  }
}
}  // namespace

SaveResult Save(const StateDict& state_dict, const std::string& uri, Communicator& comm,
                const SaveOptions& options) {
  return Save(state_dict, *WriterFor(uri, options.storage), comm, options);
}

LoadResult Load(StateDict& state_dict, const std::string& uri, Communicator& comm,
                const LoadOptions& options) {
  return Load(state_dict, *ReaderFor(uri, options.storage), comm, options);
}

StateDict LoadAll(const std::string& uri, Communicator& comm, const LoadOptions& options) {
  return LoadAll(*ReaderFor(uri, options.storage), comm, options);
}

SaveResult Save(const StateDict& state_dict, const std::string& uri, const SaveOptions& options) {
  LocalCommunicator comm;
  return Save(state_dict, uri, comm, options);
}

LoadResult Load(StateDict& state_dict, const std::string& uri, const LoadOptions& options) {
  LocalCommunicator comm;
  return Load(state_dict, uri, comm, options);
}

StateDict LoadAll(const std::string& uri, const LoadOptions& options) {
  LocalCommunicator comm;
  return LoadAll(uri, comm, options);
}

Metadata ReadMetadata(const std::string& uri, const StorageOptions& options) {
  Metadata md = OpenStorageReader(uri, options)->ReadMetadata();
  ReadStoredItems(uri, md, options);
  return md;
}

void ReadStoredItems(const std::string& uri, Metadata& md, const StorageOptions& options) {
  if (md.format_version < 2) return;
  FileIndexResolver::ResolveAll(*OpenStoreForReading(uri, options.backend), md);
}

PyValuePtr PythonValue(const Blob& blob, const std::string& what) {
  return ReadPythonValue(blob.bytes, what);
}

}  // namespace dcp
