#pragma once
// SwiGLU, RMSNorm and the rotary embedding as single autograd ops on the CPU (float32), from the fused loops of
// cpu_kernels.hpp: one pass over the values each way instead of ATen's five to eight, and fewer
// tensors kept for backward. Elsewhere (CUDA, other dtypes) callers keep ATen's composition.
#include <ATen/core/Tensor.h>

namespace lorarun::model::fused {

// Whether the fused CPU ops run at all: yes, unless LORARUN_CPU_KERNELS=aten (benchmarks compare).
bool enabled();

// silu(g) * u for contiguous float32 CPU tensors of one shape.
bool swiglu_applies(const at::Tensor& g, const at::Tensor& u);
at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u);

// x / sqrt(mean(x^2, -1) + eps) * w over the last dimension, as HF's RMSNorm in float32; w frozen.
bool rms_norm_applies(const at::Tensor& x, const at::Tensor& w);
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps);

// Rotary embedding of x [B, T, H, D] (contiguous) by cos, sin [B, 1, T, D] -> [B, H, T, D]
// contiguous: x.transpose(1, 2) * cos + rotate_half(x.transpose(1, 2)) * sin; cos and sin constant.
bool rope_applies(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);

}  // namespace lorarun::model::fused
