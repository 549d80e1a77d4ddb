#include "model/loss.hpp"

#include <ATen/ATen.h>

namespace lorarun::model {
namespace {

// Per-token losses [B, T-1] (0 where ignored) and the trained-token mask.
std::pair<at::Tensor, at::Tensor> token_losses(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t T = logits.size(1);
  const at::Tensor shifted = logits.narrow(1, 0, T - 1).to(at::kFloat);
  const at::Tensor target = labels.to(logits.device(), at::kLong).narrow(1, 1, T - 1);
  const at::Tensor loss = at::cross_entropy_loss(shifted.reshape({-1, shifted.size(-1)}), target.reshape(-1),
                                                 {}, at::Reduction::None, -100);
  return {loss.view(target.sizes()), target != -100};
}

}  // namespace

LossSum causal_lm_loss(const at::Tensor& logits, const at::Tensor& labels) {
  auto [loss, trained] = token_losses(logits, labels);
  return {loss.sum(), trained.sum()};
}

at::Tensor per_sequence_loss(const at::Tensor& logits, const at::Tensor& labels) {
  auto [loss, trained] = token_losses(logits, labels);
  return loss.sum(1) / trained.sum(1).clamp_min(1).to(at::kFloat);
}

}  // namespace lorarun::model
