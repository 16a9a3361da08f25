// Rule exchange on load: the pure planning half. Executed by dcp::Load
// (dcp/protocol/rule_exchange.h).
//
// A reshard from one rule to another (saved row-sharded at N ranks, loaded column-sharded at M)
// makes every loading rank need a piece of every saved chunk of every tensor: O(M x N x tensors)
// pieces, 6.8 M per rank at 4,096 ranks, mostly a few bytes each. Handled one piece at a time
// (a read item, an ask, a grant each) that is seconds of CPU and gigabytes per rank before a
// byte moves. But when both layouts are rules, every rank can compute every piece by arithmetic:
// which rank's slice meets which saved chunk, and where. So nothing is asked or granted:
//   - each rank finds the reads of its plan that are its whole slice under a rule, of a tensor
//     saved under another rule that a partial read would fetch scattered (FindRuleReads), and
//     the coordinator checks that every rank found the same table (a hash in its summary);
//   - each saved chunk's *owner* (CoopOwners, the rank its writer maps to) reads it whole,
//     verified, and packs every rank's piece of it into that rank's message;
//   - each rank places what its owners send by the same arithmetic.
// Planning is O(tensors) per rank; what remains per piece is a bounded strided copy on each side
// (ForEachRulePiece, CopyRulePiece), and rounds (RuleRounds) keep what an owner
// holds within the memory budget's round size.
//
// Thread safety: all functions are reentrant.
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "dcp/planner/read_sharing.h"
#include "dcp/proto/plan.h"

namespace dcp {

/// A rule's slices of one extent, computed without a division (RegularSlice's, precomputed).
struct RuleSlicer {
  int64_t extent = 0;
  int64_t world = 1;
  RegularRule rule = kRuleBalanced;
  int64_t base = 0, extra = 0;  // kRuleBalanced: extent / world, extent % world
  int64_t ceil = 0;             // kRuleCeil: ceil(extent / world)
  static RuleSlicer Of(int64_t extent, int64_t world, RegularRule rule);
  /// RegularSlice(extent, r, world, rule).
  std::pair<int64_t, int64_t> Slice(int64_t r) const {
    if (rule == kRuleCeil) {
      const int64_t b = std::min(extent, ceil * r);
      return {b, std::min(extent, b + ceil)};
    }
    const int64_t b = r * base + std::min(r, extra);
    return {b, b + base + (r < extra ? 1 : 0)};
  }
  /// The slice that holds unit u (0 <= u < extent).
  int64_t Holding(int64_t u) const;
};

/// One read of a rank's load plan served by rule exchange: the whole of the rank's slice, under
/// `load`, of a tensor the checkpoint stores under a rule.
struct RuleRead {
  uint32_t item = 0;   // index into the rank's load plan
  uint32_t entry = 0;  // ordinal in Metadata::entries
  const std::string* fqn = nullptr;
  const TensorMetadata* saved = nullptr;  // points into the metadata it was found in
  RegularLayout load;                     // world: the loading world
  size_t esize = 0;                       // bytes per element
  /// Elements of one unit along the stored dimension and one along the load dimension (one
  /// unit along the shared dimension when they are the same): the product of the other extents.
  uint64_t cross_elems = 0;
  RuleSlicer stored, loaded;  // the saved rule's chunks and the load's slices
  int64_t chunks = 0;         // ChunkCount(*saved)
  /// The tensor as five dimensions for the copies: [outer, A, middle, B, inner], A and B the
  /// stored and the load dimension in order (the same one when they are equal: then middle and
  /// B are 1), the others multiplied together.
  uint64_t outer = 1, middle = 1, inner = 1;
};
/// A RuleRead of `saved` (fqn `fqn`, entry `entry`, plan item `item`) under `load`.
RuleRead MakeRuleRead(uint32_t item, uint32_t entry, const std::string& fqn,
                      const TensorMetadata& saved, RegularLayout load);

/// A rank's rule reads, by entry ordinal, and the hash of what every rank must find alike
/// ((entry, dim, rule) in order, the world and the round size); hash 0 when there are none.
struct RuleReadTable {
  std::vector<RuleRead> reads;
  uint64_t hash = 0;
};

/// The reads of `plan` (rank `rank` of `world`) that rule exchange serves. A tensor read (a span
/// or a plain item) qualifies when the metadata is version 2 or later and stores the tensor
/// under a rule; its box is, along exactly one dimension d, the rank's slice under one rule at
/// `world` (`first` checked first: a slice both rules produce says nothing of the others')
/// and whole elsewhere, with every rank's slice non-empty;
/// the stored layout differs from that one; a partial read of it would not be one contiguous
/// range of each chunk (d or the stored dimension is not the first non-unit one, or they
/// differ); and what one owner holds of it (RuleOwnerBoundBytes) fits `round_bytes`. An entry
/// read by more than one item takes part with its first only.
RuleReadTable FindRuleReads(const LoadPlan& plan, const Metadata& md, int rank, int world,
                            uint64_t round_bytes, RegularRule first = kRuleBalanced);

/// Coordinator, from every rank's summary: whether the load exchanges its rule reads, and by which
/// table: every rank may share, and all found the same non-empty table checking kRuleBalanced
/// first (rule_hash), or else all did checking kRuleCeil first (rule_hash_ceil_first: a load cut
/// as torch.chunk cuts, whose rank 0 cannot tell). The rule checked first, or nullopt.
std::optional<RegularRule> RuleExchangeOrder(const std::vector<ReadRequestSummary>& summaries);

/// `plan` without the items `served` marks (one flag per item).
LoadPlan WithoutItems(const LoadPlan& plan, const std::vector<char>& served);

/// The writers whose chunks each owner reads: CoopOwners::OwnerOfWriter (w -> w * world /
/// saved_world) inverted once for a load.
class RuleOwnerMap {
 public:
  RuleOwnerMap(int64_t saved_world, int world);
  /// [first, last) of `owner`, clipped to `chunks`.
  std::pair<int64_t, int64_t> WritersOf(int owner, int64_t chunks) const {
    return {std::min(first_[owner], chunks), std::min(first_[owner + 1], chunks)};
  }

 private:
  std::vector<int64_t> first_;  // world + 1 bounds
};

/// The most stored bytes of `read`'s tensor any one owner reads.
uint64_t RuleOwnerBoundBytes(const RuleRead& read, int64_t saved_world, int world);

/// Rounds of a rule exchange: the index of each round's first read in `reads` (reads are never
/// split), cut so that each round's summed RuleOwnerBoundBytes is at most `round_bytes` or it
/// holds one read. The same on every rank that has the same table.
std::vector<size_t> RuleRounds(const std::vector<RuleRead>& reads, int64_t saved_world, int world,
                               uint64_t round_bytes);

/// The part of writer `w`'s chunk that rank `f`'s slice needs. The chunk is [chunk_lo, chunk_hi)
/// along the stored dimension, the slice [slice_lo, slice_hi) along the load dimension (tensor
/// coordinates, whole elsewhere); the piece is their intersection. Empty when `bytes` is 0.
struct RulePiece {
  int64_t w = 0, f = 0;
  int64_t chunk_lo = 0, chunk_hi = 0;
  int64_t slice_lo = 0, slice_hi = 0;
  uint64_t bytes = 0;
};
RulePiece RulePieceOf(const RuleRead& read, int64_t w, int64_t f);
/// The bytes of the piece whose chunk and slice bounds `p` holds.
inline uint64_t RulePieceBytes(const RuleRead& read, const RulePiece& p) {
  int64_t units = 0;
  if (read.saved->regular->dim == read.load.dim) {
    units =
        std::max<int64_t>(0, std::min(p.chunk_hi, p.slice_hi) - std::max(p.chunk_lo, p.slice_lo));
  } else if (p.chunk_lo < p.chunk_hi && p.slice_lo < p.slice_hi) {
    units = (p.chunk_hi - p.chunk_lo) * (p.slice_hi - p.slice_lo);
  }
  return static_cast<uint64_t>(units) * read.cross_elems * read.esize;
}

/// The bytes of the messages of one round (reads [b, e)), before any piece is copied: with f >= 0,
/// what each owner sends rank f; with owner >= 0 (and f < 0), what `owner` sends each rank. One
/// entry per rank. Reads of one geometry (shape, both rules, element size: a model's many
/// same-shaped tensors) are walked once and counted as many times as they occur.
std::vector<uint64_t> RuleMessageBytes(const std::vector<RuleRead>& reads, size_t b, size_t e,
                                       const RuleOwnerMap& owners, int owner, int64_t f, int world);

/// fn(piece) for each rank's non-empty piece of writer w's chunk of `read`, by rank (only ranks
/// whose slice meets the chunk are visited).
template <typename Fn>
void ForEachPieceOfChunk(const RuleRead& read, int64_t w, Fn&& fn);

/// fn(piece) for each non-empty piece that owner `owner` sends rank `f` (f's slice) of `read`, in
/// writer order; or, with f < 0, for every piece the owner sends anyone, by writer then by
/// receiving rank.
template <typename Fn>
void ForEachRulePiece(const RuleRead& read, const RuleOwnerMap& owners, int owner, int64_t f,
                      Fn&& fn);

/// `piece`'s box [off, off + len) in the array that holds it: writer w's chunk
/// (`holder_is_chunk`) or rank f's slice. For the copies a plain strided copy does.
void RulePieceBox(const RuleRead& read, const RulePiece& piece, bool holder_is_chunk, Shape& off,
                  Shape& len);

/// Copy `piece`'s bytes between `packed` and the array that holds it: writer w's chunk (as
/// stored, `holder_is_chunk`) or rank f's slice (its box in the load plan).
void CopyRulePiece(const RuleRead& read, const RulePiece& piece, char* holder, bool holder_is_chunk,
                   char* packed, bool to_packed);

// ---- implementation of the templates ----

template <typename Fn>
void ForEachPieceOfChunk(const RuleRead& read, int64_t w, Fn&& fn) {
  RulePiece p;
  p.w = w;
  std::tie(p.chunk_lo, p.chunk_hi) = read.stored.Slice(w);
  if (p.chunk_lo >= p.chunk_hi) return;
  int64_t f0 = 0, f1 = read.load.world;
  if (read.saved->regular->dim == read.load.dim) {
    f0 = read.loaded.Holding(p.chunk_lo);
    f1 = read.loaded.Holding(p.chunk_hi - 1) + 1;
  }
  for (p.f = f0; p.f < f1; ++p.f) {
    std::tie(p.slice_lo, p.slice_hi) = read.loaded.Slice(p.f);
    p.bytes = RulePieceBytes(read, p);
    if (p.bytes > 0) fn(p);
  }
}

template <typename Fn>
void ForEachRulePiece(const RuleRead& read, const RuleOwnerMap& owners, int owner, int64_t f,
                      Fn&& fn) {
  const auto [w0, w1] = owners.WritersOf(owner, read.chunks);
  if (f < 0) {
    for (int64_t w = w0; w < w1; ++w) ForEachPieceOfChunk(read, w, fn);
    return;
  }
  RulePiece p;
  p.f = f;
  std::tie(p.slice_lo, p.slice_hi) = read.loaded.Slice(f);
  for (p.w = w0; p.w < w1; ++p.w) {
    std::tie(p.chunk_lo, p.chunk_hi) = read.stored.Slice(p.w);
    p.bytes = RulePieceBytes(read, p);
    if (p.bytes > 0) fn(p);
  }
}

}  // namespace dcp
