// A tensor every rank holds one slice of (the frozen base weights under sharding): the flattened
// tensor cut into `world` slices of equal length, the last padded with zeros when `world` does
// not divide its size. The whole tensor comes back from every rank's slice in rank order
// (ProcessGroup::all_gather_async).
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <tuple>
#include <vector>

#include "model/nf4.hpp"

namespace lorarun::model {

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

// dist.shard_base: this rank's place among the ranks that share the frozen base.
struct BaseShards {
  int rank = 0, world = 1;
  // Every rank's `in` ([n]) into `out` ([world * n]) in rank order. A collective: every rank
  // calls it for the same tensors in the same order.
  std::function<void(at::Tensor& out, const at::Tensor& in)> all_gather;

  // The whole tensor, from every rank's slice: a view of a buffer kept for tensors of its size and
  // dtype in `slot`, valid until the next gather of that size into that slot (one linear's weight
  // is used at a time; an NF4 weight's codes and scales take two slots).
  at::Tensor gather(const ShardedTensor& s, int slot = 0) const;

 private:
  mutable std::map<std::tuple<int64_t, int, int>, at::Tensor> buffers_;  // (elements, dtype, slot): reused
};

// A frozen linear's weight held as this rank's slices: dense, or NF4 with its packed levels and
// its block scales sliced (the small tables stay whole).
struct ShardedWeight {
  std::shared_ptr<const BaseShards> group;
  std::vector<int64_t> shape;    // [out, in]
  ShardedTensor dense;           // the weight, when not NF4
  std::optional<Nf4Weight> nf4;  // NF4: everything but `packed` and the block scales
  ShardedTensor packed, scales;  // NF4: packed levels; absmax (or absmax8.codes with double quantisation)

  // Slices `weight` (dense) or `q` (NF4) for group->rank.
  static ShardedWeight of(const at::Tensor& weight, std::shared_ptr<const BaseShards> group);
  static ShardedWeight of(const Nf4Weight& q, std::shared_ptr<const BaseShards> group);

  at::Tensor whole() const;     // gathered (a collective) and, for NF4, dequantised: [out, in]
  int64_t bytes() const;        // held on this rank
  int64_t whole_bytes() const;  // held by one rank without sharding
};

// y = x W^T + b with W gathered whole in forward and again in backward, so no whole W outlives
// the call (the slices are all autograd keeps). Gradients flow to x only.
at::Tensor sharded_linear(const at::Tensor& x, const ShardedWeight& w, const at::Tensor& bias);

}  // namespace lorarun::model
