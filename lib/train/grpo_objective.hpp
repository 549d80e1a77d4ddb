// train.objective: grpo, as TRL 1.16's GRPOTrainer trains: each prompt's grpo.num_generations
// completions sampled from the model being trained (adapters on, no second copy of the base), scored by
// the recipe's grpo.rewards against the prompt's document, advantaged within their group over the
// whole step (every rank's prompts), and the clipped policy loss of grpo_loss on them.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "data/document.hpp"
#include "recipe/recipe.hpp"
#include "train/objective.hpp"

namespace lorarun::train {

std::unique_ptr<Objective> make_grpo(const recipe::Recipe& r, model::CausalLM& m,
                                     const std::vector<std::pair<std::string, at::Tensor>>& named,
                                     const Agreement& agree, c10::Device device, const tok::Tokenizer& tokenizer);

// grpo.rewards as one check of a document: why a completion of its prompt could not be scored (a
// field a reward reads is missing or of the wrong type), or "". Throws ConfigError for rewards that
// do not hold together.
std::function<std::string(const data::Document&)> reward_check(const recipe::Recipe& r);

}  // namespace lorarun::train
