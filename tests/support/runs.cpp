#include "support/runs.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <optional>

#include "io/safetensors.hpp"
#include "io/sha256.hpp"

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

namespace {

// max |a - b| over a's tensors, and max |a| (b empty: max |a| alone).
std::pair<double, double> compare(const std::string& a, const std::string& b) {
  const io::SafetensorsFile fa(a);
  const std::optional<io::SafetensorsFile> fb = b.empty() ? std::nullopt : std::optional<io::SafetensorsFile>(b);
  if (fb && fa.tensors().size() != fb->tensors().size()) return {INFINITY, 0};
  double worst = 0, largest = 0;
  for (const auto& t : fa.tensors()) {
    const auto x = fa.bytes(t);
    const auto* px = reinterpret_cast<const float*>(x.data());
    const auto* u = fb ? fb->find(t.name) : nullptr;
    if (fb && (!u || u->nbytes != t.nbytes)) return {INFINITY, 0};
    const auto y = fb ? fb->bytes(*u) : x;
    const auto* py = reinterpret_cast<const float*>(y.data());
    for (size_t i = 0; i < t.nbytes / 4; ++i) {
      worst = std::max(worst, double(std::abs(px[i] - py[i])));
      largest = std::max(largest, double(std::abs(px[i])));
    }
  }
  return {worst, largest};
}

}  // namespace

double adapter_relative_diff(const std::string& a, const std::string& b) {
  const auto [worst, largest] = compare(a, b);
  return worst / largest;
}

double adapter_diff(const std::string& a, const std::string& b) { return compare(a, b).first; }

double first_metric(const std::string& output_dir, const std::string& key) {
  std::ifstream in(output_dir + "/metrics.jsonl");
  std::string line;
  std::getline(in, line);
  INFO(output_dir << "/metrics.jsonl: " << line);
  return nlohmann::json::parse(line).at(key).get<double>();
}

std::map<std::string, std::string> hashes(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    if (e.is_regular_file())
      out[e.path().lexically_relative(dir).generic_string()] = io::sha256_file(e.path().string());
  return out;
}

std::string run_id_in(const std::string& output, const std::string& db) {
  const std::string marker = "run recorded as " + db + "/";
  const size_t at = output.find(marker);
  if (at == std::string::npos) FAIL("no 'run recorded as " << db << "/' in the output:\n" << output);
  return output.substr(at + marker.size(), 24);
}

Result interrupt(const std::string& cmd, const std::string& log, const std::string& marker, const std::string& act) {
  return sh(
      fmt::format("log='{}'; {} > \"$log\" 2>&1 & pid=$!; "
                  "for i in $(seq 1 1200); do grep -q '{}' \"$log\" && break; sleep 0.05; done; {}; "
                  "wait $pid; echo exit=$?",
                  log, cmd, marker, act));
}

Stopped sigterm_after(const std::string& cmd, const std::string& log, const std::string& marker, double pause) {
  const Result r = interrupt(cmd, log, marker,
                             fmt::format("sleep {}; t0=$(date +%s%N); kill -TERM $pid; wait $pid; echo rc=$?; "
                                         "echo ms=$(( ($(date +%s%N) - t0) / 1000000 ))",
                                         pause));
  INFO(r.output);
  const size_t rc = r.output.find("rc="), ms = r.output.find("ms=");
  REQUIRE(rc != std::string::npos);
  REQUIRE(ms != std::string::npos);
  return {std::stoi(r.output.substr(rc + 3)), std::stoi(r.output.substr(ms + 3))};
}

Result stop_and_resume(const std::string& cmd, const std::string& output_dir, const std::string& marker) {
  const std::string log = output_dir + ".log";
  const Result stopped = interrupt(cmd, log, marker, "kill -TERM $pid");
  INFO(read_file(log));
  CHECK_THAT(stopped.output, Catch::Contains("exit=75"));
  CHECK(std::filesystem::exists(output_dir + "/resume_state/state.json"));
  const Result resumed = sh(cmd);
  INFO(resumed.output);
  REQUIRE(resumed.status == 0);
  CHECK_THAT(resumed.output, Catch::Contains("resuming at epoch"));
  return resumed;
}

}  // namespace lorarun::test
