#include "model/gguf_weights.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include <span>

#include "model/families.hpp"
#include "model/gguf_blocks.hpp"
#include "util/error.hpp"
#include "util/untrusted.hpp"

namespace lorarun::model {

at::Tensor dequantize(const io::GgufFile& file, const io::GgufTensorInfo& t) {
  at::Tensor out = at::empty(t.torch_shape(), at::kFloat);
  const std::span<float> values{out.data_ptr<float>(), static_cast<size_t>(t.numel())};
  if (!io::can_dequantize(t.type) || t.dims.empty() || t.numel() == 0)
    io::dequantize(file, t, values);  // no rows to split, or the error naming the tensor and its type
  else
    dequantize_rows(t.type, file.bytes(t), t.numel() / t.dims[0], values);
  file.release(t);
  return out;
}

at::Tensor dequantize(const io::GgufFile& file, const std::string& name) {
  const io::GgufTensorInfo* t = file.find(name);
  if (!t) throw Error(fmt::format("{} has no tensor '{}'", file.path(), name));
  return dequantize(file, *t);
}

bool is_gguf_path(const std::string& path) { return path.size() > 5 && path.ends_with(".gguf"); }

namespace {

// What the metadata holds is checked as load_config checks config.json.
void check_sizes(const io::GgufFile& f, const ModelConfig& c) {
  if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.intermediate_size <= 0 || c.num_layers <= 0 || c.num_heads <= 0 ||
      c.num_kv_heads <= 0 || c.num_heads % c.num_kv_heads != 0 || c.head_dim <= 0 || c.head_dim % 2 != 0)
    throw Error(
        fmt::format("{}: inconsistent sizes in the GGUF metadata (vocab {}, hidden {}, ffn {}, layers {}, heads {}/{} "
                    "kv, head_dim {}); re-convert the model",
                    f.path(), c.vocab_size, c.hidden_size, c.intermediate_size, c.num_layers, c.num_heads,
                    c.num_kv_heads, c.head_dim));
}

}  // namespace

double gemma_query_scalar(const ModelConfig& c, const FamilyTraits& family) {
  const bool large = c.num_layers == family.large_variant_layers;  // the 27B models
  return static_cast<double>(large ? c.hidden_size / c.num_heads : c.head_dim);
}

std::vector<bool> windowed_every(int64_t layers, int64_t every) {
  std::vector<bool> out;
  for (int64_t i = 0; i < layers; ++i) out.push_back(i % every < every - 1);
  return out;
}

namespace {

// `value` of `what` in `f`, which divides or scales: Error unless it is finite and above 0.
double positive(const io::GgufFile& f, const std::string& what, double value) {
  if (!(value > 0) || !std::isfinite(value))
    throw Error(fmt::format("{}: {} is {}; it must be a number above 0: re-convert the model", f.path(), what, value));
  return value;
}

// A float32 vector tensor of the file (rope_freqs, rope_factors_*) of `n` values, each above 0, or
// empty when absent.
std::vector<double> factor_tensor(const io::GgufFile& f, const char* name, size_t n) {
  const io::GgufTensorInfo* t = f.find(name);
  if (!t) return {};
  if (t->dims.size() != 1 || static_cast<size_t>(t->numel()) != n)
    throw Error(
        fmt::format("{}: '{}' holds {} values but the rotary embedding has {} frequencies; re-convert the model",
                    f.path(), name, t->numel(), n));
  const at::Tensor v = dequantize(f, *t);
  std::vector<double> out(v.data_ptr<float>(), v.data_ptr<float>() + n);
  for (const double x : out) positive(f, fmt::format("a value of '{}'", name), x);
  return out;
}

// llama.cpp's gemma2/gemma3: what the file does not say is what llama.cpp assumes (the family
// table's gguf_* traits) — queries scaled by head_dim (by hidden/heads for the 27B models, told by
// their layer count), the soft-caps and the window, every global_every-th layer global unless
// attention.sliding_window_pattern says otherwise, and (local_rope) the windowed layers on rope
// base 10000 unless rope.freq_base_swa is given.
void gemma_config(const io::GgufFile& f, const std::string& arch, const FamilyTraits& family, ModelConfig& c) {
  const auto key = [&arch](const char* k) { return arch + "." + k; };
  c.gemma = true;
  c.activation = "gelu_pytorch_tanh";
  c.query_pre_attn_scalar = gemma_query_scalar(c, family);
  if (family.gguf_attn_softcap > 0) {
    c.attn_softcap = positive(f, key("attn_logit_softcapping"),
                              f.get_float(key("attn_logit_softcapping"), family.gguf_attn_softcap));
    c.logit_softcap = positive(f, key("final_logit_softcapping"),
                               f.get_float(key("final_logit_softcapping"), family.gguf_logit_softcap));
  } else if (f.has(key("final_logit_softcapping")) && f.get_float(key("final_logit_softcapping")) != 0) {
    c.logit_softcap = positive(f, key("final_logit_softcapping"), f.get_float(key("final_logit_softcapping")));
  }
  const int64_t window = f.get_int(key("attention.sliding_window"), family.gguf_window);
  if (window <= 0) return;
  c.sliding_window = window;
  c.sliding_layers.clear();
  const io::GgufValue* pattern = f.find_key(key("attention.sliding_window_pattern"));
  if (pattern && pattern->type == io::GgufType::Array) {  // one flag a layer (bools, as gguf-py writes them)
    const auto* flags = std::get_if<std::vector<uint64_t>>(&pattern->data);
    const auto* ints = std::get_if<std::vector<int64_t>>(&pattern->data);
    if (!flags && !ints)
      throw Error(fmt::format("{}: {} is not an array of flags; re-convert the model", f.path(),
                              key("attention.sliding_window_pattern")));
    if (flags)
      for (const uint64_t v : *flags) c.sliding_layers.push_back(v != 0);
    else
      for (const int64_t v : *ints) c.sliding_layers.push_back(v != 0);
    if (static_cast<int64_t>(c.sliding_layers.size()) != c.num_layers)
      throw Error(fmt::format("{}: {} has {} entries for {} layers; re-convert the model", f.path(),
                              key("attention.sliding_window_pattern"), c.sliding_layers.size(), c.num_layers));
  } else {
    const int64_t every = f.get_int(key("attention.sliding_window_pattern"), family.global_every);
    if (every <= 0)
      throw Error(
          fmt::format("{}: {} is {}; it must be positive", f.path(), key("attention.sliding_window_pattern"), every));
    c.sliding_layers = windowed_every(c.num_layers, every);
  }
  if (family.local_rope)
    c.local_rope_theta = positive(f, key("rope.freq_base_swa"), f.get_float(key("rope.freq_base_swa"), 10000.0));
}

// Rotary scaling from the metadata and the factor tensors llama.cpp's converter writes: linear;
// phi3's longrope (rope_factors_long/short, switching past rope.scaling.original_context_length);
// llama 3.x's rope_freqs (one divisor per frequency: longrope with one set that never switches).
void rope_config(const io::GgufFile& f, const std::string& arch, ModelConfig& c) {
  const auto key = [&arch](const char* k) { return arch + "." + k; };
  const std::string scaling = f.get_string(key("rope.scaling.type"), "none");
  const auto n = static_cast<size_t>(c.head_dim * c.partial_rotary) / 2;
  if (scaling == "linear") {
    c.rope.type = "linear";
    c.rope.factor = f.get_float(key("rope.scaling.factor"));
  } else if (scaling != "none" && scaling != "longrope") {
    throw Error(
        fmt::format("{}: rope scaling '{}' is not supported (none, linear, longrope)", f.path(), printable(scaling)));
  }
  std::vector<double> freqs = factor_tensor(f, "rope_freqs.weight", n);
  std::vector<double> long_factor = factor_tensor(f, "rope_factors_long.weight", n);
  std::vector<double> short_factor = factor_tensor(f, "rope_factors_short.weight", n);
  if (!freqs.empty() && (!long_factor.empty() || scaling == "linear"))
    throw Error(fmt::format("{}: rope_freqs together with other rope scaling is not supported", f.path()));
  if (long_factor.empty() != short_factor.empty())
    throw Error(
        fmt::format("{}: rope_factors_long and rope_factors_short come together; re-convert the model", f.path()));
  if (!freqs.empty()) {
    c.rope.type = "longrope";
    c.rope.short_factor = c.rope.long_factor = std::move(freqs);
    c.rope.original_max_position = c.max_positions;
    c.rope.attention_factor = 1.0;
  } else if (!long_factor.empty()) {
    c.rope.type = "longrope";
    c.rope.short_factor = std::move(short_factor);
    c.rope.long_factor = std::move(long_factor);
    c.rope.original_max_position = static_cast<int64_t>(
        positive(f, key("rope.scaling.original_context_length"),
                 static_cast<double>(f.get_int(key("rope.scaling.original_context_length"), c.max_positions))));
    const double scale = static_cast<double>(c.max_positions) / c.rope.original_max_position;
    c.rope.attention_factor = positive(
        f, key("rope.scaling.attn_factor"),
        f.get_float(key("rope.scaling.attn_factor"),
                    scale <= 1.0 ? 1.0 : std::sqrt(1 + std::log(scale) / std::log(c.rope.original_max_position))));
  }
}

ModelConfig llama_config(const io::GgufFile& f, const FamilyTraits& family) {
  const std::string arch(family.gguf);
  const auto key = [&arch](const char* k) { return arch + "." + k; };
  ModelConfig c;
  c.model_type = family.model_type;
  c.family = family.family;
  c.hidden_size = f.get_int(key("embedding_length"));
  c.intermediate_size = f.get_int(key("feed_forward_length"));
  c.num_layers = f.get_int(key("block_count"));
  c.num_heads = f.get_int(key("attention.head_count"));
  c.num_kv_heads = f.get_int(key("attention.head_count_kv"), c.num_heads);
  c.head_dim = f.get_int(key("attention.key_length"), c.num_heads > 0 ? c.hidden_size / c.num_heads : 0);
  c.max_positions = f.get_int(key("context_length"), 2048);
  c.norm_eps = f.get_float(key("attention.layer_norm_rms_epsilon"));
  c.rope_theta = f.get_float(key("rope.freq_base"), 10000.0);
  if (c.num_heads <= 0 || c.num_kv_heads <= 0)  // before the rotary check, which would blame the rotary size
    throw Error(
        fmt::format("{}: {}.attention.head_count is {} and head_count_kv {}: both must be positive; "
                    "re-convert the model",
                    f.path(), printable(arch), c.num_heads, c.num_kv_heads));
  const int64_t rope_dim = f.get_int(key("rope.dimension_count"), c.head_dim);
  if (family.fused && rope_dim > 0 && rope_dim <= c.head_dim && rope_dim % 2 == 0)  // phi3: partial rotary
    c.partial_rotary = static_cast<double>(rope_dim) / static_cast<double>(c.head_dim);
  else if (rope_dim != c.head_dim)
    throw Error(
        fmt::format("{}: rotary dimension {} differs from the head dimension {}: partial rotary embeddings "
                    "are not supported for {}",
                    f.path(), rope_dim, c.head_dim, printable(arch)));
  c.qkv_bias = family.qkv_bias;
  c.qk_norm = family.qk_norm;
  c.fused = family.fused;
  if (family.gemma) gemma_config(f, arch, family, c);
  if (family.moe != FamilyTraits::Moe::None) {  // llama.cpp's qwen3moe: every layer's experts, top k renormalised
    c.moe.experts = f.get_int(key("expert_count"));
    c.moe.top_k = f.get_int(key("expert_used_count"));
    c.moe.intermediate = f.get_int(key("expert_feed_forward_length"));
    c.moe.normalize_top_k = true;
    c.moe.sparse.assign(static_cast<size_t>(std::max<int64_t>(c.num_layers, 0)), true);
    if (c.moe.experts <= 0 || c.moe.top_k <= 0 || c.moe.top_k > c.moe.experts || c.moe.intermediate <= 0)
      throw Error(
          fmt::format("{}: inconsistent experts in the metadata ({}.expert_count {}, expert_used_count {}, "
                      "expert_feed_forward_length {}); re-convert the model",
                      f.path(), printable(arch), c.moe.experts, c.moe.top_k, c.moe.intermediate));
  }
  if (family.fused) {  // phi3: a window of 0 is none (Phi-4)
    if (const int64_t window = f.get_int(key("attention.sliding_window"), 0); window > 0) c.sliding_window = window;
  }
  rope_config(f, arch, c);
  return c;
}

// GPT-2: learned positions, LayerNorm with biases, fused QKV; llama.cpp's converter writes the
// tied output projection out as output.weight.
ModelConfig gpt2_config(const io::GgufFile& f, const FamilyTraits& family) {
  ModelConfig c;
  c.model_type = family.model_type;
  c.family = family.family;
  c.activation = "gelu_new";
  c.hidden_size = f.get_int("gpt2.embedding_length");
  c.intermediate_size = f.get_int("gpt2.feed_forward_length", 4 * c.hidden_size);
  c.num_layers = f.get_int("gpt2.block_count");
  c.num_heads = f.get_int("gpt2.attention.head_count");
  c.num_kv_heads = c.num_heads;
  c.head_dim = c.num_heads > 0 ? c.hidden_size / c.num_heads : 0;
  c.max_positions = f.get_int("gpt2.context_length");
  c.norm_eps = f.get_float("gpt2.attention.layer_norm_epsilon");
  return c;
}

// The metadata's block count against the blocks the tensors hold (blk.<i>.…): more blocks named
// than stored would fail later on the first missing tensor, which does not say what is wrong.
void check_blocks(const io::GgufFile& f, const std::string& arch, int64_t layers) {
  int64_t stored = 0;
  for (const io::GgufTensorInfo& t : f.tensors()) {
    if (!t.name.starts_with("blk.")) continue;
    const size_t dot = t.name.find('.', 4);
    const std::string i = t.name.substr(4, dot == std::string::npos ? std::string::npos : dot - 4);
    if (i.empty() || i.size() > 9 || i.find_first_not_of("0123456789") != std::string::npos) continue;
    stored = std::max<int64_t>(stored, std::stoll(i) + 1);
  }
  if (layers > stored)
    throw Error(
        fmt::format("{}: {}.block_count is {} but the file holds tensors for {} block(s): the metadata "
                    "does not match the tensors; re-convert the model",
                    f.path(), printable(arch), layers, stored));
}

// The vocabulary the metadata names (arch.vocab_size, the tokenizer's token list) must fit the
// embedding: an id past its rows would index outside it.
void check_vocabulary(const io::GgufFile& f, const std::string& arch, int64_t rows) {
  const int64_t named = f.get_int(arch + ".vocab_size", 0);
  const io::GgufValue* tokens = f.find_key("tokenizer.ggml.tokens");
  const auto listed = static_cast<int64_t>(tokens ? tokens->size() : 0);
  const int64_t vocab = std::max(named, listed);
  if (vocab > rows)
    throw Error(
        fmt::format("{}: token_embd.weight has {} rows but the vocabulary has {} tokens ({}): the embedding "
                    "is shorter than the vocabulary; re-convert the model",
                    f.path(), rows, vocab,
                    named >= listed ? printable(arch) + ".vocab_size" : std::string("tokenizer.ggml.tokens")));
}

}  // namespace

ModelConfig gguf_config(const io::GgufFile& f) {
  const std::string arch = f.get_string("general.architecture");
  const FamilyTraits& family = family_of_gguf(arch, f.path());
  ModelConfig c = family.family == Family::Gpt2 ? gpt2_config(f, family) : llama_config(f, family);
  const io::GgufTensorInfo* embed = f.find("token_embd.weight");
  if (!embed || embed->dims.size() != 2)
    throw Error(fmt::format("{} has no 2-dimensional tensor 'token_embd.weight': it is not a complete {} model",
                            f.path(), arch));
  c.vocab_size = embed->torch_shape()[0];
  c.tie_word_embeddings = f.find("output.weight") == nullptr;  // as llama.cpp and transformers decide
  check_sizes(f, c);
  check_blocks(f, arch, c.num_layers);
  check_vocabulary(f, arch, c.vocab_size);
  const auto token = [&f](const char* k) -> std::optional<int64_t> {
    if (!f.has(k)) return std::nullopt;
    return f.get_int(k);
  };
  c.bos_token_id = token("tokenizer.ggml.bos_token_id");
  c.eos_token_id = token("tokenizer.ggml.eos_token_id");
  c.pad_token_id = token("tokenizer.ggml.padding_token_id");
  return c;
}

std::string gguf_tensor_name(const std::string& hf_name, bool gemma) {
  static const std::pair<const char*, const char*> kTop[] = {
      {"model.embed_tokens.weight", "token_embd.weight"},
      {"model.norm.weight", "output_norm.weight"},
      {"lm_head.weight", "output.weight"},
      {"transformer.wte.weight", "token_embd.weight"},
      {"transformer.wpe.weight", "position_embd.weight"},
      {"transformer.ln_f.weight", "output_norm.weight"},
      {"transformer.ln_f.bias", "output_norm.bias"},
  };
  for (const auto& [hf, gguf] : kTop)
    if (hf_name == hf) return gguf;
  // "<prefix><layer>.<module>.<weight|bias>", llama's and gpt2's layer modules.
  // clang-format off
  static const std::pair<const char*, const char*> kLlama[] = {
      {"self_attn.q_proj", "attn_q"},
      {"self_attn.k_proj", "attn_k"},
      {"self_attn.v_proj", "attn_v"},
      {"self_attn.o_proj", "attn_output"},
      {"self_attn.qkv_proj", "attn_qkv"},  // phi3's fused q, k, v
      {"mlp.gate_proj", "ffn_gate"},
      {"mlp.up_proj", "ffn_up"},
      {"mlp.gate_up_proj", "ffn_up"},      // phi3's fused gate and up
      {"mlp.down_proj", "ffn_down"},
      {"input_layernorm", "attn_norm"},
      {"post_attention_layernorm", "ffn_norm"},
      {"self_attn.q_norm", "attn_q_norm"},
      {"self_attn.k_norm", "attn_k_norm"},
      {"mlp.gate", "ffn_gate_inp"},                // a mixture of experts' router
      {"mlp.experts.gate_proj", "ffn_gate_exps"},  // ... and its experts, stacked [E, out, in]
      {"mlp.experts.up_proj", "ffn_up_exps"},
      {"mlp.experts.down_proj", "ffn_down_exps"},
  };
  // clang-format on

  // Gemma's four norms a layer: the one after attention is llama's "post_attention_layernorm" by
  // name only (llama's sits before the MLP, as Gemma's pre_feedforward_layernorm does).
  static const std::pair<const char*, const char*> kGemma[] = {
      {"post_attention_layernorm", "post_attention_norm"},
      {"pre_feedforward_layernorm", "ffn_norm"},
      {"post_feedforward_layernorm", "post_ffw_norm"},
  };
  static const std::pair<const char*, const char*> kGpt2[] = {
      {"ln_1", "attn_norm"}, {"attn.c_attn", "attn_qkv"}, {"attn.c_proj", "attn_output"},
      {"ln_2", "ffn_norm"},  {"mlp.c_fc", "ffn_up"},      {"mlp.c_proj", "ffn_down"},
  };
  const bool gpt2 = hf_name.starts_with("transformer.h.");
  const std::string prefix = gpt2 ? "transformer.h." : "model.layers.";
  if (!hf_name.starts_with(prefix)) return "";
  const size_t dot = hf_name.find('.', prefix.size());
  const size_t last = hf_name.rfind('.');
  if (dot == std::string::npos || last <= dot) return "";
  const std::string layer = hf_name.substr(prefix.size(), dot - prefix.size());
  const std::string module = hf_name.substr(dot + 1, last - dot - 1);
  const std::string suffix = hf_name.substr(last + 1);
  if (layer.empty() || layer.find_first_not_of("0123456789") != std::string::npos) return "";
  using Modules = std::span<const std::pair<const char*, const char*>>;
  for (const Modules modules : {gemma ? Modules(kGemma) : Modules(), gpt2 ? Modules(kGpt2) : Modules(kLlama)})
    for (const auto& [hf, g] : modules)
      if (module == hf) return fmt::format("blk.{}.{}.{}", layer, g, suffix);
  return "";
}

GgufWeights::GgufWeights(std::shared_ptr<const io::GgufFile> file, const ModelConfig& config)
    : file_(std::move(file)), config_(config) {}

bool GgufWeights::contains(const std::string& name) const {
  const std::string g = gguf_tensor_name(name, config_.gemma);
  return !g.empty() && file_->find(g) != nullptr;
}

const io::GgufTensorInfo& GgufWeights::tensor(const std::string& name, std::string& g) const {
  g = gguf_tensor_name(name, config_.gemma);
  const io::GgufTensorInfo* t = g.empty() ? nullptr : file_->find(g);
  if (!t)
    throw Error(fmt::format("{} has no tensor '{}' (the model's {}): it is not a complete {} model", file_->path(),
                            g.empty() ? name : g, name, config_.model_type));
  used_.insert(g);
  return *t;
}

void GgufWeights::check_shape(const std::string& g, const std::vector<int64_t>& got,
                              const std::vector<int64_t>& want) const {
  if (!want.empty() && got != want)
    throw Error(
        fmt::format("{}: '{}' has shape [{}] but the metadata implies [{}]: the tensors do not match the "
                    "metadata; re-convert the model",
                    file_->path(), g, fmt::join(got, ", "), fmt::join(want, ", ")));
}

int64_t GgufWeights::permuted_heads(const std::string& g) const {
  if (!family_of_model_type(config_.model_type, file_->path()).llama_gguf) return 0;
  if (g.ends_with(".attn_q.weight") || g.ends_with(".attn_q.bias")) return config_.num_heads;
  if (g.ends_with(".attn_k.weight") || g.ends_with(".attn_k.bias")) return config_.num_kv_heads;
  return 0;
}

at::Tensor GgufWeights::load(const std::string& name, at::ScalarType dtype, at::Device device,
                             const std::vector<int64_t>& shape) const {
  std::string g;
  const io::GgufTensorInfo& t = tensor(name, g);
  // GPT-2's Conv1D weights are [in, out] in HF files; llama.cpp's converter stores them [out, in].
  const bool conv1d = config_.family == Family::Gpt2 && t.dims.size() == 2 && g.ends_with(".weight") &&
                      g.starts_with("blk.") && !g.ends_with("_norm.weight");
  std::vector<int64_t> hf_shape = t.torch_shape();
  if (conv1d) std::swap(hf_shape[0], hf_shape[1]);
  check_shape(g, hf_shape, shape);
  io::check_finite(*file_, t);                                 // (a damaged file is never trained on)
  at::Tensor w = dequantize(*file_, t);                        // float32, the one temporary
  if (config_.gemma && g.ends_with("norm.weight")) w.sub_(1);  // llama.cpp's converter stores Gemma's 1 + weight
  const int64_t heads = permuted_heads(g);
  if (!heads && !conv1d && dtype == at::kFloat && device.is_cpu()) return w;
  at::Tensor src = w;
  if (heads) src = unpermute_rows(w, heads);
  if (conv1d) src = w.t();
  at::Tensor out = at::empty(src.sizes(), at::TensorOptions().dtype(dtype).device(device));
  out.copy_(src);
  return out.view(hf_shape);
}

GgufBlocks GgufWeights::blocks(const std::string& name, at::ScalarType dtype, at::Device device,
                               const std::vector<int64_t>& shape) const {
  std::string g;
  const io::GgufTensorInfo& t = tensor(name, g);
  check_shape(g, t.torch_shape(), shape);
  if (t.dims.size() != 2 || !io::can_dequantize(t.type))
    throw Error(
        fmt::format("{}: tensor '{}' is {}, which model.keep_quantized cannot hold (it keeps F32, F16, BF16, "
                    "Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K): set model.keep_quantized: "
                    "false, or re-quantise the file to one of those",
                    file_->path(), g, io::ggml_type_name(t.type)));
  GgufBlocks b{.raw = {},
               .type = t.type,
               .shape = t.torch_shape(),
               .heads = permuted_heads(g),
               .dtype = dtype,
               .device = device};
  const auto bytes = static_cast<int64_t>(t.nbytes);
  if (device.is_meta()) {  // (shapes only: no value is read)
    b.raw = at::empty({bytes}, at::TensorOptions().dtype(at::kByte).device(at::kMeta));
    return b;
  }
  io::check_finite(*file_, t);  // (its scales once here: dequantised at every use later)
  b.raw = at::empty({bytes}, at::kByte);
  const std::span<const std::byte> src = file_->bytes(t);
  std::memcpy(b.raw.data_ptr(), src.data(), src.size());
  file_->release(t);
  if (device.is_cuda()) b.raw = b.raw.to(device);  // dequantised on the GPU at each use
  return b;
}

void GgufWeights::check_all_used() const {
  // (the rotary factor tensors are the config's: gguf_config has read them)
  static const std::set<std::string> kConfig = {"rope_freqs.weight", "rope_factors_long.weight",
                                                "rope_factors_short.weight"};
  for (const io::GgufTensorInfo& t : file_->tensors())
    if (!used_.count(t.name) && !(config_.family == Family::Llama && kConfig.count(t.name)))
      throw Error(
          fmt::format("{}: tensor '{}' has no place in the {} model lorarun builds from this file (an "
                      "unsupported variant of the architecture)",
                      file_->path(), t.name, config_.model_type));
}

}  // namespace lorarun::model
