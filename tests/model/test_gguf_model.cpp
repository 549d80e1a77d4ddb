// A .gguf model.path: config from the metadata, weights dequantised and renamed, logits against
// transformers' own GGUF loading of the same file (tests/reference/gguf_model_check.py).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <cstring>
#include <filesystem>
#include <map>
#include <span>
#include <string>
#include <vector>

#include "io/gguf.hpp"
#include "model/export.hpp"
#include "model/generate.hpp"
#include "model/gguf_blocks.hpp"
#include "model/gguf_export.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "support/oracle.hpp"
#include "support/process.hpp"
#include "util/error.hpp"

using namespace lorarun;
using namespace lorarun::model;

namespace {

const std::string kSmolLM2 =
    std::string(LORARUN_SOURCE_DIR) + "/.fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

test::Oracle gguf_model_check(const std::string& args) {
  return test::oracle(
      fmt::format("'{}' '{}/tests/reference/gguf_model_check.py' {} 2>&1", LORARUN_PYTHON, LORARUN_SOURCE_DIR, args));
}

void require_smollm2() {
  if (!std::filesystem::exists(kSmolLM2)) FAIL(kSmolLM2 << " is missing: run scripts/setup (or scripts/fetch-models)");
}

// The message CausalLM::load throws for `path`, or "" when it loads.
std::string load_error(const std::string& path) {
  try {
    CausalLM::load(path, at::kFloat, at::kCPU);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Writes transformers' logits for `file` to DIR/reference.safetensors (gguf_model_check.py logits)
// and returns the largest |difference| from `m`'s on the real tokens of that padded batch; with
// `greedy`, also whether m's 12 greedy ids after the batch's first 5 are transformers'.
double max_logit_diff_to_transformers(const CausalLM& m, const std::string& file, const std::string& dir,
                                      bool* greedy = nullptr) {
  const std::string ref_path = dir + "/reference.safetensors";
  const test::Oracle ref = gguf_model_check(fmt::format("logits '{}' '{}'", file, ref_path));
  INFO(ref.run.output);
  REQUIRE(ref.run.status == 0);
  REQUIRE(ref.fields.contains("written"));
  const auto files = WeightFiles::open_file(ref_path);
  const at::Tensor ids = files.load("input_ids", at::kLong, at::kCPU);
  const at::Tensor mask = files.load("attention_mask", at::kLong, at::kCPU);
  const at::Tensor expected = files.load("logits", at::kFloat, at::kCPU);
  c10::NoGradGuard no_grad;
  const at::Tensor logits = m.forward(ids, mask);
  const at::Tensor real = mask.to(at::kBool);
  REQUIRE(real.sum().item<int64_t>() == 32);  // 16 + 11 + 5 real tokens
  if (greedy) {
    const at::Tensor first = ids[0].slice(0, 0, 5).contiguous();
    const std::vector<int64_t> prompt(first.data_ptr<int64_t>(), first.data_ptr<int64_t>() + 5);
    GenerateOptions greedy_12;
    greedy_12.max_new_tokens = 12;  // greedy, no eos
    const std::vector<int64_t> ours = generate(m, {prompt}, {}, greedy_12)[0];
    *greedy = ours == ref.fields.at("greedy").get<std::vector<int64_t>>();
  }
  return (logits.index({real}) - expected.index({real})).abs().max().item<double>();
}

}  // namespace

TEST_CASE("gguf: SmolLM2-135M-Instruct from its .gguf gives transformers' logits on a padded batch",
          "[gguf][reference]") {
  require_smollm2();
  const CausalLM m = CausalLM::load(kSmolLM2, at::kFloat, at::kCPU);
  const ModelConfig& c = m.config();
  CHECK(c.model_type == "llama");
  CHECK(c.num_layers == 30);
  CHECK(c.hidden_size == 576);
  CHECK(c.intermediate_size == 1536);
  CHECK(c.num_heads == 9);
  CHECK(c.num_kv_heads == 3);
  CHECK(c.head_dim == 64);
  CHECK(c.vocab_size == 49152);
  CHECK(c.rope_theta == 100000.0);
  CHECK(c.tie_word_embeddings);
  CHECK(m.lm_head().is_same(m.state_dict().front().second));  // tied: one tensor, counted once
  CHECK(m.base_parameter_count() == 134515008);

  const double diff = max_logit_diff_to_transformers(m, kSmolLM2, test::temp_dir("gguf-model-logits"));
  fmt::print("gguf: SmolLM2-135M-Instruct.Q4_1 fp32: max |logit diff| vs transformers {:.3g}\n", diff);
  CHECK(diff <= 1e-4);
}

TEST_CASE(
    "gguf: tiny llama (GQA, tied), qwen2 (q/k/v bias, untied), qwen3 (q/k norms, head_dim 128) and gpt2 files give "
    "transformers' logits",
    "[gguf][reference]") {
  const std::string dir = test::temp_dir("gguf-model-tiny");
  for (const std::string arch : {"llama", "qwen2", "qwen3", "gpt2"}) {
    INFO(arch);
    const std::string file = fmt::format("{}/{}.gguf", dir, arch);
    const test::Oracle made = gguf_model_check(fmt::format("make '{}' {}", file, arch));
    INFO(made.run.output);
    REQUIRE(made.run.status == 0);
    const CausalLM m = CausalLM::load(file, at::kFloat, at::kCPU);
    CHECK(m.config().model_type == arch);
    CHECK(m.config().num_kv_heads == (arch == "gpt2" ? 4 : 2));
    if (arch != "gpt2") CHECK(m.config().rope_theta == 5000.0);
    CHECK(m.config().tie_word_embeddings == (arch == "llama"));
    CHECK(m.config().head_dim == (arch == "qwen3" ? 128 : 4));
    const double diff = max_logit_diff_to_transformers(m, file, dir);
    fmt::print("gguf: tiny {} fp32: max |logit diff| vs transformers {:.3g}\n", arch, diff);
    CHECK(diff <= 1e-4);
    // Written out as a HF directory (config.json from the metadata), transformers loads the same model.
    export_hf_model(m, fmt::format("{}/{}-hf", dir, arch), at::kFloat, int64_t{1} << 40);
    CHECK(max_logit_diff_to_transformers(m, fmt::format("{}/{}-hf", dir, arch), dir) <= 1e-4);
    // bf16 converts as it copies (Q and K rows reordered on the way): the fp32 weights, rounded.
    const CausalLM half = CausalLM::load(file, at::kBFloat16, at::kCPU);
    const auto full_weights = m.state_dict();
    const auto half_weights = half.state_dict();
    REQUIRE(half_weights.size() == full_weights.size());
    for (size_t i = 0; i < half_weights.size(); ++i) {
      INFO(half_weights[i].first);
      CHECK(half_weights[i].second.scalar_type() == at::kBFloat16);
      CHECK(at::equal(half_weights[i].second, full_weights[i].second.to(at::kBFloat16)));
    }
  }
}

TEST_CASE(
    "gguf: llama 3.x (rope_freqs), gemma2, gemma3 and phi3 (also longrope, partial rotary) files as llama.cpp's "
    "converter writes them give the logits and greedy ids of the transformers model they came from",
    "[gguf][reference]") {
  const std::string root = test::temp_dir("gguf-model-families");
  for (const std::string name : {"llama3", "gemma2", "gemma3", "phi3", "phi3_longrope"}) {
    INFO(name);
    const std::string dir = root + "/" + name;
    const test::Oracle made = gguf_model_check(fmt::format("family {} '{}'", name, dir));
    INFO(made.run.output);
    REQUIRE(made.run.status == 0);
    const CausalLM m = CausalLM::load(dir + "/model.gguf", at::kFloat, at::kCPU);
    const CausalLM hf = CausalLM::load(dir + "/hf", at::kFloat, at::kCPU);
    const ModelConfig& c = m.config();
    CHECK(c.model_type == made.fields.at("model_type").get<std::string>());
    CHECK(c.gemma == hf.config().gemma);
    CHECK(c.query_pre_attn_scalar == hf.config().query_pre_attn_scalar);
    CHECK(c.sliding_window == hf.config().sliding_window);
    CHECK(c.partial_rotary == hf.config().partial_rotary);
    CHECK(c.tie_word_embeddings == hf.config().tie_word_embeddings);
    bool greedy = false;
    const double diff = max_logit_diff_to_transformers(m, dir + "/hf", dir, &greedy);
    CHECK(diff <= 1e-4);
    CHECK(greedy);
    // transformers' own GGUF loading reads neither rope_freqs, nor phi3's longrope and partial rotary,
    // nor gemma3's linear scaling (it runs those files unscaled): there the model they came from is
    // the reference.
    const double as_gguf = max_logit_diff_to_transformers(m, dir + "/model.gguf", dir);
    const bool unscaled = name == "llama3" || name == "phi3_longrope" || name == "gemma3";
    if (!unscaled) CHECK(as_gguf <= 1e-4);
    // Written out as a HF directory (config.json from the metadata), transformers loads the same model.
    export_hf_model(m, dir + "/out-hf", at::kFloat, int64_t{1} << 40);
    const double exported = max_logit_diff_to_transformers(m, dir + "/out-hf", dir);
    CHECK(exported <= 1e-4);
    // Written back to an f32 GGUF: the converter's tensors and keys, and read back the same model.
    export_gguf(m, dir + "/out.gguf", io::GgmlType::F32);
    const test::Oracle same = gguf_model_check(fmt::format("same '{0}/model.gguf' '{0}/out.gguf'", dir));
    INFO(same.run.output);
    REQUIRE(same.run.status == 0);
    CHECK(same.fields.at("compared").get<int>() >= 15);  // phi3: 2 blocks of 6, and 3
    CHECK(same.fields.at("tensors").empty());
    CHECK(same.fields.at("keys").empty());
    const CausalLM again = CausalLM::load(dir + "/out.gguf", at::kFloat, at::kCPU);
    const auto before = m.state_dict(), after = again.state_dict();
    REQUIRE(after.size() == before.size());
    for (size_t i = 0; i < after.size(); ++i) {
      INFO(after[i].first);
      CHECK(after[i].first == before[i].first);
      CHECK(at::equal(after[i].second, before[i].second));
    }
    fmt::print(
        "gguf: {} fp32: max |logit diff| vs transformers on the HF model {:.3g}, on the GGUF {:.3g}{}, on our HF "
        "export {:.3g}; greedy {}\n",
        name, diff, as_gguf, unscaled ? " (transformers leaves the rope scaling out)" : "", exported,
        greedy ? "identical" : "DIFFERENT");
  }
}

TEST_CASE("gguf: a soft-cap, rope factor or rope length that would divide by zero or go negative is one line",
          "[gguf]") {
  const std::string root = test::temp_dir("gguf-model-hostile-values");
  for (const auto& [name, poked, value, expected] : {
           std::tuple{"gemma2", "gemma2.attn_logit_softcapping", "0", "gemma2.attn_logit_softcapping is 0"},
           std::tuple{"gemma3", "gemma3.rope.freq_base_swa", "-1", "gemma3.rope.freq_base_swa is -1"},
           std::tuple{"llama3", "rope_freqs.weight", "0", "a value of 'rope_freqs.weight' is 0"},
           std::tuple{"phi3_longrope", "rope_factors_long.weight", "nan",
                      "a value of 'rope_factors_long.weight' is nan"},
           std::tuple{"phi3_longrope", "phi3.rope.scaling.original_context_length", "0",
                      "phi3.rope.scaling.original_context_length is 0"},
       }) {
    INFO(poked);
    const std::string dir = fmt::format("{}/{}-{}", root, name, poked);
    for (const std::string& args :
         {fmt::format("family {} '{}'", name, dir), fmt::format("poke '{}/model.gguf' {} {}", dir, poked, value)}) {
      const test::Oracle made = gguf_model_check(args);
      INFO(made.run.output);
      REQUIRE(made.run.status == 0);
    }
    const std::string e = load_error(dir + "/model.gguf");
    CHECK_THAT(e, Catch::Contains(expected) && Catch::Contains("it must be a number above 0"));
    CHECK(test::count_lines(e) == 1);
  }
}

TEST_CASE("gguf: a HF llama with Llama 3.1 rope scaling written to GGUF carries it as rope_freqs", "[gguf]") {
  const std::string dir = test::temp_dir("gguf-model-rope-freqs");
  const CausalLM hf = CausalLM::load(std::string(LORARUN_MODEL_FIXTURES) + "/llama", at::kFloat, at::kCPU);
  REQUIRE(hf.config().rope.type == "llama3");
  export_gguf(hf, dir + "/llama.gguf", io::GgmlType::F32);
  const CausalLM m = CausalLM::load(dir + "/llama.gguf", at::kFloat, at::kCPU);
  CHECK(m.config().rope.type == "longrope");  // one divisor a frequency, never switching
  c10::NoGradGuard no_grad;
  const at::Tensor ids = at::arange(3, 40, at::kLong).view({1, 37});  // past original_max_position_embeddings (16)
  const double diff = (m.forward(ids, at::Tensor()) - hf.forward(ids, at::Tensor())).abs().max().item<double>();
  fmt::print("gguf: llama 3.1 rope written as rope_freqs: max |logit diff| {:.3g}\n", diff);
  CHECK(diff <= 1e-5);
}

TEST_CASE("gguf: QLoRA quantises a GGUF model's linears to NF4 as it loads", "[gguf]") {
  require_smollm2();
  const CausalLM m = CausalLM::load(kSmolLM2, at::kFloat, at::kCPU, LoadOptions{.quantize = true});
  const auto linears = m.linears();
  REQUIRE(linears.size() == 30 * 7);
  for (const Linear* l : linears) {
    INFO(l->name);
    CHECK(l->nf4.has_value());
    CHECK_FALSE(l->weight.defined());
  }
  c10::NoGradGuard no_grad;
  const at::Tensor logits = m.forward(at::arange(1, 5, at::kLong).view({1, 4}), at::Tensor());
  CHECK(logits.isfinite().all().item<bool>());
}

TEST_CASE("gguf: an unsupported architecture or a missing key is one line naming it", "[gguf]") {
  const std::string dir = test::temp_dir("gguf-model-bad");
  for (const std::string& args : {fmt::format("make '{}/gemma.gguf' gemma", dir),
                                  fmt::format("make '{}/no-blocks.gguf' llama llama.block_count", dir),
                                  fmt::format("make '{}/tiny.gguf' llama", dir)}) {
    const test::Oracle made = gguf_model_check(args);
    INFO(made.run.output);
    REQUIRE(made.run.status == 0);
  }
  const std::string arch = load_error(dir + "/gemma.gguf");
  CHECK_THAT(arch, Catch::Contains("GGUF architecture 'gemma' is not supported; supported: llama"));
  const std::string key = load_error(dir + "/no-blocks.gguf");
  CHECK_THAT(key, Catch::Contains("no metadata key 'llama.block_count'"));
  const std::string missing = load_error(dir + "/absent.gguf");
  CHECK_THAT(missing, Catch::Contains("does not exist"));
  for (const std::string& e : {arch, key, missing}) CHECK(e.find('\n') == std::string::npos);
  CHECK(load_error(dir + "/tiny.gguf").empty());  // the same file with every key loads
}

TEST_CASE("gguf: metadata quoted in a message is escaped, and zero attention heads are named as such", "[gguf]") {
  const std::string dir = test::temp_dir("gguf-model-hostile");
  // An architecture name that would clear a terminal and start a new line.
  const test::Oracle odd = gguf_model_check(fmt::format("make '{}/odd.gguf' 'll\\x1b[2Jama\\n'", dir));
  INFO(odd.run.output);
  REQUIRE(odd.run.status == 0);
  const std::string e = load_error(dir + "/odd.gguf");
  CHECK_THAT(e, Catch::Contains("GGUF architecture 'll\\x1b[2Jama\\n' is not supported"));
  CHECK(e.find('\x1b') == std::string::npos);
  CHECK(e.find('\n') == std::string::npos);
  const test::Result tool =
      test::sh(fmt::format("{} --model '{}/odd.gguf' --prompt a", test::bin("lora-generate"), dir));
  CHECK(tool.status != 0);
  CHECK(tool.output.find('\x1b') == std::string::npos);
  CHECK(test::count_lines(tool.output) == 1);
  // head_count 0 (with a rotary size given): the heads are blamed, not the rotary embedding.
  const test::Oracle zero =
      gguf_model_check(fmt::format("make '{}/zero-heads.gguf' llama '' attention.head_count=0", dir));
  INFO(zero.run.output);
  REQUIRE(zero.run.status == 0);
  CHECK_THAT(load_error(dir + "/zero-heads.gguf"),
             Catch::Contains("llama.attention.head_count is 0 and head_count_kv 2: "
                             "both must be positive"));
}

TEST_CASE("gguf: metadata naming more blocks or tokens than the tensors hold is one line naming both", "[gguf]") {
  const std::string dir = test::temp_dir("gguf-model-counts");
  for (const std::string& args : {fmt::format("make '{}/three-blocks.gguf' llama '' block_count=3", dir),
                                  fmt::format("make '{}/one-block.gguf' llama '' block_count=1", dir),
                                  fmt::format("make '{}/long-vocab.gguf' llama '' vocab_size=40", dir)}) {
    const test::Oracle made = gguf_model_check(args);
    INFO(made.run.output);
    REQUIRE(made.run.status == 0);
  }
  const std::string blocks = load_error(dir + "/three-blocks.gguf");
  CHECK_THAT(blocks, Catch::Contains("llama.block_count is 3 but the file holds tensors for 2 block(s)"));
  // Fewer blocks named than stored: the tensors left over are named.
  const std::string fewer = load_error(dir + "/one-block.gguf");
  CHECK_THAT(fewer, Catch::Contains("tensor 'blk.1.") && Catch::Contains("has no place in the llama model"));
  const std::string vocab = load_error(dir + "/long-vocab.gguf");
  CHECK_THAT(vocab, Catch::Contains("token_embd.weight has 32 rows but the vocabulary has 40 tokens "
                                    "(llama.vocab_size): the embedding is shorter than the vocabulary"));
  for (const std::string& e : {blocks, fewer, vocab}) CHECK(test::count_lines(e) == 1);
}

TEST_CASE(
    "keep_quantized on a GPU: every block type dequantised with tensor operations gives the CPU kernels' values "
    "bit for bit",
    "[gguf]") {
  using io::GgmlType;
  // random blocks whose fp16 scales are finite (the other bytes: any value)
  const auto blocks = [](GgmlType type, int64_t n, uint64_t seed) {
    const auto bytes = static_cast<int64_t>(io::ggml_block_bytes(type)),
               size = static_cast<int64_t>(io::ggml_block_size(type));
    at::Tensor raw = at::randint(0, 256, {n / size, bytes}, at::make_generator<at::CPUGeneratorImpl>(seed),
                                 at::TensorOptions().dtype(at::kByte));
    const at::Tensor scales =
        (at::rand({n / size, bytes / 2}, at::make_generator<at::CPUGeneratorImpl>(seed + 1)) - 0.5)
            .to(at::kHalf)
            .view(at::kByte)
            .view({n / size, bytes / 2 * 2});
    // the fp16 fields of each layout (as io's kernels read them)
    const std::map<GgmlType, std::vector<int64_t>> halves = {
        {GgmlType::F16, {0}},     {GgmlType::Q4_0, {0}},    {GgmlType::Q4_1, {0, 2}},   {GgmlType::Q5_0, {0}},
        {GgmlType::Q5_1, {0, 2}}, {GgmlType::Q8_0, {0}},    {GgmlType::Q2_K, {80, 82}}, {GgmlType::Q3_K, {108}},
        {GgmlType::Q4_K, {0, 2}}, {GgmlType::Q5_K, {0, 2}}, {GgmlType::Q6_K, {208}}};
    if (const auto it = halves.find(type); it != halves.end())
      for (const int64_t at : it->second) raw.narrow(1, at, 2).copy_(scales.narrow(1, at, 2));
    if (type == GgmlType::BF16)
      raw = scales.narrow(1, 0, 2).contiguous().view(at::kHalf).to(at::kBFloat16).view(at::kByte);
    return raw.reshape({-1});
  };
  std::vector<at::Device> devices = {at::kCPU};
  if (at::hasCUDA()) devices.emplace_back(at::kCUDA);
  for (const GgmlType type :
       {GgmlType::F16, GgmlType::BF16, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q5_0, GgmlType::Q5_1, GgmlType::Q8_0,
        GgmlType::Q2_K, GgmlType::Q3_K, GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K}) {
    const int64_t n = 256 * 48;
    const at::Tensor raw = blocks(type, n, 7 + static_cast<uint64_t>(type));
    std::vector<float> want(static_cast<size_t>(n));
    io::dequantize(type, std::span(static_cast<const std::byte*>(raw.data_ptr()), static_cast<size_t>(raw.numel())),
                   want);
    for (const at::Device& device : devices) {
      INFO(io::ggml_type_name(type) << " on " << device);
      const at::Tensor got = dequantize_on_device(type, raw.to(device), n).cpu().contiguous();
      REQUIRE(got.numel() == n);
      CHECK(std::memcmp(got.data_ptr<float>(), want.data(), want.size() * sizeof(float)) == 0);
    }
  }
  // and through a kept linear: Q and K rows put back in HF's order, into the model's dtype
  GgufBlocks w{.raw = blocks(GgmlType::Q4_K, 64 * 256, 3),
               .type = GgmlType::Q4_K,
               .shape = {64, 256},
               .heads = 4,
               .dtype = at::kBFloat16,
               .device = at::kCPU};
  const at::Tensor cpu = w.dequantize();
  CHECK(at::equal(w.dequantize_with_tensor_ops(), cpu));
  if (at::hasCUDA()) {
    GgufBlocks on = w;
    on.raw = w.raw.to(at::kCUDA);
    on.device = at::kCUDA;
    CHECK(at::equal(on.dequantize().cpu(), cpu));
  }
}

TEST_CASE(
    "gguf: a tiny qwen3moe file (llama.cpp's expert stacks) gives transformers' logits and greedy ids, written out "
    "as a HF directory too, and an expert count the tensors disagree with is one line",
    "[gguf][reference]") {
  const std::string dir = test::temp_dir("gguf-moe");
  const test::Oracle made = gguf_model_check(fmt::format("family qwen3moe '{}'", dir));
  INFO(made.run.output);
  REQUIRE(made.run.status == 0);
  const std::string file = dir + "/model.gguf";
  const CausalLM m = CausalLM::load(file, at::kFloat, at::kCPU);
  CHECK(m.config().model_type == "qwen3_moe");
  CHECK(m.config().moe.experts == 4);
  CHECK(m.moe_layers().size() == 2);
  bool greedy = false;
  const double diff = max_logit_diff_to_transformers(m, file, dir, &greedy);
  fmt::print("gguf: tiny qwen3moe fp32: max |logit diff| vs transformers {:.3g}\n", diff);
  CHECK(diff <= 1e-4);
  CHECK(greedy);
  export_hf_model(m, dir + "/out-hf", at::kFloat, int64_t{1} << 40);
  CHECK(max_logit_diff_to_transformers(m, dir + "/out-hf", dir) <= 1e-4);
  CHECK_THROWS_WITH(CausalLM::load(file, at::kFloat, at::kCPU, {.keep_quantized = true}),
                    Catch::Contains("model.keep_quantized does not hold a mixture of experts"));

  // an expert size no tensor has: refused by the first stack's shape, before the stacks are allocated
  REQUIRE(gguf_model_check(fmt::format("poke '{}' qwen3moe.expert_feed_forward_length 1000000000", file)).run.status ==
          0);
  CHECK_THAT(load_error(file), Catch::Contains("'blk.0.ffn_gate_exps.weight' has shape [4, 768, 64] but the metadata "
                                               "implies [4, 1000000000, 64]"));
  REQUIRE(gguf_model_check(fmt::format("poke '{}' qwen3moe.expert_feed_forward_length 768", file)).run.status == 0);
  const test::Oracle poked = gguf_model_check(fmt::format("poke '{}' qwen3moe.expert_count 8", file));
  REQUIRE(poked.run.status == 0);
  const std::string error = load_error(file);
  CHECK_THAT(error, Catch::Contains("'blk.0.ffn_gate_inp.weight' has shape [4, 64] but the metadata implies [8, 64]") &&
                        Catch::Contains("re-convert the model"));
  CHECK(error.find('\n') == std::string::npos);
}
