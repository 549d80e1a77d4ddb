// data.sources end to end with the real binaries on the tiny llama fixture: the realised mixture
// of an epoch (by examples and by tokens) against the weights, upsampling before repeats, the same
// adapter on 1 rank, 2 ranks and 1 rank with accumulation, an exact resume after kill -9, eval per
// source from FerretDB collections, the refusals, and data.shuffle: stream over sources (shares,
// repeats, interleaving, kill -9 resume).
#include <fmt/format.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "data/mongo.hpp"
#include "support/process.hpp"
#include "support/runs.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;
using nlohmann::json;

namespace {

// `n` documents of source `tag`, their responses `words` words long (so sources differ in tokens).
void write_source(const std::string& path, const std::string& tag, int n, int words) {
  std::ofstream out(path);
  for (int i = 0; i < n; ++i) {
    std::string response = std::to_string(4 * i + 1);
    for (int w = 1; w < words; ++w) response += fmt::format(" {}{}", tag, (i + w) % 10);
    out << json{{"instruction", fmt::format("{} {} and {}", tag, i, 3 * i + 1)}, {"output", response}}.dump() << "\n";
  }
}

// `dir`/`name`.yaml over JSONL sources ("[{name: a, path: …, weight: 1}, …]"), 1 epoch unless `train`
// says; `data`,
// `train` and `checkpoint` are appended to their sections.
std::string mix_recipe(const std::string& dir, const std::string& name, const std::string& sources,
                       const std::string& data = "", const std::string& train = "",
                       const std::string& checkpoint = "") {
  const std::string path = fmt::format("{}/{}.yaml", dir, name);
  std::ofstream(path) << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
data: {{source: jsonl, sources: {}, format: instruction, prompt_template: "Q: {{instruction}}\nA: "{}}}
train: {{lr: 5.0e-3, warmup_steps: 2{}{}}}
checkpoint: {{output_dir: {}/{}{}}}
track: {{mongodb: false}}
)",
                                     LORARUN_MODEL_FIXTURES, sources, data,
                                     train.find("epochs") == std::string::npos ? ", epochs: 1" : "", train, dir, name,
                                     checkpoint);
  return path;
}

std::vector<json> metrics(const std::string& output_dir) {
  std::vector<json> rows;
  std::istringstream in(read_file(output_dir + "/metrics.jsonl"));
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) rows.push_back(json::parse(line));
  return rows;
}

// Per source: the documents and trained tokens of epoch `epoch`, summed over its metrics rows.
std::map<std::string, std::pair<double, double>> realised(const std::string& output_dir, int epoch = 0) {
  std::map<std::string, std::pair<double, double>> out;
  for (const json& row : metrics(output_dir)) {
    if (!row.contains("source_documents") || row["epoch"] != epoch) continue;
    for (const auto& [name, n] : row["source_documents"].items()) out[name].first += n.get<double>();
    for (const auto& [name, n] : row["source_tokens"].items()) out[name].second += n.get<double>();
  }
  return out;
}

// Each source's realised share (documents or tokens) against weight / sum of weights.
void check_shares(const std::map<std::string, std::pair<double, double>>& got,
                  const std::map<std::string, double>& weights, bool tokens, const std::string& what) {
  double total = 0, weight = 0;
  for (const auto& [name, n] : got) total += tokens ? n.second : n.first;
  for (const auto& [name, w] : weights) weight += w;
  REQUIRE(got.size() == weights.size());
  std::string shown;
  for (const auto& [name, w] : weights) {
    const double share = (tokens ? got.at(name).second : got.at(name).first) / total, want = w / weight;
    CHECK(std::abs(share - want) <= 0.01);
    shown += fmt::format(" {} {:.2f}% (weight {:.2f}%)", name, 100 * share, 100 * want);
  }
  fmt::print("{}:{}\n", what, shown);
}

// Small (7 documents, weight 1) and large (60, weight 2) in `dir`: an epoch of 67 holds 22 of
// small's (3 passes and 1) and 45 of large's.
std::string small_and_large(const std::string& dir) {
  write_source(dir + "/small.jsonl", "s", 7, 1);
  write_source(dir + "/large.jsonl", "l", 60, 1);
  return fmt::format(
      "[{{name: small, path: {0}/small.jsonl, weight: 1}}, {{name: large, path: {0}/large.jsonl, weight: 2}}]", dir);
}

// write_source's documents as the collection `coll` of `db` at the test server (dropped first),
// with _ids 0, 1, … (eval.fraction hashes the _id: fixed ones fix the split) and a field lang.
void insert_source(const std::string& dir, const std::string& db, const std::string& coll, const std::string& tag,
                   int n, int words) {
  lorarun::data::Client client(test_uri(), std::chrono::seconds(10), {"the test"});
  client.drop(db, coll);
  write_source(fmt::format("{}/{}.jsonl", dir, coll), tag, n, words);
  std::vector<json> docs;
  std::istringstream in(read_file(fmt::format("{}/{}.jsonl", dir, coll)));
  int i = 0;
  for (std::string line; std::getline(in, line); ++i) {
    json j = json::parse(line);
    j["_id"] = i;
    j["lang"] = i % 3 == 0 ? "de" : "en";
    docs.push_back(j);
  }
  client.insert_many(db, coll, docs);
}

// (source, position) of each of the first n documents lora-data preview shows for `recipe`.
std::vector<std::pair<std::string, int>> previewed(const std::string& recipe, int n) {
  const Result r = sh(fmt::format("{} preview {} --json {}", bin("lora-data"), n, recipe));
  INFO(r.output);
  REQUIRE(r.status == 0);
  std::vector<std::pair<std::string, int>> out;
  std::istringstream in(r.output);
  for (std::string line; std::getline(in, line);) {
    const json j = json::parse(line);
    out.emplace_back(j["source"], j["position"].get<int>());
  }
  return out;
}

// Smoothly interleaved: any 12 documents in a row hold 2 to 6 of small's (4 by its share of 1/3).
void check_interleaved(const std::vector<std::pair<std::string, int>>& picks) {
  std::string order;  // 's' or 'l' per document
  for (const auto& [source, position] : picks) order += source == "small" ? 's' : 'l';
  INFO(order);
  for (size_t at = 0; at + 12 <= order.size(); ++at) {
    CHECK(std::count(order.begin() + at, order.begin() + at + 12, 's') >= 2);
    CHECK(std::count(order.begin() + at, order.begin() + at + 12, 's') <= 6);
  }
}

}  // namespace

TEST_CASE("data.sources: an epoch's realised shares follow the weights by examples and by tokens, within a point",
          "[e2e]") {
  const std::string dir = temp_dir("mix-shares");
  write_source(dir + "/small.jsonl", "s", 30, 1);   // short responses
  write_source(dir + "/large.jsonl", "l", 250, 6);  // longer ones
  write_source(dir + "/mid.jsonl", "m", 80, 3);
  const std::string two = fmt::format(
      "[{{name: small, path: {}/small.jsonl, weight: 1}}, {{name: large, path: {}/large.jsonl, weight: 3}}]", dir, dir);
  const std::string three = fmt::format(
      "[{{name: small, path: {0}/small.jsonl, weight: 1}}, {{name: mid, path: {0}/mid.jsonl, weight: 1}}, "
      "{{name: large, path: {0}/large.jsonl, weight: 8}}]",
      dir);
  const std::map<std::string, double> two_weights{{"small", 1}, {"large", 3}},
      three_weights{{"small", 1}, {"mid", 1}, {"large", 8}};
  for (const auto& [name, sources, by, shuffle, weights] :
       {std::tuple{"two-examples", two, "examples", "global", two_weights},
        std::tuple{"two-tokens", two, "tokens", "global", two_weights},
        std::tuple{"three-examples", three, "examples", "global", three_weights},
        std::tuple{"three-tokens", three, "tokens", "global", three_weights},
        std::tuple{"two-tokens-stream", two, "tokens", "stream", two_weights},
        std::tuple{"three-examples-stream", three, "examples", "stream", three_weights}}) {
    const std::string recipe = mix_recipe(dir, name, sources, fmt::format(", mix_by: {}, shuffle: {}", by, shuffle));
    const Result run = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), recipe));
    INFO(run.output);
    REQUIRE(run.status == 0);
    check_shares(realised(fmt::format("{}/{}", dir, name)), weights, std::string(by) == "tokens", name);
    // the plan lora-data stats prints is what training read
    const Result stats = sh(fmt::format("{} stats --json {}", bin("lora-data"), recipe));
    INFO(stats.output);
    REQUIRE(stats.status == 0);
    const json plan = json::parse(stats.output);
    const auto got = realised(fmt::format("{}/{}", dir, name));
    // (stream splits each source among the ranks: each padded to a multiple of the 2 ranks)
    for (const json& s : plan["sources"]) {
      const double padding = got.at(s["name"]).first - s["per_epoch"].get<double>();
      CHECK(padding >= 0);
      CHECK(padding <= (std::string(shuffle) == "stream" ? 1 : 0));
    }
  }
}

TEST_CASE("data.sources: an upsampled source's documents each come once before any comes again, over epochs too",
          "[e2e]") {
  const std::string dir = temp_dir("mix-repeats");
  const auto picks = previewed(mix_recipe(dir, "repeats", small_and_large(dir)), 67);
  std::vector<int> small;
  std::set<int> large;
  int large_count = 0;
  for (const auto& [source, position] : picks) {
    if (source == "small") {
      small.push_back(position);
    } else {
      large.insert(position);
      ++large_count;
    }
  }
  REQUIRE(small.size() == 22);
  CHECK(large_count == 45);
  CHECK(large.size() == 45);  // subsampled: none twice
  for (size_t pass = 0; pass * 7 < small.size(); ++pass) {
    const std::set<int> seen(small.begin() + pass * 7, small.begin() + std::min(small.size(), pass * 7 + 7));
    CHECK(seen.size() == std::min<size_t>(7, small.size() - pass * 7));  // each once within a pass
  }
  check_interleaved(picks);
}

TEST_CASE(
    "data.sources with data.shuffle: stream: each source's share, repeats of an upsampled one, smooth "
    "interleaving, shuffled by the window",
    "[e2e]") {
  const std::string dir = temp_dir("mix-stream");
  const std::string sources = small_and_large(dir);
  const auto window = [&](int buffer) {  // epoch 0 through a window of `buffer` documents
    return previewed(mix_recipe(dir, fmt::format("stream-{}", buffer), sources,
                                fmt::format(", shuffle: stream, shuffle_buffer: {}", buffer)),
                     67);
  };
  const auto unshuffled = window(1), shuffled = window(64);
  REQUIRE(unshuffled.size() == 67);
  std::map<int, int> small;
  std::set<int> large;
  for (const auto& [source, position] : unshuffled) {
    if (source == "small")
      ++small[position];
    else
      large.insert(position);
  }
  // small's 22: each of its 7 three or four times; large's 45 all different
  REQUIRE(small.size() == 7);
  for (const auto& [position, n] : small) CHECK((n == 3 || n == 4));
  CHECK(large.size() == 45);
  check_interleaved(unshuffled);
  // the window shuffles the same documents
  CHECK(shuffled != unshuffled);
  auto a = shuffled, b = unshuffled;
  std::sort(a.begin(), a.end());
  std::sort(b.begin(), b.end());
  CHECK(a == b);
}

TEST_CASE(
    "data.sources: 1 rank, 2 ranks and 1 rank with accumulation 2 train the same adapter, and kill -9 resumes "
    "byte-identical",
    "[e2e][resume]") {
  const std::string dir = temp_dir("mix-ranks");
  write_source(dir + "/small.jsonl", "s", 12, 2);
  write_source(dir + "/large.jsonl", "l", 90, 4);
  const std::string sources = fmt::format(
      "[{{name: small, path: {0}/small.jsonl, weight: 1}}, {{name: large, path: {0}/large.jsonl, weight: 3}}]", dir);
  const auto run = [&](const std::string& name, int ranks, int batch, int accum, int epochs) {
    const std::string recipe =
        mix_recipe(dir, name, sources, fmt::format(", batch_size: {}, mix_by: tokens", batch),
                   fmt::format(", epochs: {}, lr_scheduler: cosine, gradient_accumulation_steps: {}", epochs, accum));
    // (B starts random and lr is low: AdamW turns float rounding in near-zero gradients into steps of
    // up to lr, and the sums of 1 rank and of 2 round differently)
    return sh(fmt::format("{} --nproc-per-node {} {} lora.init=gaussian train.lr=2e-3", bin("lorarun"), ranks, recipe));
  };
  const Result two = run("two", 2, 4, 1, 1), one = run("one", 1, 8, 1, 1), accum = run("accum", 1, 4, 2, 1);
  INFO(two.output << one.output << accum.output);
  REQUIRE(two.status == 0);
  REQUIRE(one.status == 0);
  REQUIRE(accum.status == 0);
  const auto adapter = [&](const std::string& name) {
    return fmt::format("{}/{}/epoch_0/adapter_model.safetensors", dir, name);
  };
  // step by step the same documents of each source, whatever the ranks and accumulation
  const auto counts = [&](const std::string& name) {
    std::vector<json> out;
    for (const json& row : metrics(dir + "/" + name)) out.push_back({row["source_documents"], row["source_tokens"]});
    return out;
  };
  CHECK(counts("two").size() == 13);
  CHECK(counts("two") == counts("one"));
  CHECK(counts("two") == counts("accum"));
  const double d1 = adapter_relative_diff(adapter("two"), adapter("one")),
               d2 = adapter_relative_diff(adapter("two"), adapter("accum"));
  fmt::print("data.sources: 2 ranks vs 1 rank {:.2g}, vs 1 rank x accumulation 2 {:.2g} (of the largest weight)\n", d1,
             d2);
  CHECK(d1 <= 1e-6);
  CHECK(d2 <= 1e-6);

  // kill -9 of the job after a periodic state, then the same command resumes to the uninterrupted
  // adapter: the global order, and stream's runs and windows (the states fall mid-window)
  for (const std::string shuffle : {"global", "stream"}) {
    INFO(shuffle);
    const std::string data = fmt::format(", batch_size: 4, mix_by: tokens, shuffle: {}, shuffle_buffer: 6", shuffle);
    const auto recipe = [&](const std::string& name, const std::string& checkpoint) {
      return mix_recipe(dir, name, sources, data, ", epochs: 2, lr_scheduler: cosine", checkpoint);
    };
    const std::string cmd = fmt::format("{} --nproc-per-node 2 {} lora.init=gaussian train.lr=2e-3", bin("lorarun"),
                                        recipe("killed-" + shuffle, ", state_every_n_steps: 4"));
    const Result killed = interrupt(cmd, dir + "/killed.log", "step 9/",
                                    fmt::format("pkill -9 -f 'lora-train.*killed-{}.yaml'", shuffle));
    INFO(read_file(dir + "/killed.log"));
    CHECK_THAT(killed.output, !Catch::Contains("exit=0"));
    const Result resumed = sh(cmd);
    INFO(resumed.output);
    REQUIRE(resumed.status == 0);
    CHECK_THAT(resumed.output, Catch::Contains("resuming at epoch"));
    const Result straight = sh(fmt::format("{} --nproc-per-node 2 {} lora.init=gaussian train.lr=2e-3", bin("lorarun"),
                                           recipe("straight-" + shuffle, "")));
    REQUIRE(straight.status == 0);
    CHECK(hashes(dir + "/killed-" + shuffle + "/epoch_1") == hashes(dir + "/straight-" + shuffle + "/epoch_1"));
  }
}

TEST_CASE(
    "data.sources from FerretDB: collections and a filter mixed on 2 ranks, eval_loss per source, the "
    "mixture in the run record",
    "[e2e][db]") {
  const std::string dir = temp_dir("mix-mongo");
  const std::string uri = test_uri(), db = "lorarun_test_mix";
  insert_source(dir, db, "tasks", "t", 120, 3);
  insert_source(dir, db, "chat", "c", 30, 1);
  const std::string path = dir + "/mongo.yaml";
  std::ofstream(path) << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
data: {{uri: "{}", database: {}, format: instruction, prompt_template: "Q: {{instruction}}\nA: ", batch_size: 4,
        sources: [{{name: tasks, collection: tasks, weight: 3}}, {{name: chat-en, collection: chat, filter: {{lang: en}}, weight: 1}}]}}
train: {{epochs: 1, lr: 5.0e-3}}
eval: {{fraction: 0.2}}
checkpoint: {{output_dir: {}/out}}
track: {{mongodb: true, database: {}}}
)",
                                     LORARUN_MODEL_FIXTURES, uri, db, dir, db);
  const Result run = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), path));
  INFO(run.output);
  REQUIRE(run.status == 0);
  bool eval_row = false;
  for (const json& row : metrics(dir + "/out"))
    if (row.contains("eval_loss")) {
      eval_row = true;
      CHECK(row.contains("eval_loss/tasks"));
      CHECK(row.contains("eval_loss/chat-en"));
      // the overall loss lies between the sources' own
      const double a = row["eval_loss/tasks"], b = row["eval_loss/chat-en"], all = row["eval_loss"];
      CHECK(all >= std::min(a, b) - 1e-9);
      CHECK(all <= std::max(a, b) + 1e-9);
    }
  CHECK(eval_row);
  const auto got = realised(dir + "/out");
  CHECK(got.at("tasks").first > 0);
  CHECK(got.at("chat-en").first > 0);
  const std::string id = run_id_in(run.output, db);
  const Result record = sh(fmt::format("{} show {}/{} --uri '{}'", bin("lora-runs"), db, id, uri));
  INFO(record.output);
  CHECK_THAT(record.output, Catch::Contains("\"mixture\""));
  CHECK_THAT(record.output, Catch::Contains("chat-en"));
}

TEST_CASE(
    "data.sources from FerretDB: an upsampled collection's repeats that fall into one fetch all train (200 and 50 "
    "documents 1:3 on one rank: 187 of the small one's, none skipped)",
    "[e2e][db]") {
  const std::string dir = temp_dir("mix-mongo-repeats");
  const std::string uri = test_uri(), db = "lorarun_test_mix_repeats";
  insert_source(dir, db, "big", "b", 200, 2);
  insert_source(dir, db, "small", "s", 50, 2);
  const std::string path = dir + "/repeats.yaml";
  std::ofstream(path) << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: [q_proj]}}
data: {{uri: "{}", database: {}, format: instruction, prompt_template: "Q: {{instruction}}\nA: ", batch_size: 8,
        max_length: 32, sources: [{{name: big, collection: big, weight: 1}}, {{name: small, collection: small, weight: 3}}]}}
train: {{epochs: 1, lr: 1.0e-3}}
checkpoint: {{output_dir: {}/out}}
track: {{mongodb: false}}
)",
                                     LORARUN_MODEL_FIXTURES, uri, db, dir);
  const Result run = sh(fmt::format("{} --nproc-per-node 1 {}", bin("lorarun"), path));
  INFO(run.output);
  REQUIRE(run.status == 0);
  CHECK_THAT(run.output, !Catch::Contains("skipping"));
  const auto got = realised(dir + "/out");
  CHECK(got.at("big").first == 63);
  CHECK(got.at("small").first == 187);
  for (const json& row : metrics(dir + "/out")) CHECK(row["skipped"] == 0);
}

TEST_CASE("data.sources: bad mixtures are one line each, before training", "[e2e]") {
  const std::string dir = temp_dir("mix-bad");
  write_source(dir + "/a.jsonl", "a", 10, 1);
  std::ofstream(dir + "/empty.jsonl") << "\n";
  std::ofstream(dir + "/prose.txt") << "Not JSON at all.\nA second line of prose.\n";
  const std::string a = fmt::format("{{name: a, path: {}/a.jsonl, weight: 1}}", dir);
  for (const auto& [sources, data, expected] : {
           std::tuple{fmt::format("[{}, {{name: b, path: {}/a.jsonl, weight: 0}}]", a, dir), std::string(),
                      std::string("'b' has weight 0: weights are numbers above 0")},
           std::tuple{fmt::format("[{}, {{name: a, path: {}/a.jsonl}}]", a, dir), std::string(),
                      std::string("name 'a' twice")},
           std::tuple{fmt::format("[{}, {{name: b, path: {}/empty.jsonl}}]", a, dir), std::string(),
                      std::string("data.sources 'b': data.path " + dir + "/empty.jsonl holds no documents")},
           std::tuple{fmt::format("[{}, {{name: b, path: {}/a.jsonl, max_length: 64}}]", a, dir), std::string(),
                      std::string("sets max_length, which is shared by every source and cannot differ per source")},
           std::tuple{fmt::format("[{}]", a), fmt::format(", path: {}/a.jsonl", dir),
                      std::string("data.sources and data.path")},
           std::tuple{fmt::format("[{}, {{name: ../x, path: {}/a.jsonl}}]", a, dir), std::string(),
                      std::string("is named '../x'")},
           std::tuple{
               fmt::format("[{{name: a, path: {0}/a.jsonl, weight: 1e308}}, {{name: b, path: {0}/a.jsonl}}]", dir),
               std::string(), std::string("data.sources 'b' gets no document of an epoch of 20")},
           std::tuple{fmt::format("[{}, {{name: b, path: {}/prose.txt}}]", a, dir), std::string(),
                      std::string("data.sources 'b': none of the 2 documents sampled from")},
       }) {
    const std::string recipe = mix_recipe(dir, "bad", sources, data);
    const Result r = sh(fmt::format("timeout 60 {} --nproc-per-node 1 {}", bin("lorarun"), recipe));
    INFO(r.output);
    CHECK(r.status == 78);
    CHECK_THAT(r.output, Catch::Contains(expected));
    CHECK_THAT(r.output, !Catch::Contains("terminate"));
    CHECK_FALSE(std::filesystem::exists(dir + "/bad/epoch_0"));
  }
  // Weights near the largest double share an epoch as their ratio says (they once overflowed).
  const Result stats =
      sh(fmt::format("timeout 60 {} stats --json {}", bin("lora-data"),
                     mix_recipe(dir, "huge",
                                fmt::format("[{{name: a, path: {0}/a.jsonl, weight: 1.5e308}}, {{name: b, path: "
                                            "{0}/a.jsonl, weight: 0.5e308}}]",
                                            dir))));
  INFO(stats.output);
  REQUIRE(stats.status == 0);
  const json plan = json::parse(stats.output);
  CHECK(plan["sources"][0]["per_epoch"] == 15);
  CHECK(plan["sources"][1]["per_epoch"] == 5);
}
