#include "train/grpo.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <limits>

#include "util/error.hpp"

namespace lorarun::train {

std::optional<GrpoLossType> grpo_loss_type(const std::string& name) {
  if (name == "grpo") return GrpoLossType::Grpo;
  if (name == "dr_grpo") return GrpoLossType::DrGrpo;
  if (name == "dapo") return GrpoLossType::Dapo;
  if (name == "bnpo") return GrpoLossType::Bnpo;
  return std::nullopt;
}

std::optional<ScaleRewards> scale_rewards(const std::string& name) {
  if (name == "group") return ScaleRewards::Group;
  if (name == "batch") return ScaleRewards::Batch;
  if (name == "none") return ScaleRewards::None;
  return std::nullopt;
}

namespace {

// TRL's nanstd: Bessel-corrected, NaN where fewer than two values are not NaN.
at::Tensor nanstd(const at::Tensor& x, std::optional<int64_t> dim) {
  const auto over = [&](const at::Tensor& t) {
    return dim ? at::nanmean(t, *dim, /*keepdim=*/true) : at::nanmean(t).reshape({1});
  };
  const at::Tensor mean = over(x);
  at::Tensor variance = over((x - mean).pow(2));
  const at::Tensor count = dim ? x.isnan().logical_not().sum(*dim, true) : x.isnan().logical_not().sum().reshape({1});
  const at::Tensor correction =
      at::where(count > 1, count / (count - 1), at::full_like(variance, std::numeric_limits<double>::quiet_NaN()));
  return at::sqrt(variance * correction);
}

}  // namespace

Advantages group_advantages(const at::Tensor& rewards, int64_t generations, ScaleRewards scale) {
  if (generations < 1 || rewards.numel() % generations != 0)
    throw Error(fmt::format("GRPO: {} rewards are not whole groups of {}", rewards.numel(), generations));
  const at::Tensor groups = rewards.view({-1, generations});
  const at::Tensor mean = at::nanmean(groups, 1, true).expand_as(groups).reshape({-1});
  at::Tensor std;
  if (scale == ScaleRewards::Batch)
    std = rewards.numel() > 1 ? nanstd(rewards, std::nullopt).expand_as(rewards) : at::zeros_like(rewards);
  else
    std = generations > 1 ? nanstd(groups, 1).expand_as(groups).reshape({-1}) : at::zeros_like(rewards);
  at::Tensor advantages = rewards - mean;
  if (scale != ScaleRewards::None) advantages = advantages / (std + 1e-4);
  return {at::nan_to_num(advantages, 0.0), at::isclose(std, at::zeros_like(std))};
}

GrpoLoss grpo_loss(const at::Tensor& logps, const at::Tensor& old_logps, const at::Tensor& ref_logps,
                   const at::Tensor& mask_in, const at::Tensor& advantages, const GrpoLossConfig& cfg,
                   const GrpoStepCounts& step) {
  const at::Tensor mask = mask_in.to(logps.scalar_type());
  const at::Tensor tokens = mask.sum(-1);  // [B]
  const at::Tensor adv = advantages.to(logps.scalar_type()).unsqueeze(1);
  const at::Tensor log_ratio = logps - (old_logps.defined() ? old_logps : logps.detach());
  // [B, T] per token, or [B, 1]: the completion's mean log-ratio (GSPO)
  const at::Tensor log_weights =
      cfg.sequence_level ? ((log_ratio * mask).sum(-1) / tokens.clamp_min(1.0)).unsqueeze(-1) : log_ratio;
  const at::Tensor coef_1 = at::exp(log_weights);
  const at::Tensor coef_2 = at::clamp(coef_1, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high);
  at::Tensor per_token = -at::min(coef_1 * adv, coef_2 * adv);
  at::Tensor kl;
  if (cfg.beta != 0.0) {
    if (!ref_logps.defined()) throw Error("GRPO: beta is not 0 but there are no reference log-probs");
    const at::Tensor d = ref_logps - logps;
    kl = at::exp(d) - d - 1;                       // k3: an unbiased, positive estimate of KL(policy || reference)
    if (cfg.kl_bias_correction) kl = kl * coef_1;  // its gradient then the reverse KL's, off-policy too
    per_token = per_token + cfg.beta * kl;
  }
  const at::Tensor masked = per_token * mask;  // [B, T] (broadcast from [B, 1])
  at::Tensor loss;
  switch (cfg.type) {
    case GrpoLossType::Grpo:  // each completion's mean over its tokens, averaged over the step's completions
      loss = (masked.sum(-1) / tokens.clamp_min(1.0)).sum() / std::max(step.completions, 1.0);
      break;
    case GrpoLossType::DrGrpo:  // over completions of the constant length
      loss = masked.sum() / (std::max(step.completions, 1.0) * static_cast<double>(cfg.max_completion_length));
      break;
    case GrpoLossType::Dapo:  // over the step's tokens (TRL's bnpo divides by each micro-batch's: the same
    case GrpoLossType::Bnpo:  // on one rank without accumulation, and this does not depend on the split)
      loss = masked.sum() / std::max(step.tokens, 1.0);
      break;
  }
  const c10::NoGradGuard no_grad;
  const at::Tensor low = (coef_1 < 1 - cfg.epsilon_low).logical_and(adv < 0).to(at::kDouble);
  const at::Tensor high = (coef_1 > 1 + cfg.epsilon_high).logical_and(adv > 0).to(at::kDouble);
  const at::Tensor region = low.logical_or(high).to(at::kDouble);
  const at::Tensor m = mask.to(at::kDouble);
  // [B, 1] ratios count once a completion; [B, T] once a token
  const auto clip_sum = [&](const at::Tensor& x) { return cfg.sequence_level ? x.sum() : (x * m).sum(); };
  const auto per_completion = [&](const at::Tensor& x) {
    return cfg.sequence_level ? x.squeeze(1) : (x * m).sum(-1) / m.sum(-1);
  };
  at::Tensor figures = at::stack({kl.defined() ? (kl.detach().to(at::kDouble) * m).sum() : at::zeros({}, at::kDouble),
                                  clip_sum(low), clip_sum(high), clip_sum(region), m.sum(),
                                  at::scalar_tensor(static_cast<double>(logps.size(0)), at::kDouble)});
  return {loss, figures.cpu(), at::stack({per_completion(low), per_completion(high)}, 1).cpu()};
}

}  // namespace lorarun::train
