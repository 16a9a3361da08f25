#include "dcp/protocol/rule_exchange.h"

#include <algorithm>
#include <cstring>
#include <string>

#include "dcp/planner/coop_reads.h"
#include "dcp/proto/error.h"
#include "dcp/proto/staging.h"
#include "dcp/protocol/coop_read.h"

namespace dcp::protocol {

namespace {

// Every message of a round opens with the owner's status: 0 when it read and verified every
// chunk the message carries pieces of.
constexpr size_t kStatusBytes = 8;

class RuleExchange {
 public:
  RuleExchange(const LoadPlan& plan, const Metadata& md, const RuleReadTable& table,
               StorageReader& reader, LoadPlanner& planner, Communicator& comm,
               const StorageOptions& options, LoadStats& stats)
      : plan_(plan),
        reads_(table.reads),
        streamer_(reader.item_streamer()),
        planner_(planner),
        comm_(comm),
        stats_(stats),
        rank_(comm.rank()),
        world_(comm.size()),
        owners_(md.world_size, comm.size()),
        rounds_(RuleRounds(table.reads, md.world_size, comm.size(),
                           CoopRoundBytes(options.memory_budget_bytes))) {
    result_.served.assign(plan.items.size(), 0);
  }

  RuleExchangeResult Run() {
    stats_.rule_rounds = rounds_.size();
    for (size_t r = 0; r < rounds_.size() && !result_.error; ++r) {
      const size_t end = r + 1 < rounds_.size() ? rounds_[r + 1] : reads_.size();
      RunRound(rounds_[r], end);
    }
    return std::move(result_);
  }

 private:
  // Round [b, e) of the table: size both sides' messages, read and pack as the owner, exchange,
  // place and commit what arrived whole and verified.
  void RunRound(size_t b, size_t e) {
    // Messages out: [status][pieces for rank f, by read then writer], for each f with pieces;
    // messages in: what each owner sends this rank, in the same order. This rank's pieces from
    // itself are read from its out buffer.
    const std::vector<uint64_t> out_bytes =
        RuleMessageBytes(reads_, b, e, owners_, rank_, -1, world_);
    std::vector<uint64_t> in_bytes = RuleMessageBytes(reads_, b, e, owners_, -1, rank_, world_);
    in_bytes[rank_] = 0;
    std::vector<uint64_t> out_at(world_ + 1, 0), in_at(world_ + 1, 0);
    std::copy(out_bytes.begin(), out_bytes.end(), out_at.begin() + 1);
    std::copy(in_bytes.begin(), in_bytes.end(), in_at.begin() + 1);
    for (int p = 0; p < world_; ++p) {
      out_at[p + 1] += out_at[p] + (out_at[p + 1] > 0 ? kStatusBytes : 0);
      in_at[p + 1] += in_at[p] + (in_at[p + 1] > 0 ? kStatusBytes : 0);
    }
    HostBuffer out(static_cast<size_t>(std::max<uint64_t>(out_at[world_], 1)));
    HostBuffer in(static_cast<size_t>(std::max<uint64_t>(in_at[world_], 1)));
    const uint64_t status = Pack(b, e, out, out_at) ? 0 : 1;
    std::vector<Communicator::BulkSend> sends;
    std::vector<Communicator::BulkReceive> receives;
    for (int p = 0; p < world_; ++p) {
      const size_t n_out = static_cast<size_t>(out_at[p + 1] - out_at[p]);
      if (n_out > 0) std::memcpy(out.data() + out_at[p], &status, kStatusBytes);
      if (n_out > 0 && p != rank_) {
        sends.push_back({p, out.data() + out_at[p], n_out});
        stats_.rule_bytes_sent += n_out - kStatusBytes;
      }
      const size_t n_in = static_cast<size_t>(in_at[p + 1] - in_at[p]);
      if (n_in > 0) receives.push_back({p, in.data() + in_at[p], n_in});
    }
    try {
      comm_.ExchangeBytes(sends, receives, "load/rule-data");
    } catch (...) {
      result_.error = std::current_exception();
      KeepForever(std::move(in), std::move(out), {});
      return;
    }
    // Where each owner's message starts; this rank's own is in its out buffer.
    std::vector<const char*> from(world_, nullptr);
    for (int o = 0; o < world_; ++o) {
      if (o == rank_) {
        if (out_at[o + 1] > out_at[o]) from[o] = out.data() + out_at[o];
      } else if (in_at[o + 1] > in_at[o]) {
        from[o] = in.data() + in_at[o];
        stats_.rule_bytes_received += in_at[o + 1] - in_at[o] - kStatusBytes;
      }
    }
    Place(b, e, from);
  }

  // As an owner: each chunk of the round's reads this rank owns, streamed whole (verified), its
  // pieces copied into each receiver's message. False when a chunk could not be had: the
  // messages then carry what they hold, and their status tells the receivers to read it
  // themselves.
  bool Pack(size_t b, size_t e, HostBuffer& out, const std::vector<uint64_t>& out_at) {
    if (out_at[world_] == 0) return true;
    std::vector<uint64_t> cursor(out_at.begin(), out_at.end() - 1);
    for (uint64_t& c : cursor) c += kStatusBytes;
    try {
      if (streamer_ == nullptr) return false;
      for (size_t i = b; i < e; ++i) {
        const RuleRead& read = reads_[i];
        const auto [w0, w1] = owners_.WritersOf(rank_, read.chunks);
        for (int64_t w = w0; w < w1; ++w) {
          const ChunkMeta chunk = ChunkAt(*read.saved, static_cast<size_t>(w));
          const MetadataIndex index{*read.fqn, chunk.offsets, static_cast<int32_t>(w)};
          const uint64_t bytes = static_cast<uint64_t>(NumElements(chunk.sizes)) * read.esize;
          if (bytes == 0) continue;
          if (streamer_->StreamableLength(index) != bytes) return false;
          streamer_->StreamItem(index, bytes, [&](uint64_t offset, const char* data, size_t n) {
            if (offset != 0 || n != bytes) {
              throw InternalError("rule exchange: " + index.ToString() + " streamed in parts");
            }
            ForEachPieceOfChunk(read, w, [&](const RulePiece& p) {
              CopyRulePiece(read, p, const_cast<char*>(data), /*holder_is_chunk=*/true,
                            out.data() + cursor[p.f], /*to_packed=*/true);
              cursor[p.f] += p.bytes;
            });
          });
        }
      }
      return true;
    } catch (...) {
      return false;  // the receivers read it themselves, and meet the same error there, named
    }
  }

  // As a receiver: each read of the round, from every owner's message in order; committed when
  // every owner it needed sent a good status. A read that cannot be placed here (its destination
  // could not be had, or an owner failed) is left to the rank's own read, which says why.
  void Place(size_t b, size_t e, const std::vector<const char*>& from) {
    std::vector<uint64_t> cursor(world_, kStatusBytes);
    for (size_t i = b; i < e; ++i) {
      const RuleRead& read = reads_[i];
      const ReadItem& item = plan_.items[read.item];
      TensorView dst, staged;
      char* box = nullptr;   // the slice as one contiguous host array of the stored dtype
      bool strided = false;  // else a host view of the stored dtype, copied into piece by piece
      try {
        dst = planner_.ResolveTensor(item);
        const bool host = dst.device.is_cpu() && dst.data != nullptr &&
                          dst.dtype == read.saved->dtype && dst.shape == item.lengths;
        strided = host && !dst.is_contiguous();
        if (host && !strided) box = static_cast<char*>(dst.data);
        // Otherwise (a device tensor): a staging copy of the box, copied over once.
        if (!host) {
          staged = TensorView::Allocate(read.saved->dtype, item.lengths);
          box = static_cast<char*>(staged.data);
        }
      } catch (...) {
        box = nullptr;
        strided = false;
      }
      bool whole = box != nullptr || strided;
      Shape off, len;
      for (int o = 0; o < world_; ++o) {
        if (from[o] == nullptr) continue;
        uint64_t status = 0;
        std::memcpy(&status, from[o], kStatusBytes);
        whole = whole && status == 0;
        ForEachRulePiece(read, owners_, o, rank_, [&](const RulePiece& p) {
          char* packed = const_cast<char*>(from[o]) + cursor[o];
          cursor[o] += p.bytes;
          if (status != 0 || !whole) return;
          if (box != nullptr) {
            CopyRulePiece(read, p, box, /*holder_is_chunk=*/false, packed, /*to_packed=*/false);
            return;
          }
          try {
            RulePieceBox(read, p, /*holder_is_chunk=*/false, off, len);
            CopyTensor(dst.Narrow(off, len), TensorView::FromContiguous(packed, dst.dtype, len));
          } catch (...) {
            whole = false;  // left to the rank's own read, as below
          }
        });
      }
      if (whole) {
        try {
          if (staged.data != nullptr) CopyTensor(dst, staged);
          planner_.CommitTensor(item, dst);
          result_.served[read.item] = 1;
          ++stats_.rule_items;
          continue;
        } catch (...) {
          // Left to the rank's own read, as below.
        }
      }
      ++stats_.rule_items_fallen_back;
    }
  }

  const LoadPlan& plan_;
  const std::vector<RuleRead>& reads_;
  ItemStreamer* streamer_;
  LoadPlanner& planner_;
  Communicator& comm_;
  LoadStats& stats_;
  const int rank_, world_;
  const RuleOwnerMap owners_;
  const std::vector<size_t> rounds_;
  RuleExchangeResult result_;
};

}  // namespace

bool CanServeRuleReads(const RuleReadTable& table, ItemStreamer* streamer, int rank, int world,
                       int64_t saved_world) {
  if (streamer == nullptr) return false;
  const RuleOwnerMap owners(saved_world, world);
  for (const RuleRead& read : table.reads) {
    const auto [w0, w1] = owners.WritersOf(rank, read.chunks);
    if (w0 >= w1) continue;
    const ChunkMeta chunk = ChunkAt(*read.saved, static_cast<size_t>(w0));
    try {
      return streamer->StreamableLength({*read.fqn, chunk.offsets, static_cast<int32_t>(w0)}) ==
             static_cast<uint64_t>(NumElements(chunk.sizes)) * read.esize;
    } catch (const Error&) {
      return false;  // the rank's own reads meet it, and say what it is
    }
  }
  return true;
}

RuleExchangeResult ExchangeByRule(const LoadPlan& plan, const Metadata& md,
                                  const RuleReadTable& table, StorageReader& reader,
                                  LoadPlanner& planner, Communicator& comm,
                                  const StorageOptions& options, LoadStats& stats) {
  return RuleExchange(plan, md, table, reader, planner, comm, options, stats).Run();
}

}  // namespace dcp::protocol
