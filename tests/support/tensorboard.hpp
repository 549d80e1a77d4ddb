// What TensorBoard's own readers see in an events directory (tests/track/read_tensorboard.py).
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "support/process.hpp"

namespace lorarun::test {

// A Python script's run and the JSON object it printed on stdout (null when it printed none).
struct PythonRead {
  Result run;         // exit status and stdout, for INFO
  std::string error;  // its stderr
  nlohmann::json data;
};

// read_tensorboard.py on `dir`: {"scalars": {tag: [[step, value], …]}, "files": [{name,
// file_version, events, last_step}], "warnings": […]}.
PythonRead read_tensorboard(const std::string& dir);

}  // namespace lorarun::test
