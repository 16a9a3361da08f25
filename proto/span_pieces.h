// Span expansion into reused memory, for the walks over a large reshard's plan (not installed).
#pragma once

#include <cstddef>
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

}  // namespace dcp
