#include "dcp/protocol/read_once.h"

#include <cstring>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>

#include "dcp/proto/device/device.h"
#include "dcp/proto/error.h"
#include "dcp/protocol/phase.h"
#include "schema/dcp.pb.h"  // generated from proto/schema/dcp.proto

namespace dcp::protocol {

namespace {

// One read item within a rank's plan.
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

}  // namespace

void ReadWithSharing(const LoadPlan& plan, const Metadata& md,
                     const std::vector<SharedReadBatch>& batches, StorageReader& reader,
                     LoadPlanner& planner, Communicator& comm, uint64_t budget, LoadStats& stats,
                     const std::function<bool(const ReadItem&)>& served,
                     const std::vector<char>& served_items) {
  const int rank = comm.rank();
  // Received, read for others later, or served already.
  std::vector<char> skip(plan.items.size(), 0);
  for (size_t i = 0; i < served_items.size() && i < skip.size(); ++i) skip[i] = served_items[i];
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
    ForEachExpandedPart(p, md, kMaxExpandedItems, [&](const LoadPlan& part) {
      if (!served) return reader.ReadData(part, capture).get();
      LoadPlan rest;
      rest.storage_data = part.storage_data;
      rest.planner_data = part.planner_data;
      for (const ReadItem& item : part.items) {
        if (!served(item)) rest.items.push_back(item);
      }
      if (!rest.items.empty()) reader.ReadData(rest, capture).get();
    });
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

}  // namespace dcp::protocol
