// GRPO's maths, as TRL 1.16's GRPOTrainer computes it: group advantages from rewards, and the
// clipped policy loss on completion tokens (loss types grpo, dr_grpo, dapo, bnpo; token or
// sequence (GSPO) importance ratios; beta times the k3 estimate of KL to the reference, weighted by
// the importance ratio as TRL's use_bias_correction_kl does).
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <optional>
#include <string>

namespace lorarun::train {

enum class GrpoLossType { Grpo, DrGrpo, Dapo, Bnpo };
enum class ScaleRewards { Group, Batch, None };

// "grpo" -> Grpo, …; nullopt for a name it does not know.
std::optional<GrpoLossType> grpo_loss_type(const std::string& name);
std::optional<ScaleRewards> scale_rewards(const std::string& name);

struct Advantages {
  at::Tensor advantages;  // [N] float32
  at::Tensor std_zero;    // [N] bool: the std they were scaled by is 0 (TRL's frac_reward_zero_std)
};

// rewards [N] (the step's whole batch, a group's `generations` completions next to each other; NaN:
// unscorable, excluded from its group's mean and advantaged 0) -> their advantages: reward minus its
// group's mean, divided by (std + 1e-4) of its group (Group), of the batch (Batch), or not (None).
Advantages group_advantages(const at::Tensor& rewards, int64_t generations, ScaleRewards scale);

struct GrpoLossConfig {
  GrpoLossType type = GrpoLossType::Dapo;
  bool sequence_level = false;     // importance ratio per sequence (GSPO), not per token
  double beta = 0.0;               // KL weight; 0: no reference
  bool kl_bias_correction = true;  // the KL term times the importance ratio (TRL's use_bias_correction_kl)
  double epsilon_low = 0.2, epsilon_high = 0.2;
  int64_t max_completion_length = 512;  // dr_grpo's constant length
};

// What the step's normalisation divides by, counted over every rank and micro-batch of the step:
// its completions and their trained tokens.
struct GrpoStepCounts {
  double completions = 0, tokens = 0;
};

// Sums over this micro-batch for the step's figures, which the caller all-reduces: kl is kKl / kTokens;
// the clipped fractions are over tokens (kTokens), at the sequence level over completions (kCompletions).
enum GrpoFigure : int64_t { kKl, kClipLow, kClipHigh, kClipRegion, kTokens, kCompletions, kFigures };

struct GrpoLoss {
  at::Tensor loss;     // scalar: this micro-batch's share of the step's loss (the shares add up to it)
  at::Tensor figures;  // [kFigures] float64, no gradient: the sums above
  at::Tensor clipped;  // [B, 2] float64: each completion's fraction of low- and high-clipped tokens
};

// logps, old_logps, ref_logps, mask [B, T] over the completion tokens (old_logps undefined: logps
// detached, one iteration; ref_logps undefined when beta is 0); advantages [B].
GrpoLoss grpo_loss(const at::Tensor& logps, const at::Tensor& old_logps, const at::Tensor& ref_logps,
                   const at::Tensor& mask, const at::Tensor& advantages, const GrpoLossConfig& cfg,
                   const GrpoStepCounts& step);

}  // namespace lorarun::train
