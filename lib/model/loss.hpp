// The causal-LM loss, kept as a sum over trained tokens so callers can normalise globally.
#pragma once
#include <ATen/core/Tensor.h>

namespace lorarun::model {

struct LossSum {
  at::Tensor sum;    // float32 scalar: sum of per-token cross-entropy over trained tokens
  at::Tensor count;  // int64 scalar: number of trained tokens (labels != -100)
};

// logits [B, T, V] predict labels [B, T] shifted by one (position t predicts labels[t+1]), as
// transformers' ForCausalLMLoss; -100 marks tokens that are not trained.
LossSum causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);

// Per-sequence mean loss [B] (float32), for evaluation.
at::Tensor per_sequence_loss(const at::Tensor& logits, const at::Tensor& labels);

}  // namespace lorarun::model
