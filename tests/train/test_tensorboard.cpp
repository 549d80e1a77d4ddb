// track.tensorboard end to end: a run on 2 ranks with an evaluation split writes one events file
// (rank 0) that TensorBoard's own reader reads as metrics.jsonl says, step by step and float32 for
// float32; kill -9 and resume leave every step once; lora-data plot draws the run.
#include <fmt/format.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>

#include "support/runs.hpp"
#include "support/tensorboard.hpp"

using namespace lorarun::test;
namespace fs = std::filesystem;

namespace {

using Series = std::map<std::string, std::vector<std::pair<int64_t, double>>>;

// The TensorBoard tag of each metrics.jsonl key the trainer sends there.
const std::map<std::string, std::string> kTags{{"loss", "train/loss"},           {"lr", "train/lr"},
                                               {"grad_norm", "train/grad_norm"}, {"tokens_per_s", "train/tokens_per_s"},
                                               {"eval_loss", "eval/loss"},       {"eval_ppl", "eval/ppl"}};

// What TensorBoard should show for a metrics.jsonl: each key's (step, value) under its tag, the
// value as float32 (TensorBoard's simple_value) widened back to double.
Series expected(const std::string& metrics_path, Series& exact) {
  Series want;
  std::ifstream in(metrics_path);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json row = nlohmann::json::parse(line);
    for (const auto& [key, tag] : kTags) {
      if (!row.contains(key)) continue;
      const double v = row.at(key).get<double>();
      want[tag].emplace_back(row.at("step").get<int64_t>(), static_cast<double>(static_cast<float>(v)));
      exact[tag].emplace_back(row.at("step").get<int64_t>(), v);
    }
  }
  return want;
}

// What the reader saw, tag by tag.
Series seen(const nlohmann::json& read) {
  Series out;
  for (const auto& [tag, points] : read.at("scalars").items())
    for (const auto& p : points) out[tag].emplace_back(p.at(0).get<int64_t>(), p.at(1).get<double>());
  return out;
}

// The largest |TensorBoard's value - metrics.jsonl's| over all scalars, and that relative to the value.
std::pair<double, double> worst_difference(const Series& got, const Series& exact) {
  double abs = 0, rel = 0;
  for (const auto& [tag, points] : exact) {
    const auto it = got.find(tag);
    if (it == got.end() || it->second.size() != points.size()) continue;
    for (size_t i = 0; i < points.size(); ++i) {
      const double d = std::abs(it->second[i].second - points[i].second);
      abs = std::max(abs, d);
      rel = std::max(rel, d / std::max(1e-300, std::abs(points[i].second)));
    }
  }
  return {abs, rel};
}

size_t count(const Series& s) {
  size_t n = 0;
  for (const auto& [tag, points] : s) n += points.size();
  return n;
}

}  // namespace

TEST_CASE(
    "track.tensorboard: TensorBoard reads the train and eval scalars of metrics.jsonl, and lora-data plot "
    "draws them",
    "[e2e][reference][lora-data]") {
  const std::string dir = temp_dir("tensorboard-run");
  write_data(dir + "/data.jsonl", 24);
  const std::string recipe = write_recipe(dir, "run", "epochs: 2, lr: 1.0e-3", "", ", batch_size: 2",
                                          "eval: {fraction: 0.25, every_n_steps: 2}\n");
  const Result run = sh(fmt::format("{} --nproc-per-node 2 {} track.tensorboard=true", bin("lorarun"), recipe));
  INFO(run.output);
  REQUIRE(run.status == 0);
  CHECK_THAT(run.output, Catch::Contains(fmt::format("TensorBoard events in {}/run/tensorboard/", dir)));

  Series exact;
  const Series want = expected(dir + "/run/metrics.jsonl", exact);
  const size_t steps = want.at("train/loss").size();
  REQUIRE(steps >= 4);
  REQUIRE(want.count("eval/loss") == 1);
  for (size_t i = 0; i < steps; ++i) CHECK(want.at("train/loss")[i].first == static_cast<int64_t>(i + 1));

  const PythonRead read = read_tensorboard(dir + "/run/tensorboard");
  INFO(read.run.output << read.error);
  REQUIRE(read.run.status == 0);
  REQUIRE(read.data.is_object());
  CHECK(read.data.at("warnings").empty());
  // One file (rank 0 alone writes), the version TensorBoard expects, an event per scalar.
  const auto& files = read.data.at("files");
  REQUIRE(files.size() == 1);
  CHECK(files[0].at("file_version") == "brain.Event:2");
  CHECK(files[0].at("events").get<size_t>() == 1 + count(want));
  // Every tag at every step metrics.jsonl has it, equal as float32: train at each step, eval at each evaluation.
  const Series got = seen(read.data);
  CHECK(got == want);
  const auto [abs, rel] = worst_difference(got, exact);
  WARN(fmt::format(
      "TensorBoard's reader saw {} scalars ({} steps x 4 train tags, {} evaluations x 2 eval tags), each the "
      "float32 of metrics.jsonl's value; largest difference to metrics.jsonl's double {:.3g} ({:.3g} relative)",
      count(got), steps, want.at("eval/loss").size(), abs, rel));
  CHECK(rel <= 6e-8);  // float32 rounding: half an ulp

  // lora-data plot: the SVG of the run, a polyline point per train row and a marker per evaluation.
  const Result plot = sh(fmt::format("{} plot {}/run", bin("lora-data"), dir));
  INFO(plot.output);
  REQUIRE(plot.status == 0);
  CHECK(plot.output == dir + "/run/loss.svg\n");
  const PythonRead svg = check_svg(dir + "/run/loss.svg");
  INFO(svg.run.output << svg.error);
  REQUIRE(svg.data.is_object());
  CHECK(svg.data.at("root") == "svg");
  CHECK(svg.data.at("title") == "run: loss by optimizer step");
  REQUIRE(svg.data.at("polylines").size() == 1);
  CHECK(svg.data.at("polylines")[0].at("points").get<size_t>() == steps);
  CHECK(svg.data.at("circles").at("eval-loss").get<size_t>() == want.at("eval/loss").size());
  const Result other = sh(fmt::format("{} plot {}/run --out {}/other.svg", bin("lora-data"), dir, dir));
  CHECK(other.output == dir + "/other.svg\n");
  CHECK(fs::exists(dir + "/other.svg"));

  // No metrics file: one line, non-zero exit.
  const Result missing = sh(fmt::format("{} plot {}/nothing", bin("lora-data"), dir));
  CHECK(missing.status != 0);
  CHECK(count_lines(missing.output) == 1);
  CHECK_THAT(missing.output, Catch::Contains(fmt::format("{}/nothing/metrics.jsonl does not exist", dir)));
}

TEST_CASE("track.tensorboard after kill -9 and resume: TensorBoard shows every step once, as metrics.jsonl",
          "[e2e][reference][resume]") {
  const std::string dir = temp_dir("tensorboard-resume");
  write_data(dir + "/data.jsonl", 60);
  const std::string recipe = write_recipe(dir, "cut", "epochs: 1, lr: 1.0e-3", "", ", batch_size: 1");
  const std::string cmd =
      fmt::format("{} {} track.tensorboard=true checkpoint.state_every_n_steps=5", bin("lora-train"), recipe);
  const Result b = interrupt(cmd, dir + "/cut.log", "step 7/60", "kill -9 $pid");
  INFO(read_file(dir + "/cut.log"));
  CHECK_THAT(b.output, Catch::Contains("exit=137"));
  REQUIRE(fs::exists(dir + "/cut/resume_state/state.json"));
  const PythonRead killed = read_tensorboard(dir + "/cut/tensorboard");
  REQUIRE(killed.data.is_object());
  REQUIRE(killed.data.at("files").size() == 1);
  const int64_t logged = killed.data.at("files")[0].at("last_step");
  const Result c = sh(cmd);
  INFO(c.output);
  REQUIRE(c.status == 0);
  std::smatch m;
  REQUIRE(std::regex_search(c.output, m, std::regex(R"(resuming at epoch 0 step (\d+))")));
  const int64_t resumed = std::stoll(m[1]);

  Series exact;
  const Series want = expected(dir + "/cut/metrics.jsonl", exact);
  REQUIRE(want.at("train/loss").size() == 60);
  const PythonRead read = read_tensorboard(dir + "/cut/tensorboard");
  INFO(read.run.output << read.error);
  REQUIRE(read.data.is_object());
  CHECK(read.data.at("warnings").empty());
  const auto& files = read.data.at("files");
  REQUIRE(files.size() == 2);
  CHECK(logged >= resumed);
  CHECK(files[0].at("last_step") == resumed);
  CHECK(seen(read.data) == want);
  WARN(
      fmt::format("killed after step {}, resumed after step {}: the first events file was cut back to step {}, "
                  "TensorBoard shows each of the 60 steps once",
                  logged, resumed, resumed));
}
