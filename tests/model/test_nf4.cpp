// QLoRA: NF4 weights bit for bit against bitsandbytes; logits, training, eval and merge against
// transformers + PEFT on the NF4 round-tripped base (tests/reference/nf4_check.py), computed the same
// way on every CPU (LORARUN_TEST_FORCE_BNB_AVX512BF16=1 runs the references as on an AVX-512 BF16 one).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <malloc.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>

#include "model/lora.hpp"
#include "model/loss.hpp"
#include "model/nf4.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "support/oracle.hpp"

using namespace lorarun;
using namespace lorarun::model;

namespace {

const std::string kFixtures = LORARUN_MODEL_FIXTURES;

std::string nf4_check(const std::string& args) {
  return fmt::format("'{}' '{}/tests/reference/nf4_check.py' {}", LORARUN_PYTHON, LORARUN_SOURCE_DIR, args);
}

std::map<std::string, at::Tensor> load_all(const std::string& path) {
  std::map<std::string, at::Tensor> t;
  const auto files = WeightFiles::open_file(path);
  for (const std::string& n : files.names()) t[n] = files.load(n, to_scalar_type(files.info(n).dtype), at::kCPU);
  return t;
}

CausalLM load(const std::string& family, bool quantize, bool double_quant = true) {
  return CausalLM::load(kFixtures + "/" + family, at::kFloat, at::kCPU, {quantize, double_quant});
}

double max_diff(const at::Tensor& a, const at::Tensor& b) { return (a - b).abs().max().item<double>(); }

// Resident memory of this process in bytes.
int64_t rss() {
  std::ifstream f("/proc/self/statm");
  int64_t size = 0, resident = 0;
  f >> size >> resident;
  return resident * sysconf(_SC_PAGESIZE);
}

// A random adapter on every linear, B non-zero so it matters.
LoraConfig random_adapter(CausalLM& m) {
  LoraConfig cfg;
  cfg.r = 4;
  cfg.alpha = 8;
  cfg.target_modules = {"all-linear"};
  attach_lora(m, cfg, 11);
  c10::NoGradGuard no_grad;
  for (auto& [name, p] : lora_state(m)) p.normal_(0, 0.05);
  return cfg;
}

}  // namespace

TEST_CASE("NF4 codes and scales equal bitsandbytes', bit for bit, with and without double quantisation",
          "[reference]") {
  const std::string dir = test::temp_dir("nf4-quant");
  const test::Result r = test::sh(nf4_check(fmt::format("quant {}/bnb.safetensors", dir)));
  INFO(r.output);
  REQUIRE(r.status == 0);
  const auto ref = load_all(dir + "/bnb.safetensors");
  CHECK(at::equal(nf4_levels(), ref.at("nf4_levels")));
  int cases = 0;
  for (const auto& [key, w] : ref) {
    if (!key.ends_with(".w")) continue;
    const std::string c = key.substr(0, key.size() - 2);
    INFO(c);
    ++cases;
    const Nf4Weight plain = quantize_nf4(w, false);
    CHECK(at::equal(plain.packed, ref.at(c + ".packed")));
    CHECK(at::equal(plain.absmax, ref.at(c + ".absmax")));
    CHECK(at::equal(plain.dequantize(), ref.at(c + ".dequant")));
    const Nf4Weight dq = quantize_nf4(w, true);
    CHECK(at::equal(dq.packed, ref.at(c + ".packed")));
    CHECK(at::equal(dq.absmax8.codes, ref.at(c + ".dq.absmax8")));
    CHECK(at::equal(dq.offset.reshape(1), ref.at(c + ".dq.offset")));
    CHECK(at::equal(dq.absmax8.absmax, ref.at(c + ".dq.absmax2")));
    CHECK(at::equal(dq.absmax8.code, ref.at(c + ".dq.code")));
    CHECK(at::equal(dq.dequantize(), ref.at(c + ".dq.dequant")));
    CHECK(dq.dequantize().scalar_type() == w.scalar_type());
  }
  CHECK(cases == 16);  // fp32 and bf16: 6 shapes + edge cases each; fp16: one shape + edge cases
  for (const char* probe : {"probes", "random", "zero_block"}) {
    INFO(probe);
    const std::string p = fmt::format("b8.{}.", probe);
    const Blockwise8 q = quantize_blockwise8(ref.at(p + "x"));
    CHECK(at::equal(q.codes, ref.at(p + "codes")));
    CHECK(at::equal(q.absmax, ref.at(p + "absmax")));
  }
}

TEST_CASE("the NF4 linear's gradient equals a plain linear's on the dequantised weight") {
  const at::Tensor w = at::randn({48, 40}) * 0.05, b = at::randn({48});
  const at::Tensor g = at::randn({3, 5, 48});
  for (const bool dq : {true, false}) {
    const Nf4Weight q = quantize_nf4(w, dq);
    const at::Tensor x = at::randn({3, 5, 40}).requires_grad_(true), x2 = x.detach().clone().requires_grad_(true);
    const at::Tensor y = nf4_linear(x, q, b), y2 = at::linear(x2, q.dequantize(), b);
    (y * g).sum().backward();
    (y2 * g).sum().backward();
    CHECK(at::equal(y, y2));
    CHECK(max_diff(x.grad(), x2.grad()) <= 1e-6);
  }
}

TEST_CASE("LoRA gradients through NF4 base linears equal those through plain linears holding the dequantised weights") {
  for (const std::string family : {"llama", "gpt2", "opt"}) {
    INFO(family);
    const auto ref = load_all(kFixtures + "/" + family + "/reference.safetensors");
    // NF4; NF4 with activation checkpointing (blocks run again in backward); plain linears.
    CausalLM q = load(family, true), q_recompute = load(family, true), plain = load(family, false);
    q_recompute.recompute_activations = true;
    {
      c10::NoGradGuard no_grad;
      auto ql = q.linears(), pl = plain.linears();
      for (size_t i = 0; i < ql.size(); ++i) pl[i]->weight.copy_(ql[i]->nf4->dequantize());
    }
    std::vector<std::vector<at::Tensor>> grads;
    for (CausalLM* m : {&plain, &q, &q_recompute}) {
      load_adapter(*m, kFixtures + "/" + family + "/peft_adapter");
      m->training = true;
      const LossSum l = causal_lm_loss(m->forward(ref.at("input_ids"), ref.at("attention_mask")), ref.at("labels"));
      (l.sum / l.count).backward();
      grads.emplace_back();
      for (const at::Tensor& p : lora_parameters(*m)) grads.back().push_back(p.grad());
    }
    REQUIRE_FALSE(grads[0].empty());
    CHECK(grads[0][0].abs().max().item<double>() > 1e-4);  // the gradients are not all (nearly) zero
    for (size_t k : {1, 2}) {
      INFO((k == 1 ? "NF4" : "NF4 with activation checkpointing"));
      REQUIRE(grads[k].size() == grads[0].size());
      double worst = 0;
      for (size_t i = 0; i < grads[0].size(); ++i) worst = std::max(worst, max_diff(grads[k][i], grads[0][i]));
      INFO("max abs LoRA gradient difference " << worst);
      CHECK(worst <= 1e-6);
    }
  }
}

TEST_CASE("the NF4 linear keeps no dequantised weight between forward and backward") {
  // 4096 x 4096: the dequantised float32 weight is 64 MiB, the NF4 one 8.6 MiB. With every block
  // of 1 MiB or more from mmap, freed memory goes back to the system at once and resident memory
  // tells what lives.
  mallopt(M_MMAP_THRESHOLD, 1 << 20);
  const Nf4Weight q = quantize_nf4(at::randn({4096, 4096}) * 0.02, true);
  const at::Tensor x = at::randn({2, 4096}).requires_grad_(true);
  const int64_t before = rss();
  at::Tensor y = nf4_linear(x, q, at::Tensor());
  const int64_t held = rss() - before;
  y.sum().backward();
  // The control: at::linear saves the dequantised weight for its backward.
  const int64_t before_plain = rss();
  at::Tensor y2 = at::linear(x, q.dequantize(), at::Tensor());
  const int64_t held_plain = rss() - before_plain;
  INFO("held after forward: NF4 linear " << held << " bytes, plain linear " << held_plain << " bytes");
  CHECK(held < (16 << 20));
  CHECK(held_plain >= (60 << 20));
  CHECK(x.grad().defined());
}

TEST_CASE("a QLoRA model keeps NF4 linears only, every base name, and about half a byte per parameter") {
  const CausalLM plain = load("llama", false);
  for (const bool dq : {true, false}) {
    INFO("double quant " << dq);
    const CausalLM q = load("llama", true, dq);
    for (const Linear* l : q.linears()) {
      INFO(l->name);
      CHECK_FALSE(l->weight.defined());
      REQUIRE(l->nf4);
      // Codes at 4 bits; scales at 32 bits per block of 64, or 8 bits plus 32 per 256 blocks and the
      // offset; the tables: 256 byte pairs and, doubly quantised, the 8-bit map.
      const int64_t n = l->nf4->numel(), blocks = (n + 63) / 64;
      const int64_t scales = dq ? blocks + 4 * ((blocks + 255) / 256) + 4 : 4 * blocks;
      CHECK(l->nf4->bytes() == (n + 1) / 2 + scales + 256 * 2 * 4 + (dq ? 256 * 4 : 0));
    }
    CHECK(q.base_parameter_count() == plain.base_parameter_count());
    const auto sd = q.state_dict(), psd = plain.state_dict();
    REQUIRE(sd.size() == psd.size());
    for (size_t i = 0; i < sd.size(); ++i) {
      CHECK(sd[i].first == psd[i].first);
      CHECK(sd[i].second.sizes() == psd[i].second.sizes());
    }
    CHECK(trainable_summary(q) == trainable_summary(plain));
  }
}

TEST_CASE("QLoRA logits equal transformers + PEFT on bitsandbytes' NF4 weights", "[reference]") {
  const std::string out = test::temp_dir("nf4-logits");
  std::string cases;
  for (const std::string family : nlohmann::json::parse(test::read_file(kFixtures + "/families.json"))) {
    const auto ref = load_all(kFixtures + "/" + family + "/reference.safetensors");
    for (const bool dq : {true, false}) {
      const std::string c = fmt::format("{}-dq{}", family, int(dq)), dir = out + "/" + c;
      CausalLM m = load(family, true, dq);
      const LoraConfig cfg = random_adapter(m);
      save_adapter(m, cfg, dir);
      c10::NoGradGuard no_grad;
      const at::Tensor logits = m.forward(ref.at("input_ids"), ref.at("attention_mask"));
      save_tensors(
          dir + "/expected.safetensors",
          {{"input_ids", ref.at("input_ids")}, {"attention_mask", ref.at("attention_mask")}, {"logits", logits}});
      cases += " " + c;
    }
  }
  const test::Result r = test::sh(nf4_check(fmt::format("logits {} {}{}", kFixtures, out, cases)));
  INFO(r.output);
  CHECK(r.status == 0);
}

// (No semicolons in test names: CTest's test discovery splits names there.)
TEST_CASE(
    "lora-train with lora.quantize_base follows transformers + PEFT on the NF4 base, PEFT loads the adapter "
    "onto a 4-bit model, lora-eval --quantize-base agrees",
    "[e2e][reference]") {
  const std::string dir = test::temp_dir("qlora-train");
  {
    std::ofstream data(dir + "/data.jsonl"), docs(dir + "/docs.jsonl");
    for (int i = 0; i < 12; ++i) {
      data << nlohmann::json{{"instruction", fmt::format("Add {} and {}", i, 3 * i + 1)},
                             {"output", std::to_string(4 * i + 1)}}
                  .dump()
           << "\n";
      docs << nlohmann::json{{"text", fmt::format("Q: Add {} and {}\nA: {}", i, i + 2, 2 * i + 2)}}.dump() << "\n";
    }
  }
  const test::Result init =
      test::sh(fmt::format("'{}' '{}/tests/reference/train_reference.py' init {}/llama {}/init 4 8 7", LORARUN_PYTHON,
                           LORARUN_SOURCE_DIR, kFixtures, dir));
  REQUIRE(init.status == 0);
  for (const bool dq : {true, false}) {  // without double quantisation, with activation checkpointing
    const std::string name = fmt::format("dq{}", int(dq));
    std::ofstream(dir + "/" + name + ".yaml") << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear, quantize_base: true, double_quant: {}, init_from: {}/init}}
data: {{source: jsonl, path: {}/data.jsonl, format: instruction, prompt_template: "Q: {{instruction}}\nA: ", shuffle: none, batch_size: 2}}
train: {{epochs: 2, lr: 5.0e-3, warmup_steps: 2, lr_scheduler: cosine, activation_checkpointing: {}}}
checkpoint: {{output_dir: {}/{}}}
track: {{mongodb: false}}
)",
                                                             kFixtures, dq, dir, dir, !dq, dir, name);
    const test::Result t = test::sh(fmt::format("{} --nproc-per-node 2 {}/{}.yaml", test::bin("lorarun"), dir, name));
    INFO(t.output);
    REQUIRE(t.status == 0);
    CHECK_THAT(t.output, Catch::Contains("base linears in NF4"));
    const test::Oracle ref = test::oracle(nf4_check(fmt::format(
        "train {} {}/llama {}/init {}/data.jsonl {}/{} 2 2 1 2 5e-3 2", int(dq), kFixtures, dir, dir, dir, name)));
    INFO(ref.run.output);
    CHECK(ref.run.status == 0);
    CHECK(ref.fields.value("match", false));
    // PEFT on transformers' own 4-bit model: compared where bitsandbytes' CPU path is the reference's,
    // otherwise loaded or skipped with the reason shown as a WARN.
    const std::string peft_4bit = ref.fields.value("peft_4bit", "");
    CHECK((peft_4bit == "compared" || ((peft_4bit == "loaded" || peft_4bit == "skipped") && !ref.warnings.empty())));
    if (peft_4bit == "compared") CHECK(ref.fields.at("peft_4bit_logit_diff").get<double>() <= 1e-4);

    const std::string adapter = fmt::format("{}/{}/epoch_1", dir, name);
    const test::Result e = test::sh(
        fmt::format("{} --model {}/llama --adapter {} --quantize-base {} --data {}/docs.jsonl "
                    "--max-length 16 --per-doc {}/{}.losses.jsonl",
                    test::bin("lora-eval"), kFixtures, adapter, dq ? "" : "--no-double-quant", dir, dir, name));
    INFO(e.output);
    REQUIRE(e.status == 0);
    const test::Result c = test::sh(nf4_check(fmt::format("eval {} {}/llama {} {}/docs.jsonl 16 {}/{}.losses.jsonl",
                                                          int(dq), kFixtures, adapter, dir, dir, name)));
    INFO(c.output);
    CHECK(c.status == 0);
  }
}

TEST_CASE("lora-merge --qlora folds the adapter into dequantize(quantize(W))", "[e2e][reference]") {
  const std::string dir = test::temp_dir("qlora-merge");
  // (family, the dtype training quantised from, double quant)
  for (const auto& [family, from, dq] :
       {std::tuple{"llama", "fp32", true}, {"gpt2", "fp32", true}, {"llama", "bf16", false}}) {
    INFO(family << " " << from << " dq " << dq);
    const std::string base = kFixtures + "/" + family, out = fmt::format("{}/{}-{}-{}", dir, family, from, int(dq));
    const test::Result r =
        test::sh(fmt::format("{} --model {} --adapter {}/peft_adapter --out {} --dtype fp32 --qlora "
                             "--qlora-dtype {} {}",
                             test::bin("lora-merge"), base, base, out, from, dq ? "" : "--no-double-quant"));
    INFO(r.output);
    REQUIRE(r.status == 0);
    const test::Result c =
        test::sh(nf4_check(fmt::format("merge {} {}/peft_adapter {} {} {}", base, base, out, from, int(dq))));
    INFO(c.output);
    CHECK(c.status == 0);
  }
  const test::Result bad = test::sh(
      fmt::format("{} --model {}/llama --adapter x --out y --no-double-quant", test::bin("lora-merge"), kFixtures));
  CHECK(bad.status != 0);
  CHECK_THAT(bad.output, Catch::Contains("--no-double-quant requires --qlora"));
}
