// model.keep_quantized end to end: training on a GGUF's own blocks of every type lorarun
// dequantises (files written by gguf-py, tests/reference/gguf_model_check.py quantized) gives the
// adapter of training on the same file dequantised at load, bit for bit, with the base held in the
// file's bytes; and the refusals.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>

#include "support/oracle.hpp"
#include "support/runs.hpp"

using namespace lorarun::test;

namespace {

// `dir`/`type`.gguf: the tiny llama (hidden 256) with every linear of ggml type `type`.
std::string quantized_model(const std::string& dir, const std::string& type) {
  const std::string file = fmt::format("{}/{}.gguf", dir, type);
  const Oracle made = oracle(fmt::format("'{}' '{}/tests/reference/gguf_model_check.py' quantized '{}' {}",
                                         LORARUN_PYTHON, LORARUN_SOURCE_DIR, file, type));
  INFO(made.run.output);
  REQUIRE(made.run.status == 0);
  return file;
}

// `dir`/`name`.yaml: LoRA on every linear of `model` with dropout, over `dir`/text.jsonl (24
// strings of capitals, the model's tokens), 1 epoch of 6 steps.
std::string recipe(const std::string& dir, const std::string& name, const std::string& model) {
  if (!std::filesystem::exists(dir + "/text.jsonl")) {
    std::ofstream out(dir + "/text.jsonl");
    for (int i = 0; i < 24; ++i) {
      std::string text;
      for (int j = 0; j < 20; ++j) text += static_cast<char>('A' + (i * 7 + j * j) % 26);
      out << nlohmann::json{{"text", text}}.dump() << "\n";
    }
  }
  const std::string path = fmt::format("{}/{}.yaml", dir, name);
  std::ofstream(path) << fmt::format(R"(model: {{path: {}, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear, dropout: 0.1}}
data: {{source: jsonl, path: {}/text.jsonl, format: text, text_field: text, batch_size: 4, max_length: 32}}
train: {{epochs: 1, lr: 1.0e-3, warmup_steps: 2}}
checkpoint: {{output_dir: {}/{}}}
track: {{mongodb: false}}
)",
                                     model, dir, dir, name);
  return path;
}

}  // namespace

TEST_CASE(
    "model.keep_quantized: on every GGUF type, training on the file's own blocks gives the adapter of training on "
    "it dequantised at load, bit for bit (2 ranks with dist.shard_base too)",
    "[e2e][gguf]") {
  const std::string dir = temp_dir("keep-quantized");
  for (const std::string type :
       {"F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}) {
    INFO(type);
    const std::string cfg = recipe(dir, type, quantized_model(dir, type));
    const auto run = [&](const std::string& name, const std::string& overrides) {
      const Result r = sh(fmt::format("{} --nproc-per-node 1 {} checkpoint.output_dir={}/{} {}", bin("lorarun"), cfg,
                                      dir, name, overrides));
      INFO(r.output);
      REQUIRE(r.status == 0);
      return r;
    };
    run(type + "-loaded", "");
    const Result kept = run(type + "-kept", "model.keep_quantized=true");
    CHECK_THAT(kept.output, Catch::Contains(fmt::format("base linears kept as the GGUF's blocks ({} 14)", type)));
    CHECK(hashes(fmt::format("{}/{}-kept/epoch_0", dir, type)) ==
          hashes(fmt::format("{}/{}-loaded/epoch_0", dir, type)));
    const double kept_mb = first_metric(fmt::format("{}/{}-kept", dir, type), "base_mb"),
                 loaded_mb = first_metric(fmt::format("{}/{}-loaded", dir, type), "base_mb");
    fmt::print("keep_quantized {}: base {:.3f} MiB vs {:.3f} MiB dequantised to fp32 ({:.3f}x)\n", type, kept_mb,
               loaded_mb, kept_mb / loaded_mb);
    CHECK(kept_mb < loaded_mb);
  }
  // 2 ranks in bf16 with activation checkpointing: the same again, and with the blocks' bytes
  // sliced across the ranks (dist.shard_base), each rank holding half of them
  const std::string cfg = recipe(dir, "Q6_K-bf16", dir + "/Q6_K.gguf");
  for (const std::string keep : {"false", "true", "sharded"}) {
    const Result r = sh(fmt::format(
        "{} --nproc-per-node 2 {} model.dtype=bf16 train.activation_checkpointing=true model.keep_quantized={} "
        "dist.shard_base={} checkpoint.output_dir={}/bf16-{}",
        bin("lorarun"), cfg, keep == "false" ? "false" : "true", keep == "sharded" ? "true" : "false", dir, keep));
    INFO(r.output);
    REQUIRE(r.status == 0);
  }
  CHECK(hashes(dir + "/bf16-true/epoch_0") == hashes(dir + "/bf16-false/epoch_0"));
  CHECK(hashes(dir + "/bf16-sharded/epoch_0") == hashes(dir + "/bf16-false/epoch_0"));
  const std::string log = read_file(dir + "/bf16-sharded/logs/rank_0.log");
  INFO(log);
  CHECK_THAT(log, Catch::Contains("base linears kept as the GGUF's blocks (Q6_K 14)"));
  CHECK_THAT(log, Catch::Contains("dist.shard_base: base weights on this rank 0.5 MiB of 0.9 MiB"));
}

TEST_CASE(
    "model.keep_quantized on gemma2, gemma3, phi3 (longrope) and llama 3.x (rope_freqs) Q4_1 files: the adapter of "
    "training on them dequantised at load, bit for bit, which generates and merges to a GGUF that reads back",
    "[e2e][gguf]") {
  const std::string root = temp_dir("keep-quantized-families");
  for (const std::string name : {"gemma2", "gemma3", "phi3_longrope", "llama3"}) {
    INFO(name);
    const std::string dir = root + "/" + name;
    const Oracle made = oracle(fmt::format("'{}' '{}/tests/reference/gguf_model_check.py' family {} '{}' Q4_1",
                                           LORARUN_PYTHON, LORARUN_SOURCE_DIR, name, dir));
    INFO(made.run.output);
    REQUIRE(made.run.status == 0);
    const auto ok = [](const std::string& cmd) {  // each tool run must succeed
      const Result r = sh(cmd);
      INFO(r.output);
      REQUIRE(r.status == 0);
    };
    const std::string cfg = recipe(dir, "train", dir + "/model.gguf");
    for (const std::string kept : {"false", "true"})
      ok(fmt::format("{} --nproc-per-node 1 {} checkpoint.output_dir={}/kept-{} model.keep_quantized={}",
                     bin("lorarun"), cfg, dir, kept, kept));
    CHECK(hashes(dir + "/kept-true/epoch_0") == hashes(dir + "/kept-false/epoch_0"));
    const std::string adapter = fmt::format("--model '{0}/model.gguf' --adapter '{0}/kept-true/epoch_0'", dir);
    ok(fmt::format("{} {} --prompt ABCD --max-new-tokens 6", bin("lora-generate"), adapter));
    ok(fmt::format("{} {} --out '{}/merged.gguf' --gguf-type q8_0", bin("lora-merge"), adapter, dir));
    ok(fmt::format("{} --model '{}/merged.gguf' --prompt ABCD --max-new-tokens 6", bin("lora-generate"), dir));
  }
}

TEST_CASE("model.keep_quantized: refusals are one line each, before training", "[e2e][gguf]") {
  const std::string dir = temp_dir("keep-quantized-bad");
  const std::string iq = quantized_model(dir, "IQ4_NL"), q8 = quantized_model(dir, "Q8_0");
  for (const auto& [model, overrides, expected] : {
           std::tuple{iq, std::string(),
                      std::string("tensor 'token_embd.weight' is IQ4_NL, which "
                                  "model.keep_quantized cannot hold (it keeps F32, F16, BF16")},
           std::tuple{std::string(LORARUN_MODEL_FIXTURES) + "/llama", std::string(),
                      std::string("model.keep_quantized keeps a GGUF file's own blocks, and model.path")},
           std::tuple{q8, std::string("lora.quantize_base=true"),
                      std::string("model.keep_quantized and lora.quantize_base are both set")},
           std::tuple{q8, std::string("lora.init=pissa"), std::string("which lora.init pissa would rewrite")},
       }) {
    const Result r = sh(fmt::format("{} --nproc-per-node 1 {} model.path={} model.keep_quantized=true {}",
                                    bin("lorarun"), recipe(dir, "bad", q8), model, overrides));
    INFO(r.output);
    CHECK(r.status != 0);
    CHECK_THAT(r.output, Catch::Contains(expected));
    CHECK_THAT(r.output, !Catch::Contains("terminate"));
    CHECK_FALSE(std::filesystem::exists(dir + "/bad/epoch_0"));
  }
}

TEST_CASE(
    "a GGUF whose block scale is NaN (or whose F16 value is infinite) is refused in one line naming the file and the "
    "tensor: by lora-train (dequantised at load and kept quantised), lora-generate and lora-merge",
    "[e2e][gguf]") {
  const std::string dir = temp_dir("gguf-not-finite");
  for (const auto& [type, patch] : {std::pair{"Q4_1", "007e"}, std::pair{"F16", "007c"}}) {
    INFO(type);
    const std::string file = quantized_model(dir, type);
    const std::string good = recipe(dir, std::string("good-") + type, file);
    const Result trained = sh(fmt::format("{} --nproc-per-node 1 {}", bin("lorarun"), good));
    INFO(trained.output);
    REQUIRE(trained.status == 0);
    const std::string adapter = fmt::format("{}/good-{}/epoch_0", dir, type);
    // The first block's scale (Q4_1: d, a float16 at its start) or the first value (F16) of one tensor,
    // as gguf-py finds it, made NaN (0x7e00) or +inf (0x7c00), little-endian.
    const Result patched = sh(fmt::format(
        "'{}' -c \"import gguf, sys; r = gguf.GGUFReader(sys.argv[1]); "
        "t = next(t for t in r.tensors if t.name == 'blk.0.ffn_down.weight'); "
        "f = open(sys.argv[1], 'r+b'); f.seek(int(t.data_offset)); f.write(bytes.fromhex(sys.argv[2]))\" '{}' {}",
        LORARUN_PYTHON, file, patch));
    INFO(patched.output);
    REQUIRE(patched.status == 0);
    const std::string says = fmt::format(
        "{}: tensor 'blk.0.ffn_down.weight' ({}) holds {} that is NaN or infinite: "
        "the file is damaged",
        file, type, std::string(type) == "F16" ? "value 0" : "block 0 with a scale");
    const std::string cfg = recipe(dir, std::string("bad-") + type, file);
    for (const std::string& cmd :
         {fmt::format("{} --nproc-per-node 1 {}", bin("lorarun"), cfg),
          fmt::format("{} --nproc-per-node 1 {} model.keep_quantized=true", bin("lorarun"), cfg),
          fmt::format("{} --model {} --adapter {} --prompt ABCD --max-new-tokens 4", bin("lora-generate"), file,
                      adapter),
          fmt::format("{} --model {} --adapter {} --out {}/merged-{}.gguf --gguf-type q8_0", bin("lora-merge"), file,
                      adapter, dir, type)}) {
      const Result r = sh(cmd);
      INFO(cmd);
      INFO(r.output);
      CHECK(r.status != 0);
      CHECK_THAT(r.output, Catch::Contains(says));
      CHECK_THAT(r.output, !Catch::Contains("internal error") && !Catch::Contains("train.lr"));
    }
    CHECK_FALSE(std::filesystem::exists(fmt::format("{}/merged-{}.gguf", dir, type)));
    CHECK_FALSE(std::filesystem::exists(fmt::format("{}/bad-{}/epoch_0", dir, type)));
  }
}
