// train.objective: dpo: TRL 1.16's DPOTrainer losses (sigmoid, ipo, hinge; RPO's NLL term) over
// pairs of a chosen and a rejected completion. The reference is the same model with its adapters
// off, or set to lora.init_from's values: no second model in memory. train.objective: orpo:
// TRL's ORPOTrainer (no reference): the chosen sequences' NLL minus beta x log sigmoid of the
// log odds ratio of the mean completion log-probs. cpo, simpo: TRL's CPOTrainer (no reference):
// DPO's losses on the policy's log-probs alone (means with ipo and simpo; simpo less its margin
// gamma), plus cpo_alpha x the chosen completions' NLL. train.objective: kto: TRL's KTOTrainer over
// single completions marked desirable or not, against the same reference as DPO's, its KL estimate
// from each prompt with another example's completion (KtoSteps).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "data/collate.hpp"
#include "data/example.hpp"
#include "recipe/recipe.hpp"
#include "train/as_reference.hpp"
#include "train/evaluation.hpp"

namespace lorarun::model {
class CausalLM;
}

namespace lorarun::train {

// P pairs as 2P rows, the chosen sequences then the rejected (TRL's concatenated batch),
// right-padded, one sequence a row. With `whole_chosen` (ORPO's NLL) every position of a chosen
// row is a target, its prompt's too.
// KTO (data.format: unpaired): P examples as P rows, and as many rows of KL pairs.
struct PairBatch {
  data::Batch rows;
  at::Tensor seq;             // int64 [N]: the row of each target
  at::Tensor completion;      // float32 [N]: 1 where the target is a completion token
  at::Tensor lengths;         // float32 [2P]: each row's completion tokens
  int64_t pairs = 0;          // pairs (kto: examples)
  int64_t chosen_tokens = 0;  // targets in the chosen rows (kto: none)
  // kto: float32 [P] 1 where the example is desirable; the rows of each example's prompt followed by
  // another's completion (its KL pair); the step's KL estimate, once the ranks agreed on it
  at::Tensor desirable;
  data::Batch kl_rows;
  double kl = 0;
  at::Tensor
      reference;  // float32 [rows]: the reference's log-probs of `rows` when known ahead; else forward() computes them
};
PairBatch collate_pairs(const std::vector<data::Example>& pairs, c10::Device device, bool whole_chosen = false);
// KTO's batch of `examples`, example i's KL pair its prompt with `mismatched[i]` after it, cut to
// `max_length` tokens as TRL's collator cuts it (no KL pairs without `mismatched`).
PairBatch collate_unpaired(const std::vector<data::Example>& examples,
                           const std::vector<std::vector<int32_t>>* mismatched, int64_t max_length, c10::Device device);

// What a step (or an evaluation) sums over micro-batches and ranks, in this order (float64).
enum PrefStat : int64_t {
  kPairs,
  kLossSum,       // the per-pair losses
  kNllSum,        // the chosen completions' token losses (orpo: the whole chosen sequences')
  kChosenTokens,  // their tokens
  kRewardChosen,  // beta x (log p - log p_ref) of the chosen completions (orpo: beta x mean token log p)
  kRewardRejected,
  kCorrect,  // pairs whose chosen reward is above the rejected one's
  kLogpChosen,
  kLogpRejected,
  kLogOddsRatio,  // orpo: log sigmoid of the log odds ratio
  kLogOdds,       // orpo: the log odds ratio
  kDesirable,     // kto: the desirable examples (kRewardChosen, kLogpChosen theirs), the undesirable
  kUndesirable,
  kKl,  // kto: the KL estimate x the examples
  // dpo, kto: TRL's token figures: the completion tokens' entropies, and their number; their mean
  // logits, of the chosen (kto: desirable) completions' tokens and the rejected ones', and their
  // numbers; the chosen completions' tokens that were the most likely
  kEntropy,
  kCompletionTokens,
  kLogitsChosen,
  kChosenCompletionTokens,
  kLogitsRejected,
  kRejectedCompletionTokens,
  kTop1Chosen,
  kPrefStats
};

class PreferenceObjective final : public Evaluation {
 public:
  // `named` are the adapter's trained tensors under PEFT's names (model::lora_state, or a job's
  // adapter's tenant_state); when lora.init_from gave them values other than the identity (some B
  // not zero), those values, read now, before any resume, are the reference. `reference`, when
  // given, are the reference's values instead (none: the adapters off).
  PreferenceObjective(const recipe::Recipe& r, model::CausalLM& m,
                      const std::vector<std::pair<std::string, at::Tensor>>& named,
                      const std::optional<std::vector<at::Tensor>>& reference = std::nullopt);

  struct Result {
    at::Tensor loss;  // float32 scalar with gradient: the per-pair losses / `pairs` (+ the NLL weight x NLL / `chosen`)
    at::Tensor stats;  // float64 [kPrefStats], detached
  };
  // One micro-batch through the policy (with gradient when the model's parameters want it) and the
  // reference (without); `pairs` and `chosen` are the step's totals over every rank and micro-batch.
  // kto: `b.kl` set first (kl_sums).
  Result forward(const PairBatch& b, double pairs, double chosen) const;

  // The batch of `examples` (pairs, or kto's examples with their KL pairs when kl_pairs(): the i-th's
  // completion `mismatched[i]`, or when not given, the completion of the example before it in `examples`).
  PairBatch collate(const std::vector<data::Example>& examples, c10::Device device,
                    const std::vector<std::vector<int32_t>>* mismatched = nullptr) const;
  bool kto() const { return objective_ == recipe::Objective::Kto; }
  // Whether its loss has KTO's KL term, estimated from KL pairs (kto; not apo_zero_unpaired).
  bool kl_pairs() const;
  // kto: float64 [2] of `b`'s KL pairs, without gradient: the sum over them of their completions'
  // log-prob under the policy less the reference's, and their number (a batch of none: its passes skipped).
  at::Tensor kl_sums(const PairBatch& b) const;
  // Whether forward() runs a reference pass before the policy's (DPO, KTO; ORPO, CPO and SimPO have none).
  bool has_reference() const { return objective_ == recipe::Objective::Dpo || kto(); }
  // A micro-batch of no pair here: forward()'s passes skipped as the model skips a pass
  // (CausalLM::skip_pass), the policy's with a backward when `backward`, the reference's unless not `reference`.
  void skip(bool backward, bool reference = true) const;
  // preference.precompute_reference: the reference's summed log-probs of `examples`' rows (PairBatch's: [2P] of
  // pairs, [P] of kto's completions), without gradient; for none, its pass skipped and undefined.
  at::Tensor reference(const std::vector<data::Example>& examples, c10::Device device) const;
  // ... that pass skipped: a peer runs it (its rows were not computed ahead), these were.
  void skip_reference() const;

  // One evaluation batch's summed stats (float64 [kPrefStats] on the host; undefined for a batch of
  // none, whose passes are skipped) and its scored tokens. KTO's KL estimate is the batch's own.
  int64_t stats() const override { return kPrefStats; }
  std::pair<at::Tensor, int64_t> evaluate(const std::vector<data::Example>& batch, c10::Device device) const override;

  // The loss of summed stats: mean per-pair loss, plus the NLL weight (rpo_alpha, cpo_alpha; orpo: 1) x the chosen
  // tokens' mean NLL.
  double loss_of(const double* stats) const override;
  // TRL's figures of summed stats: rewards/chosen, rewards/rejected, rewards/accuracies,
  // rewards/margins, logps/chosen, logps/rejected (and nll_loss when it is in the loss; dpo: entropy,
  // logits/chosen, logits/rejected, mean_token_accuracy), each name after `prefix`. kto: rewards/*,
  // logps/* and logits/* of the examples of each label present, kl, entropy.
  nlohmann::json figures(const double* stats, const std::string& prefix = "") const override;

 private:
  at::Tensor reference_logps(const data::Batch& rows) const;
  Result kto_forward(const PairBatch& b, double examples) const;
  nlohmann::json kto_figures(const double* stats, const std::string& prefix) const;
  at::Tensor pair_loss(const at::Tensor& chosen_lr, const at::Tensor& rejected_lr, const PairBatch& b) const;
  recipe::PreferenceLoss loss_type() const;  // simpo's is the simpo loss
  bool mean_logps() const;  // a completion's log-prob is the mean over its tokens (orpo; cpo's ipo, simpo)
  std::optional<double> nll_weight() const;  // of the chosen completions' NLL in the loss (none: not added)
  at::Tensor token_losses(const data::Batch& rows, at::Tensor* figures = nullptr) const;
  // [R] each row's summed log-prob of its targets
  at::Tensor summed_logps(const data::Batch& rows, at::Tensor* figures = nullptr) const;

  const recipe::PreferenceSection& p_;
  const int64_t max_length_;
  const recipe::Objective objective_;  // dpo, kto, or orpo, cpo, simpo (no reference)
  model::CausalLM& m_;
  std::vector<at::Tensor> params_;
  std::vector<at::Tensor> reference_;  // the reference's adapter values; empty: the adapters off
};

}  // namespace lorarun::train
