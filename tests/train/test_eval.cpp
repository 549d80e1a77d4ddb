// Evaluation while training (eval:): a held-out split of the JSONL documents, evaluated at each
// epoch end and every N steps; the same loss on 1, 2 and 3 ranks and as transformers + PEFT
// compute it for the same adapter; held-out documents never trained on; overlaps refused.
#include <fmt/format.h>
#include <unistd.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <vector>

#include "data/mongo.hpp"
#include "support/oracle.hpp"
#include "support/runs.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;
namespace fs = std::filesystem;

namespace {

// metrics.jsonl's rows: the training steps' and the evaluations'.
struct Metrics {
  std::vector<nlohmann::json> train, eval;
};

Metrics metrics(const std::string& out) {
  Metrics m;
  std::ifstream in(out + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json row = nlohmann::json::parse(line);
    (row.contains("eval_loss") ? m.eval : m.train).push_back(row);
  }
  return m;
}

// The number before `what` in `text` ("30 documents from" -> 30); -1 when absent.
int64_t count_before(const std::string& text, const std::string& what) {
  const size_t at = text.find(what);
  if (at == std::string::npos || at < 2) return -1;
  size_t from = text.rfind(' ', at - 2);
  from = from == std::string::npos ? 0 : from + 1;
  return std::stoll(text.substr(from, at - 1 - from));
}

double rel(double a, double b) { return std::abs(a - b) / std::max(1e-12, std::abs(b)); }

}  // namespace

TEST_CASE(
    "eval: a held-out split, at each epoch end and every N steps, equal on 1, 2 and 3 ranks and to "
    "transformers",
    "[e2e][reference]") {
  const std::string dir = temp_dir("eval");
  write_data(dir + "/data.jsonl", 40);
  const std::string eval = "eval: {fraction: 0.25, every_n_steps: 2}\n";

  // Training with a quarter held out, on 2 ranks.
  const std::string a = write_recipe(dir, "a", "epochs: 2, lr: 1.0e-3", "", ", batch_size: 3", eval);
  const Result run = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), a));
  INFO(run.output);
  REQUIRE(run.status == 0);

  // transformers + PEFT on the documents the same hash holds out, with the last adapter.
  const Oracle ref =
      oracle(fmt::format("'{}' '{}/tests/reference/train_reference.py' eval {}/llama {}/a/epoch_1 "
                         "{}/data.jsonl 0.25",
                         LORARUN_PYTHON, LORARUN_SOURCE_DIR, LORARUN_MODEL_FIXTURES, dir, dir));
  INFO(ref.run.output);
  REQUIRE(ref.run.status == 0);
  const int64_t held = ref.fields.at("eval_documents"), trained = ref.fields.at("train_documents");
  const double want = ref.fields.at("eval_loss");
  REQUIRE(held > 0);
  REQUIRE(held + trained == 40);

  // (d) the held-out documents are not in the training selection, and are all evaluated.
  CHECK_THAT(run.output, Catch::Contains(fmt::format("{} documents from", trained)));
  CHECK_THAT(run.output, Catch::Contains(fmt::format("evaluating on {} documents", held)));
  // lora-data stats counts what training reads.
  const Result stats = sh(fmt::format("{} stats {}", bin("lora-data"), a));
  CHECK_THAT(stats.output, Catch::Contains(fmt::format(" {} selected", trained)));
  const Result eval_stats = sh(fmt::format("{} stats {} --split eval", bin("lora-data"), a));
  CHECK_THAT(eval_stats.output, Catch::Contains(fmt::format(" {} selected", held)));

  // (a) an evaluation at each epoch end and every 2 steps, each once.
  const Metrics m = metrics(dir + "/a");
  const int64_t per_rank = (trained + 1) / 2, steps_per_epoch = (per_rank + 2) / 3;
  REQUIRE(static_cast<int64_t>(m.train.size()) == 2 * steps_per_epoch);
  std::set<int64_t> expected;
  for (int64_t s = 2; s <= 2 * steps_per_epoch; s += 2) expected.insert(s);
  expected.insert(steps_per_epoch);
  expected.insert(2 * steps_per_epoch);
  std::vector<int64_t> got;
  for (const auto& row : m.eval) {
    got.push_back(row.at("step"));
    CHECK(row.at("eval_documents") == held);
    CHECK(row.at("eval_tokens").get<int64_t>() == ref.fields.at("eval_tokens").get<int64_t>());
    CHECK(row.at("eval_ppl").get<double>() == Approx(std::exp(row.at("eval_loss").get<double>())));
  }
  CHECK(got == std::vector<int64_t>(expected.begin(), expected.end()));
  REQUIRE(!m.eval.empty());
  CHECK(m.eval.back().at("epoch") == 1);

  // (c) the last evaluation (the epoch_1 adapter) is transformers' token-weighted loss.
  const double last = m.eval.back().at("eval_loss");
  CHECK(rel(last, want) < 1e-5);

  // lora-eval --recipe: the recipe's eval split, built as training builds it, on 1 and 3 ranks,
  // gives the run's last eval loss for the last adapter; --split train evaluates the others.
  const auto lora_eval = [&](const std::string& launch, const std::string& args) {
    const Result r = sh(fmt::format("{}{} --recipe {} --json {}", launch, bin("lora-eval"), a, args));
    INFO(r.output);
    REQUIRE(r.status == 0);
    const size_t at = r.output.rfind("{\"documents\"");
    REQUIRE(at != std::string::npos);
    return nlohmann::json::parse(r.output.substr(at, r.output.find('\n', at) - at));
  };
  const nlohmann::json one = lora_eval("", fmt::format("--adapter {}/a/epoch_1", dir));
  const nlohmann::json three =
      lora_eval(fmt::format("{} --nproc-per-node 3 -- ", bin("lorarun")), fmt::format("--adapter {}/a/epoch_1", dir));
  CHECK(one.at("documents") == held);
  CHECK(three.at("tokens") == one.at("tokens"));
  CHECK(rel(one.at("loss"), m.eval.back().at("eval_loss")) <= 1e-6);
  CHECK(rel(three.at("loss"), m.eval.back().at("eval_loss")) <= 1e-6);
  WARN(fmt::format("lora-eval --recipe: 1 rank {:.9f}, 3 ranks {:.9f}, the run's last eval_loss {:.9f}",
                   one.at("loss").get<double>(), three.at("loss").get<double>(),
                   m.eval.back().at("eval_loss").get<double>()));
  CHECK(lora_eval("", fmt::format("--adapter {}/a/epoch_1 --split train", dir)).at("documents") == trained);

  // (b) the same adapter (lora.init_from, a learning rate too small to move a float32 weight)
  // evaluated on 1, 2 and 3 ranks: the same number, before the first step (eval.on_start: step 0,
  // steering nothing) and at the epoch's end.
  std::vector<double> losses;
  for (int world = 1; world <= 3; ++world) {
    const std::string name = fmt::format("b{}", world);
    const std::string b = write_recipe(dir, name, "epochs: 1, lr: 1.0e-30, max_steps_per_epoch: 1",
                                       fmt::format(", init_from: {}/a/epoch_1", dir), ", batch_size: 3",
                                       "eval: {fraction: 0.25, every_n_steps: 2, on_start: true}\n");
    const Result r = sh(fmt::format("{} --nproc-per-node {} {}", bin("lorarun"), world, b));
    INFO(r.output);
    REQUIRE(r.status == 0);
    const Metrics mb = metrics(dir + "/" + name);
    REQUIRE(mb.eval.size() == 2);
    CHECK(mb.eval[0].at("step") == 0);
    CHECK_FALSE(mb.eval[0].contains("best_eval_loss"));
    CHECK(mb.eval[1].at("step") == 1);
    CHECK(rel(mb.eval[0].at("eval_loss"), mb.eval[1].at("eval_loss")) <= 1e-6);
    for (const auto& row : mb.eval) CHECK(row.at("eval_documents") == held);
    losses.push_back(mb.eval[0].at("eval_loss"));
    losses.push_back(mb.eval[1].at("eval_loss"));
  }
  double worst_ranks = 0, worst_ref = rel(last, want);
  for (const double l : losses) {
    worst_ranks = std::max(worst_ranks, rel(l, losses[0]));
    worst_ref = std::max(worst_ref, rel(l, want));
  }
  WARN(
      fmt::format("eval loss (at step 0 and at the end): 1 rank {:.9f}, 2 ranks {:.9f}, 3 ranks {:.9f}, training "
                  "run {:.9f}, transformers {:.9f}; worst relative difference across ranks {:.2e}, to transformers "
                  "{:.2e}",
                  losses[1], losses[3], losses[5], last, want, worst_ranks, worst_ref));
  CHECK(worst_ranks <= 1e-6);
  CHECK(worst_ref <= 1e-5);
}

TEST_CASE(
    "eval: an evaluation selection that overlaps the training documents is refused at start-up, a separate "
    "file is evaluated",
    "[e2e]") {
  const std::string dir = temp_dir("eval-overlap");
  write_data(dir + "/data.jsonl", 8);
  const std::string recipe = write_recipe(dir, "r", "epochs: 1");
  const auto refused = [&](const std::string& overrides) {
    const Result r = sh(fmt::format("{} {} {}", bin("lora-train"), recipe, overrides));
    CHECK(r.status != 0);
    return r.output;
  };
  CHECK_THAT(refused(fmt::format("eval.path={}/data.jsonl", dir)),
             Catch::Contains("eval.path is data.path, so the evaluation documents would be trained on: give a "
                             "separate file or use eval.fraction"));
  CHECK_THAT(refused(fmt::format("eval.fraction=0.2 eval.path={}/other.jsonl", dir)),
             Catch::Contains("set only one of eval.fraction, eval.filter/eval.collection, eval.path"));
  // A separate file that holds a training document is refused too, naming it.
  write_data(dir + "/copy.jsonl", 3, 100);
  const std::string first = read_file(dir + "/data.jsonl");
  std::ofstream(dir + "/copy.jsonl", std::ios::app) << first.substr(0, first.find('\n') + 1);
  CHECK_THAT(refused(fmt::format("eval.path={}/copy.jsonl", dir)),
             Catch::Contains(fmt::format("eval.path {}/copy.jsonl selects document #3 (document #0 of {}/data.jsonl), "
                                         "which training reads too",
                                         dir, dir)));
  CHECK_THAT(refused("'eval.filter={split: eval}'"), Catch::Contains("eval.filter needs data.source: mongodb"));
  CHECK_THAT(refused("eval.fraction=1e-9"), Catch::Contains("holds out no document of data.path"));
  CHECK(!std::filesystem::exists(dir + "/r/epoch_0"));

  // A separate file (eval.path), capped by eval.max_documents, evaluated eval.batch_size at a time.
  write_data(dir + "/eval.jsonl", 6, 100);
  const std::string extra = fmt::format("eval: {{path: {}/eval.jsonl, max_documents: 4, batch_size: 3}}\n", dir);
  const std::string other = write_recipe(dir, "p", "epochs: 2", "", "", extra);
  const Result plan = sh(fmt::format("{} --dry-run {}", bin("lora-train"), other));
  CHECK_THAT(plan.output, Catch::Contains(fmt::format("# evaluation: eval.path {}/eval.jsonl (at most 4 documents), "
                                                      "at each epoch end",
                                                      dir)));
  const Result r = sh(fmt::format("{} {}", bin("lora-train"), other));
  INFO(r.output);
  REQUIRE(r.status == 0);
  const Metrics m = metrics(dir + "/p");
  REQUIRE(m.eval.size() == 2);
  for (const auto& row : m.eval) CHECK(row.at("eval_documents") == 4);
  CHECK(m.eval[0].at("epoch") == 0);
  CHECK(m.eval[1].at("epoch") == 1);
}

TEST_CASE("eval: MongoDB, by eval.filter and by eval.fraction of the _ids, evaluations in the run record",
          "[e2e][db]") {
  const std::string dir = temp_dir("eval-db");
  {
    std::ofstream data(dir + "/data.jsonl");
    for (int i = 0; i < 40; ++i)
      data << nlohmann::json{{"instruction", fmt::format("Add {} and {}", i, 3 * i + 1)},
                             {"output", std::to_string(4 * i + 1)},
                             {"split", i < 30 ? "train" : "eval"}}
                  .dump()
           << "\n";
  }
  const std::string db = fmt::format("eval_{}", getpid());
  const Result imp = sh(
      fmt::format("{} import {}/data.jsonl --uri '{}' --db {} --collection ex", bin("lora-data"), dir, test_uri(), db));
  INFO(imp.output);
  REQUIRE(imp.status == 0);
  const std::string recipe = dir + "/r.yaml";
  std::ofstream(recipe) << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
data: {{database: {}, collection: ex, filter: {{split: train}}, prompt_template: "Q: {{instruction}}\nA: ", batch_size: 3}}
train: {{epochs: 2, lr: 1.0e-3}}
checkpoint: {{output_dir: {}/out}}
track: {{mongodb: true, database: {}}}
eval: {{filter: {{split: eval}}, every_n_steps: 2}}
)",
                                       LORARUN_MODEL_FIXTURES, db, dir, db);
  const std::string env = fmt::format("LORARUN_MONGODB_URI='{}'", test_uri());
  const Result run = sh(fmt::format("{} {} --nproc-per-node 2 {}", env, bin("lorarun"), recipe));
  INFO(run.output);
  REQUIRE(run.status == 0);
  CHECK(count_before(run.output, "documents from") == 30);
  CHECK(count_before(run.output, "documents from " + db + ".ex {\"split\":\"eval\"}") == 10);
  const Metrics m = metrics(dir + "/out");
  REQUIRE(m.eval.size() >= 2);
  for (const auto& row : m.eval) CHECK(row.at("eval_documents") == 10);
  // The run record holds each evaluation as a metrics document, and the last in its final metrics.
  lorarun::data::Client c(test_uri(), std::chrono::milliseconds(5000));
  size_t recorded = 0;
  for (const nlohmann::json& d : c.find(db, "metrics", nlohmann::json::object())) recorded += d.contains("eval_loss");
  CHECK(recorded == m.eval.size());
  const auto runs = c.find(db, "runs", nlohmann::json::object());
  REQUIRE(runs.size() == 1);
  CHECK(runs[0]["final_metrics"].value("eval_loss", 0.0) == Approx(m.eval.back().at("eval_loss").get<double>()));
  CHECK(runs[0]["recipe"]["eval"]["filter"] == R"({"split":"eval"})");

  // An eval.filter that selects training documents too is refused at start-up, naming one.
  const Result overlap =
      sh(fmt::format("{} {} {} data.filter=null track.mongodb=false checkpoint.output_dir={}/overlap", env,
                     bin("lora-train"), recipe, dir));
  CHECK(overlap.status != 0);
  CHECK_THAT(overlap.output,
             Catch::Contains(fmt::format("eval.filter {}.ex {{\"split\":\"eval\"}} selects _id ", db)) &&
                 Catch::Contains("which training reads too"));
  CHECK(!std::filesystem::exists(dir + "/overlap/epoch_0"));

  // eval.collection: the evaluation documents from another collection (with eval.filter).
  const Result imp2 = sh(fmt::format("{} import {}/data.jsonl --uri '{}' --db {} --collection ex_eval",
                                     bin("lora-data"), dir, test_uri(), db));
  REQUIRE(imp2.status == 0);
  const Result coll =
      sh(fmt::format("{} {} {} eval.collection=ex_eval train.epochs=1 train.max_steps_per_epoch=1 "
                     "track.mongodb=false checkpoint.output_dir={}/coll",
                     env, bin("lora-train"), recipe, dir));
  INFO(coll.output);
  CHECK(coll.status == 0);
  CHECK(count_before(coll.output, "documents from " + db + ".ex_eval {\"split\":\"eval\"}") == 10);

  // eval.fraction over the _ids of the whole collection: the two sides partition it.
  const Result split =
      sh(fmt::format("{} {} {} data.filter=null eval.filter=null eval.fraction=0.3 "
                     "track.mongodb=false checkpoint.output_dir={}/frac",
                     env, bin("lora-train"), recipe, dir));
  INFO(split.output);
  REQUIRE(split.status == 0);
  const int64_t trained = count_before(split.output, "documents from"),
                held = count_before(split.output, "documents from " + db + ".ex {} (eval.fraction");
  CHECK(trained > 0);
  CHECK(held > 0);
  CHECK(trained + held == 40);
}

TEST_CASE(
    "eval: best/ keeps the lowest eval loss, early stopping ends every rank at the same step, and a resumed run "
    "keeps both",
    "[e2e][resume]") {
  const std::string dir = temp_dir("eval-steer");
  write_data(dir + "/data.jsonl", 40);
  write_data(dir + "/eval.jsonl", 300, 100);
  // Every step evaluated; no evaluation improves by 10, so the run stops at step 1 + patience:
  // step 6 of epoch 0's 7 (20 documents a rank, 3 a step).
  const std::string train = "epochs: 3, lr: 1.0e-3, early_stopping_patience: 5, early_stopping_min_delta: 10";
  const std::string extra = fmt::format("eval: {{path: {}/eval.jsonl, every_n_steps: 1}}\n", dir);
  const std::string keys = "checkpoint.keep_best=true checkpoint.save_last_epoch_only=true";
  const std::string full = write_recipe(dir, "full", train, "", ", batch_size: 3", extra);
  const Result a = sh(fmt::format("{} --nproc-per-node 2 {} {}", bin("lorarun"), full, keys));
  INFO(a.output);
  REQUIRE(a.status == 0);
  CHECK_THAT(a.output, Catch::Contains("early stopping after step 6 (epoch 0): 5 evaluations without lowering"));
  CHECK_THAT(a.output, Catch::Contains("done: 6 steps (stopped early in epoch 0)"));
  const Metrics m = metrics(dir + "/full");
  REQUIRE(m.train.size() == 6);
  REQUIRE(m.eval.size() == 6);
  // save_last_epoch_only keeps the last epoch that ran; best/ is the adapter of the lowest loss.
  CHECK(fs::exists(dir + "/full/epoch_0/adapter_model.safetensors"));
  CHECK_FALSE(fs::exists(dir + "/full/epoch_1"));
  CHECK_FALSE(fs::exists(dir + "/full/resume_state"));
  size_t lowest = 0;
  for (size_t i = 0; i < m.eval.size(); ++i)
    if (m.eval[i].at("eval_loss").get<double>() < m.eval[lowest].at("eval_loss").get<double>()) lowest = i;
  const nlohmann::json best = nlohmann::json::parse(read_file(dir + "/full/best/best.json"));
  CHECK(best.at("step") == m.eval[lowest].at("step"));
  CHECK(best.at("eval_loss") == m.eval[lowest].at("eval_loss"));
  CHECK(m.eval.back().at("best_eval_loss") == m.eval[lowest].at("eval_loss"));
  const nlohmann::json done = nlohmann::json::parse(read_file(dir + "/full/run.json"));
  CHECK(done.at("early_stopped").at("step") == 6);
  CHECK(done.at("epochs_kept") == nlohmann::json::array({0}));
  CHECK(done.at("best").at("step") == best.at("step"));

  // lora-eval --recipe on best/ gives the loss best.json records.
  const Result e = sh(fmt::format("{} --recipe {} --adapter {}/full/best --json", bin("lora-eval"), full, dir));
  INFO(e.output);
  REQUIRE(e.status == 0);
  const nlohmann::json got = nlohmann::json::parse(e.output.substr(e.output.rfind("{\"documents\"")));
  CHECK(rel(got.at("loss"), best.at("eval_loss")) <= 1e-6);

  // Stopped by SIGTERM after the second evaluation, then resumed: the best loss and the count of
  // evaluations without improvement come back, so it stops at the same step with the same best/.
  const std::string cut = write_recipe(dir, "cut", train, "", ", batch_size: 3", extra);
  const std::string cmd = fmt::format("{} --nproc-per-node 2 {} {}", bin("lorarun"), cut, keys);
  const Result b = interrupt(cmd, dir + "/cut.log", "eval at epoch 0 step 2:", "kill -TERM $pid");
  INFO(read_file(dir + "/cut.log"));
  CHECK_THAT(b.output, Catch::Contains("exit=75"));
  REQUIRE(fs::exists(dir + "/cut/resume_state/state.json"));
  const Result c = sh(cmd);
  INFO(c.output);
  REQUIRE(c.status == 0);
  CHECK_THAT(c.output, Catch::Contains("resuming at epoch 0"));
  CHECK_THAT(c.output, Catch::Contains("done: 6 steps (stopped early in epoch 0)"));
  CHECK(read_file(dir + "/cut/best/adapter_model.safetensors") ==
        read_file(dir + "/full/best/adapter_model.safetensors"));
  CHECK(nlohmann::json::parse(read_file(dir + "/cut/best/best.json")).at("step") == best.at("step"));
  CHECK(read_file(dir + "/cut/epoch_0/adapter_model.safetensors") ==
        read_file(dir + "/full/epoch_0/adapter_model.safetensors"));

  // Steering needs an eval split.
  const Result none =
      sh(fmt::format("{} {} checkpoint.keep_best=true", bin("lora-train"), write_recipe(dir, "none", "epochs: 1")));
  CHECK(none.status != 0);
  CHECK_THAT(none.output, Catch::Contains("checkpoint.keep_best needs an eval: split to steer by: set eval.path or "
                                          "eval.fraction"));
}
