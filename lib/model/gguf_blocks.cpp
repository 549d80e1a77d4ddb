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

// Each thread dequantises its own rows (whole heads for Q and K, whose rows move within a head)
// into float32 and converts them into `dtype` while they are in cache: one pass over the output,
// no whole float32 copy. The conversion is ATen's copy_, as loading the file dequantised does.
at::Tensor GgufBlocks::dequantize() const {
  if (raw.is_meta()) return at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
  const int64_t rows = shape[0], cols = shape[1];
  const int64_t units = heads ? heads : rows, unit_rows = rows / units;
  const size_t row_bytes = raw.nbytes() / static_cast<size_t>(rows);
  const bool direct = dtype == at::kFloat && heads == 0;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(dtype));
  const auto* in = static_cast<const std::byte*>(raw.data_ptr());
  at::parallel_for(0, units, std::max<int64_t>(1, 16384 / (unit_rows * cols)), [&](int64_t a, int64_t b) {
    const int64_t first = a * unit_rows, n = (b - a) * unit_rows;
    at::Tensor part = direct ? out.narrow(0, first, n) : at::empty({n, cols}, at::kFloat);
    io::dequantize(type, std::span(in + static_cast<size_t>(first) * row_bytes, static_cast<size_t>(n) * row_bytes),
                   std::span(part.data_ptr<float>(), static_cast<size_t>(n * cols)));
    if (direct) return;
    const at::Tensor src = heads ? unpermute_rows(part, b - a) : part;
    out.narrow(0, first, n).view(src.sizes()).copy_(src);
  });
  return device.is_cpu() ? out : out.to(device);
}

at::Tensor gguf_linear(const at::Tensor& x, const GgufBlocks& w, const at::Tensor& bias) {
  return remade_weight_linear(x, bias, w.shape[0], [w] { return w.dequantize(); });
}

}  // namespace lorarun::model
