// CRC32C (Castagnoli), the checksum of every stored item and of the metadata file.
// Backed by ISA-L (~20 GB/s on this class of machine). Thread-safe, no state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "dcp/proto/plan.h"

namespace dcp {

/// XXH3-128 (libxxhash) of a stream of bytes: the content hash incremental saves compare items
/// by (docs/FORMAT.md, version 3). ~20 GB/s from cache. One hasher per thread; movable.
class ContentHasher {
 public:
  ContentHasher();
  ~ContentHasher();
  ContentHasher(ContentHasher&&) noexcept;
  ContentHasher& operator=(ContentHasher&&) noexcept;
  void Add(const void* data, size_t len);
  /// The hash of everything added since construction or the last Reset.
  ContentHash Digest() const;
  void Reset();

 private:
  struct State;
  std::unique_ptr<State> state_;
};

/// CRC32C of `len` bytes; pass the previous result as `crc` to extend a running checksum
/// (start with 0). Crc32c(0, "123456789", 9) == 0xE3069283.
uint32_t Crc32c(uint32_t crc, const void* data, size_t len);

/// CRC32C of A followed by B, from crc_a = Crc32c(0, A), crc_b = Crc32c(0, B) and B's length,
/// in O(log len_b) without the data: lets pieces of one item be checksummed in parallel.
uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

/// CRC-32 (IEEE 802.3, the checksum of zip and gzip; zlib's crc32), chained the same way:
/// Crc32(0, "123456789", 9) == 0xCBF43926. For PyTorch's torch.save archives.
uint32_t Crc32(uint32_t crc, const void* data, size_t len);

/// CRC-32 of A followed by B, as Crc32cCombine.
uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b);

/// Which of the two an item's stored checksum is.
enum class ChecksumKind : uint8_t { kCrc32c, kCrc32 };

/// Crc32c or Crc32, by `kind`.
inline uint32_t ChecksumExtend(ChecksumKind kind, uint32_t crc, const void* data, size_t len) {
  return kind == ChecksumKind::kCrc32 ? Crc32(crc, data, len) : Crc32c(crc, data, len);
}
/// Crc32cCombine or Crc32Combine, by `kind`.
inline uint32_t ChecksumCombine(ChecksumKind kind, uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return kind == ChecksumKind::kCrc32 ? Crc32Combine(crc_a, crc_b, len_b)
                                      : Crc32cCombine(crc_a, crc_b, len_b);
}

}  // namespace dcp
