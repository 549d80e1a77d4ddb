// Text generation with a KV cache: greedy or nucleus (top-p) sampling.
#pragma once
#include <cstdint>
#include <optional>
#include <vector>

namespace lorarun::model {

class CausalLM;

struct GenerateOptions {
  int64_t max_new_tokens = 64;
  double temperature = 0.0;  // 0: greedy
  double top_p = 1.0;
  uint64_t seed = 0;
  std::optional<int64_t> eos_id;  // stop after generating it
};

// Continues `prompt` (token ids, batch of one); returns the new ids (eos included if produced).
std::vector<int64_t> generate(const CausalLM& model, const std::vector<int64_t>& prompt, const GenerateOptions& opt);

// The id generation stops at, as transformers picks it: generation_config.json, then config.json
// (for a .gguf model, tokenizer.ggml.eos_token_id).
std::optional<int64_t> default_eos_id(const CausalLM& model);

}  // namespace lorarun::model
