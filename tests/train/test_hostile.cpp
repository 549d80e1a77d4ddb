// What a hostile (or merely unlucky) user found: a database writer who tries to become a file
// writer through a restore, a pull or --adapter mongodb-run:; a second command that would take
// over a live run; a stop during an evaluation; data that changed under a resumable state.
#include <fmt/format.h>
#include <mongoc/mongoc.h>
#include <sys/stat.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "data/example.hpp"
#include "data/mongo.hpp"
#include "data/mongo_handles.hpp"
#include "io/sha256.hpp"
#include "support/runs.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;
using namespace std::string_literals;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

json run_document(const std::string& db, const std::string& id) {
  lorarun::data::Client c(test_uri(), std::chrono::seconds(5));
  const std::vector<json> runs = c.find(db, "runs", {{"_id", {{"$oid", id}}}});
  REQUIRE(runs.size() == 1);
  return runs.front();
}

// Sets run `id`'s "artifacts" to `kept` and one more entry written as raw BSON, so that its
// artifact and file names may hold any bytes (a NUL, text that is not UTF-8); its one file is
// `file` (a {name, bytes, sha256, file_id} entry of the run) under the name `file_name`.
void tamper(const std::string& db, const std::string& id, const json& kept, const std::string& artifact,
            const std::string& file_name, const json& file) {
  mongoc_client_t* client = mongoc_client_new(test_uri().c_str());
  REQUIRE(client);
  mongoc_collection_t* runs = mongoc_client_get_collection(client, db.c_str(), "runs");
  bson_t list = BSON_INITIALIZER, entry = BSON_INITIALIZER, files = BSON_INITIALIZER, one = BSON_INITIALIZER;
  int n = 0;
  for (const json& a : kept) {
    const auto doc = lorarun::data::to_bson(a, "an artifact entry");
    const std::string key = std::to_string(n++);  // (the macro below reads its key twice)
    BSON_APPEND_DOCUMENT(&list, key.c_str(), doc.get());
  }
  bson_append_utf8(&entry, "artifact", -1, artifact.data(), static_cast<int>(artifact.size()));
  bson_append_utf8(&one, "name", -1, file_name.data(), static_cast<int>(file_name.size()));
  BSON_APPEND_INT64(&one, "bytes", file["bytes"].get<int64_t>());
  BSON_APPEND_UTF8(&one, "sha256", file["sha256"].get<std::string>().c_str());
  BSON_APPEND_UTF8(&one, "file_id", file["file_id"].get<std::string>().c_str());
  BSON_APPEND_DOCUMENT(&files, "0", &one);
  BSON_APPEND_ARRAY(&entry, "files", &files);
  const std::string last = std::to_string(n);
  BSON_APPEND_DOCUMENT(&list, last.c_str(), &entry);
  bson_t set = BSON_INITIALIZER, update = BSON_INITIALIZER, selector = BSON_INITIALIZER;
  BSON_APPEND_ARRAY(&set, "artifacts", &list);
  BSON_APPEND_DOCUMENT(&update, "$set", &set);
  bson_oid_t oid;
  bson_oid_init_from_string(&oid, id.c_str());
  BSON_APPEND_OID(&selector, "_id", &oid);
  bson_error_t error;
  const bool ok = mongoc_collection_update_one(runs, &selector, &update, nullptr, nullptr, &error);
  INFO(error.message);
  CHECK(ok);
  for (bson_t* b : {&list, &entry, &files, &one, &set, &update, &selector}) bson_destroy(b);
  mongoc_collection_destroy(runs);
  mongoc_client_destroy(client);
}

// Every path under `root` (recursively), for "nothing was written there".
std::set<std::string> tree(const std::string& root) {
  std::set<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(root)) out.insert(e.path().lexically_relative(root).string());
  return out;
}

}  // namespace

TEST_CASE(
    "store: no name from the database becomes a path: restore, lora-runs pull and --adapter mongodb-run: refuse "
    "absolute, '..', 'zzz/../..', NUL, very long and non-UTF-8 names, and write nothing",
    "[e2e][db]") {
  const std::string dir = temp_dir("hostile-names");
  fs::create_directories(dir + "/a/b");
  write_data(dir + "/data.jsonl", 40);
  const std::string db = fmt::format("hostile_names_{}", getpid());
  const std::string recipe = write_recipe(dir, "a/b/out", "epochs: 2, lr: 1.0e-3", "", ", batch_size: 4");
  const std::string out = dir + "/a/b/out";
  const std::string env = fmt::format("LORARUN_MONGODB_URI='{}'", test_uri());
  const std::string cmd = fmt::format(
      "{} {} --nproc-per-node 1 {} track.mongodb=true track.database={} checkpoint.store=mongodb "
      "checkpoint.state_every_n_steps=2",
      env, bin("lorarun"), recipe, db);
  // Stopped in epoch 1: the record lists epoch_0 and the resumable state, stored in GridFS.
  const Result cut = interrupt(cmd, dir + "/cut.log", "epoch 1/2 step 3/10", "kill -TERM $pid");
  INFO(read_file(dir + "/cut.log"));
  REQUIRE_THAT(cut.output, Catch::Contains("exit=75"));
  const std::string id = run_id_in(read_file(dir + "/cut.log"), db);
  const json run = run_document(db, id);
  json kept = run["artifacts"];
  json state_file, epoch_entry;
  for (const json& a : kept) {
    if (a["artifact"] == "resume_state") state_file = a["files"][0];
    if (a["artifact"] == "epoch_0") epoch_entry = a;
  }
  REQUIRE(state_file.is_object());
  REQUIRE(epoch_entry.is_object());
  json kept_without_epoch = json::array();
  for (const json& a : kept)
    if (a["artifact"] != "epoch_0") kept_without_epoch.push_back(a);

  const std::string abs = dir + "/abs-escaped";
  const std::string far = "/tmp/lorarun-escaped-" + std::to_string(getpid());
  const std::vector<std::string> hostile = {abs,
                                            "..",
                                            "../../escaped",
                                            "zzz/../../escaped",
                                            "../../../../../../../.." + far,
                                            "a\0b/escaped"s,
                                            std::string(5000, 'a'),
                                            "\xff\xfe/escaped",
                                            "epoch_0/../../escaped"};
  // What exists outside the run's own directory and logs: nothing may be added there.
  const auto outside = [&] {
    std::set<std::string> s;
    for (const std::string& p : tree(dir))
      if (!p.starts_with("a/b/out/") && p != "a/b/out" && !p.ends_with(".log")) s.insert(p);
    return s;
  };
  const std::set<std::string> before = outside();
  lorarun::data::Client client(test_uri(), std::chrono::seconds(5));

  for (const std::string& name : hostile) {
    const bool utf8 = lorarun::data::valid_utf8(name);
    for (const bool as_file : {false, true}) {
      INFO((as_file ? "a file of epoch_0 named " : "an artifact named ")
           << json(name).dump(-1, ' ', true, json::error_handler_t::replace));
      // The record lists the hostile name: as an artifact beside the real ones, or as epoch_0's file.
      if (as_file)
        tamper(db, id, kept_without_epoch, "epoch_0", name, state_file);
      else
        tamper(db, id, kept, name, "adapter_model.safetensors", state_file);
      // (1) The output directory lost: the same command restores the run from the database.
      fs::remove_all(out);
      sh(cmd + fmt::format(" > '{}/run.log' 2>&1", dir));
      const std::string log = read_file(dir + "/run.log");
      INFO(log);
      CHECK(outside() == before);
      CHECK(!fs::exists(abs));
      CHECK(!fs::exists(far));
      // Not UTF-8, the name either reaches us as the server stored it (FerretDB writes U+FFFD for the
      // bytes) and is refused, or the record has no JSON form, is left out, and a new run starts.
      if (utf8 || log.find("hold text that is not UTF-8") == std::string::npos) {
        CHECK(!fs::exists(out + "/resume_state"));  // nothing restored, nothing trained
        CHECK(lines_with(log, "refusing it").size() == 1);
        CHECK_THAT(log, Catch::Contains("exited with code 78"));  // not worth a restart
      } else {
        CHECK(log.find("restored") == std::string::npos);
      }
      if (!as_file) continue;
      // (2) lora-runs pull and (3) --adapter mongodb-run: of epoch_0 refuse it too, writing nothing.
      const Result pulled = sh(fmt::format("{} {} pull {}/{}/epoch_0 {}/pulled", env, bin("lora-runs"), db, id, dir));
      INFO(pulled.output);
      CHECK(pulled.status != 0);
      CHECK(count_lines(pulled.output) == 1);
      CHECK(!fs::exists(dir + "/pulled"));
      const Result generated =
          sh(fmt::format("{} {} --model {}/llama --adapter mongodb-run:{}/{}/epoch_0 --prompt 'Add 1' "
                         "--max-new-tokens 2 --ids",
                         env, bin("lora-generate"), LORARUN_MODEL_FIXTURES, db, id));
      INFO(generated.output);
      CHECK(generated.status != 0);
      CHECK(count_lines(generated.output) == 1);
      if (utf8) CHECK_THAT(pulled.output + generated.output, Catch::Contains("refusing it"));
      CHECK(outside() == before);
      CHECK(!fs::exists(abs));
      CHECK(!fs::exists(far));
    }
  }
  // A bad name in the resumable state's files (the state is restored last): refused before any
  // epoch is restored, so the output directory holds nothing of the run.
  json kept_without_state = json::array();
  for (const json& a : kept)
    if (a["artifact"] != "resume_state") kept_without_state.push_back(a);
  for (const std::string name : {"..", "zzz/../../escaped"}) {
    INFO("a file of resume_state named " << name);
    tamper(db, id, kept_without_state, "resume_state", name, state_file);
    fs::remove_all(out);
    sh(cmd + fmt::format(" > '{}/run.log' 2>&1", dir));
    const std::string log = read_file(dir + "/run.log");
    INFO(log);
    CHECK(lines_with(log, "refusing it").size() == 1);
    CHECK(!fs::exists(out + "/epoch_0"));
    CHECK(!fs::exists(out + "/resume_state"));
    CHECK(outside() == before);
  }
  // The record as lora-train wrote it: the same command restores it and finishes.
  REQUIRE(client.update_one(db, "runs", {{"_id", {{"$oid", id}}}}, {{"$set", {{"artifacts", kept}}}}));
  fs::remove_all(out);
  const Result restored = sh(cmd);
  INFO(restored.output);
  CHECK(restored.status == 0);
  CHECK_THAT(restored.output, Catch::Contains("restored epoch_0, resume_state of run " + db + "/" + id));
  CHECK(outside() == before);
}

TEST_CASE(
    "a live run's record is never taken over: a second command refuses in one line naming host, pid and "
    "output_dir, and a stale one (its process gone) is taken over and recorded so",
    "[e2e][db]") {
  const std::string dir = temp_dir("hostile-live");
  constexpr int kDocuments = 600;  // 3 epochs of one-document steps: A outlives B's and C's start-ups
  write_data(dir + "/data.jsonl", kDocuments);
  const std::string db = fmt::format("hostile_live_{}", getpid());
  const std::string recipe = write_recipe(dir, "out", "epochs: 3, lr: 1.0e-3", "", ", batch_size: 1");
  const std::string out = dir + "/out";
  const std::string env = fmt::format("LORARUN_MONGODB_URI='{}' LORARUN_LEASE_RENEW_S=1", test_uri());
  const std::string cmd = fmt::format(
      "{} {} --nproc-per-node 1 {} track.mongodb=true track.database={} checkpoint.store=mongodb "
      "checkpoint.state_every_n_steps=20",
      env, bin("lorarun"), recipe, db);

  // (a) A is live; its output directory is removed under it; the same command must not restore A's
  // run from the database, and a run without the store must not share A's directory. On 2 ranks the
  // launcher reports rank 0's refusal, not rank 1's lost connection (3 tries: it was a race).
  std::string two = cmd;
  two.replace(two.find("--nproc-per-node 1"), 18, "--nproc-per-node 2");
  const Result second = interrupt(
      cmd, dir + "/a.log", "stored resume_state in GridFS",
      fmt::format("rm -rf '{0}'; {1} > '{2}/b.log' 2>&1; echo b=$?; {1} checkpoint.store=none > '{2}/c.log' 2>&1; "
                  "echo c=$?; for k in 1 2 3; do s=$(date +%s%N); {3} checkpoint.store=none checkpoint.resume=never "
                  "> \"{2}/d$k.log\" 2>&1; "
                  "echo d=$? ms=$(( ($(date +%s%N) - s) / 1000000 )); done",
                  out, cmd, dir, two));
  const std::string a = read_file(dir + "/a.log"), b = read_file(dir + "/b.log"), c = read_file(dir + "/c.log");
  INFO(a);
  INFO(b);
  INFO(c);
  INFO(second.output);
  CHECK_THAT(second.output, Catch::Contains("b=78") && Catch::Contains("c=78") && Catch::Contains("exit=0"));
  CHECK(occurrences(second.output, "d=78 ") == 3);
  for (int k = 1; k <= 3; ++k) {
    const std::string d = read_file(fmt::format("{}/d{}.log", dir, k));
    INFO(d);
    CHECK_THAT(d,
               Catch::Contains("rank 0 (local rank 0, pid ") && Catch::Contains("failed first: exited with code 78"));
    CHECK_THAT(d, Catch::Contains("is live (pid "));
  }
  for (size_t at = 0; (at = second.output.find("ms=", at)) != std::string::npos; at += 3)
    CHECK(std::stoi(second.output.substr(at + 3)) < 20000);  // seconds, not dist.timeout_s
  const std::string id = run_id_in(a, db);
  const std::string host = sh("hostname").output.substr(0, sh("hostname").output.find('\n'));
  for (const std::string& refused : {b, c}) {
    const std::vector<std::string> lines = lines_with(refused, "lora-train: error:");
    REQUIRE(lines.size() == 1);
    CHECK_THAT(lines[0], Catch::Contains(fmt::format("run {}/{} ", db, id)) && Catch::Contains("is live (pid ") &&
                             Catch::Contains(" on " + host) && Catch::Contains(out));
    CHECK(refused.find("from GridFS into") == std::string::npos);  // nothing restored
    CHECK(refused.find("not restarting") == std::string::npos);    // (no --max-restarts asked)
  }
  // A ran to its end alone: one record, completed, every step logged once, nothing resumed.
  lorarun::data::Client client(test_uri(), std::chrono::seconds(5));
  CHECK(client.count(db, "runs", json::object()) == 1);
  const json run = run_document(db, id);
  CHECK(run["status"] == "completed");
  CHECK(run["resumes"].empty());
  CHECK(run["lease"].is_null());
  CHECK(client.count(db, "metrics", {{"loss", {{"$exists", true}}}}) == 3 * kDocuments);

  // (b) A' killed -9 (its lease stays, its process is gone), its directory lost: the same command takes
  // the run over at once and finishes it, saying whose it was.
  fs::remove_all(out);
  const std::string db2 = db + "_stale";
  const std::string cmd2 =
      cmd.substr(0, cmd.find("track.database=")) + "track.database=" + db2 + cmd.substr(cmd.find(" checkpoint.store="));
  const Result killed = interrupt(cmd2, dir + "/k.log", "stored resume_state in GridFS",
                                  "pkill -9 -f 'lora-train.*track.database=" + db2 + "'");
  INFO(read_file(dir + "/k.log"));
  const std::string stale_id = run_id_in(read_file(dir + "/k.log"), db2);
  const json stale = run_document(db2, stale_id);
  REQUIRE(stale["lease"].is_object());
  const int64_t dead_pid = stale["lease"]["pid"].get<int64_t>();
  fs::remove_all(out);
  const Result taken = sh(cmd2);
  INFO(taken.output);
  CHECK(taken.status == 0);
  CHECK_THAT(taken.output, Catch::Contains("restored resume_state of run " + db2 + "/" + stale_id));
  const json after = run_document(db2, stale_id);
  CHECK(after["status"] == "completed");
  REQUIRE(after["resumes"].size() == 1);
  CHECK(after["resumes"][0]["took_over"]["pid"] == dead_pid);
  CHECK(client.count(db2, "runs", json::object()) == 1);
}

TEST_CASE(
    "SIGTERM during an evaluation stops between two evaluation batches under lorarun, within the grace period, and the "
    "evaluation is dropped and the rerun ends byte-identical to an uninterrupted run",
    "[e2e][resume]") {
  const std::string dir = temp_dir("hostile-eval-stop");
  write_data(dir + "/data.jsonl", 40);
  write_data(dir + "/eval.jsonl", 6000, 1000);  // an evaluation of some seconds (1.6 s for 3,000 here)
  const std::string train = "epochs: 1, lr: 1.0e-3";
  const std::string eval = fmt::format("eval: {{path: {}/eval.jsonl, every_n_steps: 5, batch_size: 1}}\n", dir);
  const std::string full = write_recipe(dir, "full", train, "", ", batch_size: 2", eval);
  const std::string cut = write_recipe(dir, "cut", train, "", ", batch_size: 2", eval);
  const Result a = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), full));
  INFO(a.output);
  REQUIRE(a.status == 0);

  // The evaluation after step 5 (3,000 documents a rank) has begun: SIGTERM to lorarun.
  const std::string cmd = fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), cut);
  const Stopped b = sigterm_after(cmd, dir + "/cut.log", "step 5/10", 0.3);
  const std::string log = read_file(dir + "/cut.log");
  INFO(log);
  CHECK(b.status == 75);
  CHECK(b.ms < 10000);  // well inside the 30 s grace period (an evaluation here takes several seconds)
  fmt::print("train: SIGTERM mid-evaluation: lorarun ended {} ms after the signal, exit 75\n", b.ms);
  CHECK_THAT(log, Catch::Contains("SIGTERM: stopping after this step or evaluation batch"));
  CHECK_THAT(log, Catch::Contains("evaluation at step 5 stopped on request"));
  CHECK(log.find("eval at epoch 0 step 5:") == std::string::npos);  // the partial evaluation is not reported
  const json state = json::parse(read_file(dir + "/cut/resume_state/state.json"));
  CHECK(state["pending_eval"] == true);
  CHECK(state["step"] == 5);

  const Result c = sh(cmd);
  INFO(c.output);
  REQUIRE(c.status == 0);
  CHECK_THAT(c.output, Catch::Contains("eval at epoch 0 step 5:"));  // done again, first
  CHECK(hashes(dir + "/cut/epoch_0") == hashes(dir + "/full/epoch_0"));
  // metrics.jsonl: the same evaluations, each once, with the same losses.
  const auto evals = [](const std::string& path) {
    std::map<int, double> out;
    std::ifstream in(path);
    for (std::string line; std::getline(in, line);) {
      const json row = json::parse(line);
      if (row.contains("eval_loss")) {
        CHECK(out.count(row["step"].get<int>()) == 0);
        out[row["step"].get<int>()] = row["eval_loss"].get<double>();
      }
    }
    return out;
  };
  const std::map<int, double> want = evals(dir + "/full/metrics.jsonl");
  CHECK(want.size() == 2);
  CHECK(evals(dir + "/cut/metrics.jsonl") == want);
}

TEST_CASE(
    "resuming after the data changed says so in one line: the same count of other documents (or a state from "
    "before the keyed global order) resumes at the same step, another count is refused naming the change",
    "[e2e][resume]") {
  const std::string dir = temp_dir("hostile-data-changed");
  write_data(dir + "/data.jsonl", 200);  // 100 steps an epoch: SIGTERM lands well before the end
  const std::string recipe = write_recipe(dir, "out", "epochs: 2, lr: 1.0e-3", "", ", batch_size: 2");
  const std::string cmd = fmt::format("{} --nproc-per-node 1 {}", bin("lorarun"), recipe);
  // `command` again after its state was saved: it resumes at that step with one warning naming `change`.
  const auto resumes_warning = [](const std::string& command, const std::string& change) {
    const Result r = sh(command);
    INFO(r.output);
    CHECK(r.status == 0);
    CHECK(lines_with(r.output, "the data changed since the resumable state").size() == 1);
    CHECK_THAT(r.output, Catch::Contains(change));
    CHECK_THAT(r.output, Catch::Contains("resuming at epoch 1 step"));
  };
  const Result cut = interrupt(cmd, dir + "/cut.log", "epoch 1/2 step 5/100", "kill -TERM $pid");
  REQUIRE_THAT(cut.output, Catch::Contains("exit=75"));
  const json state = json::parse(read_file(dir + "/out/resume_state/state.json"));
  CHECK(state["data"]["documents"] == 200);
  CHECK(state["data"]["digest"].is_string());

  // Two more documents: 101 steps per epoch, and the state's step in epoch 1 no longer fits; refused,
  // naming the change, and the state kept.
  write_data(dir + "/data.jsonl", 202);
  const Result more = sh(cmd);
  INFO(more.output);
  CHECK(more.status == 78);
  CHECK_THAT(more.output, Catch::Contains("was written when the selection held 200 documents, and now 202"));
  CHECK(fs::exists(dir + "/out/resume_state/state.json"));
  // As many documents, other ones: one warning line, and the run resumes at its step.
  write_data(dir + "/data.jsonl", 200, 7);
  resumes_warning(cmd, "but other ones (digest");

  // A state written before data.shuffle: global's order was a keyed permutation (its data has no
  // "order"): the same documents, but the epoch's order is another; one warning line, and it resumes.
  const std::string later = write_recipe(dir, "later", "epochs: 2, lr: 1.0e-3", "", ", batch_size: 2");
  const std::string later_cmd = fmt::format("{} --nproc-per-node 1 {}", bin("lorarun"), later);
  const Result cut2 = interrupt(later_cmd, dir + "/cut2.log", "epoch 1/2 step 5/100", "kill -TERM $pid");
  REQUIRE_THAT(cut2.output, Catch::Contains("exit=75"));
  json older = json::parse(read_file(dir + "/later/resume_state/state.json"));
  CHECK(older["data"]["order"] == "keyed");
  older["data"].erase("order");
  std::ofstream(dir + "/later/resume_state/state.json") << older.dump();
  json manifest = json::parse(read_file(dir + "/later/resume_state/manifest.json"));  // as that lorarun wrote it
  manifest["sha256"]["state.json"] = hashes(dir + "/later/resume_state").at("state.json");
  std::ofstream(dir + "/later/resume_state/manifest.json") << manifest.dump();
  resumes_warning(later_cmd, "data.shuffle: global's order is a keyed permutation now");
}

TEST_CASE(
    "an eval split without a token to score is refused at start-up, and an overlap with the training file is found "
    "however the documents were written (CRLF, spacing, key order)",
    "[e2e]") {
  const std::string dir = temp_dir("hostile-eval-split");
  write_data(dir + "/data.jsonl", 40);
  // Every evaluation document longer than data.max_length with overlong: skip.
  std::ofstream(dir + "/long.jsonl") << json{{"instruction", std::string(400, 'x')}, {"output", "1"}}.dump() << "\n"
                                     << json{{"instruction", std::string(500, 'y')}, {"output", "2"}}.dump() << "\n";
  const std::string eval = fmt::format("eval: {{path: {}/long.jsonl}}\n", dir);
  const std::string recipe =
      write_recipe(dir, "out", "epochs: 2, lr: 1.0e-3", "", ", batch_size: 2, max_length: 32, overlong: skip", eval);
  const Result r = sh(fmt::format("{} --nproc-per-node 1 {}", bin("lorarun"), recipe));
  INFO(r.output);
  CHECK(r.status == 78);
  CHECK_THAT(r.output, Catch::Contains("hold no token to score: 2 of 2 were rejected"));
  CHECK(r.output.find("step 1/") == std::string::npos);  // before the first step
  CHECK(r.seconds < 60);

  // Documents 3 and 5 of the training file, written again: CRLF, spaces, keys in another order.
  std::ifstream in(dir + "/data.jsonl");
  std::vector<json> docs;
  for (std::string line; std::getline(in, line);) docs.push_back(json::parse(line));
  std::ofstream(dir + "/resaved.jsonl", std::ios::binary)
      << fmt::format("{{ \"output\": {},  \"instruction\": {} }}\r\n", docs[3]["output"].dump(),
                     docs[3]["instruction"].dump())
      << json{{"output", docs[5]["output"]}, {"instruction", docs[5]["instruction"]}}.dump() << "\r\n";
  const std::string overlap = write_recipe(dir, "overlap", "epochs: 1, lr: 1.0e-3", "", ", batch_size: 2",
                                           fmt::format("eval: {{path: {}/resaved.jsonl}}\n", dir));
  const Result o = sh(fmt::format("{} --nproc-per-node 1 {}", bin("lorarun"), overlap));
  INFO(o.output);
  CHECK(o.status != 0);
  CHECK_THAT(o.output, Catch::Contains("which training reads too"));
}

TEST_CASE(
    "an adapter with a NaN is refused by lora-merge, lora-generate, lora-eval and lora.init_from, naming the tensor",
    "[e2e]") {
  const std::string dir = temp_dir("hostile-nan");
  write_data(dir + "/data.jsonl", 8);
  const std::string recipe = write_recipe(dir, "out", "epochs: 1, lr: 1.0e-3", "", ", batch_size: 4");
  REQUIRE(sh(fmt::format("{} --nproc-per-node 1 {}", bin("lorarun"), recipe)).status == 0);
  // One value of one tensor made NaN (a float32 at the start of its data).
  const std::string nan = dir + "/nan";
  fs::copy(dir + "/out/epoch_0", nan);
  const Result poke = sh(fmt::format(
      "'{}' -c \"import sys; from safetensors.torch import load_file, save_file; import math; "
      "t = load_file(sys.argv[1]); k = sorted(t)[0]; t[k].view(-1)[0] = math.nan; save_file(t, sys.argv[1], "
      "metadata={{'format': 'pt'}}); print(k)\" '{}/adapter_model.safetensors'",
      LORARUN_PYTHON, nan));
  INFO(poke.output);
  REQUIRE(poke.status == 0);
  const std::string key = poke.output.substr(0, poke.output.find('\n'));
  const std::string model = std::string(LORARUN_MODEL_FIXTURES) + "/llama";
  const std::vector<std::pair<std::string, std::string>> tools = {
      {"lora-merge", fmt::format("--model {} --adapter {} --out {}/merged", model, nan, dir)},
      {"lora-generate", fmt::format("--model {} --adapter {} --prompt 'Add 1' --max-new-tokens 3", model, nan)},
      {"lora-eval", fmt::format("--model {} --adapter {} --data {}/data.jsonl --text-field output", model, nan, dir)},
      {"lorarun",
       fmt::format("--nproc-per-node 1 {} lora.init_from={} checkpoint.output_dir={}/again", recipe, nan, dir)}};
  for (const auto& [tool, args] : tools) {
    const Result r = sh(fmt::format("{} {}", bin(tool), args));
    INFO(tool << ": " << r.output);
    CHECK(r.status != 0);
    CHECK_THAT(r.output, Catch::Contains("'" + key + "' holds non-finite values"));
    CHECK(r.output.find("train.lr") == std::string::npos);  // not blamed on the learning rate
  }
  CHECK(!fs::exists(dir + "/merged"));
}

TEST_CASE("the words of the refusals: unwritable paths, an empty eval file, numbers out of range", "[e2e]") {
  const std::string dir = temp_dir("hostile-words");
  write_data(dir + "/data.jsonl", 8);
  std::ofstream(dir + "/a-file") << "x";
  const std::string model = std::string(LORARUN_MODEL_FIXTURES) + "/llama";
  // --out and checkpoint.output_dir under a file: named, with the system's reason, no "internal error".
  const Result merge = sh(fmt::format("{} --model {} --adapter {}/peft_adapter --out {}/a-file/merged",
                                      bin("lora-merge"), model, model, dir));
  INFO(merge.output);
  CHECK(merge.status == 1);
  CHECK(count_lines(merge.output) == 1);
  CHECK_THAT(merge.output, Catch::Contains("lora-merge: error: cannot create " + dir + "/a-file/merged") &&
                               Catch::Contains("Not a directory"));
  const std::string recipe = write_recipe(dir, "out", "epochs: 1, lr: 1.0e-3", "", ", batch_size: 4");
  const Result train = sh(fmt::format("{} {} checkpoint.output_dir={}/a-file/out", bin("lora-train"), recipe, dir));
  INFO(train.output);
  CHECK(train.status == 78);
  CHECK_THAT(train.output,
             Catch::Contains("cannot create checkpoint.output_dir " + dir + "/a-file/out: Not a directory"));
  // An empty eval.path is named as eval.path.
  std::ofstream(dir + "/empty.jsonl") << "";
  const Result empty = sh(fmt::format("{} {} eval.path={}/empty.jsonl", bin("lora-train"), recipe, dir));
  INFO(empty.output);
  CHECK(empty.status == 78);
  CHECK_THAT(empty.output, Catch::Contains("eval.path " + dir + "/empty.jsonl holds no documents"));
  // A whole number too large for its key says so; one written as 1e3 is a whole number.
  const Result big = sh(fmt::format("{} --dry-run {} train.epochs=1e12", bin("lora-train"), recipe));
  INFO(big.output);
  CHECK(big.status == 78);
  CHECK_THAT(big.output,
             Catch::Contains("train.epochs must be a whole number from -2147483648 to 2147483647, got '1e12'"));
  CHECK(sh(fmt::format("{} --dry-run {} data.limit=1e3", bin("lora-train"), recipe)).status == 0);
  // A run without a record still has an id, in run.json, and no message has a gap where the id would be.
  const Result done = sh(fmt::format("{} --nproc-per-node 1 {}", bin("lorarun"), recipe));
  INFO(done.output);
  REQUIRE(done.status == 0);
  const json marker = json::parse(read_file(dir + "/out/run.json"));
  CHECK_THAT(marker["run_id"].get<std::string>(), Catch::Matches("local-[0-9a-f]{24}"));
  CHECK(done.output.find("  ") == std::string::npos);
}

TEST_CASE(
    "lorarun --max-restarts does not restart a rank whose error a restart cannot change: a bad recipe, a missing, "
    "truncated or bad model, a data.path that is missing, a directory or a FIFO, pissa with r above a layer",
    "[e2e]") {
  const std::string dir = temp_dir("hostile-no-restart");
  write_data(dir + "/data.jsonl", 8);
  const std::string recipe = write_recipe(dir, "out", "epochs: 1, lr: 1.0e-3", "", ", batch_size: 4");
  const Result r = sh(fmt::format("{} --nproc-per-node 2 --max-restarts 2 {} lora.r=0", bin("lorarun"), recipe));
  INFO(r.output);
  CHECK(r.status == 78);
  CHECK(occurrences(r.output, "started 2 rank(s)") == 1);
  CHECK_THAT(r.output, Catch::Contains("failed with an error a restart cannot change (exit 78): not restarting"));
  CHECK(r.seconds < 20);
  // The model's safetensors cut in half; the training data a FIFO nothing writes to (which open()
  // would wait on for ever), a directory, or missing.
  fs::create_directories(dir + "/cut");
  for (const auto& e : fs::directory_iterator(std::string(LORARUN_MODEL_FIXTURES) + "/llama"))
    fs::copy(e.path(), dir + "/cut/" + e.path().filename().string());
  fs::resize_file(dir + "/cut/model.safetensors", fs::file_size(dir + "/cut/model.safetensors") / 2);
  REQUIRE(mkfifo((dir + "/fifo.jsonl").c_str(), 0600) == 0);
  fs::create_directories(dir + "/a-directory");
  for (const auto& [overrides, says] : {
           std::pair{"model.path=" + dir + "/nowhere", std::string("nowhere")},
           std::pair{"model.path=" + dir + "/cut", dir + "/cut/model.safetensors"},
           std::pair{"data.path=" + dir + "/fifo.jsonl",
                     "data.path " + dir + "/fifo.jsonl cannot be read: it is a FIFO"},
           std::pair{"data.path=" + dir + "/a-directory",
                     "data.path " + dir + "/a-directory cannot be read: it is a directory"},
           std::pair{"data.path=" + dir + "/missing.jsonl",
                     "data.path " + dir + "/missing.jsonl cannot be read: No such file or directory"},
           std::pair{std::string("lora.init=pissa lora.r=300"), std::string("lora.init pissa takes r directions")},
       }) {
    INFO(overrides);
    const Result failed =
        sh(fmt::format("timeout 120 {} --nproc-per-node 1 --max-restarts 2 {} {}", bin("lorarun"), recipe, overrides));
    INFO(failed.output);
    CHECK(failed.status == 78);
    CHECK(occurrences(failed.output, "started 1 rank(s)") == 1);
    CHECK_THAT(failed.output, Catch::Contains(says));
    CHECK(failed.seconds < 30);
  }
}

TEST_CASE(
    "symbolic links planted in checkpoint.output_dir (a log, metrics.jsonl, logs/, an epoch directory kept for a "
    "restore) are refused in one line before anything is written or restored, and nothing is written through them",
    "[e2e][db]") {
  const std::string dir = temp_dir("hostile-links");
  write_data(dir + "/data.jsonl", 8);
  const std::string recipe = write_recipe(dir, "out", "epochs: 1, lr: 1.0e-3", "", ", batch_size: 4");
  fs::create_directories(dir + "/elsewhere/epoch");
  std::ofstream(dir + "/elsewhere/victim.txt") << "precious\n";
  const std::string out = dir + "/out";
  for (const auto& [planted, target] :
       {std::pair{"logs/rank_0.log", "elsewhere/victim.txt"}, std::pair{"metrics.jsonl", "elsewhere/victim.txt"},
        std::pair{"logs", "elsewhere/epoch"}, std::pair{"epoch_0", "elsewhere/epoch"}}) {
    INFO(planted);
    fs::remove_all(out);
    fs::create_directories(fs::path(out + "/" + planted).parent_path());
    fs::create_symlink(dir + "/" + target, out + "/" + planted);
    const auto before = tree(dir + "/elsewhere");
    const Result r =
        sh(fmt::format("LORARUN_MONGODB_URI='{}' {} --nproc-per-node 2 {} track.mongodb=true "
                       "track.database=hostile_links checkpoint.store=mongodb",
                       test_uri(), bin("lorarun"), recipe));
    INFO(r.output);
    CHECK(r.status == 78);
    CHECK_THAT(r.output, Catch::Contains(fmt::format("checkpoint.output_dir {} holds a symbolic link, {}/{} (to {}/{})",
                                                     out, out, planted, dir, target)));
    CHECK(read_file(dir + "/elsewhere/victim.txt") == "precious\n");
    CHECK(tree(dir + "/elsewhere") == before);
    CHECK_FALSE(fs::exists(out + "/recipe.yaml"));
  }
}
