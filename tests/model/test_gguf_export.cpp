// lora-merge --out FILE.gguf against transformers, PEFT and gguf-py (tests/reference/gguf_export_check.py):
// our GGUF loaded by transformers gives PEFT's merged logits (its 2-D weights quantised by gguf-py as
// the file's for f16, bf16, q8_0), every typed tensor is gguf-py's quantisation of the f32 file's,
// gguf-py's reader reads every key and tensor, the tokenizer keys are the converter's; one-line errors.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "support/oracle.hpp"
#include "support/process.hpp"

using namespace lorarun::test;
using nlohmann::json;

namespace {

const std::string kFixtures = LORARUN_MODEL_FIXTURES;
const std::string kSmolLM2 =
    std::string(LORARUN_SOURCE_DIR) + "/.fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

Oracle export_check(const std::string& args) {
  return oracle(
      fmt::format("'{}' '{}/tests/reference/gguf_export_check.py' {} 2>&1", LORARUN_PYTHON, LORARUN_SOURCE_DIR, args));
}

Result merge(const std::string& args) { return sh(fmt::format("{} {}", bin("lora-merge"), args)); }

// The error line of a lora-merge run that must fail.
std::string merge_error(const std::string& args) {
  const Result r = merge(args);
  INFO(r.output);
  CHECK(r.status != 0);
  return r.output;
}

}  // namespace

TEST_CASE("gguf export: tiny llama, qwen2 and qwen3 merged to f32, f16, bf16, q8_0 GGUFs give PEFT's merged logits",
          "[gguf][reference][e2e]") {
  const std::string dir = temp_dir("gguf-export");
  const Oracle made = export_check(fmt::format("make '{}'", dir));
  INFO(made.run.output.substr(0, 3000));
  REQUIRE(made.run.status == 0);
  for (const std::string arch : {"llama", "qwen2", "qwen3"}) {
    INFO(arch);
    const std::string d = dir + "/" + arch;
    for (const std::string type : {"f32", "f16", "bf16", "q8_0"}) {
      const Result r = merge(fmt::format("--model '{}/base' --adapter '{}/adapter' --out '{}/{}.gguf' --gguf-type {}",
                                         d, d, d, type, type));
      INFO(r.output);
      REQUIRE(r.status == 0);
    }
    const Oracle c = export_check(fmt::format("check '{}' {}", dir, arch));
    INFO(c.run.output.substr(0, 3000));
    REQUIRE(c.run.status == 0);
    const bool tied = c.fields.at("tie").get<bool>();
    CHECK(tied == (arch == "llama"));
    for (const auto& [type, r] : c.fields.at("results").items()) {
      INFO(type);
      const double logit = r.at("logit_diff").get<double>(), weight = r.at("weight_diff").get<double>();
      fmt::print(
          "gguf export: tiny {} {}: {} bytes, max |logit diff| {:.3g}, max |weight diff| {:.3g} vs PEFT merged{}\n",
          arch, type, r.at("size").get<int64_t>(), logit, weight, type == "f32" ? "" : " quantised alike");
      CHECK(logit <= 1e-4);
      CHECK(weight <= 1e-5);
      CHECK(r.at("not_quantised").empty());   // each tensor is gguf-py's quantisation of the f32 file's
      CHECK(r.at("tokenizer_diff").empty());  // tokens, types, merges, ids, add_bos, chat template
      CHECK(r.at("pre").get<std::string>() == "default");
      const auto tensors = r.at("tensors").get<std::vector<std::string>>();
      const auto has = [&tensors](const std::string& t) {
        return std::find(tensors.begin(), tensors.end(), t) != tensors.end();
      };
      CHECK(has("output.weight") == !tied);
      CHECK(has("blk.1.attn_q.bias") == (arch == "qwen2"));
      CHECK(has("blk.1.attn_k_norm.weight") == (arch == "qwen3"));
      CHECK(has("blk.1.ffn_down.weight"));
      CHECK(tensors.size() == size_t{2} * (arch == "llama" ? 9 : arch == "qwen2" ? 12 : 11) + 2 + !tied);
      const std::map<std::string, int> file_types = {{"f32", 0}, {"f16", 1}, {"bf16", 32}, {"q8_0", 7}};
      CHECK(r.at("file_type").get<int>() == file_types.at(type));
      // qwen2's down_proj rows (80) are not whole Q8_0 blocks: F16, as the converter falls back.
      if (type == "q8_0") CHECK(r.at("tensor_types").size() == (arch == "qwen2" ? 3u : 2u));
      const auto keys = r.at("keys").get<std::vector<std::string>>();
      for (const std::string k : {"general.architecture", "general.name", "general.file_type", ".context_length",
                                  ".embedding_length", ".feed_forward_length", ".block_count", ".attention.head_count",
                                  ".attention.head_count_kv", ".attention.layer_norm_rms_epsilon", ".rope.freq_base"}) {
        const std::string key = k.starts_with(".") ? arch + k : k;
        INFO(key);
        CHECK(std::find(keys.begin(), keys.end(), key) != keys.end());
      }
    }
  }
}

TEST_CASE("gguf export: SmolLM2's .gguf merged to an f32 GGUF and to a HF directory gives PEFT's logits, its tokenizer",
          "[gguf][reference][e2e]") {
  if (!std::filesystem::exists(kSmolLM2)) FAIL(kSmolLM2 << " is missing: run scripts/setup (or scripts/fetch-models)");
  const std::string dir = temp_dir("gguf-export-smollm2");
  const Oracle made = export_check(fmt::format("smol-make '{}' '{}'", dir, kSmolLM2));
  INFO(made.run.output.substr(0, 3000));
  REQUIRE(made.run.status == 0);
  const Result r = merge(
      fmt::format("--model '{}' --adapter '{}/adapter' --out '{}/merged.gguf' --gguf-type f32", kSmolLM2, dir, dir));
  INFO(r.output);
  REQUIRE(r.status == 0);
  const Oracle c = export_check(fmt::format("smol-check '{}' '{}' '{}/merged.gguf'", dir, kSmolLM2, dir));
  INFO(c.run.output.substr(0, 3000));
  REQUIRE(c.run.status == 0);
  const double diff = c.fields.at("logit_diff").get<double>();
  fmt::print(
      "gguf export: SmolLM2-135M-Instruct + r=2 adapter -> f32 GGUF ({} bytes, {} tensors): max |logit diff| "
      "{:.3g} vs PEFT merged; {} tokenizer keys copied\n",
      c.fields.at("size").get<int64_t>(), c.fields.at("tensors").get<int>(), diff,
      c.fields.at("tokenizer_keys").get<int>());
  CHECK(diff <= 1e-4);
  CHECK(c.fields.at("tokenizer_differ").empty());
  CHECK(c.fields.at("tokenizer_keys").get<int>() >= 5);

  // The same merge as a HF directory: config.json and the tokenizer files made from the metadata.
  const Result hf = merge(fmt::format("--model '{}' --adapter '{}/adapter' --out '{}/merged'", kSmolLM2, dir, dir));
  INFO(hf.output);
  REQUIRE(hf.status == 0);
  const Oracle d = export_check(fmt::format("smol-check-dir '{}' '{}' '{}/merged'", dir, kSmolLM2, dir));
  INFO(d.run.output.substr(0, 3000));
  REQUIRE(d.run.status == 0);
  fmt::print("gguf export: SmolLM2 -> HF directory: max |logit diff| {:.3g}; ids differ on {} of {} strings\n",
             d.fields.at("logit_diff").get<double>(), d.fields.at("ids_differ").get<int>(),
             d.fields.at("strings").get<int>());
  CHECK(d.fields.at("logit_diff").get<double>() <= 1e-4);
  CHECK(d.fields.at("ids_differ").get<int>() == 0);
  CHECK(d.fields.at("strings").get<int>() >= 2000);
  CHECK(d.fields.value("chat_template_equal", false));
  CHECK(d.fields.value("eos_equal", false));
}

TEST_CASE("gguf export: an existing output, another family, a bad type, --gguf-type without .gguf are one line",
          "[gguf][e2e]") {
  const std::string dir = temp_dir("gguf-export-errors");
  const std::string llama = kFixtures + "/llama_linear_rope";
  const std::string args = fmt::format("--model '{}' --adapter '{}/peft_adapter'", llama, llama);
  const Result ok = merge(fmt::format("{} --out '{}/x.gguf'", args, dir));  // linear rope scaling: written
  INFO(ok.output);
  REQUIRE(ok.status == 0);
  CHECK_THAT(ok.output, Catch::Contains("(GGUF F16)"));  // the converter's default outtype
  const std::pair<std::string, std::string> cases[] = {
      {fmt::format("{} --out '{}/x.gguf'", args, dir), dir + "/x.gguf already exists: choose another output"},
      {fmt::format("--model '{}/opt' --adapter '{}/opt/peft_adapter' --out '{}/opt.gguf'", kFixtures, kFixtures, dir),
       "model type 'opt' cannot be written to GGUF: supported are llama, mistral, qwen2, qwen3"},
      {fmt::format("--model '{}/gemma2' --adapter '{}/gemma2/peft_adapter' --out '{}/g2.gguf'", kFixtures, kFixtures,
                   dir),
       "query_pre_attn_scalar 24 cannot be written to GGUF: llama.cpp scales a 3-layer gemma2 model's queries by 18"},
      {fmt::format("{} --out '{}/y.gguf' --gguf-type q4_0", args, dir),
       "GGUF type 'q4_0' is not supported: choose f32, f16, bf16 or q8_0"},
      {fmt::format("{} --out '{}/hf' --gguf-type f16", args, dir),
       "--gguf-type f16 needs a GGUF output: --out FILE.gguf"},
  };
  for (const auto& [a, message] : cases) {
    INFO(a);
    const std::string out = merge_error(a);
    CHECK_THAT(out, Catch::Contains(message));
    CHECK(std::count(out.begin(), out.end(), '\n') == 1);
  }
  CHECK(!std::filesystem::exists(dir + "/opt.gguf"));
  CHECK(!std::filesystem::exists(dir + "/g2.gguf"));
  CHECK(!std::filesystem::exists(dir + "/hf"));
}
