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

#include "model/gguf_blocks.hpp"
#include "model/nf4.hpp"

namespace lorarun::model {

struct ShardedTensor {
  at::Tensor shard;            // [per_rank()]: this rank's slice (its own storage)
  std::vector<int64_t> shape;  // of the whole tensor
  int64_t numel = 0;           // of the whole tensor
  int block = -1, place = -1;  // where BaseShards::add_block registered it (-1: not in a block)

  // Rank `rank`'s slice of `whole` (any shape and dtype, on any device) among `world` ranks, on
  // `device` (default: whole's).
  static ShardedTensor of(const at::Tensor& whole, int rank, int world, std::optional<at::Device> device = {});
  // ceil(numel / world): the length of every rank's slice.
  static int64_t slice_length(int64_t numel, int world) { return (numel + world - 1) / world; }

  int64_t per_rank() const { return shard.numel(); }
  // A buffer [world * per_rank()] for the gather, on the shard's device, in its dtype.
  at::Tensor gather_buffer(int world) const;
  // `gathered` (every rank's slice in rank order, as gather_buffer() shapes it) as the whole
  // tensor: a view of it, without the padding.
  at::Tensor whole(const at::Tensor& gathered) const;
};

// dist.shard_base: this rank's place among the ranks that share the frozen base, and the whole
// weights it gathers from them. A decoder block's weights are gathered together when the first of
// them is needed, and stay until a block two places away takes their buffers; with `prefetch` the
// next block's gather (the previous one's, in backward) starts at once and runs while this block
// computes. So at most two blocks are whole at a time, and a block used again straight away (the
// last in forward, first in backward; activation checkpointing's recomputation) is not gathered
// again.
struct BaseShards {
  int rank = 0, world = 1;
  // Starts gathering every rank's `in` ([n]) into `out` ([world * n]) in rank order; returns what
  // waits for it. A collective: every rank starts the same gathers in the same order, which holds
  // because every rank runs the same passes over the same blocks.
  std::function<std::function<void()>(at::Tensor& out, const at::Tensor& in)> all_gather;
  bool prefetch = true;  // false: one block whole at a time, gathered when needed

  // Registers the next decoder block's slices, in a fixed order, marking each with its place.
  void add_block(const std::vector<ShardedTensor*>& slices);

  // The whole tensor, from every rank's slice: a view of a gather buffer. For a block's slice, valid
  // until the buffers of its block are taken by another (two block fetches later); otherwise a buffer
  // kept for tensors of its size and dtype in `slot`, valid until the next gather of that size into
  // that slot (one linear's weight is used at a time; an NF4 weight's codes and scales take two slots).
  at::Tensor gather(const ShardedTensor& s, int slot = 0) const;
  // Bytes of the gather buffers (whole weights) this rank holds now.
  int64_t buffer_bytes() const;
  // The most the blocks' gather buffers take: the largest block's whole weights, twice with prefetch.
  int64_t block_buffer_bytes() const;
  int64_t block_fetches() const { return fetches_; }  // blocks gathered so far

 private:
  struct Resident {  // one block's whole weights, by place
    int block = -1;
    std::vector<at::Tensor> buffers;
    std::vector<std::function<void()>> pending;  // set while the gather into buffers[i] runs
  };
  // Starts a gather into `out` (made or remade to fit); returns its wait, or null when done.
  std::function<void()> start(at::Tensor& out, const ShardedTensor& s) const;
  void fetch(int block) const;  // starts gathering `block` into its resident set

  std::vector<std::vector<ShardedTensor>> blocks_;  // registered slices, by block and place
  mutable Resident resident_[2];                    // block b in resident_[b % 2] (b % 1 without prefetch)
  mutable int64_t fetches_ = 0;
  mutable std::map<std::tuple<int64_t, int, int>, at::Tensor> buffers_;  // (elements, dtype, slot): reused
};

// A frozen linear's weight held as this rank's slices: dense, NF4 with its packed levels and its
// block scales sliced (the small tables stay whole), or a GGUF's blocks (model.keep_quantized)
// with their bytes sliced.
struct ShardedWeight {
  std::shared_ptr<const BaseShards> group;
  std::vector<int64_t> shape;      // [out, in]
  ShardedTensor dense;             // the weight, when not NF4; a GGUF's: its blocks' bytes
  std::optional<Nf4Weight> nf4;    // NF4: everything but `packed` and the block scales
  ShardedTensor packed, scales;    // NF4: packed levels; absmax (or absmax8.codes with double quantisation)
  std::optional<GgufBlocks> gguf;  // GGUF: everything but `raw`

  // Slices `weight` (dense; the slice on `device`, default weight's), `q` (NF4) or `b`'s bytes (the
  // slice on b.device, where the gathers run) for group->rank.
  static ShardedWeight of(const at::Tensor& weight, std::shared_ptr<const BaseShards> group,
                          std::optional<at::Device> device = {});
  static ShardedWeight of(const Nf4Weight& q, std::shared_ptr<const BaseShards> group);
  static ShardedWeight of(const GgufBlocks& b, std::shared_ptr<const BaseShards> group);

  at::Tensor whole() const;     // gathered (a collective) and, for NF4 and GGUF, dequantised: [out, in]
  int64_t bytes() const;        // held on this rank
  int64_t whole_bytes() const;  // held by one rank without sharding
};

// y = x W^T + b with W gathered whole in forward and again in backward, so no whole W outlives
// the call (the slices are all autograd keeps). Gradients flow to x only.
at::Tensor sharded_linear(const at::Tensor& x, const ShardedWeight& w, const at::Tensor& bias);

}  // namespace lorarun::model
