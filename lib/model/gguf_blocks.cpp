#include "model/gguf_blocks.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <span>

#include "model/recompute.hpp"

namespace lorarun::model {

at::Tensor unpermute_rows(const at::Tensor& w, int64_t heads) {
  std::vector<int64_t> shape = {heads, w.size(0) / heads / 2, 2};
  for (int64_t d = 1; d < w.dim(); ++d) shape.push_back(w.size(d));
  return w.view(shape).transpose(1, 2);
}

at::Tensor GgufBlocks::dequantize() const {
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  if (raw.is_meta()) return at::empty(shape, options);
  const int64_t rows = shape[0], cols = shape[1];
  const size_t row_bytes = raw.nbytes() / static_cast<size_t>(rows);
  at::Tensor w = at::empty(shape, at::kFloat);
  const auto* in = static_cast<const std::byte*>(raw.data_ptr());
  float* out = w.data_ptr<float>();
  // rows are whole blocks: each thread dequantises its own rows
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / cols), [&](int64_t a, int64_t b) {
    io::dequantize(type, std::span(in + static_cast<size_t>(a) * row_bytes, static_cast<size_t>(b - a) * row_bytes),
                   std::span(out + a * cols, static_cast<size_t>((b - a) * cols)));
  });
  if (heads == 0 && dtype == at::kFloat && device.is_cpu()) return w;
  const at::Tensor src = heads ? unpermute_rows(w, heads) : w;
  at::Tensor y = at::empty(src.sizes(), options);
  y.copy_(src);
  return y.view(shape);
}

at::Tensor gguf_linear(const at::Tensor& x, const GgufBlocks& w, const at::Tensor& bias) {
  return remade_weight_linear(x, bias, w.shape[0], [w] { return w.dequantize(); });
}

}  // namespace lorarun::model
