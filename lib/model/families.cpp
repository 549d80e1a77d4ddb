#include "model/families.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <algorithm>
#include <array>
#include <vector>

#include "util/error.hpp"
#include "util/untrusted.hpp"

namespace lorarun::model {
namespace {

// One line a family. "llama" covers every pre-norm decoder with rotary positions and a gated MLP.
constexpr std::array<FamilyTraits, 11> kFamilies = {{
    {.model_type = "llama", .hf_class = "LlamaForCausalLM", .gguf = "llama", .llama_gguf = true},
    {.model_type = "mistral",
     .hf_class = "MistralForCausalLM",
     .gguf = "llama",  // llama.cpp reads a Mistral as a llama
     .always_windowed = true,
     .llama_gguf = true},
    {.model_type = "qwen2", .hf_class = "Qwen2ForCausalLM", .gguf = "qwen2", .qkv_bias = true},
    {.model_type = "qwen3", .hf_class = "Qwen3ForCausalLM", .gguf = "qwen3", .qk_norm = true},
    {.model_type = "qwen3_moe",
     .hf_class = "Qwen3MoeForCausalLM",
     .gguf = "qwen3moe",
     .qk_norm = true,
     .moe = FamilyTraits::Moe::Qwen},
    {.model_type = "mixtral",
     .hf_class = "MixtralForCausalLM",
     .always_windowed = true,
     .moe = FamilyTraits::Moe::Mixtral},
    {.model_type = "gemma2",
     .hf_class = "Gemma2ForCausalLM",
     .gguf = "gemma2",
     .gemma = true,
     .always_windowed = true,
     .global_every = 2,
     .large_variant_layers = 46,
     .gguf_window = 4096,
     .gguf_attn_softcap = 50,
     .gguf_logit_softcap = 30},
    {.model_type = "gemma3_text",
     .hf_class = "Gemma3ForCausalLM",
     .gguf = "gemma3",
     .qk_norm = true,
     .gemma = true,
     .always_windowed = true,
     .global_every = 6,  // sliding_window_pattern's default
     .local_rope = true,
     .large_variant_layers = 62},
    {.model_type = "phi3", .hf_class = "Phi3ForCausalLM", .gguf = "phi3", .fused = true, .always_windowed = true},
    {.model_type = "opt", .hf_class = "OPTForCausalLM", .family = Family::Opt},
    {.model_type = "gpt2", .hf_class = "GPT2LMHeadModel", .gguf = "gpt2", .family = Family::Gpt2},
}};

// "a, b, c": `name` of each family in table order, once each, those it gives as "" left out.
std::string listed(std::string_view name(const FamilyTraits&)) {
  std::vector<std::string_view> names;
  for (const FamilyTraits& f : kFamilies)
    if (const std::string_view n = name(f); !n.empty() && std::find(names.begin(), names.end(), n) == names.end())
      names.push_back(n);
  return fmt::format("{}", fmt::join(names, ", "));
}

// What GGUF output can be: llama.cpp's llama-like architectures (not yet its mixtures of experts).
bool gguf_writable(const FamilyTraits& f) {
  return !f.gguf.empty() && f.family == Family::Llama && f.moe == FamilyTraits::Moe::None;
}

}  // namespace

tok::SentencePieceKind sentencepiece_kind_of_gguf(const std::string& arch) {
  if (arch == "gemma" || arch == "gemma2" || arch == "gemma3") return tok::SentencePieceKind::Gemma;
  if (arch == "phi3") return tok::SentencePieceKind::Phi3;
  return tok::SentencePieceKind::Llama;
}

const FamilyTraits& family_of_model_type(const std::string& model_type, const std::string& file) {
  for (const FamilyTraits& f : kFamilies)
    if (f.model_type == model_type) return f;
  if (model_type == "gemma3")
    throw Error(
        fmt::format("{}: a multimodal Gemma 3 checkpoint (model_type gemma3) is not supported; text models "
                    "(Gemma3ForCausalLM, model_type gemma3_text) are",
                    file));
  throw Error(fmt::format("{}: model_type '{}' is not supported; supported: {}", file, printable(model_type),
                          listed([](const FamilyTraits& f) { return f.model_type; })));
}

const FamilyTraits& family_of_gguf(const std::string& arch, const std::string& file) {
  for (const FamilyTraits& f : kFamilies)
    if (!f.gguf.empty() && f.gguf == arch) return f;  // the first that says it: llama, not mistral
  throw Error(fmt::format("{}: GGUF architecture '{}' is not supported; supported: {} (mistral files are llama)", file,
                          printable(arch), listed([](const FamilyTraits& f) { return f.gguf; })));
}

std::string gguf_architecture_of(const std::string& model_type) {
  for (const FamilyTraits& f : kFamilies)
    if (f.model_type == model_type && gguf_writable(f)) return std::string(f.gguf);
  throw Error(fmt::format(
      "model type '{}' cannot be written to GGUF: supported are {} (write a HF directory instead: --out without .gguf)",
      model_type, listed([](const FamilyTraits& f) { return gguf_writable(f) ? f.model_type : std::string_view(); })));
}

}  // namespace lorarun::model
