// Span expansion into reused memory, for the walks over a large reshard's plan (not installed).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "dcp/proto/plan.h"

namespace dcp {

/// Write the plain items `item` stands for (what AppendSpanPieces appends, in its order) into
/// out[used], out[used + 1], ..., advancing `used`: elements already there are assigned over,
/// reusing their strings' and shapes' memory, and `out` grows only past its size. A walk over
/// millions of pieces that keeps `out` between calls (resetting `used`) then allocates almost
/// nothing. Errors as AppendSpanPieces; out[used, size()) is left as it was.
void WriteSpanPieces(const ReadItem& item, const TensorMetadata& saved, std::vector<ReadItem>& out,
                     size_t& used);

/// One piece of a span, without the item: stored chunk `k` holds [chunk_begin, chunk_end) of the
/// rule's dimension `dim`, and the piece reads [lo, hi) of it (the span's box covers
/// [box_begin, ...) there); every other dimension is the span's.
struct SpanChunk {
  size_t dim = 0;
  size_t k = 0;
  int64_t chunk_begin = 0, chunk_end = 0, lo = 0, hi = 0, box_begin = 0;
};
/// fn(piece) for every piece of span `item` (chunk_span > 1), in AppendSpanPieces' order, until
/// fn returns false; the span is checked first, with AppendSpanPieces' errors. For walks that
/// need a piece's numbers, not a ReadItem (cooperative reads' waste).
void ForEachSpanChunk(const ReadItem& item, const TensorMetadata& saved,
                      const std::function<bool(const SpanChunk&)>& fn);

}  // namespace dcp
