// Cooperative reads on load (read-and-scatter): the pure planning half. Executed by dcp::Load
// (dcp/protocol/coop_read.h).
//
// A resharding read of part of a stored chunk costs more than its bytes: a column box of a
// row-major chunk reads every row whole, and a verified partial read streams the whole item a
// second time for its checksum. When several ranks read parts of one stored item, one rank, its
// *owner*, reads it once, front to back (verifying it), and sends each rank its part over the
// communicator. Read-once of identical whole boxes (read_sharing.h) is the degenerate case.
//
// Everything here is a pure function of the metadata, the world and the messages, so that every
// rank computes the same owners, costs, slabs, rounds and piece sizes: no coordinator gathers the
// requests (an all-to-all reshard makes O(world x tensors) of them). Messages between ranks are
// untrusted: the decoders check every bound and throw CorruptionError naming the sender.
//
// Thread safety: all functions are reentrant; CoopOwners is immutable after construction.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "dcp/planner/read_sharing.h"
#include "dcp/proto/plan.h"

namespace dcp {

/// A request is worth sending only when the partial read it replaces wastes at least this much
/// (bytes read beyond the box): requests then grow with the bytes read, not with the world.
inline constexpr uint64_t kCoopMinWaste = uint64_t{64} << 10;

/// Which rank reads (owns) each stored item in a cooperative load at `world` ranks. Version 2:
/// the writer w of the item maps to w * world / saved_world (contiguous, byte-balanced for
/// equal shards; at the saved world the owner is the writer, which read-wise is the rank that
/// reads it anyway). Otherwise (version 1, PyTorch DCP, safetensors: the metadata lists every
/// item and its file): whole data files go to ranks, greedily by bytes in name order.
class CoopOwners {
 public:
  CoopOwners(const Metadata& md, int world);
  /// The owner of stored item `index` (a tensor chunk), or -1 when the metadata does not say
  /// (the item is then read by whoever needs it).
  int Owner(const Metadata& md, const MetadataIndex& index) const;
  /// The owner of what rank `writer` wrote in a version-2 checkpoint, or -1 (version 1, or no
  /// such writer).
  int OwnerOfWriter(const Metadata& md, int64_t writer) const;

 private:
  int world_ = 1;
  std::map<std::string, int> by_file_;  // listed metadata: data file -> owner
};

/// Bytes a partial read of the box [box_off, +box_len) of a stored raw chunk of shape `sizes`
/// (elements of `esize` bytes) fetches from storage (StoreReader's ReadBox): the rows of the
/// first dimension the box touches, whole, plus the whole item again when a verified partial
/// read must stream it for its checksum (`verify`, and the box does not already read every row).
/// Blocks (per-block checksums) are not modelled yet: see BlockAlignedPartialReadCost.
uint64_t PartialReadCost(const Shape& sizes, size_t esize, const Shape& box_off,
                         const Shape& box_len, bool verify);
/// Hook for per-block checksums: what a verified partial read costs when the item has a block
/// table of 2^log2_block-byte blocks (rows widened to block bounds). Until readers verify by
/// block it returns PartialReadCost(..., verify) for log2_block == 0 (no blocks).
uint64_t BlockAlignedPartialReadCost(const Shape& sizes, size_t esize, const Shape& box_off,
                                     const Shape& box_len, bool verify, uint32_t log2_block);

/// Whether an owner scatters a stored item of `item_bytes` raw bytes that `requests` reads ask
/// for, each costing `costs[i]` when read alone: at least two requests, and their reads together
/// cost at least the item plus max(item/16, kCoopMinWaste).
bool ShouldScatter(uint64_t item_bytes, const std::vector<uint64_t>& costs);

/// Coordinator, from every rank's summary: whether the load reads cooperatively (at least two
/// ranks take part, and their summed coop_waste is at least max(kCoopMinWaste, plan bytes / 32)).
bool ShouldCooperate(const std::vector<ReadRequestSummary>& summaries);

/// One rank's request to an owner: the box [box_off, +box_len) of the stored chunk that starts at
/// `chunk_offset` in tensor entry number `entry` (ordinal in Metadata::entries order).
struct CoopRequest {
  uint32_t entry = 0;
  Shape chunk_offset;
  Shape box_off;
  Shape box_len;
  bool operator==(const CoopRequest&) const = default;
};
std::string EncodeCoopRequests(const std::vector<CoopRequest>& requests);
/// CorruptionError naming `rank` (the sender) for a malformed message.
std::vector<CoopRequest> DecodeCoopRequests(std::string_view bytes, int rank);

/// One plain tensor read of a rank's plan that may be served by its owner.
struct CoopAsk {
  int owner = -1;
  CoopRequest request;
  ReadItem item;       // the plain item (a span's piece) it stands for
  uint64_t waste = 0;  // PartialReadCost - box bytes
};
/// The reads of `plan` (spans expanded one at a time) worth asking their owner for: those whose
/// partial read wastes at least kCoopMinWaste, plus, with `own_reads`, every read of an item this
/// rank (`rank`) owns (so that an owner that scatters an item also serves itself from that one
/// read). Tensors of at least one dimension only; in plan order. `verify`: checksums are verified.
std::vector<CoopAsk> CoopAsks(const LoadPlan& plan, const Metadata& md, const CoopOwners& owners,
                              int rank, bool verify, bool own_reads);
/// Sum of the asks' waste (ReadRequestSummary::coop_waste), without keeping them; the walk stops
/// once the sum reaches `stop_at` (a rank reports enough to pass ShouldCooperate's bar for its
/// share of the plan, without expanding a large reshard plan twice).
uint64_t CoopWaste(const LoadPlan& plan, const Metadata& md, const CoopOwners& owners, bool verify,
                   uint64_t stop_at = UINT64_MAX);

/// Entry names in Metadata::entries order (what CoopRequest::entry indexes).
std::vector<const std::string*> EntryOrdinals(const Metadata& md);

/// The stored chunk a request names, checked: a tensor entry with a chunk at chunk_offset of the
/// request's rank, and a non-empty box inside it. CorruptionError naming `rank` otherwise.
struct CoopItem {
  const std::string* fqn = nullptr;
  const TensorMetadata* tensor = nullptr;
  ChunkMeta chunk;
  size_t ordinal = 0;  // of the chunk in the tensor
};
CoopItem CheckCoopRequest(const Metadata& md, const std::vector<const std::string*>& entries,
                          const CoopRequest& request, int rank);

/// One piece of a granted request: the rows [row_begin, row_end) (of the stored chunk's first
/// dimension) of the box, sent in round `round`.
struct CoopPiece {
  uint32_t round = 0;
  int64_t row_begin = 0;
  int64_t row_end = 0;
  bool operator==(const CoopPiece&) const = default;
};
/// An owner's answer to one request. Not granted: the requester reads the box itself. Granted:
/// its pieces cover the box's rows in order, and after round `verify_round` (the item's last
/// slab, whose status says whether the whole item verified) the requester may commit it.
struct CoopGrant {
  bool granted = false;
  uint32_t verify_round = 0;
  std::vector<CoopPiece> pieces;
  bool operator==(const CoopGrant&) const = default;
};
std::string EncodeCoopGrants(const std::vector<CoopGrant>& grants);
/// `requests`: what this rank asked of the sender (`rank`). CorruptionError naming `rank` for a
/// malformed message, a count other than requests.size(), or pieces that do not cover the
/// request's rows in order. An empty message grants nothing.
std::vector<CoopGrant> DecodeCoopGrants(std::string_view bytes,
                                        const std::vector<CoopRequest>& requests, int rank);

/// Slabs of one stored item: row ranges of at most max(1, round_bytes / row_bytes) rows, each
/// placed in a round: the current one (`*round`, holding `*used` bytes) while it has room for the
/// slab, else the next. Returns {row_begin, row_end, round} per slab; updates *round and *used.
std::vector<CoopPiece> CutSlabs(int64_t rows, uint64_t row_bytes, uint64_t round_bytes,
                                uint32_t* round, uint64_t* used);
/// The pieces of a box of rows [b0, b1) over `slabs`: its rows within each slab it meets.
std::vector<CoopPiece> PiecesOf(const std::vector<CoopPiece>& slabs, int64_t b0, int64_t b1);

/// Bytes of one piece: `rows` rows of the box, packed row-major (box_len[1..] elements per row).
uint64_t CoopPieceBytes(const Shape& box_len, size_t esize, int64_t rows);

/// The bytes each round of a cooperative load may hold (stored bytes of its slabs): an eighth of
/// the memory budget (the round being exchanged, its packed pieces and the staging of what a rank
/// receives), at least one 4 KiB page.
uint64_t CoopRoundBytes(uint64_t memory_budget_bytes);

}  // namespace dcp
