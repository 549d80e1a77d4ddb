#include "support/tensorboard.hpp"

#include <fmt/format.h>

namespace lorarun::test {
namespace {

// Runs tests/track/`script` on `arg` with stderr kept apart (in `arg`.stderr), so that stdout is
// the JSON object alone.
PythonRead run_script(const std::string& script, const std::string& arg) {
  PythonRead r;
  const std::string err = arg + ".stderr";
  r.run =
      sh(fmt::format("('{}' '{}/tests/track/{}' '{}' 2>'{}')", LORARUN_PYTHON, LORARUN_SOURCE_DIR, script, arg, err));
  r.error = read_file(err);
  r.data = nlohmann::json::parse(r.run.output, nullptr, false);
  if (r.data.is_discarded()) r.data = nullptr;
  return r;
}

}  // namespace

PythonRead read_tensorboard(const std::string& dir) { return run_script("read_tensorboard.py", dir); }

PythonRead check_svg(const std::string& path) { return run_script("check_svg.py", path); }

}  // namespace lorarun::test
