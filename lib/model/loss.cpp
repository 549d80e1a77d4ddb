#include "model/loss.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "data/example.hpp"
#include "model/cpu_kernels.hpp"
#include "model/fused_ops.hpp"

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

// d loss / d z of one chunk's logits z [n, V] given their log_softmax (overwritten): softmax - one-hot,
// through the soft cap's derivative when there is one.
at::Tensor logit_grad(at::Tensor& logp, const at::Tensor& t, const at::Tensor& capped, double softcap) {
  logp.exp_().scatter_add_(1, t, at::full_like(t, -1.0, at::kFloat));  // softmax - one-hot
  if (softcap > 0) logp.mul_(1 - capped.to(at::kFloat).square());      // d(cap tanh(z/cap))/dz
  return logp;
}

// One chunk's float32 logits z [n, V] -> its rows' losses [n], z overwritten by d loss / d z, in one
// pass over each row (the CPU's fused loop) instead of log_softmax, gather, exp and scatter.
at::Tensor fused_cross_entropy(at::Tensor& z, const at::Tensor& t) {
  RECORD_FUNCTION("lorarun::softmax_cross_entropy", {});
  const int64_t n = z.size(0), V = z.size(1);
  at::Tensor losses = at::empty({n}, z.options());
  const at::Tensor targets = t.contiguous();
  const int64_t* tp = targets.const_data_ptr<int64_t>();
  // The loop writes at z[row, target]: an id outside the vocabulary must not reach it (gather, on
  // ATen's path, refuses one too). One pass over n ids, next to n x V logits.
  if (std::any_of(tp, tp + n, [V](int64_t id) { return id < 0 || id >= V; }))
    throw std::runtime_error("a target token id is outside the model's vocabulary of " + std::to_string(V) +
                             " (does the tokenizer belong to this model?)");
  float *zp = z.mutable_data_ptr<float>(), *lp = losses.mutable_data_ptr<float>();
  at::parallel_for(0, n, 1, [&](int64_t b, int64_t e) {
    cpu::kernels().softmax_cross_entropy(zp + b * V, tp + b, lp + b, e - b, V);
  });
  return losses;
}

// Fused output projection + cross-entropy over rows of hidden states, chunked over rows.
// forward: h [N, H], W [V, H], targets [N] -> sum of -log softmax(z)[target] (float32), where
// z = h W^T, or cap * tanh(h W^T / cap) with a soft cap (softcap > 0), divided by a temperature T
// when it is not 1. Gradients: h's always (when
// it needs one), computed here; W's when it is trained (modules_to_save, trainable tokens of a tied
// head): float32 [V, H] summed here, or for per-row losses recomputed in backward, where each row's
// weight is known.
struct LinearCrossEntropy : torch::autograd::Function<LinearCrossEntropy> {
  // Each chunk's row losses [n] and (when `grads`) d loss / d logits [n, V] float32, handed to
  // `each(s, n, losses, dz)`.
  template <class F>
  static void chunks(const at::Tensor& h, const at::Tensor& w, const at::Tensor& targets, int64_t chunk_rows,
                     double softcap, double temperature, bool grads, F&& each) {
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
      at::Tensor zf = z.to(at::kFloat);
      if (temperature != 1.0) zf = zf / temperature;
      if (softcap == 0 && zf.device().is_cpu() && fused::enabled() && zf.is_contiguous()) {
        const at::Tensor losses = fused_cross_entropy(zf, t);
        if (temperature != 1.0) zf.div_(temperature);
        each(s, n, losses, zf);
        continue;
      }
      at::Tensor logp = at::log_softmax(zf, 1);
      const at::Tensor losses = logp.gather(1, t).squeeze(1).neg();
      at::Tensor dz = grads ? logit_grad(logp, t, capped, softcap) : at::Tensor();
      if (dz.defined() && temperature != 1.0) dz.div_(temperature);
      each(s, n, losses, dz);
    }
  }

  // per_row: the [N] losses of the rows instead of their sum (each row's gradient is its own).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& h, const at::Tensor& w,
                            const at::Tensor& targets, int64_t chunk_rows, bool need_grad, double softcap,
                            double temperature, bool per_row) {
    at::Tensor loss =
        per_row ? at::empty({h.size(0)}, h.options().dtype(at::kFloat)) : at::zeros({}, h.options().dtype(at::kFloat));
    at::Tensor grad = need_grad ? at::empty_like(h) : at::Tensor();
    const bool need_w = w.requires_grad();
    at::Tensor grad_w = need_w && !per_row ? at::zeros(w.sizes(), w.options().dtype(at::kFloat)) : at::Tensor();
    chunks(h, w, targets, chunk_rows, softcap, temperature, need_grad || grad_w.defined(),
           [&](int64_t s, int64_t n, const at::Tensor& losses, const at::Tensor& dz) {
             if (per_row)
               loss.narrow(0, s, n).copy_(losses);
             else
               loss += losses.sum();
             if (!need_grad && !grad_w.defined()) return;
             if (need_grad) {
               at::Tensor rows = grad.narrow(0, s, n);
               at::mm_out(rows, dz.to(w.scalar_type()), w);
             }
             if (grad_w.defined()) grad_w.addmm_(dz.t(), h.narrow(0, s, n).to(at::kFloat));
           });
    ctx->save_for_backward({grad, grad_w});
    if (need_w && per_row) ctx->saved_data["inputs"] = std::vector<at::Tensor>{h.detach(), w.detach(), targets};
    ctx->saved_data["per_row"] = per_row;
    ctx->saved_data["chunk_rows"] = chunk_rows;
    ctx->saved_data["softcap"] = softcap;
    ctx->saved_data["temperature"] = temperature;
    ctx->saved_data["w_dtype"] = static_cast<int64_t>(w.scalar_type());
    return loss;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& grad = saved[0];
    const bool per_row = ctx->saved_data["per_row"].toBool();
    at::Tensor gh, gw;
    if (grad.defined()) {
      const at::Tensor g = grad_out[0].to(grad.scalar_type());
      gh = per_row ? grad * g.unsqueeze(1) : grad * g;
    }
    if (saved[1].defined()) gw = saved[1] * grad_out[0].to(at::kFloat);
    if (ctx->saved_data.count("inputs")) {  // per-row losses: W's gradient weighs each row by its own
      const auto in = ctx->saved_data["inputs"].toTensorVector();
      const at::Tensor g = grad_out[0].to(at::kFloat);
      gw = at::zeros(in[1].sizes(), in[1].options().dtype(at::kFloat));
      chunks(in[0], in[1], in[2], ctx->saved_data["chunk_rows"].toInt(), ctx->saved_data["softcap"].toDouble(),
             ctx->saved_data["temperature"].toDouble(), true,
             [&](int64_t s, int64_t n, const at::Tensor&, const at::Tensor& dz) {
               gw.addmm_((dz * g.narrow(0, s, n).unsqueeze(1)).t(), in[0].narrow(0, s, n).to(at::kFloat));
             });
    }
    if (gw.defined()) gw = gw.to(static_cast<at::ScalarType>(ctx->saved_data["w_dtype"].toInt()));
    return {gh, gw, at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
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
      LinearCrossEntropy::apply(h, lm_head, targets, chunk_rows, h.requires_grad(), softcap.value_or(0.0), 1.0, false);
  return {sum, at::scalar_tensor(rows.size(0), at::kLong)};
}

at::Tensor lm_head_token_losses(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& rows,
                                const at::Tensor& targets, std::optional<double> softcap, double temperature,
                                int64_t chunk_bytes) {
  const int64_t chunk_rows = loss_chunk_rows(lm_head.size(0), softcap.has_value(), chunk_bytes);
  const at::Tensor h = hidden.reshape({-1, hidden.size(-1)}).index_select(0, rows);  // [N, H]
  return LinearCrossEntropy::apply(h, lm_head, targets, chunk_rows, h.requires_grad(), softcap.value_or(0.0),
                                   temperature, true);
}

at::Tensor lm_head_token_figures(const at::Tensor& hidden, const at::Tensor& lm_head, const at::Tensor& rows,
                                 const at::Tensor& targets, std::optional<double> softcap, int64_t chunk_bytes) {
  c10::NoGradGuard no_grad;
  const int64_t chunk_rows = loss_chunk_rows(lm_head.size(0), softcap.has_value(), chunk_bytes);
  const at::Tensor h = hidden.detach().reshape({-1, hidden.size(-1)}).index_select(0, rows);  // [N, H]
  at::Tensor out = at::empty({h.size(0), 3}, h.options().dtype(at::kFloat));
  for (int64_t s = 0; s < h.size(0); s += chunk_rows) {
    const int64_t n = std::min(chunk_rows, h.size(0) - s);
    at::Tensor z = at::linear(h.narrow(0, s, n), lm_head.detach());
    if (softcap) z = at::tanh(z / *softcap) * *softcap;
    z = z.to(at::kFloat);
    const at::Tensor logp = at::log_softmax(z, 1);
    at::Tensor part = out.narrow(0, s, n);
    part.select(1, 0).copy_((logp.exp() * logp).sum(1).neg());
    part.select(1, 1).copy_(z.mean(1));
    part.select(1, 2).copy_(z.argmax(1).eq(targets.narrow(0, s, n)));
  }
  return out;
}

}  // namespace lorarun::model
