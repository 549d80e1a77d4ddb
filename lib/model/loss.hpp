// The causal-LM loss, kept as a sum over trained tokens so callers can normalise globally.
#pragma once
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <optional>

namespace lorarun::model {

struct LossSum {
  at::Tensor sum;    // float32 scalar: sum of per-token cross-entropy over trained tokens
  at::Tensor count;  // int64 scalar: number of trained tokens (labels != data::kIgnoreIndex)
};

// logits [B, T, V] predict labels [B, T] shifted by one (position t predicts labels[t+1]), as
// transformers' ForCausalLMLoss; data::kIgnoreIndex (-100) marks tokens that are not trained.
LossSum causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels);

// The same loss straight from the final hidden states, without logits for the whole batch:
// only the N positions that predict a trained token (`rows`, flat indices into hidden viewed as
// [B*T, H], each predicting `targets`[i]) go through the output projection, in chunks whose
// float32 logits and their log-softmax together stay under `chunk_bytes`. The gradient for those rows is computed chunk
// by chunk during the forward (softmax - one-hot) @ W and kept [N, H]; the output projection is frozen.
// softcap: the logits are cap * tanh(logits / cap) first (gemma2's final_logit_softcapping).
inline constexpr int64_t kLossChunkBytes = int64_t{256} << 20;
// The rows of one chunk for a vocabulary of `vocab`.
inline int64_t loss_chunk_rows(int64_t vocab, bool softcap, int64_t chunk_bytes = kLossChunkBytes) {
  return std::max<int64_t>(1, chunk_bytes / (vocab * 4 * (softcap ? 3 : 2)));
}
LossSum lm_head_loss(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& rows,
                     const at::Tensor& targets, std::optional<double> softcap = std::nullopt,
                     int64_t chunk_bytes = kLossChunkBytes);

// The same computation, each row's loss kept: [N] float32, -log p(targets[i]) (with gradient
// for `hidden`'s rows); what a preference loss sums per sequence. `temperature` divides the
// (capped) logits first, as TRL's GRPOTrainer divides the model's.
at::Tensor lm_head_token_losses(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& rows,
                                const at::Tensor& targets, std::optional<double> softcap = std::nullopt,
                                double temperature = 1.0, int64_t chunk_bytes = kLossChunkBytes);

// What TRL logs of the same rows' next-token distributions, without gradient: [N, 3] float32 of
// each row's entropy, the mean of its logits over the vocabulary (softcapped as the model caps
// them), and 1 where its target is the most likely token (0 else).
at::Tensor lm_head_token_figures(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& rows,
                                 const at::Tensor& targets, std::optional<double> softcap = std::nullopt,
                                 int64_t chunk_bytes = kLossChunkBytes);

// Per-sequence mean loss [B] (float32), for evaluation.
at::Tensor per_sequence_loss(const at::Tensor& logits, const at::Tensor& labels);

}  // namespace lorarun::model
