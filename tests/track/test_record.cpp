// Run records against the FerretDB that scripts/test starts: the documents RunRecorder writes,
// resume, secrets, and reading a run's recipe back for --from-run.
#include <fmt/format.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "data/mongo.hpp"
#include "io/sha256.hpp"
#include "recipe/recipe.hpp"
#include "support/process.hpp"
#include "support/servers.hpp"
#include "track/from_run.hpp"
#include "track/record.hpp"
#include "util/error.hpp"

using namespace lorarun;
using lorarun::test::test_uri;
using nlohmann::json;
using std::chrono::milliseconds;

namespace {

constexpr milliseconds kTimeout{5000};

// The test server's URI with a password (FerretDB accepts any with PLAIN and no auth set up).
std::string uri_with_password(const std::string& password) {
  std::string uri = test_uri();
  uri.insert(uri.find("://") + 3, "alice:" + password + "@");
  return uri + "?authMechanism=PLAIN";
}

// A database of its own for each test, so tests never see each other's runs.
std::string fresh_db() {
  static int n = 0;
  return fmt::format("track_test_{}_{}", getpid(), n++);
}

recipe::Recipe sample_recipe(const std::string& uri, const std::string& db) {
  return recipe::recipe_from_yaml(YAML::Load(fmt::format(R"(
model: {{path: models/tiny}}
data: {{uri: "{}", database: {}, collection: examples, prompt_template: "Q: {{instruction}}\nA: ",
        filter: {{lang: en, "meta.len": {{"$gt": 3}}}}}}
train: {{epochs: 2, lr: 0.0005}}
checkpoint: {{output_dir: runs/t}}
)",
                                                         uri, db)),
                                  {}, "sample.yaml");
}

json the_run(const std::string& db, const std::string& id) {
  data::Client c(test_uri(), kTimeout);
  const auto runs = c.find(db, "runs", {{"_id", {{"$oid", id}}}});
  REQUIRE(runs.size() == 1);
  return runs[0];
}

}  // namespace

TEST_CASE("begin, metrics, checkpoint and finish write the run and metrics documents", "[db]") {
  const std::string db = fresh_db();
  const recipe::Recipe r = sample_recipe(test_uri(), db);
  track::RunRecorder rec(test_uri(), db, kTimeout);
  const json info = {{"torch_version", "2.11.0"},
                     {"world_size", 2},
                     {"documents", 1000},
                     {"data", {{"collection", "examples"}, {"filter", {{"$gt", 3}}}}}};
  const std::string id = rec.begin(recipe::to_json(r), info);
  CHECK(id.size() == 24);
  CHECK(rec.id() == id);
  CHECK(rec.ref() == db + "/" + id);

  json run = the_run(db, id);
  CHECK(run["status"] == "running");
  CHECK(run["started_at"].contains("$date"));
  CHECK(run["ended_at"].is_null());
  CHECK(run["lorarun_version"] == LORARUN_VERSION);
  CHECK(!run["hostname"].get<std::string>().empty());
  CHECK(run["torch_version"] == "2.11.0");
  CHECK(run["world_size"] == 2);
  CHECK(run["documents"] == 1000);
  CHECK(run["data"]["filter"] == R"({"$gt":3})");  // a key MongoDB refuses: stored as text
  CHECK(run["recipe"]["train"]["lr"] == 0.0005);
  CHECK(run["recipe"]["data"]["filter"].is_string());

  rec.metrics({{"step", 1}, {"loss", 2.5}, {"lr", 1e-4}});
  rec.metrics({{"step", 2}, {"loss", 2.25}, {"lr", 2e-4}});
  data::Client c(test_uri(), kTimeout);
  const auto rows = c.find(db, "metrics", {{"run_id", {{"$oid", id}}}});
  REQUIRE(rows.size() == 2);
  CHECK(rows[0]["step"] == 1);
  CHECK(rows[1]["loss"] == 2.25);
  CHECK(rows[1]["time"].contains("$date"));

  const std::string dir = test::temp_dir("track-ckpt") + "/epoch_0";
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/adapter_config.json") << R"({"r": 8})";
  std::ofstream(dir + "/adapter_model.safetensors") << std::string(1000, 'w');
  rec.checkpoint(0, dir);
  rec.finish("completed", {{"loss", 2.25}, {"step", 2}});

  run = the_run(db, id);
  CHECK(run["status"] == "completed");
  CHECK(run["ended_at"].contains("$date"));
  CHECK(run["final_metrics"]["loss"] == 2.25);
  CHECK(run["error"].is_null());
  CHECK(!run.contains("metrics_dropped"));
  REQUIRE(run["checkpoints"].size() == 1);
  const json& ck = run["checkpoints"][0];
  CHECK(ck["epoch"] == 0);
  CHECK(ck["path"] == std::filesystem::absolute(dir).string());
  REQUIRE(ck["files"].size() == 2);
  CHECK(ck["files"][0] ==
        json{{"name", "adapter_config.json"}, {"bytes", 8}, {"sha256", io::sha256_hex(R"({"r": 8})")}});
  CHECK(ck["files"][1]["name"] == "adapter_model.safetensors");
  CHECK(ck["files"][1]["bytes"] == 1000);
  CHECK(ck["files"][1]["sha256"] == io::sha256_hex(std::string(1000, 'w')));
}

TEST_CASE("a failed run records its error, and a run never finished is marked failed", "[db]") {
  const std::string db = fresh_db();
  std::string id;
  {
    track::RunRecorder rec(test_uri(), db, kTimeout);
    id = rec.begin(recipe::to_json(sample_recipe(test_uri(), db)), json::object());
    rec.finish("failed", nullptr, "rank 1 exited with code 1");
  }
  CHECK(the_run(db, id)["error"] == "rank 1 exited with code 1");
  {
    track::RunRecorder rec(test_uri(), db, kTimeout);
    id = rec.begin(recipe::to_json(sample_recipe(test_uri(), db)), json::object());
  }  // destroyed without finish(), as when an exception unwinds the trainer
  const json run = the_run(db, id);
  CHECK(run["status"] == "failed");
  CHECK(run["ended_at"].contains("$date"));
  track::RunRecorder rec(test_uri(), db, kTimeout);
  rec.begin(json::object(), json::object());
  CHECK_THROWS_WITH(rec.finish("done", nullptr),
                    Catch::Contains("status 'done' is not completed, failed or interrupted"));
}

TEST_CASE("a metrics write that fails warns, is counted and does not stop the run", "[db]") {
  const std::string db = fresh_db();
  track::RunRecorder rec(test_uri(), db, kTimeout);
  const std::string id = rec.begin(json::object(), json::object());
  CHECK_NOTHROW(rec.metrics({{"step", 1}, {"blob", std::string(17 << 20, 'x')}}));  // over MongoDB's 16 MiB
  CHECK_NOTHROW(rec.metrics({{"step", 2}}));  // within the pause after a failure: counted, not sent
  rec.finish("completed", {{"step", 2}});
  const json run = the_run(db, id);
  CHECK(run["status"] == "completed");
  CHECK(run["metrics_dropped"] == 2);
}

TEST_CASE("resuming a run appends a resume entry and keeps one run document", "[db]") {
  const std::string db = fresh_db();
  const json recipe_json = recipe::to_json(sample_recipe(test_uri(), db));
  std::string id;
  {
    track::RunRecorder rec(test_uri(), db, kTimeout);
    id = rec.begin(recipe_json, {{"world_size", 2}});
    rec.finish("interrupted", {{"step", 7}});
  }
  track::RunRecorder rec(test_uri(), db, kTimeout);
  CHECK(rec.begin(recipe_json, {{"world_size", 2}, {"restart", 1}}, id) == id);
  data::Client c(test_uri(), kTimeout);
  REQUIRE(c.find(db, "runs", json::object()).size() == 1);
  json run = the_run(db, id);
  CHECK(run["status"] == "running");
  CHECK(run["ended_at"].is_null());
  REQUIRE(run["resumes"].size() == 1);
  CHECK(run["resumes"][0]["restart"] == 1);
  CHECK(run["resumes"][0]["previous_status"] == "interrupted");
  CHECK(run["resumes"][0]["resumed_at"].contains("$date"));
  rec.finish("completed", {{"step", 10}});
  CHECK(the_run(db, id)["status"] == "completed");

  CHECK_THROWS_WITH(rec.begin(recipe_json, json::object(), std::string("0123456789abcdef01234567")),
                    Catch::Contains("no run 0123456789abcdef01234567 in " + db + ".runs"));
}

TEST_CASE("a password in the URI never reaches any stored document", "[db]") {
  const std::string secret = "s3cr3t-pw";
  const std::string uri = uri_with_password(secret);
  const std::string db = fresh_db();
  track::RunRecorder rec(uri, db, kTimeout);
  const recipe::Recipe r = sample_recipe(uri, db);
  // The recipe comes redacted; the info, metrics and error below carry the password on purpose.
  const std::string id = rec.begin(recipe::to_json(r), {{"data", {{"uri", uri}}}, {"note", "from " + uri}});
  rec.metrics({{"step", 1}, {"msg", "password " + secret}});
  rec.finish("failed", {{"where", uri}}, "cannot reach " + uri);
  data::Client c(test_uri(), kTimeout);
  std::string all;
  for (const char* coll : {"runs", "metrics"})
    for (const json& doc : c.find(db, coll, json::object())) all += doc.dump();
  CHECK_THAT(all, Catch::Contains("alice:****@"));
  CHECK_THAT(all, !Catch::Contains(secret));
  CHECK(the_run(db, id)["recipe"]["data"]["uri"] == recipe::to_json(r)["data"]["uri"]);
}

TEST_CASE("load_run_recipe gives back the recipe: recipe_from_json of it equals the original", "[db]") {
  const std::string db = fresh_db();
  const recipe::Recipe r = sample_recipe(test_uri(), db);
  track::RunRecorder rec(test_uri(), db, kTimeout);
  const std::string id = rec.begin(recipe::to_json(r), json::object());
  const json back = track::load_run_recipe(test_uri(), db, id, kTimeout);
  CHECK(back == recipe::to_json(r));
  CHECK(recipe::recipe_from_json(back) == r);
  CHECK(back["data"]["filter"]["meta.len"]["$gt"] == 3);
}

TEST_CASE("load_run_recipe: unknown or malformed ids and unreachable servers are one clear line", "[db]") {
  const std::string db = fresh_db();
  CHECK_THROWS_WITH(track::load_run_recipe(test_uri(), db, "66aa00000000000000000000", kTimeout),
                    Catch::StartsWith("no run 66aa00000000000000000000 in " + db + ".runs at mongodb://") &&
                        Catch::Contains("check the id"));
  CHECK_THROWS_WITH(track::load_run_recipe(test_uri(), db, "abc", kTimeout),
                    "'abc' is not a run id: expected 24 hex digits, as lora-train prints it (DATABASE/ID)");
  const std::string down = "mongodb://bob:hunter2@127.0.0.1:1/?authMechanism=PLAIN";
  try {
    track::load_run_recipe(down, db, "66aa00000000000000000000", milliseconds(300));
    FAIL("expected an error");
  } catch (const Error& e) {
    const std::string m = e.what();
    CHECK_THAT(m, Catch::StartsWith("cannot reach MongoDB at mongodb://bob:****@127.0.0.1:1/"));
    CHECK_THAT(m, !Catch::Contains("hunter2"));
    CHECK(m.find('\n') == std::string::npos);
  }
  CHECK_THROWS_WITH(track::RunRecorder(down, db, milliseconds(300)),
                    Catch::StartsWith("cannot reach MongoDB at mongodb://bob:****@"));
  CHECK_THROWS_WITH(track::RunRecorder("mongodb://h:notaport/", db, kTimeout),
                    Catch::StartsWith("invalid MongoDB URI"));
}

TEST_CASE("run references: DATABASE/ID, or a bare id with --runs-db") {
  CHECK(track::parse_run_ref("lorarun/66aa00000000000000000000").database == "lorarun");
  CHECK(track::parse_run_ref("lorarun/66aa00000000000000000000").id == "66aa00000000000000000000");
  CHECK(track::parse_run_ref("66aa00000000000000000000", "runsdb").database == "runsdb");
  CHECK_THROWS_WITH(track::parse_run_ref("66aa00000000000000000000"),
                    Catch::Contains("names no database: give it as DATABASE/ID"));
}

TEST_CASE("recipe_from_run: overrides apply and the given URI replaces a redacted one", "[db]") {
  const std::string db = fresh_db();
  const std::string stored_uri = "mongodb://alice:pw@db.example:27017/";
  track::RunRecorder rec(test_uri(), db, kTimeout);
  const std::string id = rec.begin(recipe::to_json(sample_recipe(stored_uri, db)), json::object());
  const std::string given = uri_with_password("other-pw");
  const recipe::Recipe r = track::recipe_from_run(db + "/" + id, "", given, {"train.lr=1e-3"}, kTimeout);
  CHECK(r.train.lr == 1e-3);
  CHECK(r.data.uri == given);
  CHECK(r.train.epochs == 2);
  REQUIRE(!r.warnings.empty());
  CHECK_THAT(r.warnings[0], Catch::Contains("read its data from db.example:27017; this run reads it from 127.0.0.1:"));
  CHECK_THROWS_WITH(track::recipe_from_run(id, "", given, {}, kTimeout), Catch::Contains("names no database"));
  CHECK_THROWS_WITH(track::recipe_from_run(db + "/" + id, "", "", {}, kTimeout),
                    Catch::Contains("give --uri or set LORARUN_MONGODB_URI"));
  CHECK_THROWS_WITH(track::recipe_from_run(db + "/" + id, "", given, {"train.lr=fast"}, kTimeout),
                    Catch::StartsWith("run " + db + "/" + id + " (override 'train.lr=fast')"));
}
