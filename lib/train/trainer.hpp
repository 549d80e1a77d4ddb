// The training loop of one rank: data shard -> forward -> loss -> backward -> all-reduce ->
// clip -> AdamW -> schedule, with epoch checkpoints per the recipe's policy.
#pragma once
#include "dist/env.hpp"
#include "recipe/recipe.hpp"

namespace lorarun::train {

// Trains the recipe on this rank. Every rank runs the same number of optimizer steps; a rank
// that cannot go on throws lorarun::Error and the others stop at their next collective.
void run_training(const recipe::Recipe& r, const dist::DistEnv& env);

}  // namespace lorarun::train
