#include "model/transformer.hpp"

#include <ATen/ATen.h>
#include <ATen/cpu/Utils.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <cmath>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <variant>

#include "model/dora.hpp"
#include "model/families.hpp"
#include "model/fused_ops.hpp"
#include "model/gguf_weights.hpp"
#include "model/recompute.hpp"
#include "model/resolve.hpp"
#include "model/weights.hpp"
#include "recipe/recipe.hpp"
#include "tokenizer/tokenizer.hpp"
#include "util/error.hpp"

namespace lorarun::model {

at::Tensor Linear::base(const at::Tensor& x) const {
  return sharded  ? sharded_linear(x, *sharded, bias)
         : nf4    ? nf4_linear(x, *nf4, bias)
         : blocks ? gguf_linear(x, *blocks, bias)
                  : at::linear(x, weight, bias);
}

at::Tensor Linear::forward(const at::Tensor& x, bool training, const Routes* routes) const {
  if (!tenants.empty() && routes && !adapter_off) return add_tenants(*this, x, training, *routes);
  if (!adapted() || adapter_off) return base(x);
  // As PEFT: the adapter path runs in the adapters' dtype (fp32 master weights under a bf16 or
  // fp16 base); the sum is cast back to the base output's dtype. Rows [N, in] so that the base
  // output is a tensor of its own, which the adapter's GEMM can add into (see add_lora), and so
  // that x's gradient is summed in the order a job's adapters (add_tenants) sum it.
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = out_features();
  const at::Tensor rows = x.reshape({-1, x.size(-1)});
  if (dora()) return dora_forward(*this, rows, base(rows), training).view(shape);
  return add_lora(base(rows), training && dropout > 0 ? at::dropout(rows, dropout, true) : rows, lora_a, lora_b,
                  scaling)
      .view(shape);
}

namespace {

// ids [..] -> [.., E]: rows of the embedding (`frozen` looks them up), or of its trained copy;
// trainable tokens' rows from token_rows (gathered, not a patched [vocab, E] copy per call, which
// PEFT makes).
template <class Frozen>
at::Tensor embed(const TrainedTables& t, const Frozen& frozen, const at::Tensor& ids, at::ScalarType dtype) {
  if (t.off) return frozen(ids);
  at::Tensor h = t.embed.defined() ? at::embedding(t.embed.to(dtype), ids) : frozen(ids);
  if (!t.token_ids.defined()) return h;
  const at::Tensor slot = t.token_slot.index_select(0, ids.flatten()).view(ids.sizes());
  return at::where(slot.ge(0).unsqueeze(-1), at::embedding(t.token_rows.to(dtype), slot.clamp_min(0)), h);
}

// `block` run again in backward (activation recompute) with the adapters' dropout streams as they
// were when it first ran, so that it draws the same masks; they are left as they were before.
std::function<at::Tensor(const at::Tensor&)> replaying_streams(const std::shared_ptr<const Routes>& routes,
                                                               std::function<at::Tensor(const at::Tensor&)> block) {
  if (!routes || !routes->streams) return block;
  DropoutStreams* streams = routes->streams;
  auto first = std::make_shared<std::vector<at::Tensor>>();  // the streams when the forward began
  return [streams, first, block = std::move(block)](const at::Tensor& x) {
    std::vector<at::Tensor> now;
    for (size_t s = 0; s < streams->size(); ++s) now.push_back(streams->state(static_cast<int>(s)));
    if (first->empty()) {
      *first = std::move(now);
      return block(x);
    }
    for (size_t s = 0; s < streams->size(); ++s) streams->set_state(static_cast<int>(s), (*first)[s]);
    at::Tensor y = block(x);
    for (size_t s = 0; s < streams->size(); ++s) streams->set_state(static_cast<int>(s), now[s]);
    return y;
  };
}

// The linears a block has (a family leaves some empty), in a fixed order.
std::vector<Linear*> block_linears(Block& b) {
  std::vector<Linear*> out;
  for (Linear* l : {&b.q, &b.k, &b.v, &b.qkv, &b.o, &b.gate, &b.up, &b.gate_up, &b.down})
    if (l->defined()) out.push_back(l);
  return out;
}

// The tensors of `files` as the loader asks for them, on the meta device: no data is read.
class ShapesOf : public WeightSource {
 public:
  explicit ShapesOf(const WeightSource& files) : files_(files) {}
  bool contains(const std::string& name) const override { return files_.contains(name); }
  at::Tensor load(const std::string& name, at::ScalarType dtype, at::Device device,
                  const std::vector<int64_t>& shape) const override {
    if (!files_.contains(name)) return files_.load(name, dtype, device, shape);  // its error, naming what is missing
    return at::empty(shape, at::TensorOptions().dtype(dtype).device(at::kMeta));
  }
  GgufBlocks blocks(const std::string& name, at::ScalarType dtype, at::Device,
                    const std::vector<int64_t>& shape) const override {
    return files_.blocks(name, dtype, at::kMeta, shape);
  }
  void release(const std::string&) const override {}

 private:
  const WeightSource& files_;
};

// Builds the model's tensors from the files, checking each shape against the config.
template <class Named>
struct Loader {
  const WeightSource& files;
  at::ScalarType dtype;
  at::Device device;
  LoadOptions opts;
  std::vector<Named>& named;

  at::Tensor get(const std::string& name, std::vector<int64_t> shape, bool transpose = false) const {
    return get_on(device, name, std::move(shape), transpose);
  }
  at::Tensor get_on(at::Device on, const std::string& name, std::vector<int64_t> shape, bool transpose = false) const {
    at::Tensor t = files.load(name, dtype, on, shape);
    if (transpose) t = t.t().contiguous();
    named.push_back({name, t, transpose, t.numel()});
    return t;
  }
  // With opts.quantize the weight is quantised at once and its full-precision copy dropped, so
  // the whole unquantised model is never in memory. Sharded and not quantised, the weight is read
  // on the CPU (in the file's dtype, a view of the mapped file) and only this rank's slice goes to
  // the device.
  Linear linear(const std::string& name, int64_t in, int64_t out, bool bias, bool conv1d = false) const {
    Linear l;
    l.name = name;
    l.conv1d = conv1d;
    if (opts.keep_quantized) {  // the file stores every linear [out, in], GPT-2's Conv1D ones too
      l.blocks = files.blocks(name + ".weight", dtype, device, {out, in});
      named.push_back({name + ".weight", at::Tensor(), conv1d, in * out});
      if (opts.shards) {  // this rank's share of the blocks' bytes
        l.sharded = ShardedWeight::of(*l.blocks, opts.shards);
        l.blocks.reset();
      }
      if (bias) l.bias = get(name + ".bias", {out});
      return l;
    }
    const at::Device on = opts.shards && !opts.quantize ? at::Device(at::kCPU) : device;
    l.weight = conv1d ? get_on(on, name + ".weight", {in, out}, true) : get_on(on, name + ".weight", {out, in});
    if (opts.quantize) {
      l.nf4 = quantize_nf4(l.weight, opts.double_quant);
      l.weight = named.back().tensor = at::Tensor();
      files.release(name + ".weight");
    }
    if (opts.shards) {
      l.sharded = l.nf4 ? ShardedWeight::of(*l.nf4, opts.shards) : ShardedWeight::of(l.weight, opts.shards, device);
      l.nf4.reset();
      l.weight = named.back().tensor = at::Tensor();
      files.release(name + ".weight");
    }
    if (bias) l.bias = get(name + ".bias", {out});
    return l;
  }
  // The embedding: with opts.keep_quantized a GGUF's blocks (kept unless the file holds it in F32,
  // which blocks would not make smaller), else the tensor.
  std::variant<at::Tensor, GgufBlocks> embedding(const std::string& name, std::vector<int64_t> shape) const {
    if (opts.keep_quantized) {
      GgufBlocks b = files.blocks(name, dtype, device, shape);
      if (b.type != io::GgmlType::F32) {
        named.push_back({name, at::Tensor(), false, shape[0] * shape[1]});
        return b;
      }
    }
    return get(name, std::move(shape));
  }
  Norm norm(const std::string& name, int64_t n, bool bias) const {
    return {get(name + ".weight", {n}), bias ? get(name + ".bias", {n}) : at::Tensor()};
  }
  // Layer prefix `p`'s mixture-of-experts MLP: the experts stacked [E, 2I, H] and [E, H, I] whether
  // the file holds them so (transformers 5's fused names) or one tensor per expert (as released and as
  // transformers saves them), those then kept as views of the stack under their own names.
  MoeMlp moe(const std::string& p, const ModelConfig& c, FamilyTraits::Moe layout) const {
    const int64_t E = c.moe.experts, I = c.moe.intermediate, H = c.hidden_size;
    const bool qwen = layout == FamilyTraits::Moe::Qwen;
    if (opts.keep_quantized)
      throw Error(
          "model.keep_quantized does not hold a mixture of experts' expert blocks yet: set model.keep_quantized: "
          "false (the file is dequantised to model.dtype as it loads)");
    const std::string on_disk = p + (qwen ? "mlp." : "block_sparse_moe.");
    MoeMlp m;
    m.router.name = p + "mlp.gate";
    m.router.router = true;
    m.router.weight = get(on_disk + "gate.weight", {E, H});
    m.gate_up.name = p + "mlp.experts.gate_up_proj";
    m.down.name = p + "mlp.experts.down_proj";
    if (files.contains(m.gate_up.name)) {
      m.gate_up.weight = get(m.gate_up.name, {E, 2 * I, H});
      m.down.weight = get(m.down.name, {E, H, I});
      return m;
    }
    // The stacks are allocated once a file tensor has shown the metadata's expert size true (the
    // router showed E): a config alone could ask for any size. GGUF files hold three stacks.
    const std::string stack = p + "mlp.experts.";
    const bool stacks = files.contains(stack + "gate_proj.weight");
    const at::Tensor gate =
        stacks ? files.load(stack + "gate_proj.weight", dtype, device, {E, I, H})
               : files.load(fmt::format("{}experts.0.{}", on_disk, qwen ? "gate_proj.weight" : "w1.weight"), dtype,
                            device, {I, H});
    const auto opts = at::TensorOptions().dtype(dtype).device(device);
    m.gate_up.weight = at::empty({E, 2 * I, H}, opts);
    m.down.weight = at::empty({E, H, I}, opts);
    const auto into = [&](const at::Tensor& slot, const std::string& name) {
      slot.copy_(files.load(name, dtype, device, slot.sizes().vec()));
      files.release(name);
      named.push_back({name, slot, false, slot.numel()});
    };
    if (stacks) {
      // a GGUF's three stacks (llama.cpp's ffn_{gate,up,down}_exps), named per expert as transformers
      // saves them, so that a HF directory written from this model is one transformers reads
      m.gate_up.weight.narrow(1, 0, I).copy_(gate);
      m.gate_up.weight.narrow(1, I, I).copy_(files.load(stack + "up_proj.weight", dtype, device, {E, I, H}));
      m.down.weight.copy_(files.load(stack + "down_proj.weight", dtype, device, {E, H, I}));
      for (int64_t e = 0; e < E; ++e) {
        const std::string x = fmt::format("{}{}.", stack, e);
        const at::Tensor gu = m.gate_up.weight.select(0, e);
        named.push_back({x + "gate_proj.weight", gu.narrow(0, 0, I), false, I * H});
        named.push_back({x + "up_proj.weight", gu.narrow(0, I, I), false, I * H});
        named.push_back({x + "down_proj.weight", m.down.weight.select(0, e), false, H * I});
      }
      return m;
    }
    for (int64_t e = 0; e < E; ++e) {
      const std::string x = fmt::format("{}experts.{}.", on_disk, e);
      const at::Tensor gu = m.gate_up.weight.select(0, e);
      into(gu.narrow(0, 0, I), x + (qwen ? "gate_proj.weight" : "w1.weight"));
      into(gu.narrow(0, I, I), x + (qwen ? "up_proj.weight" : "w3.weight"));
      into(m.down.weight.select(0, e), x + (qwen ? "down_proj.weight" : "w2.weight"));
    }
    return m;
  }
};

// Rotary inverse frequencies [dim/2] in float32 for base `theta`, with linear, llama3 or longrope
// scaling (as HF; longrope divides by `longrope`'s factors, the short or the long set).
at::Tensor rope_inv_freq(const RopeScaling& r, double theta, int64_t dim,
                         const std::vector<double>* longrope = nullptr) {
  const at::Tensor exponent = at::arange(0, dim, 2, at::kLong).to(at::kFloat) / dim;
  if (longrope) {
    const at::Tensor ext = at::tensor(std::vector<float>(longrope->begin(), longrope->end()), at::kFloat);
    return 1.0 / (ext * at::pow(theta, exponent));
  }
  at::Tensor inv = 1.0 / at::pow(theta, exponent);
  if (r.type == "linear") return inv / r.factor;
  if (r.type != "llama3") return inv;
  const double low_wavelen = r.original_max_position / r.low_freq_factor;
  const double high_wavelen = r.original_max_position / r.high_freq_factor;
  const at::Tensor wavelen = 2 * M_PI / inv;
  at::Tensor scaled = at::where(wavelen > low_wavelen, inv / r.factor, inv);
  const at::Tensor smooth =
      (r.original_max_position / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor);
  const at::Tensor smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled;
  const at::Tensor medium = (wavelen >= high_wavelen).logical_and(wavelen <= low_wavelen);
  return at::where(medium, smoothed, scaled);
}

// (x1, x2) -> (-x2, x1) over the last dimension's halves.
at::Tensor rotate_half(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// Boolean attention mask [B, 1, Tq, Tk]: key j is visible to query i when it is a real token,
// not in the future (past + i >= j), and within the sliding window if there is one.
// left_padded: a padding query sees itself, so that no row is fully masked (generation's batches).
at::Tensor attention_mask(const at::Tensor& key_valid, int64_t tq, int64_t past, std::optional<int64_t> window,
                          bool left_padded = false) {
  const auto dev = key_valid.device();
  const int64_t tk = key_valid.size(1);
  const at::Tensor qi = at::arange(past, past + tq, at::TensorOptions().dtype(at::kLong).device(dev)).unsqueeze(1);
  const at::Tensor kj = at::arange(tk, at::TensorOptions().dtype(at::kLong).device(dev)).unsqueeze(0);
  at::Tensor allowed = kj <= qi;
  if (window) allowed = allowed.logical_and(qi - kj < *window);
  allowed = allowed.unsqueeze(0).unsqueeze(0).logical_and(key_valid.to(at::kBool).unsqueeze(1).unsqueeze(1));
  return left_padded ? allowed.logical_or(kj == qi) : allowed;
}

// Packed rows: segments [B, T] number the documents of each row (0 = padding). A token sees the
// earlier tokens of its own document only (padding sees padding, so no row is fully masked).
at::Tensor packed_attention_mask(const at::Tensor& segments, std::optional<int64_t> window) {
  const int64_t T = segments.size(1);
  const at::Tensor idx = at::arange(T, segments.options().dtype(at::kLong));
  const at::Tensor qi = idx.unsqueeze(1), kj = idx.unsqueeze(0);
  at::Tensor allowed = kj <= qi;
  if (window) allowed = allowed.logical_and(qi - kj < *window);
  return allowed.unsqueeze(0).logical_and(segments.unsqueeze(2) == segments.unsqueeze(1)).unsqueeze(1);
}

// Positions restarting at 0 at each document's first token: segments [B, T] -> [B, T].
at::Tensor positions_in_document(const at::Tensor& segments) {
  const int64_t T = segments.size(1);
  const at::Tensor idx = at::arange(T, segments.options().dtype(at::kLong)).unsqueeze(0).expand_as(segments);
  const at::Tensor starts = at::cat({at::ones_like(segments.narrow(1, 0, 1), at::kBool),
                                     segments.narrow(1, 1, T - 1) != segments.narrow(1, 0, T - 1)},
                                    1);
  return idx - std::get<0>(at::cummax(at::where(starts, idx, at::zeros_like(idx)), 1));
}

at::Tensor activation(const std::string& name, const at::Tensor& x) {
  if (name == "silu" || name == "swish") return at::silu(x);
  if (name == "relu") return at::relu(x);
  if (name == "gelu_new" || name == "gelu_pytorch_tanh" || name == "gelu_fast") return at::gelu(x, "tanh");
  if (name == "gelu") return at::gelu(x);
  throw Error(fmt::format("activation '{}' is not supported (silu, relu, gelu, gelu_new)", name));
}

}  // namespace

CausalLM CausalLM::load(const std::string& path_or_id, at::ScalarType dtype, at::Device device,
                        const LoadOptions& opts) {
  CausalLM m;
  m.dtype_ = dtype;
  m.device_ = opts.shapes_only ? at::Device(at::kMeta) : device;
  const auto build = [&](const WeightSource& files) {
    if (opts.shapes_only)
      m.build(ShapesOf(files), opts);  // meta tensors: no weight data read
    else
      m.build(files, opts);
  };
  if (is_gguf_path(path_or_id)) {
    if (!std::filesystem::is_regular_file(path_or_id))
      throw Error(
          fmt::format("model file '{}' does not exist: model.path names a .gguf file that is not there", path_or_id));
    const auto file = std::make_shared<const io::GgufFile>(path_or_id);
    m.config_ = gguf_config(*file);
    m.dir_ = path_or_id;
    const GgufWeights weights(file, m.config_);
    build(weights);
    if (!opts.shapes_only) weights.check_all_used();
    return m;
  }
  const std::string dir = resolve_model_path(path_or_id);
  m.config_ = load_config(dir);
  m.dir_ = dir;
  build(WeightFiles::open_dir(dir));
  return m;
}

void CausalLM::take_embedding(std::variant<at::Tensor, GgufBlocks> e) {
  if (auto* t = std::get_if<at::Tensor>(&e))
    embed_tokens_ = std::move(*t);
  else
    embed_blocks_ = std::move(std::get<GgufBlocks>(e));
}

void CausalLM::build(const WeightSource& files, const LoadOptions& opts) {
  CausalLM& m = *this;
  const ModelConfig& c = m.config_;
  m.passes_joined_ = opts.shards && opts.shards->world > 1;
  const Loader<NamedWeight> L{files, dtype_, device_, opts, m.named_};
  const int64_t H = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const int64_t q_out = c.num_heads * c.head_dim, kv_out = c.num_kv_heads * c.head_dim;

  if (c.family == Family::Llama) {
    m.take_embedding(L.embedding("model.embed_tokens.weight", {V, H}));
    m.embedding_name_ = "model.embed_tokens";
    const auto rotated = static_cast<int64_t>(c.head_dim * c.partial_rotary);
    const bool longrope = c.rope.type == "longrope";
    m.inv_freq_ = rope_inv_freq(c.rope, c.rope_theta, rotated, longrope ? &c.rope.short_factor : nullptr).to(device_);
    if (longrope) m.inv_freq_long_ = rope_inv_freq(c.rope, c.rope_theta, rotated, &c.rope.long_factor).to(device_);
    if (c.local_rope_theta > 0) m.inv_freq_local_ = rope_inv_freq({}, c.local_rope_theta, rotated).to(device_);
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = fmt::format("model.layers.{}.", i);
      Block b;
      b.norm1 = L.norm(p + "input_layernorm", H, false);
      if (c.gemma) {
        b.attn_out_norm = L.norm(p + "post_attention_layernorm", H, false);
        b.norm2 = L.norm(p + "pre_feedforward_layernorm", H, false);
        b.mlp_out_norm = L.norm(p + "post_feedforward_layernorm", H, false);
      } else {
        b.norm2 = L.norm(p + "post_attention_layernorm", H, false);
      }
      const bool qkv_bias = c.attention_bias || c.qkv_bias;
      if (c.fused) {
        b.qkv = L.linear(p + "self_attn.qkv_proj", H, q_out + 2 * kv_out, false);
      } else {
        b.q = L.linear(p + "self_attn.q_proj", H, q_out, qkv_bias);
        b.k = L.linear(p + "self_attn.k_proj", H, kv_out, qkv_bias);
        b.v = L.linear(p + "self_attn.v_proj", H, kv_out, qkv_bias);
      }
      b.o = L.linear(p + "self_attn.o_proj", q_out, H, c.attention_bias);
      if (c.qk_norm) {
        b.q_norm = L.norm(p + "self_attn.q_norm", c.head_dim, false);
        b.k_norm = L.norm(p + "self_attn.k_norm", c.head_dim, false);
      }
      if (c.moe.sparse_layer(static_cast<size_t>(i))) {
        b.moe = L.moe(p, c, family_of_model_type(c.model_type, dir_).moe);
      } else if (c.fused) {
        b.gate_up = L.linear(p + "mlp.gate_up_proj", H, 2 * F, false);
      } else {
        b.gate = L.linear(p + "mlp.gate_proj", H, F, c.mlp_bias);
        b.up = L.linear(p + "mlp.up_proj", H, F, c.mlp_bias);
      }
      if (!b.moe.defined()) b.down = L.linear(p + "mlp.down_proj", F, H, c.mlp_bias);
      m.blocks_.push_back(std::move(b));
    }
    m.final_norm_ = L.norm("model.norm", H, false);
  } else if (c.family == Family::Opt) {
    const int64_t E = c.word_embed_proj_dim;
    const bool bias = c.enable_bias;
    m.take_embedding(L.embedding("model.decoder.embed_tokens.weight", {V, E}));
    m.embedding_name_ = "model.decoder.embed_tokens";
    m.embed_positions_ = L.get("model.decoder.embed_positions.weight", {c.max_positions + 2, H});
    if (E != H) {
      m.project_in_ = L.linear("model.decoder.project_in", E, H, false);
      m.project_out_ = L.linear("model.decoder.project_out", H, E, false);
    }
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = fmt::format("model.decoder.layers.{}.", i);
      Block b;
      b.norm1 = L.norm(p + "self_attn_layer_norm", H, true);
      b.norm2 = L.norm(p + "final_layer_norm", H, true);
      b.q = L.linear(p + "self_attn.q_proj", H, H, bias);
      b.k = L.linear(p + "self_attn.k_proj", H, H, bias);
      b.v = L.linear(p + "self_attn.v_proj", H, H, bias);
      b.o = L.linear(p + "self_attn.out_proj", H, H, bias);
      b.up = L.linear(p + "fc1", H, F, bias);
      b.down = L.linear(p + "fc2", F, H, bias);
      m.blocks_.push_back(std::move(b));
    }
    if (c.do_layer_norm_before && !c.remove_final_layer_norm)
      m.final_norm_ = L.norm("model.decoder.final_layer_norm", H, true);
  } else {  // gpt2; older checkpoints have no "transformer." prefix
    const std::string t = files.contains("transformer.wte.weight") ? "transformer." : "";
    m.take_embedding(L.embedding(t + "wte.weight", {V, H}));
    m.embedding_name_ = "transformer.wte";
    m.embed_positions_ = L.get(t + "wpe.weight", {c.max_positions, H});
    for (int64_t i = 0; i < c.num_layers; ++i) {
      const std::string p = fmt::format("{}h.{}.", t, i);
      Block b;
      b.norm1 = L.norm(p + "ln_1", H, true);
      b.norm2 = L.norm(p + "ln_2", H, true);
      b.qkv = L.linear(p + "attn.c_attn", H, 3 * H, true, true);
      b.o = L.linear(p + "attn.c_proj", H, H, true, true);
      b.up = L.linear(p + "mlp.c_fc", H, F, true, true);
      b.down = L.linear(p + "mlp.c_proj", F, H, true, true);
      m.blocks_.push_back(std::move(b));
    }
    m.final_norm_ = L.norm(t + "ln_f", H, true);
  }
  const int64_t E = m.embed_blocks_ ? m.embed_blocks_->shape[1] : m.embed_tokens_.size(1);
  m.tied_ = c.tie_word_embeddings;
  if (!c.tie_word_embeddings && files.contains("lm_head.weight"))
    m.lm_head_ = L.get("lm_head.weight", {V, E});
  else if (c.tie_word_embeddings)
    m.lm_head_ = m.embed_tokens_;  // (undefined when the embedding is held as blocks: frozen_lm_head)
  else
    throw Error(
        fmt::format("{}: lm_head.weight is missing and config.json does not tie it to the "
                    "embeddings (tie_word_embeddings: false)",
                    dir_));
  if (opts.shards)  // each block's slices, gathered together while the block runs
    for (Block& b : m.blocks_) {
      std::vector<ShardedTensor*> slices;
      for (Linear* l : block_linears(b)) {
        ShardedWeight& w = *l->sharded;
        if (w.nf4)
          slices.insert(slices.end(), {&w.packed, &w.scales});
        else
          slices.push_back(&w.dense);
      }
      opts.shards->add_block(slices);
    }
}

at::Tensor CausalLM::norm(const Norm& n, const at::Tensor& x) const {
  if (n.bias.defined() || config_.family != Family::Llama)
    return at::layer_norm(x, {x.size(-1)}, n.weight, n.bias, config_.norm_eps);
  // RMSNorm as HF computes it: in float32, then back to the input dtype before the weight (gemma:
  // times 1 + weight in float32, then back). One fused op where the model is float32 on the CPU.
  if (!config_.gemma && fused::rms_norm_applies(x, n.weight)) return fused::rms_norm(x, n.weight, config_.norm_eps);
  const at::Tensor xf = x.to(at::kFloat);
  const at::Tensor y = xf * at::rsqrt(xf.pow(2).mean(-1, true) + config_.norm_eps);
  if (config_.gemma) return (y * (1.0 + n.weight.to(at::kFloat))).to(x.scalar_type());
  return n.weight * y.to(x.scalar_type());
}

at::Tensor CausalLM::mlp(const Block& b, const at::Tensor& x, const Routes* routes) const {
  // (a block recomputed in backward ran its routing once already)
  if (b.moe.defined()) return moe(b.moe, x, router_mask_.defined() && !in_backward(), routes);
  const auto fc = [&](const Linear& l, const at::Tensor& in) { return l.forward(in, training, routes); };
  if (b.gate_up.defined()) {
    const auto gu = fc(b.gate_up, x).chunk(2, -1);
    return fc(b.down, gu[1] * activation(config_.activation, gu[0]));
  }
  if (config_.family == Family::Llama) {
    const at::Tensor g = fc(b.gate, x), u = fc(b.up, x);
    const bool silu = config_.activation == "silu" || config_.activation == "swish";
    if (silu && fused::swiglu_applies(g, u)) return fc(b.down, fused::swiglu(g, u));
    return fc(b.down, activation(config_.activation, g) * u);
  }
  return fc(b.down, activation(config_.activation, fc(b.up, x)));
}

// x [B, T, H] -> attention output after the output projection [B, T, H].
at::Tensor CausalLM::attention(const Block& b, const at::Tensor& x, const at::Tensor& mask, const at::Tensor& cos,
                               const at::Tensor& sin, KVCache* cache, size_t layer, const Routes* routes) const {
  const ModelConfig& c = config_;
  const int64_t B = x.size(0), T = x.size(1), hd = c.head_dim;
  at::Tensor q, k, v;
  if (b.qkv.defined()) {
    const int64_t q_out = c.num_heads * hd, kv_out = c.num_kv_heads * hd;
    auto parts = b.qkv.forward(x, training, routes).split_with_sizes({q_out, kv_out, kv_out}, -1);
    q = parts[0];
    k = parts[1];
    v = parts[2];
  } else {
    q = b.q.forward(x, training, routes);
    k = b.k.forward(x, training, routes);
    v = b.v.forward(x, training, routes);
  }
  q = q.view({B, T, c.num_heads, hd});
  k = k.view({B, T, c.num_kv_heads, hd});
  if (c.qk_norm) {
    q = norm(b.q_norm, q);
    k = norm(b.k_norm, k);
  }
  v = v.view({B, T, c.num_kv_heads, hd}).transpose(1, 2);
  if (cos.defined() && fused::rope_applies(q, cos, sin) && fused::rope_applies(k, cos, sin)) {
    q = fused::rope(q, cos, sin);  // [B, nh, T, hd]
    k = fused::rope(k, cos, sin);  // [B, nkv, T, hd]
  } else if (cos.defined()) {
    q = q.transpose(1, 2);
    k = k.transpose(1, 2);
    const int64_t rot = cos.size(-1);  // phi3's partial rotary turns the first dims only
    const auto rotate = [&](const at::Tensor& t) {
      if (rot == hd) return t * cos + rotate_half(t) * sin;
      const at::Tensor r = t.narrow(-1, 0, rot);
      return at::cat({r * cos + rotate_half(r) * sin, t.narrow(-1, rot, hd - rot)}, -1);
    };
    q = rotate(q);
    k = rotate(k);
  } else {
    q = q.transpose(1, 2);
    k = k.transpose(1, 2);
  }
  if (cache) {
    k = cache->append(layer, 0, k);
    v = cache->append(layer, 1, v);
  }
  const double scale = 1.0 / std::sqrt(c.query_pre_attn_scalar.value_or(static_cast<double>(hd)));
  // q [b, nh, t, hd], k and v [b, nkv, t', hd], mask [b, 1, t, t'] -> [b, nh, t, hd]
  const auto attend = [&](const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask) {
    if (!c.attn_softcap)
      return at::scaled_dot_product_attention(q, k, v, mask, 0.0, false, scale,
                                              /*enable_gqa=*/c.num_kv_heads != c.num_heads);
    // gemma2: scores capped by cap * tanh(s / cap) before the mask; softmax in float32, as HF
    const int64_t groups = c.num_heads / c.num_kv_heads;
    const at::Tensor kr = groups == 1 ? k : k.repeat_interleave(groups, 1);
    const at::Tensor vr = groups == 1 ? v : v.repeat_interleave(groups, 1);
    const double cap = *c.attn_softcap;
    const at::Tensor scores = at::tanh(at::matmul(q, kr.transpose(2, 3)) * scale / cap) * cap;
    // A finite fill, as HF's: a padding row whose window holds no real token stays finite.
    const at::Tensor masked =
        scores.to(at::kFloat).masked_fill(mask.logical_not(), std::numeric_limits<float>::lowest());
    return at::matmul(at::softmax(masked, -1).to(q.scalar_type()), vr);
  };
  at::Tensor out;
  const bool one_route = routes && routes->routes.size() == 1 && routes->routes[0].length == T;
  if (!routes || routes->routes.empty() || cache || one_route) {
    out = attend(q, k, v, mask);
  } else {  // adapters: each route's rows at their own length, as their own run attends (the kernel's
            // blocking follows the length); the positions past it, padding, left zero
    std::vector<at::Tensor> parts;
    for (const Route& r : routes->routes) {
      const auto mine = [&](const at::Tensor& t) { return t.narrow(0, r.row0, r.rows).narrow(2, 0, r.length); };
      parts.push_back(at::constant_pad_nd(
          attend(mine(q), mine(k), mine(v), mine(mask).narrow(3, 0, r.length).contiguous()), {0, 0, 0, T - r.length}));
    }
    out = at::cat(parts);
  }
  return b.o.forward(out.transpose(1, 2).reshape({B, T, c.num_heads * hd}), training, routes);
}

at::Tensor CausalLM::hidden_states(const at::Tensor& input_ids, const at::Tensor& attention_mask_in, KVCache* cache,
                                   bool packed) const {
  const ModelConfig& c = config_;
  const int64_t B = input_ids.size(0), T = input_ids.size(1);
  const int64_t past = cache ? cache->length() : 0;
  const auto long_opts = at::TensorOptions().dtype(at::kLong).device(device_);
  at::Tensor valid =
      attention_mask_in.defined() ? attention_mask_in.to(device_, at::kLong) : at::ones({B, past + T}, long_opts);
  if (valid.size(1) == T && past > 0)  // a mask for the new tokens only: past ones were real
    valid = at::cat({at::ones({B, past}, long_opts), valid}, 1);
  // Two masks when only some layers are windowed (gemma, qwen3 layer_types): [0] full, [1] windowed.
  const bool any_window = c.sliding_window.has_value();
  const bool all_windowed = any_window && c.sliding_layers.empty();
  const std::optional<int64_t> none;
  at::Tensor masks[2], positions;
  if (packed) {
    if (cache) throw Error("packed sequences are for training; generation takes one document per row");
    if (!all_windowed) masks[0] = packed_attention_mask(valid, none);
    if (any_window) masks[1] = packed_attention_mask(valid, c.sliding_window);
    positions = positions_in_document(valid);
  } else {
    // With a cache (generation) rows may be left-padded: positions count each row's real tokens.
    const bool left = cache != nullptr;
    if (!all_windowed) masks[0] = attention_mask(valid, T, past, none, left);
    if (any_window) masks[1] = attention_mask(valid, T, past, c.sliding_window, left);
    positions = left ? (at::cumsum(valid, 1) - 1).clamp_min(0).narrow(1, past, T)
                     : at::arange(past, past + T, long_opts).unsqueeze(0).expand({B, T});
  }

  router_sums_.clear();  // a training pass records its routing (router_pass), generation's do not
  router_mask_ = config_.moe.experts > 0 && !cache ? valid.ne(0).to(at::kFloat).flatten() : at::Tensor();
  at::Tensor h = embedded(input_ids.to(device_));
  at::Tensor cos[2], sin[2];  // [0] every layer's, [1] gemma3's windowed layers' when they differ
  if (c.family == Family::Llama) {
    if (c.gemma)  // sqrt(hidden) rounded to the model's dtype first, as HF
      h = h * at::scalar_tensor(std::sqrt(static_cast<double>(c.hidden_size)), at::kFloat).to(dtype_);
    // longrope: the long factors for the whole batch once a position passes the pretraining length
    const bool long_rope = inv_freq_long_.defined() && positions.max().item<int64_t>() >= c.rope.original_max_position;
    std::tie(cos[0], sin[0]) = rope_tables(positions, long_rope ? inv_freq_long_ : inv_freq_);
    if (inv_freq_local_.defined()) std::tie(cos[1], sin[1]) = rope_tables(positions, inv_freq_local_);
  } else if (c.family == Family::Opt) {
    if (project_in_.defined()) h = project_in_.forward(h, training, routes_.get());
    // OPT counts positions over real tokens only, offset by 2 (HF's OPTLearnedPositionalEmbedding).
    const at::Tensor pos = (packed ? positions : (at::cumsum(valid, 1) * valid - 1).narrow(1, past, T)) + 2;
    h = h + at::embedding(embed_positions_, pos);
  } else {
    h = h + at::embedding(embed_positions_, positions);
  }

  const bool recompute = recompute_activations && training && c10::GradMode::is_enabled();
  for (size_t i = 0; i < blocks_.size(); ++i) {
    const bool windowed = c.windowed(i);
    const at::Tensor& mask = masks[windowed];
    const bool local = windowed && cos[1].defined();
    // Captures by value: with recompute it runs again during backward.
    auto block = [this, i, mask, cos = cos[local], sin = sin[local], cache, routes = routes_](const at::Tensor& x) {
      const Block& b = blocks_[i];
      const Routes* r = routes_.get();
      if (config_.family == Family::Opt && !config_.do_layer_norm_before) {  // post-LN OPT (350m)
        const at::Tensor y = norm(b.norm1, x + attention(b, x, mask, cos, sin, cache, i, r));
        return norm(b.norm2, y + mlp(b, y, r));
      }
      at::Tensor a = attention(b, norm(b.norm1, x), mask, cos, sin, cache, i, r);
      if (b.attn_out_norm.weight.defined()) a = norm(b.attn_out_norm, a);
      const at::Tensor y = x + a;
      at::Tensor f = mlp(b, norm(b.norm2, y), r);
      if (b.mlp_out_norm.weight.defined()) f = norm(b.mlp_out_norm, f);
      return y + f;
    };
    if (!recompute) {
      h = block(h);
      continue;
    }
    if (!h.requires_grad()) h = h.detach().requires_grad_(true);  // frozen embeddings: a leaf
    h = recomputed(replaying_streams(routes_, block), h);
  }
  if (final_norm_.weight.defined()) h = norm(final_norm_, h);
  if (project_out_.defined()) h = project_out_.forward(h, training, routes_.get());
  if (cache) cache->filled += T;
  return h;
}

void CausalLM::skip_pass(bool backward, bool packed) const {
  if (!passes_joined_) return;
  const auto opts = at::TensorOptions().dtype(at::kLong).device(device_);
  const at::Tensor h = hidden_states(at::zeros({1, 1}, opts), at::ones({1, 1}, opts), nullptr, packed);
  if (backward && h.requires_grad()) (h.sum() * 0).backward();
}

std::pair<at::Tensor, at::Tensor> CausalLM::rope_tables(const at::Tensor& positions, const at::Tensor& inv_freq) const {
  const at::Tensor freqs = positions.to(at::kFloat).unsqueeze(-1) * inv_freq;  // [B, T, rot/2]
  const at::Tensor emb = at::cat({freqs, freqs}, -1);
  const double f = config_.rope.attention_factor;  // longrope's; 1 otherwise
  at::Tensor cos = emb.cos(), sin = emb.sin();
  if (f != 1.0) {
    cos = cos * f;
    sin = sin * f;
  }
  return {cos.to(dtype_).unsqueeze(1), sin.to(dtype_).unsqueeze(1)};  // [B, 1, T, rot]
}

at::Tensor CausalLM::embedding_rows(const at::Tensor& ids) const {
  return embed_blocks_ ? embed_blocks_->rows(ids) : at::embedding(embed_tokens_, ids);
}

// Each route's rows through its adapter's tables at its own positions (its own run's lookup of its
// own micro-batch [rows, length]); the padding past them, which no loss reads, from the frozen table.
at::Tensor CausalLM::embedded(const at::Tensor& ids) const {
  const auto frozen = [this](const at::Tensor& i) { return embedding_rows(i); };
  const Routes* routes = routes_.get();
  if (!routes || tenant_tables.empty()) return embed(tables, frozen, ids, dtype_);
  if (routes->all >= 0) return embed(tenant_tables.at(static_cast<size_t>(routes->all)), frozen, ids, dtype_);
  const int64_t T = ids.size(1);
  std::vector<at::Tensor> out;
  for (const Route& r : routes->routes) {
    const TrainedTables& t = tenant_tables.at(static_cast<size_t>(r.slot));
    const at::Tensor mine = ids.narrow(0, r.row0, r.rows);
    at::Tensor h = embed(t, frozen, mine.narrow(1, 0, r.length), dtype_);
    out.push_back(r.length == T ? h : at::cat({h, frozen(mine.narrow(1, r.length, T - r.length))}, 1));
  }
  return out.size() == 1 ? out[0] : at::cat(out);
}

at::Tensor CausalLM::head_of(const TrainedTables& t) const {
  const at::Tensor head = frozen_lm_head();  // (a kept embedding tied to it: dequantised for this pass)
  if (t.off) return head;
  if (t.head.defined()) return t.head.to(dtype_);
  if (t.head_tokens) return head.index_copy(0, t.token_ids, t.token_rows.to(dtype_));
  return head;
}

at::Tensor CausalLM::lm_head() const {
  const Routes* routes = routes_.get();
  return routes && routes->all >= 0 ? lm_head(routes->all) : head_of(tables);
}

at::Tensor CausalLM::lm_head(int slot) const {
  return static_cast<size_t>(slot) < tenant_tables.size() ? head_of(tenant_tables[static_cast<size_t>(slot)])
                                                          : head_of(tables);
}

void CausalLM::set_adapters_off(bool off) {
  for (Linear* l : linears()) l->adapter_off = off;
  for (MoeMlp* m : moe_layers()) m->gate_up.adapter_off = m->down.adapter_off = off;
  tables.off = off;
  for (TrainedTables& t : tenant_tables) t.off = off;
}

void CausalLM::fold_tables() {
  c10::NoGradGuard no_grad;
  if (embed_blocks_ && (tables.embed.defined() || tables.token_ids.defined())) {  // written into: made whole
    embed_tokens_ = embed_blocks_->dequantize();
    embed_blocks_.reset();
    for (NamedWeight& w : named_)
      if (w.name == embedding_name_ + ".weight") w.tensor = embed_tokens_;
    if (tied_) lm_head_ = embed_tokens_;
  }
  if (head_tied() && (tables.embed.defined() || tables.head.defined()))
    throw Error(fmt::format(
        "the adapter trains {} apart from the output head tied to it (modules_to_save): a merged model would need "
        "tie_word_embeddings: false; serve the adapter with PEFT (or vLLM) instead of merging it",
        tables.embed.defined() ? embedding_name_ : "lm_head"));
  if (tables.embed.defined()) embed_tokens_.copy_(tables.embed);
  if (tables.head.defined()) lm_head_.copy_(tables.head);
  if (tables.token_ids.defined())  // a tied head shares the rows
    embed_tokens_.index_copy_(0, tables.token_ids, tables.token_rows.to(dtype_));
  tables = {};
}

at::Tensor CausalLM::logits(const at::Tensor& hidden) const {
  const at::Tensor z = at::linear(hidden, lm_head());
  if (!config_.logit_softcap) return z;
  return at::tanh(z / *config_.logit_softcap) * *config_.logit_softcap;  // gemma2, in the model's dtype as HF
}

std::vector<std::pair<std::string, at::Tensor>> CausalLM::state_dict() const {
  std::map<std::string, const Linear*> by_weight;
  for (const Linear* l : linears()) by_weight[l->name + ".weight"] = l;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const NamedWeight& w : named_) {
    at::Tensor t = w.tensor;
    if (!t.defined() && embed_blocks_ && w.name == embedding_name_ + ".weight") {
      t = embed_blocks_->dequantize();
    } else if (!t.defined()) {  // quantised: its Linear holds it
      const Linear& l = *by_weight.at(w.name);
      if (l.sharded)
        throw Error(
            fmt::format("{} is sharded across ranks (dist.shard_base): load the model whole to read its "
                        "weights (a lorarun bug if a training run got here)",
                        w.name));
      t = l.dense_weight();
    }
    out.emplace_back(w.name, w.transposed ? t.t() : t);
  }
  return out;
}

std::vector<Linear*> CausalLM::linears() {
  std::vector<Linear*> out;
  for (Block& b : blocks_) {
    for (Linear* l : block_linears(b)) out.push_back(l);
    if (b.moe.defined()) out.push_back(&b.moe.router);
  }
  for (Linear* l : {&project_in_, &project_out_})
    if (l->defined()) out.push_back(l);
  return out;
}

std::vector<const Linear*> CausalLM::linears() const {
  std::vector<const Linear*> out;
  for (Linear* l : const_cast<CausalLM*>(this)->linears()) out.push_back(l);
  return out;
}

int64_t CausalLM::base_bytes(bool unsharded) const {
  int64_t n = 0;
  for (const NamedWeight& w : named_)
    if (w.tensor.defined()) n += static_cast<int64_t>(w.tensor.nbytes());
  if (embed_blocks_) n += embed_blocks_->bytes();
  for (const Linear* l : linears())
    n += l->sharded  ? (unsharded ? l->sharded->whole_bytes() : l->sharded->bytes())
         : l->nf4    ? l->nf4->bytes()
         : l->blocks ? l->blocks->bytes()
                     : 0;
  return n;
}

int64_t CausalLM::base_parameter_count() const {
  int64_t n = 0;
  for (const NamedWeight& w : named_) n += w.numel;
  return n;
}

bool cpu_has_bf16() {
  const auto caps = at::cpu::get_cpu_capabilities();
  for (const char* isa : {"avx512_bf16", "amx_bf16"})
    if (const auto it = caps.find(isa); it != caps.end() && it->second.isBool() && it->second.toBool()) return true;
  return false;
}

at::ScalarType dtype_of(recipe::Dtype d, bool cuda) {
  switch (d) {
    case recipe::Dtype::Auto:
      return cuda || cpu_has_bf16() ? at::kBFloat16 : at::kFloat;
    case recipe::Dtype::BF16:
      return at::kBFloat16;
    case recipe::Dtype::FP16:
      return at::kHalf;
    case recipe::Dtype::FP32:
      return at::kFloat;
  }
  throw Error("unknown model.dtype");
}

std::optional<int64_t> CausalLM::position_limit() const {
  if (!embed_positions_.defined()) return std::nullopt;
  return embed_positions_.size(0) - (config_.family == Family::Opt ? 2 : 0);  // opt's table is offset by 2
}

void CausalLM::check_length(int64_t tokens, const std::string& what) const {
  const std::optional<int64_t> limit = position_limit();
  if (limit && tokens > *limit)
    throw ConfigError(fmt::format("{} passes the {} positions {} has ({} {}): keep it at most {}", what, *limit, dir_,
                                  config_.family == Family::Gpt2 ? "n_positions" : "max_position_embeddings", *limit,
                                  *limit));
}

void CausalLM::check_tokenizer(const tok::Tokenizer& tokenizer) const {
  const int64_t ids = tokenizer.id_bound(), rows = embed_blocks_ ? embed_blocks_->shape[0] : embed_tokens_.size(0);
  if (ids > rows)
    throw ConfigError(fmt::format(
        "{}: its tokenizer makes ids up to {} but its embedding has {} rows (vocab_size {}): the tokenizer and the "
        "weights are not of one model; use the model's own tokenizer files",
        dir_, ids - 1, rows, config_.vocab_size));
}

}  // namespace lorarun::model
