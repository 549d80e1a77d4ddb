// Text generation with a KV cache: a batch of prompts continued greedily or by sampling.
#pragma once
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

namespace at {
class Tensor;
}

namespace lorarun::model {

class CausalLM;

// How the next token is chosen: greedy (temperature 0), or drawn after transformers' warpers in
// their order: temperature, top-k, top-p.
struct Sampling {
  double temperature = 0.0;  // 0: greedy
  int64_t top_k = 0;         // 0: every token
  double top_p = 1.0;        // 1: every token
  bool greedy() const { return temperature <= 0; }
};

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  Sampling sampling;
  std::optional<int64_t> eos_id;  // a row stops after generating it
  // Ranks whose passes are joined (dist.shard_base: each forward gathers the base with the others):
  // given whether this rank still has rows after a pass, whether any rank has. A rank whose rows
  // have all ended (or that had none) joins the others' passes with a pass of none until all end.
  std::function<bool(bool)> any_running = {};
};

// The distribution a next token is drawn from: logits [B, V] -> probabilities [B, V] (float32) as
// transformers' TemperatureLogitsWarper, TopKLogitsWarper and TopPLogitsWarper leave them,
// softmaxed (the tokens they filter out 0). Not for greedy.
at::Tensor sampling_probs(const at::Tensor& logits, const Sampling& s);

// One completion's seed: from the run's seed, the step, the prompt's index in the step's global
// batch and which of its generations — never the rank or the rows it is generated beside, so any
// split of a batch over ranks, and a resume, draw the same tokens.
uint64_t completion_seed(uint64_t seed, uint64_t step, uint64_t prompt, uint64_t generation);

// The uniform in [0, 1) that picks the `token`th new token of the completion seeded `seed`.
double completion_uniform(uint64_t seed, uint64_t token);

// Draws one token per row: probs [B, V] (rows summing to 1), u [B] uniforms -> ids [B]: the first
// token whose cumulative probability passes u (inverse transform; a token of probability 0 is never drawn).
at::Tensor draw(const at::Tensor& probs, const at::Tensor& u);

// Continues each prompt (token ids, none empty; none at all on a rank with no share); row i draws
// with seeds[i] (ignored when greedy). Returns each row's new ids (eos included when produced).
// Rows run together, left-padded, with the adapters attached as they are; a row that ends leaves
// the batch.
std::vector<std::vector<int64_t>> generate(const CausalLM& model, const std::vector<std::vector<int64_t>>& prompts,
                                           const std::vector<uint64_t>& seeds, const GenerateOptions& opt);

// The id generation stops at, as transformers picks it: generation_config.json, then config.json
// (for a .gguf model, tokenizer.ggml.eos_token_id).
std::optional<int64_t> default_eos_id(const CausalLM& model);

}  // namespace lorarun::model
