// What adapters a job of many on one base (the recipe's adapters:) trains; train::run_training
// trains each exactly as its own run (recipe::adapter_recipe) would.
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

}  // namespace lorarun::train
