// DoRA, weight-decomposed LoRA, as PEFT computes it: each adapted row of W + s·BA rescaled to a
// learnt magnitude m (PEFT's lora_magnitude_vector),
//   y = W x + b + (m/n - 1) ⊙ W x + (m/n) ⊙ s·B A x,   n = ||W + s·BA||_row, detached.
#pragma once
#include <ATen/core/Tensor.h>

namespace lorarun::model {

struct Linear;

// Makes `l` (adapted) a DoRA layer: m = n at B's current value, the base rows' squared norms kept
// for every later n. A sharded W is gathered whole for it: a collective, in the same order on
// every rank (attach_lora's).
void attach_dora(Linear& l);
// The same for a magnitude read from an adapter: only the base rows' squared norms are computed.
void prepare_dora(Linear& l);

// n [out] in the adapters' dtype, without gradient. Computed as
//   n² = ||W_i||² + 2s·Σ_k B_ik (W Aᵀ)_ik + s²·(B AAᵀ Bᵀ)_ii
// with ||W_i||² kept from attach time: one r-wide product with W per call and no [out, in]
// temporary, where PEFT forms W + s·BA whole (and BA through an identity of [in, in]).
at::Tensor dora_norms(const Linear& l);

// The layer's output given its base output y = W x + b: what Linear::forward returns for DoRA.
at::Tensor dora_forward(const Linear& l, const at::Tensor& x, const at::Tensor& y, bool training);

// W's merged value (m/n') ⊙ (W + s·BA), n' its row norms, in W's dtype (PEFT's merge).
at::Tensor dora_merged_weight(const Linear& l);

}  // namespace lorarun::model
