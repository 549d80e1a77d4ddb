// DoRA, weight-decomposed LoRA, as PEFT computes it: each adapted row of W + s·BA rescaled to a
// learnt magnitude m (PEFT's lora_magnitude_vector),
//   y = W x + b + (m/n - 1) ⊙ W x + (m/n) ⊙ s·B A x,   n = ||W + s·BA||_row, detached.
#pragma once
#include <ATen/core/Tensor.h>

namespace lorarun::model {

struct Linear;

// One adapter's DoRA tensors on a layer: the layer's own, or a job's adapter's (TenantLora).
struct DoraAdapter {
  const at::Tensor& a;          // [r, in]
  const at::Tensor& b;          // [out, r]
  const at::Tensor& magnitude;  // [out]
  double scaling;
};

// Makes `l` (adapted) a DoRA layer: m = n at B's current value, the base rows' squared norms kept
// for every later n. A sharded W is gathered whole for it: a collective, in the same order on
// every rank (attach_lora's).
void attach_dora(Linear& l);
// The same for a magnitude read from an adapter: only the base rows' squared norms are computed
// (on the device of `like`, the layer's A or a job's adapter's).
void prepare_dora(Linear& l);
void prepare_dora(Linear& l, const at::Tensor& like);
// m = ||W + s·BA||_row of A `a` and B `b` at `scaling`, as attach_dora starts it (after
// prepare_dora): a job's adapter's starting magnitude, in a's dtype, trainable.
at::Tensor initial_magnitude(const Linear& l, const at::Tensor& a, const at::Tensor& b, double scaling);

// n [out] in the adapters' dtype, without gradient. Computed as
//   n² = ||W_i||² + 2s·Σ_k B_ik (W Aᵀ)_ik + s²·(B AAᵀ Bᵀ)_ii
// with ||W_i||² kept from attach time: one r-wide product with W per call and no [out, in]
// temporary, where PEFT forms W + s·BA whole (and BA through an identity of [in, in]).
at::Tensor dora_norms(const Linear& l, const DoraAdapter& d);

// The layer's output given its base output y = W x + b: what Linear::forward returns for DoRA.
at::Tensor dora_forward(const Linear& l, const at::Tensor& x, const at::Tensor& y, bool training);
// The same for adapter `d` on x after its dropout, `xd` (`dropped`: dropout applied, so the base
// runs again on xd), as its own run's layer computes it.
at::Tensor dora_forward(const Linear& l, const DoraAdapter& d, const at::Tensor& xd, bool dropped, const at::Tensor& y);

// W's merged value (m/n') ⊙ (W + s·BA), n' its row norms, in W's dtype (PEFT's merge).
at::Tensor dora_merged_weight(const Linear& l);

}  // namespace lorarun::model
