// What a run must never do, tried end to end with the real binaries on the tiny llama fixture:
// leak a password, report success for a run that did not train, differ between two identical
// runs, share an output directory, or trust a resumable state that was cut short or edited.
#include <fmt/format.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <nlohmann/json.hpp>
#include <numeric>
#include <sstream>

#include "data/mongo.hpp"
#include "io/files.hpp"
#include "io/sha256.hpp"
#include "support/process.hpp"
#include "support/runs.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

std::string lorarun_cmd(int ranks, const std::string& recipe, const std::string& overrides = "") {
  return fmt::format("{} --nproc-per-node {} {} {}", bin("lorarun"), ranks, recipe, overrides);
}

std::string all_text_under(const std::string& dir) {
  std::string all;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) all += e.path().string() + "\n" + read_file(e.path().string()) + "\n";
  return all;
}

// A FerretDB of the test's own that demands SCRAM-SHA-256 credentials; stopped on destruction.
struct AuthServer {
  std::string state, host;
  AuthServer(const std::string& dir, const std::string& user, const std::string& password) : state(dir + "/ferretdb") {
    setenv("FERRETDB_AUTH_USER", user.c_str(), 1);
    setenv("FERRETDB_AUTH_PASSWORD", password.c_str(), 1);
    const Result r = sh(fmt::format("'{}/scripts/ferretdb' start '{}' | tail -n 1", LORARUN_SOURCE_DIR, state));
    unsetenv("FERRETDB_AUTH_USER");
    unsetenv("FERRETDB_AUTH_PASSWORD");
    REQUIRE(r.status == 0);
    const size_t start = r.output.find("://") + 3;
    host = r.output.substr(start, r.output.find('/', start) - start);
  }
  ~AuthServer() { sh(fmt::format("'{}/scripts/ferretdb' stop '{}'", LORARUN_SOURCE_DIR, state)); }
  std::string uri(const std::string& user, const std::string& password_as_written) const {
    return fmt::format("mongodb://{}:{}@{}/?authSource=admin&authMechanism=SCRAM-SHA-256", user, password_as_written,
                       host);
  }
};

bool same_file(const std::string& a, const std::string& b) { return read_file(a) == read_file(b); }

}  // namespace

TEST_CASE("a password holding #, ?, /, @ and : reaches no output, file or record", "[e2e][db]") {
  const std::string dir = temp_dir("secret-uri");
  const std::string password = "Tr0ub#d?r/x@y:z";
  const AuthServer server(dir, "alice", password);
  // '#' and '?' as written (the driver takes them), '/', '@' and ':' percent-encoded.
  const std::string uri = server.uri("alice", "Tr0ub#d?r%2Fx%40y%3Az");
  const std::string encoded = server.uri("alice", "Tr0ub%23d%3Fr%2Fx%40y%3Az");
  // Every form of the password starts with this; none may appear anywhere.
  const std::string secret = "Tr0ub";
  write_data(dir + "/data.jsonl", 24);
  const Result imp = sh(
      fmt::format("{} import {}/data.jsonl --uri '{}' --db secretdb --collection ex", bin("lora-data"), dir, encoded));
  INFO(imp.output);
  REQUIRE(imp.status == 0);
  CHECK(imp.output.find(secret) == std::string::npos);

  const std::string recipe = fmt::format("{}/r.yaml", dir);
  std::ofstream(recipe) << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8}}
data: {{uri: "{}", database: secretdb, collection: ex, prompt_template: "Q: {{instruction}}\nA: ", batch_size: 2}}
train: {{epochs: 1, lr: 1.0e-3}}
checkpoint: {{output_dir: {}/out}}
)",
                                       LORARUN_MODEL_FIXTURES, uri, dir);
  const Result run = sh(lorarun_cmd(2, recipe));
  INFO(run.output);
  REQUIRE(run.status == 0);
  CHECK(run.output.find(secret) == std::string::npos);
  CHECK(all_text_under(dir + "/out").find(secret) == std::string::npos);
  const std::string ref = run.output.substr(run.output.find("--from-run ") + 11, 34);
  lorarun::data::Client db(encoded, std::chrono::milliseconds(5000));
  for (const char* coll : {"runs", "metrics"}) {
    const auto docs = db.find("secretdb", coll, json::object());
    CHECK(!docs.empty());
    for (const json& d : docs) CHECK(d.dump().find(secret) == std::string::npos);
  }
  // --from-run shows the stored recipe; the URI given replaces the redacted one, and stays hidden.
  const Result again = sh(fmt::format("{} --from-run {} --uri '{}' --dry-run", bin("lora-train"), ref, uri));
  INFO(again.output);
  CHECK(again.status == 0);
  CHECK(again.output.find(secret) == std::string::npos);

  // Failing runs: an error naming the URI (a missing collection), and a URI whose '@' is unescaped.
  const Result missing = sh(lorarun_cmd(2, recipe, "data.collection=nope checkpoint.output_dir=" + dir + "/out2"));
  INFO(missing.output);
  CHECK(missing.status != 0);
  CHECK(missing.output.find(secret) == std::string::npos);
  CHECK(all_text_under(dir + "/out2").find(secret) == std::string::npos);
  const std::string bad_at = server.uri("alice", "Tr0ub#d?r/x@y%3Az");
  const Result unescaped =
      sh(lorarun_cmd(1, recipe, fmt::format("'data.uri={}' checkpoint.output_dir={}/out3", bad_at, dir)));
  INFO(unescaped.output);
  CHECK(unescaped.status != 0);
  CHECK(unescaped.output.find(secret) == std::string::npos);
  CHECK(unescaped.output.find("x@y") == std::string::npos);
  CHECK_THAT(unescaped.output, Catch::Contains("percent-encode"));
  CHECK(all_text_under(dir + "/out3").find(secret) == std::string::npos);
  const Result tool = sh(fmt::format("{} stats --uri '{}' --db secretdb --collection ex", bin("lora-data"), bad_at));
  INFO(tool.output);
  CHECK(tool.status != 0);
  CHECK(tool.output.find(secret) == std::string::npos);
}

TEST_CASE("a diverging run stops every rank at the same step, saves no adapter, exits non-zero, is recorded failed",
          "[e2e][db]") {
  const std::string dir = temp_dir("diverge");
  write_data(dir + "/data.jsonl", 40);
  const std::string db = fmt::format("diverge_{}", getpid());
  // lr 1e30: the first step makes LoRA weights of ~1e30, whose product overflows float32 on any CPU
  // (at 1e9 the weights stayed finite on some machines and the loss merely saturated).
  const std::string recipe = write_recipe(dir, "out", "epochs: 2, lr: 1.0e+30", "", ", batch_size: 2", "");
  const Result r = sh(fmt::format("LORARUN_MONGODB_URI='{}' {}", test_uri(),
                                  lorarun_cmd(2, recipe, "track.mongodb=true track.database=" + db)));
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK_THAT(r.output, Catch::Contains("training diverged at step"));
  CHECK_THAT(r.output, !Catch::Contains("done:"));
  for (const auto& e : fs::directory_iterator(dir + "/out"))
    CHECK(e.path().filename().string().rfind("epoch_", 0) != 0);
  CHECK_FALSE(fs::exists(dir + "/out/run.json"));
  // Both ranks stopped at the same step, for the same reason.
  const std::string r0 = read_file(dir + "/out/logs/rank_0.log"), r1 = read_file(dir + "/out/logs/rank_1.log");
  const size_t a = r0.find("training diverged at step"), b = r1.find("training diverged at step");
  REQUIRE(a != std::string::npos);
  REQUIRE(b != std::string::npos);
  CHECK(r0.substr(a, 32) == r1.substr(b, 32));
  lorarun::data::Client c(test_uri(), std::chrono::milliseconds(5000));
  const auto runs = c.find(db, "runs", json::object());
  REQUIRE(runs.size() == 1);
  CHECK(runs[0]["status"] == "failed");
  CHECK_THAT(runs[0]["error"].get<std::string>(), Catch::Contains("diverged"));
}

TEST_CASE(
    "skipped documents: a run that skips more than data.max_skipped_share of an epoch stops at that step with one line "
    "naming the commonest cause, and skipped counts are summed over ranks by cause",
    "[e2e]") {
  const std::string dir = temp_dir("rejected");
  {
    std::ofstream data(dir + "/data.jsonl");
    for (int i = 0; i < 12; ++i)
      data << json{{"instruction", "a long question " + std::string(200, 'x')}, {"output", "y"}}.dump() << "\n";
  }
  const std::string recipe =
      write_recipe(dir, "out", "epochs: 1, lr: 1.0e-3", "", ", batch_size: 2, max_length: 16, overlong: skip");
  // Every document overlong: the first step (4 of the epoch's 12) shows it.
  const Result r = sh(lorarun_cmd(2, recipe));
  INFO(r.output);
  CHECK(r.status == 78);
  CHECK_THAT(r.output, Catch::Contains("epoch 0 skipped 4 of its 12 documents (4 overlong), more than "
                                       "data.max_skipped_share 0.05 allows: most were overlong (here: document #"));
  CHECK_FALSE(fs::exists(dir + "/out/epoch_0"));
  std::vector<json> rows;
  {
    std::istringstream in(read_file(dir + "/out/metrics.jsonl"));
    for (std::string line; std::getline(in, line);) rows.push_back(json::parse(line));
  }
  REQUIRE(rows.size() == 1);  // stopped after its first step
  CHECK(rows[0]["skipped"] == 4);
  CHECK(rows[0]["skipped/overlong"] == 4);
  // With data.max_skipped_share 1 the epoch runs out and trains nothing, which is never success.
  const Result all = sh(lorarun_cmd(2, recipe, "data.max_skipped_share=1 checkpoint.overwrite=true"));
  INFO(all.output);
  CHECK(all.status != 0);
  CHECK_THAT(all.output,
             Catch::Contains("trained on no token: every document of the selection was rejected (12 skipped"));
  CHECK_FALSE(fs::exists(dir + "/out/epoch_0"));

  // 5 of 20 documents lack the response field, on both ranks: one total, summed over the ranks.
  {
    std::ofstream data(dir + "/data.jsonl");
    for (int i = 0; i < 20; ++i)
      data << (i % 4 == 1 ? json{{"instruction", "q"}} : json{{"instruction", fmt::format("q{}", i)}, {"output", "a"}})
                  .dump()
           << "\n";
  }
  const Result some =
      sh(lorarun_cmd(2, recipe, "data.max_length=64 data.max_skipped_share=0.25 checkpoint.overwrite=true"));
  INFO(some.output);
  CHECK(some.status == 0);
  CHECK_THAT(some.output, Catch::Contains("5 documents were skipped on all ranks together: 5 malformed"));
  const Result most = sh(lorarun_cmd(2, recipe, "data.max_length=64 checkpoint.overwrite=true"));
  INFO(most.output);
  CHECK(most.status == 78);
  CHECK_THAT(most.output, Catch::Contains("of its 20 documents") && Catch::Contains("most were malformed"));
}

TEST_CASE("with dropout, the same recipe gives the same adapter bit for bit, another seed another one", "[e2e]") {
  const std::string dir = temp_dir("dropout");
  write_data(dir + "/data.jsonl", 32);
  const std::string train = "epochs: 2, lr: 1.0e-3";
  for (const char* name : {"a", "b", "c"}) write_recipe(dir, name, train, ", dropout: 0.1", ", batch_size: 2");
  for (const auto& [name, extra] : {std::pair{"a", ""}, std::pair{"b", ""}, std::pair{"c", "train.seed=7"}}) {
    const Result r = sh(lorarun_cmd(2, fmt::format("{}/{}.yaml", dir, name), extra));
    INFO(r.output);
    REQUIRE(r.status == 0);
  }
  CHECK(same_file(dir + "/a/epoch_1/adapter_model.safetensors", dir + "/b/epoch_1/adapter_model.safetensors"));
  CHECK_FALSE(same_file(dir + "/a/epoch_1/adapter_model.safetensors", dir + "/c/epoch_1/adapter_model.safetensors"));
}

TEST_CASE("with dropout, SIGTERM and the same command resume to the uninterrupted adapter, metrics once per step",
          "[e2e]") {
  const std::string dir = temp_dir("dropout-resume");
  write_data(dir + "/data.jsonl", 160);
  const std::string train = "epochs: 2, lr: 1.0e-3";
  const std::string full = write_recipe(dir, "full", train, ", dropout: 0.1", ", batch_size: 1");
  const std::string cut = write_recipe(dir, "cut", train, ", dropout: 0.1", ", batch_size: 1");
  REQUIRE(sh(lorarun_cmd(2, full)).status == 0);
  const Result b = interrupt(lorarun_cmd(2, cut), dir + "/cut.log", "epoch 0/2 step 20/80", "kill -TERM $pid");
  INFO(read_file(dir + "/cut.log"));
  REQUIRE(fs::exists(dir + "/cut/resume_state/manifest.json"));
  const Result c = sh(lorarun_cmd(2, cut));
  INFO(c.output);
  REQUIRE(c.status == 0);
  CHECK_THAT(c.output, Catch::Contains("resuming at epoch 0"));
  CHECK(same_file(dir + "/full/epoch_1/adapter_model.safetensors", dir + "/cut/epoch_1/adapter_model.safetensors"));
  std::vector<int> steps;
  std::ifstream metrics(dir + "/cut/metrics.jsonl");
  for (std::string line; std::getline(metrics, line);) steps.push_back(json::parse(line)["step"].get<int>());
  std::vector<int> want(160);
  std::iota(want.begin(), want.end(), 1);
  CHECK(steps == want);
}

TEST_CASE(
    "one output directory, one run: a second run fails at once naming the holder, and a finished run's "
    "adapters are replaced only with checkpoint.overwrite",
    "[e2e]") {
  const std::string dir = temp_dir("one-dir");
  write_data(dir + "/data.jsonl", 200);
  const std::string recipe = write_recipe(dir, "out", "epochs: 1, lr: 1.0e-3", "", ", batch_size: 1");
  const std::string second =
      fmt::format("{} > {}/second.log 2>&1; echo second=$? >> {}/second.log", lorarun_cmd(1, recipe), dir, dir);
  const Result first =
      interrupt(lorarun_cmd(1, recipe), dir + "/first.log", "epoch 0/1 step 5/200", second + "; kill -TERM $pid");
  const std::string log2 = read_file(dir + "/second.log");
  INFO(log2);
  INFO(read_file(dir + "/first.log"));
  CHECK_THAT(log2, Catch::Contains("is in use by another run (pid "));
  CHECK_THAT(log2, Catch::Contains("second=78"));  // a restart cannot change it
  CHECK(occurrences(log2, "is in use by another run") == 1);
  CHECK_THAT(first.output, Catch::Contains("exit=75"));
  // The interrupted run resumes and finishes; its adapter is then another run's to keep.
  const Result done = sh(lorarun_cmd(1, recipe));
  INFO(done.output);
  REQUIRE(done.status == 0);
  const std::string adapter = dir + "/out/epoch_0/adapter_model.safetensors";
  const std::string before = lorarun::io::sha256_file(adapter);
  const Result refused = sh(lorarun_cmd(1, recipe, "train.lr=2e-3"));
  INFO(refused.output);
  CHECK(refused.status == 78);
  CHECK_THAT(refused.output, Catch::Contains("holds the adapters of another run"));
  CHECK_THAT(refused.output, Catch::Contains("checkpoint.overwrite=true"));
  CHECK(lorarun::io::sha256_file(adapter) == before);
  const Result replaced = sh(lorarun_cmd(1, recipe, "train.lr=2e-3 checkpoint.overwrite=true"));
  INFO(replaced.output);
  CHECK(replaced.status == 0);
  CHECK(lorarun::io::sha256_file(adapter) != before);
}

namespace {

// Rewrites resume_state/manifest.json with the files' current sums (an edit that keeps the
// checksums right, so what is checked next is the content).
void reseal(const std::string& state) {
  json sums = json::object();
  for (const auto& e : fs::directory_iterator(state))
    if (e.path().filename() != "manifest.json")
      sums[e.path().filename().string()] = lorarun::io::sha256_file(e.path().string());
  std::ofstream(state + "/manifest.json") << json{{"sha256", sums}}.dump();
}

void edit_state_json(const std::string& state, const std::string& key, const json& value) {
  json j = json::parse(read_file(state + "/state.json"));
  j[key] = value;
  std::ofstream(state + "/state.json") << j.dump();
}

// Puts a NaN as the first value of tensor `name` in a safetensors file.
void poison(const std::string& path, const std::string& name) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  uint64_t n = 0;
  f.read(reinterpret_cast<char*>(&n), 8);
  std::string header(n, '\0');
  f.read(header.data(), static_cast<std::streamsize>(n));
  const uint64_t begin = json::parse(header)[name]["data_offsets"][0].get<uint64_t>();
  const float nan = std::numeric_limits<float>::quiet_NaN();
  f.seekp(static_cast<std::streamoff>(8 + n + begin));
  f.write(reinterpret_cast<const char*>(&nan), sizeof nan);
}

}  // namespace

TEST_CASE("a resumable state that was cut short or edited is refused with one line, and kept", "[e2e]") {
  const std::string dir = temp_dir("bad-state");
  write_data(dir + "/data.jsonl", 120);
  const std::string recipe = write_recipe(dir, "out", "epochs: 2, lr: 1.0e-3", "", ", batch_size: 1");
  const Result cut = interrupt(lorarun_cmd(1, recipe), dir + "/cut.log", "epoch 0/2 step 10/120", "kill -TERM $pid");
  INFO(read_file(dir + "/cut.log"));
  const std::string state = dir + "/out/resume_state", pristine = dir + "/pristine";
  REQUIRE(fs::exists(state + "/manifest.json"));
  fs::copy(state, pristine);
  const auto restore = [&] {
    lorarun::io::remove_tree(state);
    fs::copy(pristine, state);
  };
  const std::vector<std::pair<std::function<void()>, std::string>> cases = {
      {[&] { fs::remove(state + "/state.json"); }, "is incomplete (state.json is missing)"},
      {[&] { fs::remove(state + "/manifest.json"); }, "is incomplete (manifest.json is missing)"},
      {[&] { edit_state_json(state, "epoch", 5); }, "was changed after it was written (state.json does not match"},
      {[&] { edit_state_json(state, "epoch", 5), reseal(state); }, "is at epoch 5, outside this run's epochs 0..1"},
      {[&] { edit_state_json(state, "step_in_epoch", 99999), reseal(state); }, "is at step 99999 of epoch 0, outside"},
      {[&] { edit_state_json(state, "step_in_epoch", -3), reseal(state); }, "is at step -3 of epoch 0, outside"},
      {[&] { edit_state_json(state, "step", 3), reseal(state); }, "counts 3 steps in all"},
      {[&] { poison(state + "/state.safetensors", "0.param"), reseal(state); }, "holds non-finite values in 0.param"},
  };
  for (const auto& [damage, message] : cases) {
    restore();
    damage();
    const Result r = sh(lorarun_cmd(1, recipe));
    INFO(r.output);
    CHECK(r.status == 78);  // kept as it is, it is refused again: no restart is spent on it
    CHECK_THAT(r.output, Catch::Contains(message));
    CHECK_THAT(r.output, Catch::Contains("checkpoint.resume=never"));
    CHECK_THAT(r.output, !Catch::Contains("frame #"));
    CHECK(fs::exists(state));  // refused, never deleted
    CHECK_FALSE(fs::exists(dir + "/out/epoch_0"));
  }
  restore();
  const Result ok = sh(lorarun_cmd(1, recipe));
  INFO(ok.output);
  CHECK(ok.status == 0);
  CHECK_THAT(ok.output, Catch::Contains("resuming at epoch 0 step "));
}

TEST_CASE("lora.init_from: keys that change the weights' function must agree, and dropout is the recipe's", "[e2e]") {
  const std::string dir = temp_dir("init-from");
  write_data(dir + "/data.jsonl", 16);
  const std::string base = write_recipe(dir, "base", "epochs: 1, lr: 1.0e-3", ", dropout: 0.0", ", batch_size: 2");
  REQUIRE(sh(lorarun_cmd(1, base)).status == 0);
  const std::string from = "lora.init_from=" + dir + "/base/epoch_0";
  const std::string next = write_recipe(dir, "next", "epochs: 1, lr: 1.0e-3", ", dropout: 0.1", ", batch_size: 2");
  const Result targets = sh(lorarun_cmd(1, next, from + " 'lora.target_modules=[q_proj, v_proj]'"));
  INFO(targets.output);
  CHECK(targets.status == 78);  // the recipe's to fix: not restarted
  CHECK_THAT(targets.output, Catch::Contains("but the recipe says lora.target_modules="));
  const Result rslora = sh(lorarun_cmd(1, next, from + " lora.use_rslora=true"));
  INFO(rslora.output);
  CHECK(rslora.status == 78);
  CHECK_THAT(rslora.output,
             Catch::Contains("was trained with use_rslora=false but the recipe says lora.use_rslora=true"));
  const Result ok = sh(lorarun_cmd(1, next, from));
  INFO(ok.output);
  REQUIRE(ok.status == 0);
  const json cfg = json::parse(read_file(dir + "/next/epoch_0/adapter_config.json"));
  CHECK(cfg["lora_dropout"].get<double>() == 0.1);
  CHECK(cfg["target_modules"].size() == 7);  // all-linear on llama: q k v o gate up down
}

TEST_CASE("a recipe warning is printed once, not once per rank", "[e2e]") {
  const std::string dir = temp_dir("warn-once");
  write_data(dir + "/data.jsonl", 8);
  const std::string recipe = write_recipe(dir, "out", "epochs: 2, lr: 1.0e-3", "", ", batch_size: 2");
  const Result r = sh(lorarun_cmd(2, recipe, "checkpoint.save_last_epoch_only=true 'checkpoint.epochs_to_save=[0]'"));
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK(occurrences(r.output, "takes precedence over") == 1);
}

namespace {

// A FerretDB of the test's own that can be stopped and started again on the same port.
struct OwnServer {
  std::string state, port;
  explicit OwnServer(const std::string& dir) : state(dir + "/ferretdb") { start(); }
  ~OwnServer() { stop(); }
  void start() {
    const Result r = sh(fmt::format("'{}/scripts/ferretdb' start '{}' {} | tail -n 1", LORARUN_SOURCE_DIR, state,
                                    port.empty() ? "0" : port));
    REQUIRE(r.status == 0);
    const std::string uri = r.output.substr(0, r.output.find('\n'));
    port = uri.substr(uri.rfind(':') + 1, uri.rfind('/') - uri.rfind(':') - 1);
  }
  void stop() { sh(fmt::format("'{}/scripts/ferretdb' stop '{}'", LORARUN_SOURCE_DIR, state)); }
  std::string uri() const { return fmt::format("mongodb://127.0.0.1:{}/", port); }
  // kill -9: a graceful stop lets open connections finish their work first.
  std::string stop_command() const {
    return fmt::format("kill -9 $(cat '{0}/ferretdb.pid'); rm -f '{0}/ferretdb.pid' '{0}/uri'", state);
  }
};

}  // namespace

TEST_CASE(
    "the database gone mid-epoch: every rank saves the last completed step and exits 75, also on SIGTERM "
    "during the wait to retry, and the rerun ends with the uninterrupted adapter",
    "[e2e][db]") {
  const std::string dir = temp_dir("data-lost");
  OwnServer server(dir);
  write_data(dir + "/data.jsonl", 600);
  REQUIRE(sh(fmt::format("{} import {}/data.jsonl --uri '{}' --db lost --collection ex", bin("lora-data"), dir,
                         server.uri()))
              .status == 0);
  // 300 documents a rank, read 256 at a time and none ahead (prefetch 0): the second read comes
  // at step 257, after the server is gone.
  const auto recipe = [&](const std::string& name) {
    const std::string path = fmt::format("{}/{}.yaml", dir, name);
    std::ofstream(path) << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, dropout: 0.1}}
data: {{uri: "{}", database: lost, collection: ex, prompt_template: "Q: {{instruction}}\nA: ", batch_size: 1,
        prefetch: 0}}
train: {{epochs: 1, lr: 1.0e-3}}
checkpoint: {{output_dir: {}/{}}}
track: {{mongodb: false}}
)",
                                       LORARUN_MODEL_FIXTURES, server.uri(), dir, name);
    return path;
  };
  const std::string full = recipe("full"), cut = recipe("cut"), term = recipe("term");
  REQUIRE(sh(lorarun_cmd(2, full)).status == 0);

  // Retries spent: the ranks agree, save step 256 and stop with 75.
  const Result lost = interrupt(lorarun_cmd(2, cut, "data.retries=1 data.retry_backoff_s=0.2"), dir + "/cut.log",
                                "step 20/300", server.stop_command());
  const std::string log = read_file(dir + "/cut.log");
  INFO(log);
  CHECK_THAT(lost.output, Catch::Contains("exit=75"));
  CHECK_THAT(log, Catch::Contains("the resumable state of step 256"));
  CHECK_THAT(log, !Catch::Contains("frame #"));
  REQUIRE(fs::exists(dir + "/cut/resume_state/manifest.json"));
  server.start();
  const Result again = sh(lorarun_cmd(2, cut));
  INFO(again.output);
  REQUIRE(again.status == 0);
  CHECK_THAT(again.output, Catch::Contains("resuming at epoch 0 step 256"));
  CHECK(same_file(dir + "/full/epoch_0/adapter_model.safetensors", dir + "/cut/epoch_0/adapter_model.safetensors"));

  // SIGTERM while a rank waits 30 s to retry: it stops at once, state saved.
  const Result stopped =
      interrupt(lorarun_cmd(2, term, "data.retries=5 data.retry_backoff_s=30"), dir + "/term.log", "step 200/300",
                server.stop_command() +
                    "; for i in $(seq 1 400); do grep -q 'step 256/300' \"$log\" "
                    "&& break; sleep 0.05; done; sleep 0.5; t0=$(date +%s); kill -TERM $pid; wait $pid; "
                    "echo stopped=$?; echo waited=$(( $(date +%s) - t0 ))");
  INFO(stopped.output);
  CHECK_THAT(stopped.output, Catch::Contains("stopped=75"));
  const size_t w = stopped.output.find("waited=");
  REQUIRE(w != std::string::npos);
  CHECK(std::stoi(stopped.output.substr(w + 7)) <= 5);
  REQUIRE(fs::exists(dir + "/term/resume_state/manifest.json"));
  server.start();
  const Result resumed = sh(lorarun_cmd(2, term));
  INFO(resumed.output);
  REQUIRE(resumed.status == 0);
  CHECK(same_file(dir + "/full/epoch_0/adapter_model.safetensors", dir + "/term/epoch_0/adapter_model.safetensors"));
}
