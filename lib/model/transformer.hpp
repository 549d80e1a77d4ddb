// Causal language models of the supported families (llama, mistral, qwen2/3, gemma2/3, phi3, opt, gpt2) in
// LibTorch, loaded from a Hugging Face directory, with LoRA-capable linear layers.
#pragma once
#include <ATen/core/Tensor.h>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "model/config.hpp"
#include "model/gguf_blocks.hpp"
#include "model/nf4.hpp"
#include "model/sharded.hpp"
#include "model/tenants.hpp"

namespace lorarun::recipe {
enum class Dtype;
}

namespace lorarun::tok {
class Tokenizer;
}

namespace lorarun::model {

class WeightSource;

// The recipe's model.dtype as the weights' tensor dtype on CUDA (`cuda`) or this CPU: auto is bf16
// on CUDA and where the CPU has bf16 instructions (AVX512-BF16 or AMX; elsewhere torch emulates
// bf16, slower than fp32), else fp32.
at::ScalarType dtype_of(recipe::Dtype d, bool cuda);

// Whether this CPU computes bf16 in hardware (AVX512-BF16 or AMX-BF16).
bool cpu_has_bf16();

// A frozen linear layer, y = x W^T + b, plus an optional LoRA adapter:
//   y += scaling * B A dropout(x),  A [r, in], B [out, r]   (PEFT's LoraLayer)
// W is `weight`, or for QLoRA `nf4`, or with model.keep_quantized the GGUF's `blocks` (both
// dequantised on the fly). With DoRA (a magnitude)
// the adapted rows are rescaled: see dora.hpp.
struct Linear {
  std::string name;   // the HF module name, e.g. "model.layers.0.self_attn.q_proj"
  at::Tensor weight;  // [out, in], frozen; undefined when the weight is in NF4 or sharded
  std::optional<Nf4Weight> nf4;
  std::optional<GgufBlocks> blocks;      // model.keep_quantized: the file's blocks
  std::optional<ShardedWeight> sharded;  // dist.shard_base: this rank's slices of weight (or nf4)
  at::Tensor bias;                       // [out] or undefined
  bool conv1d = false;                   // GPT-2 Conv1D: the file stores the weight as [in, out]
  // A mixture of experts' router: kept whole (never quantised nor sharded, as transformers keeps it),
  // adapted as PEFT adapts a parameter (target_parameters' gate.weight: no dropout, no DoRA).
  bool router = false;
  at::Tensor lora_a;            // [r, in]; defined when adapted
  at::Tensor lora_b;            // [out, r]
  at::Tensor magnitude;         // DoRA: [out], the learnt row norms (lora_magnitude_vector)
  at::Tensor base_sq;           // DoRA: [out] float32, the squared row norms of the frozen W
  at::Tensor lora_a0, lora_b0;  // PiSSA/OLoRA: A and B at the start, float32, taken out of W (see lora_init.hpp)
  double scaling = 0.0;
  double dropout = 0.0;
  bool adapter_off = false;  // the adapter skipped: the base layer alone (a preference loss's reference)
  // adapters: (a job of many) one pair per adapter of the job, by slot, used as `routes` says
  std::vector<TenantLora> tenants;

  at::Tensor forward(const at::Tensor& x, bool training, const Routes* routes = nullptr) const;
  bool adapted() const { return lora_a.defined(); }
  // x W^T + bias: the frozen weight as it is held (dense, NF4, the GGUF's blocks, shards).
  at::Tensor base(const at::Tensor& x) const;
  bool dora() const { return magnitude.defined(); }
  bool defined() const { return weight.defined() || nf4 || blocks || sharded; }  // families leave some empty
  int64_t out_features() const { return shape()[0]; }
  int64_t in_features() const { return shape()[1]; }
  std::vector<int64_t> shape() const {  // W's [out, in]
    return sharded ? sharded->shape : nf4 ? nf4->shape : blocks ? blocks->shape : weight.sizes().vec();
  }
  // W whole: as held, or dequantised (NF4, GGUF blocks); not for a sharded weight.
  at::Tensor dense_weight() const { return nf4 ? nf4->dequantize() : blocks ? blocks->dequantize() : weight; }
};

// One stacked expert tensor of a mixture-of-experts MLP, [E, out, in] as transformers 5 holds it
// (gate_up_proj: each expert's gate rows, then its up rows), frozen; adapted with PEFT's
// target_parameters layout: A [r·E, in] (expert e's rows e·r … e·r + r - 1), B [out, r·E] (expert
// e's columns e, E + e, …), so ΔW_e = scaling · B_e A_e.
struct Experts {
  std::string name;   // the parameter's HF name, e.g. "model.layers.0.mlp.experts.gate_up_proj"
  at::Tensor weight;  // [E, out, in]
  at::Tensor lora_a, lora_b;
  double scaling = 0.0;
  bool adapter_off = false;
  bool adapted() const { return lora_a.defined(); }
  int64_t count() const { return weight.size(0); }
  int64_t out_features() const { return weight.size(1); }
  int64_t in_features() const { return weight.size(2); }
  // rows [n, in], routed to expert `e` -> [n, out]
  at::Tensor forward(int64_t e, const at::Tensor& rows) const;
};

// A mixture-of-experts MLP (qwen3_moe, mixtral): the router, a linear [E, H] named as transformers 5
// names it ("model.layers.0.mlp.gate"; PEFT adapts it as a parameter), and the experts' gated MLPs.
struct MoeMlp {
  Linear router;
  Experts gate_up, down;
  bool defined() const { return router.defined(); }
};

// What the routers of a training pass did (CausalLM::router_pass).
struct RouterPass {
  at::Tensor loss;  // float32 scalar: transformers' load-balancing loss of the pass (with its gradient)
  at::Tensor load;  // [MoE layers, E] float64: the real tokens each layer sent each expert
};

struct Norm {
  at::Tensor weight, bias;  // bias undefined for RMSNorm
};

// One decoder block. Linears unused by a family stay empty (name == "").
struct Block {
  Norm norm1, norm2;                 // before attention, before the MLP
  Norm attn_out_norm, mlp_out_norm;  // gemma: on the attention and MLP outputs, before the residual add
  Norm q_norm, k_norm;               // qwen3, gemma3: RMSNorm over head_dim of each query and key head
  Linear q, k, v, qkv, o;            // qkv: GPT-2's c_attn, phi3's qkv_proj ([q | k | v] rows)
  Linear gate, up, gate_up, down;    // opt: up=fc1, down=fc2; gpt2: up=c_fc, down=c_proj; gate_up: phi3's
  MoeMlp moe;                        // a mixture-of-experts layer's MLP, in place of gate, up and down
};

// PEFT's modules_to_save and trainable_token_indices: trained stand-ins for the frozen embedding
// and output head, used by forward in their place (attached by attach_lora; see lora.hpp).
struct TrainedTables {
  at::Tensor embed;          // modules_to_save: the embedding's copy [vocab, E], in the adapters' dtype
  at::Tensor head;           // modules_to_save: the output head's copy [vocab, E]
  at::Tensor token_ids;      // trainable_token_indices [n] int64
  at::Tensor token_rows;     // [n, E]: those embedding rows, trained (PEFT's trainable_tokens_delta)
  at::Tensor token_slot;     // [vocab] int64: k where token_ids[k] is the id, else -1
  bool head_tokens = false;  // the head is tied to the embedding: its rows of token_ids are token_rows too
  bool off = false;          // skipped: the frozen tables alone (a preference loss's reference)
};

// Keys and values of past positions, for generation: per layer [B, kv_heads, capacity, head_dim]
// buffers, the first length() positions filled. They grow 256 positions at a time, so a step
// writes its new positions in place rather than copying all the past ones (generate.cpp).
struct KVCache {
  std::vector<at::Tensor> k, v;
  int64_t filled = 0;  // positions of every layer written by the passes done
  int64_t length() const { return filled; }
  // Writes `kv` [B, kv_heads, T, head_dim] at positions [filled, filled + T) of layer `layer`'s
  // keys (which 0) or values (1) and returns the layer's positions so far.
  at::Tensor append(size_t layer, int which, const at::Tensor& kv);
  // Keeps the batch rows `rows` (int64, on the CPU) only: their filled positions.
  void keep_rows(const at::Tensor& rows);
};

// How the base weights are held.
struct LoadOptions {
  bool quantize = false;     // QLoRA: every linear LoRA may adapt in NF4, quantised as it is loaded
  bool double_quant = true;  // with quantize: the NF4 block scales in 8 bits too
  // model.keep_quantized (a GGUF file): every linear of linears() kept as the file's blocks
  bool keep_quantized = false;
  // dist.shard_base: each linear of linears() kept as this rank's slices, cut as it is loaded
  // (and quantised), so no rank holds the whole model; gathered whole while it is used.
  std::shared_ptr<BaseShards> shards = {};  // the decoder blocks' slices are registered with it
  // Every tensor on the meta device: the shapes and dtypes loading makes, no data read (what a
  // memory estimate counts).
  bool shapes_only = false;
};

class CausalLM {
 public:
  // Loads a HF model directory or cached model id (config.json + model.safetensors or a sharded
  // index; see resolve_model_path), or a .gguf file (config from its metadata, tensors dequantised
  // one at a time; see gguf_weights.hpp), converting weights to `dtype` on `device`; with
  // opts.quantize each linear of linears() is quantised from `dtype` (embeddings, norms and the
  // output projection stay, as transformers + bitsandbytes leave them). Throws lorarun::Error
  // when weights are missing or disagree with config.
  static CausalLM load(const std::string& path_or_id, at::ScalarType dtype, at::Device device,
                       const LoadOptions& opts = {});

  const ModelConfig& config() const { return config_; }
  const std::string& dir() const { return dir_; }  // the model directory, or the .gguf file
  // The longest sequence it takes: its learned position table's length (opt, gpt2); none for the
  // rotary families, whose positions are computed.
  std::optional<int64_t> position_limit() const;
  // Throws ConfigError naming the model and `what` ("data.max_length 1024") when `tokens` passes
  // position_limit().
  void check_length(int64_t tokens, const std::string& what) const;
  // Throws ConfigError when `tokenizer` makes ids the embedding has no row for: an id past its
  // rows would fail deep in the forward pass.
  void check_tokenizer(const tok::Tokenizer& tokenizer) const;
  at::ScalarType dtype() const { return dtype_; }
  at::Device device() const { return device_; }

  // input_ids [B, T] (int64), attention_mask [B, T] (1 = token, 0 = right padding) or undefined.
  // Returns the final hidden states [B, T, H'] (before the output projection).
  // packed: several documents share a row; attention_mask then numbers them (1, 2, .. per row,
  // 0 = padding): a token attends within its document only, positions restart per document.
  at::Tensor hidden_states(const at::Tensor& input_ids, const at::Tensor& attention_mask, KVCache* cache = nullptr,
                           bool packed = false) const;
  // hidden [.., H'] -> logits [.., vocab]
  at::Tensor logits(const at::Tensor& hidden) const;
  // The output projection [vocab, H'] as forward uses it: the frozen one, or what the tables of the
  // adapter in use make of it (`tables`; a job's adapter the Routing sends every row to).
  at::Tensor lm_head() const;
  // A job's adapter `slot`'s output projection (what its tenant_tables make of the frozen one).
  at::Tensor lm_head(int slot) const;
  // [vocab, E] (dequantised whole when model.keep_quantized holds it as the file's blocks)
  at::Tensor frozen_embedding() const { return embed_blocks_ ? embed_blocks_->dequantize() : embed_tokens_; }
  at::Tensor frozen_lm_head() const { return tied_ ? frozen_embedding() : lm_head_; }
  bool head_tied() const { return tied_; }  // tie_word_embeddings
  // The embedding's HF module name: "model.embed_tokens", "model.decoder.embed_tokens" (opt), "transformer.wte".
  const std::string& embedding_name() const { return embedding_name_; }
  // Writes `tables` into the frozen embedding and head and drops them (a merge). Throws lorarun::Error
  // when they would untie a tied head.
  void fold_tables();
  TrainedTables tables;
  // adapters: (a job of many with trained tables) adapter slot's tables; its routes' rows are
  // embedded by them. Empty when the job's adapters train none.
  std::vector<TrainedTables> tenant_tables;
  // Every adapter skipped, or back: the base alone (a preference loss's reference).
  void set_adapters_off(bool off);
  at::Tensor forward(const at::Tensor& input_ids, const at::Tensor& attention_mask) const {
    return logits(hidden_states(input_ids, attention_mask));
  }

  // Mixture of experts: each MoE layer's MLP, in layer order (none for a dense model).
  std::vector<MoeMlp*> moe_layers();
  std::vector<const MoeMlp*> moe_layers() const;
  // The routers' record of the last hidden_states pass in training (not generation's): undefined
  // tensors when the model has no experts or the pass recorded nothing.
  RouterPass router_pass() const;
  // Every linear layer LoRA may adapt (the output projection excluded, as in PEFT), the routers of a
  // mixture of experts included.
  std::vector<Linear*> linears();
  std::vector<const Linear*> linears() const;
  // Number of parameters of the base model (tied weights counted once).
  int64_t base_parameter_count() const;
  // Bytes of base weights this process holds (NF4 and sharded linears as held; tied weights once);
  // with `unsharded`, what it would hold without dist.shard_base.
  int64_t base_bytes(bool unsharded = false) const;
  // Bytes a training micro-batch of [batch, tokens] holds at its most besides the weights: what
  // forward keeps for backward (the blocks' inputs and one block's worth under
  // recompute_activations), the attention masks, the loss's chunk of logits and the gradients
  // backward has in flight. Estimated from the shapes, as this implementation keeps its tensors
  // (memory.cpp); counts the adapters attached.
  int64_t activation_bytes(int64_t batch, int64_t tokens) const;
  // The base weights under their HF names, in the file's layout (GPT-2 Conv1D as [in, out]).
  // They share storage with the model, so a merge shows up here; NF4 weights come dequantised.
  std::vector<std::pair<std::string, at::Tensor>> state_dict() const;

  // dist.shard_base on several ranks: every forward (and backward) gathers the linears' slices with
  // the other ranks, which must all run the same passes.
  bool passes_joined() const { return passes_joined_; }
  // A pass this rank has no rows for while the other ranks run theirs: when passes are joined, a
  // pass on one token whose result is discarded (with `backward`, a backward with zero gradients
  // too), so that this rank joins their gathers; otherwise nothing.
  void skip_pass(bool backward, bool packed) const;

  bool training = false;
  // Recompute each decoder block's activations in backward instead of keeping them (training).
  bool recompute_activations = false;
  // adapters: (a job of many) the rows of the passes run in its life go through the adapters as
  // `routes` says; with recompute, a block's backward keeps the routes and dropout streams its
  // forward had. Without one, every row goes through every adapter attached.
  class Routing {
   public:
    Routing(CausalLM& m, std::shared_ptr<const Routes> routes) : m_(m) { m_.routes_ = std::move(routes); }
    ~Routing() { m_.routes_.reset(); }
    Routing(const Routing&) = delete;
    Routing& operator=(const Routing&) = delete;

   private:
    CausalLM& m_;
  };

 private:
  // Builds the layers of config_'s family from `files`, in dtype_ on device_.
  void build(const WeightSource& files, const LoadOptions& opts);
  void take_embedding(std::variant<at::Tensor, GgufBlocks> e);
  at::Tensor attention(const Block& b, const at::Tensor& x, const at::Tensor& mask, const at::Tensor& cos,
                       const at::Tensor& sin, KVCache* cache, size_t layer, const Routes* routes) const;
  // cos and sin [B, 1, T, rotated dims] of rope at `positions` [B, T] with these inverse frequencies.
  std::pair<at::Tensor, at::Tensor> rope_tables(const at::Tensor& positions, const at::Tensor& inv_freq) const;
  at::Tensor mlp(const Block& b, const at::Tensor& x, const Routes* routes) const;
  // x [B, T, H] through a mixture-of-experts MLP (moe.cpp); `record`: the routing joins router_pass.
  at::Tensor moe(const MoeMlp& m, const at::Tensor& x, bool record, const Routes* routes) const;
  at::Tensor norm(const Norm& n, const at::Tensor& x) const;

  ModelConfig config_;
  std::string dir_;
  bool passes_joined_ = false;
  std::shared_ptr<const Routes> routes_;  // (a Routing's)
  at::ScalarType dtype_ = at::kFloat;
  at::Device device_{at::kCPU};
  std::string embedding_name_;
  at::Tensor embed_tokens_;                 // [vocab, E]; undefined when held as embed_blocks_
  std::optional<GgufBlocks> embed_blocks_;  // model.keep_quantized: the embedding as the file's blocks
  bool tied_ = false;                       // tie_word_embeddings: the head is the embedding
  at::Tensor embed_positions_;              // opt/gpt2 learned positions
  at::Tensor inv_freq_;                     // llama rope, float32 [rotated dims/2]
  at::Tensor inv_freq_long_;                // longrope: past the pretraining length
  at::Tensor inv_freq_local_;               // gemma3: the windowed layers'
  Linear project_in_, project_out_;         // opt when word_embed_proj_dim != hidden
  std::vector<Block> blocks_;
  // router_pass's: the real tokens of the pass ([B·T] float32, 1 or 0) and, per MoE layer run, its
  // assignments per expert [E] and summed router probabilities [E]
  mutable at::Tensor router_mask_;
  mutable std::vector<std::pair<at::Tensor, at::Tensor>> router_sums_;
  Norm final_norm_;
  at::Tensor lm_head_;  // [vocab, E]; may alias embed_tokens_ (undefined when tied to embed_blocks_)
  // ids [..] -> the frozen embedding's rows [.., E]
  at::Tensor embedding_rows(const at::Tensor& ids) const;
  // ids [B, T] -> [B, T, E] in dtype_: through `tables`, or a job's rows through their adapters' tables.
  at::Tensor embedded(const at::Tensor& ids) const;
  at::Tensor head_of(const TrainedTables& t) const;
  struct NamedWeight {
    std::string name;
    at::Tensor tensor;  // undefined for an NF4 or GGUF-blocks weight: its Linear holds it
    bool transposed;    // stored here as [out, in], in the file as [in, out]
    int64_t numel;
  };
  std::vector<NamedWeight> named_;  // every weight loaded, in file naming
};

}  // namespace lorarun::model
