// checkpoint.store: mongodb: the kept adapters, best/ and the kept resumable state in GridFS, read
// back by pymongo's own GridFSBucket; lora-runs list, show, pull and rm; a server gone at the upload
// or in the middle of one; a lost output directory restored from the database and resumed.
#include <fmt/format.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <set>
#include <string>
#include <thread>

#include "data/mongo.hpp"
#include "io/sha256.hpp"
#include "support/runs.hpp"
#include "support/servers.hpp"
#include "track/artifacts.hpp"
#include "util/error.hpp"

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

// A FerretDB of the test's own (scripts/ferretdb in `state`), stopped when it goes out of scope.
// With `password`: one that demands SCRAM credentials of user alice, in the URI.
struct OwnServer {
  std::string script = std::string(LORARUN_SOURCE_DIR) + "/scripts/ferretdb";
  std::string state, uri, port, auth;
  explicit OwnServer(const std::string& state_dir, const std::string& password = "") : state(state_dir) {
    if (!password.empty()) auth = fmt::format("FERRETDB_AUTH_USER=alice FERRETDB_AUTH_PASSWORD='{}' ", password);
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
    return sh(fmt::format("rm -f '{}/ferretdb.pid'; {}'{}' start '{}' {}", state, auth, script, state, port)).status ==
           0;
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
  // …and lora-generate's greedy ids and lora-eval's loss on best/ are the local best/'s.
  const auto tool = [&](const std::string& name, const std::string& adapter, const std::string& args) {
    const Result r = sh(fmt::format("{} {} --adapter {} {}", runs_env, bin(name), adapter, args));
    INFO(r.output);
    CHECK(r.status == 0);
    return r.output.substr(r.output.rfind('\n', r.output.size() - 2) + 1);  // the last line
  };
  const std::string gen = fmt::format("--model {} --prompt 'Add 2 and 7' --max-new-tokens 8 --ids", model);
  const std::string stored_best = fmt::format("mongodb-run:{}/{}/best", db, id);
  CHECK(tool("lora-generate", stored_best, gen) == tool("lora-generate", out + "/best", gen));
  CHECK(tool("lora-eval", stored_best, "--recipe " + recipe + " --json") ==
        tool("lora-eval", out + "/best", "--recipe " + recipe + " --json"));

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
  // (The first save after the kill is the state of step 1: each state save is stored too.)
  CHECK_THAT(log, Catch::Contains("error: lora-train: error: writing ") && Catch::Contains("resume_state failed: ") &&
                      Catch::Contains("resume_state is kept: run the same command to resume"));
  CHECK(fs::exists(dir + "/run/resume_state/manifest.json"));

  // The server back (same port): the same command resumes and stores the adapter.
  REQUIRE(server.restart());
  const Result rerun = sh(cmd);
  INFO(rerun.output);
  CHECK(rerun.status == 0);
  CHECK_THAT(rerun.output, Catch::Contains("resuming at epoch") && Catch::Contains("stored epoch_1 in GridFS"));
}

TEST_CASE(
    "store: an output directory lost mid-run is restored from the database, and the run resumes to the adapters "
    "of an uninterrupted run",
    "[e2e][db][resume]") {
  const std::string dir = temp_dir("store-restore");
  write_data(dir + "/data.jsonl", 48);
  const std::string db = fmt::format("restore_{}", getpid());
  const std::string uri = test_uri();
  const std::string recipe =
      write_recipe(dir, "run", "epochs: 3, lr: 1.0e-3", "", ", batch_size: 2", "eval: {fraction: 0.25}\n");
  const std::string cmd = fmt::format(
      "LORARUN_MONGODB_URI='{}' {} --nproc-per-node 2 {} track.mongodb=true track.database={} checkpoint.store=mongodb "
      "checkpoint.keep_best=true checkpoint.state_every_n_steps=2",
      uri, bin("lorarun"), recipe, db);
  // The same run, uninterrupted, in another directory.
  const Result whole = sh(cmd + fmt::format(" checkpoint.output_dir={}/whole", dir));
  INFO(whole.output);
  REQUIRE(whole.status == 0);

  // Rank 1 killed in epoch 1 (after a state save there was stored), then the output directory lost.
  const Result cut = interrupt(cmd, dir + "/cut.log", "epoch 1/3 step 6/",
                               "kill -9 $(sed -n 's/.*(pids [0-9]* \\([0-9]*\\)).*/\\1/p' \"$log\")");
  const std::string log = read_file(dir + "/cut.log");
  INFO(log);
  REQUIRE_THAT(cut.output, Catch::Contains("exit=1"));
  CHECK_THAT(log, Catch::Contains("stored resume_state in GridFS"));
  const std::string id = run_id_in(log, db);
  fs::remove_all(dir + "/run");

  // The same command: the state, epoch_0 and best/ come back from GridFS, the run continues where
  // the stored state stands and ends with the uninterrupted run's adapters, byte for byte.
  const Result again = sh(cmd);
  INFO(again.output);
  REQUIRE(again.status == 0);
  CHECK_THAT(again.output, Catch::Contains(fmt::format("restored best, epoch_0, resume_state of run {}/{}", db, id)) &&
                               Catch::Contains("resuming at epoch 1 step"));
  CHECK(run_id_in(again.output, db) == id);
  for (const char* epoch : {"epoch_0", "epoch_1", "epoch_2"}) {
    INFO(epoch);
    CHECK(hashes(dir + "/run/" + epoch) == hashes(dir + "/whole/" + epoch));
  }
  CHECK(lorarun::io::sha256_file(dir + "/run/best/adapter_model.safetensors") ==
        lorarun::io::sha256_file(dir + "/whole/best/adapter_model.safetensors"));

  // One record, resumed once and completed; its resumable state is gone from GridFS as from disk.
  lorarun::data::Client c(uri, std::chrono::milliseconds(5000));
  const auto runs = c.find(db, "runs", {{"_id", {{"$oid", id}}}});
  REQUIRE(runs.size() == 1);
  CHECK(runs[0]["status"] == "completed");
  CHECK(runs[0]["resumes"].size() == 1);
  CHECK(c.count(db, "lorarun.files", {{"metadata.run_id", id}, {"metadata.artifact", "resume_state"}}) == 0);
  CHECK(c.count(db, "lorarun.pending", json::object()) == 0);
  CHECK(!fs::exists(dir + "/run/resume_state"));

  // A completed run is not restored: with the directory lost again, the command starts a new run.
  fs::remove_all(dir + "/run");
  const Result fresh = sh(cmd + " train.epochs=1");
  INFO(fresh.output);
  CHECK(fresh.status == 0);
  CHECK(fresh.output.find("restored") == std::string::npos);
  CHECK(run_id_in(fresh.output, db) != id);
}

TEST_CASE(
    "store: a server lost in the middle of an upload fails it in one line, and the next upload and rm leave no chunk "
    "of it",
    "[db]") {
  const std::string dir = temp_dir("store-midway");
  const OwnServer server(dir + "/ferretdb", "mid-w4y-pw");
  const std::string db = "midway";
  const std::string run = "0123456789abcdef01234567";
  // 64 MiB that do not compress: 64 chunks, several seconds on the wire.
  const fs::path big = fs::path(dir) / "epoch_0/adapter_model.safetensors";
  fs::create_directories(big.parent_path());
  {
    std::mt19937_64 gen(7);
    std::vector<uint64_t> words((64 << 20) / 8);
    for (uint64_t& w : words) w = gen();
    std::ofstream(big, std::ios::binary).write(reinterpret_cast<const char*>(words.data()), words.size() * 8);
  }
  const auto chunks = [&] {
    lorarun::data::Client c(server.uri, std::chrono::milliseconds(5000));
    return c.count(db, "lorarun.chunks", json::object());
  };
  // An upload with the server killed (-9) once some chunks are in: one line, without the password.
  const auto cut_upload = [&] {
    const int64_t before = chunks();
    std::thread killer([&] {  // 1 s into the file's transfer (64 MiB take several seconds on FerretDB)
      lorarun::data::Client c(server.uri, std::chrono::milliseconds(5000));
      const auto started = [&] {
        for (const json& p : c.find(db, "lorarun.pending", json::object()))
          if (!p["files"].empty()) return true;
        return false;
      };
      for (int i = 0; i < 3000 && !started(); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      std::this_thread::sleep_for(std::chrono::seconds(1));
      sh(fmt::format("kill -9 $(cat '{}/ferretdb.pid')", server.state));
    });
    std::string error;
    try {
      lorarun::track::ArtifactStore store(server.uri, db, std::chrono::seconds(3));
      store.upload(run, "epoch_0", big.parent_path().string());
    } catch (const lorarun::Error& e) {
      error = e.what();
    }
    killer.join();
    INFO(error);
    CHECK_THAT(error, Catch::Contains("uploading adapter_model.safetensors of epoch_0 to GridFS midway.lorarun at"));
    CHECK(error.find('\n') == std::string::npos);
    CHECK(error.find("mid-w4y-pw") == std::string::npos);
    REQUIRE(server.restart());
    CHECK(chunks() > before);  // what the lost upload left
  };

  cut_upload();
  lorarun::track::ArtifactStore store(server.uri, db, std::chrono::seconds(5));
  CHECK(store.list(run).empty());  // an unfinished file is never shown
  // The next upload of the run clears it: only the new file's 64 chunks remain, read back whole.
  const auto files = store.upload(run, "epoch_0", big.parent_path().string());
  REQUIRE(files.size() == 1);
  lorarun::data::Client c(server.uri, std::chrono::milliseconds(5000));
  CHECK(c.count(db, "lorarun.chunks", json::object()) == 64);
  CHECK(c.count(db, "lorarun.pending", json::object()) == 0);
  store.download(run, "epoch_0", files, dir + "/pulled");
  CHECK(lorarun::io::sha256_file(dir + "/pulled/adapter_model.safetensors") == lorarun::io::sha256_file(big.string()));

  // Cut again, then rm (lora-runs rm): no files document, chunk or unfinished upload left.
  cut_upload();
  lorarun::track::ArtifactStore after(server.uri, db, std::chrono::seconds(5));
  CHECK(after.list(run).size() == 1);  // the complete copy stands
  CHECK(after.remove(run) == 1);
  CHECK(c.count(db, "lorarun.files", json::object()) == 0);
  CHECK(c.count(db, "lorarun.chunks", json::object()) == 0);
  CHECK(c.count(db, "lorarun.pending", json::object()) == 0);
}
