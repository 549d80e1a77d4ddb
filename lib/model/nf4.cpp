#include "model/nf4.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <algorithm>
#include <cmath>

#include "model/recompute.hpp"
#include "util/error.hpp"

namespace lorarun::model {
namespace {

// bnb's create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8), made with the same
// float32 tensor operations so every entry has the same bits.
at::Tensor dynamic_map() {
  std::vector<float> data;
  for (int i = 0; i < 7; ++i) {
    const at::Tensor b = at::linspace(0.1, 1, (1 << i) + 1, at::kFloat);
    const at::Tensor means = (b.narrow(0, 0, b.size(0) - 1) + b.narrow(0, 1, b.size(0) - 1)) / 2.0;
    const double scale = std::pow(10.0, i - 6);
    for (const double s : {scale, -scale}) {
      const at::Tensor v = (means * s).contiguous();
      data.insert(data.end(), v.data_ptr<float>(), v.data_ptr<float>() + v.numel());
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  return at::tensor(data, at::kFloat);
}

// bnb's CPU lookup table: entry i holds the index of the map value nearest to -1 + 2i/65535.
at::Tensor quantize_lut(const at::Tensor& code) {
  const float* c = code.data_ptr<float>();
  float mid[255];
  for (int i = 0; i < 255; ++i) mid[i] = 0.5f * (c[i] + c[i + 1]);
  at::Tensor lut = at::empty({65536}, at::kByte);
  uint8_t* out = lut.data_ptr<uint8_t>();
  for (int i = 0, k = 0; i < 65536; ++i) {
    const float v = -1.0f + (2.0f * static_cast<float>(i)) / 65535.0f;
    while (k < 255 && mid[k] < v) ++k;
    out[i] = static_cast<uint8_t>(k);
  }
  return lut;
}

// Values handled at a time: whole blocks, so results are the same, and the temporaries stay a few
// MiB whatever the size of the layer.
constexpr int64_t kChunk = Nf4Weight::kBlock << 14;

// x [m] -> [ceil(m / block) * block], zeros appended.
at::Tensor pad_to_blocks(const at::Tensor& x, int64_t block) {
  const int64_t pad = (block - x.numel() % block) % block;
  return pad ? at::constant_pad_nd(x, {0, pad}) : x;
}

}  // namespace

at::Tensor Blockwise8::dequantize() const {
  const int64_t n = codes.numel();
  const at::Tensor v = pad_to_blocks(code.index_select(0, codes.to(at::kInt)), blocksize);
  return (v.view({-1, blocksize}) * absmax.unsqueeze(1)).view(-1).narrow(0, 0, n);
}

Blockwise8 quantize_blockwise8(const at::Tensor& x_in, int64_t blocksize) {
  c10::NoGradGuard no_grad;
  const at::Tensor x = x_in.to(at::kCPU, at::kFloat).contiguous().view(-1);
  Blockwise8 q;
  q.blocksize = blocksize;
  q.code = dynamic_map();
  const at::Tensor xb = pad_to_blocks(x, blocksize).view({-1, blocksize});  // zeros leave absmax alone
  q.absmax = xb.abs().amax(1);
  const at::Tensor scale = q.absmax.unsqueeze(1);
  const at::Tensor inv = at::where(scale > 0, scale.reciprocal(), at::zeros_like(scale));
  // As bnb: index = trunc(((v + 1) * 0.5) * 65535 + 0.5), each step rounded to float32.
  const at::Tensor v = at::clamp(xb * inv, -1, 1);
  const at::Tensor index = ((((v + 1) * 0.5) * 65535) + 0.5).to(at::kLong);
  const at::Tensor codes = quantize_lut(q.code).index_select(0, index.view(-1)).view_as(xb);
  q.codes = codes.masked_fill(scale == 0, 0).view(-1).narrow(0, 0, x.numel()).contiguous();
  return q;
}

at::Tensor nf4_levels(at::Device device) {
  static const std::vector<double> levels = {-1.0,
                                             -0.6961928009986877,
                                             -0.5250730514526367,
                                             -0.39491748809814453,
                                             -0.28444138169288635,
                                             -0.18477343022823334,
                                             -0.09105003625154495,
                                             0.0,
                                             0.07958029955625534,
                                             0.16093020141124725,
                                             0.24611230194568634,
                                             0.33791524171829224,
                                             0.44070982933044434,
                                             0.5626170039176941,
                                             0.7229568362236023,
                                             1.0};
  return at::tensor(levels, at::kDouble).to(device, at::kFloat);
}

int64_t Nf4Weight::numel() const {
  int64_t n = 1;
  for (const int64_t d : shape) n *= d;
  return n;
}

int64_t Nf4Weight::bytes() const {
  int64_t b = 0;
  for (const at::Tensor* t : {&packed, &absmax, &offset, &pairs, &absmax8.codes, &absmax8.absmax, &absmax8.code})
    if (t->defined()) b += static_cast<int64_t>(t->nbytes());
  return b;
}

at::Tensor Nf4Weight::block_absmax() const { return double_quant() ? absmax8.dequantize() + offset : absmax; }

at::Tensor Nf4Weight::dequantize() const {
  c10::NoGradGuard no_grad;
  const int64_t n = numel();
  const at::Tensor scales = block_absmax();
  at::Tensor out = at::empty({n}, packed.options().dtype(dtype));
  const int64_t chunk = packed.is_cuda() ? kChunk << 4 : kChunk;  // fewer kernel launches on a GPU
  for (int64_t start = 0; start < n; start += chunk) {
    const int64_t len = std::min(chunk, n - start);
    // One lookup per byte gives both of its levels: [bytes, 2] -> [2 * bytes] in element order.
    const at::Tensor bytes = packed.narrow(0, start / 2, (len + 1) / 2);
    const at::Tensor levels = pad_to_blocks(pairs.index_select(0, bytes.to(at::kInt)).view(-1), kBlock);
    const at::Tensor s = scales.narrow(0, start / kBlock, levels.numel() / kBlock).unsqueeze(1);
    out.narrow(0, start, len).copy_((levels.view({-1, kBlock}) * s).view(-1).narrow(0, 0, len));
  }
  return out.view(shape);
}

namespace {

// bnb's quantize_4bit (backends/default/ops.py) on whole blocks but the last, operation for
// operation: a float32 [m] -> packed codes [ceil(m/2)], absmax [ceil(m/64)].
std::pair<at::Tensor, at::Tensor> quantize_blocks(const at::Tensor& a, const at::Tensor& bounds) {
  const int64_t n = a.numel(), rem = n % Nf4Weight::kBlock, full = n - rem;
  const at::Tensor body = a.narrow(0, 0, full).view({-1, Nf4Weight::kBlock});
  at::Tensor absmax = body.abs().amax(1);
  at::Tensor scaled = at::clamp(body * absmax.clamp_min(1e-38).reciprocal().unsqueeze(1), -1, 1).view(-1);
  if (rem) {  // the short last block divides where the others multiply by the reciprocal
    const at::Tensor tail = a.narrow(0, full, rem);
    const at::Tensor am = tail.abs().max().clamp_min(1e-38);
    absmax = at::cat({absmax, am.unsqueeze(0)});
    scaled = at::cat({scaled, at::clamp(tail / am, -1, 1)});
  }
  if (n % 2) scaled = at::constant_pad_nd(scaled, {0, 1});  // the odd last nibble is the level of 0
  // Nearest level; a value on a midpoint takes the lower one.
  const at::Tensor idx = at::bucketize(scaled, bounds, /*out_int32=*/true).to(at::kByte);
  const at::Tensor packed =
      at::bitwise_or(at::bitwise_left_shift(idx.slice(0, 0, std::nullopt, 2), 4), idx.slice(0, 1, std::nullopt, 2));
  return {packed, absmax};
}

// The tensors quantising makes, on the meta device (shapes only: a memory estimate's model).
Nf4Weight shapes_of_nf4(Nf4Weight q, bool double_quant) {
  const auto meta = [](std::vector<int64_t> shape, at::ScalarType t) {
    return at::empty(shape, at::TensorOptions().dtype(t).device(at::kMeta));
  };
  const int64_t n = q.numel(), blocks = (n + Nf4Weight::kBlock - 1) / Nf4Weight::kBlock;
  q.packed = meta({(n + 1) / 2}, at::kByte);
  q.pairs = meta({256, 2}, at::kFloat);
  if (!double_quant) {
    q.absmax = meta({blocks}, at::kFloat);
    return q;
  }
  q.offset = meta({}, at::kFloat);
  q.absmax8 = {meta({blocks}, at::kByte), meta({(blocks + 255) / 256}, at::kFloat), meta({256}, at::kFloat), 256};
  return q;
}

}  // namespace

Nf4Weight quantize_nf4(const at::Tensor& w, bool double_quant) {
  const auto t = w.scalar_type();
  if (t != at::kFloat && t != at::kBFloat16 && t != at::kHalf)
    throw Error(fmt::format("NF4 quantisation needs float32, bf16 or fp16 weights, not {}", c10::toString(t)));
  c10::NoGradGuard no_grad;
  Nf4Weight q;
  q.shape = w.sizes().vec();
  q.dtype = t;
  if (w.is_meta()) return shapes_of_nf4(std::move(q), double_quant);
  const at::Tensor levels = nf4_levels(w.device());
  const at::Tensor bounds = (levels.narrow(0, 0, 15) + levels.narrow(0, 1, 15)) / 2;
  const at::Tensor flat = w.reshape(-1);
  const int64_t n = flat.numel();
  q.packed = at::empty({(n + 1) / 2}, w.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({(n + Nf4Weight::kBlock - 1) / Nf4Weight::kBlock}, w.options().dtype(at::kFloat));
  for (int64_t start = 0; start < n; start += kChunk) {
    const auto [codes, scales] =
        quantize_blocks(flat.narrow(0, start, std::min(kChunk, n - start)).to(at::kFloat), bounds);
    q.packed.narrow(0, start / 2, codes.numel()).copy_(codes);
    absmax.narrow(0, start / Nf4Weight::kBlock, scales.numel()).copy_(scales);
  }
  q.pairs = at::stack({levels.repeat_interleave(16), levels.repeat({16})}, 1);
  if (!double_quant) {
    q.absmax = absmax;
    return q;
  }
  // compress_statistics: the scales less their mean, 8-bit in blocks of 256 (on the CPU, as bnb).
  const at::Tensor am = absmax.cpu();
  const at::Tensor offset = am.mean();
  Blockwise8 b = quantize_blockwise8(am - offset, 256);
  q.offset = offset.to(w.device());
  q.absmax8 = {b.codes.to(w.device()), b.absmax.to(w.device()), b.code.to(w.device()), b.blocksize};
  return q;
}

at::Tensor nf4_linear(const at::Tensor& x, const Nf4Weight& w, const at::Tensor& bias) {
  return remade_weight_linear(x, bias, w.shape[0], [w] { return w.dequantize(); });
}

}  // namespace lorarun::model
