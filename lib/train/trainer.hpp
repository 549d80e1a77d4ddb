// The training loop of one rank, over the adapters it trains (the recipe's one, or a job's many
// on one base, each as its own run): data shard -> forward -> the objective's loss -> backward ->
// all-reduce -> clip -> AdamW -> schedule, with epoch checkpoints per the recipe's policy and a
// resumable state (at each epoch end, every checkpoint.state_every_n_steps, and on SIGTERM/SIGINT).
#pragma once
#include "dist/env.hpp"
#include "recipe/recipe.hpp"

namespace lorarun::train {

// lora-train's exit status after SIGTERM/SIGINT: the ranks finished their step, saved the
// resumable state and stopped; running the same command again resumes (EX_TEMPFAIL).
inline constexpr int kExitStopped = 75;

// Trains the recipe on this rank; returns 0 when done, kExitStopped when stopped on request.
// Every rank runs the same number of optimizer steps; a rank that cannot go on throws
// lorarun::Error and the others stop at their next collective.
int run_training(const recipe::Recipe& r, const dist::DistEnv& env);

}  // namespace lorarun::train
