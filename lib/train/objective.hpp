// What train.objective makes of an adapter's step: its micro-batches through the model and back,
// the figures of its own the ranks sum, and the step's loss. The step asks it, whatever the
// objective: SFT's token cross-entropy, the preference losses of DPO, ORPO, CPO, SimPO and KTO
// (PreferenceObjective), and GRPO's policy loss on completions it samples (grpo_objective).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/example.hpp"
#include "recipe/recipe.hpp"

namespace lorarun::model {
class CausalLM;
}
namespace lorarun::tok {
class Tokenizer;
}

namespace lorarun::train {

class Agreement;
class Evaluation;

class Objective {
 public:
  virtual ~Objective();

  // What this rank's micro-batches of one step added up to, before the ranks sum them.
  struct Sums {
    at::Tensor loss;     // float32 scalar on the device: the summed losses (normalised(): already a mean)
    int64_t tokens = 0;  // trained tokens
    int64_t real = 0;    // document tokens
    int64_t slots = 0;   // row slots (padding included)
    at::Tensor stats;    // float64 [stats()] on the device: its own figures (undefined when it has none)
  };
  // The examples of the adapter's next micro-batch.
  using Next = std::function<std::vector<data::Example>()>;
  // Where a step stands: the adapter's optimizer steps done before it (what GRPO's sampling is seeded
  // by), in all and in its epoch.
  struct StepAt {
    int64_t step = 0, in_epoch = 0;
  };

  // The step's `accum` micro-batches from `next`, forward and backward: the gradients accumulate in
  // .grad; `arm` is called before the last micro-batch's backward (which sums them over ranks). GRPO
  // with grpo.num_iterations μ reads them every μ-th step of an epoch and trains on them μ steps.
  virtual Sums forward_backward(const Next& next, int accum, const std::function<void()>& arm, StepAt at) = 0;
  // Whether forward_backward divided the loss and the gradients by the step's totals over every
  // rank already (pairs); else the step divides them by the global count of trained tokens.
  virtual bool normalised() const { return false; }
  // How many figures of its own Sums::stats holds, and what the metrics row calls them once summed
  // over the ranks (TRL's names).
  virtual int64_t stats() const { return 0; }
  virtual nlohmann::json figures(const double* /*stats*/) const { return nlohmann::json::object(); }
  // How it evaluates held-out documents (nullptr: the token cross-entropy).
  virtual const Evaluation* evaluation() const { return nullptr; }

  // preference.precompute_reference (dpo, kto): whether it has no reference log-probs yet. Then
  // reference() takes each micro-batch of an epoch in turn, every rank its own (the same passes on
  // each: a micro-batch of none skips them), and reference_done() gathers every rank's on each.
  virtual bool wants_reference() const { return false; }
  virtual void reference(const std::vector<data::Example>& /*micro*/) {}
  virtual int64_t reference_done() { return 0; }  // the examples it holds the log-probs of
  // What it keeps in the resumable state (precomputed reference log-probs, GRPO's rollout that later
  // steps train on again), in the state's directory `dir`, naming the data (its identity) they were
  // computed from. load_files: "" when read, else why not (they are then computed again).
  virtual bool keeps_state() const { return false; }
  virtual void save_files(const std::string& /*dir*/, const nlohmann::json& /*data*/) const {}
  virtual std::string load_files(const std::string& /*dir*/, const nlohmann::json& /*data*/) { return ""; }
};

// The recipe's train.objective on `m`, training the tensors `named` (PEFT's names: DPO's reference
// reads lora.init_from's values from them), its batches on `device`; `agree` sums a step's pairs
// over the ranks; `tokenizer` turns GRPO's completions into the text its rewards read.
std::unique_ptr<Objective> make_objective(const recipe::Recipe& r, model::CausalLM& m,
                                          const std::vector<std::pair<std::string, at::Tensor>>& named,
                                          const Agreement& agree, c10::Device device, const tok::Tokenizer& tokenizer);

}  // namespace lorarun::train
