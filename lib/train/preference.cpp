#include "train/preference.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>

#include <algorithm>

#include "model/lora.hpp"
#include "model/loss.hpp"
#include "model/transformer.hpp"

namespace lorarun::train {

PairBatch collate_pairs(const std::vector<data::Example>& pairs, c10::Device device, bool whole_chosen) {
  PairBatch b;
  b.pairs = static_cast<int64_t>(pairs.size());
  if (pairs.empty()) return b;
  std::vector<data::Example> rows(2 * pairs.size());
  for (size_t i = 0; i < pairs.size(); ++i) {
    rows[i].ids = pairs[i].ids;
    rows[i].labels = whole_chosen ? pairs[i].ids : pairs[i].labels;
    rows[pairs.size() + i].ids = pairs[i].rejected_ids;
    rows[pairs.size() + i].labels = pairs[i].rejected_labels;
  }
  b.rows = data::collate(rows, false, 0, device);
  const int64_t T = b.rows.ids.size(1);
  b.seq = at::floor_divide(b.rows.rows, T);
  // (scored positions: a label after the first token, in the order collate lists its targets)
  std::vector<float> lengths, completion;
  for (size_t k = 0; k < rows.size(); ++k) {
    const std::vector<int32_t>& own = k < pairs.size() ? pairs[k].labels : rows[k].labels;
    float n = 0;
    for (size_t j = 1; j < rows[k].labels.size(); ++j) {
      if (rows[k].labels[j] == data::kIgnoreIndex) continue;
      const bool scored = own[j] != data::kIgnoreIndex;
      completion.push_back(scored ? 1.0f : 0.0f);
      n += scored ? 1.0f : 0.0f;
      if (k < pairs.size()) ++b.chosen_tokens;
    }
    lengths.push_back(n);
  }
  b.lengths = at::tensor(lengths, at::kFloat).to(device);
  b.completion = at::tensor(completion, at::kFloat).to(device);
  return b;
}

PairBatch collate_unpaired(const std::vector<data::Example>& examples,
                           const std::vector<std::vector<int32_t>>* mismatched, int64_t max_length,
                           c10::Device device) {
  PairBatch b;
  b.pairs = static_cast<int64_t>(examples.size());
  if (examples.empty()) return b;
  std::vector<data::Example> kl(examples.size());
  std::vector<float> desirable;
  for (size_t i = 0; i < examples.size(); ++i) {
    const data::Example& e = examples[i];
    desirable.push_back(e.desirable.value_or(false) ? 1.0f : 0.0f);
    if (!mismatched) continue;
    const auto prompt =
        std::find_if(e.labels.begin(), e.labels.end(), [](int32_t l) { return l != data::kIgnoreIndex; }) -
        e.labels.begin();
    kl[i].ids.assign(e.ids.begin(), e.ids.begin() + prompt);
    kl[i].ids.insert(kl[i].ids.end(), mismatched->at(i).begin(), mismatched->at(i).end());
    kl[i].ids.resize(std::min<size_t>(kl[i].ids.size(), static_cast<size_t>(max_length)));
    kl[i].labels = kl[i].ids;
    std::fill_n(kl[i].labels.begin(), prompt, data::kIgnoreIndex);
  }
  b.rows = data::collate(examples, false, 0, device);
  if (mismatched) b.kl_rows = data::collate(kl, false, 0, device);
  b.desirable = at::tensor(desirable, at::kFloat).to(device);
  return b;
}

namespace {

// Whether `values` (of the tensors `named`) add nothing to the base: plain LoRA pairs whose B are
// all zero. Then switching the adapters off is the same. (A DoRA magnitude or a trained table may
// differ from the base's values: those are kept as the reference.)
bool identity(const std::vector<at::Tensor>& values, const std::vector<std::pair<std::string, at::Tensor>>& named) {
  for (size_t i = 0; i < values.size(); ++i) {
    const std::string& name = named.at(i).first;
    if (name.ends_with(".lora_B.weight") && values[i].count_nonzero().item<int64_t>() != 0) return false;
    if (!name.ends_with(".lora_A.weight") && !name.ends_with(".lora_B.weight")) return false;
  }
  return true;
}

}  // namespace

PreferenceObjective::PreferenceObjective(const recipe::Recipe& r, model::CausalLM& m,
                                         const std::vector<std::pair<std::string, at::Tensor>>& named,
                                         const std::optional<std::vector<at::Tensor>>& reference)
    : p_(r.preference), max_length_(r.data.max_length), objective_(r.train.objective), m_(m) {
  for (const auto& [name, t] : named) params_.push_back(t);
  if (has_reference()) reference_ = reference ? reference_values(*reference, named) : reference_values(r, named);
}

std::vector<at::Tensor> reference_values(const std::vector<at::Tensor>& values,
                                         const std::vector<std::pair<std::string, at::Tensor>>& named) {
  std::vector<at::Tensor> out;
  if (values.empty() || identity(values, named)) return out;
  c10::NoGradGuard no_grad;
  for (const at::Tensor& t : values) out.push_back(t.detach().clone());
  return out;
}

std::vector<at::Tensor> reference_values(const recipe::Recipe& r,
                                         const std::vector<std::pair<std::string, at::Tensor>>& named) {
  if (r.lora.init_from.empty()) return {};
  std::vector<at::Tensor> values;
  for (const auto& [name, t] : named) values.push_back(t);
  return reference_values(values, named);
}

// [N] -log p of each scored token, with gradient when the model's parameters want it; `figures`, when
// given, gets their model::lm_head_token_figures.
at::Tensor PreferenceObjective::token_losses(const data::Batch& rows, at::Tensor* figures) const {
  const at::Tensor hidden = m_.hidden_states(rows.ids, rows.mask);
  const std::optional<double> cap = m_.config().logit_softcap;
  if (figures) *figures = model::lm_head_token_figures(hidden, m_.lm_head(), rows.rows, rows.targets, cap);
  return model::lm_head_token_losses(hidden, m_.lm_head(), rows.rows, rows.targets, cap);
}

at::Tensor PreferenceObjective::summed_logps(const data::Batch& rows, at::Tensor* figures) const {
  const at::Tensor tok = token_losses(rows, figures);
  return at::zeros({rows.ids.size(0)}, tok.options())
      .index_add_(0, at::floor_divide(rows.rows, rows.ids.size(1)), tok.neg());
}

PairBatch PreferenceObjective::collate(const std::vector<data::Example>& examples, c10::Device device,
                                       const std::vector<std::vector<int32_t>>* mismatched) const {
  if (!kto()) return collate_pairs(examples, device, objective_ == recipe::Objective::Orpo);
  if (mismatched || !kl_pairs()) return collate_unpaired(examples, mismatched, max_length_, device);
  std::vector<std::vector<int32_t>> rotated;  // (TRL's: the completions rotated by one)
  for (size_t i = 0; i < examples.size(); ++i)
    rotated.push_back(examples[(i + examples.size() - 1) % examples.size()].completion);
  return collate_unpaired(examples, &rotated, max_length_, device);
}

bool PreferenceObjective::kl_pairs() const { return kto() && loss_type() == recipe::PreferenceLoss::Kto; }

AsReference::AsReference(model::CausalLM& m, const std::vector<at::Tensor>& params,
                         const std::vector<at::Tensor>& values)
    : m_(m), params_(params), was_training_(m.training) {
  m.training = false;
  if (values.empty()) m.set_adapters_off(true);
  for (size_t i = 0; i < values.size(); ++i) {
    saved_.push_back(params[i].detach().clone());
    params[i].detach().copy_(values[i]);
  }
}

AsReference::~AsReference() {
  m_.set_adapters_off(false);
  for (size_t i = 0; i < saved_.size(); ++i) params_[i].detach().copy_(saved_[i]);
  m_.training = was_training_;
}

// [R] the reference's summed log-probs of each row's targets, without gradient.
at::Tensor PreferenceObjective::reference_logps(const data::Batch& rows) const {
  c10::NoGradGuard no_grad;
  const AsReference as_reference(m_, params_, reference_);
  return summed_logps(rows);
}

at::Tensor PreferenceObjective::kl_sums(const PairBatch& b) const {
  if (b.pairs == 0) {
    m_.skip_pass(false, false);
    m_.skip_pass(false, false);
    return at::zeros({2}, at::kDouble);
  }
  c10::NoGradGuard no_grad;
  const at::Tensor policy = summed_logps(b.kl_rows);
  return at::stack({(policy - reference_logps(b.kl_rows)).sum().to(at::kDouble).cpu(),
                    at::scalar_tensor(static_cast<double>(b.pairs), at::kDouble)});
}

namespace {

// TRL's token figures of a batch into `s`: `fig` [N, 3] (model::lm_head_token_figures) of its targets,
// `chosen` [N] 1 where the target is a chosen (kto: desirable) completion's, `completion` [N] 1 where
// it is a completion's at all.
void token_stats(std::vector<at::Tensor>& s, const at::Tensor& fig, const at::Tensor& chosen,
                 const at::Tensor& completion) {
  const at::Tensor c = chosen * completion, r = (1 - chosen) * completion, logits = fig.select(1, 1);
  s[kEntropy] = (fig.select(1, 0) * completion).sum();
  s[kCompletionTokens] = completion.sum();
  s[kLogitsChosen] = (logits * c).sum();
  s[kChosenCompletionTokens] = c.sum();
  s[kLogitsRejected] = (logits * r).sum();
  s[kRejectedCompletionTokens] = r.sum();
  s[kTop1Chosen] = (fig.select(1, 2) * c).sum();
}

// log(1 - exp(x)) for x < 0, as TRL computes it (branching at -ln 2).
at::Tensor log1mexp(const at::Tensor& x) {
  return at::where(x < -0.6931471805599453, at::log1p(-at::exp(x)), at::log(-at::expm1(x)));
}

}  // namespace

void PreferenceObjective::skip(bool backward, bool reference) const {
  if (has_reference() && reference) m_.skip_pass(false, false);
  m_.skip_pass(backward, false);
}

void PreferenceObjective::skip_reference() const { m_.skip_pass(false, false); }

at::Tensor PreferenceObjective::reference(const std::vector<data::Example>& examples, c10::Device device) const {
  if (examples.empty()) {
    skip_reference();
    return {};
  }
  const PairBatch b =
      kto() ? collate_unpaired(examples, nullptr, max_length_, device) : collate_pairs(examples, device);
  return reference_logps(b.rows);
}

PreferenceObjective::Result PreferenceObjective::forward(const PairBatch& b, double pairs, double chosen) const {
  if (kto()) return kto_forward(b, pairs);
  const int64_t P = b.pairs;
  const bool orpo = objective_ == recipe::Objective::Orpo;
  // (the reference first: it sets the parameters' values in place, which the policy's graph must not see)
  const at::Tensor ref = !has_reference()        ? at::Tensor()
                         : b.reference.defined() ? b.reference
                                                 : reference_logps(b.rows);
  at::Tensor fig;  // (dpo: TRL's token figures)
  const at::Tensor tok = token_losses(b.rows, objective_ == recipe::Objective::Dpo ? &fig : nullptr);
  at::Tensor logps = at::zeros({2 * P}, tok.options()).index_add(0, b.seq, tok.neg() * b.completion);
  if (mean_logps()) logps = logps / b.lengths.clamp_min(1);  // (means over each completion's tokens)
  const at::Tensor nll = tok.masked_fill(b.seq >= P, 0).sum();
  const double beta = p_.beta;
  const at::Tensor c = logps.narrow(0, 0, P), r = logps.narrow(0, P, P);
  at::Tensor per_pair, rc, rr, ratio, log_odds;
  if (orpo) {
    log_odds = (c - r) - (log1mexp(c) - log1mexp(r));
    ratio = at::log_sigmoid(log_odds);
    per_pair = -beta * ratio;
    rc = beta * c.detach();
    rr = beta * r.detach();
  } else {  // DPO: the log-ratios to the reference; CPO and SimPO: the log-probabilities themselves
    const at::Tensor chosen_lr = ref.defined() ? c - ref.narrow(0, 0, P) : c;
    const at::Tensor rejected_lr = ref.defined() ? r - ref.narrow(0, P, P) : r;
    per_pair = pair_loss(chosen_lr, rejected_lr, b);
    rc = beta * chosen_lr.detach();
    rr = beta * rejected_lr.detach();
  }
  at::Tensor loss = per_pair.sum() / pairs;
  if (const std::optional<double> w = nll_weight()) loss = loss + *w * nll / std::max(chosen, 1.0);
  std::vector<at::Tensor> s(kPrefStats, at::zeros({}, rc.options()));
  s[kPairs] = at::scalar_tensor(static_cast<double>(P), rc.options());
  s[kLossSum] = per_pair.detach().sum();
  s[kNllSum] = nll.detach();
  s[kChosenTokens] = at::scalar_tensor(static_cast<double>(b.chosen_tokens), rc.options());
  s[kRewardChosen] = rc.sum();
  s[kRewardRejected] = rr.sum();
  s[kCorrect] = (rc > rr).sum().to(rc.scalar_type());
  s[kLogpChosen] = c.detach().sum();
  s[kLogpRejected] = r.detach().sum();
  if (orpo) {
    s[kLogOddsRatio] = ratio.detach().sum();
    s[kLogOdds] = log_odds.detach().sum();
  }
  if (fig.defined()) token_stats(s, fig, (b.seq < P).to(at::kFloat), b.completion);
  return {loss, at::stack(s).to(at::kDouble)};
}

// TRL's KTO losses (Eq. 7 of the KTO paper; apo_zero_unpaired: APO's, without the KL term), each
// label's weighted, their sum over `examples` (the step's, every rank's).
PreferenceObjective::Result PreferenceObjective::kto_forward(const PairBatch& b, double examples) const {
  const at::Tensor ref = b.reference.defined() ? b.reference : reference_logps(b.rows);
  at::Tensor fig;
  const at::Tensor logps = summed_logps(b.rows, &fig);
  const at::Tensor lr = logps - ref, d = b.desirable;
  const double beta = p_.beta;
  const bool apo = loss_type() == recipe::PreferenceLoss::ApoZeroUnpaired;
  const at::Tensor chosen = 1 - at::sigmoid(beta * (apo ? lr : lr - b.kl));
  const at::Tensor rejected = apo ? at::sigmoid(beta * lr) : 1 - at::sigmoid(beta * (b.kl - lr));
  const at::Tensor per = at::where(d > 0, p_.desirable_weight * chosen, p_.undesirable_weight * rejected);
  const at::Tensor rewards = beta * lr.detach(), lp = logps.detach();
  std::vector<at::Tensor> s(kPrefStats, at::zeros({}, lp.options()));
  s[kPairs] = at::scalar_tensor(static_cast<double>(b.pairs), lp.options());
  s[kLossSum] = per.detach().sum();
  s[kRewardChosen] = (rewards * d).sum();
  s[kRewardRejected] = (rewards * (1 - d)).sum();
  s[kLogpChosen] = (lp * d).sum();
  s[kLogpRejected] = (lp * (1 - d)).sum();
  s[kDesirable] = d.sum();
  s[kUndesirable] = (1 - d).sum();
  s[kKl] = s[kPairs] * b.kl;
  const at::Tensor row = at::floor_divide(b.rows.rows, b.rows.ids.size(1));  // (each target's)
  token_stats(s, fig, d.index_select(0, row), at::ones_like(d.index_select(0, row)));
  return {per.sum() / examples, at::stack(s).to(at::kDouble)};
}

std::pair<at::Tensor, int64_t> PreferenceObjective::evaluate(const std::vector<data::Example>& batch,
                                                             c10::Device device) const {
  PairBatch b = collate(batch, device);
  if (kl_pairs()) {
    const at::Tensor kl = kl_sums(b);
    b.kl = std::max(kl[0].item<double>() / std::max(kl[1].item<double>(), 1.0), 0.0);
  }
  if (b.pairs == 0) {
    skip(false);
    return {at::Tensor(), 0};
  }
  return {forward(b, 1, 1).stats.cpu(), b.rows.tokens};
}

recipe::PreferenceLoss PreferenceObjective::loss_type() const {
  if (objective_ == recipe::Objective::Simpo) return recipe::PreferenceLoss::Simpo;
  if (kto() && p_.loss_type == recipe::PreferenceLoss::Sigmoid) return recipe::PreferenceLoss::Kto;
  return p_.loss_type;
}

bool PreferenceObjective::mean_logps() const {
  if (objective_ == recipe::Objective::Orpo) return true;
  return !has_reference() &&
         (loss_type() == recipe::PreferenceLoss::Ipo || loss_type() == recipe::PreferenceLoss::Simpo);
}

std::optional<double> PreferenceObjective::nll_weight() const {
  switch (objective_) {
    case recipe::Objective::Orpo:
      return 1.0;
    case recipe::Objective::Cpo:
    case recipe::Objective::Simpo: {
      const double w = p_.cpo_alpha.value_or(objective_ == recipe::Objective::Cpo ? 1.0 : 0.0);
      return w > 0 ? std::optional(w) : std::nullopt;
    }
    default:
      return p_.rpo_alpha;
  }
}

// TRL's losses of each pair from its chosen and rejected log-ratios (DPO: to the reference; CPO:
// the log-probabilities, means with ipo and simpo).
at::Tensor PreferenceObjective::pair_loss(const at::Tensor& chosen_lr, const at::Tensor& rejected_lr,
                                          const PairBatch& b) const {
  const double beta = p_.beta;
  const int64_t P = b.pairs;
  const auto sigmoid = [&](const at::Tensor& z) {
    const double eps = p_.label_smoothing;
    return -at::log_sigmoid(z) * (1 - eps) - at::log_sigmoid(-z) * eps;
  };
  switch (loss_type()) {
    case recipe::PreferenceLoss::Sigmoid:
      return sigmoid(beta * (chosen_lr - rejected_lr));
    case recipe::PreferenceLoss::Simpo:  // (the margin gamma in units of beta, as TRL subtracts it)
      return sigmoid(beta * ((chosen_lr - rejected_lr) - p_.simpo_gamma / beta));
    case recipe::PreferenceLoss::Hinge:
      return at::relu(1 - beta * (chosen_lr - rejected_lr));
    case recipe::PreferenceLoss::Kto:  // (kto_forward's)
    case recipe::PreferenceLoss::ApoZeroUnpaired:
      break;
    case recipe::PreferenceLoss::Ipo: {  // per-token log-ratios (TRL's normalisation; CPO's are means already)
      const at::Tensor delta = mean_logps() ? chosen_lr - rejected_lr
                                            : chosen_lr / b.lengths.narrow(0, 0, P).clamp_min(1) -
                                                  rejected_lr / b.lengths.narrow(0, P, P).clamp_min(1);
      return (delta - 1 / (2 * beta)).square();
    }
  }
  return {};
}

double PreferenceObjective::loss_of(const double* s) const {
  const double pairs = std::max(s[kPairs], 1.0);
  const std::optional<double> w = nll_weight();
  return s[kLossSum] / pairs + (w ? *w * s[kNllSum] / std::max(s[kChosenTokens], 1.0) : 0.0);
}

nlohmann::json PreferenceObjective::figures(const double* s, const std::string& prefix) const {
  if (kto()) return kto_figures(s, prefix);
  const double pairs = std::max(s[kPairs], 1.0);
  nlohmann::json out = {{prefix + "rewards/chosen", s[kRewardChosen] / pairs},
                        {prefix + "rewards/rejected", s[kRewardRejected] / pairs},
                        {prefix + "rewards/accuracies", s[kCorrect] / pairs},
                        {prefix + "rewards/margins", (s[kRewardChosen] - s[kRewardRejected]) / pairs},
                        {prefix + "logps/chosen", s[kLogpChosen] / pairs},
                        {prefix + "logps/rejected", s[kLogpRejected] / pairs}};
  if (nll_weight()) out[prefix + "nll_loss"] = s[kNllSum] / std::max(s[kChosenTokens], 1.0);
  if (objective_ == recipe::Objective::Orpo) {
    out[prefix + "log_odds_ratio"] = s[kLogOddsRatio] / pairs;
    out[prefix + "log_odds_chosen"] = s[kLogOdds] / pairs;
  }
  if (objective_ == recipe::Objective::Dpo) {  // (0 without tokens, as TRL logs them)
    const auto mean = [](double sum, double n) { return n > 0 ? sum / n : 0.0; };
    out[prefix + "entropy"] = mean(s[kEntropy], s[kCompletionTokens]);
    out[prefix + "logits/chosen"] = mean(s[kLogitsChosen], s[kChosenCompletionTokens]);
    out[prefix + "logits/rejected"] = mean(s[kLogitsRejected], s[kRejectedCompletionTokens]);
    out[prefix + "mean_token_accuracy"] = mean(s[kTop1Chosen], s[kChosenCompletionTokens]);
  }
  return out;
}

// As TRL's KTOTrainer logs them: each label's figures when the step has examples of it, the margin
// when it has both.
nlohmann::json PreferenceObjective::kto_figures(const double* s, const std::string& prefix) const {
  nlohmann::json out = {{prefix + "kl", s[kKl] / std::max(s[kPairs], 1.0)},
                        {prefix + "entropy", s[kCompletionTokens] > 0 ? s[kEntropy] / s[kCompletionTokens] : 0.0}};
  if (s[kChosenCompletionTokens] > 0) out[prefix + "logits/chosen"] = s[kLogitsChosen] / s[kChosenCompletionTokens];
  if (s[kRejectedCompletionTokens] > 0)
    out[prefix + "logits/rejected"] = s[kLogitsRejected] / s[kRejectedCompletionTokens];
  if (s[kDesirable] > 0) {
    out[prefix + "rewards/chosen"] = s[kRewardChosen] / s[kDesirable];
    out[prefix + "logps/chosen"] = s[kLogpChosen] / s[kDesirable];
  }
  if (s[kUndesirable] > 0) {
    out[prefix + "rewards/rejected"] = s[kRewardRejected] / s[kUndesirable];
    out[prefix + "logps/rejected"] = s[kLogpRejected] / s[kUndesirable];
  }
  if (s[kDesirable] > 0 && s[kUndesirable] > 0)
    out[prefix + "rewards/margins"] = s[kRewardChosen] / s[kDesirable] - s[kRewardRejected] / s[kUndesirable];
  return out;
}

}  // namespace lorarun::train
