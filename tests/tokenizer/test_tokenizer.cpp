// Unit tests of the tokenizer: error messages for bad input, BPE details on a toy vocabulary,
// and the API on the real fixtures (scripts/fetch-tokenizers) when they are present.
#include <catch2/catch.hpp>

#include <unistd.h>
#include <filesystem>
#include <fstream>
#include <string>

#include "tokenizer/regex.hpp"
#include "tokenizer/tokenizer.hpp"
#include "util/error.hpp"

namespace fs = std::filesystem;
using lorarun::tok::Tokenizer;

namespace {

// A fresh directory under the system temp dir holding the given files.
struct TempModel {
  fs::path dir;
  explicit TempModel(std::initializer_list<std::pair<const char*, std::string>> files) {
    static int counter = 0;
    dir = fs::temp_directory_path() / ("lorarun-tok-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::create_directories(dir);
    for (const auto& [name, text] : files) std::ofstream(dir / name) << text;
  }
  ~TempModel() { fs::remove_all(dir); }
};

// A toy BPE: merges in both file formats, byte fallback and a fused unk token.
std::string toy_json(const std::string& pre_tokenizer = "null", const std::string& model_extra = "") {
  return R"({"version": "1.0", "added_tokens": [
      {"id": 9, "content": "<s>", "special": true, "normalized": false,
       "single_word": false, "lstrip": false, "rstrip": false}],
    "normalizer": null, "pre_tokenizer": )" +
         pre_tokenizer + R"(,
    "post_processor": {"type": "TemplateProcessing",
      "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
      "pair": [], "special_tokens": {"<s>": {"id": "<s>", "ids": [9], "tokens": ["<s>"]}}},
    "decoder": {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, {"type": "Fuse"}]},
    "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": true, "byte_fallback": false,)" +
         model_extra + R"(
      "vocab": {"<unk>": 0, "a": 1, "b": 2, "c": 3, "ab": 4, "bc": 5, "abc": 6, "<0x41>": 7, "<s>": 9},
      "merges": ["b c", ["a", "b"], "ab c"]}})";
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const lorarun::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string fixture(const char* name) { return std::string(LORARUN_TOKENIZER_FIXTURES) + "/" + name; }

// A tokenizer fixture scripts/setup fetches (scripts/fetch-tokenizers): a test fails without it.
bool have_fixture(const char* name) {
  if (!fs::exists(fixture(name) + "/tokenizer.json"))
    FAIL("fixture " << name << " missing: run scripts/setup (scripts/fetch-tokenizers)");
  return true;
}

}  // namespace

TEST_CASE("a missing model directory is a one-line error naming it") {
  auto msg = error_of([] { Tokenizer::from_dir("/nonexistent/model"); });
  CHECK_THAT(msg, Catch::Contains("'/nonexistent/model' does not exist"));
  CHECK(msg.find('\n') == std::string::npos);
}

TEST_CASE("a directory without tokenizer.json says so") {
  TempModel m({{"config.json", "{}"}});
  CHECK_THAT(error_of([&] { Tokenizer::from_dir(m.dir); }), Catch::Contains("tokenizer.json: not found"));
}

TEST_CASE("a truncated tokenizer.json is reported as invalid JSON") {
  std::string json = toy_json();
  TempModel m({{"tokenizer.json", json.substr(0, json.size() / 2)}});
  CHECK_THAT(error_of([&] { Tokenizer::from_dir(m.dir); }), Catch::Contains("not valid JSON at byte"));
}

TEST_CASE("an unsupported pre-tokenizer type is named with the supported ones") {
  TempModel m({{"tokenizer.json", toy_json(R"({"type": "BertPreTokenizer"})")}});
  CHECK(error_of([&] { Tokenizer::from_dir(m.dir); }) ==
        "tokenizer.json: pre_tokenizer type 'BertPreTokenizer' is not supported "
        "(supported: Sequence, ByteLevel, Split, Metaspace, Digits)");
}

TEST_CASE("unsupported models, wrong types, bad merges and bad regexes are errors") {
  SECTION("model type") {
    std::string json = toy_json();
    json.replace(json.find("\"BPE\""), 5, "\"Unigram\"");
    TempModel m({{"tokenizer.json", json}});
    CHECK_THAT(error_of([&] { Tokenizer::from_dir(m.dir); }),
               Catch::Contains("model type 'Unigram' is not supported (supported: BPE)"));
  }
  SECTION("wrong JSON type") {
    std::string json = toy_json();
    json.replace(json.find("\"fuse_unk\": true"), 16, "\"fuse_unk\": \"yes\"");
    TempModel m({{"tokenizer.json", json}});
    CHECK_THAT(error_of([&] { Tokenizer::from_dir(m.dir); }), Catch::Contains("malformed"));
  }
  SECTION("merge of unknown tokens") {
    std::string json = toy_json();
    json.replace(json.find("\"b c\""), 5, "\"b z\"");
    TempModel m({{"tokenizer.json", json}});
    CHECK_THAT(error_of([&] { Tokenizer::from_dir(m.dir); }), Catch::Contains("missing from model.vocab"));
  }
  SECTION("regex that does not compile") {
    TempModel m({{"tokenizer.json", toy_json(R"({"type": "Split", "pattern": {"Regex": "(a"},
                                               "behavior": "Isolated", "invert": false})")}});
    CHECK_THAT(error_of([&] { Tokenizer::from_dir(m.dir); }), Catch::Contains("cannot compile regex '(a'"));
  }
  SECTION("malformed tokenizer_config.json") {
    TempModel m({{"tokenizer.json", toy_json()}, {"tokenizer_config.json", R"({"add_bos_token": 3})"}});
    CHECK_THAT(error_of([&] { Tokenizer::from_dir(m.dir); }), Catch::Contains("tokenizer_config.json: malformed"));
  }
}

TEST_CASE("BPE applies merges by rank, fuses unknowns and adds template tokens") {
  TempModel m({{"tokenizer.json", toy_json()}});
  Tokenizer t = Tokenizer::from_dir(m.dir);
  // "b c" has rank 0, so "abc" becomes a + bc, not ab + c.
  CHECK(t.encode("abc", false) == std::vector<int32_t>{1, 5});
  CHECK(t.encode("ab", true) == std::vector<int32_t>{9, 4});
  CHECK(t.encode("xyza", false) == std::vector<int32_t>{0, 1});  // x, y, z fuse into one <unk>
  CHECK(t.encode("a<s>b", false) == std::vector<int32_t>{1, 9, 2});
  CHECK(t.encode("", true) == std::vector<int32_t>{9});
  CHECK(t.decode(std::vector<int32_t>{9, 1, 7, 5}, true) == "aAbc");
  CHECK(t.vocab_size() == 9);
  CHECK(t.token_to_id("<s>") == 9);
  CHECK(t.id_to_token(5) == "bc");
  CHECK_FALSE(t.bos_id());
  CHECK_THAT(error_of([&] { t.encode("\xff", true); }), Catch::Contains("not valid UTF-8"));
}

TEST_CASE("regexes are rewritten to Oniguruma's character sets") {
  using lorarun::tok::Regex;
  CHECK(Regex::translate("a\\sb").find("\\x{3000}") != std::string::npos);
  CHECK(Regex::translate("[^\\s]").find("[^\\t") == 0);
  CHECK(Regex::translate("\\p{Nd}+") != "\\p{Nd}+");  // Unicode 15/16 digits PCRE2 lacks
  std::vector<std::pair<size_t, size_t>> found;
  Regex("\\s+").find_all("a \xe1\xa0\x8e b", found);  // U+180E is not White_Space
  CHECK(found == std::vector<std::pair<size_t, size_t>>{{1, 2}, {5, 6}});
}

TEST_CASE("the real tokenizers expose their special tokens") {
  if (have_fixture("llama2")) {
    Tokenizer t = Tokenizer::from_dir(fixture("llama2"));
    CHECK(t.bos_id() == 1);
    CHECK(t.eos_id() == 2);
    CHECK(t.add_bos_token());
    CHECK_FALSE(t.add_eos_token());
    CHECK(t.encode("Hello", true).front() == 1);
  }
  if (have_fixture("llama3")) {
    Tokenizer t = Tokenizer::from_dir(fixture("llama3"));
    CHECK(t.vocab_size() == 128256);
    CHECK(t.token_to_id("<|begin_of_text|>") == 128000);
  }
  if (have_fixture("gpt2")) {
    Tokenizer t = Tokenizer::from_dir(fixture("gpt2"));
    CHECK(t.eos_id() == 50256);
    CHECK(t.vocab_size() == 50257);
    CHECK(t.decode(t.encode("Hello world<|endoftext|>"), true) == "Hello world");
  }
}

TEST_CASE("encode_batch on several threads equals encode") {
  if (!have_fixture("qwen3")) return;
  Tokenizer t = Tokenizer::from_dir(fixture("qwen3"));
  std::vector<std::string> texts;
  for (int i = 0; i < 400; ++i)
    texts.push_back("Sample " + std::to_string(i * 7919) + " — naïve café 東京 😀 " + std::string(i % 13, 'x'));
  auto batch = t.encode_batch(texts, true, 4);
  REQUIRE(batch.size() == texts.size());
  for (size_t i = 0; i < texts.size(); ++i) CHECK(batch[i] == t.encode(texts[i]));
}

// Inputs found by fuzzing (scripts/fuzz, harness fuzz/tokenizer_json_fuzz.cpp): each was a
// crash, undefined behaviour, a foreign exception or a multi-GB allocation before the fix.
TEST_CASE("fuzzed tokenizer files are one-line errors, not crashes or huge allocations") {
  const std::string base = toy_json();
  // The error of loading the toy tokenizer.json with `from` replaced by `to`, plus `more` files.
  auto load_error = [&](const std::string& from, const std::string& to,
                        std::initializer_list<std::pair<const char*, std::string>> more = {}) {
    std::string json = base;
    REQUIRE(json.find(from) != std::string::npos);
    json.replace(json.find(from), from.size(), to);
    TempModel m({{"tokenizer.json", json}});
    for (const auto& [name, text] : more) std::ofstream(m.dir / name) << text;
    std::string msg = error_of([&] { Tokenizer::from_dir(m.dir); });
    CHECK(msg.find('\n') == std::string::npos);
    return msg;
  };
  const std::string vocab_a = R"("a": 1,)";
  // A vocabulary id of 288148946 made a 2.3 GB id -> token table.
  CHECK_THAT(load_error(vocab_a, R"("a": 288148946,)"),
             Catch::Contains("model.vocab id of 'a' must be an integer in [0, 16777215], got 288148946"));
  CHECK_THAT(load_error(vocab_a, R"("a": 1e20,)"), Catch::Contains("got 1e+20"));             // UB cast
  CHECK_THAT(load_error(vocab_a, R"("a": 4294967297,)"), Catch::Contains("got 4294967297"));  // wrapped to 1
  // A number beyond double escaped as nlohmann::json::out_of_range.
  CHECK_THAT(load_error(vocab_a, R"("a": 1e500,)"), Catch::Contains("not valid JSON"));
  CHECK_THAT(load_error(vocab_a, vocab_a, {{"tokenizer_config.json", R"({"bos_token": 1e999})"}}),
             Catch::Contains("tokenizer_config.json: not valid JSON"));
  // Padding to 10^11 ids, or to a multiple of 2^64 - 1 (std::length_error), in every encode.
  const std::string pre = R"("pre_tokenizer": null,)";
  CHECK_THAT(load_error(pre, pre + R"("padding": {"strategy": {"Fixed": 100000000000}},)"),
             Catch::Contains("padding Fixed length must be an integer in [0, 4194304]"));
  CHECK_THAT(
      load_error(pre, pre + R"("padding": {"strategy": "BatchLongest", "pad_to_multiple_of": 18446744073709551615},)"),
      Catch::Contains("padding.pad_to_multiple_of must be an integer"));
  // Floats out of the integer's range were undefined behaviour (UBSan: float-cast-overflow).
  CHECK_THAT(load_error(pre, pre + R"("padding": {"strategy": "BatchLongest", "pad_id": 1e30},)"),
             Catch::Contains("padding.pad_id must be an integer"));
  CHECK_THAT(load_error(pre, pre + R"("truncation": {"max_length": -1.5},)"),
             Catch::Contains("truncation.max_length must be an integer"));
  CHECK_THAT(load_error(R"("ids": [9])", R"("ids": [1e30])"),
             Catch::Contains("TemplateProcessing special token id must be an integer"));
  CHECK_THAT(load_error(R"({"type": "Fuse"})", R"({"type": "Strip", "content": " ", "start": 1e30, "stop": 0})"),
             Catch::Contains("Strip decoder start must be an integer"));
  // Sequences nested 200000 deep overflowed the stack while the stages were built.
  std::string deep;
  for (int i = 0; i < 100000; ++i) deep += R"({"type": "Sequence", "normalizers": [)";
  deep += R"({"type": "NFC"})";
  for (int i = 0; i < 100000; ++i) deep += "]}";
  CHECK_THAT(load_error(R"("normalizer": null)", R"("normalizer": )" + deep),
             Catch::Contains("normalizer Sequences are nested more than 64 deep"));
}

TEST_CASE("a GGUF vocabulary the tokenizer cannot build is a one-line error naming the file") {
  using lorarun::tok::GgufVocab;
  GgufVocab v;
  v.source = "m.gguf";
  v.model = "gpt2";
  v.tokens = {"a", "b", "ab", "<|endoftext|>"};
  v.merges = {"a b"};
  v.token_types = {1, 1, 1, 3};
  const Tokenizer ok = Tokenizer::from_files(lorarun::tok::hf_tokenizer_files(v), v.source);
  CHECK(ok.encode("abab<|endoftext|>") == std::vector<int32_t>{2, 2, 3});

  GgufVocab bert = v;
  bert.model = "bert";
  CHECK_THAT(error_of([&] { lorarun::tok::hf_tokenizer_files(bert); }),
             Catch::Contains("m.gguf: tokenizer.ggml.model 'bert' is not supported; supported: gpt2"));
  GgufVocab short_types = v;
  short_types.token_types.pop_back();
  CHECK_THAT(error_of([&] { lorarun::tok::hf_tokenizer_files(short_types); }),
             Catch::Contains("token_type has 3 entries for 4 tokens"));
  GgufVocab far_bos = v;
  far_bos.bos = 4;
  CHECK_THAT(error_of([&] { lorarun::tok::hf_tokenizer_files(far_bos); }),
             Catch::Contains("tokenizer.ggml.bos_token_id is 4, outside the 4 tokens"));
  GgufVocab spm = v;
  spm.model = "llama";
  spm.merges.clear();
  CHECK_THAT(error_of([&] { lorarun::tok::hf_tokenizer_files(spm); }),
             Catch::Contains("tokenizer.ggml.scores has 0 entries for 4 tokens"));
}
