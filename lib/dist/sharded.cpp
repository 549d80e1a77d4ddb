#include "dist/sharded.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "util/error.hpp"

namespace lorarun::dist {

ShardedTensor ShardedTensor::of(const at::Tensor& whole, int rank, int world) {
  if (world < 1 || rank < 0 || rank >= world)
    throw Error(fmt::format("ShardedTensor: rank {} of {} ranks (a lorarun bug)", rank, world));
  ShardedTensor s;
  s.shape = whole.sizes().vec();
  s.numel = whole.numel();
  const int64_t per = slice_length(s.numel, world);
  const int64_t begin = std::min<int64_t>(s.numel, per * rank);
  const int64_t end = std::min<int64_t>(s.numel, begin + per);
  s.shard = at::zeros({per}, whole.options());
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

}  // namespace lorarun::dist
