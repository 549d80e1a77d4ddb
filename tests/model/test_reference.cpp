// Our transformer families and LoRA against transformers + PEFT, on fixtures they made.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "model/lora.hpp"
#include "model/loss.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "support/process.hpp"

using namespace lorarun;
using namespace lorarun::model;
namespace fs = std::filesystem;

namespace {

const std::string kFixtures = LORARUN_MODEL_FIXTURES;

std::vector<std::string> families() {
  return nlohmann::json::parse(io::read_file(kFixtures + "/families.json")).get<std::vector<std::string>>();
}

struct Reference {
  std::map<std::string, at::Tensor> t;
  explicit Reference(const std::string& family) {
    const auto files = WeightFiles::open_file(kFixtures + "/" + family + "/reference.safetensors");
    for (const std::string& n : files.names()) {
      const auto dtype = to_scalar_type(files.info(n).dtype);
      t[n] = files.load(n, dtype, at::kCPU);
    }
  }
  const at::Tensor& operator[](const std::string& k) const { return t.at(k); }
};

// Largest |a - b| over real (unpadded) token positions.
double max_diff_on_tokens(const at::Tensor& a, const at::Tensor& b, const at::Tensor& mask) {
  const at::Tensor real = mask.to(at::kBool);
  return (a.index({real}) - b.index({real})).abs().max().item<double>();
}

CausalLM load(const std::string& family) { return CausalLM::load(kFixtures + "/" + family, at::kFloat, at::kCPU); }

}  // namespace

TEST_CASE("logits of every family equal transformers' on a padded batch", "[reference]") {
  for (const std::string& family : families()) {
    INFO(family);
    const Reference ref(family);
    const CausalLM m = load(family);
    c10::NoGradGuard no_grad;
    const at::Tensor logits = m.forward(ref["input_ids"], ref["attention_mask"]);
    const double diff = max_diff_on_tokens(logits, ref["logits"], ref["attention_mask"]);
    fmt::print("reference: {} fp32: max |logit diff| vs transformers {:.2g}\n", family, diff);
    CHECK(diff <= 1e-4);
  }
}

// The fixtures' two PEFT adapters: plain LoRA, and DoRA (reference values under "dora_").
struct Variant {
  const char* adapter;
  const char* prefix;
};
constexpr Variant kVariants[] = {{"peft_adapter", ""}, {"peft_dora_adapter", "dora_"}};

TEST_CASE("an adapter PEFT saved (LoRA, DoRA) loads and gives PEFT's logits, merged too", "[reference]") {
  for (const Variant& v : kVariants)
    for (const std::string& family : families()) {
      INFO(family << " " << v.adapter);
      const Reference ref(family);
      CausalLM m = load(family);
      load_adapter(m, kFixtures + "/" + family + "/" + v.adapter);
      c10::NoGradGuard no_grad;
      const at::Tensor logits = m.forward(ref["input_ids"], ref["attention_mask"]);
      const double diff = max_diff_on_tokens(logits, ref[v.prefix + std::string("peft_logits")], ref["attention_mask"]);
      merge_lora(m);
      const at::Tensor merged = m.forward(ref["input_ids"], ref["attention_mask"]);
      const double merged_diff =
          max_diff_on_tokens(merged, ref[v.prefix + std::string("merged_logits")], ref["attention_mask"]);
      fmt::print("reference: {} + PEFT's {}: max |logit diff| vs PEFT {:.2g}, merged {:.2g}\n", family, v.adapter, diff,
                 merged_diff);
      CHECK(diff <= 1e-4);
      CHECK(merged_diff <= 1e-4);
    }
}

TEST_CASE("loss and LoRA (and DoRA) gradients after one backward equal PEFT's", "[reference]") {
  for (const Variant& v : kVariants)
    for (const std::string& family : families()) {
      INFO(family << " " << v.adapter);
      const Reference ref(family);
      CausalLM m = load(family);
      load_adapter(m, kFixtures + "/" + family + "/" + v.adapter);
      m.training = true;
      const LossSum l = causal_lm_loss(m.forward(ref["input_ids"], ref["attention_mask"]), ref["labels"]);
      const at::Tensor loss = l.sum / l.count;
      loss.backward();
      const double want_loss = ref[v.prefix + std::string("loss")].item<double>();
      const double loss_rel = std::abs(loss.item<double>() - want_loss) / want_loss;
      CHECK(loss_rel <= 1e-5);
      const std::string grad = v.prefix + std::string("grad.");
      int compared = 0;
      double worst = 0;
      for (const auto& [name, param] : lora_state(m)) {
        INFO(name);
        const at::Tensor& want = ref[grad + name];
        REQUIRE(param.grad().defined());
        const double rel = (param.grad() - want).abs().max().item<double>() / want.abs().max().item<double>();
        CHECK(rel <= 1e-4);
        worst = std::max(worst, rel);
        ++compared;
      }
      fmt::print("reference: {} {} loss rel diff {:.2g}, worst of {} gradients rel diff {:.2g}\n", family, v.adapter,
                 loss_rel, compared, worst);
      CHECK(compared == static_cast<int>(std::count_if(ref.t.begin(), ref.t.end(),
                                                       [&](auto& kv) { return kv.first.rfind(grad, 0) == 0; })));
    }
}

TEST_CASE("PEFT loads the adapter we save (LoRA, DoRA) and gives our logits", "[reference]") {
  const std::string out = test::temp_dir("ours-adapter");
  for (const bool dora : {false, true})
    for (const std::string& family : families()) {
      INFO(family << (dora ? " DoRA" : ""));
      const Reference ref(family);
      CausalLM m = load(family);
      LoraConfig cfg;
      cfg.r = 8;
      cfg.alpha = 32;
      // (PEFT's DoRA takes no mixture of experts' expert or router adapters, which all-linear has there)
      cfg.target_modules = {dora && !m.moe_layers().empty() ? "q_proj" : "all-linear"};
      cfg.use_dora = dora;
      attach_lora(m, cfg, 7);
      {
        c10::NoGradGuard no_grad;  // make B non-zero so the adapter matters, and magnitudes not W's norms
        for (auto& [name, p] : lora_state(m))
          name.ends_with("lora_magnitude_vector") ? p.mul_(1 + 0.1 * at::randn_like(p)) : p.normal_(0, 0.05);
      }
      const std::string dir = out + "/" + family + (dora ? "-dora" : "");
      save_adapter(m, cfg, dir);
      c10::NoGradGuard no_grad;
      const at::Tensor logits = m.forward(ref["input_ids"], ref["attention_mask"]);
      save_tensors(dir + "/expected.safetensors",
                   {{"input_ids", ref["input_ids"]}, {"attention_mask", ref["attention_mask"]}, {"logits", logits}});
      const test::Result r =
          test::sh(fmt::format("'{}' '{}/tests/reference/check.py' adapter '{}/{}' '{}' '{}/expected.safetensors'",
                               LORARUN_PYTHON, LORARUN_SOURCE_DIR, kFixtures, family, dir, dir));
      INFO(r.output);
      CHECK(r.status == 0);
    }
}

TEST_CASE("trainable summary counts like PEFT") {
  CausalLM m = load("llama");
  LoraConfig cfg;
  cfg.r = 8;
  cfg.target_modules = {"q_proj", "v_proj"};
  attach_lora(m, cfg, 1);
  // llama fixture: 2 layers, hidden 64, q_out 96, kv_out 48: A+B of q (8*64 + 96*8) and v (8*64 + 48*8)
  const int64_t trainable = 2 * ((8 * 64 + 96 * 8) + (8 * 64 + 48 * 8));
  CHECK_THAT(trainable_summary(m),
             Catch::StartsWith(fmt::format("trainable params: {},{:03d} ||", trainable / 1000, trainable % 1000)));
}
