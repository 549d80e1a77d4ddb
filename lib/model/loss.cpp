#include "model/loss.hpp"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "data/example.hpp"

namespace lorarun::model {
namespace {

// Per-token losses [B, T-1] (0 where ignored) and the trained-token mask.
std::pair<at::Tensor, at::Tensor> token_losses(const at::Tensor& logits, const at::Tensor& labels) {
  const int64_t T = logits.size(1);
  const at::Tensor shifted = logits.narrow(1, 0, T - 1).to(at::kFloat);
  const at::Tensor target = labels.to(logits.device(), at::kLong).narrow(1, 1, T - 1);
  const at::Tensor loss = at::cross_entropy_loss(shifted.reshape({-1, shifted.size(-1)}), target.reshape(-1), {},
                                                 at::Reduction::None, data::kIgnoreIndex);
  return {loss.view(target.sizes()), target != data::kIgnoreIndex};
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

namespace lorarun::model {
namespace {

// Fused output projection + cross-entropy over rows of hidden states, chunked over rows.
// forward: h [N, H], W [V, H], targets [N] -> sum of -log softmax(z)[target] (float32), where
// z = h W^T, or cap * tanh(h W^T / cap) with a soft cap (softcap > 0).
struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  // per_row: the [N] losses of the rows instead of their sum (each row's gradient is its own).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w,
                            const at::Tensor& targets, int64_t chunk_rows, bool need_grad, double softcap,
                            bool per_row) {
    at::Tensor loss =
        per_row ? at::empty({h.size(0)}, h.options().dtype(at::kFloat)) : at::zeros({}, h.options().dtype(at::kFloat));
    at::Tensor grad = need_grad ? at::empty_like(h) : at::Tensor();
    for (int64_t s = 0; s < h.size(0); s += chunk_rows) {
      const int64_t n = std::min(chunk_rows, h.size(0) - s);
      const at::Tensor t = targets.narrow(0, s, n).unsqueeze(1);
      // [n, V] logits in float32 (as HF: logits.float()), then log_softmax, as cross_entropy computes
      // it: its sum of exponentials rounds as the reference's (logsumexp's differs by ~1e-5).
      at::Tensor z = at::linear(h.narrow(0, s, n), w), capped;
      if (softcap > 0) {  // in the model's dtype, as HF caps its logits
        capped = at::tanh(z / softcap);
        z = capped * softcap;
      }
      at::Tensor logp = at::log_softmax(z.to(at::kFloat), 1);
      if (per_row)
        loss.narrow(0, s, n).copy_(logp.gather(1, t).squeeze(1).neg());
      else
        loss -= logp.gather(1, t).sum();
      if (!need_grad) continue;
      logp.exp_().scatter_add_(1, t, at::full_like(t, -1.0, at::kFloat));  // softmax - one-hot
      if (softcap > 0) logp.mul_(1 - capped.to(at::kFloat).square());      // d(cap tanh(z/cap))/dz
      at::Tensor rows = grad.narrow(0, s, n);
      at::mm_out(rows, logp.to(w.scalar_type()), w);
    }
    ctx->save_for_backward({grad});
    ctx->saved_data["per_row"] = per_row;
    return loss;
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const at::Tensor grad = ctx->get_saved_variables()[0];
    const at::Tensor g = grad_out[0].to(grad.scalar_type());
    return {ctx->saved_data["per_row"].toBool() ? grad * g.unsqueeze(1) : grad * g,
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor(),
            at::Tensor()};
  }
};

}  // namespace

LossSum lm_head_loss(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& rows,
                     const at::Tensor& targets, std::optional<double> softcap, int64_t chunk_bytes) {
  const int64_t V = lm_head.size(0);
  // [rows, V] float32 buffers at once: the logits and their log_softmax (and the capped logits).
  const int64_t chunk_rows = loss_chunk_rows(V, softcap.has_value(), chunk_bytes);
  const at::Tensor h = hidden.reshape({-1, hidden.size(-1)}).index_select(0, rows);  // [N, H]
  const at::Tensor sum =
      LinearCrossEntropy::apply(h, lm_head, targets, chunk_rows, h.requires_grad(), softcap.value_or(0.0), false);
  return {sum, at::scalar_tensor(rows.size(0), at::kLong)};
}

at::Tensor lm_head_token_losses(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& rows,
                                const at::Tensor& targets, std::optional<double> softcap, int64_t chunk_bytes) {
  const int64_t chunk_rows = loss_chunk_rows(lm_head.size(0), softcap.has_value(), chunk_bytes);
  const at::Tensor h = hidden.reshape({-1, hidden.size(-1)}).index_select(0, rows);  // [N, H]
  return LinearCrossEntropy::apply(h, lm_head, targets, chunk_rows, h.requires_grad(), softcap.value_or(0.0), true);
}

}  // namespace lorarun::model
