// Writing a full Hugging Face model directory (what lora-merge produces).
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <string>

namespace lorarun::model {

class CausalLM;

// "5GB" -> 5e9, "500MB", "2GiB", "1024" (bytes). Throws lorarun::Error on anything else.
int64_t parse_size(const std::string& text);

// Writes the model's weights as `dtype` into `out_dir` (which must not exist) — one
// model.safetensors, or shards of at most `max_shard_bytes` plus model.safetensors.index.json —
// with config.json (dtype updated) and the tokenizer/generation files copied from the base
// directory; from a .gguf base, config.json, tokenizer.json and tokenizer_config.json (chat
// template included) made from its metadata as transformers reads it. Everything is written under
// a temporary name and renamed at the end.
void export_hf_model(const CausalLM& model, const std::string& out_dir, at::ScalarType dtype, int64_t max_shard_bytes);

}  // namespace lorarun::model
