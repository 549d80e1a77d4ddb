#include "model/memory.hpp"

#include <ATen/ATen.h>
#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <fmt/format.h>
#include <algorithm>
#include <atomic>

#include "model/fused_ops.hpp"
#include "model/lora.hpp"
#include "model/loss.hpp"
#include "model/transformer.hpp"

namespace lorarun::model {

// The tensors this implementation keeps (transformer.cpp, lora Linear::forward, loss.cpp), per
// token of one block: norms keep their input (RMSNorm in float32), attention keeps q, k, v and
// its output (the fused kernels keep no [T, T] scores; gemma2's soft-capped scores are), the
// gated MLP its gate, up, activation and product (fused SwiGLU on the CPU in float32: gate, up and
// product). A frozen base linear keeps nothing of its
// input (NF4 and sharded ones neither); LoRA's A keeps its input in float32 (a copy per linear
// under a bf16/fp16 base), dropout its own copy and mask. Checked against the tensor bytes
// measured on every fixture family (tests/model/test_memory.cpp).
int64_t CausalLM::activation_bytes(int64_t batch, int64_t tokens) const {
  const ModelConfig& c = config_;
  const int64_t b = static_cast<int64_t>(c10::elementSize(dtype_)), f32 = 4;
  const int64_t N = batch * tokens, H = c.hidden_size, F = c.intermediate_size, V = c.vocab_size;
  const int64_t Q = c.num_heads * c.head_dim, K = c.num_kv_heads * c.head_dim;
  const Block& k = blocks_.at(0);
  // An input of `width` that `readers` share; `counted`: the tensor itself is counted elsewhere.
  // (A base weight remade in backward needs nothing of its input: dx = dy W.)
  const auto input = [&](std::initializer_list<const Linear*> readers, int64_t width, bool counted) {
    int64_t n = 0, shared = 0;
    for (const Linear* l : readers) {
      if (!l->defined() || !l->adapted()) continue;
      n += l->lora_a.size(0) * f32;  // x A^T, for B's gradient
      if (l->dropout > 0)
        n += width * (f32 + b);  // its own dropped copy (float32) and the mask (on the CPU in the input's dtype)
      else if (b != f32)
        n += width * f32;  // its own float32 copy
      else
        shared = width * f32;  // the input itself
    }
    return counted ? n : n + shared;
  };
  const bool rms = c.family == Family::Llama;
  int64_t block = 2 * H * (rms ? f32 : b);                                 // the two norms
  if (k.attn_out_norm.weight.defined()) block += 2 * H * (rms ? f32 : b);  // gemma's output norms
  if (k.q_norm.weight.defined()) block += (Q + K) * f32;                   // qk-norm's inputs
  block += input({&k.q, &k.k, &k.v, &k.qkv}, H, false);
  block += (2 * Q + 2 * K) * b;                                 // q, k, v and the output, kept by attention
  if (c.attn_softcap) block += c.num_heads * tokens * 3 * f32;  // gemma2's scores: capped, softmax
  block += Q * b + input({&k.o}, Q, true);                      // o's input (a copy of the output)
  const bool gated = std::any_of(blocks_.begin(), blocks_.end(),
                                 [](const Block& x) { return x.gate.defined() || x.gate_up.defined(); });
  const bool cpu = device_.is_cpu() && fused::enabled();  // the fused CPU ops (fused_ops.hpp, loss.cpp) run
  const bool silu = c.activation == "silu" || c.activation == "swish";
  const bool swiglu = cpu && dtype_ == at::kFloat && silu;
  const int64_t attention = block;
  // A dense MLP keeps its gate, up, act(gate), product (ungated: fc1's output, its activation) and
  // its adapters' inputs. A mixture of experts keeps the router's probabilities (float32) and, for
  // each of a token's k experts, the routed copy of its input, gate and up (and act(gate)), product
  // and output (the weighting keeps it), and the experts' adapters' inputs and x A^T.
  const auto mlp = [&](const Block& x) {
    if (!x.moe.defined())
      return ((swiglu && x.gate.defined())              ? 3
              : x.gate.defined() || x.gate_up.defined() ? 4
                                                        : 2) *
                 F * b +
             input({&x.gate, &x.up, &x.gate_up}, H, false) + input({&x.down}, F, true);
    const int64_t I = c.moe.intermediate;
    const auto expert = [&](const Experts& e, int64_t width) {
      if (!e.adapted()) return int64_t{0};
      return e.lora_a.size(0) / e.count() * f32 + (b != f32 ? width * f32 : 0);
    };
    return c.moe.experts * f32 + input({&x.moe.router}, H, false) +
           c.moe.top_k * ((swiglu ? 3 : 4) * I * b + 2 * H * b + expert(x.moe.gate_up, H) + expert(x.moe.down, I));
  };
  int64_t blocks = 0, widest = 0;
  for (const Block& x : blocks_) {
    blocks += attention + mlp(x);
    widest = std::max(widest, attention + mlp(x));
  }
  const int64_t mlp_width = std::max((gated ? 2 : 1) * F, c.moe.top_k * (2 * c.moe.intermediate + H));

  const auto L = static_cast<int64_t>(blocks_.size());
  // Kept from forward to backward: each block's (or, recomputing, each block's input), the
  // embeddings' output and the final norm's input, the attention masks ([B, 1, T, T] bool), and
  // the loss's gradient for the rows [N, H].
  const bool two_masks = c.sliding_window && !c.sliding_layers.empty();
  const int64_t kept = (recompute_activations ? L * N * H * b : N * blocks) + N * H * (b + f32) +
                       batch * tokens * tokens * (two_masks ? 2 : 1) + N * H * b;
  // Then the most of: the loss's chunk of logits (in the model's dtype, float32, log-softmax; the
  // CPU's fused loop overwrites the float32 logits instead, then their copy in the model's dtype
  // meets the head), or backward's (a recomputed block and the gradients in flight, about a
  // block's widest).
  const int64_t rows = std::min(N, loss_chunk_rows(V, c.logit_softcap.has_value()));
  const int64_t logits = cpu && !c.logit_softcap ? (b == f32 ? f32 : 2 * b + f32) : (b == f32 ? 2 * f32 : b + 2 * f32);
  const int64_t chunk = rows * V * (logits + (c.logit_softcap ? b : 0));
  const int64_t back = (recompute_activations ? N * widest : 0) + N * (mlp_width + H) * std::max(b, f32);
  return kept + std::max(chunk, back);
}

struct TensorMemoryMeter::Impl : c10::MemoryReportingInfoBase {
  std::atomic<int64_t> now{0}, peak{0};
  std::unique_ptr<c10::DebugInfoGuard> guard;

  void reportMemoryUsage(void*, int64_t bytes, size_t, size_t, c10::Device) override {
    const int64_t n = now += bytes;
    for (int64_t p = peak.load(); n > p && !peak.compare_exchange_weak(p, n);) {
    }
  }
  bool memoryProfilingEnabled() const override { return true; }
};

TensorMemoryMeter::TensorMemoryMeter() : impl_(std::make_unique<Impl>()) {
  // Shared with the debug-info stack through a non-owning pointer: the meter outlives its guard.
  std::shared_ptr<c10::DebugInfoBase> info(impl_.get(), [](c10::DebugInfoBase*) {});
  impl_->guard = std::make_unique<c10::DebugInfoGuard>(c10::DebugInfoKind::PROFILER_STATE, info);
}

TensorMemoryMeter::~TensorMemoryMeter() { impl_->guard.reset(); }

int64_t TensorMemoryMeter::now() const { return impl_->now; }
int64_t TensorMemoryMeter::peak() const { return impl_->peak; }
void TensorMemoryMeter::reset_peak() { impl_->peak = impl_->now.load(); }

}  // namespace lorarun::model
