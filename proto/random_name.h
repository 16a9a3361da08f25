// Random identifiers for the names of objects (temporary files, save ids, upload tokens).
#pragma once

#include <cstdint>
#include <string>

namespace dcp {

/// 64 random bits from a per-thread generator seeded from std::random_device. A forked child
/// reseeds at its first call (the generator remembers the pid it was seeded in): otherwise every
/// child forked from one parent would draw the parent's next names, and a child would collide
/// with the temporary files a killed sibling left behind. Thread-safe. Throws std::system_error
/// only when std::random_device has no entropy source.
uint64_t RandomU64();

/// `bytes` random bytes as 2 * bytes lowercase hex digits.
std::string RandomHex(int bytes);

}  // namespace dcp
