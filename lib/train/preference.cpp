#include "train/preference.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include "model/loss.hpp"
#include "model/transformer.hpp"

namespace lorarun::train {

PairBatch collate_pairs(const std::vector<data::Example>& pairs, c10::Device device) {
  PairBatch b;
  b.pairs = static_cast<int64_t>(pairs.size());
  if (pairs.empty()) return b;
  std::vector<data::Example> rows(2 * pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) {
    rows[i].ids = pairs[i].ids;
    rows[i].labels = pairs[i].labels;
    rows[pairs.size() + i].ids = pairs[i].rejected_ids;
    rows[pairs.size() + i].labels = pairs[i].rejected_labels;
  }
  b.rows = data::collate(rows, false, 0, device);
  const int64_t T = b.rows.ids.size(1);
  b.seq = at::floor_divide(b.rows.rows, T);
  std::vector<float> lengths;
  for (size_t k = 0; k < rows.size(); ++k) {
    const auto& l = rows[k].labels;
    // (scored positions: a label after the first token, as the collated targets)
    const auto n = std::count_if(l.begin() + std::min<size_t>(1, l.size()), l.end(),
                                 [](int32_t x) { return x != data::kIgnoreIndex; });
    lengths.push_back(static_cast<float>(n));
    if (k < pairs.size()) b.chosen_tokens += n;
  }
  b.lengths = at::tensor(lengths, at::kFloat).to(device);
  return b;
}

namespace {

// Whether every lora_B is zero: the adapters then add nothing, and switching them off is the same.
bool identity(const std::vector<at::Tensor>& params) {
  for (size_t i = 1; i < params.size(); i += 2)  // (A then B for each layer)
    if (params[i].count_nonzero().item<int64_t>() != 0) return false;
  return true;
}

}  // namespace

PreferenceObjective::PreferenceObjective(const recipe::Recipe& r, model::CausalLM& m,
                                         const std::vector<at::Tensor>& params)
    : p_(r.preference), m_(m), params_(params) {
  if (r.lora.init_from.empty() || identity(params)) return;
  c10::NoGradGuard no_grad;
  for (const at::Tensor& t : params) reference_.push_back(t.detach().clone());
}

// [N] -log p of each scored token, with gradient when the model's parameters want it.
at::Tensor PreferenceObjective::token_losses(const PairBatch& b) const {
  const at::Tensor hidden = m_.hidden_states(b.rows.ids, b.rows.mask);
  return model::lm_head_token_losses(hidden, m_.lm_head(), b.rows.rows, b.rows.targets, m_.config().logit_softcap);
}

namespace {

// While it lives, the model is the reference: eval mode, the adapters off or at `values`.
class AsReference {
 public:
  AsReference(model::CausalLM& m, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& values)
      : m_(m), params_(params), was_training_(m.training) {
    m.training = false;
    if (values.empty())
      for (model::Linear* l : m.linears()) l->adapter_off = true;
    for (size_t i = 0; i < values.size(); ++i) {
      saved_.push_back(params[i].detach().clone());
      params[i].detach().copy_(values[i]);
    }
  }
  ~AsReference() {
    for (model::Linear* l : m_.linears()) l->adapter_off = false;
    for (size_t i = 0; i < saved_.size(); ++i) params_[i].detach().copy_(saved_[i]);
    m_.training = was_training_;
  }
  AsReference(const AsReference&) = delete;
  AsReference& operator=(const AsReference&) = delete;

 private:
  model::CausalLM& m_;
  const std::vector<at::Tensor>& params_;
  std::vector<at::Tensor> saved_;
  const bool was_training_;
};

}  // namespace

// [2P] the reference's summed completion log-probs, without gradient.
at::Tensor PreferenceObjective::reference_logps(const PairBatch& b) const {
  c10::NoGradGuard no_grad;
  const AsReference as_reference(m_, params_, reference_);
  return at::zeros({2 * b.pairs}, b.lengths.options()).index_add_(0, b.seq, token_losses(b).neg());
}

PreferenceObjective::Result PreferenceObjective::forward(const PairBatch& b, double pairs, double chosen) const {
  const int64_t P = b.pairs;
  const at::Tensor ref = reference_logps(b);
  const at::Tensor tok = token_losses(b);
  const at::Tensor logps = at::zeros({2 * P}, tok.options()).index_add(0, b.seq, tok.neg());
  const at::Tensor chosen_lr = logps.narrow(0, 0, P) - ref.narrow(0, 0, P);
  const at::Tensor rejected_lr = logps.narrow(0, P, P) - ref.narrow(0, P, P);
  const double beta = p_.beta;
  at::Tensor per_pair;
  switch (p_.loss_type) {
    case recipe::PreferenceLoss::Sigmoid: {
      const at::Tensor z = beta * (chosen_lr - rejected_lr);
      const double eps = p_.label_smoothing;
      per_pair = -at::log_sigmoid(z) * (1 - eps) - at::log_sigmoid(-z) * eps;
      break;
    }
    case recipe::PreferenceLoss::Hinge:
      per_pair = at::relu(1 - beta * (chosen_lr - rejected_lr));
      break;
    case recipe::PreferenceLoss::Ipo: {  // per-token log-ratios (TRL's normalisation)
      const at::Tensor delta =
          chosen_lr / b.lengths.narrow(0, 0, P).clamp_min(1) - rejected_lr / b.lengths.narrow(0, P, P).clamp_min(1);
      per_pair = (delta - 1 / (2 * beta)).square();
      break;
    }
  }
  const at::Tensor nll = tok.masked_fill(b.seq >= P, 0).sum();
  at::Tensor loss = per_pair.sum() / pairs;
  if (p_.rpo_alpha) loss = loss + *p_.rpo_alpha * nll / std::max(chosen, 1.0);
  const at::Tensor rc = beta * chosen_lr.detach(), rr = beta * rejected_lr.detach();
  const at::Tensor stats =
      at::stack({at::scalar_tensor(static_cast<double>(P), rc.options()), per_pair.detach().sum(), nll.detach(),
                 at::scalar_tensor(static_cast<double>(b.chosen_tokens), rc.options()), rc.sum(), rr.sum(),
                 (rc > rr).sum().to(rc.scalar_type()), logps.detach().narrow(0, 0, P).sum(),
                 logps.detach().narrow(0, P, P).sum()})
          .to(at::kDouble);
  return {loss, stats};
}

double PreferenceObjective::loss_of(const double* s) const {
  const double pairs = std::max(s[kPairs], 1.0);
  return s[kLossSum] / pairs + (p_.rpo_alpha ? *p_.rpo_alpha * s[kNllSum] / std::max(s[kChosenTokens], 1.0) : 0.0);
}

nlohmann::json PreferenceObjective::figures(const double* s, const std::string& prefix) const {
  const double pairs = std::max(s[kPairs], 1.0);
  nlohmann::json out = {{prefix + "rewards/chosen", s[kRewardChosen] / pairs},
                        {prefix + "rewards/rejected", s[kRewardRejected] / pairs},
                        {prefix + "rewards/accuracies", s[kCorrect] / pairs},
                        {prefix + "rewards/margins", (s[kRewardChosen] - s[kRewardRejected]) / pairs},
                        {prefix + "logps/chosen", s[kLogpChosen] / pairs},
                        {prefix + "logps/rejected", s[kLogpRejected] / pairs}};
  if (p_.rpo_alpha) out[prefix + "nll_loss"] = s[kNllSum] / std::max(s[kChosenTokens], 1.0);
  return out;
}

}  // namespace lorarun::train
