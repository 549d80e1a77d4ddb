// The memory features against the plain path on every fixture family: the chunked loss from
// hidden states, activation checkpointing, and packed documents. And the memory estimate
// lora-train --dry-run prints, against what a load holds and a training step takes.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "model/lora.hpp"
#include "model/loss.hpp"
#include "model/memory.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "recipe/recipe.hpp"
#include "train/memory_estimate.hpp"

using namespace lorarun;
using namespace lorarun::model;

namespace {

const std::string kFixtures = LORARUN_MODEL_FIXTURES;

std::vector<std::string> families() {
  return nlohmann::json::parse(io::read_file(kFixtures + "/families.json")).get<std::vector<std::string>>();
}

// The reference batch transformers saw: input_ids, attention_mask (right padding), labels.
std::map<std::string, at::Tensor> reference(const std::string& family) {
  std::map<std::string, at::Tensor> t;
  const auto files = WeightFiles::open_file(kFixtures + "/" + family + "/reference.safetensors");
  for (const char* n : {"input_ids", "attention_mask", "labels"}) t[n] = files.load(n, at::kLong, at::kCPU);
  return t;
}

CausalLM with_adapter(const std::string& family) {
  CausalLM m = CausalLM::load(kFixtures + "/" + family, at::kFloat, at::kCPU);
  load_adapter(m, kFixtures + "/" + family + "/peft_adapter");
  m.training = true;
  return m;
}

// Flat positions of [B*T] that predict a trained token, and those tokens.
std::pair<at::Tensor, at::Tensor> trained_rows(const at::Tensor& labels) {
  const int64_t T = labels.size(1);
  at::Tensor next = at::full_like(labels, -100);
  next.narrow(1, 0, T - 1).copy_(labels.narrow(1, 1, T - 1));
  const at::Tensor rows = (next.reshape(-1) != -100).nonzero().squeeze(1);
  return {rows, next.reshape(-1).index_select(0, rows)};
}

// Loss sum and the LoRA gradients after one backward (gradients cleared afterwards).
struct Result {
  double loss;
  std::vector<at::Tensor> grads;
};
Result backward(CausalLM& m, const LossSum& l) {
  l.sum.backward();
  Result r{l.sum.item<double>(), {}};
  for (at::Tensor& p : lora_parameters(m)) {
    r.grads.push_back(p.grad().clone());
    p.mutable_grad().zero_();
  }
  return r;
}

Result chunked(CausalLM& m, const at::Tensor& ids, const at::Tensor& mask, const at::Tensor& labels,
               bool packed = false, int64_t chunk_rows = 1 << 20) {
  const auto [rows, targets] = trained_rows(labels);
  const at::Tensor h = m.hidden_states(ids, mask, nullptr, packed);
  const auto cap = m.config().logit_softcap;
  return backward(
      m, lm_head_loss(h, m.lm_head(), rows, targets, cap, chunk_rows * m.lm_head().size(0) * 4 * (cap ? 3 : 2)));
}

// Largest gradient difference relative to the largest gradient, over all LoRA tensors.
double grad_diff(const Result& a, const Result& b) {
  double diff = 0, scale = 0;
  for (size_t i = 0; i < a.grads.size(); ++i) {
    diff = std::max(diff, (a.grads[i] - b.grads[i]).abs().max().item<double>());
    scale = std::max(scale, b.grads[i].abs().max().item<double>());
  }
  return diff / scale;
}

}  // namespace

TEST_CASE("the chunked loss from hidden states equals cross-entropy over full logits, gradients too", "[memory]") {
  for (const std::string& family : families()) {
    INFO(family);
    auto ref = reference(family);
    CausalLM m = with_adapter(family);
    const Result full = backward(m, causal_lm_loss(m.forward(ref["input_ids"], ref["attention_mask"]), ref["labels"]));
    const Result split = chunked(m, ref["input_ids"], ref["attention_mask"], ref["labels"], false, 3);
    CHECK(std::abs(split.loss - full.loss) <= 1e-6 * full.loss);
    CHECK(grad_diff(split, full) <= 1e-5);
    CHECK(full.loss > 0);
  }
}

TEST_CASE("activation checkpointing gives the gradients of the plain backward, dropout included", "[memory]") {
  for (const std::string& family : families()) {
    INFO(family);
    auto ref = reference(family);
    CausalLM m = with_adapter(family);
    for (Linear* l : m.linears()) l->dropout = 0.1;  // the recomputation must draw the same masks
    Result r[2];
    for (const bool recompute : {false, true}) {
      m.recompute_activations = recompute;
      at::manual_seed(5);
      r[recompute] = chunked(m, ref["input_ids"], ref["attention_mask"], ref["labels"]);
    }
    CHECK(r[1].loss == r[0].loss);
    CHECK(grad_diff(r[1], r[0]) <= 1e-6);
    // Other dropout masks give other gradients: the check above can tell.
    at::manual_seed(6);
    CHECK(grad_diff(chunked(m, ref["input_ids"], ref["attention_mask"], ref["labels"]), r[0]) > 1e-3);
  }
}

TEST_CASE("packed documents give the loss and gradients of one document per row", "[memory]") {
  for (const std::string& family : families()) {
    INFO(family);
    auto ref = reference(family);
    CausalLM m = with_adapter(family);
    const Result rows = chunked(m, ref["input_ids"], ref["attention_mask"], ref["labels"]);
    // The same documents back to back in one row, numbered 1, 2, … in the mask.
    std::vector<at::Tensor> ids, seg, labels;
    for (int64_t b = 0; b < ref["input_ids"].size(0); ++b) {
      const int64_t n = ref["attention_mask"][b].sum().item<int64_t>();
      ids.push_back(ref["input_ids"][b].narrow(0, 0, n));
      labels.push_back(ref["labels"][b].narrow(0, 0, n).clone());
      labels.back()[0] = -100;  // nothing predicts a document's first token
      seg.push_back(at::full({n}, b + 1, at::kLong));
    }
    const Result packed =
        chunked(m, at::cat(ids).unsqueeze(0), at::cat(seg).unsqueeze(0), at::cat(labels).unsqueeze(0), true);
    INFO(fmt::format("loss sum: rows {} packed {}", rows.loss, packed.loss));
    CHECK(std::abs(packed.loss - rows.loss) <= 1e-5 * rows.loss);
    CHECK(grad_diff(packed, rows) <= 1e-5);
    // Without the document boundaries the loss changes: the check above can tell.
    const at::Tensor one = at::ones_like(at::cat(seg).unsqueeze(0));
    CHECK(std::abs(chunked(m, at::cat(ids).unsqueeze(0), one, at::cat(labels).unsqueeze(0), true).loss - rows.loss) >
          1e-4 * rows.loss);
  }
}

namespace {

const std::string kSmolLM2 =
    std::string(LORARUN_SOURCE_DIR) + "/.fixtures/models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf";

// The most tensor bytes one training micro-batch of random tokens [B, T], all trained, takes:
// forward, the chunked loss, backward, with the LoRA gradients already allocated (by a first step).
int64_t measured_activations(CausalLM& m, int64_t B, int64_t T) {
  at::manual_seed(1);
  const at::Tensor ids = at::randint(m.config().vocab_size, {B, T}, at::kLong);
  const auto [rows, targets] = trained_rows(ids);
  const auto step = [&] {
    const at::Tensor h = m.hidden_states(ids, at::ones({B, T}, at::kLong));
    lm_head_loss(h, m.lm_head(), rows, targets, m.config().logit_softcap).sum.backward();
  };
  step();
  const TensorMemoryMeter meter;
  step();
  return meter.peak();
}

// activation_bytes against the measured bytes: the ratio, reported.
double estimate_ratio(CausalLM& m, int64_t B, int64_t T, const std::string& what) {
  const int64_t measured = measured_activations(m, B, T), estimate = m.activation_bytes(B, T);
  const double ratio = static_cast<double>(estimate) / static_cast<double>(measured);
  WARN(fmt::format("{}: estimate {:.2f} MiB, measured {:.2f} MiB, ratio {:.3f}", what, estimate / 1048576.0,
                   measured / 1048576.0, ratio));
  return ratio;
}

}  // namespace

// lora-train --dry-run's activation figure against the tensor bytes one training micro-batch
// really takes, on every fixture family, float32 and bf16, with and without activation
// checkpointing, NF4 and dropout. The estimate is what a user decides on before launching.
TEST_CASE("the activation estimate is within 20% of the tensor bytes a training micro-batch takes", "[memory]") {
  struct Case {
    at::ScalarType dtype;
    bool recompute, quantize;
    double dropout;
  };
  const std::vector<Case> cases = {{at::kFloat, false, false, 0.0},    {at::kFloat, true, false, 0.0},
                                   {at::kBFloat16, false, false, 0.0}, {at::kBFloat16, true, false, 0.0},
                                   {at::kBFloat16, false, true, 0.0},  {at::kFloat, false, false, 0.1}};
  for (const std::string& family : families())
    for (const Case& c : cases) {
      const std::string what = fmt::format("{} {} recompute {} nf4 {} dropout {}", family, c10::toString(c.dtype),
                                           c.recompute, c.quantize, c.dropout);
      INFO(what);
      CausalLM m = CausalLM::load(kFixtures + "/" + family, c.dtype, at::kCPU, {.quantize = c.quantize});
      // (a mixture of experts' all-linear adapts experts and routers, which take no dropout: its attention then)
      const bool attention = c.dropout > 0 && !m.moe_layers().empty();
      attach_lora(m,
                  {.r = 8,
                   .dropout = c.dropout,
                   .target_modules = attention ? std::vector<std::string>{"q_proj", "k_proj", "v_proj", "o_proj"}
                                               : std::vector<std::string>{"all-linear"}},
                  1);
      m.training = true;
      m.recompute_activations = c.recompute;
      const double ratio = estimate_ratio(m, 4, std::min<int64_t>(256, m.config().max_positions), what);
      CHECK(ratio >= 0.8);
      CHECK(ratio <= 1.2);
    }
}

TEST_CASE(
    "the memory estimate on SmolLM2: base bytes as loaded (whole, NF4, sharded, kept as GGUF blocks) and activations",
    "[memory]") {
  if (!std::filesystem::exists(kSmolLM2)) FAIL(kSmolLM2 << " is missing: run scripts/setup (or scripts/fetch-models)");
  for (const std::string base : {"dequantised", "nf4", "kept"})
    for (const int world : {1, 3}) {
      if (base == "kept" && world > 1) continue;  // (model.keep_quantized is not sharded)
      const bool quantize = base == "nf4", kept = base == "kept";
      INFO(fmt::format("{} world {}", base, world));
      const auto shards_of = [&] {
        std::shared_ptr<BaseShards> s;
        if (world > 1) {
          s = std::make_shared<BaseShards>();
          s->rank = world - 1;  // the last rank's slices are as long as the others' (padded)
          s->world = world;
        }
        return s;
      };
      const LoadOptions load{.quantize = quantize, .keep_quantized = kept, .shards = shards_of()};
      LoadOptions shapes{.quantize = quantize, .keep_quantized = kept, .shards = shards_of(), .shapes_only = true};
      const CausalLM real = CausalLM::load(kSmolLM2, at::kBFloat16, at::kCPU, load);
      const CausalLM meta = CausalLM::load(kSmolLM2, at::kBFloat16, at::kCPU, shapes);
      CHECK(meta.device().type() == at::kMeta);
      CHECK(meta.base_bytes() == real.base_bytes());
      CHECK(meta.base_bytes(true) == real.base_bytes(true));
      if (world > 1) CHECK(shapes.shards->block_buffer_bytes() == load.shards->block_buffer_bytes());
      if (world > 1) CHECK(meta.base_bytes() < real.base_bytes(true));
    }
  // The recipe's estimate: LoRA all-linear r 8 is 16 bytes a parameter (weights, gradients, AdamW).
  recipe::Recipe r;
  r.model.path = kSmolLM2;
  r.lora.target_modules = {"all-linear"};
  const train::MemoryEstimate whole = train::estimate_memory(r, 1, false), sharded = train::estimate_memory(r, 4, true);
  CausalLM m = CausalLM::load(kSmolLM2, at::kBFloat16, at::kCPU);
  attach_lora(m, lora_config_of(r.lora, r.model.path), 1);
  int64_t lora = 0;
  for (const at::Tensor& p : lora_parameters(m)) lora += p.numel();
  CHECK(whole.lora == 16 * lora);
  CHECK(whole.base == m.base_bytes());
  CHECK(sharded.base + sharded.gathered < whole.base);
  m.training = true;
  for (const bool recompute : {false, true}) {
    m.recompute_activations = recompute;
    // (one row: bf16 GEMMs over the 49,152-token head are slow on CPUs without bf16 units)
    const double ratio = estimate_ratio(m, 1, 256, fmt::format("SmolLM2 bf16 recompute {}", recompute));
    CHECK(ratio >= 0.8);
    CHECK(ratio <= 1.2);
  }
}

// dist.shard_base keeps two blocks whole: a block still there is not gathered again. On SmolLM2's
// 30 blocks a training step gathers 2 x 30 - 4 blocks (forward finds blocks 0 and 1 left by the last
// backward, backward finds the last two left by forward), with activation checkpointing too (the
// recomputed block is the one backward needs); without prefetch one block stays: 2 x 30 - 2.
TEST_CASE("dist.shard_base gathers each block once per pass, none that is still whole", "[memory]") {
  if (!std::filesystem::exists(kSmolLM2)) FAIL(kSmolLM2 << " is missing: run scripts/setup (or scripts/fetch-models)");
  for (const bool prefetch : {true, false}) {
    INFO(fmt::format("prefetch {}", prefetch));
    auto shards = std::make_shared<BaseShards>();  // one rank: a gather is a copy of the slice
    shards->prefetch = prefetch;
    CausalLM m = CausalLM::load(kSmolLM2, at::kFloat, at::kCPU, {.shards = shards});
    attach_lora(m, {.r = 4, .target_modules = {"all-linear"}}, 1);
    m.training = true;
    const int64_t L = m.config().num_layers;
    const at::Tensor ids = at::randint(m.config().vocab_size, {1, 8}, at::kLong);
    const auto step = [&](bool recompute) {
      m.recompute_activations = recompute;
      const int64_t before = shards->block_fetches();
      (m.hidden_states(ids, at::Tensor()).sum() * 0).backward();
      return shards->block_fetches() - before;
    };
    CHECK(step(false) == (prefetch ? 2 * L - 2 : 2 * L - 1));  // the first: nothing whole yet
    CHECK(step(false) == (prefetch ? 2 * L - 4 : 2 * L - 2));
    CHECK(step(true) == (prefetch ? 2 * L - 4 : 2 * L - 2));
    CHECK(step(true) == (prefetch ? 2 * L - 4 : 2 * L - 2));
  }
}

TEST_CASE(
    "the chunked loss gives a trained output head (modules_to_save) its gradient, per-row losses too, with a "
    "temperature too",
    "[memory]") {
  for (const std::string& family : families()) {
    INFO(family);
    auto ref = reference(family);
    CausalLM m = with_adapter(family);
    m.tables.head = m.frozen_lm_head().clone().set_requires_grad(true);
    const auto [rows, targets] = trained_rows(ref["labels"]);
    const auto cap = m.config().logit_softcap;
    const int64_t chunk_bytes = 3 * m.lm_head().size(0) * 4 * (cap ? 3 : 2);  // 3 rows a chunk
    const Result full = backward(m, causal_lm_loss(m.forward(ref["input_ids"], ref["attention_mask"]), ref["labels"]));
    const Result split = backward(m, lm_head_loss(m.hidden_states(ref["input_ids"], ref["attention_mask"]), m.lm_head(),
                                                  rows, targets, cap, chunk_bytes));
    CHECK(grad_diff(split, full) <= 1e-5);
    CHECK(full.grads.back().abs().max().item<double>() > 0);  // the head's

    // per-row losses, each weighed differently (as a preference loss weighs them)
    const at::Tensor weights = at::linspace(0.5, 2.0, rows.size(0), at::kFloat);
    const at::Tensor logits = m.forward(ref["input_ids"], ref["attention_mask"]);
    const at::Tensor all = at::cross_entropy_loss(
        logits.reshape({-1, logits.size(-1)}).index_select(0, rows).to(at::kFloat), targets, {}, at::Reduction::None);
    const Result full_rows = backward(m, {(all * weights).sum(), at::scalar_tensor(rows.size(0))});
    const at::Tensor per_row = lm_head_token_losses(m.hidden_states(ref["input_ids"], ref["attention_mask"]),
                                                    m.lm_head(), rows, targets, cap, 1.0, chunk_bytes);
    const Result split_rows = backward(m, {(per_row * weights).sum(), at::scalar_tensor(rows.size(0))});
    CHECK(grad_diff(split_rows, full_rows) <= 1e-5);

    // ... with a temperature dividing the (capped) logits, as TRL's GRPOTrainer divides them
    const at::Tensor hot_logits = m.forward(ref["input_ids"], ref["attention_mask"]);
    const at::Tensor hot =
        at::cross_entropy_loss(hot_logits.reshape({-1, hot_logits.size(-1)}).index_select(0, rows).to(at::kFloat) / 0.7,
                               targets, {}, at::Reduction::None);
    const Result full_hot = backward(m, {(hot * weights).sum(), at::scalar_tensor(rows.size(0))});
    const at::Tensor per_row_hot = lm_head_token_losses(m.hidden_states(ref["input_ids"], ref["attention_mask"]),
                                                        m.lm_head(), rows, targets, cap, 0.7, chunk_bytes);
    CHECK((per_row_hot.detach() - hot.detach()).abs().max().item<double>() <= 1e-5);
    CHECK((per_row_hot.detach() - per_row.detach()).abs().max().item<double>() > 1e-3);  // (the temperature matters)
    const Result split_hot = backward(m, {(per_row_hot * weights).sum(), at::scalar_tensor(rows.size(0))});
    CHECK(grad_diff(split_hot, full_hot) <= 1e-5);
  }
}
