#include "model/tenants.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <mutex>

#include "model/dora.hpp"
#include "model/transformer.hpp"

namespace lorarun::model {
namespace {

// Puts `state` into `gen` and returns what it held.
at::Tensor swap_state(at::Generator& gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::Tensor before = gen.get_state();
  gen.set_state(state);
  return before;
}

at::Generator default_generator(at::Device device) {
  return device.is_cuda() ? at::globalContext().defaultGenerator(device) : at::detail::getDefaultCPUGenerator();
}

}  // namespace

DropoutStreams::DropoutStreams(size_t adapters, uint64_t seed, at::Device device) : device_(device) {
  const at::Tensor cpu = at::make_generator<at::CPUGeneratorImpl>(seed).get_state();
  at::Tensor cuda;
  if (device.is_cuda()) {  // what manual_seed leaves in the device's generator: the seed, offset 0
    at::Generator gen = default_generator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    const at::Tensor before = gen.get_state();
    gen.set_current_seed(seed);
    cuda = gen.get_state();
    gen.set_state(before);
  }
  for (size_t i = 0; i < adapters; ++i) {
    cpu_.push_back(cpu.clone());
    if (cuda.defined()) cuda_.push_back(cuda.clone());
  }
}

// The adapter's state swapped into the default generator for the draw, so the mask is the one
// at::dropout draws in the adapter's own run (whatever kernel the device uses), and swapped out.
at::Tensor DropoutStreams::dropout(int slot, const at::Tensor& x, double p) {
  at::Generator gen = default_generator(x.device());
  at::Tensor& mine = x.is_cuda() ? cuda_.at(static_cast<size_t>(slot)) : cpu_.at(static_cast<size_t>(slot));
  const at::Tensor before = swap_state(gen, mine);
  at::Tensor out = at::dropout(x, p, true);
  mine = swap_state(gen, before);
  return out;
}

at::Tensor DropoutStreams::state(int slot) const {
  const auto s = static_cast<size_t>(slot);
  return cuda_.empty() ? cpu_.at(s).clone() : at::cat({cpu_.at(s), cuda_.at(s)});
}

void DropoutStreams::set_state(int slot, const at::Tensor& bytes) {
  const auto s = static_cast<size_t>(slot);
  const int64_t n = cpu_.at(s).numel();
  cpu_.at(s) = bytes.narrow(0, 0, n).clone();
  if (!cuda_.empty()) cuda_.at(s) = bytes.narrow(0, n, bytes.numel() - n).clone();
}

at::Tensor add_lora(at::Tensor y, const at::Tensor& xd, const at::Tensor& a, const at::Tensor& b, double scaling) {
  const at::Tensor x = xd.scalar_type() == a.scalar_type() ? xd : xd.to(a.scalar_type());
  const at::Tensor xa = at::linear(x, a);  // [.., r]
  const int64_t out = b.size(0);
  if (y.scalar_type() == b.scalar_type()) {
    // One GEMM adding into y: in place when y is rows [N, out] of its own (in place into a view,
    // autograd would copy and zero a whole [N, out] gradient in backward), else into a new tensor.
    if (y.dim() == 2 && !y.is_view()) return y.addmm_(xa, b.t(), 1.0, scaling);
    return at::addmm(y.view({-1, out}), xa.reshape({-1, xa.size(-1)}), b.t(), 1.0, scaling).view(y.sizes());
  }
  return (y + at::linear(xa * scaling, b)).to(y.scalar_type());
}

// Each route's rows and positions [rows, length, ..] are shaped as that adapter's own micro-batch:
// its dropout mask and its GEMMs are those of its own run. As in Linear::forward, the base and the
// adapters read x as rows [N, in] (one view of it), so that x's gradient is summed in the order of
// the adapter's own run.
at::Tensor add_tenants(const Linear& l, const at::Tensor& x, bool training, const Routes& routes) {
  const bool dropped = training && l.dropout > 0 && routes.streams;
  const auto drop = [&](int slot, const at::Tensor& in) {
    return dropped ? routes.streams->dropout(slot, in, l.dropout) : in;
  };
  // Adapter `slot`'s path added to base outputs y of its inputs `in` [.., in].
  const auto adapt = [&](int slot, const TenantLora& t, const at::Tensor& y, const at::Tensor& in) {
    if (t.magnitude.defined()) return dora_forward(l, {t.a, t.b, t.magnitude, t.scaling}, drop(slot, in), dropped, y);
    return add_lora(y, drop(slot, in), t.a, t.b, t.scaling);
  };
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = l.out_features();
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  // One adapter for the whole batch (an evaluation, or a pass of one adapter's micro-batch): its own
  // run's layer, with no views to copy back.
  const bool whole =
      routes.routes.size() == 1 && routes.routes[0].rows == x.size(0) && routes.routes[0].length == x.size(1);
  if (const int only = routes.all >= 0 ? routes.all : whole ? routes.routes[0].slot : -1; only >= 0) {
    const TenantLora& t = l.tenants.at(static_cast<size_t>(only));
    if (!t.a.defined()) return l.base(rows).view(shape);
    return adapt(only, t, l.base(rows), rows).view(shape);
  }
  // The routes' rows one after another, split (not narrowed: a split's backward is one cat, where
  // each narrow's would be a zeroed tensor of the whole batch) and the outputs put back with one cat.
  std::vector<int64_t> sizes;
  for (const Route& r : routes.routes) sizes.push_back(r.rows);
  const std::vector<at::Tensor> ys = l.base(rows).view(shape).split_with_sizes(sizes);
  const std::vector<at::Tensor> xs = rows.view(x.sizes()).split_with_sizes(sizes);
  const int64_t T = x.size(1);
  std::vector<at::Tensor> out;
  for (size_t k = 0; k < sizes.size(); ++k) {
    const Route& r = routes.routes[k];
    const TenantLora& t = l.tenants.at(static_cast<size_t>(r.slot));
    if (!t.a.defined()) {
      out.push_back(ys[k]);
    } else if (r.length == T) {
      out.push_back(adapt(r.slot, t, ys[k], xs[k]));
    } else {  // its own positions, then the padding past them as the base left it
      const std::vector<at::Tensor> y2 = ys[k].split_with_sizes({r.length, T - r.length}, 1);
      const at::Tensor x2 = xs[k].narrow(1, 0, r.length);
      out.push_back(at::cat({adapt(r.slot, t, y2[0].contiguous(), x2), y2[1]}, 1));
    }
  }
  return at::cat(out);
}

}  // namespace lorarun::model
