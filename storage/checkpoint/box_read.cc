// Partial reads of a raw stored chunk (box_read.h). A block-verified read checks exactly the
// blocks its byte runs touch: a flipped bit anywhere in a block is caught by every read that
// touches the block, at the cost of at most one block of extra bytes at each end of a run,
// instead of a second pass over the whole item.
#include "dcp/storage/checkpoint/box_read.h"

#include <algorithm>

#include "dcp/proto/checksum.h"
#include "dcp/proto/error.h"
#include "dcp/proto/slab_copy.h"

namespace dcp {

namespace {

// Verified reads land in steps of this size, each CRC'd while still in the CPU cache.
constexpr size_t kHotStepBytes = size_t{1} << 20;

void EnsureScratch(HostBuffer& scratch, size_t n, size_t limit) {
  if (n > limit) throw InternalError("scratch request over the limit");
  scratch.Reserve(n);
}

void ReadBoxDim(ItemBytes& src, DType dtype, size_t esize, const Shape& sizes, const Shape& box_off,
                const Shape& box_len, const TensorView& dst, HostBuffer& scratch, size_t limit,
                Shape& prefix) {
  const size_t d = prefix.size();
  // Byte offset of the sub-block selected by `prefix`, and bytes per index along dim d.
  const Shape strides = ContiguousStrides(sizes);
  uint64_t off = 0;
  for (size_t j = 0; j < d; ++j) off += static_cast<uint64_t>(box_off[j] + prefix[j]) * strides[j];
  const uint64_t row_bytes = static_cast<uint64_t>(strides[d]) * esize;
  if (row_bytes <= limit) {
    const int64_t rows_per_slab = std::max<int64_t>(1, limit / std::max<uint64_t>(row_bytes, 1));
    for (int64_t i = 0; i < box_len[d]; i += rows_per_slab) {
      const int64_t n = std::min(rows_per_slab, box_len[d] - i);
      const size_t bytes = static_cast<size_t>(n * row_bytes);
      EnsureScratch(scratch, bytes, limit);
      src.Read((off + static_cast<uint64_t>(box_off[d] + i) * strides[d]) * esize, scratch.data(),
               bytes);
      CopySlabIntoBox(dst, scratch.data(), dtype, sizes, box_off, box_len, prefix, d, i, n);
    }
    return;
  }
  // One index along d is larger than the scratch buffer: descend a dimension.
  for (int64_t i = 0; i < box_len[d]; ++i) {
    prefix.push_back(i);
    ReadBoxDim(src, dtype, esize, sizes, box_off, box_len, dst, scratch, limit, prefix);
    prefix.pop_back();
  }
}

}  // namespace

void ReadBox(ItemBytes& src, DType dtype, const Shape& sizes, const Shape& box_off,
             const Shape& box_len, const TensorView& dst, HostBuffer& scratch,
             size_t scratch_limit) {
  const size_t esize = ElementSize(dtype);
  const size_t rank = sizes.size();
  // One byte range: leading dims of length 1, then one partial dim, then full dims.
  size_t k = 0;
  while (k < rank && box_len[k] == 1) ++k;
  bool one_range = true;
  for (size_t d = k + 1; d < rank; ++d) one_range &= box_len[d] == sizes[d];
  if (one_range && IsDense(dst) && dst.device.is_cpu()) {
    const Shape strides = ContiguousStrides(sizes);
    uint64_t first = 0;
    for (size_t d = 0; d < rank; ++d) first += static_cast<uint64_t>(box_off[d]) * strides[d];
    const size_t n = dst.nbytes();
    // The lowest address of a dense view is its data pointer: strides are non-negative
    // (IsDense) and the view starts at its first element.
    if (n > 0) src.Read(first * esize, dst.data, n);
    return;
  }
  Shape prefix;  // fixed indices (relative to the box) of the dims before the current one
  ReadBoxDim(src, dtype, esize, sizes, box_off, box_len, dst, scratch, scratch_limit, prefix);
}

bool ReadsWholeChunk(const Shape& sizes, const Shape& box_off, const Shape& box_len, size_t esize,
                     const TensorView& dst, size_t scratch_limit) {
  const size_t rank = sizes.size();
  if (rank == 0 || box_off[0] != 0 || box_len[0] != sizes[0]) return false;
  size_t k = 0;
  while (k < rank && box_len[k] == 1) ++k;
  bool one_range = true;
  for (size_t d = k + 1; d < rank; ++d) one_range &= box_len[d] == sizes[d];
  if (one_range && IsDense(dst) && dst.device.is_cpu()) return false;
  return static_cast<uint64_t>(ContiguousStrides(sizes)[0]) * esize <= scratch_limit;
}

BlockVerifier::BlockVerifier(ReadableObject& in, const StorageInfo& info, std::string what,
                             std::string where, size_t slack_step)
    : in_(in),
      info_(info),
      what_(std::move(what)),
      where_(std::move(where)),
      block_(info.blocks.count == 0 ? std::max<uint64_t>(info.length, 1)
                                    : uint64_t{1} << info.blocks.log2),
      slack_step_(std::max<size_t>(slack_step, 1)) {}

uint64_t BlockVerifier::BlockEnd(uint64_t j) const {
  return std::min<uint64_t>((j + 1) * block_, info_.length);
}

void BlockVerifier::Read(uint64_t at, void* dst, size_t n) {
  if (n == 0) return;
  if (at > info_.length || n > info_.length - at) {
    throw InternalError("read of [" + std::to_string(at) + ", +" + std::to_string(n) + ") of " +
                        what_ + " past its " + std::to_string(info_.length) + " bytes");
  }
  const uint64_t j = at / block_;
  if (cur_ == j && at >= pos_) {
    Slack(pos_, at);  // a gap within the open block
  } else {
    if (cur_ != UINT64_MAX && pos_ > cur_ * block_) Close();
    cur_ = j;
    pos_ = j * block_;
    crc_ = 0;
    Slack(pos_, at);
  }
  char* p = static_cast<char*>(dst);
  in_.ReadAtStreaming(info_.offset + at, dst, n, kHotStepBytes,
                      [&](size_t pos, size_t k) { Feed(p + pos, k); });
}

void BlockVerifier::Finish() {
  if (cur_ != UINT64_MAX && pos_ > cur_ * block_ && pos_ < BlockEnd(cur_)) Close();
}

// Extend the open block by the next n bytes of the item; each block that completes is checked,
// and the next one opened.
void BlockVerifier::Feed(const char* p, size_t n) {
  while (n > 0) {
    const size_t m = static_cast<size_t>(std::min<uint64_t>(n, BlockEnd(cur_) - pos_));
    crc_ = Crc32c(crc_, p, m);
    pos_ += m;
    p += m;
    n -= m;
    if (pos_ < BlockEnd(cur_)) continue;
    const uint32_t stored =
        info_.blocks.count == 0 ? info_.crc32c.value_or(0) : info_.blocks.crcs[cur_];
    if (crc_ != stored) {
      const uint64_t begin = cur_ * block_;
      throw CorruptionError("checksum mismatch for " + what_ + " in '" + where_ + "' at offset " +
                            std::to_string(info_.offset) + ": block " + std::to_string(cur_) +
                            " (item bytes [" + std::to_string(begin) + ", " + std::to_string(pos_) +
                            ")): stored crc32c " + std::to_string(stored) + ", computed " +
                            std::to_string(crc_));
    }
    ++cur_;
    crc_ = 0;
  }
}

// Read [from, to) of the item (within the open block) only to CRC it.
void BlockVerifier::Slack(uint64_t from, uint64_t to) {
  if (from >= to) return;
  const size_t step = static_cast<size_t>(std::min<uint64_t>(slack_step_, block_));
  if (!slack_) slack_.reset(new char[step]);  // not zeroed: every byte is read into first
  while (from < to) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(step, to - from));
    in_.ReadAt(info_.offset + from, slack_.get(), n);
    Feed(slack_.get(), n);
    from += n;
  }
}

// Read the rest of the open block and check it.
void BlockVerifier::Close() { Slack(pos_, BlockEnd(cur_)); }

}  // namespace dcp
