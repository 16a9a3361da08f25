#include "dcp/proto/chunks.h"

#include <algorithm>
#include <cstdint>
#include <functional>
#include <map>
#include <queue>
#include <string>

#include "dcp/proto/error.h"

namespace dcp {

namespace {

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
    throw InvalidArgumentError(std::to_string(order.size()) +
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

}  // namespace

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

}  // namespace dcp
