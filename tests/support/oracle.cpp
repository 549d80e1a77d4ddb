#include "support/oracle.hpp"

#include <catch2/catch.hpp>
#include <sstream>

namespace lorarun::test {

namespace {
const std::string kMark = "@lorarun-oracle ";  // tests/support/oracle.py's MARK
}

Oracle reported(Result run) {
  Oracle o;
  std::istringstream in(run.output);
  for (std::string line; std::getline(in, line);) {
    const size_t at = line.find(kMark);
    if (at == std::string::npos) continue;
    const auto fields = nlohmann::json::parse(line.substr(at + kMark.size()));
    for (const auto& [key, value] : fields.items()) {
      if (key == "warning")
        o.warnings.push_back(value.get<std::string>());
      else
        o.fields[key] = value;
    }
  }
  o.run = std::move(run);
  return o;
}

Oracle oracle(const std::string& cmd) {
  Oracle o = reported(sh(cmd));
  for (const std::string& w : o.warnings) WARN("reference not checked: " << w);
  return o;
}

}  // namespace lorarun::test
