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

void dequantize_rows(io::GgmlType type, std::span<const std::byte> in, int64_t rows, std::span<float> out) {
  if (rows == 0) return;
  const size_t row_bytes = in.size() / static_cast<size_t>(rows), cols = out.size() / static_cast<size_t>(rows);
  // rows are whole blocks: each thread dequantises its own rows
  at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / static_cast<int64_t>(cols)), [&](int64_t a, int64_t b) {
    const auto from = static_cast<size_t>(a), n = static_cast<size_t>(b - a);
    io::dequantize(type, in.subspan(from * row_bytes, n * row_bytes), out.subspan(from * cols, n * cols));
  });
}

at::Tensor GgufBlocks::dequantize() const {
  const auto options = at::TensorOptions().dtype(dtype).device(device);
  if (raw.is_meta()) return at::empty(shape, options);
  at::Tensor w = at::empty(shape, at::kFloat);
  dequantize_rows(type, {static_cast<const std::byte*>(raw.data_ptr()), raw.nbytes()}, shape[0],
                  {w.data_ptr<float>(), static_cast<size_t>(w.numel())});
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
