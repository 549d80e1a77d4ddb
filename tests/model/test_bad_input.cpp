// Bad model, weight and adapter files: one clear error each, never a crash, nothing written.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "io/safetensors.hpp"
#include "model/lora.hpp"
#include "model/transformer.hpp"
#include "support/process.hpp"
#include "util/error.hpp"

using namespace lorarun;
namespace fs = std::filesystem;

namespace {

const std::string kFixtures = LORARUN_MODEL_FIXTURES;

// A safetensors file from a header string and a data section of `data_bytes` zero bytes.
std::string write_raw(const std::string& dir, const std::string& header, size_t data_bytes,
                      int64_t claimed_header_len = -1) {
  const std::string path = dir + "/t.safetensors";
  std::ofstream out(path, std::ios::binary);
  const uint64_t len = claimed_header_len < 0 ? header.size() : static_cast<uint64_t>(claimed_header_len);
  out.write(reinterpret_cast<const char*>(&len), 8);
  out << header << std::string(data_bytes, '\0');
  return path;
}

void copy_model(const std::string& family, const std::string& to) {
  fs::remove_all(to);
  fs::create_directories(to);
  for (const auto& e : fs::directory_iterator(kFixtures + "/" + family))
    if (e.is_regular_file()) fs::copy_file(e.path(), to + "/" + e.path().filename().string());
}

}  // namespace

TEST_CASE("corrupt safetensors files are rejected with the reason") {
  const std::string dir = test::temp_dir("bad-safetensors");
  using io::SafetensorsFile;
  const std::string ok = R"({"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]}})";
  CHECK_NOTHROW(SafetensorsFile(write_raw(dir, ok, 16)));
  CHECK_THROWS_WITH(SafetensorsFile(write_raw(dir, ok, 16, 1 << 20)), Catch::Contains("runs past the end"));
  CHECK_THROWS_WITH(SafetensorsFile(write_raw(dir, ok, 8)), Catch::Contains("outside the 8-byte data section"));
  CHECK_THROWS_WITH(SafetensorsFile(write_raw(dir, "{\"a\":", 0)), Catch::Contains("header is not JSON"));
  CHECK_THROWS_WITH(SafetensorsFile(write_raw(dir, R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", 16)),
                    Catch::Contains("has 16 bytes but dtype F32 and shape [3] need 12"));
  CHECK_THROWS_WITH(SafetensorsFile(write_raw(dir, R"({"a":{"dtype":"Q4","shape":[4],"data_offsets":[0,4]}})", 4)),
                    Catch::Contains("dtype 'Q4' is not supported"));
  CHECK_THROWS_WITH(SafetensorsFile(write_raw(dir,
                                              R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                              R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                              12)),
                    Catch::Contains("overlap"));
  CHECK_THROWS_WITH(SafetensorsFile(write_raw(dir, R"({"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", 4)),
                    Catch::Contains("bad shape"));
  CHECK_THROWS_WITH(SafetensorsFile(dir + "/missing.safetensors"),
                    Catch::Contains("missing.safetensors cannot be read: No such file or directory"));
  std::ofstream(dir + "/short.safetensors") << "abc";
  CHECK_THROWS_WITH(SafetensorsFile(dir + "/short.safetensors"), Catch::Contains("shorter than the 8-byte header"));
}

TEST_CASE("model directories that cannot work say why") {
  const std::string dir = test::temp_dir("bad-model");
  auto load = [](const std::string& d) { return model::CausalLM::load(d, at::kFloat, at::kCPU); };
  CHECK_THROWS_WITH(load(dir + "/nothing"), Catch::Contains("model directory '" + dir + "/nothing' does not exist"));
  fs::create_directories(dir + "/empty");
  CHECK_THROWS_WITH(load(dir + "/empty"), Catch::Contains("config.json not found"));

  copy_model("llama", dir + "/arch");
  std::string cfg = test::read_file(dir + "/arch/config.json");
  cfg.replace(cfg.find("\"llama\""), 7, "\"mamba\"");
  std::ofstream(dir + "/arch/config.json") << cfg;
  CHECK_THROWS_WITH(load(dir + "/arch"),
                    Catch::Contains("model_type 'mamba' is not supported; supported: llama, "
                                    "mistral, qwen2, qwen3, qwen3_moe, mixtral, gemma2, gemma3_text, phi3, opt, gpt2"));
  cfg.replace(cfg.find("\"mamba\""), 7, "\"gemma3\"");
  std::ofstream(dir + "/arch/config.json") << cfg;
  CHECK_THROWS_WITH(load(dir + "/arch"), Catch::Contains("multimodal Gemma 3 checkpoint (model_type gemma3) is not "
                                                         "supported; text models (Gemma3ForCausalLM, model_type "
                                                         "gemma3_text) are"));

  copy_model("llama", dir + "/shape");
  cfg = test::read_file(dir + "/shape/config.json");
  cfg.replace(cfg.find("\"intermediate_size\": 96"), 23, "\"intermediate_size\": 97");
  std::ofstream(dir + "/shape/config.json") << cfg;
  CHECK_THROWS_WITH(load(dir + "/shape"), Catch::Contains("config.json implies [97, 64]"));

  copy_model("llama", dir + "/noweights");
  fs::remove(dir + "/noweights/model.safetensors");
  CHECK_THROWS_WITH(load(dir + "/noweights"), Catch::Contains("neither model.safetensors nor"));

  copy_model("llama", dir + "/truncated");
  fs::resize_file(dir + "/truncated/model.safetensors", fs::file_size(dir + "/truncated/model.safetensors") / 2);
  CHECK_THROWS_WITH(load(dir + "/truncated"), Catch::Contains("truncated or corrupt"));

  copy_model("phi3", dir + "/longrope");
  cfg = test::read_file(dir + "/longrope/config.json");
  cfg.replace(cfg.find("\"short_factor\": ["), 17, "\"short_factor\": [3.0, ");
  std::ofstream(dir + "/longrope/config.json") << cfg;
  CHECK_THROWS_WITH(load(dir + "/longrope"), Catch::Contains("longrope short_factor and long_factor need 6 values each "
                                                             "(head_dim 16 x partial_rotary_factor 0.75 / 2), not 7 "
                                                             "and 6"));
}

TEST_CASE("adapters for another base, unknown keys, and targets that match nothing") {
  model::CausalLM llama = model::CausalLM::load(kFixtures + "/llama", at::kFloat, at::kCPU);
  CHECK_THROWS_WITH(model::load_adapter(llama, kFixtures + "/qwen2/peft_adapter"),
                    Catch::Contains("was made for another base model"));
  CHECK_THROWS_WITH(model::load_adapter(llama, kFixtures + "/gpt2/peft_adapter"),
                    Catch::Contains("names no linear layer of this llama model"));
  CHECK_THROWS_WITH(model::load_adapter(llama, kFixtures + "/nowhere"),
                    Catch::Contains("adapter_config.json not found"));
  model::LoraConfig cfg;
  cfg.target_modules = {"query_key_value"};
  CHECK_THROWS_WITH(model::attach_lora(llama, cfg, 0),
                    Catch::Contains("match no layer of this llama model; its linear layers are: down_proj, "
                                    "gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"));
  // A DoRA adapter whose config says it is none, and a plain one whose config says DoRA.
  const std::string dir = test::temp_dir("adapter-dora-mismatch");
  for (const auto& [from, use_dora] : {std::pair{"peft_dora_adapter", false}, {"peft_adapter", true}}) {
    const std::string to = dir + "/" + from;
    fs::copy(kFixtures + "/llama/" + from, to);
    nlohmann::json j = nlohmann::json::parse(io::read_file(to + "/adapter_config.json"));
    j["use_dora"] = use_dora;
    io::write_file_atomic(to + "/adapter_config.json", j.dump());
  }
  model::CausalLM fresh = model::CausalLM::load(kFixtures + "/llama", at::kFloat, at::kCPU);
  CHECK_THROWS_WITH(model::load_adapter(fresh, dir + "/peft_dora_adapter"),
                    Catch::Contains("lora_magnitude_vector' is DoRA's but") && Catch::Contains("use_dora: false"));
  CHECK_THROWS_WITH(model::load_adapter(fresh, dir + "/peft_adapter"),
                    Catch::Contains("lacks lora_magnitude_vector (DoRA)"));
}

TEST_CASE("lora-merge output (LoRA, DoRA) loads in transformers and gives PEFT's merged logits", "[e2e][reference]") {
  const std::string out = test::temp_dir("merge");
  for (const std::string family : {"llama", "gpt2", "opt", "mistral", "qwen3", "gemma2", "gemma3", "phi3"})
    for (const std::string variant : {"", "dora_"}) {
      INFO(family << " " << variant);
      const std::string base = kFixtures + "/" + family, to = out + "/" + variant + family;
      const test::Result r =
          test::sh(fmt::format("{} --model {} --adapter {}/peft_{}adapter --out {} --max-shard-size 40KB",
                               test::bin("lora-merge"), base, base, variant, to));
      INFO(r.output);
      REQUIRE(r.status == 0);
      CHECK(fs::exists(to + "/model.safetensors.index.json"));  // sharded at 40KB
      const test::Result check =
          test::sh(fmt::format("'{}' '{}/tests/reference/check.py' model {} {}/reference.safetensors {}merged_logits",
                               LORARUN_PYTHON, LORARUN_SOURCE_DIR, to, base, variant));
      INFO(check.output);
      CHECK(check.status == 0);
    }
}

TEST_CASE("lora-merge with bad input: one line, non-zero, nothing written", "[e2e]") {
  const std::string out = test::temp_dir("merge-bad");
  const std::string llama = kFixtures + "/llama";
  for (const std::string& adapter : {kFixtures + "/qwen2/peft_adapter", out + "/missing"}) {
    const test::Result r =
        test::sh(fmt::format("{} --model {} --adapter {} --out {}/x", test::bin("lora-merge"), llama, adapter, out),
                 test::Capture::StderrOnly);
    INFO(r.output);
    CHECK(r.status == 1);
    CHECK(test::count_lines(r.output) == 1);
    CHECK_THAT(r.output, Catch::StartsWith("lora-merge: error: "));
    CHECK(fs::is_empty(out));
  }
  const test::Result r = test::sh(fmt::format("{} --model {} --adapter {}/peft_adapter --out {} --max-shard-size 5XB",
                                              test::bin("lora-merge"), llama, llama, out + "/y"),
                                  test::Capture::StderrOnly);
  CHECK_THAT(r.output, Catch::Contains("size '5XB' is not a positive size"));
  CHECK(fs::is_empty(out));
}

TEST_CASE("a model id is found in the local Hugging Face cache, never downloaded") {
  const std::string home = test::temp_dir("hf-home");
  const std::string snap = home + "/hub/models--tiny--llama/snapshots/abc123";
  fs::create_directories(snap);
  for (const auto& e : fs::directory_iterator(kFixtures + "/llama"))
    if (e.is_regular_file()) fs::create_symlink(e.path(), snap + "/" + e.path().filename().string());
  fs::create_directories(home + "/hub/models--tiny--llama/refs");
  std::ofstream(home + "/hub/models--tiny--llama/refs/main") << "abc123";
  setenv("HF_HOME", home.c_str(), 1);
  unsetenv("HF_HUB_CACHE");
  const model::CausalLM m = model::CausalLM::load("tiny/llama", at::kFloat, at::kCPU);
  CHECK(m.dir() == snap);
  CHECK_THROWS_WITH(model::CausalLM::load("tiny/absent", at::kFloat, at::kCPU),
                    Catch::Contains("model 'tiny/absent' is neither a directory nor in the local Hugging Face "
                                    "cache") &&
                        Catch::Contains("never downloads"));
  unsetenv("HF_HOME");
}

namespace {

// kFixtures/`family` with config.json `changes` (KEY=JSON), its weights made anew by transformers.
std::string variant(const std::string& family, const std::string& name, const std::string& changes) {
  const std::string dir = test::temp_dir(name);
  const test::Result r = test::sh(fmt::format("'{}' '{}/tests/reference/variant_model.py' '{}/{}' '{}' {}",
                                              LORARUN_PYTHON, LORARUN_SOURCE_DIR, kFixtures, family, dir, changes));
  INFO(r.output);
  REQUIRE(r.status == 0);
  return dir;
}

// `n` documents {"text": …} in dir/docs.jsonl, and a recipe training on them with `extra` keys.
std::string text_recipe(const std::string& dir, const std::string& model, const std::string& extra) {
  std::ofstream docs(dir + "/docs.jsonl");
  for (int i = 0; i < 8; ++i) docs << fmt::format(R"({{"text": "The quick brown fox {}."}})", i) << "\n";
  const std::string path = dir + "/r.yaml";
  std::ofstream(path) << fmt::format(R"(model: {{path: {}, dtype: fp32, device: cpu}}
lora: {{r: 2, alpha: 4, target_modules: all-linear}}
data: {{source: jsonl, path: {}/docs.jsonl, format: text, batch_size: 4{}}}
train: {{epochs: 1, lr: 1.0e-3}}
checkpoint: {{output_dir: {}/out}}
track: {{mongodb: false}}
)",
                                     model, dir, extra, dir);
  return path;
}

}  // namespace

TEST_CASE(
    "a model whose learned positions are fewer than data.max_length, or than a generation needs, says so where it "
    "is known, naming the limit",
    "[e2e]") {
  const std::string model = variant("gpt2", "gpt2-16-positions", "n_positions=16");
  const std::string dir = test::temp_dir("short-positions");
  const std::string recipe = text_recipe(dir, model, "");
  for (const char* name : {"lora-train", "lora-eval --recipe"}) {
    const std::string tool = name;
    const test::Result r =
        test::sh(fmt::format("{} {}", test::bin(tool.substr(0, tool.find(' '))),
                             tool.find(' ') == std::string::npos ? recipe : "--recipe " + recipe + " --split train"));
    INFO(r.output);
    CHECK(r.status == 78);
    CHECK(test::count_lines(r.output) == 1);
    CHECK_THAT(r.output, Catch::Contains("data.max_length 1024 passes the 16 positions") &&
                             Catch::Contains("(n_positions 16): keep it at most 16"));
  }
  CHECK(test::sh(fmt::format("{} {} data.max_length=16", test::bin("lora-train"), recipe)).status == 0);
  // lora-eval --data takes what fits when --max-length is not given.
  CHECK(test::sh(fmt::format("{} --model {} --data {}/docs.jsonl", test::bin("lora-eval"), model, dir)).status == 0);
  // A generation longer than the table: the tokens that fit, and one warning saying so.
  const test::Result g = test::sh(
      fmt::format("{} --model {} --prompt 'The quick' --max-new-tokens 100 --ids", test::bin("lora-generate"), model));
  INFO(g.output);
  CHECK(g.status == 0);
  CHECK(test::lines_with(g.output, "passes the 16 positions").size() == 1);
  const std::string ids = g.output.substr(g.output.rfind('['));
  CHECK(std::count(ids.begin(), ids.end(), ',') + 1 <= 16);
  const test::Result long_prompt = test::sh(fmt::format("{} --model {} --prompt '{}' --max-new-tokens 4",
                                                        test::bin("lora-generate"), model, std::string(200, 'x')));
  CHECK(long_prompt.status == 78);
  CHECK_THAT(long_prompt.output, Catch::Contains("the prompt (") && Catch::Contains("passes the 16 positions"));
}

TEST_CASE("a tokenizer that makes ids the embedding has no row for is refused at load, naming both sizes", "[e2e]") {
  const std::string model = variant("llama", "llama-small-vocab", "vocab_size=200");
  const std::string dir = test::temp_dir("small-vocab");
  const std::string recipe = text_recipe(dir, model, "");
  const std::vector<std::string> runs = {
      fmt::format("{} {}", test::bin("lora-train"), recipe),
      fmt::format("{} --recipe {} --split train", test::bin("lora-eval"), recipe),
      fmt::format("{} --model {} --data {}/docs.jsonl", test::bin("lora-eval"), model, dir),
      fmt::format("{} --model {} --prompt 'a' --max-new-tokens 2", test::bin("lora-generate"), model)};
  for (const std::string& cmd : runs) {
    const test::Result r = test::sh(cmd);
    INFO(cmd << "\n" << r.output);
    CHECK(r.status == 78);
    CHECK(test::count_lines(r.output) == 1);
    CHECK_THAT(r.output,
               Catch::Contains("its tokenizer makes ids up to ") && Catch::Contains("but its embedding has 200 rows"));
  }
}
