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
