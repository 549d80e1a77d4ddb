#include "data/shard.hpp"

#include <fmt/format.h>
#include <numeric>

#include "util/error.hpp"

namespace lorarun::data {
namespace {

struct SplitMix64 {
  uint64_t state;
  uint64_t next() {
    uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  // Uniform in [0, bound) without modulo bias (rejection).
  uint64_t below(uint64_t bound) {
    const uint64_t limit = UINT64_MAX - UINT64_MAX % bound;
    for (;;)
      if (const uint64_t x = next(); x < limit) return x % bound;
  }
};

}  // namespace

std::vector<int64_t> permutation(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> p(static_cast<size_t>(n));
  std::iota(p.begin(), p.end(), 0);
  SplitMix64 rng{seed * 0x100000001b3ULL ^ static_cast<uint64_t>(epoch) * 0x9e3779b97f4a7c15ULL};
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[static_cast<size_t>(i)], p[rng.below(static_cast<uint64_t>(i) + 1)]);
  return p;
}

std::vector<int64_t> shard_positions(int64_t n, int world, int rank, uint64_t seed, int64_t epoch, Order order) {
  if (world < 1 || rank < 0 || rank >= world)
    throw Error(fmt::format("rank {} of world size {} is not a valid shard", rank, world));
  if (n <= 0) return {};
  std::vector<int64_t> all;
  if (order == Order::Shuffled) {
    all = permutation(n, seed, epoch);
  } else {
    all.resize(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), 0);
  }
  const int64_t per_rank = (n + world - 1) / world;
  for (int64_t i = 0; static_cast<int64_t>(all.size()) < per_rank * world; ++i)
    all.push_back(all[static_cast<size_t>(i)]);
  std::vector<int64_t> mine;
  mine.reserve(static_cast<size_t>(per_rank));
  for (int64_t k = 0; k < per_rank; ++k) mine.push_back(all[static_cast<size_t>(rank + k * world)]);
  return mine;
}

}  // namespace lorarun::data
