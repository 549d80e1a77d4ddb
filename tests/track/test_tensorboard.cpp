// TensorBoard event files (lib/track/tensorboard) read back by TensorBoard's own readers: tags,
// steps and float32 values exactly, the file name and version TensorBoard expects, a resumed run's
// earlier file cut back to its state's step; and the loss plot (lib/track/plot) on metrics rows written here.
#include <fmt/format.h>
#include <unistd.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>

#include "support/process.hpp"
#include "support/tensorboard.hpp"
#include "track/plot.hpp"
#include "track/tensorboard.hpp"
#include "util/error.hpp"

using namespace lorarun;
using namespace lorarun::test;
namespace fs = std::filesystem;

namespace {

using Series = std::map<std::string, std::vector<std::pair<int64_t, double>>>;

// What the reader saw, tag by tag: (step, value) in its order.
Series scalars_of(const nlohmann::json& read) {
  Series out;
  for (const auto& [tag, points] : read.at("scalars").items())
    for (const auto& p : points) out[tag].emplace_back(p.at(0).get<int64_t>(), p.at(1).get<double>());
  return out;
}

// Writes `steps` steps of two train tags and, every third step, an eval tag; returns what was
// written, as float32 values widened back to double (what TensorBoard stores and shows).
Series write_steps(track::TensorBoardWriter& w, int64_t first, int64_t last, double scale) {
  Series wrote;
  for (int64_t step = first; step <= last; ++step) {
    std::vector<track::Scalar> values{{"train/loss", scale * 3.0 / static_cast<double>(step) + 0.1},
                                      {"train/lr", 2e-4 * static_cast<double>(step) / 7.0}};
    if (step % 3 == 0) values.push_back({"eval/loss", -1e-30 * static_cast<double>(step) + 123456.789});
    w.scalars(step, values);
    for (const auto& v : values) wrote[v.tag].emplace_back(step, static_cast<double>(static_cast<float>(v.value)));
  }
  return wrote;
}

}  // namespace

TEST_CASE("CRC-32C and TFRecord's mask match the published check values") {
  CHECK(track::crc32c("") == 0u);
  CHECK(track::crc32c("123456789") == 0xE3069283u);            // the CRC-32C check value
  CHECK(track::crc32c(std::string(32, '\0')) == 0x8A9136AAu);  // RFC 3720 B.4: 32 bytes of zeros
  const uint32_t crc = track::crc32c("123456789");
  CHECK(track::masked_crc32c("123456789") == ((crc >> 15) | (crc << 17)) + 0xa282ead8u);
}

TEST_CASE("TensorBoard's reader reads our events file: tags, steps and float32 values exactly", "[reference]") {
  const std::string dir = temp_dir("tensorboard") + "/tb";
  Series wrote;
  std::string path;
  {
    track::TensorBoardWriter w(dir);
    path = w.path();
    wrote = write_steps(w, 1, 12, 1.0);
    w.scalars(13, {{"odd/values", 0.1}, {"odd/tiny", 1e-42}, {"odd/huge", 3.4e38}, {"odd/negative", -2.5}});
    wrote["odd/values"].emplace_back(13, static_cast<double>(0.1f));
    wrote["odd/tiny"].emplace_back(13, static_cast<double>(1e-42f));
    wrote["odd/huge"].emplace_back(13, static_cast<double>(3.4e38f));
    wrote["odd/negative"].emplace_back(13, -2.5);
  }
  // The name TensorBoard looks for: events.out.tfevents.<unix seconds>.<hostname>.<pid>.<n>.
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const std::string name = fs::path(path).filename().string();
  CHECK(std::regex_match(name,
                         std::regex(fmt::format(R"(events\.out\.tfevents\.\d{{10}}\.{}\.{}\.\d+)",
                                                std::regex_replace(host, std::regex(R"([.])"), R"(\.)"), getpid()))));

  const PythonRead read = read_tensorboard(dir);
  INFO(read.run.output << read.error);
  REQUIRE(read.run.status == 0);
  REQUIRE(read.data.is_object());
  CHECK(read.data.at("warnings").empty());
  const auto& files = read.data.at("files");
  REQUIRE(files.size() == 1);
  CHECK(files[0].at("name") == name);
  CHECK(files[0].at("file_version") == "brain.Event:2");
  CHECK(files[0].at("events") == 1 + 12 * 2 + 4 + 4);  // the version event, then one per scalar
  CHECK(files[0].at("last_step") == 13);
  const Series seen = scalars_of(read.data);
  CHECK(seen == wrote);  // exact: the same float32 values
  size_t n = 0;
  for (const auto& [tag, points] : seen) n += points.size();
  WARN(fmt::format("TensorBoard's EventAccumulator read {} scalars in {} tags, each equal to the float32 written", n,
                   seen.size()));
}

TEST_CASE("a resumed run: the earlier file keeps the steps of the state, a write cut short is dropped", "[reference]") {
  const std::string dir = temp_dir("tensorboard-resume") + "/tb";
  Series first, second;
  std::string path;
  {
    track::TensorBoardWriter w(dir);
    path = w.path();
    first = write_steps(w, 1, 9, 1.0);  // the process dies after step 9; its state is of step 6
  }
  std::ofstream(path, std::ios::app | std::ios::binary) << std::string("\x2a\0\0\0\0\0\0\0\x01\x02", 10);
  {
    track::TensorBoardWriter w(dir, 6);
    second = write_steps(w, 7, 12, 2.0);
  }
  const PythonRead read = read_tensorboard(dir);
  INFO(read.run.output << read.error);
  REQUIRE(read.data.is_object());
  CHECK(read.data.at("warnings").empty());
  const auto& files = read.data.at("files");
  REQUIRE(files.size() == 2);
  CHECK(files[0].at("name") == fs::path(path).filename().string());
  CHECK(files[0].at("last_step") == 6);
  CHECK(files[0].at("events") == 1 + 6 * 2 + 2);
  CHECK(files[1].at("last_step") == 12);
  // Steps 1-6 of the first process, 7-12 of the second: each step once.
  Series want;
  for (const Series* s : {&first, &second})
    for (const auto& [tag, points] : *s)
      for (const auto& p : points)
        if ((s == &first) == (p.first <= 6)) want[tag].push_back(p);
  CHECK(scalars_of(read.data) == want);

  // A fresh run in the same directory starts the events afresh, as metrics.jsonl does.
  {
    track::TensorBoardWriter w(dir);
  }
  const PythonRead again = read_tensorboard(dir);
  REQUIRE(again.data.is_object());
  CHECK(again.data.at("files").size() == 1);
  CHECK(again.data.at("scalars").empty());
}

TEST_CASE("a TensorBoard directory that cannot be made is one line naming the fix") {
  CHECK_THROWS_WITH(track::TensorBoardWriter("/dev/null/tb"),
                    Catch::StartsWith("cannot create the TensorBoard directory /dev/null/tb: ") &&
                        Catch::EndsWith("make checkpoint.output_dir writable or set track.tensorboard: false"));
}

TEST_CASE("the loss plot: a line of every train row, a marker per evaluation, well-formed SVG", "[reference]") {
  const std::string dir = temp_dir("plot");
  {
    std::ofstream m(dir + "/metrics.jsonl");
    for (int step = 1; step <= 20; ++step) {
      m << nlohmann::json{{"epoch", 0}, {"step", step}, {"loss", 4.0 / (1 + 0.1 * step)}, {"lr", 1e-3}}.dump() << "\n";
      if (step % 5 == 0)
        m << nlohmann::json{{"epoch", 0}, {"step", step}, {"eval_loss", 5.0 / (1 + 0.1 * step)}}.dump() << "\n";
    }
    m << R"({"epoch": 0, "step": 21, "lo)";  // a row being written: left out
  }
  const track::LossCurves c = track::read_loss_curves(dir + "/metrics.jsonl");
  CHECK(c.train.size() == 20);
  CHECK(c.eval.size() == 4);
  const std::string path = track::plot_loss(dir);
  CHECK(path == dir + "/loss.svg");
  const PythonRead svg = check_svg(path);
  INFO(svg.run.output << svg.error);
  REQUIRE(svg.data.is_object());
  CHECK(svg.data.at("root") == "svg");
  CHECK(svg.data.at("title") == fmt::format("{}: loss by optimizer step", fs::path(dir).filename().string()));
  REQUIRE(svg.data.at("polylines").size() == 1);
  CHECK(svg.data.at("polylines")[0].at("class") == "train-loss");
  CHECK(svg.data.at("polylines")[0].at("points") == 20);
  CHECK(svg.data.at("circles").at("eval-loss") == 4);
  const std::vector<std::string> texts = svg.data.at("texts");
  for (const char* label : {"train loss", "eval loss", "optimizer step", "loss", "0", "20"})
    CHECK(std::find(texts.begin(), texts.end(), label) != texts.end());

  // A loss that falls over more than a decade (the quickstart's 4.8 to 0.0009), with an evaluation
  // before the first step: a logarithmic axis over whole decades, the step-0 marker drawn.
  fs::create_directories(dir + "/log");
  {
    std::ofstream m(dir + "/log/metrics.jsonl");
    m << nlohmann::json{{"epoch", 0}, {"step", 0}, {"eval_loss", 4.8}}.dump() << "\n";
    for (int step = 1; step <= 60; ++step)
      m << nlohmann::json{{"epoch", 0}, {"step", step}, {"loss", 4.8 * std::pow(0.85, step)}}.dump() << "\n";
  }
  const PythonRead log = check_svg(track::plot_loss(dir + "/log"));
  INFO(log.run.output << log.error);
  REQUIRE(log.data.is_object());
  const std::vector<std::string> log_texts = log.data.at("texts");
  for (const char* label : {"loss (log scale)", "0.0001", "0.001", "0.01", "0.1", "1", "10", "0"})
    CHECK(std::find(log_texts.begin(), log_texts.end(), label) != log_texts.end());
  CHECK(std::find(log_texts.begin(), log_texts.end(), "loss") == log_texts.end());
  CHECK(log.data.at("circles").at("eval-loss") == 1);

  // A bad line in the middle, no loss row, no file: one line each, naming the fix.
  fs::create_directories(dir + "/bad");
  std::ofstream(dir + "/bad/metrics.jsonl") << "{\"step\": 1, \"loss\": 2}\nnot json\n";
  CHECK_THROWS_WITH(track::plot_loss(dir + "/bad"), dir +
                                                        "/bad/metrics.jsonl:2: not a JSON object; fix or remove "
                                                        "that line");
  std::ofstream(dir + "/bad/metrics.jsonl") << "{\"step\": 5, \"eval_loss\": 2}\n";
  CHECK_THROWS_WITH(track::plot_loss(dir + "/bad"), dir +
                                                        "/bad/metrics.jsonl holds no training loss row: plot a "
                                                        "run once it has logged a step");
  CHECK_THROWS_WITH(track::plot_loss(dir + "/none"), dir +
                                                         "/none/metrics.jsonl does not exist: give the "
                                                         "checkpoint.output_dir of a run that has started");

  // Another figure (GRPO's), its eval_ twin as markers, written next to the run as <metric>.svg.
  fs::create_directories(dir + "/reward");
  {
    std::ofstream m(dir + "/reward/metrics.jsonl");
    for (int step = 1; step <= 10; ++step)
      m << nlohmann::json{{"step", step}, {"loss", 0.01}, {"rewards/sum/mean", 0.05 * step}}.dump() << "\n";
    m << nlohmann::json{{"step", 10}, {"eval_rewards/sum/mean", 0.6}}.dump() << "\n";
  }
  const std::string reward_svg = track::plot_loss(dir + "/reward", "", "rewards/sum/mean");
  CHECK(reward_svg == dir + "/reward/rewards_sum_mean.svg");
  const PythonRead reward = check_svg(reward_svg);
  INFO(reward.run.output << reward.error);
  REQUIRE(reward.data.is_object());
  const std::vector<std::string> reward_texts = reward.data.at("texts");
  for (const char* label : {"rewards/sum/mean (log scale)", "train rewards/sum/mean", "eval rewards/sum/mean"})
    CHECK(std::find(reward_texts.begin(), reward_texts.end(), label) != reward_texts.end());
  CHECK(reward.data.at("circles").at("eval-loss") == 1);
  CHECK_THROWS_WITH(track::plot_loss(dir + "/reward", "", "reward"), Catch::Contains("holds no training reward row"));
}
