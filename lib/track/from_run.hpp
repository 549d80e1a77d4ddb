// lora-train --from-run: a recorded run's recipe, rebuilt with new overrides.
#pragma once
#include <chrono>
#include <string>
#include <vector>

#include "recipe/recipe.hpp"

namespace lorarun::track {

struct RunRef {
  std::string database, id;
};

// "<database>/<hexid>" as lora-train prints it, or a bare id with `runs_db` (--runs-db). Throws
// lorarun::Error saying which form is expected.
RunRef parse_run_ref(const std::string& text, const std::string& runs_db = {});

// The stored recipe of run `ref` at `uri`, through recipe_from_json with `overrides`. The stored
// data.uri has its password redacted; then `uri` (which has it) reads the data instead, with a
// warning in the recipe's warnings when the two name different hosts.
recipe::Recipe recipe_from_run(const std::string& ref, const std::string& runs_db, const std::string& uri,
                               const std::vector<std::string>& overrides, std::chrono::milliseconds timeout);

}  // namespace lorarun::track
