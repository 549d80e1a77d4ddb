// QLoRA's 4-bit NormalFloat (NF4) base weights, bit for bit as bitsandbytes stores them
// (quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=…), its CPU algorithm).
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <vector>

namespace lorarun::model {

// bnb's 8-bit blockwise quantisation with its signed dynamic map (quantize_blockwise).
struct Blockwise8 {
  at::Tensor codes;   // uint8 [n]: indices into `code`
  at::Tensor absmax;  // float32 [ceil(n / blocksize)]
  at::Tensor code;    // float32 [256]: create_dynamic_map()
  int64_t blocksize = 256;

  at::Tensor dequantize() const;  // float32 [n]: code[codes] * absmax of the block
};

// x float32 [n], any device. Computed on the CPU as bnb's CPU kernel does (a 65536-entry lookup
// table over [-1, 1]), so every device gets the same bits.
Blockwise8 quantize_blockwise8(const at::Tensor& x, int64_t blocksize = 256);

// The flattened row-major weight is cut into blocks of 64 (the last may be shorter); each block
// is scaled by its absolute maximum and each value replaced by the nearest of the 16 NF4 levels.
struct Nf4Weight {
  static constexpr int64_t kBlock = 64;

  at::Tensor packed;           // uint8 [ceil(n/2)]: level indices two a byte, the even element in the high nibble
  at::Tensor absmax;           // float32 [ceil(n/64)]; undefined under double quantisation
  Blockwise8 absmax8;          // double quantisation: absmax - offset in 8 bits, blocks of 256
  at::Tensor offset;           // double quantisation: float32 scalar, the mean of the absmax
  at::Tensor pairs;            // float32 [256, 2]: the two levels each packed byte stands for
  std::vector<int64_t> shape;  // [out, in]
  at::ScalarType dtype = at::kFloat;  // of the original weight, and of dequantize()

  bool double_quant() const { return offset.defined(); }
  int64_t numel() const;
  int64_t bytes() const;            // memory held, tables included
  at::Tensor block_absmax() const;  // float32 [ceil(n/64)], the double quantisation undone
  at::Tensor dequantize() const;    // `dtype` [shape], on the weight's device (dequantize_4bit)
};

// The 16 NF4 levels, float32 (bnb's get_4bit_type("nf4")).
at::Tensor nf4_levels(at::Device device = at::kCPU);

// w [out, in] as float32, bf16 or fp16, on any device. Throws lorarun::Error for other dtypes.
Nf4Weight quantize_nf4(const at::Tensor& w, bool double_quant);

// y = x W^T + b, x [.., in] -> [.., out], with W dequantised on the fly in forward and again in
// backward, so no full-precision W outlives the call. Gradients flow to x only.
at::Tensor nf4_linear(const at::Tensor& x, const Nf4Weight& w, const at::Tensor& bias);

}  // namespace lorarun::model
