// How an objective with figures of its own evaluates held-out documents (the preference losses on
// pairs, GRPO's rewards of greedy completions): each batch's sums, which the ranks add, and the
// evaluation row's figures from them.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <utility>
#include <vector>

#include "data/example.hpp"

namespace lorarun::train {

class Evaluation {
 public:
  virtual ~Evaluation() = default;
  // How many sums a batch gives.
  virtual int64_t stats() const = 0;
  // One evaluation batch's sums (float64 [stats()] on the host; undefined for a batch of none, whose
  // passes are skipped) and what it scored (tokens; GRPO: completions).
  virtual std::pair<at::Tensor, int64_t> evaluate(const std::vector<data::Example>& batch,
                                                  c10::Device device) const = 0;
  // The eval_loss of summed sums: what best/ and early stopping lower (GRPO: minus the mean reward).
  virtual double loss_of(const double* stats) const = 0;
  // Its figures of summed sums, each name after `prefix`.
  virtual nlohmann::json figures(const double* stats, const std::string& prefix) const = 0;
  // Whether exp(eval_loss) means something (a mean token loss): the row's eval_ppl.
  virtual bool perplexity() const { return true; }
};

}  // namespace lorarun::train
