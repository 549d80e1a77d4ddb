#include "model/gguf_blocks.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <fmt/format.h>
#include <span>

#include "model/recompute.hpp"
#include "util/error.hpp"

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
// into float32, a stretch of about 256 KiB at a time in one buffer of its own, and converts each
// stretch into `dtype` while it is in cache: one pass over the output, never a float32 copy of a
// whole weight (a tied 49,152-row head's would be 113 MiB). The conversion is ATen's copy_, as
// loading the file dequantised does.
at::Tensor GgufBlocks::dequantize() const {
  if (raw.is_meta()) return at::empty(shape, at::TensorOptions().dtype(dtype).device(device));
  const int64_t rows = shape[0], cols = shape[1];
  if (!raw.is_cpu()) return dequantize_with_tensor_ops();  // blocks in the GPU's memory, dequantised there
  const int64_t units = heads ? heads : rows, unit_rows = rows / units;
  const int64_t stretch = std::max<int64_t>(1, (int64_t{1} << 16) / (unit_rows * cols));  // units at a time
  const size_t row_bytes = raw.nbytes() / static_cast<size_t>(rows);
  const bool direct = dtype == at::kFloat && heads == 0;
  at::Tensor out = at::empty(shape, at::TensorOptions().dtype(dtype));
  const auto* in = static_cast<const std::byte*>(raw.data_ptr());
  at::parallel_for(0, units, std::max<int64_t>(1, 16384 / (unit_rows * cols)), [&](int64_t a, int64_t b) {
    at::Tensor buffer = direct ? at::Tensor() : at::empty({std::min(stretch, b - a) * unit_rows, cols}, at::kFloat);
    for (int64_t u = a; u < b; u += stretch) {
      const int64_t v = std::min(b, u + stretch), first = u * unit_rows, n = (v - u) * unit_rows;
      at::Tensor part = direct ? out.narrow(0, first, n) : buffer.narrow(0, 0, n);
      io::dequantize(type, std::span(in + static_cast<size_t>(first) * row_bytes, static_cast<size_t>(n) * row_bytes),
                     std::span(part.data_ptr<float>(), static_cast<size_t>(n * cols)));
      if (direct) continue;
      const at::Tensor src = heads ? unpermute_rows(part, v - u) : part;
      out.narrow(0, first, n).view(src.sizes()).copy_(src);
    }
  });
  return device.is_cpu() ? out : out.to(device);
}

namespace {

// Bytes [from, from + n) of every block [blocks, block bytes], as uint8 [blocks, n].
at::Tensor field(const at::Tensor& b, int64_t from, int64_t n) { return b.narrow(1, from, n); }

// The little-endian fp16 at byte `from` of every block, as float32 [blocks, 1] (exact).
at::Tensor half_at(const at::Tensor& b, int64_t from) {
  return field(b, from, 2).contiguous().view(at::kHalf).to(at::kFloat);
}

// Bit i of each byte of `bytes` [.., k] as [.., k * 8] (byte j's bits at 8j .. 8j + 7): a little-
// endian bit field.
at::Tensor bits_of(const at::Tensor& bytes) {
  const at::Tensor shifts = at::arange(8, bytes.options());
  std::vector<int64_t> shape = bytes.sizes().vec();
  shape.back() *= 8;
  return bytes.unsqueeze(-1).bitwise_right_shift(shifts).bitwise_and(1).reshape(shape);
}

// The low and the high nibbles of each byte of `q` [blocks, k], as [blocks, 2, k].
at::Tensor nibbles(const at::Tensor& q) { return at::stack({q.bitwise_and(0xf), q.bitwise_right_shift(4)}, 1); }

// y = d * q (+ m): the float32 product (and sum) of each value's scale, per group of `group` values.
at::Tensor scaled(const at::Tensor& q, const at::Tensor& d, int64_t group) {
  const int64_t blocks = q.size(0);
  return (d.view({blocks, -1, 1}) * q.to(at::kFloat).view({blocks, -1, group})).view({blocks, -1});
}

at::Tensor dequantize_blocks(io::GgmlType type, const at::Tensor& b) {
  using T = io::GgmlType;
  const int64_t nb = b.size(0);
  switch (type) {
    case T::F16:
      return b.contiguous().view(at::kHalf).to(at::kFloat).view({nb, -1});
    case T::BF16:
      return b.contiguous().view(at::kBFloat16).to(at::kFloat).view({nb, -1});
    case T::Q4_0:  // d, 16 bytes of nibbles (element j < 16: low nibble of byte j, j + 16: high)
      return scaled(nibbles(field(b, 2, 16)).view({nb, 32}).to(at::kInt) - 8, half_at(b, 0), 32);
    case T::Q4_1:
      return scaled(nibbles(field(b, 4, 16)).view({nb, 32}), half_at(b, 0), 32) + half_at(b, 2);
    case T::Q5_0:
    case T::Q5_1: {  // d (, m), 32 fifth bits, 16 bytes of nibbles
      const bool m = type == T::Q5_1;
      const at::Tensor fifth = bits_of(field(b, m ? 4 : 2, 4));
      const at::Tensor q = nibbles(field(b, m ? 8 : 6, 16)).view({nb, 32}).bitwise_or(fifth.bitwise_left_shift(4));
      if (m) return scaled(q, half_at(b, 0), 32) + half_at(b, 2);
      return scaled(q.to(at::kInt) - 16, half_at(b, 0), 32);
    }
    case T::Q8_0:  // d, 32 int8: q * d
      return (field(b, 2, 32).contiguous().view(at::kChar).to(at::kFloat) * half_at(b, 0));
    case T::Q2_K: {  // 16 scale/min bytes, 64 bytes of 2-bit quants (e = 128 n + 32 s + l: byte 32 n + l,
                     // shift 2 s), d, dmin; group e / 16
      const at::Tensor sc = field(b, 0, 16), shifts = at::arange(0, 8, 2, b.options()).view({1, 1, 4, 1});
      const at::Tensor q = field(b, 16, 64).reshape({nb, 2, 1, 32}).bitwise_right_shift(shifts).bitwise_and(3);
      const at::Tensor dl = half_at(b, 80) * sc.bitwise_and(0xf).to(at::kFloat);
      const at::Tensor ml = half_at(b, 82) * sc.bitwise_right_shift(4).to(at::kFloat);
      return (scaled(q.reshape({nb, 256}), dl, 16).view({nb, 16, 16}) - ml.view({nb, 16, 1})).view({nb, 256});
    }
    case T::Q3_K: {  // 32 bytes of high bits, 64 bytes of 2-bit quants, 12 bytes of 6-bit scales, d
      const at::Tensor sc = field(b, 96, 12);
      const at::Tensor lo =
          at::cat({sc.narrow(1, 0, 8).bitwise_and(0xf), sc.narrow(1, 0, 8).bitwise_right_shift(4)}, 1);
      const at::Tensor hi = sc.narrow(1, 8, 4)
                                .unsqueeze(1)
                                .bitwise_right_shift(at::arange(0, 8, 2, b.options()).view({1, 4, 1}))
                                .bitwise_and(3)
                                .reshape({nb, 16});  // group g: byte 8 + g % 4, shift 2 (g / 4)
      const at::Tensor dl =
          half_at(b, 108) * (lo.bitwise_or(hi.bitwise_left_shift(4)).to(at::kInt) - 32).to(at::kFloat);
      const at::Tensor s = at::arange(4, b.options()).view({1, 1, 4, 1});
      const at::Tensor ql = field(b, 32, 64).reshape({nb, 2, 1, 32}).bitwise_right_shift(s * 2).bitwise_and(3);
      const at::Tensor high = field(b, 0, 32)  // bit 4 n + s of byte l
                                  .reshape({nb, 1, 1, 32})
                                  .bitwise_right_shift(s + 4 * at::arange(2, b.options()).view({1, 2, 1, 1}))
                                  .bitwise_and(1);
      const at::Tensor q = ql.to(at::kInt) - high.bitwise_xor(1).to(at::kInt).bitwise_left_shift(2);
      return scaled(q.reshape({nb, 256}), dl, 16);
    }
    case T::Q4_K:
    case T::Q5_K: {  // d, dmin, 12 bytes of 6-bit scales and mins (get_scale_min), (32 bytes of fifth
                     // bits,) 128 bytes of nibbles: group j = 2 c + s is nibble s of bytes 32 c ..
      const at::Tensor s = field(b, 4, 12);
      const at::Tensor s0 = s.narrow(1, 0, 4), s1 = s.narrow(1, 4, 4), s2 = s.narrow(1, 8, 4);
      const at::Tensor sc = at::cat(
          {s0.bitwise_and(63), s2.bitwise_and(0xf).bitwise_or(s0.bitwise_right_shift(6).bitwise_left_shift(4))}, 1);
      const at::Tensor mn = at::cat(
          {s1.bitwise_and(63), s2.bitwise_right_shift(4).bitwise_or(s1.bitwise_right_shift(6).bitwise_left_shift(4))},
          1);
      const at::Tensor dl = half_at(b, 0) * sc.to(at::kFloat), ml = half_at(b, 2) * mn.to(at::kFloat);
      const bool k5 = type == T::Q5_K;
      at::Tensor q = nibbles(field(b, k5 ? 48 : 16, 128).reshape({nb * 4, 32})).view({nb, 8, 32});
      if (k5)  // group j's fifth bit: bit j of byte l
        q = q.bitwise_or(field(b, 16, 32)
                             .reshape({nb, 1, 32})
                             .bitwise_right_shift(at::arange(8, b.options()).view({1, 8, 1}))
                             .bitwise_and(1)
                             .bitwise_left_shift(4));
      return (scaled(q.reshape({nb, 256}), dl, 32).view({nb, 8, 32}) - ml.view({nb, 8, 1})).view({nb, 256});
    }
    case T::Q6_K: {  // 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d; e = 128 h + 32 s
                     // + l: nibble s / 2 of byte 64 h + 32 (s % 2) + l, bits 2 s of byte 32 h + l
      const at::Tensor lo = nibbles(field(b, 0, 128).reshape({nb * 2, 64})).view({nb, 2, 4, 32});
      const at::Tensor hi = field(b, 128, 64)
                                .reshape({nb, 2, 1, 32})
                                .bitwise_right_shift(at::arange(0, 8, 2, b.options()).view({1, 1, 4, 1}))
                                .bitwise_and(3);
      const at::Tensor q = lo.bitwise_or(hi.bitwise_left_shift(4)).to(at::kInt) - 32;
      const at::Tensor dl = half_at(b, 208) * field(b, 192, 16).contiguous().view(at::kChar).to(at::kFloat);
      return scaled(q.reshape({nb, 256}), dl, 16);
    }
    default:
      throw Error(fmt::format("ggml type {} cannot be dequantised on the device", io::ggml_type_name(type)));
  }
}

}  // namespace

at::Tensor dequantize_on_device(io::GgmlType type, const at::Tensor& raw, int64_t n) {
  const auto block = static_cast<int64_t>(io::ggml_block_size(type)),
             bytes = static_cast<int64_t>(io::ggml_block_bytes(type));
  if (n % block != 0 || raw.numel() != n / block * bytes)
    throw Error(
        fmt::format("dequantising {}: {} bytes do not make {} values", io::ggml_type_name(type), raw.numel(), n));
  return dequantize_blocks(type, raw.view({n / block, bytes})).reshape({n});
}

at::Tensor GgufBlocks::dequantize_with_tensor_ops() const {
  at::Tensor w = dequantize_on_device(type, raw, shape[0] * shape[1]).view({shape[0], shape[1]});
  if (heads) w = unpermute_rows(w, heads).reshape({shape[0], shape[1]});
  return w.to(dtype);
}

at::Tensor GgufBlocks::rows(const at::Tensor& ids) const {
  std::vector<int64_t> sizes = ids.sizes().vec();
  sizes.push_back(shape[1]);
  if (raw.is_meta()) return at::empty(sizes, at::TensorOptions().dtype(dtype).device(device));
  const int64_t cols = shape[1], row_bytes = raw.numel() / shape[0];
  const at::Tensor picked = raw.view({shape[0], row_bytes}).index_select(0, ids.reshape({-1}).to(raw.device()));
  const int64_t n = picked.size(0);
  at::Tensor values;
  if (picked.is_cpu()) {
    values = at::empty({n, cols}, at::kFloat);
    dequantize_rows(type,
                    std::span(static_cast<const std::byte*>(picked.data_ptr()), static_cast<size_t>(picked.numel())), n,
                    std::span(values.data_ptr<float>(), static_cast<size_t>(n * cols)));
  } else {
    values = dequantize_on_device(type, picked.reshape({-1}), n * cols);
  }
  return values.to(device, dtype).view(sizes);
}

at::Tensor gguf_linear(const at::Tensor& x, const GgufBlocks& w, const at::Tensor& bias) {
  return remade_weight_linear(x, bias, w.shape[0], [w] { return w.dequantize(); });
}

}  // namespace lorarun::model
