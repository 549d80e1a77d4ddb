// The shard reader against a real FerretDB (LORARUN_TEST_MONGODB_URI, as scripts/test exports
// it) and JSONL files: complete, disjoint, equal shards in every mode; order from (seed, epoch)
// only; exact resume; prefetch; projection; bad documents; a server restart and a dead server.
#include <catch2/catch.hpp>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <map>
#include <set>
#include <thread>
#include <unistd.h>

#include "data/mongo.hpp"
#include "data/source.hpp"
#include "tokenizer/tokenizer.hpp"
#include "util/error.hpp"

using namespace lorarun;
using recipe::Shuffle;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

const tok::Tokenizer& tokenizer() {
  static const tok::Tokenizer t = tok::Tokenizer::from_dir(std::string(LORARUN_TOKENIZER_FIXTURES) + "/gpt2");
  return t;
}

std::string test_uri() {
  const char* u = std::getenv("LORARUN_TEST_MONGODB_URI");
  return u ? u : "";
}

std::string unique_db() {
  static int n = 0;
  return fmt::format("test_source_{}_{}", getpid(), n++);
}

// Document i: {_id: i, n: i, instruction: "doc i", input: "", output: "answer", extra: …}.
nlohmann::json doc(int64_t i) {
  return {{"_id", i}, {"n", i}, {"instruction", fmt::format("doc {}", i)}, {"input", ""}, {"output", " answer"},
          {"extra", std::string(200, 'x')}};
}

recipe::DataSection config(const std::string& uri, const std::string& db, Shuffle shuffle) {
  recipe::DataSection d;
  d.uri = uri, d.database = db, d.collection = "docs", d.shuffle = shuffle;
  d.format = recipe::Format::Instruction;
  d.prompt_template = "{instruction}\n";
  d.response_field = "output";
  d.shuffle_buffer = 8, d.prefetch = 2, d.retries = 5, d.retry_backoff_s = 0.05;
  return d;
}

// A database holding documents 0..n-1 (inserted in a scrambled order: the natural order must
// not matter), or a JSONL file of them in order (file order is a JSONL source's _id order).
recipe::DataSection with_documents(const std::string& uri, int64_t n, Shuffle shuffle, bool jsonl = false) {
  std::vector<nlohmann::json> docs;
  for (int64_t i = 0; i < n; ++i) docs.push_back(doc(jsonl ? i : (i * 7919) % n));
  recipe::DataSection d = config(uri, unique_db(), shuffle);
  if (jsonl) {
    d.source = recipe::Source::Jsonl;
    d.path = (fs::temp_directory_path() / (d.database + ".jsonl")).string();
    std::ofstream out(d.path);
    for (const auto& j : docs) out << j.dump() << "\n";
    return d;
  }
  data::Client(uri, std::chrono::seconds(10)).insert_many(d.database, "docs", docs);
  return d;
}

// The document number an example came from (-1 for a rejection).
int64_t number(const data::Built& b) {
  const auto* e = std::get_if<data::Example>(&b);
  if (!e) return -1;
  long long n = -1;
  std::sscanf(tokenizer().decode(e->ids).c_str(), "doc %lld", &n);
  return n;
}

std::vector<int64_t> read_all(data::ShardReader& r, size_t batch = 7) {
  std::vector<int64_t> out;
  for (auto b = r.next(batch); !b.empty(); b = r.next(batch))
    for (const auto& x : b) out.push_back(number(x));
  return out;
}

std::vector<int64_t> read_shard(const data::Documents& docs, const data::ShardSpec& s, int64_t start = 0) {
  const data::ExampleBuilder builder(docs.config(), tokenizer());
  data::ShardReader r(docs, builder, s, start);
  return read_all(r);
}

#define NEED_SERVER()                                                        \
  if (test_uri().empty()) {                                                  \
    WARN("LORARUN_TEST_MONGODB_URI is not set: run scripts/test");           \
    return;                                                                  \
  }

// A FerretDB of the test's own, to stop and restart (scripts/ferretdb; same port on restart).
struct OwnServer {
  fs::path state = fs::temp_directory_path() / fmt::format("lorarun-ferretdb-{}-{}", getpid(), unique_db());
  std::string uri, port;
  OwnServer() {
    uri = run("start " + state.string());
    port = uri.substr(uri.rfind(':') + 1);
    port.pop_back();  // the trailing '/'
  }
  ~OwnServer() {
    run("stop " + state.string());
    fs::remove_all(state);
  }
  void stop() { run("stop " + state.string()); }
  bool start() { return run(fmt::format("start {} {}", state.string(), port)) == uri; }
  static std::string run(const std::string& args) {
    const std::string cmd = fmt::format("{}/scripts/ferretdb {} 2>&1 | tail -n 1", LORARUN_SOURCE_DIR, args);
    FILE* p = popen(cmd.c_str(), "r");
    std::string out;
    char buf[256];
    while (p && std::fgets(buf, sizeof buf, p)) out += buf;
    if (p) pclose(p);
    while (!out.empty() && out.back() == '\n') out.pop_back();
    return out;
  }
};

}  // namespace

TEST_CASE("shards: 1, 2, 3 ranks in every mode are complete, disjoint and equal (MongoDB and JSONL)") {
  NEED_SERVER();
  const int64_t n = 49;  // 2 ranks: 1 padded document; 3 ranks: 2
  for (const bool jsonl : {false, true})
    for (const Shuffle mode : {Shuffle::Global, Shuffle::Stream, Shuffle::None}) {
      const recipe::DataSection d = with_documents(test_uri(), n, mode, jsonl);
      const data::Documents docs(d, std::chrono::seconds(10));
      for (int world = 1; world <= 3; ++world) {
        INFO(fmt::format("{} {} world {}", jsonl ? "jsonl" : "mongodb", recipe::name(mode), world));
        const int64_t per = data::examples_per_rank(n, world);
        std::map<int64_t, int> seen;
        for (int rank = 0; rank < world; ++rank) {
          const auto ids = read_shard(docs, {world, rank, 42, 0, mode});
          CHECK(static_cast<int64_t>(ids.size()) == per);
          for (int64_t i : ids) ++seen[i];
        }
        CHECK(static_cast<int64_t>(seen.size()) == n);  // every document, nothing else
        CHECK(seen.begin()->first == 0);
        CHECK(seen.rbegin()->first == n - 1);
        std::vector<int64_t> twice;
        for (auto [i, c] : seen)
          if (c > 1) twice.push_back(i);
        CHECK(static_cast<int64_t>(twice.size()) == per * world - n);  // the documented padding only
        if (mode != Shuffle::Global)  // padding repeats the first documents in _id order
          for (size_t k = 0; k < twice.size(); ++k) CHECK(twice[k] == static_cast<int64_t>(k));
      }
    }
}

TEST_CASE("stream: many runs and windows, resumable, memory bounded by the window") {
  NEED_SERVER();
  const int64_t n = 301;
  recipe::DataSection d = with_documents(test_uri(), n, Shuffle::Stream);
  d.shuffle_buffer = 2;  // 151 per rank → 51 runs of 3 (64 at most), windows of 2 across runs
  const data::Documents docs(d, std::chrono::seconds(10));
  std::set<int64_t> all;
  for (int rank = 0; rank < 2; ++rank) {
    const auto ids = read_shard(docs, {2, rank, 7, 1, Shuffle::Stream});
    REQUIRE(ids.size() == 151);
    all.insert(ids.begin(), ids.end());
    for (int64_t k : {3, 150})
      CHECK(read_shard(docs, {2, rank, 7, 1, Shuffle::Stream}, k) == std::vector<int64_t>(ids.begin() + k, ids.end()));
  }
  CHECK(all.size() == 301);
}

TEST_CASE("order depends on (seed, epoch) only and none is sorted") {
  NEED_SERVER();
  for (const Shuffle mode : {Shuffle::Global, Shuffle::Stream, Shuffle::None}) {
    INFO(recipe::name(mode));
    recipe::DataSection d = with_documents(test_uri(), 60, mode);
    const data::Documents docs(d, std::chrono::seconds(10));
    const auto base = read_shard(docs, {2, 1, 1, 0, mode});
    recipe::DataSection sync = d;
    sync.prefetch = 0;
    const data::Documents other(sync, std::chrono::seconds(10));  // another process, no prefetch
    CHECK(read_shard(other, {2, 1, 1, 0, mode}) == base);
    if (mode == Shuffle::None) {
      CHECK(std::is_sorted(base.begin(), base.end()));
      CHECK(read_shard(docs, {2, 1, 1, 1, mode}) == base);
    } else {
      CHECK(read_shard(docs, {2, 1, 1, 1, mode}) != base);
      CHECK(read_shard(docs, {2, 1, 2, 0, mode}) != base);
      CHECK_FALSE(std::is_sorted(base.begin(), base.end()));
    }
  }
}

TEST_CASE("resume at k delivers exactly the tail of the uninterrupted order") {
  NEED_SERVER();
  for (const Shuffle mode : {Shuffle::Global, Shuffle::Stream, Shuffle::None}) {
    const recipe::DataSection d = with_documents(test_uri(), 45, mode);
    const data::Documents docs(d, std::chrono::seconds(10));
    const auto full = read_shard(docs, {3, 2, 5, 3, mode});
    REQUIRE(full.size() == 15);
    for (int64_t k : {0, 1, 7, 8, 9, 14, 15}) {
      INFO(fmt::format("{} k={}", recipe::name(mode), k));
      const data::ExampleBuilder builder(d, tokenizer());
      data::ShardReader r(docs, builder, {3, 2, 5, 3, mode}, k);
      CHECK(r.position() == k);
      CHECK(read_all(r, 4) == std::vector<int64_t>(full.begin() + k, full.end()));
      CHECK(r.position() == 15);
    }
  }
}

TEST_CASE("the reader fetches only the fields the format needs") {
  NEED_SERVER();
  recipe::DataSection d = with_documents(test_uri(), 3, Shuffle::Global);
  d.prompt_template = "{instruction}{input}\n";
  const data::ExampleBuilder builder(d, tokenizer());
  CHECK(builder.fields() == std::vector<std::string>{"instruction", "input", "output"});
  const data::Documents docs(d, std::chrono::seconds(10));
  const std::set<std::string> want{"_id", "instruction", "input", "output"};
  for (const auto& f : docs.fetch_found({0, 2}, builder.fields())) {
    std::set<std::string> keys;
    for (const auto& [k, v] : f.doc.items()) keys.insert(k);
    CHECK(keys == want);
  }
  for (const auto& f : docs.run(1, "", 2, builder.fields())) CHECK_FALSE(f.doc.contains("extra"));
  CHECK(docs.fetch({0})[0].contains("extra"));  // no projection: the whole document
  recipe::DataSection text = d, chat = d;
  text.format = recipe::Format::Text, chat.format = recipe::Format::Chat;
  CHECK(data::ExampleBuilder(text, tokenizer()).fields() == std::vector<std::string>{"text"});
  CHECK(data::ExampleBuilder(chat, tokenizer()).fields() == std::vector<std::string>{"messages"});
}

TEST_CASE("bad documents are counted by kind, with the first ids and reasons") {
  NEED_SERVER();
  const std::vector<nlohmann::json> docs{
      {{"_id", 1}, {"instruction", "doc 1"}, {"output", "ok"}},
      {{"_id", 2}, {"output", "missing instruction"}},
      {{"_id", 3}, {"instruction", 42}, {"output", "not a string"}},
      {{"_id", 4}, {"instruction", "doc 4"}, {"output", ""}},
      {{"_id", 5}, {"instruction", "doc 5"}, {"output", "ok"}},
  };
  for (const bool jsonl : {false, true}) {
    INFO(std::string(jsonl ? "jsonl" : "mongodb"));
    recipe::DataSection d = config(test_uri(), unique_db(), Shuffle::None);
    if (jsonl) {
      d.source = recipe::Source::Jsonl;
      d.path = (fs::temp_directory_path() / (d.database + ".jsonl")).string();
      std::ofstream out(d.path);
      for (const auto& j : docs) out << j.dump() << "\n";
      out << "{\"_id\": 6, \"instruction\": \"bad \xff\xfe\", \"output\": \"x\"}\n";  // invalid UTF-8
    } else {
      data::Client(test_uri(), std::chrono::seconds(10)).insert_many(d.database, "docs", docs);
    }
    const data::Documents source(d, std::chrono::seconds(10));
    const data::ExampleBuilder builder(d, tokenizer());
    data::ShardReader r(source, builder, {1, 0, 42, 0, Shuffle::None});
    const auto got = read_all(r, 2);
    CHECK(got == (jsonl ? std::vector<int64_t>{1, -1, -1, -1, 5, -1} : std::vector<int64_t>{1, -1, -1, -1, 5}));
    CHECK(r.rejected(data::Rejection::BadDocument) == (jsonl ? 4 : 3));
    CHECK(r.rejected(data::Rejection::Overlong) == 0);
    const std::string p = jsonl ? "#" : "";
    std::vector<std::string> want{(jsonl ? "#1" : "2") + std::string(": field 'instruction' is missing"),
                                  (jsonl ? "#2" : "3") + std::string(": field 'instruction' is not a string"),
                                  (jsonl ? "#3" : "4") + std::string(": field 'output' is empty")};
    if (jsonl) want.push_back("#5: not valid JSON or not valid UTF-8");
    CHECK(r.first_rejected() == want);
  }
}

TEST_CASE("an empty selection and an unknown collection are errors before training") {
  NEED_SERVER();
  for (const Shuffle mode : {Shuffle::Global, Shuffle::Stream}) {
    recipe::DataSection d = with_documents(test_uri(), 3, mode);
    d.filter = {{"n", 1000}};
    CHECK_THROWS_WITH(data::Documents(d, std::chrono::seconds(10)),
                      Catch::Contains("selects no document") && Catch::Contains("fix data.filter"));
    d.filter = nlohmann::json::object();
    d.collection = "nope";
    CHECK_THROWS_WITH(data::Documents(d, std::chrono::seconds(10)),
                      Catch::Contains("collection 'nope' does not exist"));
  }
}

// Stops the server after `before` examples, restarts it on the same port `down_s` later in the
// background, and checks the reader goes on with exactly the uninterrupted order.
void restart_mid_epoch(Shuffle mode, int prefetch) {
  OwnServer server;
  recipe::DataSection d = with_documents(server.uri, 1500, mode);
  d.prefetch = prefetch, d.shuffle_buffer = 100, d.retries = 8, d.retry_backoff_s = 0.25;
  const data::Documents docs(d, std::chrono::seconds(5));
  const auto full = read_shard(docs, {1, 0, 3, 0, mode});
  const data::ExampleBuilder builder(d, tokenizer());
  data::ShardReader r(docs, builder, {1, 0, 3, 0, mode});
  std::vector<int64_t> got;
  for (const auto& b : r.next(100)) got.push_back(number(b));
  server.stop();
  bool restarted = false;
  std::thread restart([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    restarted = server.start();
  });
  const auto rest = read_all(r, 50);
  restart.join();
  CHECK(restarted);
  got.insert(got.end(), rest.begin(), rest.end());
  CHECK(got == full);  // no duplicate, no gap, same order
  CHECK(r.wait_seconds() > 1.0);
}

TEST_CASE("FerretDB restarted mid-epoch (global, prefetch): no duplicate, no gap") {
  NEED_SERVER();
  restart_mid_epoch(Shuffle::Global, 1);
}

TEST_CASE("FerretDB restarted mid-epoch (stream, synchronous): no duplicate, no gap") {
  NEED_SERVER();
  restart_mid_epoch(Shuffle::Stream, 0);
}

TEST_CASE("FerretDB gone past the retry budget: one Error naming the server, no hang") {
  NEED_SERVER();
  OwnServer server;
  recipe::DataSection d = with_documents(server.uri, 2000, Shuffle::Global);
  d.retries = 2, d.retry_backoff_s = 0.2, d.prefetch = 1;
  const data::Documents docs(d, std::chrono::seconds(2));
  const data::ExampleBuilder builder(d, tokenizer());
  {  // destroyed in the middle of a backoff: returns at once
    recipe::DataSection patient = d;
    patient.retries = 10, patient.retry_backoff_s = 5;
    const data::Documents slow(patient, std::chrono::seconds(2));
    server.stop();
    auto r = std::make_unique<data::ShardReader>(slow, builder, data::ShardSpec{});
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    const auto t0 = Clock::now();
    r.reset();
    CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 2.0);
    REQUIRE(server.start());
  }
  data::ShardReader r(docs, builder, {1, 0, 42, 0, Shuffle::Global});
  CHECK(r.next(10).size() == 10);
  server.stop();
  const auto t0 = Clock::now();
  std::string message;
  try {
    read_all(r);
  } catch (const Error& e) {
    message = e.what();
  }
  CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 20.0);
  CHECK_THAT(message, Catch::StartsWith("lost MongoDB at " + server.uri + ": 3 attempt(s) over 0.6 s failed") &&
                          Catch::Contains("raise data.retries (2) / data.retry_backoff_s (0.2)"));
  CHECK(message.find('\n') == std::string::npos);
}
