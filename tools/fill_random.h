// Deterministic pseudo-random bytes (splitmix64) for the demo, the benchmarks and the tests:
// fast, reproducible from a seed, and never zero pages (which some storage special-cases).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace dcp::tools {

inline void FillRandomBytes(void* data, size_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  auto* p = static_cast<unsigned char*>(data);
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    x += 0x9E3779B97F4A7C15ull;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    std::memcpy(p + i, &z, 8);
  }
  for (; i < n; ++i) p[i] = static_cast<unsigned char>((x >> (i % 8 * 8)) ^ i);
}

}  // namespace dcp::tools
