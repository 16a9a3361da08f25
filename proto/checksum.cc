#include "proto/checksum.h"

#include <isa-l/crc.h>

namespace dcp {

uint32_t Crc32c(uint32_t crc, const void* data, size_t len) {
  // ISA-L's crc32_iscsi works on the un-inverted register; the standard CRC32C inverts the
  // initial value and the result.
  const uint32_t r = crc32_iscsi(static_cast<unsigned char*>(const_cast<void*>(data)),
                                 static_cast<int>(len), ~crc);
  return ~r;
}

}  // namespace dcp
