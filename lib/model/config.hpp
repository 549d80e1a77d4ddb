// A Hugging Face config.json, reduced to what the supported transformer families need.
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace lorarun::model {

enum class Family { Llama, Opt, Gpt2 };  // llama covers mistral, qwen2 and qwen3

struct RopeScaling {
  std::string type = "default";  // default | linear | llama3
  double factor = 1.0;
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  int64_t original_max_position = 8192;
};

struct ModelConfig {
  std::string model_type;               // llama, mistral, qwen2, qwen3, opt, gpt2
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
  bool tie_word_embeddings = false;
  bool attention_bias = false;  // llama attention_bias; qwen2 always has q/k/v bias
  bool qkv_bias = false;        // bias on q/k/v only (qwen2)
  bool qk_norm = false;         // RMSNorm over each head of q and k before rope (qwen3)
  bool mlp_bias = false;
  std::string activation = "silu";
  std::optional<int64_t> sliding_window;  // mistral/qwen2, when in use
  // opt
  bool do_layer_norm_before = true;
  bool remove_final_layer_norm = false;
  int64_t word_embed_proj_dim = 0;
  bool enable_bias = true;
  // token ids from config.json, when present
  std::optional<int64_t> bos_token_id, eos_token_id, pad_token_id;
};

// Reads DIR/config.json. Throws lorarun::Error for a missing file, an unsupported model_type
// (naming the supported ones) or missing/invalid fields.
ModelConfig load_config(const std::string& model_dir);

}  // namespace lorarun::model
