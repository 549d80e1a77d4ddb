// A Hugging Face config.json, reduced to what the supported transformer families need.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lorarun::model {

// Llama covers every pre-norm decoder with rotary positions and a gated MLP, the families told
// apart by the flags below (model/families.cpp: one table of them).
enum class Family { Llama, Opt, Gpt2 };

struct RopeScaling {
  std::string type = "default";  // default | linear | llama3 | longrope
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
  // longrope (phi3): per-frequency divisors, the long set once a sequence passes
  // original_max_position; cos and sin are scaled by attention_factor.
  std::vector<double> short_factor, long_factor;
  double attention_factor = 1.0;
};

// A mixture-of-experts MLP (qwen3_moe, mixtral): each token's hidden state goes through the top_k
// of `experts` gated MLPs its router scores highest, their outputs summed by the router's weights.
struct MoeConfig {
  int64_t experts = 0;          // 0: a dense model
  int64_t top_k = 0;            // num_experts_per_tok
  int64_t intermediate = 0;     // each expert's (qwen3_moe moe_intermediate_size; mixtral intermediate_size)
  bool normalize_top_k = true;  // the k weights divided by their sum (qwen3_moe norm_topk_prob; mixtral always)
  bool float_weights = false;   // the k weights multiply in float32 (mixtral), else in the model's dtype (qwen)
  // What transformers adds to the loss: router_aux_loss_coef × the load-balancing loss, only when
  // config.json says output_router_logits (its default: false, so 0 here).
  double aux_loss_coef = 0;
  std::vector<bool> sparse;  // per layer: experts (true) or the dense MLP (qwen3_moe mlp_only_layers)
  bool sparse_layer(size_t layer) const { return experts > 0 && sparse.at(layer); }
};

struct ModelConfig {
  std::string model_type;               // config.json's model_type (families.hpp)
  std::string torch_dtype = "float32";  // the dtype the weights were saved in
  Family family = Family::Llama;
  int64_t vocab_size = 0;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;  // opt: ffn_dim, gpt2: n_inner (default 4*hidden)
  int64_t num_layers = 0;
  int64_t num_heads = 0;
  int64_t num_kv_heads = 0;
  int64_t head_dim = 0;
  int64_t max_positions = 0;
  double norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope;
  double partial_rotary = 1.0;  // the share of head_dim that rope rotates (phi3 partial_rotary_factor)
  double local_rope_theta = 0;  // gemma3: the windowed layers' own rope base (no scaling); 0: as the others
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // llama attention_bias; qwen2 always has q/k/v bias
  bool qkv_bias = false;        // bias on q/k/v only (qwen2)
  bool qk_norm = false;         // RMSNorm over each head of q and k before rope (qwen3)
  bool mlp_bias = false;
  bool fused = false;  // phi3: one qkv_proj [q|k|v] and one gate_up_proj [gate|up]
  // gemma2/3: RMSNorm scales by 1 + weight (in float32), embeddings are multiplied by
  // sqrt(hidden_size), and attention and MLP outputs are normed before the residual add too.
  bool gemma = false;
  std::optional<double> query_pre_attn_scalar;  // gemma: scores scaled by its -1/2 power, not head_dim's
  std::optional<double> attn_softcap;           // gemma2: scores -> cap * tanh(scores / cap)
  std::optional<double> logit_softcap;          // gemma2: logits -> cap * tanh(logits / cap)
  std::string activation = "silu";
  std::optional<int64_t> sliding_window;  // when in use
  std::vector<bool> sliding_layers;       // the layers the window applies to; empty: all of them
  // opt
  bool do_layer_norm_before = true;
  bool remove_final_layer_norm = false;
  int64_t word_embed_proj_dim = 0;
  bool enable_bias = true;
  bool windowed(size_t layer) const { return sliding_window && (sliding_layers.empty() || sliding_layers.at(layer)); }
  MoeConfig moe;
  // token ids from config.json, when present
  std::optional<int64_t> bos_token_id, eos_token_id, pad_token_id;
};

// Reads DIR/config.json. Throws lorarun::Error for a missing file, an unsupported model_type
// (naming the supported ones) or missing/invalid fields.
ModelConfig load_config(const std::string& model_dir);

}  // namespace lorarun::model
