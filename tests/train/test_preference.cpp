// train.objective: dpo, orpo, cpo, simpo, kto: lora-train step by step against TRL's DPOTrainer (sigmoid,
// ipo, hinge, RPO, lora.init_from as the reference), ORPOTrainer, CPOTrainer (sigmoid, hinge, ipo,
// simpo) and KTOTrainer; the same adapter on 1 and 2 ranks and with accumulation, pairs read from FerretDB; kill -9
// and resume; bad pairs counted, bad recipes refused.
#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <tuple>
#include <vector>

#include "support/oracle.hpp"
#include "support/runs.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;

namespace {

// `n` pairs: "Q: add i and 3i+1\nA: " with the right sum chosen over a near miss.
void write_pairs(const std::string& path, int n, int from = 0) {
  std::ofstream out(path);
  for (int i = from; i < from + n; ++i)
    out << nlohmann::json{{"prompt", fmt::format("Q: add {} and {}\nA: ", i, 3 * i + 1)},
                          {"chosen", std::to_string(4 * i + 1)},
                          {"rejected", std::to_string(4 * i + (i % 2 ? 3 : 11))}}
               .dump()
        << "\n";
}

// `n` labelled answers to write_pairs' questions from the `from`-th for KTO ({prompt, completion,
// label}): the right sum (desirable) where `good(i)`, a near miss otherwise; labels true/false, or 1/0
// with `numbers`.
template <class Good>
void write_unpaired(const std::string& path, int n, Good good, bool numbers = false, int from = 0) {
  std::ofstream out(path);
  for (int i = from; i < from + n; ++i) {
    const bool g = good(i);
    out << nlohmann::json{{"prompt", fmt::format("Q: add {} and {}\nA: ", i, 3 * i + 1)},
                          {"completion", std::to_string(4 * i + (g       ? 1
                                                                 : i % 2 ? 3
                                                                         : 11))},
                          {"label", numbers ? nlohmann::json(g ? 1 : 0) : nlohmann::json(g)}}
               .dump()
        << "\n";
  }
}

// The documents of `from` with their prompt and `completions` fields (strings) as one message each
// (the user's, the assistant's), in `to`: TRL's conversational format.
void as_conversations(const std::string& from, const std::string& to, const std::vector<std::string>& completions) {
  std::ofstream out(to);
  std::ifstream in(from);
  const auto said = [](const std::string& role, const std::string& content) {
    return nlohmann::json::array({{{"role", role}, {"content", content}}});
  };
  for (std::string line; std::getline(in, line);) {
    auto d = nlohmann::json::parse(line);
    d["prompt"] = said("user", d["prompt"]);
    for (const std::string& c : completions) d[c] = said("assistant", d[c]);
    out << d.dump() << "\n";
  }
}

// A DPO recipe on the llama fixture: `dir`/pairs.jsonl (unless `data` names a MongoDB source) in
// file order, constant LR.
std::string write_dpo_recipe(const std::string& dir, const std::string& name, const std::string& train,
                             const std::string& preference, const std::string& data = "") {
  const std::string path = fmt::format("{}/{}.yaml", dir, name);
  const std::string jsonl = data.find("source: mongodb") == std::string::npos
                                ? fmt::format("source: jsonl, path: {}/pairs.jsonl, ", dir)
                                : "";
  std::ofstream(path) << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
data: {{{}format: preference, shuffle: none, max_length: 64{}}}
train: {{objective: dpo, lr_scheduler: constant, {}}}
preference: {{{}}}
checkpoint: {{output_dir: {}/{}}}
track: {{mongodb: false}}
)",
                                     LORARUN_MODEL_FIXTURES, jsonl, data, train, preference, dir, name);
  return path;
}

std::vector<nlohmann::json> train_rows(const std::string& run_dir) {
  std::vector<nlohmann::json> rows;
  std::ifstream in(run_dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const auto row = nlohmann::json::parse(line);
    if (row.contains("loss")) rows.push_back(row);
  }
  return rows;
}

// Runs the TRL oracle `cmd`, requires its match and shows what it measured for `name`.
void check_against_trl(const std::string& cmd, const std::string& name) {
  const Oracle ref = oracle(cmd);
  INFO(ref.run.output);
  CHECK(ref.run.status == 0);
  CHECK(ref.fields.value("match", false));
  WARN(fmt::format(
      "{}: loss {:.6f} -> {:.6f}, worst relative figure difference {:.2e}, adapter {:.2e} of its largest weight", name,
      ref.fields.value("first_loss", 0.0), ref.fields.value("last_loss", 0.0),
      ref.fields.value("worst_relative_figure_diff", 1.0), ref.fields.value("worst_relative_weight_diff", 1.0)));
}

// `train` (a lora-train command writing `dir`/k, 2 epochs of 6 steps) killed (-9) mid-epoch after a
// state, then run again: it resumes, to the adapter of the uninterrupted run in `dir`/w1b4a1. Returns
// the second run.
Result killed_then_resumed(const std::string& train, const std::string& dir) {
  const std::string cmd = train + " checkpoint.state_every_n_steps=2";
  const Result killed = interrupt(cmd, dir + "/k.log", "epoch 0/2 step 4/6", "kill -9 $pid");
  INFO(read_file(dir + "/k.log"));
  REQUIRE_THAT(killed.output, Catch::Contains("exit=137"));
  REQUIRE_THAT(read_file(dir + "/k.log"), !Catch::Contains("done:"));
  const Result again = sh(cmd);
  INFO(again.output);
  REQUIRE(again.status == 0);
  CHECK_THAT(again.output, Catch::Contains("resuming at epoch "));
  CHECK(sh(fmt::format("cmp {}/w1b4a1/epoch_1/adapter_model.safetensors {}/k/epoch_1/adapter_model.safetensors", dir,
                       dir))
            .status == 0);
  return again;
}

// The largest difference of `key` between two runs' rows, step by step (a step may lack it, as a
// KTO step without an example of one label does: then in both runs; else infinite).
double worst_diff(const std::vector<nlohmann::json>& a, const std::vector<nlohmann::json>& b, const std::string& key) {
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i) {
    if (a[i].contains(key) != b[i].contains(key)) return INFINITY;
    if (a[i].contains(key)) worst = std::max(worst, std::abs(a[i][key].get<double>() - b[i][key].get<double>()));
  }
  return worst;
}

// The largest magnitude of `keys` over a run's rows.
double largest(const std::vector<nlohmann::json>& rows, const std::vector<std::string>& keys) {
  double m = 0;
  for (const auto& row : rows)
    for (const std::string& key : keys)
      if (row.contains(key)) m = std::max(m, std::abs(row[key].get<double>()));
  return m;
}

}  // namespace

TEST_CASE(
    "dpo, orpo, cpo and simpo: lora-train equals TRL's DPOTrainer, ORPOTrainer and CPOTrainer step by step: sigmoid, "
    "ipo, hinge, RPO, lora.init_from as the reference, conversations, and CPO's sigmoid, hinge, ipo and simpo losses "
    "with and without its NLL",
    "[e2e][reference][preference]") {
  const std::string dir = temp_dir("dpo-trl");
  write_pairs(dir + "/pairs.jsonl", 20);  // 10 steps of 2 pairs
  // the same pairs as conversations (TRL's conversational preference format)
  as_conversations(dir + "/pairs.jsonl", dir + "/conversations.jsonl", {"chosen", "rejected"});
  // lorarun's built-in chatml, as a Jinja template for TRL
  std::ofstream(dir + "/chatml.jinja")
      << "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  const std::string role_tags = std::string(LORARUN_SOURCE_DIR) + "/tests/data/chat_templates/role_tags.jinja";
  const std::string script =
      fmt::format("'{}' '{}/tests/reference/dpo_reference.py'", LORARUN_PYTHON, LORARUN_SOURCE_DIR);
  REQUIRE(sh(fmt::format("{} init {}/llama {}/fresh 4 8 7", script, LORARUN_MODEL_FIXTURES, dir)).status == 0);
  // (a trained head of its own: the per-row losses' gradient for the head, a reference that keeps the start's head)
  REQUIRE(sh(fmt::format("{} init {}/llama {}/fresh-head 4 8 7 lm_head", script, LORARUN_MODEL_FIXTURES, dir)).status ==
          0);
  // (A and B random: the adapter is a model of its own, and the reference TRL re-trains from)
  REQUIRE(sh(fmt::format("'{}' '{}/tests/reference/train_reference.py' init {}/llama {}/trained 4 8 7", LORARUN_PYTHON,
                         LORARUN_SOURCE_DIR, LORARUN_MODEL_FIXTURES, dir))
              .status == 0);
  struct Case {
    std::string loss, beta, rpo, init;                // rpo_alpha or "none"; the starting adapter is the reference
    std::string data = "pairs", ours = "", trl = "";  // the data file; overrides; dpo_reference.py's options
  };
  for (const Case& c : {Case{"sigmoid", "0.1", "none", "fresh"}, Case{"ipo", "0.5", "none", "fresh"},
                        Case{"hinge", "0.2", "none", "fresh"}, Case{"sigmoid", "0.1", "1.0", "fresh"},
                        Case{"sigmoid", "0.3", "none", "trained"},
                        Case{"sigmoid", "0.1", "none", "fresh-head", "pairs", "lora.modules_to_save=[lm_head]"},
                        Case{"sigmoid", "0.1", "none", "fresh", "conversations",
                             fmt::format("data.chat_format=template data.chat_template={}", role_tags),
                             fmt::format("--chat-template={}", role_tags)},
                        Case{"sigmoid", "0.1", "none", "fresh", "conversations", "data.chat_format=chatml",
                             fmt::format("--chat-template={}/chatml.jinja", dir)},
                        Case{"orpo", "0.1", "none", "trained"},
                        Case{"orpo", "0.2", "none", "trained", "conversations", "data.chat_format=chatml",
                             fmt::format("--chat-template={}/chatml.jinja", dir)},
                        Case{"cpo-sigmoid", "0.1", "1.0", "trained"}, Case{"cpo-hinge", "0.2", "0.5", "fresh"},
                        Case{"cpo-ipo", "0.5", "none", "trained"}, Case{"cpo-simpo", "0.1", "1.0", "trained"},
                        Case{"simpo", "2.0", "none", "trained"}}) {
    const std::string format = c.ours.empty() || c.ours.starts_with("lora.") ? ""
                               : c.ours.find("chatml") != std::string::npos  ? "-chatml"
                                                                             : "-template";
    const std::string name = fmt::format("{}-{}-{}-{}{}", c.loss, c.rpo, c.init, c.data, format);
    INFO(name);
    // orpo: TRL's ORPOTrainer (beta its lambda, no loss type); cpo-T: its CPOTrainer with loss T and
    // rpo as cpo_alpha; simpo: the CPOTrainer's simpo loss with cpo_alpha 0
    const bool orpo = c.loss == "orpo", simpo = c.loss == "simpo", cpo = c.loss.starts_with("cpo-");
    const std::string nll = cpo               ? fmt::format(", cpo_alpha: {}", c.rpo == "none" ? "0" : c.rpo)
                            : c.rpo == "none" ? ""
                                              : fmt::format(", rpo_alpha: {}", c.rpo);
    const std::string preference =
        orpo || simpo ? fmt::format("beta: {}", c.beta)
                      : fmt::format("beta: {}, loss_type: {}{}", c.beta, cpo ? c.loss.substr(4) : c.loss, nll);
    const std::string objective = orpo    ? "train.objective=orpo"
                                  : cpo   ? "train.objective=cpo"
                                  : simpo ? "train.objective=simpo"
                                          : "";
    const std::string recipe = write_dpo_recipe(dir, name, "epochs: 1, lr: 5.0e-3", preference, ", batch_size: 2");
    const Result t = sh(fmt::format("{} {} lora.init_from={}/{} data.path={}/{}.jsonl {} {}", bin("lora-train"), recipe,
                                    dir, c.init, dir, c.data, c.ours, objective));
    INFO(t.output);
    REQUIRE(t.status == 0);
    // Figures within 1e-5, the adapter within 1e-3 of its largest weight: AdamW at lr 5e-3 turns
    // rounding-level gradient differences into weight differences that depend on the CPU (measured
    // 4e-6 to 4e-5, and 3.5e-4 for the role-tags template on one Xeon whose run is right to 1.6e-6
    // in every figure); a wrong gradient is off by ~1.
    check_against_trl(fmt::format("{} check {}/llama {}/{} {}/{}.jsonl {}/{} {} {} {} 10 2 5e-3 64 1e-5 1e-3 {}",
                                  script, LORARUN_MODEL_FIXTURES, dir, c.init, dir, c.data, dir, name,
                                  simpo ? "cpo-simpo" : c.loss, c.beta, c.rpo, c.trl),
                      name);
  }
}

TEST_CASE(
    "dpo and cpo (simpo loss): 1 rank x 4 pairs = 2 ranks x 2 = 1 rank x 2 x accumulation 2, pairs read from "
    "FerretDB, and kill -9 then resume gives the same adapter",
    "[e2e][db][preference]") {
  const std::string dir = temp_dir("dpo-ranks");
  write_pairs(dir + "/pairs.jsonl", 24);
  const std::string db = fmt::format("dpo_{}", getpid());
  const Result imp = sh(fmt::format("{} import {}/pairs.jsonl --uri '{}' --db {} --collection pairs", bin("lora-data"),
                                    dir, test_uri(), db));
  INFO(imp.output);
  REQUIRE(imp.status == 0);
  const std::string env = fmt::format("LORARUN_MONGODB_URI='{}'", test_uri());
  const std::string source = fmt::format(", source: mongodb, database: {}, collection: pairs", db);
  // DPO with RPO's NLL, and CPO's simpo loss with its NLL (no reference, mean log-probabilities)
  for (const auto& [objective, preference] : {std::pair{"dpo", "beta: 0.2, rpo_alpha: 0.5"},
                                              std::pair{"cpo", "beta: 0.2, loss_type: simpo, cpo_alpha: 0.5"}}) {
    std::vector<nlohmann::json> first;
    const std::string prefix = objective == std::string("dpo") ? "" : "cpo-";
    for (const auto& [world, batch, accum] : {std::tuple{1, 4, 1}, std::tuple{2, 2, 1}, std::tuple{1, 2, 2}}) {
      const std::string name = fmt::format("{}w{}b{}a{}", prefix, world, batch, accum);
      INFO(name);
      const std::string recipe =
          write_dpo_recipe(dir, name, fmt::format("epochs: 2, lr: 5.0e-3, gradient_accumulation_steps: {}", accum),
                           preference, fmt::format("{}, batch_size: {}", source, batch));
      const Result t = sh(fmt::format("{} {} --nproc-per-node {} {} train.objective={}", env, bin("lorarun"), world,
                                      recipe, objective));
      INFO(t.output);
      REQUIRE(t.status == 0);
      const std::vector<nlohmann::json> rows = train_rows(dir + "/" + name);
      REQUIRE(rows.size() == 12);  // 24 pairs, 4 a step, 2 epochs
      if (first.empty()) {
        first = rows;
        continue;
      }
      // Each figure within 1e-6 of its largest magnitude over the run; a reward, beta times the
      // difference of two float32 log-probabilities (summed over other batch shapes), within 1e-6 of
      // beta times theirs.
      for (const std::string key : {"loss", "rewards/chosen", "rewards/margins", "logps/rejected", "nll_loss"}) {
        INFO(key);
        const bool reward = key.starts_with("rewards/");
        const double scale = reward ? 0.2 * largest(first, {"logps/chosen"}) : largest(first, {key});
        CHECK(worst_diff(rows, first, key) <= 1e-6 * scale);
      }
      // The adapter within 1e-4 of its largest weight: AdamW at lr 5e-3 turns the rounding of other
      // sums (2 ranks, other batch shapes, the CPU's kernels) into steps of up to the lr on weights
      // whose gradients are near 0. Measured on an AVX-512/AMX Xeon: DPO 1.5e-6, CPO 1.6e-5 (2 ranks);
      // a wrong gradient moves it by ~1. The figures above hold the maths to 1e-6.
      CHECK(adapter_relative_diff(fmt::format("{}/{}w1b4a1/epoch_1/adapter_model.safetensors", dir, prefix),
                                  dir + "/" + name + "/epoch_1/adapter_model.safetensors") < 1e-4);
    }
  }
  // Killed (-9) mid-epoch after a state, then the same command: the uninterrupted run's adapter.
  const std::string recipe = write_dpo_recipe(dir, "k", "epochs: 2, lr: 5.0e-3", "beta: 0.2, rpo_alpha: 0.5",
                                              fmt::format("{}, batch_size: 4", source));
  killed_then_resumed(fmt::format("{} {} {}", env, bin("lora-train"), recipe), dir);
}

TEST_CASE(
    "dpo: bad pairs are counted and skipped, an eval split reports the preference metrics, bad recipes are one line",
    "[e2e][preference]") {
  const std::string dir = temp_dir("dpo-bad");
  write_pairs(dir + "/pairs.jsonl", 8);
  {
    std::ofstream out(dir + "/pairs.jsonl", std::ios::app);
    out << R"({"prompt": "Q: no rejected\nA: ", "chosen": "1"})" << "\n";
    out << R"({"prompt": "Q: same\nA: ", "chosen": "2", "rejected": "2"})" << "\n";
    out << nlohmann::json{{"prompt", std::string(300, 'x')}, {"chosen", "3"}, {"rejected", "4"}}.dump() << "\n";
  }
  write_pairs(dir + "/eval.jsonl", 4, 50);
  const std::string recipe = write_dpo_recipe(dir, "b", "epochs: 1, lr: 5.0e-3", "beta: 0.1", ", batch_size: 2");
  const Result t =
      sh(fmt::format("{} {} eval.path={}/eval.jsonl data.max_skipped_share=0.3", bin("lora-train"), recipe, dir));
  INFO(t.output);
  REQUIRE(t.status == 0);
  CHECK_THAT(t.output, Catch::Contains("field 'rejected' is missing"));
  CHECK_THAT(t.output, Catch::Contains("the chosen and the rejected completion are the same"));
  CHECK_THAT(t.output, Catch::Contains("data.max_length is 64"));
  CHECK_THAT(t.output, Catch::Contains("3 documents were skipped on all ranks together: 1 malformed, 1 untrainable, "
                                       "1 overlong"));
  std::vector<nlohmann::json> evals;
  std::ifstream in(dir + "/b/metrics.jsonl");
  for (std::string line; std::getline(in, line);)
    if (auto row = nlohmann::json::parse(line); row.contains("eval_loss")) evals.push_back(row);
  REQUIRE(evals.size() == 1);
  CHECK(evals[0].at("eval_documents") == 4);
  CHECK(evals[0].at("eval_rewards/accuracies").get<double>() >= 0);
  CHECK(evals[0].contains("eval_rewards/margins"));
  // lora-eval --recipe scores the epoch's adapter on the same split: the figures of that evaluation.
  const Result scored = sh(fmt::format("{} --recipe {} --adapter {}/b/epoch_0 --json eval.path={}/eval.jsonl",
                                       bin("lora-eval"), recipe, dir, dir));
  INFO(scored.output);
  REQUIRE(scored.status == 0);
  const auto got = nlohmann::json::parse(lines_with(scored.output, "\"pairs\"").at(0));
  CHECK(got.at("pairs") == 4);
  CHECK(got.at("loss").get<double>() == Approx(evals[0].at("eval_loss").get<double>()).epsilon(1e-9));
  for (const char* key : {"rewards/accuracies", "rewards/margins", "logps/chosen"})
    CHECK(got.at(key).get<double>() == Approx(evals[0].at(std::string("eval_") + key).get<double>()).epsilon(1e-9));

  // Recipes that cannot train pairs: one line each, nothing written.
  for (const auto& [override_, says] :
       {std::pair{"data.format=instruction 'data.prompt_template=Q: {prompt}'", "train.objective dpo trains on pairs"},
        std::pair{"train.objective=sft", "train.objective is sft, but data.format: preference"},
        std::pair{"preference.label_smoothing=0.1 preference.loss_type=ipo", "preference.label_smoothing applies to"},
        std::pair{"data.packing=true", "does not pack pairs"}}) {
    INFO(override_);
    const Result bad =
        sh(fmt::format("{} {} {} checkpoint.output_dir={}/never", bin("lora-train"), recipe, override_, dir));
    CHECK(bad.status != 0);
    CHECK_THAT(bad.output, Catch::Contains(says));
    CHECK(lines_with(bad.output, "error").size() == 1);
    CHECK(!std::filesystem::exists(dir + "/never/epoch_0"));
  }
}

TEST_CASE(
    "dpo composes: activation checkpointing and dist.shard_base on 2 ranks give the same run, QLoRA trains (kto "
    "too)",
    "[e2e][preference]") {
  const std::string dir = temp_dir("dpo-compose");
  write_pairs(dir + "/pairs.jsonl", 16);
  write_unpaired(dir + "/answers.jsonl", 16, [](int i) { return i % 2 == 0; });
  REQUIRE(sh(fmt::format("'{}' '{}/tests/reference/train_reference.py' init {}/llama {}/trained 4 8 7", LORARUN_PYTHON,
                         LORARUN_SOURCE_DIR, LORARUN_MODEL_FIXTURES, dir))
              .status == 0);
  const std::string recipe =
      write_dpo_recipe(dir, "plain", "epochs: 1, lr: 5.0e-3", "beta: 0.3, rpo_alpha: 0.5", ", batch_size: 2");
  const auto run = [&](const std::string& name, int ranks, const std::string& overrides = "") {
    const Result t =
        sh(fmt::format("{} --nproc-per-node {} {} lora.init_from={}/trained checkpoint.output_dir={}/{} {}",
                       bin("lorarun"), ranks, recipe, dir, dir, name, overrides));
    INFO(t.output);
    REQUIRE(t.status == 0);
    return train_rows(dir + "/" + name);
  };
  const std::vector<nlohmann::json> plain = run("plain", 1);
  const std::vector<nlohmann::json> recompute = run("recompute", 1, "train.activation_checkpointing=true");
  const std::vector<nlohmann::json> sharded = run("sharded", 2, "dist.shard_base=true data.batch_size=1");
  const std::vector<nlohmann::json> qlora = run("qlora", 1, "lora.quantize_base=true");
  const std::vector<nlohmann::json> kto_qlora =
      run("kto-qlora", 1,
          fmt::format("lora.quantize_base=true train.objective=kto data.format=unpaired preference.rpo_alpha=null "
                      "data.path={}/answers.jsonl",
                      dir));
  REQUIRE(plain.size() == 8);
  REQUIRE(sharded.size() == 8);
  for (size_t i = 0; i < plain.size(); ++i) {
    CHECK(recompute[i].at("loss") == plain[i].at("loss"));
    CHECK(recompute[i].at("rewards/margins") == plain[i].at("rewards/margins"));
    CHECK(sharded[i].at("loss").get<double>() == Approx(plain[i].at("loss").get<double>()).epsilon(1e-6));
  }
  CHECK(adapter_diff(dir + "/plain/epoch_0/adapter_model.safetensors",
                     dir + "/recompute/epoch_0/adapter_model.safetensors") == 0);
  CHECK(adapter_diff(dir + "/plain/epoch_0/adapter_model.safetensors",
                     dir + "/sharded/epoch_0/adapter_model.safetensors") < 1e-6);
  REQUIRE(qlora.size() == 8);
  CHECK(qlora.back().at("loss").get<double>() != plain.back().at("loss").get<double>());  // (an NF4 base)
  CHECK(std::isfinite(qlora.back().at("rewards/margins").get<double>()));
  REQUIRE(kto_qlora.size() == 8);
  CHECK(std::isfinite(kto_qlora.back().at("kl").get<double>()));
  CHECK(kto_qlora.back().at("loss").get<double>() != kto_qlora.front().at("loss").get<double>());
}

TEST_CASE(
    "dpo, simpo and kto on SmolLM2 from its GGUF equal TRL's DPOTrainer (from a trained adapter as the reference), "
    "CPOTrainer and KTOTrainer step by step",
    "[e2e][reference][preference][gguf]") {
  const std::string smollm2 =
      std::string(LORARUN_SOURCE_DIR) + "/.fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";
  if (!std::filesystem::exists(smollm2)) FAIL(smollm2 << " is missing: run scripts/setup (or scripts/fetch-models)");
  const std::string dir = temp_dir("dpo-smollm2");
  write_pairs(dir + "/pairs.jsonl", 10);                                               // 5 steps of 2 pairs
  write_unpaired(dir + "/answers.jsonl", 10, [](int i) { return i % 3 != 1; }, true);  // 5 steps of 2 answers
  REQUIRE(sh(fmt::format("'{}' '{}/tests/reference/train_reference.py' init {} {}/trained 4 8 7", LORARUN_PYTHON,
                         LORARUN_SOURCE_DIR, smollm2, dir))
              .status == 0);
  const std::string recipe =
      write_dpo_recipe(dir, "s", "epochs: 1, lr: 1.0e-4", "beta: 0.1, rpo_alpha: 0.5", ", batch_size: 2");
  // lora-train from the trained adapter into `dir`/`out` with `overrides`, then TRL (`script`: its
  // arguments after the data file `data` and ours, `trl`) on the same documents
  const auto against_trl = [&](const std::string& out, const std::string& overrides, const std::string& script,
                               const std::string& data, const std::string& trl, const std::string& name) {
    const Result t =
        sh(fmt::format("{} {} model.path={} lora.init_from={}/trained checkpoint.output_dir={}/{} data.path={}/{} {}",
                       bin("lora-train"), recipe, smollm2, dir, dir, out, dir, data, overrides));
    INFO(t.output);
    REQUIRE(t.status == 0);
    check_against_trl(fmt::format("'{}' '{}/tests/reference/{}' check {} {}/trained {}/{} {}/{} {}", LORARUN_PYTHON,
                                  LORARUN_SOURCE_DIR, script, smollm2, dir, dir, data, dir, out, trl),
                      name);
  };
  // Every figure within 1e-5; the adapter within 2e-3 of its largest weight: AdamW moves a weight
  // whose gradient is rounding noise by about lr either way (measured here: figures 2.8e-6, adapter
  // 7.8e-4 at lr 1e-4 and 7.7e-3 at lr 1e-3, in proportion to lr), where a wrong gradient would show
  // in the figures of the steps after it. (dpo_reference.py's loss, beta, NLL weight; 5 steps of 2.)
  against_trl("s", "", "dpo_reference.py", "pairs.jsonl", "sigmoid 0.1 0.5 5 2 1e-4 64 1e-5 2e-3", "SmolLM2 DPO + RPO");
  // SimPO (CPO's simpo loss, no NLL) from the same adapter, at SimPO's beta and lr 3e-5: its figures
  // (beta 2 x mean log-probs) drift from TRL's as the adapters part by rounding noise (measured: step 1
  // within 1.1e-6 at any lr; by step 5, 1.9e-5 at lr 1e-4, 4.9e-6 at 3e-5)
  against_trl("simpo", "train.objective=simpo preference.beta=2.0 preference.rpo_alpha=null train.lr=3.0e-5",
              "dpo_reference.py", "pairs.jsonl", "cpo-simpo 2.0 none 5 2 3e-5 64 1e-5 2e-3", "SmolLM2 SimPO");
  // KTO from the same adapter on labelled answers (2:1), the undesirable ones weighted 2, at lr 3e-5
  // (measured: 4.2e-6; 9.4e-6 at lr 1e-4, the adapters parting by rounding noise as above)
  against_trl("kto",
              "train.objective=kto data.format=unpaired preference.rpo_alpha=null preference.undesirable_weight=2.0 "
              "train.lr=3.0e-5",
              "kto_reference.py", "answers.jsonl", "kto 0.1 1.0 2.0 5 2 3e-5 64 1e-5 2e-3", "SmolLM2 KTO");
}

TEST_CASE(
    "kto: lora-train equals TRL's KTOTrainer step by step: balanced and unbalanced labels, desirable and undesirable "
    "weights, batches of one label, apo_zero_unpaired, a trained adapter or the base as the reference, conversations",
    "[e2e][reference][preference]") {
  const std::string dir = temp_dir("kto-trl");
  write_unpaired(dir + "/balanced.jsonl", 40, [](int i) { return i % 2 == 0; });
  write_unpaired(dir + "/unbalanced.jsonl", 40, [](int i) { return i % 4 != 3; }, true);
  write_unpaired(dir + "/runs.jsonl", 40, [](int i) { return i / 4 % 2 == 0; });  // each batch of 4 one label
  as_conversations(dir + "/balanced.jsonl", dir + "/conversations.jsonl", {"completion"});
  std::ofstream(dir + "/chatml.jinja")
      << "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}";
  REQUIRE(sh(fmt::format("'{}' '{}/tests/reference/dpo_reference.py' init {}/llama {}/fresh 4 8 7", LORARUN_PYTHON,
                         LORARUN_SOURCE_DIR, LORARUN_MODEL_FIXTURES, dir))
              .status == 0);
  REQUIRE(sh(fmt::format("'{}' '{}/tests/reference/train_reference.py' init {}/llama {}/trained 4 8 7", LORARUN_PYTHON,
                         LORARUN_SOURCE_DIR, LORARUN_MODEL_FIXTURES, dir))
              .status == 0);
  struct Case {
    std::string data, loss, beta, desirable, undesirable, init, ours = "", trl = "";
  };
  for (const Case& c :
       {Case{"balanced", "kto", "0.1", "1.0", "1.0", "trained"},
        Case{"unbalanced", "kto", "0.2", "1.0", "2.0", "fresh"}, Case{"runs", "kto", "0.1", "1.33", "1.0", "trained"},
        Case{"balanced", "apo_zero_unpaired", "0.1", "1.0", "1.5", "trained"},
        Case{"conversations", "kto", "0.1", "1.0", "1.0", "trained", "data.chat_format=chatml",
             fmt::format("--chat-template={}/chatml.jinja", dir)}}) {
    const std::string name = fmt::format("{}-{}-{}-{}-{}", c.data, c.loss, c.desirable, c.undesirable, c.init);
    INFO(name);
    const std::string recipe =
        write_dpo_recipe(dir, name, "epochs: 1, lr: 5.0e-3",
                         fmt::format("beta: {}, loss_type: {}, desirable_weight: {}, undesirable_weight: {}", c.beta,
                                     c.loss, c.desirable, c.undesirable),
                         ", batch_size: 4");
    const Result t =
        sh(fmt::format("{} {} train.objective=kto data.format=unpaired lora.init_from={}/{} data.path={}/{}.jsonl {}",
                       bin("lora-train"), recipe, dir, c.init, dir, c.data, c.ours));
    INFO(t.output);
    REQUIRE(t.status == 0);
    // 10 steps: figures within 1e-5 (measured 1.7e-7 to 2.4e-7), the adapter within 1e-3 of its largest weight
    // (measured 9.4e-6 to 6.5e-5: AdamW at lr 5e-3 moves weights whose gradient is rounding noise)
    check_against_trl(fmt::format("'{}' '{}/tests/reference/kto_reference.py' check {}/llama {}/{} {}/{}.jsonl {}/{} "
                                  "{} {} {} {} 10 4 5e-3 64 1e-5 1e-3 {}",
                                  LORARUN_PYTHON, LORARUN_SOURCE_DIR, LORARUN_MODEL_FIXTURES, dir, c.init, dir, c.data,
                                  dir, name, c.loss, c.beta, c.desirable, c.undesirable, c.trl),
                      name);
  }
}

TEST_CASE(
    "kto: 1 rank x 4 = 2 ranks x 2 = 1 rank x 2 x accumulation 2 from FerretDB, kill -9 then resume gives the same "
    "adapter, bad labels are counted and skipped, an eval split reports KTO's figures",
    "[e2e][db][preference]") {
  const std::string dir = temp_dir("kto-ranks");
  write_unpaired(dir + "/examples.jsonl", 24, [](int i) { return i % 3 != 2; });
  const std::string db = fmt::format("kto_{}", getpid());
  const Result imp = sh(fmt::format("{} import {}/examples.jsonl --uri '{}' --db {} --collection examples",
                                    bin("lora-data"), dir, test_uri(), db));
  INFO(imp.output);
  REQUIRE(imp.status == 0);
  const std::string env = fmt::format("LORARUN_MONGODB_URI='{}'", test_uri());
  const std::string source = fmt::format(", source: mongodb, database: {}, collection: examples", db);
  const std::string kto = "train.objective=kto data.format=unpaired";
  std::vector<nlohmann::json> first;
  for (const auto& [world, batch, accum] : {std::tuple{1, 4, 1}, std::tuple{2, 2, 1}, std::tuple{1, 2, 2}}) {
    const std::string name = fmt::format("w{}b{}a{}", world, batch, accum);
    INFO(name);
    const std::string recipe =
        write_dpo_recipe(dir, name, fmt::format("epochs: 2, lr: 5.0e-3, gradient_accumulation_steps: {}", accum),
                         "beta: 0.2, undesirable_weight: 2.0", fmt::format("{}, batch_size: {}", source, batch));
    const Result t = sh(fmt::format("{} {} --nproc-per-node {} {} {}", env, bin("lorarun"), world, recipe, kto));
    INFO(t.output);
    REQUIRE(t.status == 0);
    const std::vector<nlohmann::json> rows = train_rows(dir + "/" + name);
    REQUIRE(rows.size() == 12);  // 24 examples, 4 a step, 2 epochs
    if (first.empty()) {
      first = rows;
      continue;
    }
    // The loss within 1e-6 of its largest; the log-probability figures (sums over a completion's
    // tokens, the KL estimate and rewards their differences) within 1e-6 of the largest log-probability
    // (measured: 1e-7 of it, float32 sums in another order)
    const double logps = largest(first, {"logps/chosen", "logps/rejected"}), loss = largest(first, {"loss"});
    for (const std::string key :
         {"loss", "kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"}) {
      INFO(key);
      CHECK(worst_diff(rows, first, key) <= 1e-6 * (key == "loss" ? loss : logps));
    }
    // (AdamW at lr 5e-3 over 12 steps turns those rounding differences into 1e-5 of the largest weight)
    CHECK(adapter_relative_diff(dir + "/w1b4a1/epoch_1/adapter_model.safetensors",
                                dir + "/" + name + "/epoch_1/adapter_model.safetensors") < 1e-4);
  }
  // Killed (-9) mid-epoch after a state, then the same command: the uninterrupted run's adapter.
  const std::string recipe = write_dpo_recipe(dir, "k", "epochs: 2, lr: 5.0e-3", "beta: 0.2, undesirable_weight: 2.0",
                                              fmt::format("{}, batch_size: 4", source));
  killed_then_resumed(fmt::format("{} {} {} {}", env, bin("lora-train"), recipe, kto), dir);
  // Bad labels are bad documents (one line each, counted); an eval split gets KTO's figures.
  {
    std::ofstream out(dir + "/bad.jsonl");
    std::ifstream in(dir + "/examples.jsonl");
    out << in.rdbuf();
    out << R"({"prompt": "Q: label 2\nA: ", "completion": "1", "label": 2})" << "\n";
    out << R"({"prompt": "Q: label text\nA: ", "completion": "1", "label": "yes"})" << "\n";
    out << R"({"prompt": "Q: no label\nA: ", "completion": "1"})" << "\n";
  }
  write_unpaired(dir + "/eval.jsonl", 6, [](int i) { return i % 2 == 0; }, false, 50);
  const std::string bad = write_dpo_recipe(dir, "bad", "epochs: 1, lr: 5.0e-3", "beta: 0.1", ", batch_size: 4");
  const Result t = sh(fmt::format("{} {} {} data.path={}/bad.jsonl eval.path={}/eval.jsonl data.max_skipped_share=0.2",
                                  bin("lora-train"), bad, kto, dir, dir));
  INFO(t.output);
  REQUIRE(t.status == 0);
  CHECK_THAT(t.output, Catch::Contains("field 'label' is the number 2, neither true/false nor 1/0"));
  CHECK_THAT(t.output, Catch::Contains("field 'label' is a string, neither true/false nor 1/0"));
  CHECK_THAT(t.output, Catch::Contains("field 'label' is missing"));
  CHECK_THAT(t.output, Catch::Contains("3 documents were skipped on all ranks together: 3 malformed"));
  std::vector<nlohmann::json> evals;
  std::ifstream in(dir + "/bad/metrics.jsonl");
  for (std::string line; std::getline(in, line);)
    if (auto row = nlohmann::json::parse(line); row.contains("eval_loss")) evals.push_back(row);
  REQUIRE(evals.size() == 1);
  CHECK(evals[0].at("eval_documents") == 6);
  for (const char* key : {"eval_kl", "eval_rewards/chosen", "eval_rewards/rejected", "eval_rewards/margins"})
    CHECK(std::isfinite(evals[0].at(key).get<double>()));
  // lora-eval --recipe scores the epoch's adapter on the same split alike
  const Result scored =
      sh(fmt::format("{} --recipe {} {} --adapter {}/bad/epoch_0 --json data.path={}/bad.jsonl eval.path={}/eval.jsonl",
                     bin("lora-eval"), bad, kto, dir, dir, dir));
  INFO(scored.output);
  REQUIRE(scored.status == 0);
  const auto got = nlohmann::json::parse(lines_with(scored.output, "\"examples\"").at(0));
  CHECK(got.at("examples") == 6);
  CHECK(got.at("loss").get<double>() == Approx(evals[0].at("eval_loss").get<double>()).epsilon(1e-6));
  CHECK(got.at("kl").get<double>() == Approx(evals[0].at("eval_kl").get<double>()).epsilon(1e-6).margin(1e-9));
}

TEST_CASE(
    "preference.precompute_reference: dpo and kto with it = without it (1 rank, and 2 ranks on a sharded base) from "
    "FerretDB, kill -9 then resume reads them back, changed documents have them computed again",
    "[e2e][db][preference]") {
  const std::string dir = temp_dir("precompute");
  write_pairs(dir + "/pairs.jsonl", 24);
  write_unpaired(dir + "/examples.jsonl", 24, [](int i) { return i % 3 != 2; });
  const std::string db = fmt::format("precompute_{}", getpid());
  for (const char* c : {"pairs", "examples"}) {
    const Result imp = sh(fmt::format("{} import {}/{}.jsonl --uri '{}' --db {} --collection {}", bin("lora-data"), dir,
                                      c, test_uri(), db, c));
    INFO(imp.output);
    REQUIRE(imp.status == 0);
  }
  const std::string env = fmt::format("LORARUN_MONGODB_URI='{}'", test_uri());
  const auto recipe = [&](const std::string& name, const std::string& collection) {
    return write_dpo_recipe(
        dir, name, "epochs: 2, lr: 5.0e-3", "beta: 0.2",
        fmt::format(", source: mongodb, database: {}, collection: {}, batch_size: 4", db, collection));
  };
  const std::string precompute = " data.shuffle=global preference.precompute_reference=true";
  for (const auto& [objective, collection] : {std::pair{"dpo", "pairs"}, std::pair{"kto", "examples"}}) {
    INFO(objective);
    const std::string o = objective == std::string("dpo") ? "" : "kto-";
    const std::string extra = o.empty() ? "" : " train.objective=kto data.format=unpaired";
    const auto run = [&](const std::string& name, int world, const std::string& overrides) {
      const Result t = sh(fmt::format("{} {} --nproc-per-node {} {}{} {}", env, bin("lorarun"), world,
                                      recipe(o + name, collection), extra, overrides));
      INFO(t.output);
      REQUIRE(t.status == 0);
      return std::pair{train_rows(dir + "/" + o + name), t.output};
    };
    const auto [plain, plain_out] = run("plain", 1, "data.shuffle=global");
    const auto [pre, pre_out] = run("w1b4a1", 1, precompute);
    const auto [sharded, sharded_out] = run("sharded", 2, precompute + " dist.shard_base=true data.batch_size=2");
    CHECK_THAT(pre_out, Catch::Contains("the reference's log-probs of 24 examples of epoch 0"));
    CHECK_THAT(sharded_out, Catch::Contains("the reference's log-probs of 24 examples of epoch 0"));
    REQUIRE(plain.size() == 12);
    REQUIRE(pre.size() == 12);
    REQUIRE(sharded.size() == 12);
    // Each figure within 1e-6 of the largest log-probability (the loss: of the largest loss). Epoch 1
    // reads the documents in other batches than epoch 0 computed them in: float32 sums in another order.
    const double logps = largest(plain, {"logps/chosen", "logps/rejected"}), loss = largest(plain, {"loss"});
    for (const std::string key : {"loss", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected"}) {
      INFO(key);
      const double scale = key == "loss" ? loss : logps;
      CHECK(worst_diff(pre, plain, key) <= 1e-6 * scale);
      CHECK(worst_diff(sharded, plain, key) <= 1e-6 * scale);
    }
    for (const char* run_dir : {"w1b4a1", "sharded"}) {
      INFO(run_dir);
      CHECK(adapter_relative_diff(fmt::format("{}/{}plain/epoch_1/adapter_model.safetensors", dir, o),
                                  fmt::format("{}/{}{}/epoch_1/adapter_model.safetensors", dir, o, run_dir)) < 1e-4);
    }
  }
  // Killed (-9) mid-epoch after a state, then the same command: the log-probs come back with the state
  // (not computed again), to the uninterrupted run's adapter.
  const std::string train = fmt::format("{} {} {}{}", env, bin("lora-train"), recipe("k", "pairs"), precompute);
  const Result again = killed_then_resumed(train, dir);
  CHECK_THAT(again.output, !Catch::Contains("the reference's log-probs of"));
  // Killed again, and the collection imported anew before the resume (the same count, other documents: the
  // state's position still fits): the log-probs are computed again, said in one line.
  const std::string cmd = train + " checkpoint.state_every_n_steps=2 checkpoint.output_dir=" + dir + "/c";
  REQUIRE_THAT(interrupt(cmd, dir + "/c.log", "epoch 0/2 step 4/6", "kill -9 $pid").output,
               Catch::Contains("exit=137"));
  write_pairs(dir + "/other.jsonl", 24, 1);
  REQUIRE(sh(fmt::format("{} import {}/other.jsonl --drop --uri '{}' --db {} --collection pairs", bin("lora-data"), dir,
                         test_uri(), db))
              .status == 0);
  const Result changed = sh(cmd);
  INFO(changed.output);
  REQUIRE(changed.status == 0);
  CHECK(lines_with(changed.output, "computing them again").size() == 1);
  CHECK_THAT(changed.output, Catch::Contains("were computed from other data: the selection held 24 documents then "
                                             "as now, but other ones"));
  CHECK_THAT(changed.output, Catch::Contains("the reference's log-probs of 24 examples"));
  // With checkpoint.store: mongodb they go to GridFS with the state: an output directory lost after a
  // state comes back from there, and the run resumes without computing them again.
  const std::string stored = fmt::format(
      "{} {} {}{} track.mongodb=true track.database={} checkpoint.store=mongodb checkpoint.state_every_n_steps=2 "
      "checkpoint.output_dir={}/s",
      env, bin("lora-train"), recipe("s", "pairs"), precompute, db, dir);
  REQUIRE_THAT(interrupt(stored, dir + "/s.log", "epoch 0/2 step 4/6", "kill -9 $pid").output,
               Catch::Contains("exit=137"));
  std::filesystem::remove_all(dir + "/s");
  const Result restored = sh(stored);
  INFO(restored.output);
  REQUIRE(restored.status == 0);
  CHECK_THAT(restored.output, Catch::Contains("resuming at epoch 0"));
  CHECK_THAT(restored.output, !Catch::Contains("the reference's log-probs of"));
}
