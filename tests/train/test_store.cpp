// checkpoint.store: mongodb: the kept adapters, best/ and the kept resumable state in GridFS, read
// back by pymongo's own GridFSBucket; lora-runs list, show, pull and rm; a server gone at the upload.
#include <fmt/format.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string>

#include "data/mongo.hpp"
#include "io/sha256.hpp"
#include "support/runs.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;
namespace fs = std::filesystem;
using nlohmann::json;

namespace {

// pymongo's view of run `id`'s GridFS files (tests/train/gridfs_check.py).
json gridfs_view(const std::string& uri, const std::string& db, const std::string& id, const std::string& out) {
  const Result r = sh(fmt::format("'{}' '{}/tests/train/gridfs_check.py' '{}' {} {} {}", LORARUN_PYTHON,
                                  LORARUN_SOURCE_DIR, uri, db, id, out),
                      Capture::Both);
  INFO(r.output);
  REQUIRE(r.status == 0);
  return json::parse(r.output.substr(r.output.rfind("\n{") == std::string::npos ? 0 : r.output.rfind("\n{") + 1));
}

// The regular files under `dir` as {relative name: sha256}.
std::map<std::string, std::string> hashes(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file())
      out[e.path().lexically_relative(dir).generic_string()] = lorarun::io::sha256_file(e.path().string());
  return out;
}

// The run id lora-train printed ("run recorded as DB/ID").
std::string run_id_in(const std::string& output, const std::string& db) {
  const std::string marker = "run recorded as " + db + "/";
  const size_t at = output.find(marker);
  REQUIRE(at != std::string::npos);
  return output.substr(at + marker.size(), 24);
}

// A FerretDB of the test's own (scripts/ferretdb in `state`), stopped when it goes out of scope.
// With `password`: one that demands SCRAM credentials of user alice, in the URI.
struct OwnServer {
  std::string script = std::string(LORARUN_SOURCE_DIR) + "/scripts/ferretdb";
  std::string state, uri, port;
  explicit OwnServer(const std::string& state_dir, const std::string& password = "") : state(state_dir) {
    const std::string auth =
        password.empty() ? "" : fmt::format("FERRETDB_AUTH_USER=alice FERRETDB_AUTH_PASSWORD='{}' ", password);
    const Result r = sh(fmt::format("{}'{}' start '{}' 2>&1 | tail -n1", auth, script, state));
    REQUIRE(r.status == 0);
    const std::string plain = r.output.substr(0, r.output.find('\n'));
    REQUIRE(plain.rfind("mongodb://127.0.0.1:", 0) == 0);
    port = plain.substr(plain.rfind(':') + 1, plain.rfind('/') - plain.rfind(':') - 1);
    uri = password.empty() ? plain : fmt::format("mongodb://alice:{}@127.0.0.1:{}/?authSource=admin", password, port);
  }
  void stop() const { sh(fmt::format("'{}' stop '{}' >/dev/null 2>&1", script, state)); }
  // Starts it again on the same port (the same URI).
  bool restart() const {
    return sh(fmt::format("rm -f '{}/ferretdb.pid'; '{}' start '{}' {}", state, script, state, port)).status == 0;
  }
  ~OwnServer() { stop(); }
  OwnServer(const OwnServer&) = delete;
  OwnServer& operator=(const OwnServer&) = delete;
};

}  // namespace

TEST_CASE(
    "store: kept epochs, best/ and the resumable state in GridFS as pymongo reads them, and lora-runs list, show, "
    "pull, rm",
    "[e2e][db][reference]") {
  const std::string dir = temp_dir("store");
  write_data(dir + "/data.jsonl", 40);
  const std::string db = fmt::format("store_{}", getpid());
  const std::string recipe =
      write_recipe(dir, "run", "epochs: 3, lr: 1.0e-3", "", ", batch_size: 4", "eval: {fraction: 0.25}\n");
  // A server that wants a password, in the URI: never shown.
  const OwnServer server(dir + "/ferretdb", "s3cr3t-pw");
  const std::string uri = server.uri;
  const std::string env = fmt::format("LORARUN_MONGODB_URI='{}'", uri);
  const Result run =
      sh(fmt::format("{} {} --nproc-per-node 2 {} track.mongodb=true track.database={} checkpoint.store=mongodb "
                     "checkpoint.epochs_to_save=[0,2] checkpoint.keep_best=true checkpoint.keep_resume_state=true",
                     env, bin("lorarun"), recipe, db));
  INFO(run.output);
  REQUIRE(run.status == 0);
  const std::string id = run_id_in(run.output, db);
  CHECK_THAT(run.output, Catch::Contains("stored epoch_0 in GridFS") && Catch::Contains("stored epoch_2 in GridFS"));
  const std::string out = dir + "/run";

  // (a) every kept file, read by pymongo's GridFSBucket, is the local file byte for byte, with its sha256.
  const json view = gridfs_view(uri, db, id, out);
  std::map<std::string, std::map<std::string, std::string>> stored;
  for (const json& f : view["files"]) {
    INFO(f.dump());
    CHECK(f["identical"] == true);
    CHECK(f["metadata"]["sha256"] == f["sha256"]);
    CHECK(f["metadata"]["bytes"] == f["bytes"]);
    CHECK(f["metadata"]["run_id"] == id);
    stored[f["artifact"]][f["name"]] = f["sha256"];
  }
  CHECK(stored["epoch_0"] == hashes(out + "/epoch_0"));
  CHECK(stored["epoch_2"] == hashes(out + "/epoch_2"));
  CHECK(stored["best"] == hashes(out + "/best"));
  CHECK(stored["resume_state"] == hashes(out + "/resume_state"));
  CHECK(stored.count("epoch_1") == 0);
  CHECK(!fs::exists(out + "/epoch_1"));
  CHECK(stored.size() == 4);
  // best/ was rewritten at each improvement: only its last copy is left.
  CHECK(view["files_docs"] == view["files"].size());

  // The run record lists them.
  lorarun::data::Client c(uri, std::chrono::milliseconds(5000));
  const auto runs = c.find(db, "runs", {{"_id", {{"$oid", id}}}});
  REQUIRE(runs.size() == 1);
  std::set<std::string> listed;
  for (const json& a : runs[0]["artifacts"]) listed.insert(a["artifact"].get<std::string>());
  CHECK(listed == std::set<std::string>{"best", "epoch_0", "epoch_2", "resume_state"});

  // (b) lora-runs pull ID/epoch_2 gives epoch_2 byte for byte; the default is the last kept epoch.
  const std::string& runs_env = env;
  const Result pulled = sh(fmt::format("{} {} pull {}/{}/epoch_2 {}/pulled", runs_env, bin("lora-runs"), db, id, dir));
  INFO(pulled.output);
  REQUIRE(pulled.status == 0);
  CHECK(hashes(dir + "/pulled") == hashes(out + "/epoch_2"));
  const Result last = sh(fmt::format("{} pull --db {} {} {}/last --uri '{}'", bin("lora-runs"), db, id, dir, uri));
  INFO(last.output);
  CHECK(last.status == 0);
  CHECK(hashes(dir + "/last") == hashes(out + "/epoch_2"));
  const Result best = sh(fmt::format("{} {} pull {}/{}/best {}/best", runs_env, bin("lora-runs"), db, id, dir));
  CHECK(best.status == 0);
  CHECK(hashes(dir + "/best") == hashes(out + "/best"));

  // list shows the run; show prints the recipe, metrics and artifacts without the password.
  const Result listing = sh(fmt::format("{} {} list --db {} --status completed", runs_env, bin("lora-runs"), db));
  INFO(listing.output);
  CHECK(listing.status == 0);
  CHECK_THAT(listing.output, Catch::Contains(id) && Catch::Contains("completed") && Catch::Contains("0,2"));
  const Result shown = sh(fmt::format("{} {} show {}/{}", runs_env, bin("lora-runs"), db, id));
  INFO(shown.output);
  CHECK(shown.status == 0);
  CHECK_THAT(shown.output, Catch::Contains("\"epoch_2\"") && Catch::Contains("\"final_metrics\""));
  CHECK(shown.output.find("s3cr3t-pw") == std::string::npos);
  CHECK_THAT(shown.output, Catch::Contains("alice:****@"));
  CHECK(run.output.find("s3cr3t-pw") == std::string::npos);
  CHECK(pulled.output.find("s3cr3t-pw") == std::string::npos);

  // A missing artifact is one line naming it.
  const Result missing = sh(fmt::format("{} {} pull {}/{}/epoch_1 {}/none", runs_env, bin("lora-runs"), db, id, dir));
  CHECK(missing.status != 0);
  CHECK_THAT(missing.output, Catch::Contains("no artifact 'epoch_1'"));

  // --adapter mongodb-run:DB/ID/epoch_2 merges as the local epoch_2 does.
  const std::string model = std::string(LORARUN_MODEL_FIXTURES) + "/llama";
  const Result merged_db = sh(fmt::format("{} {} --model {} --adapter mongodb-run:{}/{}/epoch_2 --out {}/merged_db",
                                          runs_env, bin("lora-merge"), model, db, id, dir));
  INFO(merged_db.output);
  CHECK(merged_db.status == 0);
  const Result merged =
      sh(fmt::format("{} --model {} --adapter {}/epoch_2 --out {}/merged", bin("lora-merge"), model, out, dir));
  CHECK(merged.status == 0);
  CHECK(hashes(dir + "/merged_db") == hashes(dir + "/merged"));
  CHECK(merged_db.output.find("s3cr3t-pw") == std::string::npos);

  // (c) rm: no files or chunks document of the run, no record, no metrics left.
  const Result removed = sh(fmt::format("{} {} rm {}/{}", runs_env, bin("lora-runs"), db, id));
  INFO(removed.output);
  CHECK(removed.status == 0);
  const json after = gridfs_view(uri, db, id, out);
  CHECK(after["files"].empty());
  CHECK(after["files_docs"] == 0);
  CHECK(after["all_chunks"] == 0);
  CHECK(c.count(db, "lorarun.files", json::object()) == 0);
  CHECK(c.count(db, "lorarun.chunks", json::object()) == 0);
  CHECK(c.find(db, "runs", json::object()).empty());
  CHECK(c.count(db, "metrics", {{"run_id", {{"$oid", id}}}}) == 0);
}

TEST_CASE(
    "store: the server gone at the upload fails the run in one line, keeps the local files, and a rerun "
    "succeeds",
    "[e2e][db][resume]") {
  const std::string dir = temp_dir("store-gone");
  write_data(dir + "/data.jsonl", 40);
  // A FerretDB of this test's own, killed (no goodbye to its clients) while the run trains.
  const OwnServer server(dir + "/ferretdb");
  const std::string& uri = server.uri;
  const std::string recipe = write_recipe(dir, "run", "epochs: 2, lr: 1.0e-3", "", ", batch_size: 4, timeout_s: 2", "");
  const std::string cmd = fmt::format(
      "LORARUN_MONGODB_URI='{}' {} --nproc-per-node 2 {} track.mongodb=true track.database=gone "
      "checkpoint.store=mongodb checkpoint.state_every_n_steps=1",
      uri, bin("lorarun"), recipe);
  const Result failed = interrupt(cmd, dir + "/first.log", "run recorded as",
                                  fmt::format("kill -9 $(cat '{}/ferretdb.pid')", server.state));
  const std::string log = read_file(dir + "/first.log");
  INFO(log);
  CHECK(failed.output.find("exit=0") == std::string::npos);
  CHECK(failed.seconds < 60);
  // The summary names rank 0's own error, on one line.
  CHECK_THAT(log, Catch::Contains("rank 0 (local rank 0") && Catch::Contains("failed first"));
  CHECK_THAT(log, Catch::Contains("error: lora-train: error: writing epoch_0 failed: cannot reach MongoDB at ") &&
                      Catch::Contains("checkpoint.store: mongodb"));
  CHECK(fs::exists(dir + "/run/epoch_0/adapter_model.safetensors"));
  CHECK(fs::exists(dir + "/run/resume_state/manifest.json"));

  // The server back (same port): the same command resumes and stores the adapter.
  REQUIRE(server.restart());
  const Result rerun = sh(cmd);
  INFO(rerun.output);
  CHECK(rerun.status == 0);
  CHECK_THAT(rerun.output, Catch::Contains("resuming at epoch") && Catch::Contains("stored epoch_1 in GridFS"));
}
