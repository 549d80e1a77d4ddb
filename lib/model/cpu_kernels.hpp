#pragma once
// Fused float32 loops for the CPU training step (SwiGLU, RMSNorm, rotary embedding, softmax
// cross-entropy), each compiled for every CPU capability ATen dispatches on (DEFAULT, AVX2, AVX512)
// and chosen at run time as ATen chooses its own kernels. Raw rows, no tensors: fused_ops.hpp wraps them for autograd.
#include <cstdint>
#include <string_view>

namespace lorarun::model::cpu {

struct Kernels {
  // y = silu(g) * u over n values.
  void (*swiglu)(const float* g, const float* u, float* y, int64_t n);
  // dg, du of y = silu(g) * u given dy, over n values.
  void (*swiglu_backward)(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n);
  // rows of `cols`: y = w * x / sqrt(mean(x^2) + eps); rstd[row] = 1 / sqrt(mean(x^2) + eps).
  void (*rms_norm)(const float* x, const float* w, float eps, float* y, float* rstd, int64_t rows, int64_t cols);
  // dx of rms_norm given dy (w frozen).
  void (*rms_norm_backward)(const float* dy, const float* x, const float* w, const float* rstd, float* dx, int64_t rows,
                            int64_t cols);
  // Rotary embedding of one [D] row: out = x * cos + rotate_half(x) * sin, rotate_half(x) = [-x2, x1]
  // (x1, x2 the halves). backward: dx from dout (sign = -1 turns the rotation back).
  void (*rope)(const float* x, const float* cos, const float* sin, float* out, int64_t d);
  void (*rope_backward)(const float* dout, const float* cos, const float* sin, float* dx, int64_t d);
  // rows of logits z [rows, vocab], overwritten by d(-log softmax(z)[t])/dz = softmax(z) - onehot(t);
  // loss[row] = -log softmax(z)[t].
  void (*softmax_cross_entropy)(float* z, const int64_t* targets, float* loss, int64_t rows, int64_t vocab);
};

// The kernels for this CPU: those of ATen's capability (at::get_cpu_capability(), which
// ATEN_CPU_CAPABILITY lowers).
const Kernels& kernels();
// Those built for a capability ("DEFAULT", "AVX2", "AVX512"); null where not built (another ISA).
const Kernels* kernels_for(std::string_view capability);

}  // namespace lorarun::model::cpu
