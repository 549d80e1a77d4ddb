#include "model/dora.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "model/recompute.hpp"
#include "model/transformer.hpp"

namespace lorarun::model {
namespace {

constexpr int64_t kRows = 2048;  // rows of W cast to float32 at a time

// W [out, in] whole: NF4 or GGUF blocks dequantised (as bitsandbytes' dequantize does for PEFT), a sharded one
// gathered (in forward its block is whole already: no collective of its own).
at::Tensor base_weight(const Linear& l) { return l.sharded ? l.sharded->whole() : l.dense_weight(); }

// A memory estimate's layer: shapes only, nothing to gather or compute.
bool shapes_only(const Linear& l) {
  if (l.sharded) return (l.sharded->nf4 ? l.sharded->packed.shard : l.sharded->dense.shard).is_meta();
  return l.nf4 ? l.nf4->packed.is_meta() : l.blocks ? l.blocks->raw.is_meta() : l.weight.is_meta();
}

// f(first row i, rows i.. of W as float32 [c, in]) for consecutive row ranges, concatenated along dim 0.
template <class F>
at::Tensor by_rows(const at::Tensor& w, F f) {
  std::vector<at::Tensor> parts;
  for (int64_t i = 0; i < w.size(0); i += kRows)
    parts.push_back(f(i, w.narrow(0, i, std::min(kRows, w.size(0) - i)).to(at::kFloat)));
  return parts.size() == 1 ? parts[0] : at::cat(parts);
}

}  // namespace

void prepare_dora(Linear& l) { prepare_dora(l, l.lora_a); }

void prepare_dora(Linear& l, const at::Tensor& like) {
  c10::NoGradGuard no_grad;
  if (shapes_only(l)) {
    l.base_sq = at::empty({l.out_features()}, like.options().dtype(at::kFloat));
    return;
  }
  l.base_sq = by_rows(base_weight(l), [](int64_t, const at::Tensor& w) { return w.square().sum(1); });
}

at::Tensor initial_magnitude(const Linear& l, const at::Tensor& a_, const at::Tensor& b_, double scaling) {
  c10::NoGradGuard no_grad;
  if (shapes_only(l)) return at::empty({l.out_features()}, a_.options()).set_requires_grad(true);
  // PEFT: ||W + s·BA||_row from the weight whole, as it starts (B = 0 unless init says otherwise).
  const at::Tensor a = a_.to(at::kFloat), b = b_.to(at::kFloat);
  const at::Tensor m = by_rows(base_weight(l), [&](int64_t i, const at::Tensor& w) {
    return at::linalg_vector_norm(w + scaling * b.narrow(0, i, w.size(0)).mm(a), 2, 1);
  });
  return m.to(a_.scalar_type()).set_requires_grad(true);
}

void attach_dora(Linear& l) {
  prepare_dora(l);
  l.magnitude = initial_magnitude(l, l.lora_a, l.lora_b, l.scaling);
}

at::Tensor dora_norms(const Linear& l, const DoraAdapter& d) {
  c10::NoGradGuard no_grad;
  const at::Tensor a = d.a.to(at::kFloat), b = d.b.to(at::kFloat);
  const double s = d.scaling;
  const at::Tensor wa = by_rows(base_weight(l), [&](int64_t, const at::Tensor& w) { return w.mm(a.t()); });  // [out, r]
  const at::Tensor n2 = l.base_sq + (2 * s) * (b * wa).sum(1) + (s * s) * (b.mm(a.mm(a.t())) * b).sum(1);
  return n2.clamp_min(0).sqrt().to(d.a.scalar_type());
}

at::Tensor dora_forward(const Linear& l, const at::Tensor& x, const at::Tensor& y, bool training) {
  // As PEFT: without dropout the base output is reused (less its bias), with it the base runs again
  // on the dropped-out input.
  const bool drop = training && l.dropout > 0;
  return dora_forward(l, {l.lora_a, l.lora_b, l.magnitude, l.scaling}, drop ? at::dropout(x, l.dropout, true) : x, drop,
                      y);
}

at::Tensor dora_forward(const Linear& l, const DoraAdapter& d, const at::Tensor& x, bool dropped, const at::Tensor& y) {
  // As PEFT: x in the adapters' dtype.
  const at::Tensor xd = x.scalar_type() != d.a.scalar_type() ? x.to(d.a.scalar_type()) : x;
  const at::Tensor scale = d.magnitude / dora_norms(l, d);  // [out]; the gradient reaches m only
  const at::Tensor lora = at::linear(at::linear(xd, d.a), d.b);
  // (a sharded W is gathered again for backward, not kept: its block's buffers move on)
  const auto dtype = xd.scalar_type();
  const at::Tensor base =
      !dropped    ? (l.bias.defined() ? y - l.bias : y)
      : l.sharded ? remade_weight_linear(xd, {}, l.out_features(), [&l, dtype] { return base_weight(l).to(dtype); })
                  : at::linear(xd, base_weight(l).to(dtype));
  return (y + ((scale - 1) * base + scale * lora * d.scaling)).to(y.scalar_type());
}

at::Tensor dora_merged_weight(const Linear& l) {
  c10::NoGradGuard no_grad;
  const at::Tensor w = base_weight(l);
  const at::Tensor merged = w.to(at::kFloat) + at::matmul(l.lora_b.to(at::kFloat), l.lora_a.to(at::kFloat)) * l.scaling;
  const at::Tensor factor = l.magnitude.to(at::kFloat) / at::linalg_vector_norm(merged, 2, 1);
  return (factor.view({-1, 1}) * merged).to(w.scalar_type());
}

}  // namespace lorarun::model
