#include "model/config.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "model/families.hpp"
#include "util/error.hpp"

namespace lorarun::model {
namespace {

using nlohmann::json;

struct Reader {
  const json& j;
  std::string file;

  template <class T>
  T get(const char* key, std::optional<T> fallback = std::nullopt) const {
    if (!j.contains(key) || j[key].is_null()) {
      if (fallback) return *fallback;
      throw Error(fmt::format("{}: '{}' is missing; is this a complete Hugging Face config?", file, key));
    }
    try {
      return j[key].get<T>();
    } catch (const json::exception&) {
      throw Error(fmt::format("{}: '{}' has the wrong type ({})", file, key, j[key].dump()));
    }
  }
  std::optional<int64_t> token(const char* key) const {
    if (!j.contains(key) || !j[key].is_number_integer()) return std::nullopt;  // lists: not a single id
    return j[key].get<int64_t>();
  }
};

// One rope parameter set (rope_parameters, or rope_scaling in 4.x files): type, theta, scaling.
void read_rope_set(const json& p, const std::string& file, ModelConfig& c) {
  const Reader s{p, file + " rope parameters"};
  c.rope_theta = s.get<double>("rope_theta", c.rope_theta);
  c.rope.type = p.contains("rope_type") ? s.get<std::string>("rope_type") : s.get<std::string>("type", "default");
  if (c.rope.type == "su" || c.rope.type == "yarn") c.rope.type = "longrope";  // phi3's older names for it
  if (c.rope.type != "default" && c.rope.type != "linear" && c.rope.type != "llama3" && c.rope.type != "longrope")
    throw Error(
        fmt::format("{}: rope type '{}' is not supported (default, linear, llama3, longrope)", file, c.rope.type));
  c.rope.factor = s.get<double>("factor", 1.0);
  c.rope.low_freq_factor = s.get<double>("low_freq_factor", 1.0);
  c.rope.high_freq_factor = s.get<double>("high_freq_factor", 4.0);
  c.rope.original_max_position = s.get<int64_t>("original_max_position_embeddings", c.rope.original_max_position);
  c.partial_rotary = s.get<double>("partial_rotary_factor", c.partial_rotary);
  if (c.rope.type != "longrope") return;
  c.rope.short_factor = s.get<std::vector<double>>("short_factor");
  c.rope.long_factor = s.get<std::vector<double>>("long_factor");
  const auto rotated = static_cast<size_t>(c.head_dim * c.partial_rotary) / 2;
  if (c.rope.short_factor.size() != rotated || c.rope.long_factor.size() != rotated)
    throw Error(fmt::format(
        "{}: longrope short_factor and long_factor need {} values each (head_dim {} x "
        "partial_rotary_factor {} / 2), not {} and {}",
        file, rotated, c.head_dim, c.partial_rotary, c.rope.short_factor.size(), c.rope.long_factor.size()));
  // As transformers: the factor is the context's growth unless given; cos and sin grow with it.
  const double factor = p.contains("factor") && !p["factor"].is_null()
                            ? c.rope.factor
                            : static_cast<double>(c.max_positions) / c.rope.original_max_position;
  c.rope.attention_factor =
      s.get<double>("attention_factor",
                    factor <= 1.0 ? 1.0 : std::sqrt(1 + std::log(factor) / std::log(c.rope.original_max_position)));
}

// rope settings: transformers 5 writes rope_parameters (theta inside; gemma3 one set per layer
// type), 4.x rope_theta + rope_scaling (+ gemma3's rope_local_base_freq).
void read_rope(const Reader& r, ModelConfig& c) {
  c.rope_theta = r.get<double>("rope_theta", 10000.0);
  c.partial_rotary = r.get<double>("partial_rotary_factor", 1.0);
  c.rope.original_max_position = r.get<int64_t>("original_max_position_embeddings", 8192);
  const json* p = nullptr;
  if (r.j.contains("rope_parameters") && r.j["rope_parameters"].is_object())
    p = &r.j["rope_parameters"];
  else if (r.j.contains("rope_scaling") && r.j["rope_scaling"].is_object())
    p = &r.j["rope_scaling"];
  if (family_of_model_type(c.model_type, r.file).local_rope) {
    c.rope_theta = r.get<double>("rope_theta", 1000000.0);
    c.local_rope_theta = r.get<double>("rope_local_base_freq", 10000.0);
    if (p && p->contains("sliding_attention")) {
      ModelConfig local = c;
      read_rope_set((*p)["sliding_attention"], r.file + " (sliding_attention)", local);
      if (local.rope.type != "default")
        throw Error(fmt::format("{}: rope type '{}' on the sliding-window layers is not supported (default)", r.file,
                                local.rope.type));
      c.local_rope_theta = local.rope_theta;
    }
    if (p && p->contains("full_attention")) p = &(*p)["full_attention"];
  }
  if (p) read_rope_set(*p, r.file, c);
}

// Which layers the sliding window applies to: config's layer_types, or the family's pattern.
void read_layer_types(const Reader& r, ModelConfig& c) {
  c.sliding_layers.clear();
  if (r.j.contains("layer_types") && r.j["layer_types"].is_array()) {
    for (const json& t : r.j["layer_types"]) c.sliding_layers.push_back(t == "sliding_attention");
  } else if (const FamilyTraits& f = family_of_model_type(c.model_type, r.file); f.global_every > 0) {
    const int64_t every = r.get<int64_t>("sliding_window_pattern", f.global_every);
    for (int64_t i = 0; i < c.num_layers; ++i) c.sliding_layers.push_back((i + 1) % every != 0);
  } else {
    return;  // mistral and others: every layer when a window is set
  }
  if (static_cast<int64_t>(c.sliding_layers.size()) != c.num_layers)
    throw Error(
        fmt::format("{}: layer_types has {} entries for {} layers", r.file, c.sliding_layers.size(), c.num_layers));
  if (std::find(c.sliding_layers.begin(), c.sliding_layers.end(), true) == c.sliding_layers.end())
    c.sliding_window.reset();
}

// The experts of a qwen3_moe or mixtral config (num_experts, or num_local_experts as transformers 5
// writes both), which layers have them, and how their router weighs them.
void read_moe(const Reader& r, const FamilyTraits& f, ModelConfig& c) {
  MoeConfig& m = c.moe;
  const char* count = r.j.contains("num_experts") ? "num_experts" : "num_local_experts";
  m.experts = r.get<int64_t>(count);
  m.top_k = r.get<int64_t>("num_experts_per_tok");
  const bool qwen = f.moe == FamilyTraits::Moe::Qwen;
  m.intermediate = qwen ? r.get<int64_t>("moe_intermediate_size") : c.intermediate_size;
  m.normalize_top_k = qwen ? r.get<bool>("norm_topk_prob", false) : true;
  m.float_weights = !qwen;
  m.aux_loss_coef = r.get<bool>("output_router_logits", false) ? r.get<double>("router_aux_loss_coef", 0.001) : 0.0;
  if (m.experts <= 0 || m.top_k <= 0 || m.top_k > m.experts || m.intermediate <= 0)
    throw Error(fmt::format("{}: inconsistent experts ({} {}, num_experts_per_tok {}, expert intermediate size {})",
                            r.file, count, m.experts, m.top_k, m.intermediate));
  if (!qwen && r.get<double>("router_jitter_noise", 0.0) != 0.0)
    throw Error(
        fmt::format("{}: router_jitter_noise is not supported (set it to 0.0: released Mixtral configs do)", r.file));
  const auto dense =
      qwen ? r.get<std::vector<int64_t>>("mlp_only_layers", std::vector<int64_t>{}) : std::vector<int64_t>{};
  const int64_t step = qwen ? r.get<int64_t>("decoder_sparse_step", 1) : 1;
  if (step <= 0) throw Error(fmt::format("{}: decoder_sparse_step must be positive, got {}", r.file, step));
  for (int64_t i = 0; i < c.num_layers; ++i)
    m.sparse.push_back(std::find(dense.begin(), dense.end(), i) == dense.end() && (i + 1) % step == 0);
}

void read_llama(const Reader& r, ModelConfig& c) {
  c.family = Family::Llama;
  c.vocab_size = r.get<int64_t>("vocab_size");
  c.hidden_size = r.get<int64_t>("hidden_size");
  c.intermediate_size = r.get<int64_t>("intermediate_size");
  c.num_layers = r.get<int64_t>("num_hidden_layers");
  c.num_heads = r.get<int64_t>("num_attention_heads");
  c.num_kv_heads = r.get<int64_t>("num_key_value_heads", c.num_heads);
  c.head_dim = r.get<int64_t>("head_dim", c.hidden_size / std::max<int64_t>(1, c.num_heads));
  c.max_positions = r.get<int64_t>("max_position_embeddings", 2048);
  c.norm_eps = r.get<double>("rms_norm_eps", 1e-6);
  c.tie_word_embeddings = r.get<bool>("tie_word_embeddings", c.gemma);
  c.activation = r.get<std::string>(c.gemma ? "hidden_activation" : "hidden_act",
                                    std::string(c.gemma ? "gelu_pytorch_tanh" : "silu"));
  c.attention_bias = r.get<bool>("attention_bias", false);
  const FamilyTraits& f = family_of_model_type(c.model_type, r.file);
  c.qkv_bias = f.qkv_bias;
  c.qk_norm = f.qk_norm;
  c.fused = f.fused;
  c.mlp_bias = r.get<bool>("mlp_bias", false);
  read_rope(r, c);
  if (f.moe != FamilyTraits::Moe::None) read_moe(r, f, c);
  const bool use_sliding = f.always_windowed || r.get<bool>("use_sliding_window", false);
  if (use_sliding && r.j.contains("sliding_window") && r.j["sliding_window"].is_number_integer())
    c.sliding_window = r.j["sliding_window"].get<int64_t>();
  read_layer_types(r, c);
  if (c.gemma) {
    c.query_pre_attn_scalar = r.get<double>("query_pre_attn_scalar", 256.0);
    const auto cap = [&](const char* key) -> std::optional<double> {
      if (!r.j.contains(key) || r.j[key].is_null()) return std::nullopt;
      return r.get<double>(key);
    };
    c.attn_softcap = cap("attn_logit_softcapping");
    c.logit_softcap = cap("final_logit_softcapping");
    if (r.get<bool>("use_bidirectional_attention", false))
      throw Error(
          fmt::format("{}: use_bidirectional_attention is not supported (causal language models only)", r.file));
  }
}

void read_opt(const Reader& r, ModelConfig& c) {
  c.family = Family::Opt;
  c.vocab_size = r.get<int64_t>("vocab_size");
  c.hidden_size = r.get<int64_t>("hidden_size");
  c.intermediate_size = r.get<int64_t>("ffn_dim");
  c.num_layers = r.get<int64_t>("num_hidden_layers");
  c.num_heads = c.num_kv_heads = r.get<int64_t>("num_attention_heads");
  c.head_dim = c.num_heads > 0 ? c.hidden_size / c.num_heads : 0;  // (0 heads: refused below)
  c.max_positions = r.get<int64_t>("max_position_embeddings", 2048);
  c.norm_eps = 1e-5;
  c.tie_word_embeddings = r.get<bool>("tie_word_embeddings", true);
  c.activation = r.get<std::string>("activation_function", "relu");
  c.do_layer_norm_before = r.get<bool>("do_layer_norm_before", true);
  c.remove_final_layer_norm = r.get<bool>("_remove_final_layer_norm", false);
  c.word_embed_proj_dim = r.get<int64_t>("word_embed_proj_dim", c.hidden_size);
  c.enable_bias = r.get<bool>("enable_bias", true);
}

void read_gpt2(const Reader& r, ModelConfig& c) {
  c.family = Family::Gpt2;
  c.vocab_size = r.get<int64_t>("vocab_size");
  c.hidden_size = r.get<int64_t>("n_embd");
  c.intermediate_size = r.get<int64_t>("n_inner", 4 * c.hidden_size);
  c.num_layers = r.get<int64_t>("n_layer");
  c.num_heads = c.num_kv_heads = r.get<int64_t>("n_head");
  c.head_dim = c.num_heads > 0 ? c.hidden_size / c.num_heads : 0;
  c.max_positions = r.get<int64_t>("n_positions", 1024);
  c.norm_eps = r.get<double>("layer_norm_epsilon", 1e-5);
  c.tie_word_embeddings = r.get<bool>("tie_word_embeddings", true);
  c.activation = r.get<std::string>("activation_function", "gelu_new");
  if (r.get<bool>("scale_attn_by_inverse_layer_idx", false) || r.get<bool>("reorder_and_upcast_attn", false))
    throw Error(fmt::format("{}: scale_attn_by_inverse_layer_idx / reorder_and_upcast_attn are not supported", r.file));
}

}  // namespace

ModelConfig load_config(const std::string& model_dir) {
  const std::string file = (std::filesystem::path(model_dir) / "config.json").string();
  if (!std::filesystem::exists(file))
    throw Error(
        fmt::format("{} not found: model.path must be a Hugging Face model directory "
                    "(config.json, *.safetensors, tokenizer.json)",
                    file));
  json j;
  try {
    j = json::parse(io::read_file(file));
  } catch (const json::exception& e) {
    throw Error(fmt::format("{} is not valid JSON: {}", file, e.what()));
  }
  if (!j.is_object()) throw Error(fmt::format("{} is not a JSON object", file));
  const Reader r{j, file};
  ModelConfig c;
  c.model_type = r.get<std::string>("model_type");
  const FamilyTraits& family = family_of_model_type(c.model_type, file);
  c.gemma = family.gemma;
  switch (family.family) {
    case Family::Llama:
      read_llama(r, c);
      break;
    case Family::Opt:
      read_opt(r, c);
      break;
    case Family::Gpt2:
      read_gpt2(r, c);
      break;
  }
  if (c.vocab_size <= 0 || c.hidden_size <= 0 || c.num_layers <= 0 || c.num_heads <= 0 || c.num_kv_heads <= 0 ||
      c.num_heads % c.num_kv_heads != 0 || c.head_dim <= 0)
    throw Error(
        fmt::format("{}: inconsistent sizes (vocab {}, hidden {}, layers {}, heads {}/{} kv, "
                    "head_dim {})",
                    file, c.vocab_size, c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim));
  c.torch_dtype = r.get<std::string>("dtype", r.get<std::string>("torch_dtype", std::string("float32")));
  c.bos_token_id = r.token("bos_token_id");
  c.eos_token_id = r.token("eos_token_id");
  c.pad_token_id = r.token("pad_token_id");
  return c;
}

}  // namespace lorarun::model
