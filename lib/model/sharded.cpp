#include "model/sharded.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <utility>

#include "model/recompute.hpp"
#include "util/error.hpp"

namespace lorarun::model {

ShardedTensor ShardedTensor::of(const at::Tensor& whole, int rank, int world, std::optional<at::Device> device) {
  if (world < 1 || rank < 0 || rank >= world)
    throw Error(fmt::format("ShardedTensor: rank {} of {} ranks (a lorarun bug)", rank, world));
  ShardedTensor s;
  s.shape = whole.sizes().vec();
  s.numel = whole.numel();
  const int64_t per = slice_length(s.numel, world);
  const int64_t begin = std::min<int64_t>(s.numel, per * rank);
  const int64_t end = std::min<int64_t>(s.numel, begin + per);
  s.shard = at::zeros({per}, whole.options().device(device.value_or(whole.device())));
  if (end > begin) s.shard.narrow(0, 0, end - begin).copy_(whole.reshape({-1}).narrow(0, begin, end - begin));
  return s;
}

at::Tensor ShardedTensor::gather_buffer(int world) const { return at::empty({per_rank() * world}, shard.options()); }

at::Tensor ShardedTensor::whole(const at::Tensor& gathered) const {
  if (gathered.dim() != 1 || gathered.numel() < numel || gathered.numel() % std::max<int64_t>(1, per_rank()) != 0)
    throw Error(
        fmt::format("ShardedTensor: {} gathered elements for a tensor of {} (a lorarun bug)", gathered.numel(), numel));
  return gathered.narrow(0, 0, numel).view(shape);
}

void BaseShards::add_block(const std::vector<ShardedTensor*>& slices) {
  std::vector<ShardedTensor>& kept = blocks_.emplace_back();
  for (ShardedTensor* s : slices) {
    s->block = static_cast<int>(blocks_.size()) - 1;
    s->place = static_cast<int>(kept.size());
    kept.push_back(*s);  // shares the slice's storage
  }
}

std::function<void()> BaseShards::start(at::Tensor& out, const ShardedTensor& s) const {
  if (!out.defined() || out.numel() != s.per_rank() * world || out.scalar_type() != s.shard.scalar_type() ||
      out.device() != s.shard.device())
    out = s.gather_buffer(world);  // a buffer for tensors of this size, kept for the next gather
  if (all_gather) return all_gather(out, s.shard);
  if (world != 1) throw Error(fmt::format("BaseShards: {} ranks and no all_gather (a lorarun bug)", world));
  out.copy_(s.shard);  // one rank without a process group: the slice is the whole
  return nullptr;
}

void BaseShards::fetch(int block) const {
  Resident& r = resident_[block % (prefetch ? 2 : 1)];
  for (auto& wait : r.pending)  // the buffers' last gather lands before the next one
    if (wait) std::exchange(wait, nullptr)();
  const std::vector<ShardedTensor>& slices = blocks_.at(block);
  ++fetches_;
  r.block = block;
  r.buffers.resize(slices.size());
  r.pending.assign(slices.size(), nullptr);
  for (size_t i = 0; i < slices.size(); ++i) {
    const ShardedTensor& s = slices[i];
    r.pending[i] = start(r.buffers[i], s);
  }
}

at::Tensor BaseShards::gather(const ShardedTensor& s, int slot) const {
  if (s.block < 0) {
    at::Tensor& out = buffers_[{s.per_rank() * world, static_cast<int>(s.shard.scalar_type()), slot}];
    if (auto wait = start(out, s)) wait();
    return s.whole(out);
  }
  const int sets = prefetch ? 2 : 1;
  if (resident_[s.block % sets].block != s.block) fetch(s.block);
  if (prefetch) {  // the block used next: backward visits the blocks last to first
    const int next = s.block + (in_backward() ? -1 : 1);
    if (next >= 0 && next < static_cast<int>(blocks_.size()) && resident_[next % 2].block != next) fetch(next);
  }
  Resident& r = resident_[s.block % sets];
  if (auto& wait = r.pending.at(s.place)) std::exchange(wait, nullptr)();
  return s.whole(r.buffers[s.place]);
}

int64_t BaseShards::block_buffer_bytes() const {
  int64_t largest = 0;
  for (const std::vector<ShardedTensor>& block : blocks_) {
    int64_t n = 0;
    for (const ShardedTensor& s : block) n += s.per_rank() * world * static_cast<int64_t>(s.shard.element_size());
    largest = std::max(largest, n);
  }
  return largest * (prefetch ? 2 : 1);
}

int64_t BaseShards::buffer_bytes() const {
  int64_t n = 0;
  for (const auto& [key, t] : buffers_) n += static_cast<int64_t>(t.nbytes());
  for (const Resident& r : resident_)
    for (const at::Tensor& t : r.buffers) n += static_cast<int64_t>(t.nbytes());
  return n;
}

ShardedWeight ShardedWeight::of(const at::Tensor& weight, std::shared_ptr<const BaseShards> group,
                                std::optional<at::Device> device) {
  ShardedWeight w;
  w.shape = weight.sizes().vec();
  w.dense = ShardedTensor::of(weight, group->rank, group->world, device);
  w.group = std::move(group);
  return w;
}

ShardedWeight ShardedWeight::of(const Nf4Weight& q, std::shared_ptr<const BaseShards> group) {
  ShardedWeight w;
  w.shape = q.shape;
  w.nf4 = q;
  w.packed = ShardedTensor::of(q.packed, group->rank, group->world);
  w.nf4->packed = at::Tensor();
  if (q.double_quant()) {
    w.scales = ShardedTensor::of(q.absmax8.codes, group->rank, group->world);
    w.nf4->absmax8.codes = at::Tensor();
  } else {
    w.scales = ShardedTensor::of(q.absmax, group->rank, group->world);
    w.nf4->absmax = at::Tensor();
  }
  w.group = std::move(group);
  return w;
}

ShardedWeight ShardedWeight::of(const GgufBlocks& b, std::shared_ptr<const BaseShards> group) {
  ShardedWeight w;
  w.shape = b.shape;
  w.dense = ShardedTensor::of(b.raw, group->rank, group->world, b.device.is_meta() ? at::kMeta : b.device);
  w.gguf = b;
  w.gguf->raw = at::Tensor();
  w.group = std::move(group);
  return w;
}

at::Tensor ShardedWeight::whole() const {
  if (gguf) {  // the bytes gathered where the ranks exchange them, and dequantised there
    GgufBlocks b = *gguf;
    b.raw = group->gather(dense);
    return b.dequantize();
  }
  if (!nf4) return group->gather(dense);
  Nf4Weight q = *nf4;
  q.packed = group->gather(packed);
  (q.double_quant() ? q.absmax8.codes : q.absmax) = group->gather(scales, 1);
  return q.dequantize();
}

int64_t ShardedWeight::bytes() const {
  const auto held = [](const ShardedTensor& t) {
    return t.shard.defined() ? static_cast<int64_t>(t.shard.nbytes()) : 0;
  };
  if (!nf4) return held(dense);
  return nf4->bytes() + held(packed) + held(scales);  // (nf4 without its two big tensors: the tables)
}

int64_t ShardedWeight::whole_bytes() const {
  const auto whole = [](const ShardedTensor& t) { return t.numel * static_cast<int64_t>(t.shard.element_size()); };
  if (!nf4) return whole(dense);
  return nf4->bytes() + whole(packed) + whole(scales);
}

at::Tensor sharded_linear(const at::Tensor& x, const ShardedWeight& w, const at::Tensor& bias) {
  return remade_weight_linear(x, bias, w.shape[0], [w] { return w.whole(); });
}

}  // namespace lorarun::model
