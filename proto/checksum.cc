#include "dcp/proto/checksum.h"

#include <isa-l/crc.h>
#include <xxhash.h>

#include "dcp/proto/error.h"

namespace dcp {

uint32_t Crc32c(uint32_t crc, const void* data, size_t len) {
  // ISA-L's crc32_iscsi works on the un-inverted register; the standard CRC32C inverts the
  // initial value and the result. Its length is an int, so feed it at most 1 GiB at a time.
  constexpr size_t kStep = size_t{1} << 30;
  auto* p = static_cast<unsigned char*>(const_cast<void*>(data));
  uint32_t r = ~crc;
  while (len > 0) {
    const size_t n = len < kStep ? len : kStep;
    r = crc32_iscsi(p, static_cast<int>(n), r);
    p += n;
    len -= n;
  }
  return ~r;
}

uint32_t Crc32(uint32_t crc, const void* data, size_t len) {
  // ISA-L's gzip CRC takes and returns the standard (inverted) value, like zlib's crc32.
  return crc32_gzip_refl(crc, static_cast<const unsigned char*>(data), len);
}

// Combination by polynomial arithmetic modulo the (reflected) CRC polynomial: appending len_b
// bytes multiplies A's CRC register by x^(8 len_b); the initial and final inversions of the
// standard CRC cancel out in the XOR. (The method of zlib's crc32_combine; ISA-L has no
// combine, hence this short hand-written version, tested against ISA-L.)
namespace {

constexpr uint32_t kCastagnoliReflected = 0x82F63B78u;  // CRC32C
constexpr uint32_t kIeeeReflected = 0xEDB88320u;        // CRC-32 (zip, gzip)

// a * b modulo P, bit-reflected representation (x^0 is the top bit).
template <uint32_t P>
uint32_t MultModP(uint32_t a, uint32_t b) {
  uint32_t m = 1u << 31, p = 0;
  for (;;) {
    if (a & m) {
      p ^= b;
      if ((a & (m - 1)) == 0) break;
    }
    m >>= 1;
    b = (b & 1) ? (b >> 1) ^ P : b >> 1;
  }
  return p;
}

// x^(2^n) for every n a combination can reach (len_b < 2^64 bytes: 8 len_b < 2^67). zlib keeps
// 32 and wraps n around, which holds for CRC-32, where x^(2^32) = x, but not for CRC32C.
template <uint32_t P>
struct PowerTable {
  uint32_t x2n[67];  // x^(2^n) mod P
  PowerTable() {
    uint32_t p = 1u << 30;  // x^1
    for (auto& e : x2n) {
      e = p;
      p = MultModP<P>(p, p);
    }
  }
};

// x^(n * 2^k) mod P.
template <uint32_t P>
uint32_t X2nModP(uint64_t n, unsigned k) {
  static const PowerTable<P> table;
  uint32_t p = 1u << 31;  // x^0
  while (n) {
    if (n & 1) p = MultModP<P>(table.x2n[k], p);
    n >>= 1;
    ++k;
  }
  return p;
}

}  // namespace

uint32_t Crc32cCombine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return MultModP<kCastagnoliReflected>(X2nModP<kCastagnoliReflected>(len_b, 3), crc_a) ^ crc_b;
}

uint32_t Crc32Combine(uint32_t crc_a, uint32_t crc_b, uint64_t len_b) {
  return MultModP<kIeeeReflected>(X2nModP<kIeeeReflected>(len_b, 3), crc_a) ^ crc_b;
}

struct ContentHasher::State {
  XXH3_state_t* xxh = nullptr;
  ~State() { XXH3_freeState(xxh); }
};

ContentHasher::ContentHasher() : state_(std::make_unique<State>()) {
  state_->xxh = XXH3_createState();
  if (state_->xxh == nullptr) throw InternalError("XXH3_createState failed (out of memory)");
  Reset();
}
ContentHasher::~ContentHasher() = default;
ContentHasher::ContentHasher(ContentHasher&&) noexcept = default;
ContentHasher& ContentHasher::operator=(ContentHasher&&) noexcept = default;

void ContentHasher::Reset() { XXH3_128bits_reset(state_->xxh); }

void ContentHasher::Add(const void* data, size_t len) {
  XXH3_128bits_update(state_->xxh, data, len);
}

ContentHash ContentHasher::Digest() const {
  const XXH128_hash_t h = XXH3_128bits_digest(state_->xxh);
  return ContentHash{h.low64, h.high64};
}

}  // namespace dcp
