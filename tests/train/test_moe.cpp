// Mixture-of-experts models (qwen3_moe, mixtral) trained by lora-train against transformers + PEFT
// + torch AdamW: attention, router and per-expert adapters (PEFT's target_parameters), the router's
// load-balancing loss, 1 rank = 2 ranks = accumulation; and the bad input they bring.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <fstream>
#include <string>
#include <vector>

#include "support/oracle.hpp"
#include "support/runs.hpp"

using namespace lorarun::test;

namespace {

const std::string kFixtures = LORARUN_MODEL_FIXTURES;

// The default LoRA section's keys: all-linear from DIR/init (PEFT's reading of all-linear on a mixture
// of experts adapts the routers and experts too).
std::string from_init(const std::string& dir) {
  return fmt::format(", target_modules: all-linear, init_from: {}/init", dir);
}

// DIR/NAME.yaml for fixture `family`: LoRA r 4, alpha 8 and `lora`'s keys (from_init's when none), DIR/data.jsonl (40
// documents), batch `batch`, one epoch, and `extra` sections.
std::string moe_recipe(const std::string& dir, const std::string& family, const std::string& name,
                       const std::string& extra, int accum = 1, int batch = 2, const std::string& lora = "") {
  const std::string path = fmt::format("{}/{}.yaml", dir, name);
  std::ofstream(path) << fmt::format(R"(model: {{path: {}/{}, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8{}}}
data: {{source: jsonl, path: {}/data.jsonl, format: instruction, prompt_template: "Q: {{instruction}}\nA: ", shuffle: none, batch_size: {}}}
train: {{epochs: 1, lr: 5.0e-3, warmup_steps: 2, lr_scheduler: cosine, gradient_accumulation_steps: {}}}
checkpoint: {{output_dir: {}/{}}}
track: {{mongodb: false}}
{})",
                                     kFixtures, family, lora.empty() ? from_init(dir) : lora, dir, batch, accum, dir,
                                     name, extra);
  return path;
}

Result train(const std::string& recipe, int ranks) {
  return sh(fmt::format("{} --nproc-per-node {} {}", bin("lorarun"), ranks, recipe));
}

// The reference's replay of DIR/NAME (2 ranks' batches of 2 for 10 steps), which must match.
void check_reference(const std::string& dir, const std::string& family, const std::string& name,
                     const std::string& options) {
  const Oracle ref =
      oracle(fmt::format("'{}' '{}/tests/reference/train_reference.py' check {} {}/{} {}/init {}/data.jsonl {}/{} 2 2 "
                         "1 1 5e-3 2 1e-5 2e-4",
                         LORARUN_PYTHON, LORARUN_SOURCE_DIR, options, kFixtures, family, dir, dir, dir, name));
  INFO(ref.run.output);
  CHECK(ref.run.status == 0);
  CHECK(ref.fields.value("match", false));
  CHECK(ref.fields.value("steps", 0) == 10);
  fmt::print("{} {}: 10 steps vs transformers + PEFT: worst relative loss diff {:.2g}, adapter {:.2g}\n", family,
             options, ref.fields.value("worst_relative_loss_diff", -1.0),
             ref.fields.value("worst_relative_weight_diff", -1.0));
}

// lora-generate's greedy ids for fixture `family` (with `adapter`, or "-") equal transformers' (+ PEFT's).
void check_generation(const std::string& family, const std::string& adapter) {
  const std::string model = kFixtures + "/" + family;
  const Result ours = sh(fmt::format("{} --model {} {} --prompt 'The quick' --max-new-tokens 12 --ids 2>/dev/null",
                                     bin("lora-generate"), model, adapter == "-" ? "" : "--adapter " + adapter));
  INFO(ours.output);
  REQUIRE(ours.status == 0);
  const std::vector<std::string> ids = lines_with(ours.output, "[");
  REQUIRE(ids.size() == 1);
  const Result ref = sh(fmt::format("'{}' '{}/tests/reference/check.py' generate {} {} 'The quick' 12 '{}'",
                                    LORARUN_PYTHON, LORARUN_SOURCE_DIR, model, adapter, ids[0]));
  INFO(ref.output);
  CHECK(ref.status == 0);
}

void start(const std::string& dir, const std::string& family) {
  write_data(dir + "/data.jsonl", 40);
  const Result init = sh(fmt::format("'{}' '{}/tests/reference/train_reference.py' init {}/{} {}/init 4 8 7",
                                     LORARUN_PYTHON, LORARUN_SOURCE_DIR, kFixtures, family, dir));
  INFO(init.output);
  REQUIRE(init.status == 0);
}

}  // namespace

TEST_CASE(
    "qwen3_moe with the router loss trains as transformers + PEFT do (attention, routers and experts adapted), "
    "1 rank with accumulation = 2 ranks",
    "[e2e][reference]") {
  const std::string dir = temp_dir("moe-qwen");
  start(dir, "qwen3_moe");
  const Result two = train(moe_recipe(dir, "qwen3_moe", "two", "moe: {router_aux_loss_coef: 0.05}"), 2);
  INFO(two.output);
  REQUIRE(two.status == 0);
  check_reference(dir, "qwen3_moe", "two", "--router-aux=0.05");
  const std::string metrics = read_file(dir + "/two/metrics.jsonl");
  CHECK_THAT(metrics, Catch::Contains("\"expert_load/min\""));
  CHECK_THAT(metrics, Catch::Contains("\"expert_load/max\""));

  // The router loss is each micro-batch's (transformers'): ranks and accumulation agree where they make the
  // same micro-batches (one document each: DistributedSampler's interleaving groups 2 otherwise).
  const std::string coef = "moe: {router_aux_loss_coef: 0.05}";
  const Result ranked = train(moe_recipe(dir, "qwen3_moe", "ranks", coef, 1, 1), 2);
  const Result one = train(moe_recipe(dir, "qwen3_moe", "one", coef, 2, 1), 1);
  INFO(ranked.output << one.output);
  REQUIRE(ranked.status == 0);
  REQUIRE(one.status == 0);
  const double ranks =
      adapter_diff(dir + "/ranks/epoch_0/adapter_model.safetensors", dir + "/one/epoch_0/adapter_model.safetensors");
  CHECK(ranks <= 1e-6);
  // the router loss matters: without it the adapter ends elsewhere
  const Result none = train(moe_recipe(dir, "qwen3_moe", "none", "moe: {router_aux_loss_coef: 0.0}"), 2);
  REQUIRE(none.status == 0);
  const double without =
      adapter_diff(dir + "/two/epoch_0/adapter_model.safetensors", dir + "/none/epoch_0/adapter_model.safetensors");
  CHECK(without > 1e-4);
  fmt::print("qwen3_moe: 1 rank x accumulation 2 vs 2 ranks: adapter {:.2g}; without the router loss {:.2g}\n", ranks,
             without);

  // out: lora-merge folds the router and expert adapters into the per-expert tensors transformers
  // reads; lora-generate runs the model with the adapter (PEFT's fixture adapter: random B, so it shows)
  const Result m = sh(fmt::format("{} --model {}/qwen3_moe --adapter {}/two/epoch_0 --out {}/merged", bin("lora-merge"),
                                  kFixtures, dir, dir));
  INFO(m.output);
  REQUIRE(m.status == 0);
  const Oracle merged =
      oracle(fmt::format("'{}' '{}/tests/reference/train_reference.py' merged {}/qwen3_moe "
                         "{}/two/epoch_0 {}/merged {}/data.jsonl",
                         LORARUN_PYTHON, LORARUN_SOURCE_DIR, kFixtures, dir, dir, dir));
  INFO(merged.run.output);
  CHECK(merged.fields.value("logits_diff", 1.0) <= 1e-5);
  check_generation("qwen3_moe", kFixtures + "/qwen3_moe/peft_adapter");
  // --dry-run counts the parameters a token passes through: 2 MoE layers of 4 experts (3 x 32 x 64 each), top 2
  const Result plan = sh(fmt::format("{} --dry-run {}/two.yaml", bin("lora-train"), dir));
  INFO(plan.output);
  CHECK_THAT(plan.output, Catch::Contains("of 154656 base parameters active per token") &&
                              Catch::Contains("130080 of") && Catch::Contains("its top 2 of 4 experts"));
}

TEST_CASE("mixtral trains as transformers + PEFT do, without a router loss as its config says", "[e2e][reference]") {
  const std::string dir = temp_dir("moe-mixtral");
  start(dir, "mixtral");
  const Result two = train(moe_recipe(dir, "mixtral", "two", ""), 2);
  INFO(two.output);
  REQUIRE(two.status == 0);
  check_reference(dir, "mixtral", "two", "");
  check_generation("mixtral", "-");
}

TEST_CASE("mixture-of-experts bad input: one line each, nothing trained", "[e2e]") {
  const std::string dir = temp_dir("moe-bad");
  start(dir, "qwen3_moe");
  const auto refused = [&](const std::string& family, const std::string& lora, const std::string& extra,
                           const std::string& says) {
    const std::string path = moe_recipe(dir, family, "bad", extra, 1, 2, lora);
    const Result r = sh(fmt::format("{} {}", bin("lora-train"), path));
    INFO(r.output);
    CHECK(r.status != 0);
    CHECK_THAT(r.output, Catch::Contains(says));
    CHECK_THAT(r.output, !Catch::Contains("terminate called"));
    CHECK(!std::filesystem::exists(dir + "/bad/epoch_0"));
  };
  refused("llama", ", target_parameters: [mlp.experts.gate_up_proj]", "", "has no expert tensors");
  refused("qwen3_moe", ", target_parameters: [mlp.experts.w9]", "", "match no parameter of this qwen3_moe model");
  refused("qwen3_moe", ", target_modules: [gate_proj]", "", "lists gate_proj but not up_proj");
  refused("qwen3_moe", ", target_modules: all-linear, dropout: 0.1", "", "take plain LoRA");
  refused("qwen3_moe", ", target_modules: [q_proj]", "moe: {router_aux_loss_coef: -0.5}", "moe.router_aux_loss_coef");
  refused("llama", ", target_modules: [q_proj]", "moe: {router_aux_loss_coef: 0.01}", "is not a mixture of experts");
}
