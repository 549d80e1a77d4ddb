// All-gather of sharded tensors (lib/model/sharded.hpp) across the ranks lorarun starts, Gloo on
// the CPU or NCCL on GPUs:
//   lorarun --nproc-per-node W -- build/bin/gather_bench --check
//       every rank rebuilds tensors of awkward sizes (1, 7, a prime, multiples of W) in float32,
//       bf16 and uint8 from the W slices, bit for bit, one gather at a time and with two in
//       flight at once; one JSON line per rank.
//   lorarun --nproc-per-node W -- build/bin/gather_bench [--mb 64] [--reps 10] [--cuda]
//       the time to gather a bf16 tensor of that many MB (whole) from its W slices; one JSON line
//       per rank (mean and best seconds, GB/s of whole tensor rebuilt).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "dist/env.hpp"
#include "dist/process_group.hpp"
#include "model/sharded.hpp"

using namespace lorarun;
using Clock = std::chrono::steady_clock;

namespace {

// The same values on every rank, of every dtype.
at::Tensor pattern(int64_t n, at::ScalarType dtype, const at::Device& device) {
  const at::Tensor i = at::arange(n, at::TensorOptions().dtype(at::kLong));
  at::Tensor v = dtype == at::kByte ? (i * 37 + 11).remainder(251) : (i.to(at::kDouble) * 0.618034).sin() * 3.0;
  return v.to(dtype).to(device);
}

at::Tensor gathered(dist::ProcessGroup& pg, const model::ShardedTensor& s) {
  at::Tensor out = s.gather_buffer(pg.size());
  pg.all_gather_async(out, s.shard).wait();
  return s.whole(out);
}

int check(dist::ProcessGroup& pg, const at::Device& device) {
  const int w = pg.size(), r = pg.rank();
  int cases = 0, wrong = 0;
  const std::vector<int64_t> sizes = {1, 7, 1000003, int64_t{w} * 5, 64 * 3 + 1};
  for (const at::ScalarType dtype : {at::kFloat, at::kBFloat16, at::kByte})
    for (const int64_t n : sizes) {
      const at::Tensor whole = pattern(n, dtype, device).view({n});
      const model::ShardedTensor s = model::ShardedTensor::of(whole, r, w);
      ++cases;
      if (s.per_rank() != model::ShardedTensor::slice_length(n, w) || !at::equal(gathered(pg, s), whole)) ++wrong;
    }
  // Two gathers in flight (a prefetch of the next block while the current one is used): each
  // lands in its own buffer.
  const at::Tensor a = pattern(3001 * 7, at::kFloat, device).view({3001, 7});
  const at::Tensor b = pattern(999, at::kBFloat16, device);
  const model::ShardedTensor sa = model::ShardedTensor::of(a, r, w), sb = model::ShardedTensor::of(b, r, w);
  at::Tensor oa = sa.gather_buffer(w), ob = sb.gather_buffer(w);
  dist::ProcessGroup::Pending pa = pg.all_gather_async(oa, sa.shard);
  dist::ProcessGroup::Pending pb = pg.all_gather_async(ob, sb.shard);
  pb.wait();
  pa.wait();
  cases += 2;
  wrong += !at::equal(sa.whole(oa), a) + !at::equal(sb.whole(ob), b);
  fmt::print("{{\"rank\": {}, \"world\": {}, \"cases\": {}, \"wrong\": {}}}\n", r, w, cases, wrong);
  std::fflush(stdout);
  return wrong == 0 ? 0 : 1;
}

int bench(dist::ProcessGroup& pg, const at::Device& device, double mb, int reps) {
  const auto n = static_cast<int64_t>(mb * 1e6 / 2);
  const model::ShardedTensor s = model::ShardedTensor::of(pattern(n, at::kBFloat16, device), pg.rank(), pg.size());
  at::Tensor out = s.gather_buffer(pg.size());
  pg.all_gather_async(out, s.shard).wait();  // warm-up
  double total = 0, best = 1e30;
  for (int i = 0; i < reps; ++i) {
    pg.barrier();
    const auto t0 = Clock::now();
    pg.all_gather_async(out, s.shard).wait();
    if (device.is_cuda()) out.cpu();  // (a sync)
    const double t = std::chrono::duration<double>(Clock::now() - t0).count();
    total += t;
    best = std::min(best, t);
  }
  fmt::print(
      "{{\"rank\": {}, \"world\": {}, \"mb\": {}, \"reps\": {}, \"mean_s\": {:.6f}, \"best_s\": {:.6f}, "
      "\"gb_per_s\": {:.3f}}}\n",
      pg.rank(), pg.size(), mb, reps, total / reps, best, mb / 1e3 / (total / reps));
  std::fflush(stdout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  bool do_check = false, cuda = false;
  double mb = 64;
  int reps = 10;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--check")
      do_check = true;
    else if (a == "--cuda")
      cuda = true;
    else if (a == "--mb" && i + 1 < argc)
      mb = std::stod(argv[++i]);
    else if (a == "--reps" && i + 1 < argc)
      reps = std::stoi(argv[++i]);
    else {
      fmt::print(stderr, "usage: gather_bench [--check] [--mb MB] [--reps N] [--cuda] (under lorarun -- …)\n");
      return 2;
    }
  }
  try {
    const dist::DistEnv env = dist::DistEnv::from_environment();
    const at::Device device = cuda ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank)) : at::kCPU;
    dist::ProcessGroup pg(env, cuda ? dist::Backend::Nccl : dist::Backend::Gloo, std::chrono::seconds(120));
    return do_check ? check(pg, device) : bench(pg, device, mb, reps);
  } catch (const std::exception& e) {
    fmt::print(stderr, "gather_bench: {}\n", e.what());
    return 1;
  }
}
