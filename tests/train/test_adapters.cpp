// adapters: (a job of many adapters on one base) end to end with the real binaries on the tiny llama
// fixture: every adapter of a 3- and an 8-adapter job against its own run (adapter_recipe's recipe,
// trained by lora-train alone) at every kept epoch and best/, per: from FerretDB and list: from
// JSONL files, 2 ranks, dropout, cosine with warmup, per-adapter r, alpha, lr and epochs, QLoRA and
// LoRA+ with activation checkpointing, packing; DoRA, data.sources and trained tables per adapter;
// DPO, ORPO and SimPO jobs; lora.init_from; an exact resume after kill -9 and after SIGTERM during an
// evaluation; the metrics rows and the run record; the dry run; the refusals.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "data/mongo.hpp"
#include "support/process.hpp"
#include "support/runs.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;
using nlohmann::json;
namespace fs = std::filesystem;

namespace {

struct Tenant {
  std::string name;
  int documents;
  std::string own;  // its keys in the job ("r: 8, lr: 2.0e-3"), as overrides of its own run ("lora.r=8 …")
  std::string overrides;
};

// `n` instruction documents of tenant `tag` (its numbers from `from`), responses `words` long.
std::vector<json> tenant_docs(const std::string& tag, int n, int from) {
  std::vector<json> out;
  for (int i = from; i < from + n; ++i) {
    std::string response = std::to_string(4 * i + 1);
    for (int w = 0; w < i % 4; ++w) response += fmt::format(" {}{}", tag, w);
    out.push_back(
        {{"tenant", tag}, {"instruction", fmt::format("{} {} and {}", tag, i, 3 * i + 1)}, {"output", response}});
  }
  return out;
}

void write_jsonl(const std::string& path, const std::vector<json>& docs) {
  std::ofstream out(path);
  for (const json& d : docs) out << d.dump() << "\n";
}

// Each tenant's documents in `dir`/<name>.jsonl (their numbers 100 apart); returns adapters.list's
// entries for them, with their own keys.
std::string write_tenants(const std::string& dir, const std::vector<Tenant>& tenants) {
  std::string list;
  int from = 0;
  for (const Tenant& t : tenants) {
    write_jsonl(fmt::format("{}/{}.jsonl", dir, t.name), tenant_docs(t.name, t.documents, from));
    from += 100;
    list += fmt::format("{}{{name: {}, path: {}/{}.jsonl{}}}", list.empty() ? "" : ", ", t.name, dir, t.name,
                        t.own.empty() ? "" : ", " + t.own);
  }
  return list;
}

// The keys a job recipe appends to its sections (", packing: true"), and its last lines.
struct JobKeys {
  std::string lora = {}, data = {}, train = {}, checkpoint = {}, extra = {};
};

// A job recipe `dir`/`name`.yaml on the llama fixture: LoRA r 4 on every linear with dropout, cosine
// with warmup over 2 epochs, and `keys`.
std::string job_recipe(const std::string& dir, const std::string& name, const JobKeys& keys) {
  const std::string path = fmt::format("{}/{}.yaml", dir, name);
  std::ofstream(path) << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, dropout: 0.1, target_modules: all-linear{}}}
data: {{format: instruction, prompt_template: "Q: {{instruction}}\nA: ", batch_size: 4{}}}
train: {{epochs: 2, lr: 5.0e-3, lr_scheduler: cosine, warmup_steps: 2{}}}
checkpoint: {{output_dir: {}/{}{}}}
{}
)",
                                     LORARUN_MODEL_FIXTURES, keys.lora, keys.data, keys.train, dir, name,
                                     keys.checkpoint, keys.extra);
  return path;
}

// The header of safetensors file `path` (its tensors' names, shapes and offsets) as JSON text.
std::string adapter_keys(const std::string& path) {
  const std::string file = read_file(path);  // (8 bytes of length, then the JSON header)
  uint64_t length = 0;
  std::memcpy(&length, file.data(), sizeof length);
  return json::parse(file.substr(8, length)).dump();
}

std::vector<json> metrics(const std::string& output_dir) {
  std::vector<json> rows;
  std::istringstream in(read_file(output_dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rows.push_back(json::parse(line));
  return rows;
}

// Each adapter's epochs (and best/) in the job against its own run in `solo_dir`/<name>: within 1e-5
// of its largest weight, as the issue asks; says which are bit for bit.
void check_against_own_runs(const std::string& job_dir, const std::string& solo_dir, const std::vector<Tenant>& tenants,
                            const std::string& what) {
  int compared = 0, identical = 0;
  std::string shown;
  for (const Tenant& t : tenants)
    for (const auto& e : fs::directory_iterator(fs::path(job_dir) / t.name)) {
      const std::string name = e.path().filename().string();
      if (!name.starts_with("epoch_") && name != "best") continue;
      const std::string a = e.path().string() + "/adapter_model.safetensors";
      const std::string b = fmt::format("{}/{}/{}/adapter_model.safetensors", solo_dir, t.name, name);
      INFO(what << ": " << t.name << "/" << name);
      REQUIRE(fs::exists(b));
      const double rel = adapter_relative_diff(a, b);
      CHECK(rel <= 1e-5);
      ++compared;
      identical += adapter_diff(a, b) == 0.0;
      shown += fmt::format(" {}/{} {:.1e}", t.name, name, rel);
    }
  CHECK(compared >= static_cast<int>(tenants.size()));
  fmt::print("{}: {} of {} adapters bit for bit their own run's; relative differences:{}\n", what, identical, compared,
             shown);
}

// Pairs "Q: add i and 3i+1" with the right sum chosen over a near miss: `dir`/a.jsonl (14) and
// `dir`/b.jsonl (10, its numbers from 40).
void write_pairs(const std::string& dir) {
  for (const auto& [name, from, n] : {std::tuple{"a", 0, 14}, std::tuple{"b", 40, 10}}) {
    std::vector<json> docs;
    for (int i = from; i < from + n; ++i)
      docs.push_back({{"prompt", fmt::format("Q: add {} and {}\nA: ", i, 3 * i + 1)},
                      {"chosen", std::to_string(4 * i + 1)},
                      {"rejected", std::to_string(4 * i + (i % 2 ? 3 : 11))}});
    write_jsonl(fmt::format("{}/{}.jsonl", dir, name), docs);
  }
}

// The same questions' answers for KTO in `dir`/kto: the right sum (desirable) or, every third, a near miss.
void write_answers(const std::string& dir) {
  std::filesystem::create_directories(dir + "/kto");
  for (const auto& [name, from, n] : {std::tuple{"a", 0, 14}, std::tuple{"b", 40, 10}}) {
    std::vector<json> docs;
    for (int i = from; i < from + n; ++i)
      docs.push_back({{"prompt", fmt::format("Q: add {} and {}\nA: ", i, 3 * i + 1)},
                      {"completion", std::to_string(4 * i + (i % 3 == 2 ? 11 : 1))},
                      {"label", i % 3 != 2}});
    write_jsonl(fmt::format("{}/kto/{}.jsonl", dir, name), docs);
  }
}

// A job recipe `dir`/`name`.yaml of preference pairs on the llama fixture, like job_recipe's: adapters
// a and b (b at lr 1e-2) reading `pairs_dir`/a.jsonl and b.jsonl (write_pairs), and `keys`.
std::string pairs_job_recipe(const std::string& dir, const std::string& name, const std::string& pairs_dir,
                             const JobKeys& keys) {
  const std::string path = fmt::format("{}/{}.yaml", dir, name);
  std::ofstream(path) << fmt::format(
      R"(model: {{path: {0}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, dropout: 0.1, target_modules: all-linear{3}}}
data: {{source: jsonl, format: preference, max_length: 64, batch_size: 2{4}}}
train: {{epochs: 2, lr: 5.0e-3{5}}}
checkpoint: {{output_dir: {1}/{2}{6}}}
track: {{mongodb: false}}
adapters: {{list: [{{name: a, path: {7}/a.jsonl}}, {{name: b, path: {7}/b.jsonl, lr: 1.0e-2}}]}}
{8}
)",
      LORARUN_MODEL_FIXTURES, dir, name, keys.lora, keys.data, keys.train, keys.checkpoint, pairs_dir, keys.extra);
  return path;
}

// Each tenant's own run: the job's recipe without adapters:, its selection and keys as overrides.
void run_own(const std::string& recipe, const std::string& solo_dir, const Tenant& t, const std::string& selection,
             const std::string& more = "") {
  const Result r =
      sh(fmt::format("{} --nproc-per-node 2 {} 'adapters.list=[]' 'adapters.per=' {} {} "
                     "checkpoint.output_dir={}/{} track.mongodb=false {}",
                     bin("lorarun"), recipe, selection, t.overrides, solo_dir, t.name, more));
  INFO(r.output);
  REQUIRE(r.status == 0);
}

// Job `recipe` (writing `job_dir`) on 2 ranks, then each tenant's own run from `dir`/<name>.jsonl into
// `own_dir`/<name>, compared with check_against_own_runs.
void jsonl_job_against_own_runs(const std::string& recipe, const std::string& dir, const std::string& job_dir,
                                const std::string& own_dir, const std::vector<Tenant>& tenants,
                                const std::string& what) {
  const Result job = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), recipe));
  INFO(job.output);
  REQUIRE(job.status == 0);
  for (const Tenant& t : tenants) run_own(recipe, own_dir, t, fmt::format("data.path={}/{}.jsonl", dir, t.name));
  check_against_own_runs(job_dir, own_dir, tenants, what);
}

}  // namespace

TEST_CASE(
    "adapters.per from FerretDB: each adapter of a 5-adapter job on 2 ranks (9, 17, 30, 1, 1 documents, dropout, "
    "cosine with warmup, one at r 8) is its own run, eval (on start too) and best/ per adapter, metrics and run record "
    "per adapter, a tenant eval.fraction holds out none or all of trained on all, unevaluated",
    "[e2e][db]") {
  const std::string dir = temp_dir("adapters-per");
  const std::string uri = test_uri(), db = "lorarun_test_adapters";
  lorarun::data::Client client(uri, std::chrono::seconds(10), {"the test"});
  client.drop(db, "docs");
  // hooli's and piper's own runs: eval.fraction holds out none and all of their one document
  const std::string unsplit = "eval.fraction=0 checkpoint.keep_best=false";
  const std::vector<Tenant> tenants = {{"acme", 9, "", ""},
                                       {"globex", 17, "{name: globex, r: 8}", "lora.r=8"},
                                       {"initech", 30, "", ""},
                                       {"hooli", 1, "", unsplit},
                                       {"piper", 1, "", unsplit}};
  // Fixed _ids: eval.fraction holds out by a hash of each _id. With random ObjectIds it held out none
  // of acme's 9 documents about one time in seven; these hold out 1, 3, 3, none and all.
  int from = 0;
  for (const Tenant& t : tenants) {
    std::vector<json> docs = tenant_docs(t.name, t.documents, from);
    for (size_t i = 0; i < docs.size(); ++i) docs[i]["_id"] = from + static_cast<int>(i);
    client.insert_many(db, "docs", docs);
    from += 50;
  }
  client.insert_many(db, "docs", {json{{"_id", from}, {"instruction", "no tenant"}, {"output", "1"}}});
  const std::string data = fmt::format(", uri: \"{}\", database: {}, collection: docs", uri, db);
  const std::string recipe = job_recipe(
      dir, "job",
      {.data = data,
       .checkpoint = ", keep_best: true",
       .extra = fmt::format("eval: {{fraction: 0.2, on_start: true}}\ntrack: {{mongodb: true, database: {}}}\n"
                            "adapters: {{per: tenant, list: [{{name: globex, r: 8}}]}}",
                            db)});
  const Result dry = sh(fmt::format("{} --dry-run {}", bin("lora-train"), recipe));
  INFO(dry.output);
  REQUIRE(dry.status == 0);
  CHECK_THAT(dry.output, Catch::Contains("# 5 adapters, each trained as its own run would be"));
  CHECK_THAT(dry.output, Catch::Contains("globex: 17 documents, 5 steps per epoch x 2 epochs"));
  CHECK_THAT(dry.output, Catch::Contains("LoRA r 8"));

  const Result job = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), recipe));
  INFO(job.output);
  REQUIRE(job.status == 0);
  CHECK_THAT(job.output, Catch::Contains("1 documents of data's selection have no field tenant"));
  CHECK_THAT(job.output, Catch::Contains("adapter 'hooli': eval.fraction 0.2 holds out none of its 1 documents: it "
                                         "trains on them all and is not evaluated"));
  CHECK_THAT(job.output, Catch::Contains("adapter 'piper': eval.fraction 0.2 holds out every one of its 1 documents"));
  for (const Tenant& t : tenants) run_own(recipe, dir + "/own", t, fmt::format("'data.filter={{tenant: {}}}'", t.name));
  check_against_own_runs(dir + "/job", dir + "/own", tenants, "per: tenant, 2 ranks, eval.fraction, keep_best");
  for (const Tenant& t : tenants) {  // the same best step and loss as its own run, or none
    const std::string best = fmt::format("{}/job/{}/best/best.json", dir, t.name);
    if (t.overrides == unsplit) {
      CHECK_FALSE(fs::exists(best));
      continue;
    }
    CHECK(json::parse(read_file(best))["eval_loss"] ==
          json::parse(read_file(fmt::format("{}/own/{}/best/best.json", dir, t.name)))["eval_loss"]);
  }

  // metrics.jsonl: per adapter its loss, tokens, lr, grad_norm in the step rows, and its eval rows
  int steps = 0, evals = 0, last = 0, on_start = 0;
  for (const json& row : metrics(dir + "/job")) {
    if (row.contains("adapter")) {
      ++evals;
      on_start += row["step"] == 0;
      CHECK(row.contains("eval_loss/" + row["adapter"].get<std::string>()));
      continue;
    }
    ++steps;
    last = row["step"];
    if (row["step"] == 1)
      for (const Tenant& t : tenants)
        for (const char* key : {"loss/", "tokens/", "lr/", "grad_norm/"}) CHECK(row.contains(key + t.name));
  }
  CHECK(steps == last);  // a row every job step: initech's, the largest
  CHECK(steps >= 6);
  CHECK(evals == 9);     // each split adapter before its first step (eval.on_start) and at each epoch end
  CHECK(on_start == 3);  // (steering nothing: best/ is its own run's, above)
  const std::string id = run_id_in(job.output, db);
  const Result record = sh(fmt::format("{} show {}/{} --uri '{}'", bin("lora-runs"), db, id, uri));
  INFO(record.output);
  CHECK_THAT(record.output, Catch::Contains("\"adapters\""));
  CHECK_THAT(record.output, Catch::Contains("initech"));
}

TEST_CASE(
    "adapters.list: each adapter of an 8-adapter job (6 to 40 documents, with their own r, alpha, lr, epochs) on 2 "
    "ranks in passes of 3 adapters, with QLoRA, LoRA+, activation checkpointing and packing, is its own run",
    "[e2e]") {
  const std::string dir = temp_dir("adapters-list");
  const std::vector<Tenant> tenants = {
      {"t0", 6, "", ""},
      {"t1", 40, "r: 8, alpha: 32", "lora.r=8 lora.alpha=32"},
      {"t2", 11, "lr: 2.0e-3", "train.lr=2.0e-3"},
      {"t3", 23, "epochs: 1", "train.epochs=1"},
      {"t4", 9, "", ""},
      {"t5", 31, "target_modules: [q_proj, v_proj]", "'lora.target_modules=[q_proj, v_proj]'"},
      {"t6", 14, "epochs: 3, r: 2", "train.epochs=3 lora.r=2"},
      {"t7", 18, "", ""},
  };
  const std::string list = write_tenants(dir, tenants);
  const std::string recipe =
      job_recipe(dir, "job",
                 {.lora = ", quantize_base: true, plus_lr_ratio: 16",
                  .data = ", source: jsonl, packing: true, max_length: 48",
                  .train = ", activation_checkpointing: true",
                  .extra = fmt::format("track: {{mongodb: false}}\nadapters: {{per_pass: 3, list: [{}]}}", list)});
  const Result job = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), recipe));
  INFO(job.output);
  REQUIRE(job.status == 0);
  for (const Tenant& t : tenants) run_own(recipe, dir + "/own", t, fmt::format("data.path={}/{}.jsonl", dir, t.name));
  check_against_own_runs(dir + "/job", dir + "/own", tenants,
                         "list of 8, QLoRA, LoRA+, activation checkpointing, packing");
  CHECK(fs::exists(dir + "/job/t6/epoch_2"));   // 3 epochs
  CHECK(!fs::exists(dir + "/job/t3/epoch_1"));  // 1 epoch
  const json config = json::parse(read_file(dir + "/job/t1/epoch_0/adapter_config.json"));
  CHECK(config["r"] == 8);
  CHECK(config["lora_alpha"] == 32.0);
  CHECK(json::parse(read_file(dir + "/job/t5/epoch_0/adapter_config.json"))["target_modules"] ==
        json::array({"q_proj", "v_proj"}));
}

TEST_CASE(
    "adapters: kill -9 mid-job, and SIGTERM during an adapter's evaluation, resume to every adapter's adapter and "
    "best/ of the uninterrupted job byte for byte",
    "[e2e][resume]") {
  const std::string dir = temp_dir("adapters-resume");
  std::string list;
  int from = 0;
  for (const auto& [name, n] : {std::pair{"a", 60}, std::pair{"b", 100}, std::pair{"c", 150}}) {
    write_jsonl(fmt::format("{}/{}.jsonl", dir, name), tenant_docs(name, n, from));
    from += 1000;
    list += fmt::format("{}{{name: {}, path: {}/{}.jsonl}}", list.empty() ? "" : ", ", name, dir, name);
  }
  const std::string recipe =
      job_recipe(dir, "job",
                 {.data = ", source: jsonl",
                  .checkpoint = ", keep_best: true, state_every_n_steps: 7",
                  .extra = fmt::format("eval: {{fraction: 0.1, every_n_steps: 1, batch_size: 1}}\n"
                                       "track: {{mongodb: false}}\nadapters: {{list: [{}]}}",
                                       list)});
  const Result full = sh(fmt::format("{} --nproc-per-node 2 {} data.batch_size=1 checkpoint.output_dir={}/full",
                                     bin("lorarun"), recipe, dir));
  INFO(full.output);
  REQUIRE(full.status == 0);
  const auto same_as_full = [&](const std::string& out) {
    int files = 0;
    for (const auto& [name, sum] : hashes(dir + "/full")) {
      if (!name.ends_with("adapter_model.safetensors")) continue;
      INFO(name);
      CHECK(hashes(out).count(name) == 1);
      if (hashes(out).count(name)) CHECK(hashes(out).at(name) == sum);
      ++files;
    }
    CHECK(files >= 8);  // a: 2 epochs + best, b: 2 + best, c: 2 + best
  };

  const std::string killed = fmt::format("{} --nproc-per-node 2 {} data.batch_size=1 checkpoint.output_dir={}/killed",
                                         bin("lorarun"), recipe, dir);
  const Result k = interrupt(killed, dir + "/killed.log", "step 30/",
                             "kill -9 $(sed -n 's/.*(pids \\([0-9]*\\) \\([0-9]*\\)).*/\\1 \\2/p' \"$log\")");
  INFO(read_file(dir + "/killed.log"));
  CHECK_THAT(k.output, Catch::Contains("exit=1"));
  REQUIRE(fs::exists(dir + "/killed/c/resume_state/state.json"));
  const Result again = sh(killed);
  INFO(again.output);
  REQUIRE(again.status == 0);
  CHECK_THAT(again.output, Catch::Contains("resuming the job at step"));
  same_as_full(dir + "/killed");

  // SIGTERM once adapter a's evaluation at step 40 is done (each adapter evaluates after every step, so the
  // signal lands in an evaluation or cuts the next one short): saved with the evaluations due
  // pending, resumed to the same adapters
  const std::string stopped = fmt::format("{} --nproc-per-node 2 {} data.batch_size=1 checkpoint.output_dir={}/stopped",
                                          bin("lorarun"), recipe, dir);
  const Result s = interrupt(stopped, dir + "/stopped.log", "at epoch 1 step 40:", "kill -TERM $pid");
  const std::string log = read_file(dir + "/stopped.log");
  INFO(log);
  CHECK_THAT(s.output, Catch::Contains("exit=75"));
  CHECK_THAT(log, Catch::Contains("stopped on request: it is done again when the job resumes"));
  fmt::print("SIGTERM during the evaluations of step 40: {}\n",
             log.find("stopped on request: it is done again") != std::string::npos ? "an evaluation was cut short"
                                                                                   : "the step ended first");
  const Result resumed = sh(stopped);
  INFO(resumed.output);
  REQUIRE(resumed.status == 0);
  same_as_full(dir + "/stopped");
  for (const char* name : {"a", "b", "c"})
    CHECK_FALSE(fs::exists(fmt::format("{}/stopped/{}/resume_state", dir, name)));
}

TEST_CASE(
    "adapters on one rank: a step where an adapter trains no token (its one document skipped) is no AdamW step, as "
    "in its own run, in passes of one adapter and of both",
    "[e2e]") {
  const std::string dir = temp_dir("adapters-empty-step");
  const std::vector<Tenant> tenants = {{"a", 6, "", ""}, {"b", 5, "", ""}};
  for (const Tenant& t : tenants) {
    std::vector<json> docs = tenant_docs(t.name, t.documents, 0);
    if (t.name == "a")  // its third step: one document longer than max_length, skipped
      docs.insert(docs.begin() + 2, json{{"instruction", std::string(400, 'x')}, {"output", "1"}});
    write_jsonl(fmt::format("{}/{}.jsonl", dir, t.name), docs);
  }
  const std::string recipe = job_recipe(
      dir, "job",
      {.data = ", source: jsonl, max_length: 48, overlong: skip, max_skipped_share: 0.2, shuffle: none",
       .extra = fmt::format("track: {{mongodb: false}}\nadapters: {{list: [{{name: a, path: {0}/a.jsonl}}, {{name: b, "
                            "path: {0}/b.jsonl}}]}}",
                            dir)});
  for (const char* per_pass : {"1", "2"}) {
    const Result job = sh(fmt::format("{} {} data.batch_size=1 adapters.per_pass={} checkpoint.output_dir={}/job{}",
                                      bin("lora-train"), recipe, per_pass, dir, per_pass));
    INFO(job.output);
    REQUIRE(job.status == 0);
    CHECK_THAT(job.output, Catch::Contains("skipped"));
  }
  for (const Tenant& t : tenants) {
    const Result own =
        sh(fmt::format("{} {} 'adapters.list=[]' data.batch_size=1 data.path={}/{}.jsonl "
                       "checkpoint.output_dir={}/own/{}",
                       bin("lora-train"), recipe, dir, t.name, dir, t.name));
    INFO(own.output);
    REQUIRE(own.status == 0);
  }
  check_against_own_runs(dir + "/job1", dir + "/own", tenants, "one rank, a step of no tokens, passes of 1");
  check_against_own_runs(dir + "/job2", dir + "/own", tenants, "one rank, a step of no tokens, passes of 2");
}

TEST_CASE("adapters: bad jobs are one line each, before anything is trained or written", "[e2e][db]") {
  const std::string dir = temp_dir("adapters-bad");
  const std::string uri = test_uri(), db = "lorarun_test_adapters_bad";
  lorarun::data::Client client(uri, std::chrono::seconds(10), {"the test"});
  client.drop(db, "docs");
  std::vector<json> docs = tenant_docs("good", 8, 0);
  client.insert_many(db, "docs", docs);
  write_jsonl(dir + "/a.jsonl", tenant_docs("a", 8, 0));
  std::ofstream(dir + "/empty.jsonl") << "\n";
  const std::string mongo = fmt::format(", uri: \"{}\", database: {}, collection: docs", uri, db);
  const std::string jsonl = ", source: jsonl";
  const std::string a = fmt::format("{{name: a, path: {}/a.jsonl}}", dir);
  int n = 0;
  for (const auto& [data, adapters, expected] : {
           std::tuple{jsonl, fmt::format("{{list: [{}, {{name: b, path: {}/a.jsonl, dropout: 0.2}}]}}", a, dir),
                      std::string("entry 1 sets dropout, which one base pass shares between the adapters")},
           std::tuple{jsonl, fmt::format("{{list: [{}, {{name: ../b, path: {}/a.jsonl}}]}}", a, dir),
                      std::string("entry 1 is named '../b': an adapter needs a name of 1 to 64 letters")},
           std::tuple{jsonl, fmt::format("{{list: [{}, {{name: b, path: {}/empty.jsonl}}]}}", a, dir),
                      std::string("adapter 'b': data.path " + dir + "/empty.jsonl holds no documents")},
           std::tuple{jsonl, std::string("{per: tenant}"), std::string("adapters.per needs data.source: mongodb")},
           std::tuple{mongo, std::string("{per: tenant, max: 1}"),
                      std::string("tenant has 2 distinct values in data's selection, more than adapters.max 1")},
           std::tuple{mongo, std::string("{per: tenant}"),
                      std::string("tenant holds 'bad/../name', which cannot name an adapter's directory")},
           std::tuple{mongo, std::string("{list: [{name: x, filter: {tenant: nobody}}]}"),
                      std::string("adapter 'x': data.filter")},
           std::tuple{mongo, std::string("{per: tenant}"),
                      std::string("tenant holds a list in 1 document(s) of data's selection, which would train each "
                                  "of them in several adapters")},
           std::tuple{mongo, std::string("{per: tenant}"),
                      std::string("adapters.per: tenant holds 'Acme' and 'acme', which differ only in case")},
           std::tuple{jsonl, fmt::format("{{list: [{}, {{name: A, path: {}/a.jsonl}}]}}", a, dir),
                      std::string("names 'a' and 'A' differ only in case")},
           std::tuple{fmt::format(", uri: \"{}\", database: {}, sources: [{{name: s, collection: docs}}]", uri, db),
                      std::string("{list: [{name: x, collection: docs}]}"),
                      std::string("'x' sets collection, which each of data.sources names for itself: give the "
                                  "adapter a filter")},
           std::tuple{fmt::format("{}, sources: [{{name: s, path: {}/a.jsonl}}]", jsonl, dir),
                      fmt::format("{{list: [{}]}}", a),
                      std::string("adapters.list with data.sources from JSONL files has no way to give each adapter "
                                  "its documents")},
       }) {
    if (n == 4) {  // a second tenant, and (n == 5) one whose name would leave the output directory
      client.insert_many(db, "docs", tenant_docs("other", 3, 50));
    } else if (n == 5) {
      client.drop(db, "docs");
      client.insert_many(db, "docs", tenant_docs("good", 4, 0));
      client.insert_many(db, "docs", tenant_docs("bad/../name", 4, 10));
    } else if (n == 7) {  // a document of two tenants at once; then (n == 8) two that differ only in case
      client.drop(db, "docs");
      client.insert_many(db, "docs", tenant_docs("good", 4, 0));
      client.insert_many(db, "docs", {json{{"tenant", {"good", "other"}}, {"instruction", "q"}, {"output", "1"}}});
    } else if (n == 8) {
      client.drop(db, "docs");
      client.insert_many(db, "docs", tenant_docs("Acme", 4, 0));
      client.insert_many(db, "docs", tenant_docs("acme", 4, 10));
    }
    const std::string name = fmt::format("bad{}", n++);
    const std::string recipe = job_recipe(
        dir, name, {.data = data, .extra = fmt::format("track: {{mongodb: false}}\nadapters: {}", adapters)});
    const Result r = sh(fmt::format("{} {}", bin("lora-train"), recipe));
    INFO(r.output);
    CHECK(r.status != 0);
    CHECK_THAT(r.output, Catch::Contains(expected));
    CHECK(count_lines(r.output) == 1);
    bool trained = false;  // nothing of an adapter written
    if (fs::exists(dir + "/" + name))
      for (const auto& e : fs::recursive_directory_iterator(dir + "/" + name))
        trained =
            trained || e.path().filename().string().starts_with("epoch_") || e.path().filename() == "resume_state";
    CHECK_FALSE(trained);
  }
}

TEST_CASE("adapters.per: tenants found only among the evaluation documents are named in a warning", "[e2e][db]") {
  const std::string dir = temp_dir("adapters-eval-only");
  const std::string uri = test_uri(), db = "lorarun_test_adapters_eval_only";
  lorarun::data::Client client(uri, std::chrono::seconds(10), {"the test"});
  client.drop(db, "docs");
  for (const auto& [tenant, split, n, from] :
       {std::tuple{"acme", "train", 6, 0}, std::tuple{"acme", "eval", 2, 10}, std::tuple{"ghost", "eval", 2, 20}}) {
    std::vector<json> docs = tenant_docs(tenant, n, from);
    for (json& d : docs) d["split"] = split;
    client.insert_many(db, "docs", docs);
  }
  const std::string recipe = job_recipe(
      dir, "job",
      {.data = fmt::format(", uri: \"{}\", database: {}, collection: docs, filter: {{split: train}}", uri, db),
       .extra = "eval: {filter: {split: eval}}\ntrack: {mongodb: false}\nadapters: {per: tenant}"});
  const Result dry = sh(fmt::format("{} --dry-run {}", bin("lora-train"), recipe));
  INFO(dry.output);
  REQUIRE(dry.status == 0);
  CHECK_THAT(dry.output, Catch::Contains("adapters.per: the evaluation documents hold tenant ghost that no training "
                                         "document has: no adapter trains or evaluates on those"));
  CHECK(occurrences(dry.output, "ghost") == 1);
}

TEST_CASE(
    "adapters with checkpoint.store: mongodb: each adapter's artifacts as <name>/…, a wiped output directory after "
    "kill -9 restored and resumed byte for byte, lora-runs pull and --adapter mongodb-run: by adapter",
    "[e2e][db][resume]") {
  const std::string dir = temp_dir("adapters-store");
  const std::string uri = test_uri(), db = "lorarun_test_adapters_store";
  std::string list;
  int from = 0;
  for (const auto& [name, n] : {std::pair{"a", 40}, std::pair{"b", 70}}) {
    write_jsonl(fmt::format("{}/{}.jsonl", dir, name), tenant_docs(name, n, from));
    from += 1000;
    list += fmt::format("{}{{name: {}, path: {}/{}.jsonl}}", list.empty() ? "" : ", ", name, dir, name);
  }
  const std::string recipe = job_recipe(
      dir, "job",
      {.data = fmt::format(", source: jsonl, uri: \"{}\"", uri),
       .checkpoint = ", keep_best: true, state_every_n_steps: 5, store: mongodb",
       .extra = fmt::format("eval: {{fraction: 0.1}}\ntrack: {{mongodb: true, database: {}}}\nadapters: {{list: [{}]}}",
                            db, list)});
  const auto cmd = [&](const std::string& out) {
    return fmt::format("{} --nproc-per-node 2 {} data.batch_size=1 checkpoint.output_dir={}/{}", bin("lorarun"), recipe,
                       dir, out);
  };
  const Result full = sh(cmd("full"));
  INFO(full.output);
  REQUIRE(full.status == 0);
  const Result k = interrupt(cmd("cut"), dir + "/cut.log", "step 20/",
                             "kill -9 $(sed -n 's/.*(pids \\([0-9]*\\) \\([0-9]*\\)).*/\\1 \\2/p' \"$log\")");
  INFO(read_file(dir + "/cut.log"));
  CHECK_THAT(k.output, Catch::Contains("exit=1"));
  fs::remove_all(dir + "/cut");  // a new node: only the database holds the job now
  const Result again = sh(cmd("cut"));
  INFO(again.output);
  REQUIRE(again.status == 0);
  CHECK_THAT(again.output, Catch::Contains("resume_state of run"));  // a's and b's, after their epochs
  CHECK_THAT(again.output, Catch::Contains("resuming the job at step"));
  for (const char* a : {"a/epoch_0", "a/epoch_1", "a/best", "b/epoch_0", "b/epoch_1", "b/best"})
    CHECK(adapter_diff(fmt::format("{}/full/{}/adapter_model.safetensors", dir, a),
                       fmt::format("{}/cut/{}/adapter_model.safetensors", dir, a)) == 0.0);

  const std::string id = run_id_in(again.output, db);
  const std::string env = fmt::format("LORARUN_MONGODB_URI='{}'", uri);
  const Result show = sh(fmt::format("{} {} show {}/{}", env, bin("lora-runs"), db, id));
  INFO(show.output);
  CHECK_THAT(show.output, Catch::Contains("\"b/epoch_1\""));
  CHECK_THAT(show.output, Catch::Contains("\"a/best\""));
  CHECK(show.output.find("/resume_state\"") == std::string::npos);  // gone with the job's end
  const Result pull = sh(fmt::format("{} {} pull {}/{}/b {}/pulled", env, bin("lora-runs"), db, id, dir));
  INFO(pull.output);
  REQUIRE(pull.status == 0);
  CHECK(hashes(dir + "/pulled") == hashes(dir + "/cut/b/epoch_1"));
  const Result whole = sh(fmt::format("{} {} pull {}/{} {}/whole", env, bin("lora-runs"), db, id, dir));
  CHECK(whole.status != 0);
  CHECK_THAT(whole.output, Catch::Contains("the run is a job of many adapters (a, b): name one"));
  const Result eval =
      sh(fmt::format("{} {} --model {}/llama --adapter mongodb-run:{}/{}/a/best --data {}/a.jsonl "
                     "--prompt-field instruction --text-field output",
                     env, bin("lora-eval"), LORARUN_MODEL_FIXTURES, db, id, dir));
  INFO(eval.output);
  CHECK(eval.status == 0);
}

TEST_CASE(
    "adapters: DPO, ORPO, SimPO and KTO jobs on 2 ranks (dropout, their own lr, an eval split, best/, DPO's and KTO's "
    "reference log-probs precomputed) give each adapter its own run's, with its figures per adapter",
    "[e2e]") {
  const std::string dir = temp_dir("adapters-pairs");
  write_pairs(dir);
  write_answers(dir);
  const std::vector<Tenant> tenants = {{"a", 14, "", ""}, {"b", 10, "lr: 1.0e-2", "train.lr=1.0e-2"}};
  for (const std::string objective : {"dpo", "orpo", "simpo", "kto"}) {
    const bool kto = objective == "kto";  // (labelled answers: kl every step, not every label every step)
    const std::string data = kto ? dir + "/kto" : dir;
    const bool reference = kto || objective == "dpo";
    std::string recipe =
        pairs_job_recipe(dir, objective + "-job", data,
                         {.data = ", shuffle: global",
                          .train = fmt::format(", objective: {}, lr_scheduler: cosine, warmup_steps: 1", objective),
                          .checkpoint = ", keep_best: true",
                          .extra = std::string(reference ? "preference: {precompute_reference: true}\n" : "") +
                                   "eval: {fraction: 0.25, every_n_steps: 2}"});
    if (kto) REQUIRE(sh(fmt::format("sed -i 's/format: preference/format: unpaired/' {}", recipe)).status == 0);
    jsonl_job_against_own_runs(recipe, data, fmt::format("{}/{}-job", dir, objective),
                               fmt::format("{}/{}-own", dir, objective), tenants, objective + " job on 2 ranks");
    // Each adapter's figures in the job's rows are its own run's.
    const std::vector<json> rows = metrics(fmt::format("{}/{}-job", dir, objective));
    const std::string every = kto ? "kl" : "rewards/margins";  // (a figure of every step)
    for (const Tenant& t : tenants) {
      std::vector<json> own;
      for (const json& row : metrics(fmt::format("{}/{}-own/{}", dir, objective, t.name)))
        if (row.contains(every)) own.push_back(row);
      std::vector<json> mine;
      for (const json& row : rows)
        if (row.contains(every + "/" + t.name)) mine.push_back(row);
      REQUIRE(mine.size() == own.size());
      REQUIRE(!own.empty());
      const std::vector<std::string> keys =
          kto ? std::vector<std::string>{"loss", "kl", "logps/chosen"}
              : std::vector<std::string>{"loss", "rewards/margins", "rewards/accuracies", "logps/chosen"};
      for (size_t k = 0; k < own.size(); ++k)
        for (const std::string& key : keys) {
          if (!own[k].contains(key)) continue;
          INFO(t.name << " step " << k << " " << key);
          CHECK(mine[k].at(key + "/" + t.name).get<double>() ==
                Approx(own[k].at(key).get<double>()).epsilon(1e-6).margin(1e-9));
        }
      int evals = 0;
      for (const json& row : rows)
        if (row.value("adapter", "") == t.name && row.contains("eval_" + every)) ++evals;
      CHECK(evals >= 2);
    }
    // adapters.per_pass stacks SFT adapters only: with pairs it is refused, not ignored.
    const Result stacked = sh(fmt::format("{} {} adapters.per_pass=2", bin("lora-train"), recipe));
    CHECK(stacked.status == 78);
    CHECK_THAT(stacked.output, Catch::Contains("adapters.per_pass stacks SFT adapters into shared passes, but with "
                                               "train.objective " +
                                               objective));
  }
}

TEST_CASE(
    "adapters: lora.init_from starts every adapter of an SFT and a DPO job (the reference too) as it starts its own "
    "run, and an adapter it does not fit is one line",
    "[e2e]") {
  const std::string dir = temp_dir("adapters-init-from");
  const std::vector<Tenant> tenants = {{"a", 9, "", ""}, {"b", 7, "lr: 1.0e-2", "train.lr=1.0e-2"}};
  for (const Tenant& t : tenants)
    write_jsonl(fmt::format("{}/{}.jsonl", dir, t.name), tenant_docs(t.name, t.documents, 0));
  const std::string list = fmt::format(
      "adapters: {{list: [{{name: a, path: {0}/a.jsonl}}, {{name: b, path: {0}/b.jsonl, lr: 1.0e-2}}]}}", dir);
  const std::string sft =
      job_recipe(dir, "sft", {.data = ", source: jsonl", .extra = "track: {mongodb: false}\n" + list});
  // The start: an adapter trained alone on a's documents (not zero: B moved).
  const Result start = sh(fmt::format("{} {} 'adapters.list=[]' data.path={}/a.jsonl checkpoint.output_dir={}/start",
                                      bin("lora-train"), sft, dir, dir));
  INFO(start.output);
  REQUIRE(start.status == 0);
  const std::string from = fmt::format("lora.init_from={}/start/epoch_0", dir);
  const Result job =
      sh(fmt::format("{} --nproc-per-node 2 {} {} checkpoint.output_dir={}/sft-job", bin("lorarun"), sft, from, dir));
  INFO(job.output);
  REQUIRE(job.status == 0);
  for (const Tenant& t : tenants)
    run_own(sft, dir + "/sft-own", t, fmt::format("data.path={}/{}.jsonl", dir, t.name), from);
  check_against_own_runs(dir + "/sft-job", dir + "/sft-own", tenants, "SFT job from lora.init_from");

  // DPO from it: the start is the reference as well.
  const std::string pairs_dir = dir + "/pairs";
  fs::create_directories(pairs_dir);
  write_pairs(pairs_dir);
  const std::string dpo =
      pairs_job_recipe(dir, "dpo-job", pairs_dir,
                       {.lora = fmt::format(", init_from: {}/start/epoch_0", dir), .train = ", objective: dpo"});
  const Result dpo_job = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), dpo));
  INFO(dpo_job.output);
  REQUIRE(dpo_job.status == 0);
  for (const Tenant& t : tenants)
    run_own(dpo, dir + "/dpo-own", t, fmt::format("data.path={}/{}.jsonl", pairs_dir, t.name));
  check_against_own_runs(dir + "/dpo-job", dir + "/dpo-own", tenants, "DPO job from lora.init_from");

  // An adapter whose r is not the start's: refused in one line naming it, before anything is trained.
  const Result bad =
      sh(fmt::format("{} {} {} 'adapters.list=[{{name: a, path: {}/a.jsonl}}, {{name: b, path: {}/b.jsonl, r: 8}}]' "
                     "checkpoint.output_dir={}/bad",
                     bin("lora-train"), sft, from, dir, dir, dir));
  INFO(bad.output);
  CHECK(bad.status == 78);
  CHECK_THAT(bad.output, Catch::Contains("adapter 'b': lora.init_from") &&
                             Catch::Contains("has r=4 but the adapter trains with r=8"));
  CHECK(!fs::exists(dir + "/bad/b/epoch_0"));
}

TEST_CASE(
    "adapters.per with data.sources from FerretDB: each adapter of a 3-adapter job on 2 ranks mixes its own documents "
    "of two collections (weights 2:1, one with its own template, eval.fraction of each) and is its own run, its "
    "source counts too",
    "[e2e][db]") {
  const std::string dir = temp_dir("adapters-sources");
  const std::string uri = test_uri(), db = "lorarun_test_adapters_sources";
  lorarun::data::Client client(uri, std::chrono::seconds(10), {"the test"});
  client.drop(db, "qa");
  client.drop(db, "notes");
  struct Counts {
    std::string name;
    int qa, notes;
  };
  const std::vector<Counts> counts = {{"acme", 14, 8}, {"globex", 20, 9}, {"initech", 10, 16}};
  std::vector<Tenant> tenants;
  int from = 0;
  for (const Counts& c : counts) {  // (fixed _ids: eval.fraction holds out by a hash of each)
    std::vector<json> qa = tenant_docs(c.name, c.qa, from), notes = tenant_docs(c.name, c.notes, from + 50);
    for (size_t i = 0; i < qa.size(); ++i) qa[i]["_id"] = from + static_cast<int>(i);
    for (size_t i = 0; i < notes.size(); ++i) notes[i]["_id"] = 1000 + from + static_cast<int>(i);
    client.insert_many(db, "qa", qa);
    client.insert_many(db, "notes", notes);
    tenants.push_back({c.name, c.qa + c.notes, "", ""});
    from += 100;
  }
  const std::string data = ", uri: \"" + uri + "\", database: " + db +
                           ", sources: [{name: qa, collection: qa, weight: 2}, {name: notes, collection: notes, "
                           "prompt_template: \"N: {instruction}\\nA: \"}]";
  const std::string recipe =
      job_recipe(dir, "job",
                 {.data = data,
                  .checkpoint = ", keep_best: true",
                  .extra = "eval: {fraction: 0.25}\ntrack: {mongodb: false}\nadapters: {per: tenant}"});
  const Result dry = sh(fmt::format("{} --dry-run {}", bin("lora-train"), recipe));
  INFO(dry.output);
  REQUIRE(dry.status == 0);
  CHECK_THAT(dry.output, Catch::Contains("# 3 adapters, each trained as its own run would be"));
  CHECK_THAT(dry.output, Catch::Contains("initech: 26 documents"));

  const Result job = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), recipe));
  INFO(job.output);
  REQUIRE(job.status == 0);
  CHECK_THAT(job.output, Catch::Contains("adapter 'globex': LoRA r 4"));
  for (const Tenant& t : tenants) run_own(recipe, dir + "/own", t, fmt::format("'data.filter={{tenant: {}}}'", t.name));
  check_against_own_runs(dir + "/job", dir + "/own", tenants, "per: tenant over data.sources, 2 ranks, eval.fraction");
  // Each adapter's documents per source over its steps, as its own run counts them: a mixture of its own.
  for (const Tenant& t : tenants) {
    json job_sum = {{"qa", 0}, {"notes", 0}}, own_sum = job_sum;
    for (const json& row : metrics(dir + "/job"))
      if (row.contains("source_documents/" + t.name))
        for (const char* s : {"qa", "notes"})
          job_sum[s] = job_sum[s].get<int>() + row["source_documents/" + t.name][s].get<int>();
    for (const json& row : metrics(dir + "/own/" + t.name))
      if (row.contains("source_documents"))
        for (const char* s : {"qa", "notes"})
          own_sum[s] = own_sum[s].get<int>() + row["source_documents"][s].get<int>();
    INFO(t.name << ": job " << job_sum.dump() << ", own " << own_sum.dump());
    CHECK(job_sum == own_sum);
    CHECK(job_sum["qa"].get<int>() > 0);
    CHECK(job_sum["notes"].get<int>() > 0);
    CHECK(json::parse(read_file(fmt::format("{}/job/{}/best/best.json", dir, t.name)))["eval_loss"] ==
          json::parse(read_file(fmt::format("{}/own/{}/best/best.json", dir, t.name)))["eval_loss"]);
  }
}

TEST_CASE(
    "adapters with DoRA: each adapter of a 3-adapter job on 2 ranks (dropout, LoRA+, one at r 8, passes of 2) keeps "
    "its own magnitudes and is its own run",
    "[e2e]") {
  const std::string dir = temp_dir("adapters-dora");
  const std::vector<Tenant> tenants = {
      {"d0", 6, "", ""}, {"d1", 11, "r: 8", "lora.r=8"}, {"d2", 9, "lr: 2.0e-3", "train.lr=2.0e-3"}};
  const std::string list = write_tenants(dir, tenants);
  const std::string recipe =
      job_recipe(dir, "job",
                 {.lora = ", use_dora: true, plus_lr_ratio: 4",
                  .data = ", source: jsonl",
                  .extra = fmt::format("track: {{mongodb: false}}\nadapters: {{per_pass: 2, list: [{}]}}", list)});
  const Result job = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), recipe));
  INFO(job.output);
  REQUIRE(job.status == 0);
  CHECK_THAT(job.output, Catch::Contains("DoRA: a learnt magnitude per output row"));
  for (const Tenant& t : tenants) run_own(recipe, dir + "/own", t, fmt::format("data.path={}/{}.jsonl", dir, t.name));
  check_against_own_runs(dir + "/job", dir + "/own", tenants, "DoRA, LoRA+, 2 ranks, passes of 2");
  for (const Tenant& t : tenants) {  // PEFT's DoRA adapter: its magnitudes saved, and trained away from their start
    const std::string epoch = fmt::format("{}/job/{}/epoch_1", dir, t.name);
    CHECK(json::parse(read_file(epoch + "/adapter_config.json"))["use_dora"] == true);
    CHECK_THAT(adapter_keys(epoch + "/adapter_model.safetensors"), Catch::Contains("q_proj.lora_magnitude_vector"));
  }
}

TEST_CASE(
    "adapters with trained tables: modules_to_save (embedding and head) and trainable tokens, each adapter its own "
    "copies, in an SFT job on 2 ranks in passes of 2 and a DPO job (the reference without them), are its own run",
    "[e2e]") {
  const std::string dir = temp_dir("adapters-tables");
  // (the fixture llama ties its head to the embedding; 16..25 are its digits, 33 "A", 298 "dd")
  const std::string tokens = ", trainable_token_indices: [16, 17, 18, 20, 23, 33, 298]";
  const std::vector<Tenant> tenants = {{"s0", 7, "", ""}, {"s1", 11, "r: 8", "lora.r=8"}, {"s2", 9, "", ""}};
  const std::string list = write_tenants(dir, tenants);
  for (const auto& [variant, lora] :
       {std::pair{"save", ", modules_to_save: [embed_tokens, lm_head]"}, std::pair{"tokens", tokens.c_str()}}) {
    const std::string recipe =
        job_recipe(dir, fmt::format("{}-job", variant),
                   {.lora = lora,
                    .data = ", source: jsonl",
                    .extra = fmt::format("track: {{mongodb: false}}\nadapters: {{per_pass: 2, list: [{}]}}", list)});
    jsonl_job_against_own_runs(recipe, dir, fmt::format("{}/{}-job", dir, variant),
                               fmt::format("{}/{}-own", dir, variant), tenants,
                               fmt::format("{}, 2 ranks, passes of 2", variant));
    const std::string epoch = fmt::format("{}/{}-job/s1/epoch_1", dir, variant);
    const std::string keys = adapter_keys(epoch + "/adapter_model.safetensors");
    CHECK_THAT(keys,
               Catch::Contains(variant == std::string("save") ? "base_model.model.lm_head.weight"
                                                              : "embed_tokens.token_adapter.trainable_tokens_delta"));
  }
  write_pairs(dir);
  const std::vector<Tenant> pairs = {{"a", 14, "", ""}, {"b", 10, "lr: 1.0e-2", "train.lr=1.0e-2"}};
  const std::string recipe = pairs_job_recipe(dir, "dpo-job", dir, {.lora = tokens, .train = ", objective: dpo"});
  jsonl_job_against_own_runs(recipe, dir, dir + "/dpo-job", dir + "/dpo-own", pairs, "DPO, trainable tokens, 2 ranks");
}
