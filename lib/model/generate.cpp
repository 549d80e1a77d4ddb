#include "model/generate.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "model/transformer.hpp"
#include "util/error.hpp"

namespace lorarun::model {
namespace {

// Samples from softmax(logits / temperature) restricted to the smallest set of tokens whose
// probability reaches top_p (HF's TopPLogitsWarper keeps at least one token).
int64_t sample_top_p(const at::Tensor& logits, double temperature, double top_p, at::Generator& gen) {
  const at::Tensor probs = at::softmax(logits.to(at::kFloat) / temperature, -1);
  const auto [sorted, order] = probs.sort(-1, /*descending=*/true);
  const at::Tensor before = sorted.cumsum(-1) - sorted;  // mass of strictly more likely tokens
  const at::Tensor kept = sorted.masked_fill(before >= top_p, 0);
  const int64_t pick = at::multinomial(kept.cpu(), 1, false, gen).item<int64_t>();
  return order[pick].item<int64_t>();
}

}  // namespace

std::optional<int64_t> default_eos_id(const CausalLM& model) {
  for (const char* file : {"generation_config.json", "config.json"}) {
    const auto path = std::filesystem::path(model.dir()) / file;
    if (!std::filesystem::exists(path)) continue;
    const auto j = nlohmann::json::parse(io::read_file(path.string()), nullptr, false);
    if (j.is_object() && j.contains("eos_token_id")) {
      const auto& e = j["eos_token_id"];
      if (e.is_number_integer()) return e.get<int64_t>();
      if (e.is_array() && !e.empty() && e[0].is_number_integer()) return e[0].get<int64_t>();
    }
  }
  return model.config().eos_token_id;  // a .gguf model: from its metadata
}

std::vector<int64_t> generate(const CausalLM& model, const std::vector<int64_t>& prompt, const GenerateOptions& opt) {
  if (prompt.empty()) throw Error("the prompt has no tokens");
  c10::NoGradGuard no_grad;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(opt.seed);
  KVCache cache;
  at::Tensor ids = at::tensor(prompt, at::kLong).unsqueeze(0);
  std::vector<int64_t> out;
  while (static_cast<int64_t>(out.size()) < opt.max_new_tokens) {
    const at::Tensor last = model.logits(model.hidden_states(ids, {}, &cache).select(1, -1)).squeeze(0);
    const int64_t next =
        opt.temperature <= 0 ? last.argmax().item<int64_t>() : sample_top_p(last, opt.temperature, opt.top_p, gen);
    out.push_back(next);
    if (opt.eos_id && next == *opt.eos_id) break;
    ids = at::full({1, 1}, next, at::kLong);
  }
  return out;
}

}  // namespace lorarun::model
