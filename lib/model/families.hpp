// The model families: one table entry each — config.json's model_type, the transformers class,
// the GGUF architecture, and the traits that tell the llama-like decoders apart — read by
// config.cpp (config.json), gguf_weights.cpp (GGUF in), export.cpp (config.json of a GGUF base)
// and gguf_export.cpp (GGUF out). Adding a family is an entry here plus its genuinely new maths.
#pragma once
#include <optional>
#include <string>
#include <string_view>

#include "model/config.hpp"
#include "tokenizer/gguf_vocab.hpp"

namespace lorarun::model {

struct FamilyTraits {
  std::string_view model_type = {};  // config.json's model_type
  std::string_view hf_class = {};    // its transformers class, for a config.json we write
  std::string_view gguf = {};        // llama.cpp's architecture it is read from and written as ("" none)
  Family family = Family::Llama;
  bool qkv_bias = false;         // biases on q, k and v whatever attention_bias says (qwen2)
  bool qk_norm = false;          // RMSNorm over each head of q and k (qwen3, gemma3)
  bool fused = false;            // one qkv_proj and one gate_up_proj (phi3)
  bool gemma = false;            // 1+weight norms, sqrt(hidden) embeddings, sandwich norms, soft-capping
  bool always_windowed = false;  // sliding_window applies without use_sliding_window (mistral, gemma, phi3)
  int global_every = 0;          // without layer_types: every Nth layer (sliding_window_pattern) is global (gemma)
  bool local_rope = false;       // windowed layers have a rope base of their own (gemma3)
  // The mixture-of-experts layout: on disk, qwen's mlp.gate + mlp.experts.{e}.{gate,up,down}_proj or
  // mixtral's block_sparse_moe.gate + block_sparse_moe.experts.{e}.w1/w3/w2 (also read fused, as
  // transformers 5 holds them: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]).
  enum class Moe { None, Qwen, Mixtral } moe = Moe::None;
  bool llama_gguf = false;  // llama.cpp's llama: Q/K rows in its rotary order, vocab_size and rope keys
  // What llama.cpp assumes of a GGUF file of the family that does not say (gemma): the layer count
  // of the large variant whose queries are scaled by hidden/heads rather than head_dim (27B), the
  // sliding window, and the attention and final logit soft-caps (0: none unless the file says).
  int64_t large_variant_layers = 0;
  int64_t gguf_window = 0;
  double gguf_attn_softcap = 0, gguf_logit_softcap = 0;
};

// How transformers builds a SentencePiece tokenizer of a GGUF file of architecture `arch` (its
// GGUF_SENTENCEPIECE_BUILDERS): llama's, Gemma's (gemma, gemma2, gemma3) or phi3's (llama's with a
// prepending normalizer). Any architecture, lorarun's families or not: a tokenizer is read alone.
tok::SentencePieceKind sentencepiece_kind_of_gguf(const std::string& arch);

// The family of config.json's model_type; lorarun::Error naming `file` and the supported types
// (or why a known checkpoint kind is refused) when there is none.
const FamilyTraits& family_of_model_type(const std::string& model_type, const std::string& file);

// The family read from GGUF architecture `arch` (mistral's files say llama); Error naming `file`,
// `arch` (escaped) and the supported ones when there is none.
const FamilyTraits& family_of_gguf(const std::string& arch, const std::string& file);

// The GGUF architecture `model_type` is written as; Error naming those that can be when none.
std::string gguf_architecture_of(const std::string& model_type);

}  // namespace lorarun::model
