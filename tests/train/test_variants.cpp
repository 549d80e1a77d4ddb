// Adapter variants trained by lora-train against transformers + PEFT + torch AdamW on the same
// start: DoRA (fp32 and on the NF4 base).
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <string>

#include "support/oracle.hpp"
#include "support/runs.hpp"

using namespace lorarun::test;

namespace {

const std::string kLlama = std::string(LORARUN_MODEL_FIXTURES) + "/llama";

// The reference's random start (r 4, alpha 8, every linear; `variant` as train_reference.py init takes it).
void init_adapter(const std::string& dir, const std::string& variant) {
  const Result init = sh(fmt::format("'{}' '{}/tests/reference/train_reference.py' init {} {}/init 4 8 7 {}",
                                     LORARUN_PYTHON, LORARUN_SOURCE_DIR, kLlama, dir, variant));
  INFO(init.output);
  REQUIRE(init.status == 0);
}

// 40 documents on 2 ranks, 2 a rank a step, 2 epochs: 20 optimizer steps from DIR/init.
Result train(const std::string& dir, const std::string& name, const std::string& lora, const std::string& train = "") {
  const std::string recipe =
      write_recipe(dir, name, "epochs: 2, lr: 5.0e-3, warmup_steps: 2, lr_scheduler: cosine" + train,
                   fmt::format(", init_from: {}/init{}", dir, lora), ", shuffle: none, batch_size: 2");
  return sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), recipe));
}

// The step-by-step check of DIR/NAME (reports match): `script` `mode`, train_reference.py's check or
// a wrapper of it.
Oracle reference(const std::string& dir, const std::string& name, const std::string& script = "train_reference.py",
                 const std::string& mode = "check") {
  return oracle(fmt::format("'{}' '{}/tests/reference/{}' {} {} {}/init {}/data.jsonl {}/{} 2 2 1 2 5e-3 2",
                            LORARUN_PYTHON, LORARUN_SOURCE_DIR, script, mode, kLlama, dir, dir, dir, name));
}

}  // namespace

TEST_CASE("DoRA trains as transformers + PEFT do for 20 steps on 2 ranks, the same with activation checkpointing",
          "[e2e][reference]") {
  const std::string dir = temp_dir("dora-train");
  write_data(dir + "/data.jsonl", 40);
  init_adapter(dir, "dora");
  const Result t = train(dir, "dora", ", use_dora: true");
  INFO(t.output);
  REQUIRE(t.status == 0);
  const Oracle ref = reference(dir, "dora");
  INFO(ref.run.output);
  CHECK(ref.run.status == 0);
  CHECK(ref.fields.value("match", false));
  CHECK(ref.fields.value("steps", 0) == 20);
  fmt::print("dora: 20 steps vs PEFT: worst relative loss diff {:.2g}, adapter {:.2g}\n",
             ref.fields.value("worst_relative_loss_diff", -1.0), ref.fields.value("worst_relative_weight_diff", -1.0));

  const Result ckpt = train(dir, "dora-ckpt", ", use_dora: true", ", activation_checkpointing: true");
  INFO(ckpt.output);
  REQUIRE(ckpt.status == 0);
  CHECK(adapter_diff(dir + "/dora/epoch_1/adapter_model.safetensors",
                     dir + "/dora-ckpt/epoch_1/adapter_model.safetensors") == 0);
}

TEST_CASE("DoRA on the NF4 base (QLoRA) trains as PEFT's DoRA does on the same dequantised weights",
          "[e2e][reference]") {
  const std::string dir = temp_dir("dora-qlora");
  write_data(dir + "/data.jsonl", 40);
  init_adapter(dir, "dora");
  const Result t = train(dir, "qdora", ", use_dora: true, quantize_base: true");
  INFO(t.output);
  REQUIRE(t.status == 0);
  CHECK_THAT(t.output, Catch::Contains("base linears in NF4"));
  const Oracle ref = reference(dir, "qdora", "nf4_check.py", "train 1");
  INFO(ref.run.output);
  CHECK(ref.run.status == 0);
  CHECK(ref.fields.value("match", false));
  fmt::print("dora + qlora: 20 steps vs PEFT: worst relative loss diff {:.2g}, adapter {:.2g}\n",
             ref.fields.value("worst_relative_loss_diff", -1.0), ref.fields.value("worst_relative_weight_diff", -1.0));
}
