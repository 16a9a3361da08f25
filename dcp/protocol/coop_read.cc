#include "dcp/protocol/coop_read.h"

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <thread>

#include "dcp/planner/coop_reads.h"
#include "dcp/proto/error.h"
#include "dcp/proto/staging.h"

namespace dcp::protocol {

namespace {

// A round opens, per (owner -> receiver) pair that has something in it, with this status:
// 0 when the owner has read (and, for an item's last slab, verified) everything so far.
constexpr size_t kStatusBytes = 8;

// One stored item an owner scatters.
struct Scatter {
  MetadataIndex index;
  CoopItem item;
  uint64_t row_bytes = 0;
  std::vector<CoopPiece> slabs;
  std::vector<std::pair<int, size_t>> members;  // (rank, its request number)
};

// A piece in flight: (peer, request number of that peer's list, piece number).
struct PieceRef {
  int peer;
  size_t request;
  size_t piece;
  bool operator<(const PieceRef& o) const {
    return std::tie(peer, request, piece) < std::tie(o.peer, o.request, o.piece);
  }
};

// A slab of scattered item number `item` at byte `offset`, read ahead: its `size` bytes in a
// pooled buffer.
struct QueuedSlab {
  size_t item = 0;
  uint64_t offset = 0;
  HostBuffer bytes;
  size_t size = 0;
};

// The owner's read-ahead: at most kDepth slabs wait (memory: kDepth slabs of a round's bytes
// each, within the budget's share of CoopRoundBytes), buffers recycled.
class SlabQueue {
 public:
  static constexpr size_t kDepth = 2;
  // Producer: a buffer to fill (recycled when one is free).
  HostBuffer Spare() {
    std::lock_guard<std::mutex> lock(mu_);
    if (spare_.empty()) return {};
    HostBuffer s = std::move(spare_.back());
    spare_.pop_back();
    return s;
  }
  // Producer: false once the consumer gave up.
  bool Push(QueuedSlab slab) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return cancelled_ || slabs_.size() < kDepth; });
    if (cancelled_) return false;
    slabs_.push_back(std::move(slab));
    cv_.notify_all();
    return true;
  }
  void Finish(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
    error_ = error;
    cv_.notify_all();
  }
  // Consumer: the next slab, or nullopt once the producer finished.
  std::optional<QueuedSlab> Pop() {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return done_ || !slabs_.empty(); });
    if (slabs_.empty()) return std::nullopt;
    QueuedSlab s = std::move(slabs_.front());
    slabs_.pop_front();
    cv_.notify_all();
    return s;
  }
  void Recycle(HostBuffer bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    if (spare_.size() <= kDepth) spare_.push_back(std::move(bytes));
  }
  void RethrowError() {
    std::lock_guard<std::mutex> lock(mu_);
    if (error_) std::rethrow_exception(error_);
  }
  void Cancel() {
    std::lock_guard<std::mutex> lock(mu_);
    cancelled_ = true;
    cv_.notify_all();
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<QueuedSlab> slabs_;
  std::vector<HostBuffer> spare_;
  bool done_ = false, cancelled_ = false;
  std::exception_ptr error_;
};

class CoopRead {
 public:
  CoopRead(const LoadPlan& plan, const Metadata& md, StorageReader& reader, LoadPlanner& planner,
           Communicator& comm, const StorageOptions& options, LoadStats& stats)
      : plan_(plan),
        md_(md),
        streamer_(reader.item_streamer()),
        planner_(planner),
        comm_(comm),
        options_(options),
        stats_(stats),
        rank_(comm.rank()),
        world_(comm.size()),
        round_bytes_(CoopRoundBytes(options.memory_budget_bytes)) {}

  CoopReadResult Run() {
    try {
      Ask();
      Grant();
      AgreeOnRounds();
      Exchange();
    } catch (...) {
      // A collective failed: the communicator is poisoned, so every rank fails this load; what
      // was granted stays unread here, and nothing of it was committed.
      Fail();
    }
    return std::move(result_);
  }

 private:
  void Fail() {
    if (!result_.error) result_.error = std::current_exception();
  }

  // 1. What this rank asks each owner for (its own reads of items it owns included).
  void Ask() {
    std::vector<std::string> out(world_);
    mine_.assign(world_, {});
    asks_by_owner_.assign(world_, {});
    try {
      asks_ = CoopAsks(plan_, md_, CoopOwners(md_, world_), rank_, options_.verify_checksums,
                       /*own_reads=*/streamer_ != nullptr);
      for (size_t i = 0; i < asks_.size(); ++i) {
        const int o = asks_[i].owner;
        if (o < 0 || o >= world_) continue;
        asks_by_owner_[o].push_back(i);
        mine_[o].push_back(asks_[i].request);
      }
      for (int o = 0; o < world_; ++o) {
        if (!mine_[o].empty()) out[o] = EncodeCoopRequests(mine_[o]);
      }
    } catch (...) {
      Fail();
      out.assign(world_, {});
      mine_.assign(world_, {});
      asks_by_owner_.assign(world_, {});
    }
    theirs_raw_ = comm_.AllToAll(std::move(out), "load/coop-request");
  }

  // 2. As an owner: which items to scatter, their slabs and rounds, and each asker's grants.
  void Grant() {
    std::vector<std::string> out(world_);
    theirs_.assign(world_, {});
    grants_out_.assign(world_, {});
    esize_out_.assign(world_, {});
    try {
      Decide();
    } catch (...) {
      Fail();  // e.g. an index that cannot be read: this owner grants nothing
      scatters_.clear();
      for (auto& g : grants_out_) g.assign(g.size(), CoopGrant{});
    }
    for (int p = 0; p < world_; ++p) {
      if (!theirs_[p].empty()) out[p] = EncodeCoopGrants(grants_out_[p]);
    }
    std::vector<std::string> got = comm_.AllToAll(std::move(out), "load/coop-grant");
    grants_in_.assign(world_, {});
    for (int o = 0; o < world_; ++o) {
      try {
        grants_in_[o] = DecodeCoopGrants(got[o], mine_[o], o);
      } catch (...) {
        Fail();
        grants_in_[o].assign(mine_[o].size(), CoopGrant{});
      }
    }
    for (int o = 0; o < world_; ++o) {
      for (size_t i = 0; i < grants_in_[o].size(); ++i) {
        if (grants_in_[o][i].granted) {
          result_.served.insert(CoopItemKey(asks_[asks_by_owner_[o][i]].item));
        }
      }
    }
  }

  void Decide() {
    const std::vector<const std::string*> entries = EntryOrdinals(md_);
    std::map<std::pair<uint32_t, size_t>, Scatter> items;  // (entry, chunk) -> askers
    for (int p = 0; p < world_; ++p) {
      try {
        theirs_[p] = DecodeCoopRequests(theirs_raw_[p], p);
        std::vector<CoopItem> checked;
        for (const CoopRequest& r : theirs_[p]) {
          checked.push_back(CheckCoopRequest(md_, entries, r, p));
        }
        for (size_t i = 0; i < checked.size(); ++i) {
          Scatter& s = items[{theirs_[p][i].entry, checked[i].ordinal}];
          s.item = checked[i];
          s.members.emplace_back(p, i);
        }
      } catch (const Error&) {
        theirs_[p].clear();  // a malformed request: no grants to its sender
      }
      std::string().swap(theirs_raw_[p]);
      grants_out_[p].assign(theirs_[p].size(), CoopGrant{});
      esize_out_[p].assign(theirs_[p].size(), 1);
    }
    uint32_t round = 0;
    uint64_t used = 0;
    for (auto& [key, s] : items) {
      const Shape& sizes = s.item.chunk.sizes;
      const size_t esize = ElementSize(s.item.tensor->dtype);
      for (const auto& [p, i] : s.members) esize_out_[p][i] = esize;
      const uint64_t bytes = static_cast<uint64_t>(NumElements(sizes)) * esize;
      std::vector<uint64_t> costs;
      for (const auto& [p, i] : s.members) {
        const CoopRequest& r = theirs_[p][i];
        costs.push_back(
            PartialReadCost(sizes, esize, r.box_off, r.box_len, options_.verify_checksums));
      }
      if (streamer_ == nullptr || !ShouldScatter(bytes, costs)) continue;
      s.row_bytes = bytes / static_cast<uint64_t>(sizes[0]);
      // A slab is whole rows: a row over a round's bytes would hold more than the budget allows,
      // so such items are read by each rank as before.
      if (s.row_bytes > round_bytes_) continue;
      s.index = {*s.item.fqn, s.item.chunk.offsets, static_cast<int32_t>(s.item.ordinal)};
      if (streamer_->StreamableLength(s.index) != bytes) continue;
      s.slabs = CutSlabs(sizes[0], s.row_bytes, round_bytes_, &round, &used);
      for (const auto& [p, i] : s.members) {
        const CoopRequest& r = theirs_[p][i];
        CoopGrant& g = grants_out_[p][i];
        g.granted = true;
        g.verify_round = s.slabs.back().round;
        g.pieces = PiecesOf(s.slabs, r.box_off[0], r.box_off[0] + r.box_len[0]);
      }
      scatters_.push_back(std::move(s));
    }
    own_rounds_ = scatters_.empty() ? 0 : scatters_.back().slabs.back().round + 1;
  }

  // 3. Rounds: the most any owner needs (every rank joins each).
  void AgreeOnRounds() {
    std::string mine(4, '\0');
    for (int i = 0; i < 4; ++i) mine[i] = static_cast<char>(own_rounds_ >> (8 * i));
    const std::vector<std::string> all = comm_.AllGather(std::move(mine), "load/coop-rounds");
    rounds_ = 0;
    for (const std::string& m : all) {
      uint32_t v = 0;
      if (m.size() == 4) {
        for (int i = 0; i < 4; ++i)
          v |= static_cast<uint32_t>(static_cast<unsigned char>(m[i])) << (8 * i);
      }
      rounds_ = std::max(rounds_, v);
    }
    stats_.coop_rounds = rounds_;
    // What each round moves, derived alike by both sides from the grants.
    out_.assign(rounds_, {});
    in_.assign(rounds_, {});
    out_status_.assign(rounds_, std::vector<char>(world_, 0));
    in_status_.assign(rounds_, std::vector<char>(world_, 0));
    for (int p = 0; p < world_; ++p) {
      if (p == rank_) continue;
      for (size_t i = 0; i < grants_out_[p].size(); ++i) {
        const CoopGrant& g = grants_out_[p][i];
        if (!g.granted) continue;
        out_status_[g.verify_round][p] = 1;
        for (size_t k = 0; k < g.pieces.size(); ++k) {
          out_[g.pieces[k].round].push_back({p, i, k});
          out_status_[g.pieces[k].round][p] = 1;
        }
      }
      for (size_t i = 0; i < grants_in_[p].size(); ++i) {
        CoopGrant& g = grants_in_[p][i];
        if (!g.granted) continue;
        if (g.verify_round >= rounds_) {  // a grant no round carries: read it here after all
          try {
            throw CorruptionError("cooperative read: rank " + std::to_string(p) +
                                  " granted a round past the last");
          } catch (...) {
            Fail();
          }
          g.granted = false;
          continue;
        }
        in_status_[g.verify_round][p] = 1;
        for (size_t k = 0; k < g.pieces.size(); ++k) {
          in_[g.pieces[k].round].push_back({p, i, k});
          in_status_[g.pieces[k].round][p] = 1;
        }
      }
    }
    for (auto& r : out_) std::sort(r.begin(), r.end());
    for (auto& r : in_) std::sort(r.begin(), r.end());
  }

  // 4. The owner streams its items on a helper thread, a slab or two ahead, while this thread
  // packs each slab's pieces for their round and exchanges a round once the stream has passed it
  // (so the next slab is read while a round crosses the communicator). Rounds left over (an
  // owner with fewer rounds, or none, or one that failed) are exchanged after.
  void Exchange() {
    bool failed = result_.error != nullptr;
    if (!failed && !scatters_.empty()) {
      SlabQueue queue;
      std::thread ahead([&] { ReadAhead(queue); });
      std::vector<std::vector<size_t>> cursors(scatters_.size());
      for (size_t k = 0; k < scatters_.size(); ++k)
        cursors[k].assign(scatters_[k].members.size(), 0);
      try {
        while (std::optional<QueuedSlab> slab = queue.Pop()) {
          Place(scatters_[slab->item], slab->offset, slab->bytes.data(), slab->size,
                cursors[slab->item]);
          queue.Recycle(std::move(slab->bytes));
        }
        queue.RethrowError();
      } catch (...) {
        Fail();
        failed = true;
        queue.Cancel();
      }
      ahead.join();
    }
    owner_failed_ = owner_failed_ || failed;
    while (next_round_ < rounds_) RunRound();
  }

  static uint64_t SlabBytes(const Scatter& s) {
    return static_cast<uint64_t>(s.slabs[0].row_end - s.slabs[0].row_begin) * s.row_bytes;
  }

  // The helper thread: every scattered item, slab by slab, into `queue`. The streamer checks an
  // item's checksum before its last slab, so a bad item's last slab never reaches the queue.
  void ReadAhead(SlabQueue& queue) {
    struct Cancelled {};
    try {
      for (size_t k = 0; k < scatters_.size(); ++k) {
        streamer_->StreamItem(scatters_[k].index, SlabBytes(scatters_[k]),
                              [&](uint64_t offset, const char* data, size_t n) {
                                HostBuffer bytes = queue.Spare();
                                bytes.Reserve(n);
                                std::memcpy(bytes.data(), data, n);
                                if (!queue.Push({k, offset, std::move(bytes), n})) {
                                  throw Cancelled{};
                                }
                              });
      }
      queue.Finish(nullptr);
    } catch (const Cancelled&) {
      queue.Finish(nullptr);
    } catch (...) {
      queue.Finish(std::current_exception());
    }
  }

  // One slab of `s` at byte `offset` of the item: its rows of every granted box, packed for
  // their round (or, for this rank's own boxes, placed), rounds before it exchanged first.
  void Place(const Scatter& s, uint64_t offset, const char* bytes, size_t size,
             std::vector<size_t>& cursor) {
    const Shape& sizes = s.item.chunk.sizes;
    const DType dtype = s.item.tensor->dtype;
    const uint64_t slab_bytes = SlabBytes(s);
    const size_t j = static_cast<size_t>(offset / slab_bytes);
    if (j >= s.slabs.size() || offset % slab_bytes != 0) {
      throw InternalError("cooperative read: a slab out of place");
    }
    const CoopPiece& slab = s.slabs[j];
    const int64_t rows = slab.row_end - slab.row_begin;
    if (size != static_cast<uint64_t>(rows) * s.row_bytes) {
      throw InternalError("cooperative read: a slab of another size");
    }
    while (next_round_ < slab.round) RunRound();
    Shape slab_shape = sizes;
    slab_shape[0] = rows;
    const TensorView src = TensorView::FromContiguous(const_cast<char*>(bytes), dtype, slab_shape);
    for (size_t m = 0; m < s.members.size(); ++m) {
      const auto [p, i] = s.members[m];
      const CoopGrant& g = grants_out_[p][i];
      if (cursor[m] >= g.pieces.size() || g.pieces[cursor[m]].row_begin >= slab.row_end) continue;
      const CoopPiece& piece = g.pieces[cursor[m]];
      const CoopRequest& r = theirs_[p][i];
      Shape off = r.box_off, len = r.box_len;
      off[0] = piece.row_begin - slab.row_begin;
      len[0] = piece.row_end - piece.row_begin;
      const TensorView part = src.Narrow(off, len);
      if (p == rank_) {
        CopyTensor(Destination(i).Narrow(RowOffsets(len, piece.row_begin - r.box_off[0]), len),
                   part);
      } else {
        CopyTensor(TensorView::FromContiguous(OutPiece(piece.round, {p, i, cursor[m]}), dtype, len),
                   part);
      }
      ++cursor[m];
    }
    if (j + 1 == s.slabs.size()) {  // verified: the owner's own boxes are complete
      for (const auto& [p, i] : s.members) {
        if (p == rank_) planner_.CommitTensor(asks_[asks_by_owner_[rank_][i]].item, Destination(i));
      }
    }
  }

  static Shape RowOffsets(const Shape& len, int64_t row) {
    Shape off(len.size(), 0);
    off[0] = row;
    return off;
  }

  // The destination of this rank's request number i to owner `o` (resolved once).
  TensorView Destination(size_t i, int o = -1) {
    if (o < 0) o = rank_;
    const size_t a = asks_by_owner_[o][i];
    auto it = landed_.find(a);
    if (it == landed_.end()) it = landed_.emplace(a, planner_.ResolveTensor(asks_[a].item)).first;
    return it->second;
  }

  // One round of "load/coop-data": this rank's packed pieces out, the pieces owners send it in.
  void RunRound() {
    const uint32_t t = next_round_++;
    std::vector<Communicator::BulkSend> sends;
    std::vector<Communicator::BulkReceive> receives;
    const uint64_t status = owner_failed_ ? 1 : 0;
    char status_bytes[kStatusBytes];
    std::memcpy(status_bytes, &status, kStatusBytes);
    LayOut(t);
    size_t at = 0;
    for (int p = 0; p < world_; ++p) {
      if (!out_status_[t][p]) continue;
      sends.push_back({p, status_bytes, kStatusBytes});
      // A failed owner still sends every piece (as its buffer holds it) so that sizes agree.
      for (; at < out_[t].size() && out_[t][at].peer == p; ++at) {
        const size_t n = out_at_[at + 1] - out_at_[at];
        sends.push_back({p, out_arena_.data() + out_at_[at], n});
        if (!owner_failed_) stats_.coop_bytes_sent += n;
      }
    }
    // What this rank receives lands in place where its destination rows are contiguous host
    // memory of the stored dtype (a box of whole rows of a contiguous tensor), else in one pooled
    // buffer, carved in the order of in_[t], from which Land copies it.
    std::vector<uint64_t> in_at(in_[t].size() + 1, 0);
    std::vector<char*> in_place(in_[t].size(), nullptr);
    std::vector<uint64_t> piece_bytes(in_[t].size(), 0);
    for (size_t k = 0; k < in_[t].size(); ++k) {
      const PieceRef& ref = in_[t][k];
      const ReadItem& item = asks_[asks_by_owner_[ref.peer][ref.request]].item;
      const CoopPiece& piece = grants_in_[ref.peer][ref.request].pieces[ref.piece];
      const DType stored = std::get<TensorMetadata>(md_.entries.at(item.storage_index.fqn)).dtype;
      const uint64_t bytes =
          CoopPieceBytes(item.lengths, ElementSize(stored), piece.row_end - piece.row_begin);
      piece_bytes[k] = bytes;
      try {
        in_place[k] = InPlace(ref, item, piece, stored, bytes);
      } catch (...) {
        Fail();  // its destination cannot be had: staged, and Land reports nothing new
      }
      in_at[k + 1] = in_at[k] + (in_place[k] ? 0 : bytes);
    }
    in_arena_.Reserve(static_cast<size_t>(in_at.back()));
    std::vector<uint64_t> got_status(world_, 0);
    at = 0;
    for (int o = 0; o < world_; ++o) {
      if (!in_status_[t][o]) continue;
      receives.push_back({o, reinterpret_cast<char*>(&got_status[o]), kStatusBytes});
      for (; at < in_[t].size() && in_[t][at].peer == o; ++at) {
        receives.push_back({o, in_place[at] ? in_place[at] : in_arena_.data() + in_at[at],
                            static_cast<size_t>(piece_bytes[at])});
      }
    }
    if (comm_broken_) return;
    try {
      comm_.ExchangeBytes(sends, receives, "load/coop-data");
    } catch (...) {
      Fail();
      comm_broken_ = true;
      KeepForever(std::move(in_arena_), std::move(out_arena_), std::move(got_status));
      return;
    }
    Land(t, in_at, in_place, piece_bytes, got_status);
  }

  // Where piece `ref` can be received straight into its destination: the rows it brings of a
  // contiguous host destination of the stored dtype, or nullptr (then it is staged).
  char* InPlace(const PieceRef& ref, const ReadItem& item, const CoopPiece& piece, DType stored,
                uint64_t bytes) {
    const TensorView dst = Destination(ref.request, ref.peer);
    if (!dst.device.is_cpu() || dst.dtype != stored || !dst.is_contiguous() ||
        dst.data == nullptr || dst.shape != item.lengths || bytes == 0) {
      return nullptr;
    }
    const uint64_t row_bytes =
        dst.nbytes() / static_cast<uint64_t>(std::max<int64_t>(dst.shape[0], 1));
    return static_cast<char*>(dst.data) +
           static_cast<uint64_t>(piece.row_begin - item.storage_offsets[0]) * row_bytes;
  }

  // Round t's outgoing pieces in one pooled buffer, carved in the order of out_[t] (the order
  // they are sent in): out_at_[k] is where piece k starts. Only one round is filled at a time.
  void LayOut(uint32_t t) {
    if (laid_out_ == t) return;
    laid_out_ = t;
    out_at_.assign(out_[t].size() + 1, 0);
    for (size_t k = 0; k < out_[t].size(); ++k) {
      const PieceRef& ref = out_[t][k];
      const CoopPiece& piece = grants_out_[ref.peer][ref.request].pieces[ref.piece];
      out_at_[k + 1] = out_at_[k] + CoopPieceBytes(theirs_[ref.peer][ref.request].box_len,
                                                   esize_out_[ref.peer][ref.request],
                                                   piece.row_end - piece.row_begin);
    }
    out_arena_.Reserve(static_cast<size_t>(out_at_.back()));
  }

  char* OutPiece(uint32_t t, const PieceRef& ref) {
    LayOut(t);
    const auto it = std::lower_bound(out_[t].begin(), out_[t].end(), ref);
    if (it == out_[t].end() || ref < *it)
      throw InternalError("cooperative read: an ungranted piece");
    return out_arena_.data() + out_at_[static_cast<size_t>(it - out_[t].begin())];
  }

  // Place what round t brought; commit each box whose item's last slab came with a good status.
  void Land(uint32_t t, const std::vector<uint64_t>& in_at, const std::vector<char*>& in_place,
            const std::vector<uint64_t>& piece_bytes, const std::vector<uint64_t>& status) {
    for (int o = 0; o < world_; ++o) {
      if (in_status_[t][o] && status[o] != 0 && !owner_reported_[o]) {
        owner_reported_[o] = true;
        try {
          throw CorruptionError("rank " + std::to_string(o) +
                                " could not read the items it reads for this rank (cooperative "
                                "read of " +
                                FirstItemFrom(o) + ")");
        } catch (...) {
          Fail();
        }
      }
    }
    for (size_t at = 0; at < in_[t].size(); ++at) {
      const PieceRef& ref = in_[t][at];
      if (status[ref.peer] != 0) continue;
      try {
        const ReadItem& item = asks_[asks_by_owner_[ref.peer][ref.request]].item;
        const CoopPiece& piece = grants_in_[ref.peer][ref.request].pieces[ref.piece];
        Shape len = item.lengths;
        len[0] = piece.row_end - piece.row_begin;
        const TensorView dst = Destination(ref.request, ref.peer);
        if (in_place[at] == nullptr) {
          const TensorView src =
              TensorView::FromContiguous(in_arena_.data() + in_at[at], dst.dtype, len);
          CopyTensor(dst.Narrow(RowOffsets(len, piece.row_begin - item.storage_offsets[0]), len),
                     src);
        }
        stats_.coop_bytes_received += piece_bytes[at];
      } catch (...) {
        Fail();
      }
    }
    for (int o = 0; o < world_; ++o) {
      if (o == rank_ || !in_status_[t][o] || status[o] != 0) continue;
      for (size_t i = 0; i < grants_in_[o].size(); ++i) {
        const CoopGrant& g = grants_in_[o][i];
        if (!g.granted || g.verify_round != t) continue;
        try {
          planner_.CommitTensor(asks_[asks_by_owner_[o][i]].item, Destination(i, o));
          stats_.coop_items_received += 1;
        } catch (...) {
          Fail();
        }
      }
    }
  }

  std::string FirstItemFrom(int o) const {
    for (size_t i = 0; i < grants_in_[o].size(); ++i) {
      if (grants_in_[o][i].granted)
        return asks_[asks_by_owner_[o][i]].item.storage_index.ToString();
    }
    return "its items";
  }

  const LoadPlan& plan_;
  const Metadata& md_;
  ItemStreamer* streamer_;
  LoadPlanner& planner_;
  Communicator& comm_;
  const StorageOptions& options_;
  LoadStats& stats_;
  const int rank_, world_;
  const uint64_t round_bytes_;
  CoopReadResult result_;

  std::vector<CoopAsk> asks_;                       // this rank's
  std::vector<std::vector<size_t>> asks_by_owner_;  // owner -> indices into asks_, in order
  std::vector<std::vector<CoopRequest>> mine_;      // owner -> what this rank asked of it
  std::vector<std::string> theirs_raw_;             // rank -> its requests to this rank
  std::vector<std::vector<CoopRequest>> theirs_;    // decoded and checked
  std::vector<std::vector<CoopGrant>> grants_out_;  // rank -> this owner's answers
  std::vector<std::vector<CoopGrant>> grants_in_;   // owner -> its answers to this rank
  std::vector<std::vector<size_t>> esize_out_;      // rank -> element size of each request
  std::vector<Scatter> scatters_;
  uint32_t own_rounds_ = 0, rounds_ = 0, next_round_ = 0;
  std::vector<std::vector<PieceRef>> out_, in_;            // per round, sorted
  std::vector<std::vector<char>> out_status_, in_status_;  // per round, per peer
  HostBuffer out_arena_, in_arena_;                        // pooled: a round's pieces out, and in
  std::vector<uint64_t> out_at_;  // where each piece of out_[laid_out_] starts, and the end
  uint32_t laid_out_ = UINT32_MAX;
  std::map<size_t, TensorView> landed_;  // ask -> its destination
  std::map<int, bool> owner_reported_;
  bool owner_failed_ = false;
  bool comm_broken_ = false;
};

}  // namespace

// What a failed bulk exchange may still touch: ExchangeBytes' contract leaves the buffers to the
// transport until the communicator is destroyed (a posted MPI receive may still land), which
// this code cannot see. So they are kept for the life of the process, never returned to the pool
// or the heap where another lease or allocation would get them. At most once per communicator:
// a poisoned one exchanges nothing more. (The destinations received into in place are the
// caller's tensors: docs/PROTOCOL.md, "Cooperative reads".)
void KeepForever(HostBuffer in, HostBuffer out, std::vector<uint64_t> status) {
  struct Kept {
    HostBuffer in, out;
    std::vector<uint64_t> status;
  };
  static std::mutex mu;
  static auto* kept = new std::vector<Kept>;  // never destroyed: reachable, not leaked
  std::lock_guard<std::mutex> lock(mu);
  kept->push_back({std::move(in), std::move(out), std::move(status)});
}

std::string CoopItemKey(const ReadItem& item) {
  std::string id = item.dest_index.ToString() + "@";
  for (int64_t v : item.dest_offsets) id += std::to_string(v) + ",";
  id += "<" + item.storage_index.ToString() + "@";
  for (int64_t v : item.storage_offsets) id += std::to_string(v) + ",";
  id += "+";
  for (int64_t v : item.lengths) id += std::to_string(v) + ",";
  return id;
}

CoopReadResult ReadCooperatively(const LoadPlan& plan, const Metadata& md, StorageReader& reader,
                                 LoadPlanner& planner, Communicator& comm,
                                 const StorageOptions& options, LoadStats& stats) {
  return CoopRead(plan, md, reader, planner, comm, options, stats).Run();
}

}  // namespace dcp::protocol
