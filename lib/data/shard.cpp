#include "data/shard.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <numeric>
#include <utility>

#include "util/error.hpp"
#include "util/mix.hpp"

namespace lorarun::data {
namespace {

constexpr uint64_t kGolden = kGolden64;
constexpr uint64_t finalise(uint64_t z) { return mix64(z); }

uint64_t epoch_key(uint64_t seed, int64_t epoch) {
  return seed * 0x100000001b3ULL ^ static_cast<uint64_t>(epoch) * kGolden;
}

struct SplitMix64 {
  uint64_t state;
  uint64_t next() { return finalise(state += kGolden); }
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
  SplitMix64 rng{epoch_key(seed, epoch)};
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[static_cast<size_t>(i)], p[rng.below(static_cast<uint64_t>(i) + 1)]);
  return p;
}

KeyedPermutation::KeyedPermutation(int64_t n, uint64_t key)
    : n_(static_cast<uint64_t>(std::max<int64_t>(n, 0))), key_(finalise(key)), mask_(0), half_bits_(0) {
  while (half_bits_ < 32 && n_ > uint64_t{1} << (2 * half_bits_)) ++half_bits_;
  mask_ = (uint64_t{1} << half_bits_) - 1;
}

// Six rounds: (l, r) -> (r, l ^ F(r)), F a keyed splitmix64 of the half and the round.
uint64_t KeyedPermutation::encrypt(uint64_t x) const {
  uint64_t l = x >> half_bits_, r = x & mask_;
  for (uint64_t round = 0; round < 6; ++round) {
    const uint64_t f = finalise(key_ ^ finalise(r + round * kGolden)) & mask_;
    l = std::exchange(r, l ^ f);
  }
  return l << half_bits_ | r;
}

// Cycle walking: the network permutes 0..4^h-1; following i's cycle to its next member below n
// is a bijection of 0..n-1 (i's cycle comes back to i, so the walk ends).
int64_t KeyedPermutation::operator()(int64_t i) const {
  uint64_t x = static_cast<uint64_t>(i);
  do x = encrypt(x);
  while (x >= n_);
  return static_cast<int64_t>(x);
}

ShardOrder::ShardOrder(int64_t n, int world, int rank, uint64_t seed, int64_t epoch, Order order)
    : n_(std::max<int64_t>(n, 0)),
      per_rank_(0),
      world_(world),
      rank_(rank),
      order_(order),
      permute_(n, epoch_key(seed, epoch)) {
  if (world < 1 || rank < 0 || rank >= world)
    throw Error(fmt::format("rank {} of world size {} is not a valid shard", rank, world));
  per_rank_ = (n_ + world - 1) / world;
}

int64_t ShardOrder::operator[](int64_t k) const {
  int64_t i = rank_ + k * world_;  // in the padded order
  if (i >= n_) i %= n_;            // the padding repeats the order's first positions
  return order_ == Order::Shuffled ? permute_(i) : i;
}

std::vector<int64_t> shard_positions(int64_t n, int world, int rank, uint64_t seed, int64_t epoch, Order order) {
  const ShardOrder mine(n, world, rank, seed, epoch, order);
  std::vector<int64_t> out(static_cast<size_t>(mine.size()));
  for (int64_t k = 0; k < mine.size(); ++k) out[static_cast<size_t>(k)] = mine[k];
  return out;
}

}  // namespace lorarun::data
