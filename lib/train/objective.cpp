#include "train/objective.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <algorithm>
#include <limits>
#include <numeric>
#include <optional>

#include "data/collate.hpp"
#include "model/loss.hpp"
#include "model/transformer.hpp"
#include "train/agreement.hpp"
#include "train/grpo_objective.hpp"
#include "train/preference.hpp"
#include "train/reference_logps.hpp"
#include "util/error.hpp"

namespace lorarun::train {
namespace {

// The router loss's coefficient for `m` (moe.router_aux_loss_coef, else as transformers trains the
// model); ConfigError where it cannot apply.
double router_loss_coef(const recipe::Recipe& r, const model::CausalLM& m) {
  const double coef = r.moe.router_aux_loss_coef.value_or(m.config().moe.aux_loss_coef);
  if (r.moe.router_aux_loss_coef && m.moe_layers().empty())
    throw ConfigError(
        fmt::format("moe.router_aux_loss_coef is set but {} is not a mixture of experts: remove it", m.dir()));
  if (coef == 0) return 0;
  const char* why = r.train.objective != recipe::Objective::Sft ? "train.objective sft only so far"
                    : r.train.activation_checkpointing          ? "without train.activation_checkpointing so far"
                    : r.adapters.enabled()                      ? "a run of one adapter only so far (not adapters:)"
                                                                : nullptr;
  if (why)
    throw ConfigError(
        fmt::format("the router's load-balancing loss (moe.router_aux_loss_coef {}{}) is added by {}: set "
                    "moe.router_aux_loss_coef: 0 to train without it",
                    coef, r.moe.router_aux_loss_coef ? "" : ", from config.json's output_router_logits", why));
  return coef;
}

// train.objective: sft: the token cross-entropy of the completion's tokens (or every token's). A
// mixture of experts adds the routers' load-balancing loss of each micro-batch (transformers'),
// weighted by its trained tokens like the cross-entropy it joins, times the coefficient; its stats
// are that loss (times the tokens), the tokens, and each MoE layer's tokens per expert.
class Sft final : public Objective {
 public:
  Sft(const recipe::Recipe& r, model::CausalLM& m, c10::Device device)
      : r_(r),
        m_(m),
        device_(device),
        coef_(router_loss_coef(r, m)),
        experts_(m.config().moe.experts),
        moe_layers_(static_cast<int64_t>(m.moe_layers().size())) {}

  Sums forward_backward(const Next& next, int accum, const std::function<void()>& arm, StepAt /*at*/) override {
    Sums sums;
    sums.loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
    for (int a = 0; a < accum; ++a) {
      if (a + 1 == accum) arm();
      const data::Batch b = data::collate(next(), r_.data.packing, static_cast<size_t>(r_.data.max_length), device_);
      sums.real += b.real;
      sums.slots += b.slots;
      if (b.tokens == 0) {  // an empty micro-batch: the gradients' all-reduce still joins in
        m_.skip_pass(true, r_.data.packing);
        continue;
      }
      const at::Tensor hidden = m_.hidden_states(b.ids, b.mask, nullptr, r_.data.packing);
      const model::LossSum l = model::lm_head_loss(hidden, m_.lm_head(), b.rows, b.targets, m_.config().logit_softcap);
      at::Tensor loss = l.sum;
      if (moe_layers_ > 0) {
        const model::RouterPass p = m_.router_pass();
        const auto tokens = static_cast<double>(b.tokens);
        if (coef_ > 0) loss = loss + p.loss * (coef_ * tokens);
        if (!sums.stats.defined())
          sums.stats = at::zeros({stats()}, at::TensorOptions().dtype(at::kDouble).device(device_));
        sums.stats.narrow(0, 0, 2) +=
            at::stack({p.loss.detach().to(at::kDouble) * tokens, at::scalar_tensor(tokens, sums.stats.options())});
        sums.stats.narrow(0, 2, moe_layers_ * experts_) += p.load.flatten().to(device_);
      }
      loss.backward();
      sums.loss += l.sum.detach();
      sums.tokens += b.tokens;
    }
    if (moe_layers_ > 0 && !sums.stats.defined())
      sums.stats = at::zeros({stats()}, at::TensorOptions().dtype(at::kDouble).device(device_));
    return sums;
  }
  int64_t stats() const override { return moe_layers_ > 0 ? 2 + moe_layers_ * experts_ : 0; }
  // router_loss: the load-balancing loss (mean over the step's trained tokens); expert_load/min and
  // max: over every MoE layer and expert, the share of the layer's routed tokens an expert took
  // times the experts (1: an even load; 0: an expert left idle).
  nlohmann::json figures(const double* s) const override {
    nlohmann::json out = nlohmann::json::object();
    if (moe_layers_ == 0 || s[1] <= 0) return out;
    out["router_loss"] = s[0] / s[1];
    double low = std::numeric_limits<double>::infinity(), high = 0;
    for (int64_t l = 0; l < moe_layers_; ++l) {
      const double* load = s + 2 + l * experts_;
      const double all = std::accumulate(load, load + experts_, 0.0);
      for (int64_t e = 0; e < experts_ && all > 0; ++e) {
        low = std::min(low, load[e] / all * static_cast<double>(experts_));
        high = std::max(high, load[e] / all * static_cast<double>(experts_));
      }
    }
    if (high > 0) {
      out["expert_load/min"] = low;
      out["expert_load/max"] = high;
    }
    return out;
  }

 private:
  const recipe::Recipe& r_;
  model::CausalLM& m_;
  const c10::Device device_;
  const double coef_;
  const int64_t experts_, moe_layers_;
};

// KTO's mismatched completions for this rank's micro-batches `micro` of a step: every rank's examples
// of the step in one order — the first of each rank in rank order, then the second, … (the order of
// the positions DistributedSampler's interleaving read them from, so the same on 1 rank with
// accumulation as on N) — each paired with the completion of the example before it, the first with
// the last's: TRL's rotation by one, over the whole step rather than one rank's micro-batch.
std::vector<std::vector<std::vector<int32_t>>> mismatched(const std::vector<std::vector<data::Example>>& micro,
                                                          const Agreement& agree) {
  std::vector<double> flat = {0};  // this rank's: [examples, each completion's length, their ids]
  for (const auto& examples : micro)
    for (const data::Example& e : examples) {
      ++flat[0];
      flat.push_back(static_cast<double>(e.completion.size()));
    }
  for (const auto& examples : micro)
    for (const data::Example& e : examples) flat.insert(flat.end(), e.completion.begin(), e.completion.end());
  const int world = agree.world();
  const std::vector<std::vector<double>> all = agree.gather(flat);
  std::vector<std::vector<std::vector<int32_t>>> completions(static_cast<size_t>(world));  // by rank
  for (int r = 0; r < world; ++r) {
    const double* row = all[static_cast<size_t>(r)].data();
    const auto n = static_cast<size_t>(row[0]);
    for (size_t i = 0, at = 1 + n; i < n; ++i) {
      const auto len = static_cast<size_t>(row[1 + i]);
      completions[static_cast<size_t>(r)].emplace_back(row + at, row + at + len);
      at += len;
    }
  }
  std::vector<std::pair<int, size_t>> order;  // (rank, its example)
  for (size_t k = 0;; ++k) {
    const size_t before = order.size();
    for (int r = 0; r < world; ++r)
      if (k < completions[static_cast<size_t>(r)].size()) order.emplace_back(r, k);
    if (order.size() == before) break;
  }
  std::vector<std::vector<std::vector<int32_t>>> out(micro.size());
  for (size_t g = 0, a = 0; g < order.size(); ++g) {
    if (order[g].first != agree.rank()) continue;
    while (out[a].size() == micro[a].size()) ++a;
    const auto& [r, i] = order[(g + order.size() - 1) % order.size()];
    out[a].push_back(completions[static_cast<size_t>(r)][i]);
  }
  return out;
}

// train.objective: dpo, orpo, cpo, simpo, kto. A step's micro-batches are read first, so that each
// one's loss can be divided by the pairs (kto: examples; and chosen tokens) of the whole step, every
// rank's: the loss is a mean over the global batch's pairs, whatever the ranks and accumulation. KTO's
// KL estimate is the step's too: the mean over every rank's KL pairs (mismatched), clamped at 0, taken
// before any loss (it carries no gradient). (TRL's is each micro-batch's, averaged over the ranks: the
// same without accumulation.)
class Pairs final : public Objective {
 public:
  Pairs(const recipe::Recipe& r, model::CausalLM& m, const std::vector<std::pair<std::string, at::Tensor>>& named,
        const Agreement& agree, c10::Device device)
      : pref_(r, m, named), agree_(agree), device_(device) {
    if (r.preference.precompute_reference) cache_.emplace(pref_.kto() ? 1 : 2);
  }

  Sums forward_backward(const Next& next, int accum, const std::function<void()>& arm, StepAt /*at*/) override {
    Sums sums;
    sums.loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
    sums.stats = at::zeros({kPrefStats}, at::TensorOptions().dtype(at::kDouble).device(device_));
    std::vector<std::vector<data::Example>> examples;
    for (int a = 0; a < accum; ++a) examples.push_back(next());
    const bool kl_pairs = pref_.kl_pairs();
    std::vector<std::vector<std::vector<int32_t>>> others;  // each example's KL pair's completion
    if (kl_pairs) others = mismatched(examples, agree_);
    std::vector<PairBatch> micro;
    // pairs, chosen tokens; kto: its KL pairs' sum and count; then each micro-batch whose reference
    // log-probs were not computed ahead here (its reference pass runs: on every rank alike)
    std::vector<double> mine(4 + examples.size(), 0.0);
    for (size_t a = 0; a < examples.size(); ++a) {
      micro.push_back(pref_.collate(examples[a], device_, kl_pairs ? &others[a] : nullptr));
      PairBatch& b = micro.back();
      mine[0] += static_cast<double>(b.pairs);
      mine[1] += static_cast<double>(b.chosen_tokens);
      if (cache_ && b.pairs > 0) b.reference = cache_->find(examples[a], device_);
      mine[4 + a] = !cache_ || (b.pairs > 0 && !b.reference.defined()) ? 1.0 : 0.0;
      if (!kl_pairs) continue;
      const at::Tensor kl = pref_.kl_sums(b);
      mine[2] += kl[0].item<double>();
      mine[3] += kl[1].item<double>();
    }
    at::Tensor total = at::tensor(mine, at::kDouble).to(device_);
    agree_.sum(total);
    total = total.cpu().contiguous();
    const double* t = total.data_ptr<double>();
    const double pairs = std::max(t[0], 1.0), chosen = t[1];
    const double kl = std::max(t[2] / std::max(t[3], 1.0), 0.0);
    for (PairBatch& b : micro) b.kl = kl;
    for (size_t a = 0; a < micro.size(); ++a) {
      if (a + 1 == micro.size()) arm();
      const PairBatch& b = micro[a];
      const bool live = t[4 + a] > 0;  // a rank runs this micro-batch's reference pass
      sums.real += b.rows.real;
      sums.slots += b.rows.slots;
      if (b.pairs == 0) {
        pref_.skip(true, live);
        continue;
      }
      if (live && b.reference.defined()) pref_.skip_reference();  // (joins a peer's pass)
      const PreferenceObjective::Result res = pref_.forward(b, pairs, chosen);
      res.loss.backward();
      sums.loss += res.loss.detach();
      sums.stats += res.stats;
      sums.tokens += b.rows.tokens;
    }
    return sums;
  }
  bool normalised() const override { return true; }
  int64_t stats() const override { return kPrefStats; }
  nlohmann::json figures(const double* stats) const override { return pref_.figures(stats); }
  const Evaluation* evaluation() const override { return &pref_; }

  bool wants_reference() const override { return cache_ && !ready_; }
  void reference(const std::vector<data::Example>& micro) override {
    const at::Tensor logps = pref_.reference(micro, device_);
    if (logps.defined()) cache_->add(micro, logps);
  }
  int64_t reference_done() override {
    cache_->gather(agree_);
    ready_ = true;
    return cache_->size();
  }
  bool keeps_state() const override { return cache_.has_value(); }
  void save_files(const std::string& dir, const nlohmann::json& data) const override {
    if (cache_) cache_->save(dir, data);
  }
  std::string load_files(const std::string& dir, const nlohmann::json& data) override {
    if (!cache_) return "";
    const std::string why = cache_->load(dir, data);
    ready_ = why.empty();
    if (!ready_) cache_->clear();
    return why;
  }

 private:
  const PreferenceObjective pref_;
  std::optional<ReferenceLogps> cache_;  // preference.precompute_reference's
  bool ready_ = false;                   // ... computed, or read from the state
  const Agreement& agree_;
  const c10::Device device_;
};

}  // namespace

Objective::~Objective() = default;

std::unique_ptr<Objective> make_objective(const recipe::Recipe& r, model::CausalLM& m,
                                          const std::vector<std::pair<std::string, at::Tensor>>& named,
                                          const Agreement& agree, c10::Device device, const tok::Tokenizer& tokenizer) {
  if (r.train.objective == recipe::Objective::Sft) return std::make_unique<Sft>(r, m, device);
  router_loss_coef(r, m);  // (what they do not add is refused)
  if (r.train.objective == recipe::Objective::Grpo) return make_grpo(r, m, named, agree, device, tokenizer);
  return std::make_unique<Pairs>(r, m, named, agree, device);
}

}  // namespace lorarun::train
