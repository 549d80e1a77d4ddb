// lora-data stats / preview / import on the fixture llama's tokenizer, checked against HF
// tokenizers (tests/reference/lora_data_check.py) and a dataset whose counts are known.
#include <fmt/format.h>
#include <unistd.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "support/process.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;
using nlohmann::json;

namespace {

const std::string kModel = std::string(LORARUN_MODEL_FIXTURES) + "/llama";
const char* kTemplate = "Q: {instruction}\nA: ";

// 49 documents: 40 short good ones, 4 far over 64 tokens (#30-#33), 5 bad (#3, #10: no output;
// #15: a number; #20: empty; #25: not JSON), and a blank line that is not a document.
void write_designed(const std::string& path) {
  std::ofstream f(path);
  for (int i = 0, good = 0; i < 49; ++i) {
    const std::string q = fmt::format("Add {} and {}", good, good + 1);
    if (i == 3 || i == 10)
      f << json{{"instruction", q}}.dump() << "\n";
    else if (i == 15)
      f << json{{"instruction", q}, {"output", 7}}.dump() << "\n";
    else if (i == 20)
      f << json{{"instruction", q}, {"output", ""}}.dump() << "\n";
    else if (i == 25)
      f << "{not json\n\n";
    else if (i >= 30 && i < 34)
      f << json{{"instruction", q}, {"output", std::string(400, 'z') + " the end"}}.dump() << "\n";
    else
      f << json{{"instruction", q}, {"output", std::to_string(2 * good++ + 1)}}.dump() << "\n";
  }
}

// A recipe over `data` (a JSONL path, or "mongodb:URI:DB:COLLECTION").
std::string write_recipe(const std::string& dir, const std::string& source) {
  std::string data = fmt::format("source: jsonl, path: {}", source);
  if (source.rfind("mongodb:", 0) == 0) {
    const auto parts = source.substr(8);
    const size_t c2 = parts.rfind(':'), c1 = parts.rfind(':', c2 - 1);
    data = fmt::format("source: mongodb, uri: \"{}\", database: {}, collection: {}", parts.substr(0, c1),
                       parts.substr(c1 + 1, c2 - c1 - 1), parts.substr(c2 + 1));
  }
  const std::string path = dir + "/recipe.yaml";
  std::ofstream(path) << fmt::format(
      "model: {{path: {}}}\ndata: {{{}, format: instruction, prompt_template: "
      "\"Q: {{instruction}}\\nA: \", max_length: 64}}\n",
      kModel, data);
  return path;
}

std::string oracle(const std::string& mode, const std::string& data, const std::string& overlong,
                   const std::string& ours) {
  return fmt::format("'{}' '{}/tests/reference/lora_data_check.py' {} {} {} '{}' 64 {} {}", LORARUN_PYTHON,
                     LORARUN_SOURCE_DIR, mode, kModel, data, kTemplate, overlong, ours);
}

// stats --json of a recipe (with overrides), as parsed JSON.
json stats_json(const std::string& recipe, const std::string& overrides = "") {
  const std::string out = recipe + "." + std::to_string(std::hash<std::string>{}(overrides)) + ".json";
  const Result r = sh(fmt::format("{} stats {} {} --json > {}", bin("lora-data"), recipe, overrides, out));
  INFO(r.output);
  REQUIRE(r.status == 0);
  return json::parse(read_file(out));
}

void check_one_line_error(const std::string& cmd, const std::string& needle) {
  const Result r = sh(cmd);
  INFO(cmd << "\n" << r.output);
  CHECK((r.status == 1 || r.status == 78));  // 78: input a rerun reads again alike (a missing file)
  CHECK(count_lines(r.output) == 1);
  CHECK_THAT(r.output, Catch::StartsWith("lora-data: error: ") && Catch::Contains(needle));
}

}  // namespace

TEST_CASE("lora-data stats gives the counts and token lengths HF tokenizers give", "[e2e][reference][lora-data]") {
  const std::string dir = temp_dir("lora_data_stats");
  write_designed(dir + "/data.jsonl");
  const std::string recipe = write_recipe(dir, dir + "/data.jsonl");

  for (const std::string overlong : {"truncate", "skip"}) {
    INFO("overlong " << overlong);
    const json s = stats_json(recipe, "data.overlong=" + overlong);
    CHECK(s["documents"] == 49);
    CHECK(s["bad_documents"] == 5);
    CHECK(s["overlong"] == 4);
    CHECK(s["overlong_policy"] == overlong);
    CHECK(s["examples"] == (overlong == "skip" ? 40 : 44));
    CHECK(s["token_length"]["max"].get<int>() > 400);  // 400 z's: far more than 64 tokens
    std::map<std::string, json> reasons;
    for (const json& b : s["bad_by_reason"]) reasons[b["reason"]] = b;
    CHECK(reasons["field 'output' is missing"]["count"] == 2);
    CHECK(reasons["field 'output' is missing"]["first"] == json{"#3", "#10"});
    CHECK(reasons["field 'output' is not a string"]["first"] == json{"#15"});
    CHECK(reasons["field 'output' is empty"]["first"] == json{"#20"});
    CHECK(reasons["not valid JSON"]["first"] == json{"#25"});
    std::ofstream(dir + "/ours.json") << s.dump();
    const Result c = sh(oracle("stats", dir + "/data.jsonl", overlong, dir + "/ours.json"));
    INFO(c.output);
    CHECK(c.status == 0);
  }

  const Result text = sh(fmt::format("{} stats {}", bin("lora-data"), recipe));
  INFO(text.output);
  CHECK(text.status == 0);
  CHECK_THAT(text.output, Catch::Contains("documents       49 selected") && Catch::Contains("examples        44") &&
                              Catch::Contains("field 'output' is missing: #3, #10") &&
                              Catch::Contains("4 exceed data.max_length 64 (truncated)"));
}

TEST_CASE("lora-data preview ids equal HF tokenizers' and labels mask exactly the prompt",
          "[e2e][reference][lora-data]") {
  const std::string dir = temp_dir("lora_data_preview");
  write_designed(dir + "/data.jsonl");
  const std::string recipe = write_recipe(dir, dir + "/data.jsonl");

  const Result r = sh(fmt::format("{} preview 100 {} --json > {}/ours.jsonl", bin("lora-data"), recipe, dir));
  INFO(r.output);
  REQUIRE(r.status == 0);
  std::istringstream lines(read_file(dir + "/ours.jsonl"));
  std::vector<json> docs;
  for (std::string line; std::getline(lines, line);) docs.push_back(json::parse(line));
  REQUIRE(docs.size() == 49);
  CHECK(docs[3] == json{{"position", 3}, {"rejected", "field 'output' is missing"}});
  // #0 "Q: Add 0 and 1\nA: " + "1" + EOS: a masked prompt, then trained tokens to the end.
  const auto ids = docs[0]["ids"].get<std::vector<int>>(), labels = docs[0]["labels"].get<std::vector<int>>();
  REQUIRE(ids.size() == labels.size());
  const size_t prompt =
      static_cast<size_t>(std::find_if(labels.begin(), labels.end(), [](int l) { return l != -100; }) - labels.begin());
  CHECK(prompt > 3);
  CHECK(std::equal(ids.begin() + static_cast<long>(prompt), ids.end(), labels.begin() + static_cast<long>(prompt)));
  CHECK(ids.back() == 0);               // <|endoftext|>
  CHECK(docs[30]["ids"].size() == 64);  // truncated to data.max_length

  const Result c = sh(oracle("preview", dir + "/data.jsonl", "truncate", dir + "/ours.jsonl"));
  INFO(c.output);
  CHECK(c.status == 0);

  const Result text = sh(fmt::format("{} preview 4 {}", bin("lora-data"), recipe));
  INFO(text.output);
  CHECK(text.status == 0);
  CHECK_THAT(text.output, Catch::Contains("Q: Add 0 and 1\nA: ⟦1<|endoftext|>⟧") &&
                              Catch::Contains("#3  rejected: field 'output' is missing"));
  CHECK_THAT(text.output, !Catch::Contains("#4"));

  // A document's terminal escapes, bell and direction override are shown, not sent to the terminal.
  std::ofstream(dir + "/hostile.jsonl") << json{{"instruction", "\x1b[2J\x07\u202e clear"}, {"output", "ok"}}.dump()
                                        << "\n";
  const Result hostile = sh(fmt::format("{} preview 1 {} data.path={}/hostile.jsonl", bin("lora-data"), recipe, dir));
  INFO(hostile.output);
  CHECK(hostile.status == 0);
  CHECK_THAT(hostile.output, Catch::Contains("\\x1b[2J\\x07\\u{202e} clear"));
  CHECK(hostile.output.find('\x1b') == std::string::npos);
  CHECK(hostile.output.find('\x07') == std::string::npos);
}

TEST_CASE("lora-data import streams JSONL into MongoDB in batches and names a bad line", "[e2e][db][lora-data]") {
  const char* uri = std::getenv("LORARUN_TEST_MONGODB_URI");
  if (!uri) FAIL("LORARUN_TEST_MONGODB_URI is not set: run the tests with scripts/test, which starts FerretDB");
  const std::string dir = temp_dir("lora_data_import"), coll = fmt::format("import_{}", getpid());
  const auto write = [&](const std::string& name, int lines, int bad_line) {
    std::ofstream f(dir + "/" + name);
    for (int n = 1; n <= lines; ++n)
      f << (n == bad_line ? "[\"not an object\"]"
                          : json{{"instruction", fmt::format("Say {}", n)}, {"output", "ok"}}.dump())
        << "\n";
  };
  write("good.jsonl", 2500, 0);
  write("bad.jsonl", 2500, 1700);
  write("bad_early.jsonl", 10, 5);
  const std::string import =
      fmt::format("{} import --uri '{}' --db lorarun_test_lora_data --collection {} ", bin("lora-data"), uri, coll);
  const std::string recipe = write_recipe(dir, fmt::format("mongodb:{}:lorarun_test_lora_data:{}", uri, coll));

  const Result ok = sh(import + dir + "/good.jsonl --drop");
  INFO(ok.output);
  REQUIRE(ok.status == 0);
  CHECK_THAT(ok.output, Catch::Contains("imported 2500 documents") && Catch::Contains("docs/s"));
  CHECK(stats_json(recipe)["documents"] == 2500);
  CHECK(stats_json(recipe)["examples"] == 2500);

  // Line 1,700 is bad: the first whole batch (1,000) is in, nothing after it.
  check_one_line_error(import + dir + "/bad.jsonl --drop",
                       "bad.jsonl:1700: not a JSON object (1000 documents inserted");
  CHECK(stats_json(recipe)["documents"] == 1000);
  // A bad line in the first batch leaves the collection as it was, --drop or not.
  check_one_line_error(import + dir + "/bad_early.jsonl --drop", "bad_early.jsonl:5: not a JSON object (0 documents");
  CHECK(stats_json(recipe)["documents"] == 1000);
}

TEST_CASE("lora-data errors are one line and exit non-zero", "[e2e][lora-data]") {
  const std::string dir = temp_dir("lora_data_errors");
  const std::string recipe = write_recipe(dir, dir + "/missing.jsonl");
  check_one_line_error(fmt::format("{} stats {}", bin("lora-data"), recipe), "missing.jsonl cannot be read");
  check_one_line_error(fmt::format("{} stats {}/nope.yaml", bin("lora-data"), dir), "nope.yaml");
  check_one_line_error(fmt::format("{} preview {}", bin("lora-data"), recipe), "see lora-data --help");
  check_one_line_error(fmt::format("{} stats {} data.max_lenght=5", bin("lora-data"), recipe), "max_length");
  check_one_line_error(
      fmt::format("env -u LORARUN_MONGODB_URI {} import {} --db d --collection c", bin("lora-data"), recipe),
      "give --uri or set LORARUN_MONGODB_URI");
}

TEST_CASE("an unreachable data.uri stops lora-train and lora-data within data.timeout_s, not dist.timeout_s",
          "[e2e][lora-data]") {
  const std::string dir = temp_dir("unreachable");
  const SilentPort silent;
  const std::string uri = fmt::format("mongodb://alice:s3cr3t-pw@127.0.0.1:{}/", silent.port);
  const std::string recipe = write_recipe(dir, fmt::format("mongodb:{}:train:docs", uri));
  // `timeout 120`: before data.timeout_s, lora-train waited dist.timeout_s (600 s) here.
  for (const std::string& cmd :
       {fmt::format("timeout 120 {} {} data.timeout_s=2 dist.timeout_s=600 model.device=cpu track.mongodb=false "
                    "checkpoint.output_dir={}/out",
                    bin("lora-train"), recipe, dir),
        fmt::format("timeout 120 {} stats {} data.timeout_s=2", bin("lora-data"), recipe)}) {
    const Result r = sh(cmd);
    INFO(cmd << "\n" << r.output);
    CHECK(r.status == 1);
    CHECK(r.seconds < 2 + 8);  // the timeout, and loading the tiny model
    CHECK_THAT(r.output,
               Catch::Contains(fmt::format("error: cannot reach MongoDB at mongodb://alice:****@127.0.0.1:{}/ "
                                           "within 2 s (data.timeout_s): ",
                                           silent.port)) &&
                   Catch::Contains("start the server or fix data.uri\n"));
    CHECK(r.output.find("error:") == r.output.rfind("error:"));  // one error line, no stack
    CHECK_THAT(r.output, !Catch::Contains("s3cr3t"));
  }
}

TEST_CASE("lora-train --dry-run runs data.filter on the server when it answers", "[e2e][db][lora-data]") {
  const char* uri = std::getenv("LORARUN_TEST_MONGODB_URI");
  if (!uri) FAIL("LORARUN_TEST_MONGODB_URI is not set: run the tests with scripts/test, which starts FerretDB");
  const std::string dir = temp_dir("dry_run_filter"), coll = fmt::format("dry_run_{}", getpid());
  std::ofstream(dir + "/docs.jsonl") << json{{"instruction", "a"}, {"output", "b"}}.dump() << "\n"
                                     << json{{"instruction", "c"}, {"output", "d"}}.dump() << "\n";
  REQUIRE(sh(fmt::format("{} import --uri '{}' --db lorarun_test_lora_data --collection {} {}/docs.jsonl --drop",
                         bin("lora-data"), uri, coll, dir))
              .status == 0);
  const std::string recipe = write_recipe(dir, fmt::format("mongodb:{}:lorarun_test_lora_data:{}", uri, coll));
  const std::string dry = fmt::format("{} --dry-run {}", bin("lora-train"), recipe);

  const Result ok = sh(dry);
  INFO(ok.output);
  CHECK(ok.status == 0);
  CHECK_THAT(ok.output, Catch::Contains("# documents selected: 2\n"));

  const Result bad = sh(dry + " 'data.filter={$foo: 1}'");
  INFO(bad.output);
  CHECK(bad.status == 1);
  const size_t at = bad.output.find("lora-train: error: ");
  REQUIRE(at != std::string::npos);
  const std::string line = bad.output.substr(at, bad.output.find('\n', at) - at);  // one line says it all
  CHECK_THAT(line, Catch::StartsWith("lora-train: error: data.filter {\"$foo\":1} was rejected by MongoDB at ") &&
                       Catch::Contains("unknown top level operator: $foo") && Catch::EndsWith("fix data.filter"));
  CHECK(bad.output.find("error:") == bad.output.rfind("error:"));

  // No server: the recipe itself is fine, so a warning and exit 0.
  const SilentPort silent;
  const Result down = sh(
      fmt::format("{} 'data.filter={{$foo: 1}}' data.timeout_s=1 data.uri=mongodb://127.0.0.1:{}/", dry, silent.port));
  INFO(down.output);
  CHECK(down.status == 0);
  CHECK_THAT(down.output, Catch::Contains("warning: could not check data.filter: cannot reach MongoDB at"));
}
