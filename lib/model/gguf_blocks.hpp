// model.keep_quantized: a GGUF file's linear weights held as the file's own blocks (F16, BF16,
// Q4_0 … Q8_0, Q2_K … Q6_K), dequantised into model.dtype each time a layer uses them, in forward
// and again in backward, so the whole weight never outlives the call.
#pragma once
#include <ATen/core/Tensor.h>
#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "io/gguf.hpp"

namespace lorarun::model {

struct GgufBlocks {
  at::Tensor raw;  // uint8 [out * row bytes]: the file's blocks, row after row, on the CPU (or on `device`)
  io::GgmlType type = io::GgmlType::F32;
  std::vector<int64_t> shape;         // [out, in]: the weight as the layer uses it
  int64_t heads = 0;                  // llama's Q and K: the converter's per-head row interleave undone (0: none)
  at::ScalarType dtype = at::kFloat;  // what dequantize() makes: model.dtype
  at::Device device = at::kCPU;       // ... and where

  int64_t bytes() const { return static_cast<int64_t>(raw.nbytes()); }
  // `dtype` [out, in] on `device`: bit for bit what loading the file dequantised gives
  // (model/gguf_weights.hpp): blocks on the CPU dequantised there on all intra-op threads, blocks
  // on a GPU there (dequantize_on_device).
  at::Tensor dequantize() const;
  // The same with tensor operations, where `raw` is (what dequantize() does for blocks on a GPU).
  at::Tensor dequantize_with_tensor_ops() const;
  // Rows `ids` [..] (int64) alone, dequantised: [.., in] in `dtype`, the values of dequantize()'s
  // rows (an embedding looked up without a whole copy of it; heads == 0).
  at::Tensor rows(const at::Tensor& ids) const;
};

// The blocks `raw` (uint8, whole blocks of `type`, on any device) as float32 values [n] on the same
// device, with tensor operations: on a GPU the blocks stay in its memory and are dequantised there.
// io::dequantize's values bit for bit: each value is the same float32 products and sums of the same
// operands, one operation a kernel (nothing fused).
at::Tensor dequantize_on_device(io::GgmlType type, const at::Tensor& raw, int64_t n);

// `rows` rows of whole blocks of `type` from `in` into `out` (rows x cols float32), rows split
// over the intra-op threads: io::dequantize's values, bit for bit.
void dequantize_rows(io::GgmlType type, std::span<const std::byte> in, int64_t rows, std::span<float> out);

// llama.cpp's converter reorders the rows of each head of Q and K ([heads * head_dim, ..]) from
// HF's rotate-half layout (first halves, then second halves) to interleaved pairs; this is the
// inverse, transformers' reverse_permute: per head, [dim/2, 2] -> [2, dim/2]. Returns a view
// [heads, 2, dim/2, rest..] of `w`.
at::Tensor unpermute_rows(const at::Tensor& w, int64_t heads);

// y = x W^T + b with W dequantised from `w` in forward and again in backward (remade_weight_linear).
at::Tensor gguf_linear(const at::Tensor& x, const GgufBlocks& w, const at::Tensor& bias);

}  // namespace lorarun::model
