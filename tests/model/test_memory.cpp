// The memory features against the plain path on every fixture family: the chunked loss from
// hidden states, activation checkpointing, and packed documents.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "model/lora.hpp"
#include "model/loss.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"

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
  for (const std::string& n : {"input_ids", "attention_mask", "labels"}) t[n] = files.load(n, at::kLong, at::kCPU);
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
