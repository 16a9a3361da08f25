#include "proto/checksum.h"

#include <isa-l/crc.h>

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

}  // namespace dcp
