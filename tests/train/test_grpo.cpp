// train.objective: grpo: lora-train samples, scores and trains as TRL's GRPOTrainer does; the same
// completions and adapter on 1 rank, 2 ranks and with accumulation; a resume samples the same
// completions again; bad rewards and documents in one line.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/oracle.hpp"
#include "support/runs.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;

namespace {

// `n` prompts "What is i+(i+1)? Answer:" with the answer 2i+1, one JSON object a line.
void write_prompts(const std::string& path, int n) {
  std::ofstream out(path);
  for (int i = 0; i < n; ++i)
    out << nlohmann::json{{"prompt", fmt::format("What is {}+{}? Answer:", i, i + 1)}, {"answer", 2 * i + 1}}.dump()
        << "\n";
}

// 4 completions of up to 8 tokens a prompt, rewarded for the right number and for ending early.
const std::string kGrpo =
    "num_generations: 4, max_completion_length: 8, rewards: [{name: num, kind: number, field: answer}, {name: short, "
    "kind: length, max_tokens: 8, cache: 6, weight: 0.5}]";

// ... and a reward of weight 0 that takes 0.05 s a completion: steps slow enough to stop or kill in.
const std::string kPaced =
    kGrpo.substr(0, kGrpo.size() - 1) +
    R"(, {name: pace, kind: command, weight: 0, run: [sh, -c, "while read -r l; do sleep 0.05; echo 0; done"]}])";

// A GRPO recipe on the llama fixture over `dir`/prompts.jsonl in file order, constant LR, logging
// its completions; `grpo` is the grpo: section's keys.
std::string write_grpo_recipe(const std::string& dir, const std::string& name, const std::string& train,
                              const std::string& grpo = kGrpo, const std::string& data = "") {
  const std::string path = fmt::format("{}/{}.yaml", dir, name);
  std::ofstream(path) << fmt::format(
      R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
data: {{source: jsonl, path: {}/prompts.jsonl, format: prompt, shuffle: none, max_length: 64{}}}
train: {{objective: grpo, lr_scheduler: constant, lr: 0.001, {}}}
grpo: {{log_completions: true, {}}}
checkpoint: {{output_dir: {}/{}}}
track: {{mongodb: false}}
)",
      LORARUN_MODEL_FIXTURES, dir, data, train, grpo, dir, name);
  return path;
}

std::vector<nlohmann::json> rows_of(const std::string& file) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(file);
  for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

// The train rows of a run's metrics.jsonl.
std::vector<nlohmann::json> steps_of(const std::string& run_dir) {
  std::vector<nlohmann::json> out;
  for (auto& row : rows_of(run_dir + "/metrics.jsonl"))
    if (row.contains("reward")) out.push_back(std::move(row));
  return out;
}

// `cmd` (output_dir `dir`/k), interrupted, run again: it resumes in epoch `epoch` and ends with the
// adapter of the uninterrupted run in `dir`/w, having sampled its completions (the log kept the steps
// before the state and dropped the interrupted run's later ones).
void resumes_as_uninterrupted(const std::string& cmd, const std::string& dir, int epoch) {
  const Result again = sh(cmd);
  INFO(again.output);
  REQUIRE(again.status == 0);
  CHECK_THAT(again.output, Catch::Contains(fmt::format("resuming at epoch {}", epoch)));
  CHECK(sh(fmt::format("cmp {0}/w/epoch_{1}/adapter_model.safetensors {0}/k/epoch_{1}/adapter_model.safetensors", dir,
                       epoch))
            .status == 0);
  CHECK(sh(fmt::format("cmp {0}/w/completions.jsonl {0}/k/completions.jsonl", dir)).status == 0);
}

}  // namespace

TEST_CASE(
    "grpo: lora-train equals TRL's GRPOTrainer step by step on the same completions: dapo, grpo, dr_grpo, bnpo, "
    "GSPO's sequence level, beta 0 and 0.04, scale_rewards group, batch and none, accumulation, masked truncation, "
    "num_iterations 2, gemma2's soft cap with a temperature",
    "[e2e][reference][grpo]") {
  const std::string dir = temp_dir("grpo-trl");
  {  // 8 steps of 2 prompts (× accumulation 2): "What is a + b?", the answer a number or a string
    std::ofstream out(dir + "/prompts.jsonl");
    for (int i = 0; i < 32; ++i) {
      const int a = (i * 7 + 1) % 6, b = (i * 5 + 4) % 5;
      const nlohmann::json answer = i % 2 ? nlohmann::json(std::to_string(a + b)) : nlohmann::json(a + b);
      out << nlohmann::json{{"prompt", fmt::format("What is {} + {}?", a, b)}, {"answer", answer}}.dump() << "\n";
    }
  }
  const std::string script = std::string(LORARUN_SOURCE_DIR) + "/tests/reference/grpo_trainer_reference.py";
  const std::string model = std::string(LORARUN_MODEL_FIXTURES) + "/llama";
  REQUIRE(sh(fmt::format("{} {} init {} {}/init 4 8 0", LORARUN_PYTHON, script, model, dir)).status == 0);
  // 8 completions of up to 16 tokens a prompt, rewarded for ending early: groups whose rewards differ
  const std::string recipe = write_grpo_recipe(
      dir, "g", "epochs: 1, max_steps_per_epoch: 8",
      "num_generations: 8, max_completion_length: 16, rewards: [{name: num, kind: number, field: answer}, "
      "{name: short, kind: length, max_tokens: 16, cache: 14, weight: 0.5}]",
      ", batch_size: 2");
  const struct {
    std::string name, ours, trl;
  } cases[] = {
      {"dapo", "grpo.beta=0.04", "--loss-type dapo --beta 0.04"},
      {"grpo", "grpo.loss_type=grpo", "--loss-type grpo --beta 0"},
      {"dr_grpo", "grpo.loss_type=dr_grpo grpo.beta=0.04", "--loss-type dr_grpo --beta 0.04"},
      {"bnpo", "grpo.loss_type=bnpo grpo.beta=0.04", "--loss-type bnpo --beta 0.04"},
      {"gspo", "grpo.importance_sampling_level=sequence grpo.beta=0.04",
       "--loss-type dapo --beta 0.04 --importance-level sequence"},
      {"none", "grpo.scale_rewards=none grpo.beta=0.04", "--loss-type dapo --beta 0.04 --scale-rewards none"},
      {"accum", "train.gradient_accumulation_steps=2 grpo.beta=0.04", "--loss-type dapo --beta 0.04 --accum 2"},
      {"masked", "grpo.mask_truncated_completions=true grpo.beta=0.04",
       "--loss-type dapo --beta 0.04 --mask-truncated"},
      {"batch", "grpo.scale_rewards=batch grpo.epsilon_high=0.28 grpo.temperature=0.7",
       "--loss-type dapo --beta 0 --scale-rewards batch --epsilon-high 0.28 --temperature 0.7"},
      // each generation trained on twice, the second time against its log-probs at sampling (a small
      // epsilon: ratios that clip)
      {"mu2", "grpo.num_iterations=2 grpo.beta=0.04 grpo.epsilon=0.002",
       "--loss-type dapo --beta 0.04 --epsilon 0.002 --num-iterations 2"},
      {"mu2accum", "grpo.num_iterations=2 grpo.loss_type=grpo grpo.epsilon=0.002 train.gradient_accumulation_steps=2",
       "--loss-type grpo --beta 0 --accum 2 --epsilon 0.002 --num-iterations 2"},
  };
  for (const auto& c : cases) {
    INFO(c.name);
    const Result t = sh(fmt::format("{} {} lora.init_from={}/init checkpoint.output_dir={}/{} {}", bin("lora-train"),
                                    recipe, dir, dir, c.name, c.ours));
    INFO(t.output);
    REQUIRE(t.status == 0);
    const Oracle ref =
        oracle(fmt::format("{} {} check {} {}/init {}/prompts.jsonl {}/{} --steps 8 --batch 2 --num-generations 8 "
                           "--max-completion-length 16 --length 16,14 --lr 1e-3 --loss-tol 1e-5 --adapter-tol 1e-4 {}",
                           LORARUN_PYTHON, script, model, dir, dir, dir, c.name, c.trl));
    INFO(ref.run.output);
    CHECK(ref.run.status == 0);
    CHECK(ref.fields.value("match", false));
    CHECK(ref.fields.value("steps", 0) == 8);
    // advantages that move the adapter: some groups' rewards differ
    CHECK(ref.fields.value("largest_weight_change", 0.0) > 1e-4);
    if (c.name.starts_with("mu")) {  // the steps on an earlier generation clip some ratios, and log no reward
      double clipped = 0;
      size_t rewarded = 0;
      for (const auto& row : rows_of(fmt::format("{}/{}/metrics.jsonl", dir, c.name)))
        if (row.contains("loss")) {
          clipped = std::max(clipped, row.value("clip_ratio/region_mean", 0.0));
          rewarded += row.contains("reward");
        }
      CHECK(clipped > 0);
      CHECK(rewarded == 4);
    }
  }
  {  // gemma2 soft-caps its logits: a temperature divides the capped logits, as TRL divides the model's
    const std::string gemma2 = std::string(LORARUN_MODEL_FIXTURES) + "/gemma2";
    REQUIRE(sh(fmt::format("{} {} init {} {}/init_g2 4 8 0", LORARUN_PYTHON, script, gemma2, dir)).status == 0);
    const Result t =
        sh(fmt::format("{} {} model.path={} lora.init_from={}/init_g2 checkpoint.output_dir={}/gemma2 "
                       "grpo.temperature=0.7 grpo.beta=0.04",
                       bin("lora-train"), recipe, gemma2, dir, dir));
    INFO(t.output);
    REQUIRE(t.status == 0);
    const Oracle ref = oracle(
        fmt::format("{} {} check {} {}/init_g2 {}/prompts.jsonl {}/gemma2 --steps 8 --batch 2 --num-generations 8 "
                    "--max-completion-length 16 --length 16,14 --lr 1e-3 --beta 0.04 --temperature 0.7",
                    LORARUN_PYTHON, script, gemma2, dir, dir, dir));
    INFO(ref.run.output);
    CHECK(ref.fields.value("match", false));
    CHECK(ref.fields.value("largest_weight_change", 0.0) > 1e-4);
  }
}

TEST_CASE(
    "grpo: 1 rank, 2 ranks, accumulation 2 and a sharded base sample the same completions and train the same "
    "adapter, num_iterations 2 too",
    "[e2e][grpo]") {
  const std::string dir = temp_dir("grpo-ranks");
  write_prompts(dir + "/prompts.jsonl", 16);  // 4 steps of 4 prompts, read from FerretDB
  const std::string db = fmt::format("grpo_ranks_{}", getpid());
  REQUIRE(sh(fmt::format("{} import {}/prompts.jsonl --uri '{}' --db {} --collection prompts --drop", bin("lora-data"),
                         dir, test_uri(), db))
              .status == 0);
  const std::string mongo =
      fmt::format("data.source=mongodb 'data.uri={}' data.database={} data.collection=prompts", test_uri(), db);
  struct Layout {
    std::string name, launch, train;
  } layouts[] = {{"w1b4", bin("lora-train"), "data.batch_size=4"},
                 {"w2b2", bin("lorarun") + " --nproc-per-node 2", "data.batch_size=2"},
                 {"w1b2a2", bin("lora-train"), "data.batch_size=2 train.gradient_accumulation_steps=2"},
                 // each rank holding half the base: ranks whose completions end first join the others' passes
                 {"w2b2s", bin("lorarun") + " --nproc-per-node 2", "data.batch_size=2 dist.shard_base=true"}};
  const std::string recipe = write_grpo_recipe(dir, "g", "epochs: 1", kGrpo + ", beta: 0.04");
  for (const Layout& l : layouts) {
    const Result t =
        sh(fmt::format("{} {} {} {} checkpoint.output_dir={}/{}", l.launch, recipe, mongo, l.train, dir, l.name));
    INFO(l.name << "\n" << t.output);
    REQUIRE(t.status == 0);
  }
  // each generation trained on twice: every step's loss and kl the same on 1 rank and on 2 ranks each
  // holding half the base
  for (const Layout& l : {layouts[0], layouts[3]}) {
    const Result t = sh(fmt::format("{} {} {} {} grpo.num_iterations=2 checkpoint.output_dir={}/{}m2", l.launch, recipe,
                                    mongo, l.train, dir, l.name));
    INFO(l.name << "m2\n" << t.output);
    REQUIRE(t.status == 0);
  }
  {
    std::vector<nlohmann::json> m2[2];
    for (int k = 0; k < 2; ++k)
      for (auto& row : rows_of(dir + (k ? "/w2b2sm2" : "/w1b4m2") + "/metrics.jsonl"))
        if (row.contains("loss")) m2[k].push_back(std::move(row));
    REQUIRE(m2[0].size() == 8);
    REQUIRE(m2[1].size() == 8);
    for (size_t s = 0; s < 8; ++s) {
      INFO("num_iterations 2, step " << s + 1);
      CHECK(m2[1][s].contains("reward") == (s % 2 == 0));
      CHECK(std::abs(m2[1][s]["loss"].get<double>() - m2[0][s]["loss"].get<double>()) <=
            1e-6 * std::max(1.0, std::abs(m2[0][s]["loss"].get<double>())));
      // (kl ~ d^2 / 2 of log-prob differences d ~ 1e-2 from float32 sums: a few 1e-5 apart)
      CHECK(m2[1][s]["kl"].get<double>() == Approx(m2[0][s]["kl"].get<double>()).epsilon(1e-3));
    }
    CHECK(adapter_relative_diff(dir + "/w1b4m2/epoch_0/adapter_model.safetensors",
                                dir + "/w2b2sm2/epoch_0/adapter_model.safetensors") < 1e-5);
  }
  const auto one = steps_of(dir + "/w1b4");
  REQUIRE(one.size() == 4);
  bool learnt = false;
  for (const Layout& l : {layouts[1], layouts[2], layouts[3]}) {
    INFO(l.name);
    const auto other = steps_of(dir + "/" + l.name);
    REQUIRE(other.size() == one.size());
    // every rank's completions are scored and advantaged together: the step's figures are the same
    for (size_t s = 0; s < one.size(); ++s)
      for (const char* key : {"reward", "reward_std", "frac_reward_zero_std", "rewards/short/mean",
                              "completions/mean_length", "completions/max_length"}) {
        INFO("step " << s + 1 << " " << key);
        CHECK(other[s][key] == one[s][key]);
      }
    CHECK(adapter_relative_diff(dir + "/w1b4/epoch_0/adapter_model.safetensors",
                                dir + "/" + l.name + "/epoch_0/adapter_model.safetensors") < 1e-5);
  }
  for (const auto& row : one) learnt = learnt || row["grad_norm"].get<double>() > 0;
  CHECK(learnt);
  // every completion is logged, 4 steps × 4 prompts × 4 generations, the same on each layout
  const auto logged = rows_of(dir + "/w1b4/completions.jsonl");
  CHECK(logged.size() == 64);
  for (const char* other : {"w2b2", "w1b2a2", "w2b2s"}) {
    const auto rows = rows_of(dir + "/" + other + "/completions.jsonl");
    REQUIRE(rows.size() == logged.size());
    for (size_t i = 0; i < logged.size(); ++i) {
      INFO(other << " row " << i);
      CHECK(rows[i]["prompt"] == logged[i]["prompt"]);
      CHECK(rows[i]["completion_ids"] == logged[i]["completion_ids"]);
      CHECK(rows[i]["advantage"] == logged[i]["advantage"]);
    }
  }
}

TEST_CASE("grpo: a run killed mid-epoch resumes to the uninterrupted run's adapter, sampling the same completions",
          "[e2e][grpo]") {
  const std::string dir = temp_dir("grpo-resume");
  write_prompts(dir + "/prompts.jsonl", 8);  // 4 steps of 2 prompts an epoch
  const std::string recipe = write_grpo_recipe(dir, "w", "epochs: 2", kPaced, ", batch_size: 2");
  REQUIRE(sh(fmt::format("{} {}", bin("lora-train"), recipe)).status == 0);
  const std::string cmd =
      fmt::format("{} {} checkpoint.output_dir={}/k checkpoint.state_every_n_steps=2", bin("lora-train"), recipe, dir);
  const Result killed = interrupt(cmd, dir + "/k.log", "epoch 1/2 step 1/4", "kill -9 $pid");
  INFO(read_file(dir + "/k.log"));
  REQUIRE_THAT(killed.output, Catch::Contains("exit=137"));
  resumes_as_uninterrupted(cmd, dir, 1);
  CHECK(rows_of(dir + "/w/completions.jsonl").size() == 64);
}

TEST_CASE("grpo: num_iterations 2 stopped between the two steps on a generation resumes on the rollout its state kept",
          "[e2e][grpo]") {
  const std::string dir = temp_dir("grpo-mu-resume");
  write_prompts(dir + "/prompts.jsonl", 8);  // 4 generations of 2 prompts, each trained on twice: 8 steps
  const std::string recipe =
      write_grpo_recipe(dir, "w", "epochs: 1, max_grad_norm: 1.0",
                        kPaced + ", num_iterations: 2, beta: 0.04, epsilon: 0.002", ", batch_size: 2");
  REQUIRE(sh(fmt::format("{} {}", bin("lora-train"), recipe)).status == 0);
  const std::string cmd = fmt::format("{} {} checkpoint.output_dir={}/k", bin("lora-train"), recipe, dir);
  // stopped while step 3 samples the second generation: the state after it lies inside that generation
  const Result stopped = interrupt(cmd, dir + "/k.log", "step 2/8", "kill -TERM $pid");
  INFO(read_file(dir + "/k.log"));
  REQUIRE_THAT(stopped.output, Catch::Contains("exit=75"));
  const auto state = nlohmann::json::parse(read_file(dir + "/k/resume_state/state.json"));
  CHECK(state["step_in_epoch"] == 3);
  CHECK(std::filesystem::exists(dir + "/k/resume_state/grpo_rollout.safetensors"));
  resumes_as_uninterrupted(cmd, dir, 0);
  // without the rollout, the step cannot train on it: one line, nothing written
  const Result lost =
      interrupt(fmt::format("{} checkpoint.output_dir={}/l", cmd, dir), dir + "/l.log", "step 2/8", "kill -TERM $pid");
  REQUIRE_THAT(lost.output, Catch::Contains("exit=75"));
  std::filesystem::remove(dir + "/l/resume_state/grpo_rollout.safetensors");
  const Result refused = sh(fmt::format("{} checkpoint.output_dir={}/l", cmd, dir));
  CHECK(refused.status != 0);
  CHECK_THAT(refused.output, Catch::Contains("grpo_rollout.safetensors is missing"));
  CHECK_FALSE(std::filesystem::exists(dir + "/l/epoch_0"));
}

TEST_CASE(
    "grpo: eval reports the mean reward of greedy completions as transformers' generate with the adapter scores "
    "them, lora-eval --recipe too, and best/ and early stopping keep the highest",
    "[e2e][reference][grpo]") {
  const std::string dir = temp_dir("grpo-eval");
  write_prompts(dir + "/prompts.jsonl", 8);
  {  // held-out sums the training prompts do not hold
    std::ofstream out(dir + "/eval.jsonl");
    for (int a = 20; a < 24; ++a)
      for (int b : {7, 8})
        out << nlohmann::json{{"prompt", fmt::format("What is {}+{}? Answer:", a, b)}, {"answer", a + b}}.dump()
            << "\n";
  }
  // the rewards of the TRL check and a program reading the text: each completion's characters
  const std::string chars = fmt::format(
      R"py({{name: chars, kind: command, run: [{}, -c, "import sys, json\nfor l in sys.stdin: print(len(json.loads(l)['completion']), flush=True)"]}})py",
      LORARUN_PYTHON);
  const std::string recipe = write_grpo_recipe(
      dir, "g", "epochs: 1", kGrpo.substr(0, kGrpo.size() - 1) + ", " + chars + "]", ", batch_size: 2");
  const Result t = sh(
      fmt::format("{} {} train.lr=0.01 'eval.path={}/eval.jsonl' eval.batch_size=3", bin("lora-train"), recipe, dir));
  INFO(t.output);
  REQUIRE(t.status == 0);
  CHECK_THAT(t.output, Catch::Contains("eval_reward"));
  const Oracle ref =
      oracle(fmt::format("{} {}/tests/reference/grpo_trainer_reference.py eval {}/llama {}/g {}/eval.jsonl "
                         "--max-completion-length 8 --length 8,6 --rewards number,length,chars",
                         LORARUN_PYTHON, LORARUN_SOURCE_DIR, LORARUN_MODEL_FIXTURES, dir, dir));
  INFO(ref.run.output);
  CHECK(ref.fields.value("match", false));
  CHECK(ref.fields.value("prompts", 0) == 8);
  // lora-eval --recipe reports the same of the adapter
  const Result e = sh(fmt::format("{} --recipe {} --adapter {}/g/epoch_0 'eval.path={}/eval.jsonl' --json",
                                  bin("lora-eval"), recipe, dir, dir));
  INFO(e.output);
  REQUIRE(e.status == 0);
  nlohmann::json last;
  for (auto& row : rows_of(dir + "/g/metrics.jsonl"))
    if (row.contains("eval_reward")) last = row;
  const auto got = nlohmann::json::parse(e.output.substr(e.output.rfind('{')));
  CHECK(got["reward"] == last["eval_reward"]);
  CHECK(got["rewards/chars/mean"] == last["eval_rewards/chars/mean"]);
  CHECK(got["prompts"] == 8);

  // A reward that grows with every completion scored (training's and evaluation's): each evaluation's
  // mean beats the last, so best/ follows the last; one that shrinks stops the run at its second.
  for (const std::string sign : {"", "-"}) {
    INFO("reward " << sign << "n");
    const std::string counter = fmt::format(
        R"(rewards: [{{name: count, kind: command, run: [sh, -c, "n=0; while read -r l; do n=$((n+1)); echo {}$n; done"]}}])",
        sign);
    const std::string steered =
        write_grpo_recipe(dir, "s" + sign, "epochs: 1, early_stopping_patience: 1",
                          "num_generations: 2, max_completion_length: 4, " + counter, ", batch_size: 1");
    const Result s = sh(fmt::format("{} {} 'eval.path={}/eval.jsonl' eval.every_n_steps=2 checkpoint.keep_best=true",
                                    bin("lora-train"), steered, dir));
    INFO(s.output);
    REQUIRE(s.status == 0);
    std::vector<nlohmann::json> evals;
    for (auto& row : rows_of(fmt::format("{}/s{}/metrics.jsonl", dir, sign)))
      if (row.contains("eval_reward")) evals.push_back(std::move(row));
    const auto best = nlohmann::json::parse(read_file(fmt::format("{}/s{}/best/best.json", dir, sign)));
    CHECK(best["best"] == "the highest eval_reward so far");
    if (sign.empty()) {
      REQUIRE(evals.size() == 4);  // steps 2, 4, 6 and the epoch's end
      CHECK(evals[3]["eval_reward"].get<double>() > evals[0]["eval_reward"].get<double>());
      CHECK(best["step"] == evals[3]["step"]);
      CHECK(evals[3]["best_eval_reward"] == evals[3]["eval_reward"]);
    } else {
      REQUIRE(evals.size() == 2);
      CHECK(best["step"] == 2);
      CHECK(evals[1]["best_eval_reward"] == evals[0]["eval_reward"]);
      CHECK_THAT(s.output, Catch::Contains("without raising the best eval_reward"));
    }
  }
}

TEST_CASE(
    "grpo: data.sources mixes prompt sources by weight, the same on 1 rank and 2, evaluated by eval.fraction of each",
    "[e2e][grpo]") {
  const std::string dir = temp_dir("grpo-sources");
  write_prompts(dir + "/small.jsonl", 12);
  {
    std::ofstream out(dir + "/large.jsonl");
    for (int i = 0; i < 40; ++i)
      out << nlohmann::json{{"prompt", fmt::format("Add {} and {}.", 3 * i, 7)}, {"answer", 3 * i + 7}}.dump() << "\n";
  }
  const auto run = [&](const std::string& name, const std::string& launch, int batch) {
    const std::string path = fmt::format("{}/{}.yaml", dir, name);
    std::ofstream(path) << fmt::format(
        R"(model: {{path: {0}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
data: {{source: jsonl, format: prompt, max_length: 64, batch_size: {3}, epoch_documents: 16,
        sources: [{{name: small, path: {1}/small.jsonl, weight: 1}}, {{name: large, path: {1}/large.jsonl, weight: 3}}]}}
eval: {{fraction: 0.3}}
train: {{objective: grpo, lr_scheduler: constant, lr: 0.001, epochs: 1}}
grpo: {{{4}, beta: 0.04}}
checkpoint: {{output_dir: {1}/{2}}}
track: {{mongodb: false}}
)",
        LORARUN_MODEL_FIXTURES, dir, name, batch, kGrpo);
    return sh(fmt::format("{} {}", launch, path));
  };
  const Result one = run("one", bin("lora-train"), 4), two = run("two", bin("lorarun") + " --nproc-per-node 2", 2);
  INFO(one.output << two.output);
  REQUIRE(one.status == 0);
  REQUIRE(two.status == 0);
  const auto a = steps_of(dir + "/one"), b = steps_of(dir + "/two");
  REQUIRE(a.size() == 4);
  REQUIRE(b.size() == a.size());
  for (size_t s = 0; s < a.size(); ++s) {
    INFO("step " << s + 1);
    CHECK(a[s]["source_documents"] == b[s]["source_documents"]);
    CHECK(a[s]["reward"] == b[s]["reward"]);
  }
  CHECK(adapter_relative_diff(dir + "/one/epoch_0/adapter_model.safetensors",
                              dir + "/two/epoch_0/adapter_model.safetensors") < 1e-5);
  nlohmann::json last;
  for (auto& row : rows_of(dir + "/one/metrics.jsonl"))
    if (row.contains("eval_loss")) last = row;
  CHECK(last.contains("eval_reward"));
  CHECK(last.contains("eval_loss/small"));
  CHECK(last.contains("eval_loss/large"));
  CHECK(last["eval_reward"].get<double>() == Approx(-last["eval_loss"].get<double>()));
}

TEST_CASE(
    "grpo: a job of two adapters on 2 ranks trains each as its own run on 1 rank: the same completions and adapter",
    "[e2e][grpo]") {
  const std::string dir = temp_dir("grpo-job");
  write_prompts(dir + "/a.jsonl", 8);
  {
    std::ofstream out(dir + "/b.jsonl");
    for (int i = 0; i < 8; ++i)
      out << nlohmann::json{{"prompt", fmt::format("Add {} and {}.", 5 * i, 9)}, {"answer", 5 * i + 9}}.dump() << "\n";
  }
  const std::string grpo = kGrpo + ", beta: 0.04, num_iterations: 2";
  const std::string job = write_grpo_recipe(dir, "job", "epochs: 1", grpo, ", batch_size: 2");
  const Result j =
      sh(fmt::format("{} --nproc-per-node 2 {} 'adapters.list=[{{name: a, path: {}/a.jsonl}}, {{name: b, path: "
                     "{}/b.jsonl, lr: 0.002}}]' "
                     "data.batch_size=1",
                     bin("lorarun"), job, dir, dir));
  INFO(j.output);
  REQUIRE(j.status == 0);
  for (const std::string name : {"a", "b"}) {
    INFO(name);
    const std::string own = write_grpo_recipe(dir, name, "epochs: 1", grpo, ", batch_size: 2");
    const Result t = sh(fmt::format("{} {} data.path={}/{}.jsonl {}", bin("lora-train"), own, dir, name,
                                    name == "b" ? "train.lr=0.002" : ""));
    INFO(t.output);
    REQUIRE(t.status == 0);
    CHECK(adapter_relative_diff(fmt::format("{}/job/{}/epoch_0/adapter_model.safetensors", dir, name),
                                fmt::format("{}/{}/epoch_0/adapter_model.safetensors", dir, name)) < 1e-5);
    const auto mine = rows_of(fmt::format("{}/job/{}/completions.jsonl", dir, name)),
               alone = rows_of(fmt::format("{}/{}/completions.jsonl", dir, name));
    REQUIRE(mine.size() == 32);  // 4 generations (of 2 steps each) of 2 prompts x 4 completions
    REQUIRE(alone.size() == mine.size());
    for (size_t i = 0; i < mine.size(); ++i) {
      INFO("row " << i);
      CHECK(mine[i]["completion_ids"] == alone[i]["completion_ids"]);
      CHECK(mine[i]["advantage"] == alone[i]["advantage"]);
    }
  }
}

TEST_CASE("grpo: a reward program scores completions, and bad rewards, programs and documents are one line each",
          "[e2e][grpo]") {
  const std::string dir = temp_dir("grpo-bad");
  write_prompts(dir + "/prompts.jsonl", 6);
  {  // two documents without the answer a reward checks: skipped as bad documents before sampling
    std::ofstream out(dir + "/prompts.jsonl", std::ios::app);
    out << R"({"prompt": "What is one?"})" << "\n" << R"({"prompt": "What is two?", "answer": "none"})" << "\n";
  }
  const std::string recipe = write_grpo_recipe(dir, "g", "epochs: 1", kGrpo, ", batch_size: 2");
  // a program in any language: here sh, 1 for a line that holds the document's answer field, else 0
  std::ofstream(dir + "/digit.sh")
      << "while read -r l; do case \"$l\" in *'\"answer\":'*) echo 1;; *) echo 0;; esac; done\n";
  const Result scored = sh(fmt::format(
      "{} {} data.max_skipped_share=0.5 'grpo.rewards=[{{name: digit, kind: command, fields: [answer], run: [sh, "
      "{}/digit.sh]}}, {{name: num, kind: number, field: answer}}]'",
      bin("lora-train"), recipe, dir));
  INFO(scored.output);
  REQUIRE(scored.status == 0);
  const auto rows = steps_of(dir + "/g");
  REQUIRE(rows.size() == 4);  // 4 steps of 2 documents, the last two skipped: a step of none, reward null
  int skipped = 0;
  for (size_t s = 0; s < rows.size(); ++s) {
    INFO(rows[s].dump());
    CHECK(rows[s]["rewards/digit/mean"] == (s < 3 ? nlohmann::json(1.0) : nlohmann::json(nullptr)));
    skipped += rows[s]["skipped"].get<int>();
  }
  CHECK(skipped == 2);
  const struct {
    std::string override_, message;
  } bad[] = {
      {"grpo.rewards=[{name: x, kind: bogus}]", "grpo.rewards[0] (x): kind 'bogus' is not one of"},
      {"grpo.rewards=[{name: x, kind: exact}]", "grpo.rewards[0] (x): a exact reward compares with a field"},
      {R"(grpo.rewards=[{name: "a b", kind: json}])", "grpo.rewards[0]: `name` must be set, of letters"},
      {R"(grpo.rewards=[{name: x, kind: regex, pattern: "(("}])", "pattern '((' does not compile"},
      {R"(grpo.rewards=[{name: talk, kind: command, run: [sh, -c, "while read -r l; do echo hello; done"]}])", "talk"},
      {R"(grpo.rewards=[{name: gone, kind: command, run: [sh, -c, "exit 3"]}])", "gone"},
      {R"(grpo.rewards=[{name: stuck, kind: command, timeout_s: 1, run: [sh, -c, "sleep 60"]}])", "stuck"},
      {"grpo.rewards=[{name: x, kind: json, keys: [1, 2]}]",
       "grpo.rewards[0]: `keys` must be a list of strings, got [1,2]"},
      {"grpo.num_generations=1", "grpo.num_generations must be at least 2"},
      {"grpo.max_completion_length=0", "grpo.max_completion_length must be at least 1"},
  };
  for (const auto& b : bad) {
    const auto t0 = std::chrono::steady_clock::now();
    const Result r =
        sh(fmt::format("{} {} '{}' checkpoint.output_dir={}/bad", bin("lora-train"), recipe, b.override_, dir));
    INFO(b.override_ << "\n" << r.output);
    // ended, its output closed: a program past its timeout is killed with what it started (its
    // `sleep 60` would otherwise hold the output open for a minute)
    CHECK(std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30));
    CHECK(r.status != 0);
    CHECK_THAT(r.output, Catch::Contains(b.message));
    CHECK_THAT(r.output, !Catch::Contains("terminate called"));
    CHECK(sh(fmt::format("test -e {}/bad/epoch_0", dir)).status != 0);
  }
}

TEST_CASE(
    "grpo: SmolLM2 with its GGUF blocks kept quantised samples, scores and trains from FerretDB on 2 ranks, its "
    "completions real text",
    "[e2e][grpo][gguf]") {
  const std::string dir = temp_dir("grpo-smollm2");
  {
    std::ofstream out(dir + "/prompts.jsonl");
    for (int i = 0; i < 8; ++i)
      out << nlohmann::json{{"prompt", {{{"role", "user"}, {"content", fmt::format("What is {} plus {}?", i, i)}}}},
                            {"answer", std::to_string(2 * i)}}
                 .dump()
          << "\n";
  }
  const std::string db = fmt::format("grpo_smollm2_{}", getpid());
  const Result imp = sh(fmt::format("{} import {}/prompts.jsonl --uri '{}' --db {} --collection prompts --drop",
                                    bin("lora-data"), dir, test_uri(), db));
  INFO(imp.output);
  REQUIRE(imp.status == 0);
  const std::string recipe = fmt::format("{}/g.yaml", dir);
  std::ofstream(recipe) << fmt::format(
      R"(model: {{path: {}/.fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf, dtype: fp32, device: cpu,
        keep_quantized: true}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
data: {{uri: "{}", database: {}, collection: prompts, format: prompt, chat_format: chatml, max_length: 64,
       batch_size: 2}}
train: {{objective: grpo, epochs: 1, lr: 0.001, max_steps_per_epoch: 2}}
grpo: {{num_generations: 4, max_completion_length: 12, beta: 0.04, log_completions: true,
       rewards: [{{name: sum, kind: number, field: answer}}, {{name: brief, kind: length, max_tokens: 12, cache: 8}}]}}
checkpoint: {{output_dir: {}/out}}
track: {{mongodb: false}}
)",
      LORARUN_SOURCE_DIR, test_uri(), db, dir);
  const Result t = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), recipe));
  INFO(t.output);
  REQUIRE(t.status == 0);
  const auto rows = steps_of(dir + "/out");
  REQUIRE(rows.size() == 2);
  for (const auto& row : rows) {
    CHECK(row["completions/mean_length"].get<double>() > 0);
    CHECK(row["kl"].get<double>() >= 0);
    CHECK(row.contains("rewards/sum/mean"));
  }
  const auto logged = rows_of(dir + "/out/completions.jsonl");
  REQUIRE(logged.size() == 2 * 4 * 4);  // 2 steps, 2 ranks × 2 prompts, 4 generations
  int words = 0;                        // completions of the real model read as words, not noise
  for (const auto& row : logged) {
    CHECK_THAT(row["prompt"].get<std::string>(), Catch::Contains("<|im_start|>assistant"));
    const std::string c = row["completion"];
    words += std::count(c.begin(), c.end(), ' ') >= 2 ? 1 : 0;
  }
  CHECK(words > 16);
  CHECK(sh(fmt::format("test -s {}/out/epoch_0/adapter_model.safetensors", dir)).status == 0);
}

TEST_CASE("grpo: a run record's command reward is not started by --from-run, an override's is", "[e2e][grpo]") {
  const std::string dir = temp_dir("grpo-from-run");
  write_prompts(dir + "/prompts.jsonl", 4);
  const std::string recipe = write_grpo_recipe(dir, "g", "epochs: 1", kGrpo, ", batch_size: 2");
  const std::string db = fmt::format("grpo_from_run_{}", getpid());
  const std::string env = fmt::format("LORARUN_MONGODB_URI='{}'", test_uri());
  const std::string command =
      R"('grpo.rewards=[{name: c, kind: command, run: [sh, -c, "while read -r l; do echo 1; done"]}]')";
  const Result first =
      sh(fmt::format("{} {} {} track.mongodb=true track.database={} {}", env, bin("lora-train"), recipe, db, command));
  INFO(first.output);
  REQUIRE(first.status == 0);
  const std::string id = run_id_in(first.output, db);
  // a record anyone with write access to the database could have changed starts no program
  const Result stored =
      sh(fmt::format("{} {} --from-run {}/{} checkpoint.output_dir={}/again", env, bin("lora-train"), db, id, dir));
  INFO(stored.output);
  CHECK(stored.status != 0);
  CHECK_THAT(stored.output, Catch::Contains("a run record may not"));
  CHECK(sh(fmt::format("test -e {}/again/epoch_0", dir)).status != 0);
  const Result given = sh(fmt::format("{} {} --from-run {}/{} checkpoint.output_dir={}/given {}", env,
                                      bin("lora-train"), db, id, dir, command));
  INFO(given.output);
  CHECK(given.status == 0);
}
