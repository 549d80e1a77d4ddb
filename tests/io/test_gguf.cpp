// GGUF files (lib/io/gguf.hpp) against llama.cpp's own reader, gguf-py (tests/reference/gguf_check.py):
// every key, tensor and dequantised value of the real SmolLM2-135M-Instruct file and of a file with
// every value type and every tensor type we dequantise; and what a truncated or hostile file gets:
// one line naming the file and the problem, never a crash or a huge allocation. The writer
// (lib/io/gguf_write.hpp): gguf-py's files rewritten byte for byte, and quantisation as gguf-py's.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>

#include "io/gguf.hpp"
#include "io/gguf_write.hpp"
#include "io/sha256.hpp"
#include "model/gguf_weights.hpp"
#include "support/oracle.hpp"
#include "support/process.hpp"
#include "util/error.hpp"

using namespace lorarun;
using io::GgmlType;
using io::GgufFile;
using io::GgufType;
using nlohmann::json;

namespace {

const std::string kSmolLM2 =
    std::string(LORARUN_SOURCE_DIR) + "/.fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

test::Oracle gguf_check(const std::string& mode, const std::string& path) {
  return test::oracle(fmt::format("'{}' '{}/tests/reference/gguf_check.py' {} '{}' 2>&1", LORARUN_PYTHON,
                                  LORARUN_SOURCE_DIR, mode, path));
}

void require_smollm2() {
  if (!std::filesystem::exists(kSmolLM2)) FAIL(kSmolLM2 << " is missing: run scripts/setup (or scripts/fetch-models)");
}

// A metadata value as gguf-py's contents() gives it in JSON.
json to_json(const io::GgufValue& v) {
  const bool bools = (v.type == GgufType::Array ? v.item_type : v.type) == GgufType::Bool;
  return std::visit(
      [&](const auto& x) -> json {
        using T = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<T, uint64_t>)
          return bools ? json(x != 0) : json(x);
        else if constexpr (std::is_same_v<T, std::vector<uint64_t>>) {
          json a = json::array();
          for (uint64_t u : x) a.push_back(bools ? json(u != 0) : json(u));
          return a;
        } else if constexpr (std::is_same_v<T, std::vector<io::GgufValue>>) {
          json a = json::array();
          for (const auto& item : x) a.push_back(to_json(item));
          return a;
        } else
          return json(x);
      },
      v.data);
}

// "" when equal; otherwise where they first differ (arrays of 49,152 tokens are not printed whole).
std::string difference(const json& ours, const json& theirs) {
  if (ours == theirs) return "";
  if (ours.is_array() && theirs.is_array()) {
    if (ours.size() != theirs.size()) return fmt::format("{} items, gguf-py {}", ours.size(), theirs.size());
    for (size_t i = 0; i < ours.size(); ++i)
      if (ours[i] != theirs[i]) return fmt::format("item {}: {} vs gguf-py {}", i, ours[i].dump(), theirs[i].dump());
  }
  return fmt::format("{} vs gguf-py {}", ours.dump().substr(0, 200), theirs.dump().substr(0, 200));
}

float as_float(const json& v) {  // the oracle writes NaN and infinities as strings
  return v.is_string() ? static_cast<float>(std::stod(v.get<std::string>())) : v.get<float>();
}

// What gguf_check.py's digest() computes: sha256 of the float32 bits, every NaN as 0x7fc00000.
std::string digest(const at::Tensor& t) {
  const float* p = t.data_ptr<float>();
  io::Sha256 h;
  std::vector<uint32_t> bits(1 << 16);
  for (int64_t from = 0; from < t.numel(); from += static_cast<int64_t>(bits.size())) {
    const size_t n = std::min<int64_t>(bits.size(), t.numel() - from);
    std::memcpy(bits.data(), p + from, n * 4);
    for (size_t i = 0; i < n; ++i)
      if (std::isnan(p[from + i])) bits[i] = 0x7fc00000u;
    h.update(bits.data(), n * 4);
  }
  return h.hex();
}

struct TypeTally {
  int tensors = 0, identical = 0;
  int64_t values = 0;
  double max_sample_diff = 0;
};

// Checks `file` against gguf-py's report of it: header, keys in order with their types and
// values, tensors with their types, dims, offsets, sizes, and dequantised values (digest of all
// of them, exact values at the sampled indices). Returns a tally per tensor type.
std::map<std::string, TypeTally> check_against(const GgufFile& file, const json& ref) {
  CHECK(file.version() == ref.at("version").get<uint32_t>());
  CHECK(file.alignment() == ref.at("alignment").get<size_t>());
  CHECK(file.data_offset() == ref.at("data_offset").get<size_t>());

  const json& keys = ref.at("keys");
  REQUIRE(file.metadata().size() == keys.size());
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto& [key, value] = file.metadata()[i];
    INFO("key " << i << ": " << key);
    CHECK(key == keys[i].at("key").get<std::string>());
    CHECK(io::gguf_type_name(value.type) == keys[i].at("type").get<std::string>());
    if (value.type == GgufType::Array)
      CHECK(io::gguf_type_name(value.item_type) == keys[i].at("item_type").get<std::string>());
    if (!keys[i].at("value").is_null()) CHECK(difference(to_json(value), keys[i].at("value")) == "");
  }

  std::map<std::string, TypeTally> tally;
  const json& tensors = ref.at("tensors");
  REQUIRE(file.tensors().size() == tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const io::GgufTensorInfo& t = file.tensors()[i];
    const json& r = tensors[i];
    INFO("tensor " << i << ": " << t.name << " (" << io::ggml_type_name(t.type) << ")");
    CHECK(t.name == r.at("name").get<std::string>());
    CHECK(io::ggml_type_name(t.type) == r.at("type").get<std::string>());
    CHECK(t.dims == r.at("dims").get<std::vector<int64_t>>());
    CHECK(t.torch_shape() == r.at("torch_shape").get<std::vector<int64_t>>());
    CHECK(t.offset == r.at("offset").get<size_t>());
    CHECK(t.nbytes == r.at("nbytes").get<size_t>());
    if (!io::can_dequantize(t.type)) continue;

    const at::Tensor values = model::dequantize(file, t);
    CHECK(values.sizes().vec() == t.torch_shape());
    TypeTally& k = tally[io::ggml_type_name(t.type)];
    ++k.tensors;
    k.values += values.numel();
    const bool identical = digest(values) == r.at("sha256").get<std::string>();
    k.identical += identical;
    CHECK(identical);
    const float* p = values.data_ptr<float>();
    for (const json& s : r.at("samples")) {
      const auto j = s[0].get<int64_t>();
      const float theirs = as_float(s[1]);
      INFO("value " << j << ": " << p[j] << " vs gguf-py " << theirs);
      if (std::isnan(theirs)) {
        CHECK(std::isnan(p[j]));
      } else {
        CHECK(std::memcmp(&p[j], &theirs, 4) == 0);  // bit for bit: +0 and -0 differ
        k.max_sample_diff = std::max<double>(k.max_sample_diff, std::abs(double(p[j]) - double(theirs)));
      }
    }
  }
  return tally;
}

void print_tally(const std::string& what, const std::map<std::string, TypeTally>& tally) {
  for (const auto& [type, k] : tally)
    fmt::print(
        "gguf: {} {}: {}/{} tensors ({} values) bit-identical to gguf-py's dequantize; "
        "max |diff| at the sampled values {}\n",
        what, type, k.identical, k.tensors, k.values, k.max_sample_diff);
}

// Little-endian GGUF bytes, for files gguf-py will not write.
struct Bytes {
  std::string s;
  template <typename T>
  Bytes& put(T v) {
    s.append(reinterpret_cast<const char*>(&v), sizeof v);
    return *this;
  }
  Bytes& u32(uint32_t v) { return put(v); }
  Bytes& u64(uint64_t v) { return put(v); }
  Bytes& str(const std::string& v) {
    u64(v.size());
    s += v;
    return *this;
  }
  Bytes& header(uint64_t n_tensors, uint64_t n_keys, uint32_t version = 3) {
    s += "GGUF";
    return u32(version).u64(n_tensors).u64(n_keys);
  }
  Bytes& key_u32(const std::string& k, uint32_t v) { return str(k).u32(4).u32(v); }
  Bytes& key_strings(const std::string& k, const std::vector<std::string>& v) {
    str(k).u32(9).u32(8).u64(v.size());
    for (const auto& x : v) str(x);
    return *this;
  }
  Bytes& tensor(const std::string& name, const std::vector<uint64_t>& dims, uint32_t type, uint64_t offset) {
    str(name).u32(static_cast<uint32_t>(dims.size()));
    for (uint64_t d : dims) u64(d);
    return u32(type).u64(offset);
  }
  Bytes& pad(size_t align) {
    s.append((align - s.size() % align) % align, '\0');
    return *this;
  }
};

// A small valid file: two keys, an F32 tensor w = [1, 2, 3, 4] and a Q8_0 tensor q of shape
// [2, 32] (scale 0.5, q = -16..15 in each row). `q_offset` replaces q's offset.
std::string tiny(uint64_t q_offset = 32) {
  Bytes b;
  b.header(2, 2).key_u32("general.alignment", 32).key_strings("tokenizer.ggml.tokens", {"a", "bc"});
  b.tensor("w", {4}, 0, 0).tensor("q", {32, 2}, 8, q_offset).pad(32);
  for (float x : {1.f, 2.f, 3.f, 4.f}) b.put(x);
  b.pad(32);
  for (int row = 0; row < 2; ++row) {
    b.put(uint16_t{0x3800});  // fp16 0.5
    for (int j = 0; j < 32; ++j) b.put(static_cast<int8_t>(j - 16));
  }
  return b.s;
}

std::string write(const std::string& dir, const std::string& name, const std::string& bytes) {
  const std::string path = dir + "/" + name;
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

// The lorarun::Error that opening `path` (and dequantising every tensor) gives, or "" when it
// reads; any other exception escapes and fails the test.
std::string error_of(const std::string& path) {
  try {
    GgufFile f(path);
    for (const auto& t : f.tensors()) {
      std::vector<float> out(t.numel());
      if (io::can_dequantize(t.type)) io::dequantize(f, t, out);
    }
    return "";
  } catch (const Error& e) {
    return e.what();
  }
}

// `bytes` as a file must be refused with one line naming the file and containing `what`.
void check_refused(const std::string& dir, const std::string& bytes, const std::string& what) {
  const std::string path = write(dir, "bad.gguf", bytes);
  const std::string e = error_of(path);
  INFO("error: " << e);
  CHECK(e.find(path) != std::string::npos);
  CHECK(e.find(what) != std::string::npos);
  CHECK(e.find('\n') == std::string::npos);
}

}  // namespace

TEST_CASE("gguf: SmolLM2-135M-Instruct reads as gguf-py reads it: keys, tensors, every value bit for bit",
          "[gguf][reference]") {
  require_smollm2();
  const test::Oracle ref = gguf_check("dump", kSmolLM2);
  INFO(ref.run.output.substr(0, 2000));
  REQUIRE(ref.run.status == 0);
  const GgufFile f(kSmolLM2);
  const auto tally = check_against(f, ref.fields);
  print_tally("SmolLM2-135M-Instruct.Q4_1", tally);
  // The types the file holds: Q4_1 for the linear layers, Q8_0 for the (tied) embedding, F32 norms.
  CHECK(tally.at("Q4_1").tensors == 210);
  CHECK(tally.at("Q8_0").tensors == 1);
  CHECK(tally.at("F32").tensors == 61);
  CHECK(tally.size() == 3);

  // What a llama model needs from the metadata, through the typed lookups.
  CHECK(f.get_string("general.architecture") == "llama");
  CHECK(f.get_int("llama.block_count") == 30);
  CHECK(f.get_int("llama.context_length") == 8192);
  CHECK(f.get_int("llama.embedding_length") == 576);
  CHECK(f.get_int("llama.feed_forward_length") == 1536);
  CHECK(f.get_int("llama.attention.head_count") == 9);
  CHECK(f.get_int("llama.attention.head_count_kv") == 3);
  CHECK(f.get_int("llama.rope.dimension_count") == 64);
  CHECK(f.get_float("llama.rope.freq_base") == 100000.0);
  CHECK(f.get_float("llama.attention.layer_norm_rms_epsilon") == double(1e-5f));
  CHECK(f.get_string("tokenizer.ggml.model") == "gpt2");
  CHECK(f.get_string("tokenizer.ggml.pre") == "smollm");
  CHECK(f.get_strings("tokenizer.ggml.tokens").size() == 49152);
  CHECK(f.get_strings("tokenizer.ggml.merges").size() == 48900);
  CHECK(f.get_ints("tokenizer.ggml.token_type").size() == 49152);
  CHECK(f.get_int("tokenizer.ggml.bos_token_id") == 1);
  CHECK(f.get_int("tokenizer.ggml.eos_token_id") == 2);
  CHECK_FALSE(f.get_bool("tokenizer.ggml.add_bos_token"));
  CHECK(f.get_string("tokenizer.chat_template").find("<|im_start|>") != std::string::npos);
  CHECK(f.find("output.weight") == nullptr);  // tied to token_embd.weight
  REQUIRE(f.find("token_embd.weight") != nullptr);
  CHECK(f.find("token_embd.weight")->torch_shape() == std::vector<int64_t>{49152, 576});
}

TEST_CASE("gguf: every value type, arrays of arrays, and every tensor type we dequantise match gguf-py",
          "[gguf][reference]") {
  const std::string dir = test::temp_dir("gguf-types");
  const std::string path = dir + "/types.gguf";
  const test::Oracle made = gguf_check("make", path);
  INFO(made.run.output.substr(0, 2000));
  REQUIRE(made.run.status == 0);
  const test::Oracle ref = gguf_check("dump", path);
  REQUIRE(ref.run.status == 0);
  const GgufFile f(path);
  const auto tally = check_against(f, ref.fields);
  print_tally("every type", tally);
  for (const char* type :
       {"F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}) {
    INFO(type);
    CHECK(tally.count(type) == 1);
  }

  CHECK(f.alignment() == 64);
  // gguf-py's reader leaves arrays of arrays unparsed: what its writer was given.
  CHECK(to_json(*f.find_key("test.array.nested")) == made.fields.at("nested"));
  CHECK(f.get_int("test.i8") == -100);
  CHECK(f.get_int("test.u32") == 4000000000);
  CHECK(f.get_int("test.missing", 7) == 7);
  CHECK(f.get_float("test.f32") == double(0.1f));
  CHECK(f.get_float("test.f64") == 1e-300);
  CHECK(f.get_bool("test.bool"));
  CHECK(f.get_string("test.string") == "héllo, 世界 🙂");
  CHECK(f.get_ints("test.array.int8") == std::vector<int64_t>{-128, 127});
  CHECK(f.get_ints("test.array.uint32") == std::vector<int64_t>{3, 4294967295});
  CHECK(f.get_floats("test.array.float32") == std::vector<double>{1.5, double(-0.3f), double(3e38f)});
  CHECK(f.get_strings("test.array.string") == std::vector<std::string>{"a", "", "ü\n\t\"\\"});
  CHECK_THROWS_WITH(f.get_int("test.u64"), Catch::Contains("'test.u64' is 18000000000000000000, too large"));
  CHECK_THROWS_WITH(f.get_string("test.u8"), Catch::Contains("metadata key 'test.u8' is UINT8, not a string"));
  CHECK_THROWS_WITH(f.get_strings("test.array.int32"),
                    Catch::Contains("'test.array.int32' is an array of INT32, not an array of strings"));
  CHECK_THROWS_WITH(f.get_ints("test.string"), Catch::Contains("is STRING, not an array of integers"));
  CHECK_THROWS_WITH(f.get_int("test.missing"), Catch::Contains("has no metadata key 'test.missing'"));

  // A type the file may hold but we do not dequantise: one line naming the file, tensor and types.
  const io::GgufTensorInfo* iq = f.find("unsupported.IQ4_NL");
  REQUIRE(iq != nullptr);
  CHECK_THROWS_WITH(model::dequantize(f, *iq),
                    Catch::Contains(path + ": tensor 'unsupported.IQ4_NL' has type IQ4_NL, which lorarun "
                                           "cannot dequantise (supported: F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                                           "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, BF16)"));
  CHECK_THROWS_WITH(model::dequantize(f, "nope"), Catch::Contains(path + " has no tensor 'nope'"));
}

TEST_CASE("gguf: a small file reads, and every truncation of it is one line naming the file", "[gguf]") {
  const std::string dir = test::temp_dir("gguf-truncated");
  const std::string good = tiny();
  const GgufFile f(write(dir, "tiny.gguf", good));
  REQUIRE(f.tensors().size() == 2);
  CHECK(f.get_strings("tokenizer.ggml.tokens") == std::vector<std::string>{"a", "bc"});
  CHECK(model::dequantize(f, "w").equal(at::tensor({1.f, 2.f, 3.f, 4.f})));
  CHECK(model::dequantize(f, "q").equal((at::arange(-16, 16, at::kFloat) * 0.5).repeat({2, 1})));
  for (size_t n = 0; n < good.size(); ++n) {
    INFO("truncated to " << n << " of " << good.size() << " bytes");
    check_refused(dir, good.substr(0, n), "GGUF");
  }
}

TEST_CASE("gguf: the real file truncated in its metadata, its tensor infos and its data is refused", "[gguf]") {
  require_smollm2();
  const std::string dir = test::temp_dir("gguf-real-truncated");
  std::ifstream in(kSmolLM2, std::ios::binary);
  const std::string whole((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const GgufFile f(kSmolLM2);
  const size_t infos_end = f.data_offset() - 32;  // inside the last tensor infos (or padding)
  for (const auto& [n, what] : std::vector<std::pair<size_t, std::string>>{
           {3, "the magic number at byte 0 runs past the end of the 3-byte file"},
           {5000, "272 tensors cannot fit in the 5000-byte file"},
           {20000, "key 'tokenizer.ggml.tokens' is an array of 49152 STRING items, more than the"},
           {1000000, "key 'tokenizer.ggml.merges' is an array of 48900 STRING items"},
           {infos_end, "is not a valid GGUF file"},  // the last tensor info
           {whole.size() - 1000, "tensor 'output_norm.weight' data (2304 bytes at offset"}}) {
    INFO("truncated to " << n << " bytes");
    check_refused(dir, whole.substr(0, n), what);
  }
}

TEST_CASE("gguf: hostile counts, lengths, offsets and types are one-line errors, never allocations", "[gguf]") {
  const std::string dir = test::temp_dir("gguf-hostile");
  const uint64_t huge = uint64_t{1} << 62;
  // Lengths and counts far beyond the file.
  check_refused(dir, Bytes().header(0, 1).str("tokenizer.ggml.tokens").u32(9).u32(8).u64(huge).s,
                "is an array of 4611686018427387904 STRING items, more than the 0 bytes left");
  check_refused(dir, Bytes().header(0, 1).str("a").u32(9).u32(0).u64(huge).u64(0).s,
                "array of 4611686018427387904 UINT8 items");
  check_refused(dir, Bytes().header(0, 1).str("a").u32(9).u32(9).u64(huge).s,
                "array of 4611686018427387904 ARRAY items");
  check_refused(dir, Bytes().header(0, 1).u64(uint64_t{1} << 63).u64(0).s, "has length 9223372036854775808");
  check_refused(dir, Bytes().header(0, 1).str("a").u32(8).u64(~uint64_t{0}).s, "has length 18446744073709551615");
  check_refused(dir, Bytes().header(0, huge).s, "4611686018427387904 metadata keys cannot fit");
  check_refused(dir, Bytes().header(huge, 0).s, "4611686018427387904 tensors cannot fit");
  Bytes deep;
  deep.header(0, 1).str("deep").u32(9);
  for (int i = 0; i < 20; ++i) deep.u32(9).u64(1);
  check_refused(dir, deep.s, "nests arrays deeper than 8");

  // Tensor offsets and shapes.
  check_refused(dir, tiny(uint64_t{1} << 40),
                "tensor 'q' data (68 bytes at offset 1099511627776) is outside the 100-byte data section");
  check_refused(dir, tiny(~uint64_t{0} - 31), "is outside the");
  check_refused(dir, tiny(33), "tensor 'q' has offset 33, not a multiple of the alignment 32");
  check_refused(dir, tiny(0), "tensors 'w' and 'q' overlap");
  const auto one_tensor = [](const std::vector<uint64_t>& dims, uint32_t type) {
    return Bytes().header(1, 0).tensor("t", dims, type, 0).pad(32).s + std::string(64, '\0');
  };
  check_refused(dir, one_tensor({1, 1, 1, 1, 1}, 0), "tensor 't' has 5 dimensions (at most 4)");
  check_refused(dir, one_tensor({uint64_t{1} << 63}, 0),
                "tensor 't' is too large (dimension 0 is 9223372036854775808)");
  check_refused(dir, one_tensor({uint64_t{1} << 30, uint64_t{1} << 30}, 0), "tensor 't' is too large (dimension 1");
  check_refused(dir, one_tensor({16}, 77), "tensor 't' has unknown ggml type 77");
  check_refused(dir, one_tensor({31}, 8), "rows of 31 elements, not a multiple of its block size 32");
  check_refused(dir, one_tensor({100, 2}, 12),
                "of type Q4_K has rows of 100 elements, not a multiple of its block size 256");
  CHECK(error_of(write(dir, "ok.gguf", one_tensor({16}, 0))) == "");

  // Keys, header and alignment.
  check_refused(dir, Bytes().header(0, 1).str("a").u32(13).u32(0).s, "key 'a' has unknown value type 13");
  check_refused(dir, Bytes().header(0, 2).key_u32("a", 1).key_u32("a", 2).s, "key 'a' appears twice");
  check_refused(dir,
                Bytes().header(2, 0).tensor("t", {1}, 0, 0).tensor("t", {1}, 0, 32).pad(32).s + std::string(64, '\0'),
                "tensor 't' appears twice");
  check_refused(dir, Bytes().header(0, 1).key_u32("general.alignment", 3).s,
                "general.alignment 3 is not a power of two");
  check_refused(dir, Bytes().header(0, 1).key_u32("general.alignment", 0).s,
                "general.alignment 0 is not a power of two");
  check_refused(dir, Bytes().header(0, 1).str("general.alignment").u32(10).u64(32).s,
                "general.alignment is UINT64, not UINT32");
  check_refused(dir, "GGML" + Bytes().u32(3).u64(0).u64(0).s, "is not a GGUF file (it does not start with \"GGUF\")");
  check_refused(dir, Bytes().header(0, 0, 1).s, "is GGUF version 1, which lorarun does not read");
  check_refused(dir, Bytes().header(0, 0, 0x03000000).s, "is a big-endian GGUF file");
  check_refused(dir, Bytes().header(0, 0, 4).s, "is GGUF version 4");
  check_refused(dir, "", "it is empty");
  CHECK_THROWS_WITH(GgufFile(dir + "/missing.gguf"),
                    Catch::Contains(dir + "/missing.gguf cannot be read: No such file or directory"));

  // Every byte of the small file's header and tensor infos overwritten: it reads, or it is refused
  // with a lorarun::Error (error_of lets any other exception, or a crash, fail the test).
  const std::string good = tiny();
  const size_t data_start = GgufFile(write(dir, "tiny.gguf", good)).data_offset();
  int refused = 0;
  for (size_t i = 0; i < data_start; ++i)
    for (const char v : {'\x00', '\x01', '\x7f', '\x80', '\xff'}) {
      std::string bad = good;
      bad[i] = v;
      refused += !error_of(write(dir, "flipped.gguf", bad)).empty();
    }
  CHECK(refused > 0);
}

namespace {

// `src` rewritten by GgufWriter: every key in order, every tensor's bytes as they are.
void rewrite(const GgufFile& src, const std::string& path) {
  io::GgufWriter w(path);
  for (const auto& [key, value] : src.metadata()) w.add(key, value);
  for (const io::GgufTensorInfo& t : src.tensors()) w.add_tensor(t.name, t.type, t.torch_shape());
  for (const io::GgufTensorInfo& t : src.tensors()) w.write_tensor(src.bytes(t));
  w.commit();
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(in), {}};
}

}  // namespace

TEST_CASE("gguf write: gguf-py's files rewritten by GgufWriter are byte-identical, and gguf-py reads them back",
          "[gguf][reference]") {
  const std::string dir = test::temp_dir("gguf-write");
  const std::string made_path = dir + "/types.gguf";
  const test::Oracle made = gguf_check("make", made_path);
  INFO(made.run.output.substr(0, 2000));
  REQUIRE(made.run.status == 0);
  std::vector<std::pair<std::string, std::string>> files = {{made_path, dir + "/types.rewritten.gguf"}};
  if (std::filesystem::exists(kSmolLM2)) files.emplace_back(kSmolLM2, dir + "/smollm2.rewritten.gguf");
  for (const auto& [from, to] : files) {
    INFO(from);
    {
      const GgufFile src(from);
      rewrite(src, to);
    }
    CHECK(bytes_of(to) == bytes_of(from));  // header, keys of every type, padding, data
    const GgufFile ours(to);
    const test::Oracle ref = gguf_check("dump", to);
    REQUIRE(ref.run.status == 0);
    print_tally("rewritten " + std::filesystem::path(from).filename().string(), check_against(ours, ref.fields));
    CHECK(to_json(*ours.find_key("general.architecture")) == "llama");
  }
  CHECK(!std::filesystem::exists(dir + "/types.rewritten.gguf.tmp." + std::to_string(getpid())));

  // An error on the way leaves nothing behind; a second key of the same name is refused.
  {
    io::GgufWriter w(dir + "/partial.gguf");
    w.add("a", io::gguf_u32(1));
    CHECK_THROWS_WITH(w.add("a", io::gguf_u32(2)), Catch::Contains("GGUF key 'a' added twice"));
    w.add_tensor("t", GgmlType::Q8_0, {2, 32});
    const std::vector<std::byte> short_data(10);
    CHECK_THROWS_WITH(w.write_tensor(short_data), Catch::Contains("takes 68 bytes as Q8_0, not 10"));
  }
  CHECK(!std::filesystem::exists(dir + "/partial.gguf"));
}

TEST_CASE("gguf write: F16, BF16 and Q8_0 quantisation is bit-identical to gguf-py's gguf.quants.quantize",
          "[gguf][reference]") {
  const std::string dir = test::temp_dir("gguf-quant");
  const test::Oracle made = gguf_check("quant", dir);
  INFO(made.run.output.substr(0, 2000));
  REQUIRE(made.run.status == 0);
  const std::map<std::string, GgmlType> types = {
      {"F16", GgmlType::F16}, {"BF16", GgmlType::BF16}, {"Q8_0", GgmlType::Q8_0}};
  int checked = 0;
  for (const auto& [file, n] : made.fields.at("written").items()) {
    INFO(file);
    const std::string input = bytes_of(dir + "/" + file.substr(0, file.find('.')) + ".f32");
    const std::string theirs = bytes_of(dir + "/" + file);
    REQUIRE(input.size() == n.get<size_t>() * 4);
    std::vector<float> x(n.get<size_t>());
    std::memcpy(x.data(), input.data(), input.size());
    const GgmlType type = types.at(file.substr(file.find('.') + 1));
    std::vector<std::byte> ours(theirs.size());
    io::quantize(type, x, ours);
    size_t differ = 0;
    for (size_t i = 0; i < theirs.size(); ++i) differ += static_cast<char>(ours[i]) != theirs[i];
    CHECK(differ == 0);
    fmt::print("gguf write: {} ({} values): {} of {} bytes differ from gguf-py's\n", file, x.size(), differ,
               theirs.size());
    ++checked;
  }
  CHECK(checked == 5);
  const std::vector<float> zeros(32);
  std::vector<std::byte> q4(18);
  CHECK_THROWS_WITH(io::quantize(GgmlType::Q4_0, zeros, q4), Catch::Contains("cannot quantise to Q4_0"));
}
