#include "dcp/proto/schema/codec.h"

#include <google/protobuf/arena.h>
#include <google/protobuf/io/coded_stream.h>
#include <google/protobuf/io/zero_copy_stream_impl_lite.h>
#include <google/protobuf/wire_format_lite.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <queue>
#include <set>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "dcp/proto/checksum.h"
#include "schema/dcp.pb.h"  // generated from proto/schema/dcp.proto

namespace dcp {

namespace {

constexpr char kMagic[8] = {'D', 'C', 'P', 'M', 'E', 'T', 'A', '1'};

template <typename Repeated>
Shape ToShape(const Repeated& r) {
  return Shape(r.begin(), r.end());
}
template <typename Repeated>
void FromShape(const Shape& s, Repeated* r) {
  r->Clear();
  for (int64_t v : s) r->Add(v);
}

DType ToDType(int v, std::string_view source) {
  if (!IsValidDType(v)) {
    throw CorruptionError(std::string(source) + ": unknown dtype value " + std::to_string(v));
  }
  return static_cast<DType>(v);
}

void ToPb(const MetadataIndex& i, pb::MetadataIndex* p) {
  p->set_fqn(i.fqn);
  FromShape(i.offset, p->mutable_offset());
  p->set_index(i.index.value_or(-1));
}
MetadataIndex FromPb(const pb::MetadataIndex& p) {
  MetadataIndex i;
  i.fqn = p.fqn();
  i.offset = ToShape(p.offset());
  if (p.index() >= 0) i.index = p.index();
  return i;
}

void ToPb(const ChunkMeta& c, pb::Chunk* p) {
  FromShape(c.offsets, p->mutable_offsets());
  FromShape(c.sizes, p->mutable_sizes());
}
ChunkMeta FromPb(const pb::Chunk& p) { return {ToShape(p.offsets()), ToShape(p.sizes())}; }

void ToPb(const StorageInfo& s, pb::StorageInfo* p) {
  p->set_relative_path(s.relative_path);
  p->set_offset(s.offset);
  p->set_length(s.length);
  p->set_has_crc32c(s.crc32c.has_value());
  p->set_crc32c(s.crc32c.value_or(0));
  for (const auto& t : s.transforms) p->add_transforms(t);
  p->set_raw_length(s.raw_length);
}
StorageInfo FromPb(const pb::StorageInfo& p) {
  StorageInfo s;
  s.relative_path = p.relative_path();
  s.offset = p.offset();
  s.length = p.length();
  if (p.has_crc32c()) s.crc32c = p.crc32c();
  s.transforms.assign(p.transforms().begin(), p.transforms().end());
  s.raw_length = p.raw_length();
  return s;
}

// Plans and metadata hold millions of small messages at scale (a 1,024-rank save plans ~3M
// items); building and parsing them on an arena turns a malloc/free pair per message into a
// pointer bump (the heap work was over half of the coordinator's planning time in
// dcp-scale-bench). Blocks grow to a few MiB so that huge messages use few of them.
//
// Not under ThreadSanitizer: with Debian's (uninstrumented) libprotobuf, any arena crashes a
// TSan build when it is destroyed (SerialArena::CleanupList frees a pointer TSan's allocator
// never returned; a ten-line program shows it). TSan builds use plain heap messages: same
// bytes, same behaviour, only slower.
#if defined(__SANITIZE_THREAD__)
#define DCP_CODEC_ARENA 0
#elif defined(__has_feature)
#if __has_feature(thread_sanitizer)
#define DCP_CODEC_ARENA 0
#endif
#endif
#ifndef DCP_CODEC_ARENA
#define DCP_CODEC_ARENA 1
#endif

template <typename Msg>
class CodecMessage {
 public:
#if DCP_CODEC_ARENA
  CodecMessage() : arena_(Options()), msg_(google::protobuf::Arena::CreateMessage<Msg>(&arena_)) {}
  Msg& operator*() { return *msg_; }

 private:
  static google::protobuf::ArenaOptions Options() {
    google::protobuf::ArenaOptions o;
    o.start_block_size = 4096;
    o.max_block_size = 4 << 20;
    return o;
  }
  google::protobuf::Arena arena_;
  Msg* msg_;
#else
  Msg& operator*() { return msg_; }

 private:
  Msg msg_;
#endif
};

template <typename Msg>
void Parse(Msg* msg, std::string_view bytes, std::string_view what) {
  if (!msg->ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    throw CorruptionError("cannot parse " + std::string(what) + " (" +
                          std::to_string(bytes.size()) + " bytes)");
  }
}

void PutLe(std::string* out, uint64_t v, int n) {
  for (int i = 0; i < n; ++i) out->push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe(const char* p, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i)
    v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

using ChunkPair = std::pair<size_t, size_t>;

// The chunks of one tensor, by index: where each starts and ends along a dimension.
struct ChunkSpans {
  const std::vector<ChunkMeta>& chunks;
  int64_t start(size_t i, size_t d) const { return chunks[i].offsets[d]; }
  int64_t end(size_t i, size_t d) const { return chunks[i].offsets[d] + chunks[i].sizes[d]; }
  bool intersect(size_t a, size_t b) const { return Intersect(chunks[a], chunks[b]).has_value(); }
  // Sort chunk indices by their start along d.
  void SortByStart(std::vector<size_t>& order, size_t d) const {
    std::sort(order.begin(), order.end(),
              [&](size_t a, size_t b) { return start(a, d) < start(b, d); });
  }
};

// The dimensions along which some chunk of `order` is not whole.
std::vector<size_t> PartialDims(const std::vector<ChunkMeta>& chunks,
                                const std::vector<size_t>& order, const Shape& shape) {
  std::vector<size_t> dims;
  for (size_t d = 0; d < shape.size(); ++d) {
    for (size_t i : order) {
      if (chunks[i].offsets[d] != 0 || chunks[i].sizes[d] != shape[d]) {
        dims.push_back(d);
        break;
      }
    }
  }
  return dims;
}

// One partial dimension, d (see FindOverlap).
std::optional<ChunkPair> OverlapAlongOne(const ChunkSpans& x, std::vector<size_t> order, size_t d) {
  x.SortByStart(order, d);
  size_t reach = order[0];  // the chunk reaching furthest so far
  for (size_t k = 1; k < order.size(); ++k) {
    const size_t i = order[k];
    if (x.start(i, d) < x.end(reach, d)) return std::make_pair(reach, i);
    if (x.end(i, d) > x.end(reach, d)) reach = i;
  }
  return std::nullopt;
}

// Two partial dimensions, d0 and d1 (see FindOverlap).
std::optional<ChunkPair> OverlapAlongTwo(const ChunkSpans& x, std::vector<size_t> order, size_t d0,
                                         size_t d1) {
  x.SortByStart(order, d0);
  using Alive = std::pair<int64_t, size_t>;  // (end along d0, chunk)
  std::priority_queue<Alive, std::vector<Alive>, std::greater<Alive>> by_end;
  std::map<int64_t, size_t> by_start;  // alive chunks by start along d1 (pairwise disjoint)
  for (size_t i : order) {
    while (!by_end.empty() && by_end.top().first <= x.start(i, d0)) {
      by_start.erase(x.start(by_end.top().second, d1));
      by_end.pop();
    }
    auto next = by_start.lower_bound(x.start(i, d1));
    if (next != by_start.end() && next->first < x.end(i, d1)) {
      return std::make_pair(next->second, i);
    }
    if (next != by_start.begin() && x.end(std::prev(next)->second, d1) > x.start(i, d1)) {
      return std::make_pair(std::prev(next)->second, i);
    }
    by_start.emplace(x.start(i, d1), i);
    by_end.emplace(x.end(i, d0), i);
  }
  return std::nullopt;
}

// The grid formed by every chunk boundary along each partial dimension.
struct BoundaryGrid {
  std::vector<std::vector<int64_t>> bounds;  // sorted, distinct, per partial dimension
  uint64_t cells = 1;
};

// The grid of all boundaries, if it has at most kMaxCells cells.
std::optional<BoundaryGrid> SmallBoundaryGrid(const ChunkSpans& x, const std::vector<size_t>& order,
                                              const std::vector<size_t>& dims) {
  constexpr uint64_t kMaxCells = uint64_t{1} << 24;
  BoundaryGrid grid;
  grid.bounds.resize(dims.size());
  for (size_t k = 0; k < dims.size() && grid.cells <= kMaxCells; ++k) {
    auto& b = grid.bounds[k];
    b.reserve(2 * order.size());
    for (size_t i : order) b.push_back(x.start(i, dims[k])), b.push_back(x.end(i, dims[k]));
    std::sort(b.begin(), b.end());
    b.erase(std::unique(b.begin(), b.end()), b.end());
    grid.cells *= b.size() - 1;
  }
  if (grid.cells > kMaxCells) return std::nullopt;
  return grid;
}

// Mark the grid cells of every chunk: each cell is marked at most once before an overlap stops
// the scan.
std::optional<ChunkPair> OverlapInGrid(const ChunkSpans& x, const std::vector<size_t>& order,
                                       const std::vector<size_t>& dims, const BoundaryGrid& grid) {
  const auto& bounds = grid.bounds;
  std::vector<bool> covered(grid.cells, false);
  std::vector<size_t> lo(dims.size()), hi(dims.size()), at(dims.size());
  for (size_t i : order) {
    for (size_t k = 0; k < dims.size(); ++k) {
      const auto& b = bounds[k];
      lo[k] = std::lower_bound(b.begin(), b.end(), x.start(i, dims[k])) - b.begin();
      hi[k] = std::lower_bound(b.begin(), b.end(), x.end(i, dims[k])) - b.begin();
      at[k] = lo[k];
    }
    for (;;) {  // every cell of chunk i, odometer order
      uint64_t cell = 0;
      for (size_t k = 0; k < dims.size(); ++k) cell = cell * (bounds[k].size() - 1) + at[k];
      if (covered[cell]) {
        for (size_t j : order) {
          if (j != i && x.intersect(i, j)) return std::make_pair(j, i);
        }
      }
      covered[cell] = true;
      size_t k = dims.size();
      while (k > 0 && ++at[k - 1] == hi[k - 1]) at[k - 1] = lo[k - 1], --k;
      if (k == 0) break;
    }
  }
  return std::nullopt;
}

// A sweep along the dimension where it compares the fewest pairs, within a bound. The sweep
// compares each chunk with the chunks alive at its start: along each dimension that count is
// known from the sorted starts and ends alone (a chunk ending at or before a start also began
// before it), so the cheapest dimension is chosen before any comparison. A layout that is
// costly along every dimension (no real sharding is: they are grids) is refused rather than
// validated in quadratic time.
std::optional<ChunkPair> OverlapBySweep(const ChunkSpans& x, std::vector<size_t> order,
                                        const std::vector<size_t>& dims) {
  constexpr uint64_t kMaxComparisons = uint64_t{1} << 27;
  size_t dim = dims[0];
  uint64_t best = UINT64_MAX;
  for (size_t d : dims) {
    std::vector<int64_t> starts, ends;
    for (size_t i : order) starts.push_back(x.start(i, d)), ends.push_back(x.end(i, d));
    std::sort(starts.begin(), starts.end());
    std::sort(ends.begin(), ends.end());
    uint64_t cost = 0;
    size_t ended = 0;
    for (size_t k = 0; k < starts.size(); ++k) {
      while (ended < ends.size() && ends[ended] <= starts[k]) ++ended;
      cost += k - std::min(k, ended);
    }
    if (cost < best) best = cost, dim = d;
  }
  if (best > kMaxComparisons) {
    throw CorruptionError(std::to_string(order.size()) +
                          " chunks in an irregular layout of 3 or more dimensions: validating "
                          "it would take " +
                          std::to_string(best) + " comparisons (limit " +
                          std::to_string(kMaxComparisons) + ")");
  }
  x.SortByStart(order, dim);
  std::vector<size_t> active;
  for (size_t i : order) {
    std::erase_if(active, [&](size_t a) { return x.end(a, dim) <= x.start(i, dim); });
    for (size_t a : active) {
      if (x.intersect(a, i)) return std::make_pair(a, i);
    }
    active.push_back(i);
  }
  return std::nullopt;
}

// Two chunks of a tensor that overlap, if any (indices into `chunks`, which lie inside
// `shape`). Metadata is untrusted, so this must stay near O(n log n) in the number of chunks
// (a million-chunk tensor validates in seconds): only the dimensions along which some chunk is
// not whole matter, since every pair of non-empty chunks overlaps along the others.
// - 0 or 1 such dimension: sort by start, compare each start with the largest end before it.
// - 2: sweep along the first; the chunks alive at the sweep point all contain it, so the
//   disjoint ones among them are disjoint along the second dimension too, and an ordered map
//   by their start there finds a new chunk's only possible overlaps (its neighbours).
// - 3 or more: mark the cells of the grid formed by every chunk boundary (each cell is marked
//   at most once before an overlap stops the scan), when that grid has at most 2^24 cells;
//   beyond, a sweep along the dimension where it compares the fewest pairs, within a bound.
std::optional<ChunkPair> FindOverlap(const std::vector<ChunkMeta>& chunks, const Shape& shape) {
  std::vector<size_t> order;  // the non-empty chunks
  for (size_t i = 0; i < chunks.size(); ++i) {
    if (chunks[i].numel() > 0) order.push_back(i);
  }
  if (order.size() < 2) return std::nullopt;
  const std::vector<size_t> dims = PartialDims(chunks, order, shape);
  const ChunkSpans spans{chunks};
  if (dims.empty()) return std::make_pair(order[0], order[1]);
  if (dims.size() == 1) return OverlapAlongOne(spans, std::move(order), dims[0]);
  if (dims.size() == 2) return OverlapAlongTwo(spans, std::move(order), dims[0], dims[1]);
  if (const auto grid = SmallBoundaryGrid(spans, order, dims)) {
    return OverlapInGrid(spans, order, dims, *grid);
  }
  return OverlapBySweep(spans, std::move(order), dims);
}

std::string JoinKeys(const KeyPath& path) {
  std::string s;
  for (size_t i = 0; i < path.size(); ++i) s += (i ? "." : "") + path[i];
  return s;
}

// Key paths rebuild the nesting of a loaded state dict, so they must agree with the fqns and
// form a tree: no empty path or key, no two entries at one path, no entry below another.
void ValidateKeyPaths(const Metadata& md, const std::string& src) {
  auto fail = [&](const std::string& what) { throw CorruptionError(src + ": " + what); };
  // A load rebuilds one nested state dict per level (and a flatten walks them recursively): a
  // path as deep as a crafted 8 MiB name has dots would exhaust the stack and cost O(depth^2).
  auto check_depth = [&](const std::string& fqn, size_t depth) {
    if (depth > kMaxKeyPathDepth) {
      fail("entry " + ClippedName(fqn) + " is nested " + std::to_string(depth) +
           " levels deep (limit " + std::to_string(kMaxKeyPathDepth) + ")");
    }
  };
  for (const auto& [fqn, path] : md.key_paths) {
    check_depth(fqn, path.size());
    if (!md.entries.count(fqn)) fail("key path of '" + fqn + "' names no entry");
    if (path.empty()) fail("entry '" + fqn + "' has an empty key path");
    for (const auto& k : path) {
      if (k.empty()) fail("entry '" + fqn + "' has an empty key in its key path");
    }
    if (JoinKeys(path) != fqn) {
      fail("entry '" + fqn + "' has key path [" + JoinKeys(path) +
           "] that does not join to its fqn");
    }
  }
  // The path each entry is loaded at: its key path, or its fqn split at dots.
  std::vector<std::pair<KeyPath, const std::string*>> paths;
  paths.reserve(md.entries.size());
  for (const auto& [fqn, entry] : md.entries) {
    if (auto it = md.key_paths.find(fqn); it != md.key_paths.end()) {
      paths.emplace_back(it->second, &fqn);
      continue;
    }
    check_depth(fqn, static_cast<size_t>(std::count(fqn.begin(), fqn.end(), '.')) + 1);
    KeyPath path;
    for (size_t pos = 0;;) {
      const size_t dot = fqn.find('.', pos);
      path.push_back(fqn.substr(pos, dot == std::string::npos ? dot : dot - pos));
      if (dot == std::string::npos) break;
      pos = dot + 1;
    }
    paths.emplace_back(std::move(path), &fqn);
  }
  // Sorted, an entry nested below another follows it directly or after others below it.
  std::sort(paths.begin(), paths.end());
  for (size_t i = 1; i < paths.size(); ++i) {
    const KeyPath& a = paths[i - 1].first;
    const KeyPath& b = paths[i].first;
    if (a.size() <= b.size() && std::equal(a.begin(), a.end(), b.begin())) {
      fail(a.size() == b.size() ? "entries '" + *paths[i - 1].second + "' and '" +
                                      *paths[i].second + "' have the same key path"
                                : "entry '" + *paths[i].second + "' is nested under entry '" +
                                      *paths[i - 1].second + "', which is not a dict");
    }
  }
}

}  // namespace

std::string EncodeSavePlan(const SavePlan& plan) {
  CodecMessage<pb::SavePlan> holder;
  auto& p = *holder;
  for (const auto& item : plan.items) {
    auto* w = p.add_items();
    ToPb(item.index, w->mutable_index());
    w->set_type(static_cast<pb::WriteItemType>(item.type));
    w->set_dtype(static_cast<pb::DType>(item.dtype));
    FromShape(item.global_shape, w->mutable_global_shape());
    ToPb(item.chunk, w->mutable_chunk());
    w->set_size_bytes(item.size_bytes);
  }
  p.set_storage_data(plan.storage_data);
  p.set_planner_data(plan.planner_data);
  for (const auto& [fqn, path] : plan.key_paths) {
    auto& kp = (*p.mutable_key_paths())[fqn];
    for (const auto& k : path) kp.add_keys(k);
  }
  // Deterministic (map entries sorted): equal plans encode to equal bytes, which plan caching
  // compares by hash (dcp/checkpoint.h, SavePlanCache).
  std::string out;
  {
    google::protobuf::io::StringOutputStream stream(&out);
    google::protobuf::io::CodedOutputStream coded(&stream);
    coded.SetSerializationDeterministic(true);
    if (!p.SerializeToCodedStream(&coded)) throw InternalError("cannot encode a save plan");
  }
  return out;
}

SavePlan DecodeSavePlan(std::string_view bytes) {
  CodecMessage<pb::SavePlan> holder;
  auto& p = *holder;
  Parse(&p, bytes, "save plan");
  SavePlan plan;
  plan.items.reserve(p.items_size());
  for (const auto& w : p.items()) {
    WriteItem item;
    item.index = FromPb(w.index());
    item.type = static_cast<WriteItemType>(w.type());
    item.dtype = ToDType(w.dtype(), "save plan");
    item.global_shape = ToShape(w.global_shape());
    item.chunk = FromPb(w.chunk());
    item.size_bytes = w.size_bytes();
    plan.items.push_back(std::move(item));
  }
  plan.storage_data = p.storage_data();
  plan.planner_data = p.planner_data();
  for (const auto& [fqn, kp] : p.key_paths()) {
    plan.key_paths[fqn] = KeyPath(kp.keys().begin(), kp.keys().end());
  }
  return plan;
}

std::string EncodeLoadPlan(const LoadPlan& plan) {
  CodecMessage<pb::LoadPlan> holder;
  auto& p = *holder;
  for (const auto& item : plan.items) {
    auto* r = p.add_items();
    r->set_type(static_cast<pb::ReadItemType>(item.type));
    ToPb(item.dest_index, r->mutable_dest_index());
    FromShape(item.dest_offsets, r->mutable_dest_offsets());
    ToPb(item.storage_index, r->mutable_storage_index());
    FromShape(item.storage_offsets, r->mutable_storage_offsets());
    FromShape(item.lengths, r->mutable_lengths());
    if (item.chunk_span > 1) r->set_chunk_span(item.chunk_span);
  }
  p.set_storage_data(plan.storage_data);
  p.set_planner_data(plan.planner_data);
  return p.SerializeAsString();
}

LoadPlan DecodeLoadPlan(std::string_view bytes) {
  CodecMessage<pb::LoadPlan> holder;
  auto& p = *holder;
  Parse(&p, bytes, "load plan");
  LoadPlan plan;
  plan.items.reserve(p.items_size());
  for (const auto& r : p.items()) {
    ReadItem item;
    item.type = static_cast<ReadItemType>(r.type());
    item.dest_index = FromPb(r.dest_index());
    item.dest_offsets = ToShape(r.dest_offsets());
    item.storage_index = FromPb(r.storage_index());
    item.storage_offsets = ToShape(r.storage_offsets());
    item.lengths = ToShape(r.lengths());
    item.chunk_span = std::max<uint32_t>(r.chunk_span(), 1);
    plan.items.push_back(std::move(item));
  }
  plan.storage_data = p.storage_data();
  plan.planner_data = p.planner_data();
  return plan;
}

std::string EncodeLocalLoadPlan(const LoadPlan& plan, bool can_share) {
  pb::LocalLoadPlan p;
  p.set_plan(EncodeLoadPlan(plan));
  p.set_can_share(can_share);
  return p.SerializeAsString();
}

std::pair<LoadPlan, bool> DecodeLocalLoadPlan(std::string_view bytes) {
  pb::LocalLoadPlan p;
  Parse(&p, bytes, "local load plan");
  return {DecodeLoadPlan(p.plan()), p.can_share()};
}

std::string EncodeLoadAssignment(const LoadPlan& plan,
                                 const std::vector<SharedReadBatch>& batches) {
  pb::LoadAssignment p;
  p.set_plan(EncodeLoadPlan(plan));
  for (const auto& b : batches) {
    auto* q = p.add_batches();
    q->set_root(b.root);
    q->mutable_send_items()->Add(b.send_items.begin(), b.send_items.end());
    q->mutable_recv_segments()->Add(b.recv_segments.begin(), b.recv_segments.end());
    q->mutable_recv_items()->Add(b.recv_items.begin(), b.recv_items.end());
    q->set_bytes(b.bytes);
  }
  return p.SerializeAsString();
}

std::pair<LoadPlan, std::vector<SharedReadBatch>> DecodeLoadAssignment(std::string_view bytes) {
  pb::LoadAssignment p;
  Parse(&p, bytes, "load assignment");
  std::pair<LoadPlan, std::vector<SharedReadBatch>> out{DecodeLoadPlan(p.plan()), {}};
  const auto n = static_cast<int64_t>(out.first.items.size());
  auto in_plan = [&](int32_t i) {
    if (i < 0 || i >= n) {
      throw CorruptionError("load assignment names item " + std::to_string(i) + " of a plan of " +
                            std::to_string(n));
    }
    return i;
  };
  for (const auto& q : p.batches()) {
    SharedReadBatch b;
    b.root = q.root();
    for (int32_t i : q.send_items()) b.send_items.push_back(in_plan(i));
    for (int32_t i : q.recv_items()) b.recv_items.push_back(in_plan(i));
    b.recv_segments.assign(q.recv_segments().begin(), q.recv_segments().end());
    if (b.recv_segments.size() != b.recv_items.size()) {
      throw CorruptionError("load assignment: a batch's receive lists differ in length");
    }
    b.bytes = q.bytes();
    out.second.push_back(std::move(b));
  }
  return out;
}

std::string EncodeWriteResults(const std::vector<WriteResult>& results) {
  CodecMessage<pb::WriteResults> holder;
  auto& p = *holder;
  for (const auto& r : results) {
    auto* w = p.add_results();
    ToPb(r.index, w->mutable_index());
    w->set_size_in_bytes(r.size_in_bytes);
    ToPb(r.storage, w->mutable_info());
  }
  return p.SerializeAsString();
}

std::vector<WriteResult> DecodeWriteResults(std::string_view bytes) {
  CodecMessage<pb::WriteResults> holder;
  auto& p = *holder;
  Parse(&p, bytes, "write results");
  std::vector<WriteResult> out;
  out.reserve(p.results_size());
  for (const auto& w : p.results()) {
    out.push_back({FromPb(w.index()), w.size_in_bytes(), FromPb(w.info())});
  }
  return out;
}

// The coordinator of a save at thousands of ranks receives millions of write results. Decoding
// them all into vectors, then copying them into the metadata's storage map, held both forms at
// once (about 5x the encoded metadata). Here each rank's payload is read one result at a time
// and each result is moved into the map: a k-way merge by stored item, so results that each rank
// lists in order (what StoreWriter writes) are appended at the map's end without a tree walk.
// Out-of-order results still insert correctly, only slower.
namespace {

class WriteResultStream {
 public:
  WriteResultStream(std::string* bytes, int rank)
      : bytes_(bytes),
        in_(std::make_unique<google::protobuf::io::CodedInputStream>(
            reinterpret_cast<const uint8_t*>(bytes->data()), static_cast<int>(bytes->size()))),
        rank_(rank) {}

  // Parse the next result into current(); false (and the payload freed) at the end.
  bool Advance() {
    for (uint32_t tag; (tag = in_->ReadTag()) != 0;) {
      if (tag != kResultsTag) {
        if (!google::protobuf::internal::WireFormatLite::SkipField(in_.get(), tag)) Corrupt();
        continue;
      }
      uint32_t length = 0;
      if (!in_->ReadVarint32(&length) || length > bytes_->size() - in_->CurrentPosition()) {
        Corrupt();
      }
      const auto limit = in_->PushLimit(static_cast<int>(length));
      msg_.Clear();
      if (!msg_.MergePartialFromCodedStream(in_.get()) || !in_->ConsumedEntireMessage()) {
        Corrupt();
      }
      in_->PopLimit(limit);
      current_.index = FromPb(msg_.index());
      current_.size_in_bytes = msg_.size_in_bytes();
      current_.storage = FromPb(msg_.info());
      return true;
    }
    if (!in_->ConsumedEntireMessage()) Corrupt();
    in_.reset();
    std::string().swap(*bytes_);
    return false;
  }
  WriteResult& current() { return current_; }

 private:
  // Field 1 of WriteResults, length-delimited.
  static constexpr uint32_t kResultsTag = (1u << 3) | 2u;
  [[noreturn]] void Corrupt() const {
    throw CorruptionError("cannot parse the write results of rank " + std::to_string(rank_));
  }
  std::string* bytes_;
  std::unique_ptr<google::protobuf::io::CodedInputStream> in_;
  int rank_;
  pb::WriteResult msg_;
  WriteResult current_;
};

}  // namespace

void FillStorageFromEncoded(Metadata& md, std::vector<std::string>& encoded_results) {
  md.storage.clear();
  for (const auto& bytes : encoded_results) {
    if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
      throw CorruptionError("write results of one rank larger than 2 GiB");
    }
  }
  std::vector<std::unique_ptr<WriteResultStream>> streams;
  streams.reserve(encoded_results.size());
  std::vector<uint32_t> heap;  // streams with a current result, min-heap by stored item
  for (size_t r = 0; r < encoded_results.size(); ++r) {
    streams.push_back(
        std::make_unique<WriteResultStream>(&encoded_results[r], static_cast<int>(r)));
    if (streams.back()->Advance()) heap.push_back(static_cast<uint32_t>(r));
  }
  auto later = [&](uint32_t a, uint32_t b) {
    const MetadataIndex& x = streams[a]->current().index;
    const MetadataIndex& y = streams[b]->current().index;
    return y < x || (!(x < y) && b < a);  // ties by rank, so a duplicate names both in order
  };
  std::make_heap(heap.begin(), heap.end(), later);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const uint32_t r = heap.back();
    WriteResult& cur = streams[r]->current();
    if (md.storage.empty() || md.storage.rbegin()->first < cur.index) {
      md.storage.emplace_hint(md.storage.end(), std::move(cur.index), std::move(cur.storage));
    } else {
      auto [it, inserted] = md.storage.try_emplace(std::move(cur.index));
      if (!inserted) {
        throw InternalError("item " + it->first.ToString() + " was written twice (again by rank " +
                            std::to_string(r) + ")");
      }
      it->second = std::move(cur.storage);
    }
    if (streams[r]->Advance()) {
      std::push_heap(heap.begin(), heap.end(), later);
    } else {
      heap.pop_back();
      streams[r].reset();
    }
  }
}

// Metadata grows with ranks x tensors (hundreds of MiB at thousands of ranks), so it is encoded
// and decoded one entry and one stored item at a time through a reused message, never as one
// protobuf object beside the native one. The bytes are those of the whole message serialized
// deterministically (fields in number order, map entries sorted).
namespace {

constexpr uint32_t kVersionTag = (1 << 3) | 0;  // Metadata.format_version, varint
constexpr uint32_t kEntriesTag = (7 << 3) | 2;  // Metadata.entries, length-delimited
constexpr uint32_t kItemsTag = (8 << 3) | 2;    // Metadata.items

template <typename Msg>
void WriteSubmessage(google::protobuf::io::CodedOutputStream& out, uint32_t tag, const Msg& m) {
  const size_t size = m.ByteSizeLong();
  if (size > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    throw InvalidArgumentError("a metadata entry of " + std::to_string(size) +
                               " bytes is too large to encode");
  }
  out.WriteTag(tag);
  out.WriteVarint32(static_cast<uint32_t>(size));
  m.SerializeWithCachedSizes(&out);
}

}  // namespace

namespace {

// Output in fixed blocks, then one exact copy: a string grown by doubling holds up to three
// times the metadata while it grows (old and new buffer), and the metadata is hundreds of MiB at
// thousands of ranks. Each block is freed as soon as it is copied.
class BlockOutputStream : public google::protobuf::io::ZeroCopyOutputStream {
 public:
  // Blocks grow from 64 KiB to 4 MiB, and are not zero-filled: a small metadata touches a few
  // pages instead of faulting in (and clearing) 4 MiB, which made a process's first save ~15 ms
  // slower than the next.
  static constexpr int kFirstBlock = 64 << 10, kMaxBlock = 4 << 20;
  bool Next(void** data, int* size) override {
    const int n = next_block_;
    next_block_ = std::min(kMaxBlock, 2 * next_block_);
    blocks_.push_back(std::make_unique_for_overwrite<char[]>(static_cast<size_t>(n)));
    used_.push_back(n);
    *data = blocks_.back().get();
    *size = n;
    total_ += n;
    return true;
  }
  void BackUp(int count) override {
    used_.back() -= count;
    total_ -= count;
  }
  int64_t ByteCount() const override { return total_; }
  // The bytes written, after `prefix` zero bytes; frees the blocks.
  std::string Take(size_t prefix) {
    std::string out;
    out.reserve(prefix + static_cast<size_t>(total_));
    out.append(prefix, '\0');
    for (size_t i = 0; i < blocks_.size(); ++i) {
      out.append(blocks_[i].get(), static_cast<size_t>(used_[i]));
      blocks_[i].reset();
    }
    blocks_.clear();
    used_.clear();
    total_ = 0;
    next_block_ = kFirstBlock;
    return out;
  }

 private:
  std::vector<std::unique_ptr<char[]>> blocks_;
  std::vector<int> used_;
  int64_t total_ = 0;
  int next_block_ = kFirstBlock;
};

void ToPb(const DataFile& f, pb::DataFile* out) {
  out->set_name(f.name);
  out->set_writer(f.writer);
  out->set_size(f.size);
  out->set_index_offset(f.index_offset);
  out->set_index_length(f.index_length);
  out->set_index_crc32c(f.index_crc32c);
  if (!f.index_copy.empty()) out->set_index(f.index_copy);
}

DataFile FromPb(const pb::DataFile& f) {
  return {f.name(),         f.writer(),       f.size(), f.index_offset(),
          f.index_length(), f.index_crc32c(), f.index()};
}

// EncodeMetadata's bytes after `prefix` zero bytes (room for the file envelope).
std::string EncodeMetadataAfter(const Metadata& md, size_t prefix) {
  const bool v2 = md.format_version >= 2;
  BlockOutputStream blocks;
  {
    google::protobuf::io::CodedOutputStream cos(&blocks);
    cos.SetSerializationDeterministic(true);
    {
      pb::Metadata head;  // fields 1-6
      head.set_format_version(md.format_version);
      head.set_checkpoint_id(md.checkpoint_id);
      head.set_save_id(md.save_id);
      head.set_world_size(md.world_size);
      head.set_created_unix_ns(md.created_unix_ns);
      head.set_library_version(md.library_version);
      head.SerializeToCodedStream(&cos);
    }
    pb::Entry e;
    for (const auto& [fqn, entry] : md.entries) {
      e.Clear();
      e.set_fqn(fqn);
      if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
        auto* te = e.mutable_tensor();
        te->set_dtype(static_cast<pb::DType>(t->dtype));
        FromShape(t->shape, te->mutable_shape());
        if (t->regular && v2) {
          auto* rs = te->mutable_regular();
          rs->set_dim(t->regular->dim);
          rs->set_rule(t->regular->rule);
          rs->set_world(t->regular->world);
        } else {
          // Version 1 lists every chunk, a rule's too.
          te->mutable_chunks()->Reserve(static_cast<int>(ChunkCount(*t)));
          ForEachChunk(*t, [&](size_t, const ChunkMeta& c) { ToPb(c, te->add_chunks()); });
          // (ValidateMetadata refuses a version-2 list without a writer per chunk.)
          if (v2)
            te->mutable_chunk_writers()->Add(t->chunk_writers.begin(), t->chunk_writers.end());
        }
      } else {
        auto* be = e.mutable_bytes();
        if (v2) {
          be->set_writer(std::get<BytesMetadata>(entry).writer);
          be->set_size(std::get<BytesMetadata>(entry).size);
        }
      }
      WriteSubmessage(cos, kEntriesTag, e);
    }
    pb::StoredItem item;
    // Version 2 keeps where items lie in the data files' indexes, not here.
    if (!v2)
      for (const auto& [index, info] : md.storage) {
        item.Clear();
        ToPb(index, item.mutable_index());
        ToPb(info, item.mutable_info());
        WriteSubmessage(cos, kItemsTag, item);
      }
    pb::Metadata tail;  // fields 9-10 (maps: sorted by the deterministic stream)
    for (const auto& [fqn, path] : md.key_paths) {
      auto& kp = (*tail.mutable_key_paths())[fqn];
      for (const auto& k : path) kp.add_keys(k);
    }
    for (const auto& [k, v] : md.planner_data) (*tail.mutable_planner_data())[k] = v;
    if (v2) {
      for (const auto& f : md.files) ToPb(f, tail.add_files());
    }
    tail.SerializeToCodedStream(&cos);
    if (cos.HadError()) throw InternalError("cannot encode metadata");
  }
  return blocks.Take(prefix);
}

}  // namespace

std::string EncodeMetadata(const Metadata& md) { return EncodeMetadataAfter(md, 0); }

std::string EncodeDataFiles(const std::vector<DataFile>& files) {
  pb::Metadata p;
  for (const auto& f : files) ToPb(f, p.add_files());
  return p.SerializeAsString();
}

std::vector<DataFile> DecodeDataFiles(std::string_view bytes, int rank) {
  pb::Metadata p;
  if (!p.ParseFromArray(bytes.data(), static_cast<int>(bytes.size()))) {
    throw CorruptionError("rank " + std::to_string(rank) +
                          " sent a malformed list of data files (do all ranks save with the "
                          "same metadata_version?)");
  }
  std::vector<DataFile> out;
  out.reserve(static_cast<size_t>(p.files_size()));
  for (const auto& f : p.files()) {
    if (f.writer() != rank) {
      throw CorruptionError("rank " + std::to_string(rank) + " reported data file '" + f.name() +
                            "' as written by rank " + std::to_string(f.writer()));
    }
    out.push_back(FromPb(f));
  }
  return out;
}

namespace {
std::atomic<uint64_t> g_metadata_limit_for_testing{0};
}  // namespace

uint64_t MetadataPayloadLimit() {
  const uint64_t lowered = g_metadata_limit_for_testing.load();
  return lowered != 0 ? lowered : static_cast<uint64_t>(std::numeric_limits<int>::max());
}

void SetMetadataPayloadLimitForTesting(uint64_t bytes) { g_metadata_limit_for_testing = bytes; }

void CheckMetadataPayloadSize(uint64_t bytes, std::string_view where) {
  const uint64_t limit = MetadataPayloadLimit();
  if (bytes <= limit) return;
  throw InvalidArgumentError(
      std::string(where) + ": the checkpoint's metadata would be " + std::to_string(bytes) +
      " bytes (" + std::to_string(bytes >> 20) + " MiB), above the " + std::to_string(limit) +
      "-byte limit of protobuf, so no reader could decode it; nothing was committed. Save fewer, "
      "larger entries or chunks (e.g. fewer ranks per tensor, or tensors merged)");
}

namespace {

CorruptionError NotAProtobuf(const std::string& src, const std::string& what) {
  return CorruptionError(src + ": metadata payload is not a valid protobuf (" + what + ")");
}

// Reads a metadata payload field by field: entries and stored items go straight into a
// Metadata, one message at a time. Fields other than entries and items (small: scalars and
// maps) are copied out, to be parsed as one message.
class MetadataPayloadReader {
 public:
  MetadataPayloadReader(std::string_view bytes, std::string_view source, Metadata& md)
      : bytes_(bytes),
        source_(source),
        src_(source),
        md_(md),
        in_(reinterpret_cast<const uint8_t*>(bytes.data()), static_cast<int>(bytes.size())) {
    in_.SetRecursionLimit(64);
  }

  // Reads every field; returns the fields other than entries and items, serialized.
  std::string Read() {
    std::string rest;
    {  // the streams let go of `rest` before it is returned
      google::protobuf::io::StringOutputStream rest_stream(&rest);
      google::protobuf::io::CodedOutputStream rest_out(&rest_stream);
      for (uint32_t tag; (tag = in_.ReadTag()) != 0;) {
        if (tag == kVersionTag) {
          ReadVersion(tag, rest_out);
        } else if (tag == kEntriesTag) {
          ReadEntry();
        } else if (tag == kItemsTag) {
          ReadItem();
        } else if (!google::protobuf::internal::WireFormatLite::SkipField(&in_, tag, &rest_out)) {
          throw NotAProtobuf(src_, "truncated field " + std::to_string(tag >> 3));
        }
      }
      if (!in_.ConsumedEntireMessage()) throw NotAProtobuf(src_, "bad tag");
      rest_out.Trim();
    }
    return rest;
  }

 private:
  void ReadVersion(uint32_t tag, google::protobuf::io::CodedOutputStream& rest_out) {
    // Checked at once: a newer format's entries may not parse as this version's.
    uint32_t version = 0;
    if (!in_.ReadVarint32(&version)) throw NotAProtobuf(src_, "truncated format version");
    if (version > kFormatVersion) {
      throw UnsupportedError(src_ + ": checkpoint format version " + std::to_string(version) +
                             " is newer than this library's " + std::to_string(kFormatVersion) +
                             "; upgrade dcp to read it");
    }
    rest_out.WriteTag(tag);
    rest_out.WriteVarint32(version);
    version_ = version;
  }

  void ReadEntry() {
    ParseSub(e_, "entry");
    if (md_.entries.count(e_.fqn()))
      throw CorruptionError(src_ + ": duplicate entry '" + e_.fqn() + "'");
    if (e_.has_tensor()) {
      TensorMetadata t;
      t.dtype = ToDType(e_.tensor().dtype(), source_);
      t.shape = ToShape(e_.tensor().shape());
      t.chunks.reserve(e_.tensor().chunks_size());
      for (const auto& c : e_.tensor().chunks()) t.chunks.push_back(FromPb(c));
      if (e_.tensor().has_regular()) {
        // Checked by ValidateMetadata before use; the rule value is kept as read.
        const auto& rs = e_.tensor().regular();
        t.regular = RegularLayout{
            rs.dim(), static_cast<RegularRule>(rs.rule() <= 0xff ? rs.rule() : 0), rs.world()};
      }
      t.chunk_writers.assign(e_.tensor().chunk_writers().begin(),
                             e_.tensor().chunk_writers().end());
      md_.entries.emplace(e_.fqn(), std::move(t));
    } else if (e_.has_bytes()) {
      md_.entries.emplace(e_.fqn(), BytesMetadata{e_.bytes().writer(), e_.bytes().size()});
    } else {
      throw CorruptionError(src_ + ": entry '" + e_.fqn() + "' has no kind");
    }
  }

  void ReadItem() {
    ParseSub(item_, "stored item");
    if (version_ >= 2) {
      throw CorruptionError(src_ + ": version-2 metadata lists a stored item (" +
                            FromPb(item_.index()).ToString() +
                            "); version 2 keeps them in the data files' indexes");
    }
    MetadataIndex index = FromPb(item_.index());
    auto [it, inserted] = md_.storage.try_emplace(std::move(index));
    if (!inserted) throw CorruptionError(src_ + ": duplicate stored item " + it->first.ToString());
    it->second = FromPb(item_.info());
  }

  // A length-delimited submessage into msg (cleared first).
  template <typename Msg>
  void ParseSub(Msg& msg, const char* what) {
    uint32_t length = 0;
    if (!in_.ReadVarint32(&length) || length > bytes_.size() - in_.CurrentPosition()) {
      throw NotAProtobuf(src_, std::string("truncated ") + what);
    }
    const auto limit = in_.PushLimit(static_cast<int>(length));
    msg.Clear();
    if (!msg.MergePartialFromCodedStream(&in_) || !in_.ConsumedEntireMessage()) {
      throw NotAProtobuf(src_, std::string("bad ") + what);
    }
    in_.PopLimit(limit);
  }

  std::string_view bytes_;
  std::string_view source_;
  std::string src_;
  Metadata& md_;
  google::protobuf::io::CodedInputStream in_;
  pb::Entry e_;  // reused by every entry, and item_ by every stored item
  pb::StoredItem item_;
  uint32_t version_ = 0;  // as read so far (the encoder writes it first)
};

// The fields other than entries and items (`rest`, one serialized pb::Metadata), into md.
void ReadMetadataHeader(const std::string& rest, const std::string& src, Metadata& md) {
  pb::Metadata p;
  if (!p.ParseFromString(rest)) throw NotAProtobuf(src, "bad header");
  if (p.format_version() > kFormatVersion) {
    throw UnsupportedError(src + ": checkpoint format version " +
                           std::to_string(p.format_version()) + " is newer than this library's " +
                           std::to_string(kFormatVersion) + "; upgrade dcp to read it");
  }
  if (p.format_version() == 0) {
    throw CorruptionError(src + ": metadata has no format version");
  }
  md.format_version = p.format_version();
  md.checkpoint_id = p.checkpoint_id();
  md.save_id = p.save_id();
  md.world_size = p.world_size();
  md.created_unix_ns = p.created_unix_ns();
  md.library_version = p.library_version();
  for (const auto& [fqn, kp] : p.key_paths()) {
    md.key_paths[fqn] = KeyPath(kp.keys().begin(), kp.keys().end());
  }
  for (const auto& [k, v] : p.planner_data()) md.planner_data[k] = v;
  md.files.reserve(static_cast<size_t>(p.files_size()));
  for (const auto& f : p.files()) md.files.push_back(FromPb(f));
}

}  // namespace

Metadata DecodeMetadata(std::string_view bytes, std::string_view source) {
  const std::string src(source);
  if (bytes.size() > static_cast<size_t>(std::numeric_limits<int>::max())) {
    throw NotAProtobuf(src, "larger than 2 GiB");
  }
  Metadata md;
  const std::string rest = MetadataPayloadReader(bytes, source, md).Read();
  ReadMetadataHeader(rest, src, md);
  return md;
}

std::string EncodeMetadataFile(const Metadata& md) {
  // The envelope is written in front of the payload in place: no second copy of it.
  std::string out = EncodeMetadataAfter(md, kMetadataHeaderSize);
  const size_t n = out.size() - kMetadataHeaderSize;
  std::string head(kMagic, sizeof(kMagic));
  PutLe(&head, md.format_version, 4);
  PutLe(&head, Crc32c(0, out.data() + kMetadataHeaderSize, n), 4);
  PutLe(&head, n, 8);
  if (head.size() != kMetadataHeaderSize) throw InternalError("metadata envelope size");
  out.replace(0, kMetadataHeaderSize, head);
  return out;
}

void CheckMetadataFileHeader(std::string_view bytes, uint64_t file_size, std::string_view source) {
  const std::string src(source);
  if (bytes.size() < kMetadataHeaderSize || std::memcmp(bytes.data(), kMagic, 4) != 0) {
    throw CorruptionError(src + ": not a dcp metadata file (bad magic or too short: " +
                          std::to_string(file_size) + " bytes)");
  }
  if (std::memcmp(bytes.data(), kMagic, sizeof(kMagic)) != 0) {
    throw UnsupportedError(src + ": unsupported metadata envelope '" +
                           std::string(bytes.substr(0, 8)) + "'");
  }
  const uint32_t version = static_cast<uint32_t>(GetLe(bytes.data() + 8, 4));
  const uint64_t len = GetLe(bytes.data() + 16, 8);
  if (version > kFormatVersion) {
    throw UnsupportedError(src + ": checkpoint format version " + std::to_string(version) +
                           " is newer than this library's " + std::to_string(kFormatVersion) +
                           "; upgrade dcp to read it");
  }
  if (file_size < kMetadataHeaderSize || len != file_size - kMetadataHeaderSize) {
    throw CorruptionError(
        src + ": metadata payload length " + std::to_string(len) + " does not match the file (" +
        std::to_string(file_size - std::min<uint64_t>(file_size, kMetadataHeaderSize)) +
        " bytes follow the header); the file is truncated or damaged");
  }
}

Metadata DecodeMetadataFile(std::string_view bytes, std::string_view source) {
  const std::string src(source);
  CheckMetadataFileHeader(bytes, bytes.size(), source);
  const uint32_t version = static_cast<uint32_t>(GetLe(bytes.data() + 8, 4));
  const uint32_t crc = static_cast<uint32_t>(GetLe(bytes.data() + 12, 4));
  const std::string_view payload = bytes.substr(kMetadataHeaderSize);
  const uint32_t actual = Crc32c(0, payload.data(), payload.size());
  if (actual != crc) {
    throw CorruptionError(src + ": metadata checksum mismatch (stored " + std::to_string(crc) +
                          ", computed " + std::to_string(actual) + "); the file is damaged");
  }
  Metadata md = DecodeMetadata(payload, source);
  if (version == 0 || md.format_version != version) {
    throw CorruptionError(src + ": the header says format version " + std::to_string(version) +
                          " but the payload says " + std::to_string(md.format_version));
  }
  ValidateMetadata(md, source);
  return md;
}

namespace {

[[noreturn]] void FailValidation(const std::string& src, const std::string& what) {
  throw CorruptionError(src + ": " + what);
}

// The elements of a tensor's shape. A single entry may not describe more than 2^50 elements:
// far beyond any real model, and a guard against allocation attacks by tools that materialise
// tensors from metadata.
int64_t CheckedVolume(const std::string& fqn, const TensorMetadata& t, const std::string& src) {
  constexpr int64_t kMaxElements = int64_t{1} << 50;
  int64_t volume = 1;
  for (int64_t d : t.shape) {
    if (d < 0 || (d > 0 && volume > kMaxElements / d)) {
      FailValidation(
          src, "tensor '" + fqn + "' has an invalid or absurd shape " + ShapeToString(t.shape));
    }
    volume *= d;
  }
  return volume;
}

// A chunk lies inside its tensor; returns its elements (version 2: nothing stored to check).
int64_t CheckChunkBox(const std::string& fqn, const TensorMetadata& t, const ChunkMeta& c,
                      const std::string& src) {
  if (c.offsets.size() != t.shape.size() || c.sizes.size() != t.shape.size()) {
    FailValidation(src, "tensor '" + fqn + "' chunk " + c.ToString() +
                            " does not match rank of shape " + ShapeToString(t.shape));
  }
  for (size_t i = 0; i < t.shape.size(); ++i) {
    if (c.offsets[i] < 0 || c.sizes[i] < 0 || c.offsets[i] > t.shape[i] - c.sizes[i]) {
      FailValidation(src, "tensor '" + fqn + "' chunk " + c.ToString() +
                              " lies outside its shape " + ShapeToString(t.shape));
    }
  }
  return NumElements(c.sizes);
}

// A chunk lies inside its tensor and has a stored item of its size; returns its elements.
int64_t CheckChunk(const Metadata& md, const std::string& fqn, const TensorMetadata& t,
                   const ChunkMeta& c, const std::string& src) {
  const int64_t n = CheckChunkBox(fqn, t, c, src);
  auto it = md.storage.find(MetadataIndex{fqn, c.offsets, {}});
  if (it == md.storage.end()) {
    FailValidation(src, "tensor '" + fqn + "' chunk " + c.ToString() + " has no stored item");
  }
  const uint64_t raw = static_cast<uint64_t>(n) * ElementSize(t.dtype);
  if (it->second.raw_length != raw) {
    FailValidation(src, "tensor '" + fqn + "' chunk " + c.ToString() + " should hold " +
                            std::to_string(raw) + " bytes but its stored item records " +
                            std::to_string(it->second.raw_length));
  }
  if (it->second.transforms.empty() && it->second.length != raw) {
    FailValidation(src, "tensor '" + fqn + "' chunk " + c.ToString() + " stored length " +
                            std::to_string(it->second.length) + " != " + std::to_string(raw));
  }
  return n;
}

// A rule is checked without expanding it: what a rule claims costs the same however many
// chunks it names.
void ValidateRegularLayout(const Metadata& md, const std::string& fqn, const TensorMetadata& t,
                           const std::string& src) {
  const RegularLayout& reg = *t.regular;
  if (!t.chunks.empty() || !t.chunk_writers.empty()) {
    FailValidation(src, "tensor '" + fqn + "' has both a sharding rule and listed chunks");
  }
  if (reg.dim < 0 || static_cast<size_t>(reg.dim) >= t.shape.size()) {
    FailValidation(src, "tensor '" + fqn + "' is split along dimension " + std::to_string(reg.dim) +
                            " of a shape " + ShapeToString(t.shape));
  }
  if (reg.rule != kRuleBalanced && reg.rule != kRuleCeil) {
    FailValidation(src, "tensor '" + fqn + "' has an unknown sharding rule " +
                            std::to_string(static_cast<int>(reg.rule)));
  }
  if (reg.world < 1 || reg.world != md.world_size) {
    FailValidation(src, "tensor '" + fqn + "' is split over " + std::to_string(reg.world) +
                            " ranks in a checkpoint saved by " + std::to_string(md.world_size));
  }
  const int64_t n = t.shape[static_cast<size_t>(reg.dim)];
  if (n < 1) {
    FailValidation(src, "tensor '" + fqn + "' is split along an empty dimension");
  }
  if (reg.rule == kRuleCeil && n >= reg.world) {
    // Every rank's slice is non-empty, so that chunk k is rank k's.
    const int64_t c = (n + reg.world - 1) / reg.world;
    if ((reg.world - 1) * c >= n) {
      FailValidation(src, "tensor '" + fqn + "': the ceil rule leaves a rank of " +
                              std::to_string(reg.world) + " without rows of " + std::to_string(n));
    }
  }
}

// Version 2: who wrote each chunk (its data files hold it) must be a rank of the save.
void ValidateWriters(const Metadata& md, const std::string& fqn, const TensorMetadata& t,
                     const std::string& src) {
  if (t.regular) return;
  if (t.chunk_writers.size() != t.chunks.size()) {
    FailValidation(src, "tensor '" + fqn + "' lists " + std::to_string(t.chunks.size()) +
                            " chunks and " + std::to_string(t.chunk_writers.size()) + " writers");
  }
  for (int32_t w : t.chunk_writers) {
    if (w < 0 || w >= md.world_size) {
      FailValidation(src, "tensor '" + fqn + "' names writer rank " + std::to_string(w) +
                              " in a checkpoint saved by " + std::to_string(md.world_size));
    }
  }
}

// A tensor's chunks lie inside it, are stored, and cover it exactly once.
void ValidateTensorEntry(const Metadata& md, const std::string& fqn, const TensorMetadata& t,
                         const std::string& src) {
  const int64_t volume = CheckedVolume(fqn, t, src);
  const bool v2 = md.format_version >= 2;
  if (t.regular) {
    ValidateRegularLayout(md, fqn, t, src);
    // A rule tiles its tensor by construction; version 1 (in memory, before encoding) still
    // needs every chunk stored.
    if (!v2) ForEachChunk(t, [&](size_t, const ChunkMeta& c) { CheckChunk(md, fqn, t, c, src); });
    return;
  }
  if (v2) ValidateWriters(md, fqn, t, src);
  int64_t covered = 0;
  for (const auto& c : t.chunks) {
    covered += v2 ? CheckChunkBox(fqn, t, c, src) : CheckChunk(md, fqn, t, c, src);
  }
  // Disjoint chunks whose sizes add up to the volume cover it exactly; overlapping ones may
  // add up to it too while leaving a gap.
  std::optional<std::pair<size_t, size_t>> overlap;
  try {
    overlap = FindOverlap(t.chunks, t.shape);
  } catch (const CorruptionError& e) {
    FailValidation(src, "tensor '" + fqn + "': " + e.what());
  }
  if (overlap) {
    FailValidation(src, "tensor '" + fqn + "' chunks " + t.chunks[overlap->first].ToString() +
                            " and " + t.chunks[overlap->second].ToString() + " overlap");
  }
  if (covered != volume) {
    FailValidation(src, "tensor '" + fqn + "' chunks cover " + std::to_string(covered) + " of " +
                            std::to_string(volume) + " elements");
  }
}

// The chunk offsets of each tensor, sorted once, so that finding a stored item's chunk is a
// binary search (a scan of every chunk per item would be quadratic in the chunks of a tensor).
class ChunkOffsetIndex {
 public:
  bool Contains(const std::string& fqn, const TensorMetadata& t, const Shape& offset) {
    auto [it, fresh] = sorted_.try_emplace(fqn);
    auto& sorted = it->second;
    if (t.regular) return ChunkOrdinal(t, offset).has_value();
    if (fresh) {
      sorted.reserve(t.chunks.size());
      for (const auto& c : t.chunks) sorted.push_back(&c.offsets);
      std::sort(sorted.begin(), sorted.end(), Less);
    }
    return std::binary_search(sorted.begin(), sorted.end(), &offset, Less);
  }

 private:
  static bool Less(const Shape* a, const Shape* b) { return *a < *b; }
  std::map<std::string_view, std::vector<const Shape*>> sorted_;
};

// Where a stored item lies and what it may expand to.
void CheckStoredBytes(const MetadataIndex& index, const StorageInfo& info, const std::string& src) {
  // The format is flat (docs/FORMAT.md): a data object is a plain name in the root.
  const std::string& p = info.relative_path;
  if (p.empty() || p == "." || p == ".." || p.find('/') != std::string::npos ||
      p.find('\\') != std::string::npos || p.find('\0') != std::string::npos) {
    FailValidation(src, "stored item " + index.ToString() + " has an invalid path '" + p +
                            "' (a data file is a plain name in the checkpoint's root)");
  }
  if (info.offset > std::numeric_limits<uint64_t>::max() - info.length ||
      info.offset + info.length > (uint64_t{1} << 62)) {
    FailValidation(src, "stored item " + index.ToString() + " has an overflowing offset/length");
  }
  // What a reader may be asked to allocate must be backed by stored bytes: a raw item is its
  // stored bytes; a zstd frame cannot expand by more than kMaxZstdExpansion (one 4-byte RLE
  // block per 128 KiB of output), so a claim beyond that is a lie, refused before any
  // allocation.
  if (info.transforms.empty() && info.raw_length != info.length) {
    FailValidation(src, "stored item " + index.ToString() + " is raw but records " +
                            std::to_string(info.raw_length) + " raw bytes for " +
                            std::to_string(info.length) + " stored");
  }
  if (info.transforms.size() == 1 && info.transforms[0] == "zstd" &&
      info.raw_length / kMaxZstdExpansion > info.length) {
    FailValidation(src, "stored item " + index.ToString() + " claims " +
                            std::to_string(info.raw_length) + " raw bytes from a " +
                            std::to_string(info.length) +
                            "-byte zstd frame (more than zstd can expand)");
  }
}

// Each stored item must belong to an entry (to a chunk, for a tensor) and lie in a plain file.
void ValidateStoredItems(const Metadata& md, const std::string& src) {
  ChunkOffsetIndex chunk_offsets;
  for (const auto& [index, info] : md.storage) {
    auto entry = md.entries.find(index.fqn);
    if (entry == md.entries.end()) {
      FailValidation(src, "stored item " + index.ToString() + " has no entry");
    }
    if (const auto* t = std::get_if<TensorMetadata>(&entry->second)) {
      if (!chunk_offsets.Contains(entry->first, *t, index.offset)) {
        FailValidation(src, "stored item " + index.ToString() + " matches no chunk of its tensor");
      }
    } else if (!index.offset.empty()) {
      FailValidation(src, "stored item " + index.ToString() + " of a byte entry has chunk offsets");
    }
    CheckStoredBytes(index, info, src);
  }
}

}  // namespace

void PutLe64(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetLe64(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}
constexpr char kIndexMagic[8] = {'D', 'C', 'P', 'I', 'D', 'X', '0', '1'};

// Version 2: the file table. A row's index lies inside its file and its length is what its item
// count takes (storage/checkpoint/file_index.h), so an index claims no more items than its bytes
// hold; names are plain and distinct; writers are ranks of the save.
void ValidateFileTable(const Metadata& md, const std::string& src) {
  std::unordered_set<std::string_view> names;
  names.reserve(md.files.size());
  for (const auto& f : md.files) {
    const std::string& p = f.name;
    if (p.empty() || p == "." || p == ".." || p.find('/') != std::string::npos ||
        p.find('\\') != std::string::npos || p.find('\0') != std::string::npos) {
      FailValidation(
          src, "data file " + ClippedName(p) + " is not a plain name in the checkpoint's root");
    }
    if (!names.insert(p).second) FailValidation(src, "data file '" + p + "' is listed twice");
    if (f.writer < 0 || f.writer >= md.world_size) {
      FailValidation(src, "data file '" + p + "' names writer rank " + std::to_string(f.writer) +
                              " in a checkpoint saved by " + std::to_string(md.world_size));
    }
    if (f.size > (uint64_t{1} << 62) || f.index_offset > f.size ||
        f.index_length > f.size - f.index_offset) {
      FailValidation(src, "data file '" + p + "': its index [" + std::to_string(f.index_offset) +
                              ", +" + std::to_string(f.index_length) + ") lies outside its " +
                              std::to_string(f.size) + " bytes");
    }
    if (f.index_length < kFileIndexHeaderBytes ||
        (f.index_length - kFileIndexHeaderBytes) % kFileIndexItemBytes != 0) {
      FailValidation(src, "data file '" + p + "': an index of " + std::to_string(f.index_length) +
                              " bytes is no whole number of items");
    }
    if (!f.index_copy.empty() &&
        (f.index_copy.size() != f.index_length ||
         Crc32c(0, f.index_copy.data(), f.index_copy.size()) != f.index_crc32c)) {
      FailValidation(src, "data file '" + p +
                              "': the metadata's copy of its index does not match the index's "
                              "recorded length and checksum");
    }
  }
}

// Version 2: the items each rank's indexes list are the items the metadata attributes to it
// (chunk k of a rule by rank k, an explicit chunk or a byte entry by its writer); the commit
// checks this per rank. Checked from the counts alone (O(entries + files), no rule expanded), so
// that neither an index (whose length is read and allocated) nor a load plan (one read item per
// chunk) can claim more than the other side holds: a 189-byte document claiming 2^31 chunks
// needs 2^31 rows of data files here, and a file's index_length is bounded by its writer's items.
void ValidateItemCounts(const Metadata& md, const std::string& src) {
  std::unordered_map<int32_t, uint64_t> stored;  // rank -> items its files' indexes hold
  std::unordered_map<int32_t, std::vector<const DataFile*>> file_of;
  stored.reserve(md.files.size());
  for (const DataFile& f : md.files) {
    const uint64_t n = (f.index_length - kFileIndexHeaderBytes) / kFileIndexItemBytes;
    if (n == 0) {
      // A writer creates a file for items only; a row that holds none is referenced by nothing
      // (and would cost a size query per row).
      FailValidation(src, "data file '" + f.name + "' holds no item (its index is empty)");
    }
    stored[f.writer] += n;
    file_of[f.writer].push_back(&f);
  }
  std::unordered_map<int32_t, std::pair<uint64_t, const std::string*>> listed;  // explicit
  std::vector<std::pair<size_t, const std::string*>> rules;  // chunk count, tensor
  for (const auto& [fqn, entry] : md.entries) {
    if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
      if (t->regular) {
        rules.emplace_back(ChunkCount(*t), &fqn);
      } else {
        for (int32_t w : t->chunk_writers) {
          auto& a = listed.try_emplace(w, 0, &fqn).first->second;
          ++a.first;
        }
      }
    } else {
      auto& a = listed.try_emplace(std::get<BytesMetadata>(entry).writer, 0, &fqn).first->second;
      ++a.first;
    }
  }
  std::sort(rules.begin(), rules.end(),
            [](const auto& a, const auto& b) { return a.first < b.first; });
  const size_t max_chunks = rules.empty() ? 0 : rules.back().first;
  // Chunk k of a rule is rank k's: every rank below the longest rule's chunk count needs files.
  if (max_chunks > stored.size()) {
    FailValidation(src, "tensor " + ClippedName(*rules.back().second) + " claims " +
                            std::to_string(max_chunks) + " stored chunks (one per rank) but only " +
                            std::to_string(stored.size()) +
                            " ranks have data files: its chunks exceed what is stored");
  }
  std::vector<int32_t> ranks;
  ranks.reserve(stored.size() + listed.size() + max_chunks);
  for (const auto& [r, n] : stored) ranks.push_back(r);
  for (const auto& [r, a] : listed) ranks.push_back(r);
  for (size_t r = 0; r < max_chunks; ++r) ranks.push_back(static_cast<int32_t>(r));
  std::sort(ranks.begin(), ranks.end());
  ranks.erase(std::unique(ranks.begin(), ranks.end()), ranks.end());
  std::vector<size_t> counts(rules.size());
  for (size_t i = 0; i < rules.size(); ++i) counts[i] = rules[i].first;
  for (int32_t r : ranks) {
    // Rules with more than r chunks each have one item of rank r.
    const auto longer = static_cast<uint64_t>(
        counts.end() - std::upper_bound(counts.begin(), counts.end(), static_cast<size_t>(r)));
    auto l = listed.find(r);
    const uint64_t expected = longer + (l == listed.end() ? 0 : l->second.first);
    auto s = stored.find(r);
    const uint64_t held = s == stored.end() ? 0 : s->second;
    if (held == expected) continue;
    const std::string* example =
        l != listed.end() ? l->second.second : (longer > 0 ? rules.back().second : nullptr);
    std::string names;
    auto f = file_of.find(r);
    if (f == file_of.end()) {
      names = "it has none";
    } else {
      constexpr size_t kNamed = 4;
      for (size_t i = 0; i < f->second.size() && i < kNamed; ++i) {
        names += (i ? ", '" : "'") + f->second[i]->name + "'";
      }
      if (f->second.size() > kNamed) {
        names += " and " + std::to_string(f->second.size() - kNamed) + " more";
      }
    }
    FailValidation(src, "the indexes of rank " + std::to_string(r) + "'s data files (" + names +
                            ") claim " + std::to_string(held) + " items, the metadata attributes " +
                            std::to_string(expected) + " to it" +
                            (example ? " (e.g. of " + ClippedName(*example) + ")" : std::string()));
  }
}

uint64_t FqnHash(std::string_view fqn) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (char c : fqn) {
    h ^= static_cast<uint8_t>(c);
    h *= 0x100000001b3ull;
  }
  h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9ull;
  h = (h ^ (h >> 27)) * 0x94D049BB133111EBull;
  return h ^ (h >> 31);
}

std::string EncodeFileIndex(std::vector<FileIndexItem> items) {
  std::sort(items.begin(), items.end(), [](const FileIndexItem& a, const FileIndexItem& b) {
    return a.fqn_hash != b.fqn_hash ? a.fqn_hash < b.fqn_hash : a.chunk < b.chunk;
  });
  std::string out(kIndexMagic, sizeof(kIndexMagic));
  PutLe64(out, items.size(), 4);
  PutLe64(out, 0, 4);
  out.reserve(kFileIndexHeaderBytes + items.size() * kFileIndexItemBytes);
  for (size_t i = 0; i < items.size(); ++i) {
    const FileIndexItem& it = items[i];
    if (i > 0 && it.fqn_hash == items[i - 1].fqn_hash && it.chunk == items[i - 1].chunk) {
      throw InternalError("file index: two items with key " + std::to_string(it.fqn_hash) + "/" +
                          std::to_string(it.chunk));
    }
    PutLe64(out, it.fqn_hash, 8);
    PutLe64(out, it.chunk, 4);
    PutLe64(out, it.offset, 8);
    PutLe64(out, it.length, 8);
    PutLe64(out, it.raw_length, 8);
    PutLe64(out, it.crc32c.value_or(0), 4);
    PutLe64(out, (it.crc32c ? 1u : 0u) | (it.zstd ? 2u : 0u), 1);
  }
  return out;
}

std::vector<FileIndexItem> DecodeFileIndex(std::string_view bytes, uint64_t index_offset,
                                           const std::string& file) {
  auto fail = [&](const std::string& what) -> CorruptionError {
    return CorruptionError("index of data file '" + file + "': " + what);
  };
  if (bytes.size() < kFileIndexHeaderBytes ||
      std::memcmp(bytes.data(), kIndexMagic, sizeof(kIndexMagic)) != 0) {
    throw fail("bad magic or too short (" + std::to_string(bytes.size()) + " bytes)");
  }
  const uint64_t count = GetLe64(bytes.data() + 8, 4);
  if (GetLe64(bytes.data() + 12, 4) != 0) throw fail("reserved bytes are not zero");
  if (bytes.size() != kFileIndexHeaderBytes + count * kFileIndexItemBytes) {
    throw fail(std::to_string(count) + " items in " + std::to_string(bytes.size()) + " bytes");
  }
  std::vector<FileIndexItem> items(static_cast<size_t>(count));
  const char* p = bytes.data() + kFileIndexHeaderBytes;
  for (size_t i = 0; i < items.size(); ++i, p += kFileIndexItemBytes) {
    FileIndexItem& it = items[i];
    it.fqn_hash = GetLe64(p, 8);
    it.chunk = static_cast<uint32_t>(GetLe64(p + 8, 4));
    it.offset = GetLe64(p + 12, 8);
    it.length = GetLe64(p + 20, 8);
    it.raw_length = GetLe64(p + 28, 8);
    const uint32_t crc = static_cast<uint32_t>(GetLe64(p + 36, 4));
    const uint8_t flags = static_cast<uint8_t>(p[40]);
    if (flags & ~3u) throw fail("item " + std::to_string(i) + " has unknown flags");
    if (flags & 1u) it.crc32c = crc;
    it.zstd = (flags & 2u) != 0;
    if (i > 0) {
      const FileIndexItem& prev = items[i - 1];
      if (prev.fqn_hash > it.fqn_hash || (prev.fqn_hash == it.fqn_hash && prev.chunk >= it.chunk)) {
        throw fail("items are not sorted by key, or repeat one (item " + std::to_string(i) + ")");
      }
    }
    if (it.offset > index_offset || it.length > index_offset - it.offset) {
      throw fail("item " + std::to_string(i) + " [" + std::to_string(it.offset) + ", +" +
                 std::to_string(it.length) + ") runs past the data (" +
                 std::to_string(index_offset) + " bytes)");
    }
    if (!it.zstd && it.raw_length != it.length) {
      throw fail("item " + std::to_string(i) + " is raw but records " +
                 std::to_string(it.raw_length) + " raw bytes for " + std::to_string(it.length));
    }
    if (it.zstd && it.raw_length / kMaxZstdExpansion > it.length) {
      throw fail("item " + std::to_string(i) + " claims " + std::to_string(it.raw_length) +
                 " raw bytes from a " + std::to_string(it.length) + "-byte zstd frame");
    }
  }
  // No two items share bytes (a lying index could make two chunks read one range).
  std::vector<std::pair<uint64_t, uint64_t>> spans;
  spans.reserve(items.size());
  for (const auto& it : items) {
    if (it.length > 0) spans.emplace_back(it.offset, it.length);
  }
  std::sort(spans.begin(), spans.end());
  for (size_t i = 1; i < spans.size(); ++i) {
    if (spans[i - 1].first + spans[i - 1].second > spans[i].first) {
      throw fail("two items overlap at byte " + std::to_string(spans[i].first));
    }
  }
  return items;
}

void ValidateMetadata(const Metadata& md, std::string_view source) {
  const std::string src(source);
  const bool v2 = md.format_version >= 2;
  if (!v2 && !md.files.empty()) {
    FailValidation(src, "version-1 metadata has a file table (a version-2 field)");
  }
  for (const auto& [fqn, entry] : md.entries) {
    if (fqn.empty()) FailValidation(src, "entry with an empty fqn");
    if (const auto* t = std::get_if<TensorMetadata>(&entry)) {
      ValidateTensorEntry(md, fqn, *t, src);
    } else if (v2) {
      const int32_t w = std::get<BytesMetadata>(entry).writer;
      if (w < 0 || w >= md.world_size) {
        FailValidation(src, "byte entry '" + fqn + "' names writer rank " + std::to_string(w) +
                                " in a checkpoint saved by " + std::to_string(md.world_size));
      }
    } else if (!md.storage.count(MetadataIndex{fqn, {}, {}})) {
      FailValidation(src, "byte entry '" + fqn + "' has no stored item");
    }
  }
  if (v2) {
    ValidateFileTable(md, src);
    ValidateItemCounts(md, src);
    // Indexes key items by FqnHash: two entries with one hash could not be told apart.
    std::unordered_map<uint64_t, const std::string*> hashes;
    hashes.reserve(md.entries.size());
    for (const auto& [fqn, entry] : md.entries) {
      auto [it, fresh] = hashes.emplace(FqnHash(fqn), &fqn);
      if (!fresh) {
        FailValidation(src, "entries '" + *it->second + "' and '" + fqn +
                                "' share an index key (FqnHash); rename one, or save with "
                                "metadata_version 1");
      }
    }
  }
  ValidateStoredItems(md, src);
  ValidateKeyPaths(md, src);
}

}  // namespace dcp
