// Which examples each rank sees in an epoch: DistributedSampler's rules, our own permutation.
#pragma once
#include <cstdint>
#include <vector>

namespace lorarun::data {

enum class Order { Shuffled, Sorted };

// A keyed bijection of 0..n-1, computed one position at a time (no list of n): a balanced
// Feistel network over the smallest power of four >= n, cycle-walked back into 0..n-1 (fewer
// than 4 rounds of the network per position on average, since that domain is below 4n).
class KeyedPermutation {
 public:
  KeyedPermutation(int64_t n, uint64_t key);
  int64_t operator()(int64_t i) const;

 private:
  uint64_t encrypt(uint64_t x) const;
  uint64_t n_, key_, mask_;
  int half_bits_;
};

// This rank's positions (into the selected documents sorted by _id, 0..n-1) in `epoch`, in
// reading order, each computed when asked: memory does not grow with n. Shuffled: one keyed
// permutation of all n that depends only on (seed, epoch); Sorted: identity. Equalisation as
// torch's DistributedSampler (drop_last=False): the order is padded to a multiple of `world` by
// repeating its first positions, so every rank gets ceil(n / world) examples and at most world-1
// documents are seen twice in an epoch. Either way rank r takes every world-th position of the
// padded order (r, r+world, …), as DistributedSampler does, so the k-th `batch` positions of
// every rank together are the k-th world*batch positions of one rank's order (the padding aside).
class ShardOrder {
 public:
  ShardOrder(int64_t n, int world, int rank, uint64_t seed, int64_t epoch, Order order);
  int64_t size() const { return per_rank_; }  // ceil(n / world)
  int64_t operator[](int64_t k) const;        // 0 <= k < size()

 private:
  int64_t n_, per_rank_;
  int world_, rank_;
  Order order_;
  KeyedPermutation permute_;
};

// ShardOrder's positions as a list (for orders that are themselves lists: a mixture's picks).
std::vector<int64_t> shard_positions(int64_t n, int world, int rank, uint64_t seed, int64_t epoch, Order order);

// A permutation of 0..n-1 from (seed, epoch) alone, drawn whole: Fisher–Yates over splitmix64
// (where a list of n is held anyway: shuffle windows, a stream's runs, packing's bins, a mixture).
std::vector<int64_t> permutation(int64_t n, uint64_t seed, int64_t epoch);

}  // namespace lorarun::data
