// A tensor every rank holds one slice of (the frozen base weights under sharding): the flattened
// tensor cut into `world` slices of equal length, the last padded with zeros when `world` does
// not divide its size. The whole tensor comes back from every rank's slice in rank order
// (ProcessGroup::all_gather_async).
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <vector>

namespace lorarun::dist {

struct ShardedTensor {
  at::Tensor shard;            // [per_rank()]: this rank's slice (its own storage)
  std::vector<int64_t> shape;  // of the whole tensor
  int64_t numel = 0;           // of the whole tensor

  // Rank `rank`'s slice of `whole` (any shape and dtype, on any device) among `world` ranks.
  static ShardedTensor of(const at::Tensor& whole, int rank, int world);
  // ceil(numel / world): the length of every rank's slice.
  static int64_t slice_length(int64_t numel, int world) { return (numel + world - 1) / world; }

  int64_t per_rank() const { return shard.numel(); }
  // A buffer [world * per_rank()] for the gather, on the shard's device, in its dtype.
  at::Tensor gather_buffer(int world) const;
  // `gathered` (every rank's slice in rank order, as gather_buffer() shapes it) as the whole
  // tensor: a view of it, without the padding.
  at::Tensor whole(const at::Tensor& gathered) const;
};

}  // namespace lorarun::dist
