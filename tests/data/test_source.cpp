// The shard reader against a real FerretDB (LORARUN_TEST_MONGODB_URI, as scripts/test exports
// it) and JSONL files: complete, disjoint, equal shards in every mode; order from (seed, epoch)
// only; exact resume; prefetch; projection; bad documents; a server restart and a dead server;
// stop requests; unreachable servers and refused credentials.
#include <catch2/catch.hpp>

#include <fmt/format.h>
#include <mongoc/mongoc.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <thread>
#include <tuple>

#include "data/batches.hpp"
#include "data/mixture.hpp"
#include "data/mongo.hpp"
#include "data/source.hpp"
#include "support/servers.hpp"
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

// The test FerretDB (LORARUN_TEST_MONGODB_URI): a test that needs it fails without it.
using lorarun::test::test_uri;

std::string unique_db() {
  static int n = 0;
  return fmt::format("test_source_{}_{}", getpid(), n++);
}

// Document i: {_id: i, n: i, instruction: "doc i", input: "", output: "answer", extra: …}.
nlohmann::json doc(int64_t i) {
  return {{"_id", i},
          {"n", i},
          {"instruction", fmt::format("doc {}", i)},
          {"input", ""},
          {"output", " answer"},
          {"extra", std::string(200, 'x')}};
}

recipe::DataSection config(const std::string& uri, const std::string& db, Shuffle shuffle) {
  recipe::DataSection d;
  d.uri = uri;
  d.database = db;
  d.collection = "docs";
  d.shuffle = shuffle;
  d.format = recipe::Format::Instruction;
  d.prompt_template = "{instruction}\n";
  d.response_field = "output";
  d.shuffle_buffer = 8;
  d.prefetch = 2;
  d.retries = 5;
  d.retry_backoff_s = 0.05;
  d.timeout_s = 10;
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

// A FerretDB of the test's own, to stop and restart (scripts/ferretdb; same port on restart).
// `env`: FERRETDB_* settings for it (FerretDB reads its flags from the environment too).
struct OwnServer {
  fs::path state = fs::temp_directory_path() / fmt::format("lorarun-ferretdb-{}-{}", getpid(), unique_db());
  std::string uri, port, env;
  explicit OwnServer(std::string environment = "") : env(std::move(environment)) {
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
  std::string run(const std::string& args) const {
    const std::string cmd = fmt::format("{} {}/scripts/ferretdb {} 2>&1 | tail -n 1", env, LORARUN_SOURCE_DIR, args);
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

TEST_CASE("IdList gives back every id's text, ObjectIds packed and any other type after them") {
  // the texts libbson writes for an ObjectId, a string and an int _id
  const std::string a = R"({ "_id" : { "$oid" : "65f1c2d3e4f5a6b7c8d9e0f1" } })";
  const std::string b = R"({ "_id" : { "$oid" : "000000000000000000000000" } })";
  const std::string odd = R"({ "_id" : { "$oid" : "65F1C2D3E4F5A6B7C8D9E0F1" } })";  // not libbson's: kept as text
  const std::string s = R"({ "_id" : "tenant \" 7" })", n = R"({ "_id" : { "$numberInt" : "7" } })";
  data::IdList ids;
  ids.push_back(a);
  ids.push_back(b);
  CHECK(ids.size() == 2);
  CHECK(ids[0] == a);
  CHECK(ids[1] == b);
  for (const std::string& t : {odd, s, n, a}) ids.push_back(t);
  ids.shrink_to_fit();
  const std::vector<std::string> want = {a, b, odd, s, n, a};
  REQUIRE(ids.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) CHECK(ids[i] == want[i]);
  // past a block of packed ids (65536 of them), each still read back as given, then as text
  data::IdList many;
  const auto oid = [](size_t i) { return fmt::format(R"({{ "_id" : {{ "$oid" : "{:024x}" }} }})", i * 7919); };
  for (size_t i = 0; i < 65536 + 3; ++i) many.push_back(oid(i));
  REQUIRE(many.size() == 65536 + 3);
  for (size_t i : {size_t{0}, size_t{65535}, size_t{65536}, size_t{65538}}) CHECK(many[i] == oid(i));
  many.push_back(s);
  REQUIRE(many.size() == 65536 + 4);
  CHECK(many[65537] == oid(65537));
  CHECK(many[65539] == s);
}

TEST_CASE("shards: 1, 2, 3 ranks in every mode are complete, disjoint and equal (MongoDB and JSONL)", "[db]") {
  const int64_t n = 49;  // 2 ranks: 1 padded document; 3 ranks: 2
  for (const bool jsonl : {false, true})
    for (const Shuffle mode : {Shuffle::Global, Shuffle::Stream, Shuffle::None}) {
      const recipe::DataSection d = with_documents(test_uri(), n, mode, jsonl);
      const data::Documents docs(d);
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

TEST_CASE("stream: many runs and windows, resumable, memory bounded by the window", "[db]") {
  const int64_t n = 301;
  recipe::DataSection d = with_documents(test_uri(), n, Shuffle::Stream);
  d.shuffle_buffer = 2;  // 151 per rank → 51 runs of 3 (64 at most), windows of 2 across runs
  const data::Documents docs(d);
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

TEST_CASE("order depends on (seed, epoch) only and none is sorted", "[db]") {
  for (const Shuffle mode : {Shuffle::Global, Shuffle::Stream, Shuffle::None}) {
    INFO(recipe::name(mode));
    recipe::DataSection d = with_documents(test_uri(), 60, mode);
    const data::Documents docs(d);
    const auto base = read_shard(docs, {2, 1, 1, 0, mode});
    recipe::DataSection sync = d;
    sync.prefetch = 0;
    const data::Documents other(sync);  // another process, no prefetch
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

TEST_CASE("resume at k delivers exactly the tail of the uninterrupted order", "[db]") {
  for (const Shuffle mode : {Shuffle::Global, Shuffle::Stream, Shuffle::None}) {
    const recipe::DataSection d = with_documents(test_uri(), 45, mode);
    const data::Documents docs(d);
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

// data.sources with stream: a collection of 49 (weight 2) and one of 7 (weight 1), so an epoch of
// 56 holds 37 of the first (down-sampled) and 19 of the second (2 passes and 5).
TEST_CASE("data.sources with stream: every source's share split among the ranks, passes, epochs, resume", "[db]") {
  recipe::Recipe r;
  r.data = with_documents(test_uri(), 49, Shuffle::Stream);
  std::vector<nlohmann::json> small;
  for (int64_t i = 0; i < 7; ++i) small.push_back(doc(1000 + (i * 3) % 7));
  data::Client(test_uri(), std::chrono::seconds(10)).insert_many(r.data.database, "small", small);
  r.data.collection.clear();
  r.data.shuffle_buffer = 4;
  for (const auto& [name, collection, weight] : {std::tuple{"large", "docs", 2.0}, std::tuple{"small", "small", 1.0}}) {
    recipe::DataSource& s = r.data.sources.emplace_back();
    s.name = name;
    s.collection = collection;
    s.weight = weight;
  }
  const data::Mixture mix(r, tokenizer(), data::PairTokens::Dpo, {});
  REQUIRE(mix.sources()[0].per_epoch == 37);
  REQUIRE(mix.sources()[1].per_epoch == 19);
  const auto read = [&](int world, int rank, int64_t epoch, int64_t start = 0) {
    data::ShardReader reader(mix, {world, rank, 5, epoch, Shuffle::Stream}, start);
    return read_all(reader, 3);
  };
  std::set<int64_t> large_seen;  // over epochs 0 and 1 of 1 rank
  for (int world = 1; world <= 3; ++world)
    for (int64_t epoch = 0; epoch < 2; ++epoch) {
      INFO(fmt::format("world {} epoch {}", world, epoch));
      const int64_t large_per = data::examples_per_rank(37, world), small_per = data::examples_per_rank(19, world);
      std::map<int64_t, int> large, small_counts;
      for (int rank = 0; rank < world; ++rank) {
        const std::vector<int64_t> got = read(world, rank, epoch);
        REQUIRE(static_cast<int64_t>(got.size()) == large_per + small_per);
        for (int64_t i : got) ++(i < 1000 ? large : small_counts)[i];
        CHECK(std::count_if(got.begin(), got.end(), [](int64_t i) { return i < 1000; }) == large_per);
        if (rank == world - 1)  // resumes anywhere give the tail, across windows and sources
          for (int64_t k : {int64_t{1}, int64_t{4}, int64_t{9}, static_cast<int64_t>(got.size()) - 1})
            CHECK(read(world, rank, epoch, k) == std::vector<int64_t>(got.begin() + k, got.end()));
      }
      // the down-sampled source: 37 distinct documents (and the ranks' padding: its epoch's first)
      CHECK(large.size() == 37);
      int64_t extra = 0;
      for (auto [i, c] : large) extra += c - 1;
      CHECK(extra == large_per * world - 37);
      // the up-sampled one: every document 2 or 3 times (19 = 2 passes of 7 and 5), plus padding
      REQUIRE(small_counts.size() == 7);
      int64_t total = 0;
      for (auto [i, c] : small_counts) {
        CHECK(c >= 2);
        CHECK(c <= 3 + (small_per * world - 19));
        total += c;
      }
      CHECK(total == small_per * world);
      if (world == 1)
        for (auto [i, c] : large) large_seen.insert(i);
    }
  CHECK(large_seen.size() == 49);  // the next epoch takes the next stretch: all 49 within 2 epochs
  CHECK(read(2, 1, 0) != read(2, 1, 1));
  CHECK(read(2, 1, 0) == read(2, 1, 0));
}

TEST_CASE("the reader fetches only the fields the format needs", "[db]") {
  recipe::DataSection d = with_documents(test_uri(), 3, Shuffle::Global);
  d.prompt_template = "{instruction}{input}\n";
  const data::ExampleBuilder builder(d, tokenizer());
  CHECK(builder.fields() == std::vector<std::string>{"instruction", "input", "output"});
  const data::Documents docs(d);
  const std::set<std::string> want{"_id", "instruction", "input", "output"};
  for (const auto& f : docs.fetch_found({0, 2}, builder.fields())) {
    std::set<std::string> keys;
    for (const auto& [k, v] : f.doc.items()) keys.insert(k);
    CHECK(keys == want);
  }
  for (const auto& f : docs.run(1, "", 2, builder.fields())) CHECK_FALSE(f.doc.contains("extra"));
  CHECK(docs.fetch({0})[0].contains("extra"));  // no projection: the whole document
  recipe::DataSection text = d, chat = d;
  text.format = recipe::Format::Text;
  chat.format = recipe::Format::Chat;
  CHECK(data::ExampleBuilder(text, tokenizer()).fields() == std::vector<std::string>{"text"});
  CHECK(data::ExampleBuilder(chat, tokenizer()).fields() == std::vector<std::string>{"messages"});
}

TEST_CASE("a fetch that names a document several times gets it at every place (a mixture's repeats)", "[db]") {
  recipe::DataSection d = with_documents(test_uri(), 3, Shuffle::None);
  const data::Documents docs(d);
  const std::vector<data::Found> once = docs.fetch_found({0, 1, 2}, {});
  const std::vector<data::Found> got = docs.fetch_found({2, 0, 2, 1, 0, 2}, {});
  REQUIRE(got.size() == 6);
  for (const auto& [at, position] :
       std::vector<std::pair<size_t, size_t>>{{0, 2}, {1, 0}, {2, 2}, {3, 1}, {4, 0}, {5, 2}}) {
    INFO(at);
    CHECK(got[at].id == once[position].id);
    CHECK(got[at].doc == once[position].doc);
    CHECK_FALSE(got[at].doc.is_null());
  }
}

TEST_CASE("bad documents are counted by kind, with the first ids and reasons", "[db]") {
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
    const data::Documents source(d);
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

TEST_CASE("an empty selection and an unknown collection are errors before training", "[db]") {
  for (const Shuffle mode : {Shuffle::Global, Shuffle::Stream}) {
    recipe::DataSection d = with_documents(test_uri(), 3, mode);
    d.filter = {{"n", 1000}};
    CHECK_THROWS_WITH(data::Documents(d), Catch::Contains("selects no document") && Catch::Contains("fix data.filter"));
    d.filter = nlohmann::json::object();
    d.collection = "nope";
    CHECK_THROWS_WITH(data::Documents(d), Catch::Contains("collection 'nope' does not exist"));
  }
}

// Stops the server after `before` examples, restarts it on the same port `down_s` later in the
// background, and checks the reader goes on with exactly the uninterrupted order.
void restart_mid_epoch(Shuffle mode, int prefetch) {
  OwnServer server;
  recipe::DataSection d = with_documents(server.uri, 1500, mode);
  d.prefetch = prefetch;
  d.shuffle_buffer = 100;
  d.retries = 8;
  d.retry_backoff_s = 0.25;
  d.timeout_s = 5;
  const data::Documents docs(d);
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

TEST_CASE("FerretDB restarted mid-epoch (global, prefetch): no duplicate, no gap", "[db]") {
  restart_mid_epoch(Shuffle::Global, 1);
}

TEST_CASE("FerretDB restarted mid-epoch (stream, synchronous): no duplicate, no gap", "[db]") {
  restart_mid_epoch(Shuffle::Stream, 0);
}

TEST_CASE("FerretDB gone past the retry budget: one DataUnavailable naming the server, no hang", "[db]") {
  OwnServer server;
  recipe::DataSection d = with_documents(server.uri, 2000, Shuffle::Global);
  d.retries = 2;
  d.retry_backoff_s = 0.2;
  d.prefetch = 1;
  d.timeout_s = 2;
  const data::Documents docs(d);
  const data::ExampleBuilder builder(d, tokenizer());
  {  // destroyed in the middle of a backoff: returns at once
    recipe::DataSection patient = d;
    patient.retries = 10;
    patient.retry_backoff_s = 5;
    const data::Documents slow(patient);
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
  } catch (const data::DataUnavailable& e) {  // not a plain Error: the trainer tells them apart
    message = e.what();
  }
  CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 20.0);
  CHECK_THAT(message, Catch::StartsWith("lost MongoDB at " + server.uri + ": 3 attempt(s) over 0.6 s failed") &&
                          Catch::Contains("raise data.retries (2) / data.retry_backoff_s (0.2)"));
  CHECK(message.find('\n') == std::string::npos);
}

// Reads micro-batches until one throws DataUnavailable; returns its message ("" if none did).
std::string until_unavailable(data::MicroBatches& batches) {
  try {
    while (!batches.next().empty()) {
    }
  } catch (const data::DataUnavailable& e) {
    return e.what();
  }
  return "";
}

TEST_CASE("FerretDB gone: DataUnavailable reaches MicroBatches::next() from the prefetch thread and without it",
          "[db]") {
  OwnServer server;
  recipe::DataSection d = with_documents(server.uri, 2000, Shuffle::Global);
  d.retries = 1;
  d.retry_backoff_s = 0.1;
  d.timeout_s = 2;
  const data::ExampleBuilder builder(d, tokenizer());
  for (const int prefetch : {2, 0}) {
    INFO("prefetch " << prefetch);
    recipe::DataSection dp = d;
    dp.prefetch = prefetch;
    const data::Documents docs(dp);
    data::MicroBatches batches(docs, builder, {1, 0, 42, 0, Shuffle::Global}, {8, 1, 1, 42, 0}, 0);
    CHECK(batches.next().size() == 8);
    server.stop();
    CHECK_THAT(until_unavailable(batches), Catch::StartsWith("lost MongoDB at " + server.uri + ": 2 attempt(s)"));
    REQUIRE(server.start());
  }
}

TEST_CASE("a stop request while waiting to retry: DataUnavailable within 0.5 s, through MicroBatches::next()", "[db]") {
  OwnServer server;
  recipe::DataSection d = with_documents(server.uri, 2000, Shuffle::Global);
  d.retries = 10;
  d.retry_backoff_s = 20;
  d.timeout_s = 2;  // minutes of patience without the stop
  const data::ExampleBuilder builder(d, tokenizer());
  for (const int prefetch : {1, 0}) {
    INFO("prefetch " << prefetch);
    recipe::DataSection dp = d;
    dp.prefetch = prefetch;
    const data::Documents docs(dp);
    std::atomic<bool> stop{false};
    data::MicroBatches batches(docs, builder, {1, 0, 42, 0, Shuffle::Global, &stop}, {8, 1, 1, 42, 0}, 0);
    CHECK(batches.next().size() == 8);
    server.stop();
    Clock::time_point set_at;
    std::thread stopper([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));  // well inside the first 20 s backoff
      set_at = Clock::now();
      stop = true;  // as a signal handler would: no notification
    });
    const std::string message = until_unavailable(batches);
    const auto caught = Clock::now();
    stopper.join();
    INFO(message);
    CHECK(caught > set_at);
    CHECK(std::chrono::duration<double>(caught - set_at).count() < 0.5);
    CHECK_THAT(message, Catch::StartsWith("lost MongoDB at " + server.uri + ": stopped while waiting to retry"));
    CHECK(message.find('\n') == std::string::npos);
    REQUIRE(server.start());
  }
}

// A port on 127.0.0.1 that nothing listens on, or (silent) one whose connections are accepted by
// the kernel and never answered — what a firewalled or wrong host looks like, without leaving
// the loopback interface.
struct Port {
  std::unique_ptr<test::SilentPort> silent_port;
  int port;
  explicit Port(bool silent)
      : silent_port(silent ? std::make_unique<test::SilentPort>() : nullptr),
        port(silent ? silent_port->port : test::free_port()) {}
};

TEST_CASE("an unreachable server fails within data.timeout_s with one redacted line") {
  for (const bool silent : {false, true}) {
    const Port port(silent);
    recipe::DataSection d =
        config(fmt::format("mongodb://alice:s3cr3t-pw@127.0.0.1:{}/", port.port), "db", Shuffle::Global);
    d.timeout_s = 2;
    INFO((silent ? "silent port " : "closed port ") << port.port);
    const auto t0 = Clock::now();
    std::string message;
    try {
      data::Documents docs(d);
    } catch (const data::ConnectionError& e) {
      message = e.what();
    }
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    INFO(message);
    CHECK(s < 2 + 1.5);
    if (silent) CHECK(s > 1.5);  // it did wait for the server, as long as it was told
    CHECK_THAT(message, Catch::StartsWith(fmt::format("cannot reach MongoDB at mongodb://alice:****@127.0.0.1:{}/ "
                                                      "within 2 s (data.timeout_s): ",
                                                      port.port)) &&
                            Catch::EndsWith("start the server or fix data.uri"));
    CHECK_THAT(message, !Catch::Contains("s3cr3t"));
    CHECK(message.find('\n') == std::string::npos);
    // The URI's own serverSelectionTimeoutMS / connectTimeoutMS win over data.timeout_s.
    d.uri = fmt::format("mongodb://127.0.0.1:{}/?serverSelectionTimeoutMS=700&connectTimeoutMS=700", port.port);
    d.timeout_s = 30;
    const auto t1 = Clock::now();
    CHECK_THROWS_WITH(data::Documents(d), Catch::Contains("within 0.7 s (serverSelectionTimeoutMS in the URI)"));
    CHECK(std::chrono::duration<double>(Clock::now() - t1).count() < 5);
  }
}

TEST_CASE("a filter the server rejects names data.filter, in training and in check_selection (--dry-run)", "[db]") {
  recipe::DataSection d = with_documents(test_uri(), 5, Shuffle::Global);
  CHECK(data::check_selection(d).count == 5);
  CHECK(data::check_selection(d).warning.empty());
  d.filter = {{"n", {{"$gte", 3}}}};
  CHECK(data::check_selection(d).count == 2);
  d.limit = 1;
  CHECK(data::check_selection(d).count == 1);
  d.limit.reset();
  d.filter = {{"$foo", 1}};
  for (const Shuffle mode : {Shuffle::Global, Shuffle::Stream}) {
    d.shuffle = mode;
    CHECK_THROWS_WITH(data::Documents(d), Catch::StartsWith("data.filter {\"$foo\":1} was rejected by MongoDB at " +
                                                            test_uri() + ": unknown top level operator: $foo") &&
                                              Catch::EndsWith("fix data.filter"));
  }
  CHECK_THROWS_WITH(data::check_selection(d), Catch::StartsWith("data.filter {\"$foo\":1} was rejected by MongoDB at"));
  d.filter = {{"n", 1000}};
  CHECK_THAT(data::check_selection(d).warning, Catch::Contains("selects no document"));
  d.uri = "mongodb://127.0.0.1:1/", d.timeout_s = 1;  // nothing listens there: a warning, not an error
  const data::Selection unreachable = data::check_selection(d);
  CHECK(unreachable.count == 0);
  CHECK_THAT(unreachable.warning, Catch::StartsWith("could not check data.filter: cannot reach MongoDB at "
                                                    "mongodb://127.0.0.1:1/ within 1 s (data.timeout_s)"));
  d.uri.clear();
  CHECK_THAT(data::check_selection(d).warning, Catch::Contains("data.uri is empty"));
}

TEST_CASE("refused credentials are told apart from an unreachable server (FerretDB with authentication)", "[db]") {
  OwnServer server(
      "FERRETDB_TEST_ENABLE_NEW_AUTH=true FERRETDB_SETUP_USERNAME=alice FERRETDB_SETUP_PASSWORD=s3cr3t-pw "
      "FERRETDB_SETUP_DATABASE=admin");
  REQUIRE(server.uri.rfind("mongodb://127.0.0.1:", 0) == 0);
  const std::string host = server.uri.substr(10);  // 127.0.0.1:PORT/
  recipe::DataSection d =
      config(fmt::format("mongodb://alice:s3cr3t-pw@{}?authSource=admin", host), "db", Shuffle::Global);
  data::Client(d.uri, std::chrono::seconds(5)).insert_many(d.database, "docs", {doc(1), doc(2)});
  CHECK(data::Documents(d).size() == 2);  // the right password
  for (const std::string bad : {"alice:wrong-pw@", "bob:s3cr3t-pw@"}) {
    d.uri = fmt::format("mongodb://{}{}?authSource=admin", bad, host);
    const auto t0 = Clock::now();
    std::string message;
    try {
      data::Documents docs(d);
    } catch (const data::ConnectionError& e) {
      FAIL("refused credentials reported as unreachable: " << e.what());
    } catch (const Error& e) {
      message = e.what();
    }
    INFO(message);
    CHECK(std::chrono::duration<double>(Clock::now() - t0).count() < 5);  // not retried, not waited for
    CHECK_THAT(message,
               Catch::StartsWith(fmt::format("MongoDB at mongodb://{}:****@{}", bad.substr(0, bad.find(':')), host)) &&
                   Catch::Contains("refused the credentials: check the user, password and authSource in "
                                   "data.uri"));
    CHECK_THAT(message, !Catch::Contains("s3cr3t") && !Catch::Contains("wrong-pw"));
  }
  d.uri = server.uri;  // none at all
  CHECK_THROWS_WITH(data::Documents(d), Catch::StartsWith("MongoDB at " + server.uri +
                                                          " requires authentication: put "
                                                          "the user, password and authSource in data.uri"));
  // The driver's own error codes, as the messages above were classified.
  CHECK(data::classify(MONGOC_ERROR_CLIENT, MONGOC_ERROR_CLIENT_AUTHENTICATE) == data::Failure::Credentials);
  CHECK(data::classify(MONGOC_ERROR_SERVER, 18) == data::Failure::Credentials);
  CHECK(data::classify(MONGOC_ERROR_SERVER_SELECTION, MONGOC_ERROR_SERVER_SELECTION_FAILURE) ==
        data::Failure::Unreachable);
  CHECK(data::classify(MONGOC_ERROR_SERVER, 2) == data::Failure::Other);
}

// {_id: 7, <field>: <bytes>, output: "ok"} as BSON, the way the server sends it.
std::vector<uint8_t> wire_document(const std::string& field, const std::string& bytes) {
  bson_t* b = bson_new();
  BSON_APPEND_INT32(b, "_id", 7);
  bson_append_utf8(b, field.c_str(), -1, bytes.data(), static_cast<int>(bytes.size()));  // libbson does not validate
  BSON_APPEND_UTF8(b, "output", "ok");
  std::vector<uint8_t> out(bson_get_data(b), bson_get_data(b) + b->len);
  bson_destroy(b);
  return out;
}

TEST_CASE("a MongoDB string that is not UTF-8 is a bad document naming its _id and field, as in JSONL") {
  recipe::DataSection d = config("", "db", Shuffle::Global);
  const data::ExampleBuilder builder(d, tokenizer());
  // Bytes no JSON text can hold; libbson turns some into other characters, drops others.
  for (const std::string bad :
       {"bad \xff\xfe", "cont \xc3\x28", "surrogate \xed\xa0\x80", "overlong \xc1\xbf", "cut \xe2\x82"}) {
    INFO(bad);
    const std::vector<uint8_t> wire = wire_document("instruction", bad);
    const data::Found f = data::decode_document(wire.data(), wire.size());
    CHECK(data::relaxed_id(f.id) == "7");
    CHECK(f.invalid_utf8 == "instruction");
    const data::Built b = data::build_found(builder, f);
    const auto* r = std::get_if<data::Rejection>(&b);
    REQUIRE(r);
    CHECK(r->kind == data::Rejection::BadDocument);  // counted; data.bad_documents: fail stops on it
    CHECK(r->document == "7");
    CHECK(r->reason == "field 'instruction' is not valid UTF-8");  // the words JSONL documents get
  }
  // Good UTF-8 (U+FFFD included: FerretDB stores bad bytes as it) is trained as it is.
  const std::string good = "h\xc3\xa9llo \xef\xbf\xbd \xf0\x9f\x98\x80";
  const std::vector<uint8_t> wire = wire_document("instruction", good);
  const data::Found f = data::decode_document(wire.data(), wire.size());
  CHECK(f.invalid_utf8.empty());
  CHECK(f.doc["instruction"] == good);
  CHECK(std::holds_alternative<data::Example>(data::build_found(builder, f)));
  // Nested strings and keys are named by their dotted path; a bad key's bytes are escaped.
  bson_t* chat = bson_new();
  BSON_APPEND_INT32(chat, "_id", 8);
  bson_t list, m0, m1;
  BSON_APPEND_ARRAY_BEGIN(chat, "messages", &list);
  BSON_APPEND_DOCUMENT_BEGIN(&list, "0", &m0);
  BSON_APPEND_UTF8(&m0, "content", "fine");
  bson_append_document_end(&list, &m0);
  BSON_APPEND_DOCUMENT_BEGIN(&list, "1", &m1);
  bson_append_utf8(&m1, "content", -1, "\xc3\x28", 2);
  bson_append_document_end(&list, &m1);
  bson_append_array_end(chat, &list);
  CHECK(data::decode_document(bson_get_data(chat), chat->len).invalid_utf8 == "messages.1.content");
  bson_destroy(chat);
  const std::vector<uint8_t> key = wire_document("in\xffstruction", "fine");
  CHECK(data::decode_document(key.data(), key.size()).invalid_utf8 == "in\\xffstruction");
}
