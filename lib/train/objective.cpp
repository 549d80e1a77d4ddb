#include "train/objective.hpp"

#include <ATen/ATen.h>
#include <algorithm>

#include "data/collate.hpp"
#include "model/loss.hpp"
#include "model/transformer.hpp"
#include "train/agreement.hpp"
#include "train/preference.hpp"

namespace lorarun::train {
namespace {

// train.objective: sft: the token cross-entropy of the completion's tokens (or every token's).
class Sft final : public Objective {
 public:
  Sft(const recipe::Recipe& r, model::CausalLM& m, c10::Device device) : r_(r), m_(m), device_(device) {}

  Sums forward_backward(const Next& next, int accum, const std::function<void()>& arm) override {
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
      l.sum.backward();
      sums.loss += l.sum.detach();
      sums.tokens += b.tokens;
    }
    return sums;
  }

 private:
  const recipe::Recipe& r_;
  model::CausalLM& m_;
  const c10::Device device_;
};

// train.objective: dpo, orpo, cpo, simpo. A step's micro-batches are read first, so that each one's
// loss can be divided by the pairs (and chosen tokens) of the whole step, every rank's: the loss is a
// mean over the global batch's pairs, whatever the ranks and accumulation.
class Pairs final : public Objective {
 public:
  Pairs(const recipe::Recipe& r, model::CausalLM& m, const std::vector<std::pair<std::string, at::Tensor>>& named,
        const Agreement& agree, c10::Device device)
      : pref_(r, m, named), agree_(agree), device_(device) {}

  Sums forward_backward(const Next& next, int accum, const std::function<void()>& arm) override {
    Sums sums;
    sums.loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
    sums.stats = at::zeros({kPrefStats}, at::TensorOptions().dtype(at::kDouble).device(device_));
    std::vector<PairBatch> micro;
    double mine[2] = {0, 0};
    for (int a = 0; a < accum; ++a) {
      micro.push_back(collate_pairs(next(), device_, pref_.whole_chosen()));
      mine[0] += static_cast<double>(micro.back().pairs);
      mine[1] += static_cast<double>(micro.back().chosen_tokens);
    }
    at::Tensor total = at::tensor({mine[0], mine[1]}, at::kDouble).to(device_);
    agree_.sum(total);
    total = total.cpu();
    const double pairs = std::max(total[0].item<double>(), 1.0), chosen = total[1].item<double>();
    for (size_t a = 0; a < micro.size(); ++a) {
      if (a + 1 == micro.size()) arm();
      const PairBatch& b = micro[a];
      sums.real += b.rows.real;
      sums.slots += b.rows.slots;
      if (b.pairs == 0) {
        pref_.skip(true);
        continue;
      }
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
  const PreferenceObjective* preference() const override { return &pref_; }

 private:
  const PreferenceObjective pref_;
  const Agreement& agree_;
  const c10::Device device_;
};

}  // namespace

Objective::~Objective() = default;

std::unique_ptr<Objective> make_objective(const recipe::Recipe& r, model::CausalLM& m,
                                          const std::vector<std::pair<std::string, at::Tensor>>& named,
                                          const Agreement& agree, c10::Device device) {
  if (r.train.objective == recipe::Objective::Sft) return std::make_unique<Sft>(r, m, device);
  return std::make_unique<Pairs>(r, m, named, agree, device);
}

}  // namespace lorarun::train
