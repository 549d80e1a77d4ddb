// What TensorBoard's own readers see in an events directory (tests/track/read_tensorboard.py), and
// the structure of an SVG as Python's xml.etree parses it (tests/track/check_svg.py).
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

// check_svg.py on `path`: {"root", "title", "texts", "polylines": [{class, points}], "circles"}.
PythonRead check_svg(const std::string& path);

}  // namespace lorarun::test
