#include "support/runs.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/safetensors.hpp"

namespace lorarun::test {

void write_data(const std::string& path, int n, int from) {
  std::ofstream data(path);
  for (int i = from; i < from + n; ++i)
    data << nlohmann::json{{"instruction", fmt::format("Add {} and {}", i, 3 * i + 1)},
                           {"output", std::to_string(4 * i + 1)}}
                .dump()
         << "\n";
}

std::string write_recipe(const std::string& dir, const std::string& name, const std::string& train,
                         const std::string& lora, const std::string& data, const std::string& extra) {
  const std::string path = fmt::format("{}/{}.yaml", dir, name);
  std::ofstream(path) << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear{}}}
data: {{source: jsonl, path: {}/data.jsonl, format: instruction, prompt_template: "Q: {{instruction}}\nA: "{}}}
train: {{{}}}
checkpoint: {{output_dir: {}/{}}}
track: {{mongodb: false}}
{})",
                                     LORARUN_MODEL_FIXTURES, lora, dir, data, train, dir, name, extra);
  return path;
}

double adapter_diff(const std::string& a, const std::string& b) {
  const io::SafetensorsFile fa(a), fb(b);
  if (fa.tensors().size() != fb.tensors().size()) return INFINITY;
  double worst = 0;
  for (const auto& t : fa.tensors()) {
    const auto* u = fb.find(t.name);
    if (!u || u->nbytes != t.nbytes) return INFINITY;
    const auto x = fa.bytes(t), y = fb.bytes(*u);
    const auto* px = reinterpret_cast<const float*>(x.data());
    const auto* py = reinterpret_cast<const float*>(y.data());
    for (size_t i = 0; i < t.nbytes / 4; ++i) worst = std::max(worst, double(std::abs(px[i] - py[i])));
  }
  return worst;
}

Result interrupt(const std::string& cmd, const std::string& log, const std::string& marker, const std::string& act) {
  return sh(
      fmt::format("log='{}'; {} > \"$log\" 2>&1 & pid=$!; "
                  "for i in $(seq 1 1200); do grep -q '{}' \"$log\" && break; sleep 0.05; done; {}; "
                  "wait $pid; echo exit=$?",
                  log, cmd, marker, act));
}

}  // namespace lorarun::test
