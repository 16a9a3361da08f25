#include "dcp/proto/random_name.h"

#include <unistd.h>

#include <random>

namespace dcp {

uint64_t RandomU64() {
  // The pid check costs one getpid() per name, which is nothing next to creating the object the
  // name is for; pthread_atfork would reseed only the forking thread's generator.
  thread_local std::mt19937_64 rng;
  thread_local pid_t seeded_in = 0;
  const pid_t pid = ::getpid();
  if (seeded_in != pid) {
    std::random_device rd;
    rng.seed((static_cast<uint64_t>(rd()) << 32) ^ rd() ^ static_cast<uint64_t>(pid));
    seeded_in = pid;
  }
  return rng();
}

std::string RandomHex(int bytes) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string s;
  s.reserve(static_cast<size_t>(bytes) * 2);
  uint64_t bits = 0;
  for (int i = 0; i < bytes * 2; ++i) {
    if (i % 16 == 0) bits = RandomU64();
    s.push_back(kDigits[bits & 15]);
    bits >>= 4;
  }
  return s;
}

}  // namespace dcp
