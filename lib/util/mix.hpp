// splitmix64: the one integer mixer behind every seeded stream and hash of ids.
#pragma once
#include <cstdint>

namespace lorarun {

inline constexpr uint64_t kGolden64 = 0x9e3779b97f4a7c15ULL;  // 2^64 / golden ratio: splitmix64's increment

// splitmix64's finaliser: a bijection that spreads keys differing in few bits over all 64.
constexpr uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace lorarun
