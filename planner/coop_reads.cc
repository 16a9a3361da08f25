#include "dcp/planner/coop_reads.h"

#include <algorithm>
#include <optional>
#include <unordered_map>

#include "dcp/proto/error.h"
#include "dcp/proto/span_pieces.h"

namespace dcp {

namespace {

void PutU64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void PutU32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>(v >> (8 * i)));
}
void PutShape(std::string& out, const Shape& s) {
  for (int64_t v : s) PutU64(out, static_cast<uint64_t>(v));
}

// Little-endian reads from an untrusted message, every one bounds-checked.
class In {
 public:
  In(std::string_view bytes, std::string what) : bytes_(bytes), what_(std::move(what)) {}
  uint64_t U64() { return Take(8); }
  uint32_t U32() { return static_cast<uint32_t>(Take(4)); }
  uint8_t U8() { return static_cast<uint8_t>(Take(1)); }
  Shape ShapeOf(size_t n) {
    if (n > left() / 8) Fail("truncated");
    Shape s(n);
    for (auto& v : s) v = static_cast<int64_t>(U64());
    return s;
  }
  size_t left() const { return bytes_.size() - pos_; }
  void End() {
    if (pos_ != bytes_.size()) Fail(std::to_string(left()) + " trailing bytes");
  }
  [[noreturn]] void Fail(const std::string& why) const {
    throw CorruptionError("cooperative read: " + what_ + " is malformed: " + why);
  }

 private:
  uint64_t Take(size_t n) {
    if (left() < n) Fail("truncated");
    uint64_t v = 0;
    for (size_t i = 0; i < n; ++i) {
      v |= static_cast<uint64_t>(static_cast<unsigned char>(bytes_[pos_ + i])) << (8 * i);
    }
    pos_ += n;
    return v;
  }
  std::string_view bytes_;
  std::string what_;
  size_t pos_ = 0;
};

uint64_t Sat(uint64_t a, uint64_t b) { return a > UINT64_MAX - b ? UINT64_MAX : a + b; }

}  // namespace

CoopOwners::CoopOwners(const Metadata& md, int world) : world_(std::max(world, 1)) {
  if (md.format_version >= 2) return;
  // Listed metadata: a data file's bytes per file, then files to the least-loaded rank in name
  // order (ties to the lowest rank), so that every rank computes the same owners.
  std::map<std::string, uint64_t> bytes;
  for (const auto& [index, info] : md.storage) {
    bytes[info.relative_path] = Sat(bytes[info.relative_path], info.length);
  }
  std::vector<uint64_t> load(world_, 0);
  for (const auto& [file, n] : bytes) {
    const int r = static_cast<int>(std::min_element(load.begin(), load.end()) - load.begin());
    by_file_[file] = r;
    load[r] = Sat(load[r], n);
  }
}

int CoopOwners::Owner(const Metadata& md, const MetadataIndex& index) const {
  if (md.format_version >= 2) {
    auto e = md.entries.find(index.fqn);
    if (e == md.entries.end() || md.world_size <= 0) return -1;
    const auto* t = std::get_if<TensorMetadata>(&e->second);
    if (t == nullptr) return -1;
    const auto k = ChunkOrdinal(*t, index.offset, index.index);
    if (!k) return -1;
    return OwnerOfWriter(md, ChunkWriter(*t, *k));
  }
  auto s = md.storage.find(index);
  if (s == md.storage.end()) return -1;
  auto f = by_file_.find(s->second.relative_path);
  return f == by_file_.end() ? -1 : f->second;
}

int CoopOwners::OwnerOfWriter(const Metadata& md, int64_t writer) const {
  if (md.format_version < 2 || writer < 0 || writer >= md.world_size) return -1;
  return static_cast<int>(writer * world_ / md.world_size);
}

uint64_t PartialReadCost(const Shape& sizes, size_t esize, const Shape& box_off,
                         const Shape& box_len, bool verify) {
  (void)box_off;
  uint64_t whole = esize;
  for (int64_t v : sizes) whole *= static_cast<uint64_t>(std::max<int64_t>(v, 0));
  if (sizes.empty() || sizes[0] <= 0) return whole;
  const uint64_t row = whole / static_cast<uint64_t>(sizes[0]);
  const uint64_t rows = row * static_cast<uint64_t>(std::max<int64_t>(box_len[0], 0));
  if (box_len == sizes) return whole;  // a whole read checks its CRC as it goes
  // A box that reads every row reads the item front to back and checks its CRC on the way;
  // any other verified partial read streams the whole item once more for it.
  return verify && rows != whole ? Sat(rows, whole) : rows;
}

uint64_t BlockAlignedPartialReadCost(const Shape& sizes, size_t esize, const Shape& box_off,
                                     const Shape& box_len, bool verify, uint32_t log2_block) {
  (void)log2_block;  // blocks absent: a partial read verifies by streaming the whole item
  return PartialReadCost(sizes, esize, box_off, box_len, verify);
}

bool ShouldScatter(uint64_t item_bytes, const std::vector<uint64_t>& costs) {
  if (costs.size() < 2 || item_bytes == 0) return false;
  uint64_t sum = 0;
  for (uint64_t c : costs) sum = Sat(sum, c);
  return sum >= Sat(item_bytes, std::max(item_bytes / 16, kCoopMinWaste));
}

bool ShouldCooperate(const std::vector<ReadRequestSummary>& summaries) {
  uint64_t waste = 0, plan = 0;
  int sharing = 0;
  for (const auto& s : summaries) {
    if (!s.can_share) continue;
    ++sharing;
    waste = Sat(waste, s.coop_waste);
    plan = Sat(plan, s.plan_bytes);
  }
  return sharing > 1 && waste > 0 && waste >= std::max(kCoopMinWaste, plan / 32);
}

namespace {

// fn(item, tensor) for each plain tensor read of `plan`, spans expanded one at a time, until
// fn returns false.
// fn(piece, tensor) for every plain tensor read of `plan`, spans expanded, until fn returns
// false. `span_fn(span, tensor)`, when given, may take a whole span instead: it returns whether to
// go on, or nullopt to have the span's pieces built and passed to fn.
struct NoSpanFn {
  std::optional<bool> operator()(const ReadItem&, const TensorMetadata&) const { return {}; }
};
template <typename Fn, typename SpanFn = NoSpanFn>
void ForEachPlainTensorRead(const LoadPlan& plan, const Metadata& md, Fn&& fn,
                            SpanFn&& span_fn = SpanFn()) {
  const std::string* last_fqn = nullptr;
  const TensorMetadata* t = nullptr;
  std::vector<ReadItem> pieces;
  for (const ReadItem& item : plan.items) {
    if (item.type != ReadItemType::kTensor) continue;
    if (last_fqn == nullptr || *last_fqn != item.storage_index.fqn) {
      auto it = md.entries.find(item.storage_index.fqn);
      t = it == md.entries.end() ? nullptr : std::get_if<TensorMetadata>(&it->second);
      last_fqn = &item.storage_index.fqn;
    }
    if (t == nullptr || item.lengths.empty()) continue;
    if (item.chunk_span <= 1) {
      if (!fn(item, *t)) return;
      continue;
    }
    if (const std::optional<bool> go_on = span_fn(item, *t)) {
      if (!*go_on) return;
      continue;
    }
    size_t used = 0;  // the pieces' memory is reused from span to span
    WriteSpanPieces(item, *t, pieces, used);
    for (size_t i = 0; i < used; ++i) {
      if (!fn(pieces[i], *t)) return;
    }
  }
}

// What a read of the box [off, +len) of a stored chunk of `sizes` fetches beyond the box, or
// nullopt for a box outside the chunk or an empty one.
std::optional<uint64_t> PieceWaste(const Shape& sizes, size_t esize, const Shape& off,
                                   const Shape& len, bool verify) {
  if (sizes.size() != len.size() || off.size() != len.size()) return std::nullopt;
  for (size_t d = 0; d < sizes.size(); ++d) {
    const int64_t o = off[d], n = len[d];
    if (o < 0 || n <= 0 || o > sizes[d] || n > sizes[d] - o) return std::nullopt;
  }
  const uint64_t cost = BlockAlignedPartialReadCost(sizes, esize, off, len, verify,
                                                    /*log2_block=*/0);
  const uint64_t box = static_cast<uint64_t>(NumElements(len)) * esize;
  return cost > box ? cost - box : 0;
}

// The waste of one plain read, or nullopt when it names no chunk of `t` or a box outside it.
std::optional<uint64_t> WasteOf(const ReadItem& item, const TensorMetadata& t, bool verify,
                                ChunkMeta* chunk_out) {
  const auto k = ChunkOrdinal(t, item.storage_index.offset, item.storage_index.index);
  if (!k) return std::nullopt;
  ChunkMeta chunk = ChunkAt(t, *k);
  const auto waste =
      PieceWaste(chunk.sizes, ElementSize(t.dtype), item.storage_offsets, item.lengths, verify);
  if (chunk_out) *chunk_out = std::move(chunk);
  return waste;
}

}  // namespace

std::vector<CoopAsk> CoopAsks(const LoadPlan& plan, const Metadata& md, const CoopOwners& owners,
                              int rank, bool verify, bool own_reads) {
  std::unordered_map<std::string_view, uint32_t> ordinal;
  uint32_t n = 0;
  for (const auto& [fqn, entry] : md.entries) ordinal.emplace(fqn, n++);
  std::vector<CoopAsk> out;
  ForEachPlainTensorRead(plan, md, [&](const ReadItem& item, const TensorMetadata& t) {
    ChunkMeta chunk;
    const auto waste = WasteOf(item, t, verify, &chunk);
    if (!waste) return true;
    const int owner = owners.Owner(md, item.storage_index);
    // Own reads of a tensor stored as one whole chunk stay with read-once (its candidates).
    const bool own = own_reads && owner == rank && !(ChunkCount(t) == 1 && chunk.sizes == t.shape);
    if (owner < 0 || (*waste < kCoopMinWaste && !own)) return true;
    CoopAsk ask;
    ask.owner = owner;
    ask.request = {ordinal.at(item.storage_index.fqn), chunk.offsets, item.storage_offsets,
                   item.lengths};
    ask.item = item;
    ask.waste = *waste;
    out.push_back(std::move(ask));
    return true;
  });
  return out;
}

uint64_t CoopWaste(const LoadPlan& plan, const Metadata& md, const CoopOwners& owners, bool verify,
                   uint64_t stop_at) {
  uint64_t sum = 0;
  auto add = [&](const std::optional<uint64_t>& waste, int owner) {
    if (waste && *waste >= kCoopMinWaste && owner >= 0) sum = Sat(sum, *waste);
    return sum < stop_at;
  };
  // A span's pieces are judged by their numbers (SpanChunk), not built: an all-to-all reshard
  // has millions of them, and every rank walks them all when the waste stays under the bar.
  Shape sizes, off, len;
  ForEachPlainTensorRead(
      plan, md,
      [&](const ReadItem& item, const TensorMetadata& t) {
        return add(WasteOf(item, t, verify, nullptr), owners.Owner(md, item.storage_index));
      },
      [&](const ReadItem& span, const TensorMetadata& t) {
        if (md.format_version < 2) return std::optional<bool>();  // piece by piece
        sizes = t.shape;
        off = span.storage_offsets;
        len = span.lengths;
        const size_t esize = ElementSize(t.dtype);
        bool go_on = true;
        ForEachSpanChunk(span, t, [&](const SpanChunk& c) {
          sizes[c.dim] = c.chunk_end - c.chunk_begin;
          off[c.dim] = c.lo - c.chunk_begin;
          len[c.dim] = c.hi - c.lo;
          go_on = add(PieceWaste(sizes, esize, off, len, verify),
                      owners.OwnerOfWriter(md, ChunkWriter(t, c.k)));
          return go_on;
        });
        return std::optional<bool>(go_on);
      });
  return sum;
}

std::string EncodeCoopRequests(const std::vector<CoopRequest>& requests) {
  std::string out;
  PutU32(out, static_cast<uint32_t>(requests.size()));
  for (const auto& r : requests) {
    PutU32(out, r.entry);
    out.push_back(static_cast<char>(r.chunk_offset.size()));
    PutShape(out, r.chunk_offset);
    PutShape(out, r.box_off);
    PutShape(out, r.box_len);
  }
  return out;
}

std::vector<CoopRequest> DecodeCoopRequests(std::string_view bytes, int rank) {
  In in(bytes, "the read requests of rank " + std::to_string(rank));
  std::vector<CoopRequest> out;
  if (bytes.empty()) return out;
  const uint32_t n = in.U32();
  if (n > in.left() / 5) in.Fail("claims " + std::to_string(n) + " requests");
  out.resize(n);
  for (auto& r : out) {
    r.entry = in.U32();
    const uint8_t dims = in.U8();
    if (dims == 0 || dims > 64) in.Fail("a request of " + std::to_string(dims) + " dimensions");
    r.chunk_offset = in.ShapeOf(dims);
    r.box_off = in.ShapeOf(dims);
    r.box_len = in.ShapeOf(dims);
  }
  in.End();
  return out;
}

std::vector<const std::string*> EntryOrdinals(const Metadata& md) {
  std::vector<const std::string*> out;
  out.reserve(md.entries.size());
  for (const auto& [fqn, entry] : md.entries) out.push_back(&fqn);
  return out;
}

CoopItem CheckCoopRequest(const Metadata& md, const std::vector<const std::string*>& entries,
                          const CoopRequest& request, int rank) {
  auto fail = [&](const std::string& why) -> CoopItem {
    throw CorruptionError("cooperative read: rank " + std::to_string(rank) + " asked for " + why);
  };
  if (request.entry >= entries.size()) return fail("entry " + std::to_string(request.entry));
  CoopItem item;
  item.fqn = entries[request.entry];
  item.tensor = std::get_if<TensorMetadata>(&md.entries.at(*item.fqn));
  if (item.tensor == nullptr) return fail(ClippedName(*item.fqn) + ", which is not a tensor");
  const auto k = ChunkOrdinal(*item.tensor, request.chunk_offset);
  if (!k) return fail("a chunk " + ClippedName(*item.fqn) + " does not have");
  item.ordinal = *k;
  item.chunk = ChunkAt(*item.tensor, *k);
  const Shape& sizes = item.chunk.sizes;
  if (sizes.size() != request.box_off.size() || sizes.size() != request.box_len.size()) {
    return fail("a box of another rank than " + ClippedName(*item.fqn));
  }
  for (size_t d = 0; d < sizes.size(); ++d) {
    const int64_t o = request.box_off[d], n = request.box_len[d];
    if (o < 0 || n <= 0 || o > sizes[d] || n > sizes[d] - o) {
      return fail("a box outside its chunk of " + ClippedName(*item.fqn));
    }
  }
  return item;
}

std::string EncodeCoopGrants(const std::vector<CoopGrant>& grants) {
  std::string out;
  PutU32(out, static_cast<uint32_t>(grants.size()));
  for (const auto& g : grants) {
    out.push_back(static_cast<char>(g.granted ? 1 : 0));
    if (!g.granted) continue;
    PutU32(out, g.verify_round);
    PutU32(out, static_cast<uint32_t>(g.pieces.size()));
    for (const auto& p : g.pieces) {
      PutU32(out, p.round);
      PutU64(out, static_cast<uint64_t>(p.row_begin));
      PutU64(out, static_cast<uint64_t>(p.row_end));
    }
  }
  return out;
}

std::vector<CoopGrant> DecodeCoopGrants(std::string_view bytes,
                                        const std::vector<CoopRequest>& requests, int rank) {
  std::vector<CoopGrant> out(requests.size());
  if (bytes.empty()) return out;
  In in(bytes, "the grants of rank " + std::to_string(rank));
  if (in.U32() != requests.size()) in.Fail("not one answer per request");
  for (size_t i = 0; i < requests.size(); ++i) {
    CoopGrant& g = out[i];
    const uint8_t flag = in.U8();
    if (flag > 1) in.Fail("unknown flag");
    if (flag == 0) continue;
    g.granted = true;
    g.verify_round = in.U32();
    const uint32_t n = in.U32();
    if (n == 0 || n > in.left() / 20) in.Fail("claims " + std::to_string(n) + " pieces");
    g.pieces.resize(n);
    // The pieces must cover the box's rows, in order, each in a round no later than the
    // item's verification.
    int64_t next = requests[i].box_off[0];
    uint32_t last_round = 0;
    for (auto& p : g.pieces) {
      p.round = in.U32();
      p.row_begin = static_cast<int64_t>(in.U64());
      p.row_end = static_cast<int64_t>(in.U64());
      if (p.row_begin != next || p.row_end <= p.row_begin || p.round < last_round ||
          p.round > g.verify_round) {
        in.Fail("pieces that do not cover request " + std::to_string(i) + " in order");
      }
      next = p.row_end;
      last_round = p.round;
    }
    if (next != requests[i].box_off[0] + requests[i].box_len[0]) {
      in.Fail("pieces that do not cover request " + std::to_string(i));
    }
  }
  in.End();
  return out;
}

std::vector<CoopPiece> CutSlabs(int64_t rows, uint64_t row_bytes, uint64_t round_bytes,
                                uint32_t* round, uint64_t* used) {
  std::vector<CoopPiece> out;
  const int64_t per =
      static_cast<int64_t>(std::max<uint64_t>(1, round_bytes / std::max<uint64_t>(row_bytes, 1)));
  for (int64_t r = 0; r < rows; r += per) {
    const int64_t n = std::min(per, rows - r);
    const uint64_t bytes = static_cast<uint64_t>(n) * row_bytes;
    if (*used > 0 && Sat(*used, bytes) > round_bytes) {
      ++*round;
      *used = 0;
    }
    out.push_back({*round, r, r + n});
    *used = Sat(*used, bytes);
  }
  return out;
}

std::vector<CoopPiece> PiecesOf(const std::vector<CoopPiece>& slabs, int64_t b0, int64_t b1) {
  std::vector<CoopPiece> out;
  for (const auto& s : slabs) {
    const int64_t lo = std::max(s.row_begin, b0), hi = std::min(s.row_end, b1);
    if (lo < hi) out.push_back({s.round, lo, hi});
  }
  return out;
}

uint64_t CoopPieceBytes(const Shape& box_len, size_t esize, int64_t rows) {
  uint64_t n = esize * static_cast<uint64_t>(std::max<int64_t>(rows, 0));
  for (size_t d = 1; d < box_len.size(); ++d) n *= static_cast<uint64_t>(box_len[d]);
  return n;
}

uint64_t CoopRoundBytes(uint64_t memory_budget_bytes) {
  return std::max<uint64_t>(memory_budget_bytes / 8, 4096);
}

}  // namespace dcp
