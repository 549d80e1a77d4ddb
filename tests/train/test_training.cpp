// lorarun + lora-train end to end on 2 CPU ranks (Gloo): JSONL data, epoch checkpoint policy.
#include <fmt/format.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "support/oracle.hpp"

using namespace lorarun::test;
namespace fs = std::filesystem;

TEST_CASE("2 ranks train from JSONL and keep exactly the epochs asked for", "[e2e][reference]") {
  const std::string dir = temp_dir("train");
  {
    std::ofstream data(dir + "/data.jsonl");
    for (int i = 0; i < 37; ++i)
      data << nlohmann::json{{"instruction", fmt::format("Add {} and {}", i, i + 1)},
                             {"output", std::to_string(2 * i + 1)}}
                  .dump()
           << "\n";
  }
  std::ofstream(dir + "/r.yaml") << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
data: {{source: jsonl, path: {}/data.jsonl, format: instruction, prompt_template: "Q: {{instruction}}\nA: ", batch_size: 4}}
train: {{epochs: 4, lr: 1.0e-3, warmup_steps: 2}}
checkpoint: {{output_dir: {}/out, epochs_to_save: [1, 3]}}
track: {{mongodb: false}}
)",
                                                LORARUN_MODEL_FIXTURES, dir, dir);
  fs::create_directories(dir + "/out/epoch_0");  // left by an interrupted earlier run: must go
  const Result r = sh(fmt::format("{} --nproc-per-node 2 {}/r.yaml", bin("lorarun"), dir));
  INFO(r.output);
  REQUIRE(r.status == 0);
  std::vector<std::string> epochs;
  for (const auto& e : fs::directory_iterator(dir + "/out"))
    if (e.path().filename().string().rfind("epoch_", 0) == 0) epochs.push_back(e.path().filename().string());
  std::sort(epochs.begin(), epochs.end());
  CHECK(epochs == std::vector<std::string>{"epoch_1", "epoch_3"});
  CHECK(fs::exists(dir + "/out/epoch_3/adapter_model.safetensors"));
  CHECK(fs::exists(dir + "/out/recipe.yaml"));
  // 37 documents, 2 ranks, batch 4: ceil(19 / 4) = 5 steps per epoch, 20 in all.
  CHECK_THAT(r.output, Catch::Contains("done: 20 steps"));
  // PEFT loads what we saved (no expected logits: just that it loads, with a LoRA layer on each of
  // the 7 linears of the fixture's 2 decoder layers).
  const Oracle peft = oracle(fmt::format("'{}' '{}/tests/reference/probe.py' peft-load {}/llama {}/out/epoch_3",
                                         LORARUN_PYTHON, LORARUN_SOURCE_DIR, LORARUN_MODEL_FIXTURES, dir));
  INFO(peft.run.output);
  CHECK(peft.run.status == 0);
  CHECK(peft.fields.value("lora_modules", 0) == 2 * 7);
}

TEST_CASE("train.profile_steps: every rank writes a Chrome trace of the steps asked for, and trains as without it",
          "[e2e]") {
  const std::string dir = temp_dir("profile");
  {
    std::ofstream data(dir + "/data.jsonl");
    for (int i = 0; i < 37; ++i)
      data << nlohmann::json{{"text", fmt::format("{} plus {} is {}", i, i + 1, 2 * i + 1)}}.dump() << "\n";
  }
  const auto run = [&](const std::string& out, const std::string& extra) {
    std::ofstream(dir + "/r.yaml") << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
data: {{source: jsonl, path: {}/data.jsonl, format: text, batch_size: 4}}
train: {{epochs: 1, lr: 1.0e-3}}
checkpoint: {{output_dir: {}/{}}}
track: {{mongodb: false}}
)",
                                                  LORARUN_MODEL_FIXTURES, dir, dir, out);
    return sh(fmt::format("{} --nproc-per-node 2 {}/r.yaml {}", bin("lorarun"), dir, extra));
  };
  // 37 documents, 2 ranks, batch 4: 5 steps; the first two warm up, then 2 are traced
  const Result traced = run("traced", "train.profile_steps=2");
  INFO(traced.output);
  REQUIRE(traced.status == 0);
  CHECK_THAT(traced.output, Catch::Contains("profiled 2 steps (after 2) into"));
  for (int rank : {0, 1}) {
    const std::string path = fmt::format("{}/traced/profile/rank_{}.json", dir, rank);
    REQUIRE(fs::exists(path));
    const nlohmann::json trace = nlohmann::json::parse(read_file(path));
    int steps = 0, gemms = 0, with_shapes = 0;
    for (const nlohmann::json& e : trace.at("traceEvents")) {
      const std::string name = e.value("name", "");
      if (e.value("cat", "") == "user_annotation" && name == "optimizer") ++steps;
      if (e.value("cat", "") == "cpu_op" && name == "aten::mm") {
        ++gemms;
        with_shapes += e.contains("args") && e["args"].contains("Input Dims");
      }
    }
    CHECK(steps == 2);  // one optimizer step in each traced step, no more
    CHECK(gemms > 0);
    CHECK(with_shapes == gemms);
  }
  const Result plain = run("plain", "");
  INFO(plain.output);
  REQUIRE(plain.status == 0);
  CHECK_FALSE(fs::exists(dir + "/plain/profile"));
  CHECK(read_file(dir + "/traced/epoch_0/adapter_model.safetensors") ==
        read_file(dir + "/plain/epoch_0/adapter_model.safetensors"));

  // more steps asked for than the run has: what was recorded, said so
  const Result short_run = run("short", "train.profile_steps=9");
  INFO(short_run.output);
  REQUIRE(short_run.status == 0);
  CHECK_THAT(short_run.output, Catch::Contains("profiled 3 steps (after 2)"));
  CHECK_THAT(short_run.output, Catch::Contains("the run ended before train.profile_steps 9"));
  CHECK(fs::exists(dir + "/short/profile/rank_1.json"));
}
