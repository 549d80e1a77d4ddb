// What a Python oracle reports (tests/support/oracle.py): the lines it marks, never the rest of its
// output, where transformers, PEFT and bitsandbytes print warnings and progress bars.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/process.hpp"

namespace lorarun::test {

struct Oracle {
  Result run;                                        // exit status and the whole output, for INFO
  nlohmann::json fields = nlohmann::json::object();  // every report's fields, later ones overriding
  std::vector<std::string> warnings;                 // what it could not check here, and why (oracle.warn)
};

// The marked lines of `output` (oracle.MARK, anywhere in a line: a progress bar may still be open).
Oracle reported(Result run);

// Runs `cmd` with sh (see sh()), reads what it reported, and shows each warning as a Catch2 WARN,
// so that a check the oracle skipped is never silent.
Oracle oracle(const std::string& cmd);

}  // namespace lorarun::test
