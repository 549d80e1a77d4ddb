// Which examples each rank sees in an epoch: DistributedSampler's rules, our own permutation.
#pragma once
#include <cstdint>
#include <vector>

namespace lorarun::data {

enum class Order { Shuffled, Sorted };

// Positions (into the selected documents sorted by _id, 0..n-1) that `rank` of `world` reads
// in `epoch`, in reading order. Shuffled: one permutation of all n that depends only on
// (seed, epoch); Sorted: identity. Equalisation as torch's DistributedSampler (drop_last=False):
// the order is padded to a multiple of `world` by repeating its first positions, so every rank
// gets ceil(n / world) examples and at most world-1 documents are seen twice in an epoch.
// Either way rank r takes every world-th position of the padded order (r, r+world, …), as
// DistributedSampler does, so the k-th `batch` positions of every rank together are the k-th
// world*batch positions of one rank's order (the padding aside).
std::vector<int64_t> shard_positions(int64_t n, int world, int rank, uint64_t seed, int64_t epoch, Order order);

// A permutation of 0..n-1 from (seed, epoch) alone: Fisher–Yates over splitmix64.
std::vector<int64_t> permutation(int64_t n, uint64_t seed, int64_t epoch);

}  // namespace lorarun::data
