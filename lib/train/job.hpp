// A job of many adapters on one base (the recipe's adapters:): each adapter trains exactly as its
// own run (recipe::adapter_recipe) would, and one forward and backward pass per micro-batch serves
// all of them, so the frozen base is held and read once.
#pragma once
#include <string>
#include <vector>

#include "dist/env.hpp"
#include "recipe/recipe.hpp"

namespace lorarun::train {

// The job's adapters, in slot order: adapters.list as written, or with adapters.per one for each
// distinct value of that field in data's selection (sorted by name; list entries add their own
// keys). Throws lorarun::Error for a value that cannot name a directory, more values than
// adapters.max, none at all, or a list entry naming no value found.
std::vector<recipe::AdapterSpec> job_adapters(const recipe::Recipe& r);

// The recipe of `file` as a tool reading one selection sees it (lora-data, lora-eval --recipe): a
// job's narrowed to its adapter `name` (adapter_recipe), else `r` itself. Throws lorarun::Error for
// a job without `name`, a name the job does not train, or a name given for a recipe of one adapter.
recipe::Recipe one_adapter(const recipe::Recipe& r, const std::string& name, const std::string& file);

// Trains the job on this rank, for run_training (which holds the output directory and reports the
// errors; the exit statuses are a single run's): <output_dir>/<name>/ holds each adapter's epochs,
// best/ and resumable state; <output_dir> the job's metrics, logs and run.json.
int run_job(const recipe::Recipe& r, const dist::DistEnv& env);

}  // namespace lorarun::train
