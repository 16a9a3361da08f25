// Partial reads of a raw stored chunk: a box of it copied into a destination through bounded
// scratch (ReadBox), from a source of the item's bytes that may verify them block by block
// (BlockVerifier, for items whose data file has a block table: docs/FORMAT.md). Internal (not
// installed); used by the store reader's read threads, each object by one thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "dcp/proto/plan.h"
#include "dcp/proto/staging.h"
#include "dcp/proto/tensor.h"
#include "dcp/storage/store.h"

namespace dcp {

/// Where ReadBox takes a stored item's bytes from.
class ItemBytes {
 public:
  virtual ~ItemBytes() = default;
  /// Fill dst with bytes [at, at + n) of the item. Errors as ReadableObject::ReadAt, or
  /// CorruptionError when a check of the bytes fails.
  virtual void Read(uint64_t at, void* dst, size_t n) = 0;
};

/// Copy the box [box_off, +box_len) of a stored C-contiguous chunk of shape `sizes` (the item
/// `src` reads) into `dst` (shape box_len), using at most `scratch_limit` bytes of `scratch`.
/// When the box is one byte range and dst is dense host memory, reads straight into dst;
/// otherwise in slabs of whole rows, narrowed to deeper dimensions when one row is over the
/// limit. Reads ascend through the item.
void ReadBox(ItemBytes& src, DType dtype, const Shape& sizes, const Shape& box_off,
             const Shape& box_len, const TensorView& dst, HostBuffer& scratch,
             size_t scratch_limit);

/// Whether ReadBox of this box reads every byte of the chunk, in order: the box spans the whole
/// first dimension, a row of it fits the scratch limit (slabs of whole rows) and it is not the
/// single-range read straight into a dense destination.
bool ReadsWholeChunk(const Shape& sizes, const Shape& box_off, const Shape& box_len, size_t esize,
                     const TensorView& dst, size_t scratch_limit);

/// The bytes of a raw item whose blocks have CRC32Cs (StorageInfo::blocks), read from `in` with
/// every block a read touches verified: the block's bytes before and after the read (at most a
/// block at each end of each contiguous run of reads) are read and CRC'd, never buffered whole.
/// Consecutive reads within one block continue it without re-reading. Finish() checks the last
/// block touched. Slack is read in steps of at most `slack_step` bytes (the scratch limit), through
/// a buffer of that size. A mismatch is a CorruptionError naming `what` (the item), `where` (its
/// file), the block, its byte range and both CRCs. `info` must outlive the verifier. Not
/// thread-safe.
class BlockVerifier : public ItemBytes {
 public:
  BlockVerifier(ReadableObject& in, const StorageInfo& info, std::string what, std::string where,
                size_t slack_step);
  void Read(uint64_t at, void* dst, size_t n) override;
  /// Verify the block the reads ended in (reading the rest of it). Call after the last read.
  void Finish();

 private:
  uint64_t BlockEnd(uint64_t j) const;
  void Feed(const char* p, size_t n);
  void Slack(uint64_t from, uint64_t to);
  void Close();

  ReadableObject& in_;
  const StorageInfo& info_;
  std::string what_, where_;
  uint64_t block_;             // bytes per block (the item's length when it is one block)
  uint64_t cur_ = UINT64_MAX;  // the open block (UINT64_MAX: none yet)
  uint64_t pos_ = 0;           // item offset up to which the open block is CRC'd
  uint32_t crc_ = 0;           // of [cur_ * block_, pos_)
  size_t slack_step_;
  std::unique_ptr<char[]> slack_;
};

}  // namespace dcp
