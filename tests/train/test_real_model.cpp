// The real pretrained model: SmolLM2-135M-Instruct from its Q4_1 GGUF (scripts/fetch-models),
// trained by lorarun on 2 ranks step by step against transformers + PEFT on the same file, its
// adapter loaded by PEFT for greedy generation, and trained in bf16 and on its own Q4_1 blocks.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/oracle.hpp"
#include "support/runs.hpp"

using namespace lorarun::test;

namespace {

const std::string kSmolLM2 =
    std::string(LORARUN_SOURCE_DIR) + "/.fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

std::vector<double> losses(const std::string& metrics_jsonl) {
  std::vector<double> out;
  std::ifstream in(metrics_jsonl);
  for (std::string line; std::getline(in, line);) out.push_back(nlohmann::json::parse(line).at("loss").get<double>());
  return out;
}

// lorarun on 2 ranks over DIR/data.jsonl (20 documents, 2 a rank a step: 5 steps) into DIR/NAME.
Result train(const std::string& dir, const std::string& name, const std::string& overrides) {
  const std::string recipe = write_recipe(dir, name, "epochs: 1, lr: 1.0e-3, warmup_steps: 2, lr_scheduler: cosine", "",
                                          ", shuffle: none, batch_size: 2");
  return sh(fmt::format("{} --nproc-per-node 2 {} model.path={} {}", bin("lorarun"), recipe, kSmolLM2, overrides));
}

}  // namespace

TEST_CASE("SmolLM2 from its GGUF trains as transformers + PEFT do, and PEFT generates our adapter's ids",
          "[e2e][reference][gguf]") {
  if (!std::filesystem::exists(kSmolLM2)) FAIL(kSmolLM2 << " is missing: run scripts/setup (or scripts/fetch-models)");
  const std::string dir = temp_dir("smollm2");
  write_data(dir + "/data.jsonl", 20);
  const Result init = sh(fmt::format("'{}' '{}/tests/reference/train_reference.py' init {} {}/init 4 8 7",
                                     LORARUN_PYTHON, LORARUN_SOURCE_DIR, kSmolLM2, dir));
  INFO(init.output);
  REQUIRE(init.status == 0);
  const Result t = train(dir, "fp32", fmt::format("lora.init_from={}/init", dir));  // the reference's random adapter
  INFO(t.output);
  REQUIRE(t.status == 0);

  // Every step's loss and the adapter after 5 steps against the reference (relative). Measured here:
  // losses within 3.8e-7, adapter within 2.4e-5 of its largest weight (AdamW turns rounding-level
  // gradient differences into steps of up to lr), where a wrong gradient is ~1.
  const Oracle ref = oracle(fmt::format(
      "'{}' '{}/tests/reference/train_reference.py' check {} {}/init {}/data.jsonl {}/fp32 2 2 1 1 1e-3 2 1e-5 1e-4",
      LORARUN_PYTHON, LORARUN_SOURCE_DIR, kSmolLM2, dir, dir, dir));
  INFO(ref.run.output);
  CHECK(ref.run.status == 0);
  CHECK(ref.fields.value("match", false));
  CHECK(ref.fields.value("steps", 0) == 5);

  // Greedy generation with the trained adapter: our 24 ids, and transformers' with PEFT loading it.
  {
    std::ofstream(dir + "/prompt.txt") << "<|im_start|>user\nWrite a short poem about the sea.<|im_end|>\n"
                                          "<|im_start|>assistant\n";
    const Result ours =
        sh(fmt::format("{} --model {} --adapter {}/fp32/epoch_0 --prompt-file {}/prompt.txt "
                       "--max-new-tokens 24 --ids 2>{}/generate.err",
                       bin("lora-generate"), kSmolLM2, dir, dir, dir));
    INFO(ours.output);
    REQUIRE(ours.status == 0);
    const Oracle theirs =
        oracle(fmt::format("'{}' '{}/tests/reference/gguf_model_check.py' generate {} {}/prompt.txt "
                           "24 {}/fp32/epoch_0",
                           LORARUN_PYTHON, LORARUN_SOURCE_DIR, kSmolLM2, dir, dir));
    INFO(theirs.run.output);
    REQUIRE(theirs.fields.contains("ids"));
    const auto ids = nlohmann::json::parse(ours.output).get<std::vector<int64_t>>();
    CHECK(ids == theirs.fields["ids"].get<std::vector<int64_t>>());
    CHECK(ids.size() == 24);  // no early end: all 24 compared
  }
}

TEST_CASE(
    "SmolLM2 from its GGUF trains in bf16, and on the file's own Q4_1 blocks (model.keep_quantized) to the same "
    "adapter bit for bit",
    "[e2e][gguf]") {
  if (!std::filesystem::exists(kSmolLM2)) FAIL(kSmolLM2 << " is missing: run scripts/setup (or scripts/fetch-models)");
  const std::string dir = temp_dir("smollm2-bf16");
  write_data(dir + "/data.jsonl", 20);
  // The same 5 steps from PEFT's own initialisation (B = 0) in fp32 and in bf16, the linears
  // dequantised at load or kept as the file's blocks.
  for (const char* dtype : {"fp32", "bf16"}) {
    for (const char* keep : {"false", "true"}) {
      const Result r = train(dir, fmt::format("{}{}", dtype, keep == std::string("true") ? "-kept" : ""),
                             fmt::format("model.dtype={} model.keep_quantized={}", dtype, keep));
      INFO(r.output);
      REQUIRE(r.status == 0);
    }
    CHECK(hashes(fmt::format("{}/{}-kept/epoch_0", dir, dtype)) == hashes(fmt::format("{}/{}/epoch_0", dir, dtype)));
    const double kept = first_metric(fmt::format("{}/{}-kept", dir, dtype), "base_mb"),
                 loaded = first_metric(fmt::format("{}/{}", dir, dtype), "base_mb");
    fmt::print("SmolLM2 Q4_1 {}: base {:.1f} MiB kept as blocks vs {:.1f} MiB dequantised\n", dtype, kept, loaded);
    CHECK(kept < loaded);
  }
  const std::vector<double> fp32 = losses(dir + "/fp32/metrics.jsonl"), bf16 = losses(dir + "/bf16/metrics.jsonl");
  REQUIRE(bf16.size() == 5);
  for (double l : bf16) CHECK(std::isfinite(l));
  CHECK(std::abs(bf16[0] - fp32[0]) < 0.02 * fp32[0]);  // bf16's rounding of the same forward
  CHECK(bf16.back() < bf16.front());
}
