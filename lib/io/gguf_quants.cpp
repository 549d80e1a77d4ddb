// ggml's block types dequantised to float32, value for value as gguf-py's gguf.quants does, and the
// check that a tensor would dequantise to finite values.
#include <fmt/format.h>
#include <array>
#include <bit>
#include <cstring>
#include <optional>
#include <span>

#include "io/ggml_types.hpp"
#include "io/gguf.hpp"
#include "util/error.hpp"

namespace lorarun::io {

using detail::dequantizable_names;
using detail::traits;
using detail::TypeTraits;

namespace {

// ggml's fp16 -> fp32, exact for every finite value (subnormals included); NaN keeps its payload
// and sign (as numpy converts, so that dequantised values match gguf-py's bit for bit).
float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else if (mant == 0) {
    bits = sign;
  } else {  // subnormal: normalise the mantissa
    int e = -1;
    uint32_t m = mant;
    do {
      m <<= 1;
      ++e;
    } while (!(m & 0x400u));
    bits = sign | ((112 - e) << 23) | ((m & 0x3ffu) << 13);
  }
  return std::bit_cast<float>(bits);
}

[[gnu::always_inline]] inline uint16_t u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, 2);
  return v;
}
[[gnu::always_inline]] inline float f16(const std::byte* p) { return half_to_float(u16(p)); }
[[gnu::always_inline]] inline const uint8_t* bytes_of(const std::byte* p) {
  return reinterpret_cast<const uint8_t*>(p);
}

// The blocks below follow gguf-py's quants.py (and ggml-quants.c) operation for operation: each
// value is one float32 product (plus one float32 add or subtract) of the same operands, so the
// results are identical. This file is compiled with -ffp-contract=off: a fused multiply-add would
// round once where numpy rounds twice. The inner loops run over runs of 16 or 32 contiguous
// values of one scale, so that the compiler vectorises them; inlined into the loop over blocks,
// except Q4_0 and Q4_1, which GCC vectorises better on their own (bench/model_load/dequant_bench:
// 1.3-1.4x the values/s of the two inlined).

// Q4_0: d, 16 bytes of nibbles; element j < 16 is the low nibble of byte j, j + 16 the high one.
[[gnu::noinline]] void block_q4_0(const std::byte* b, float* y) {
  const float d = f16(b);
  const uint8_t* q = bytes_of(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>((q[j] & 0xf) - 8);
    y[j + 16] = d * static_cast<float>((q[j] >> 4) - 8);
  }
}

// Q4_1: d, m, 16 bytes of nibbles; y = d * q + m.
[[gnu::noinline]] void block_q4_1(const std::byte* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  const uint8_t* q = bytes_of(b + 4);
  for (int j = 0; j < 16; ++j) {
    y[j] = d * static_cast<float>(q[j] & 0xf) + m;
    y[j + 16] = d * static_cast<float>(q[j] >> 4) + m;
  }
}

// Q5_0: d, 32 high bits (bit j is element j's fifth bit), 16 bytes of nibbles; q - 16.
[[gnu::always_inline]] inline void block_q5_0(const std::byte* b, float* y) {
  const float d = f16(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, 4);
  const uint8_t* q = bytes_of(b + 6);
  // int: q - 16 may be negative
  for (int j = 0; j < 16; ++j)
    y[j] = d * static_cast<float>(static_cast<int>((q[j] & 0xf) | (((qh >> j) & 1) << 4)) - 16);
  for (int j = 0; j < 16; ++j)
    y[j + 16] = d * static_cast<float>(static_cast<int>((q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - 16);
}

// Q5_1: d, m, 32 high bits, 16 bytes of nibbles; y = d * q + m.
[[gnu::always_inline]] inline void block_q5_1(const std::byte* b, float* y) {
  const float d = f16(b), m = f16(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, 4);
  const uint8_t* q = bytes_of(b + 8);
  for (int j = 0; j < 16; ++j)
    y[j] = d * static_cast<float>(static_cast<int>((q[j] & 0xf) | (((qh >> j) & 1) << 4))) + m;
  for (int j = 0; j < 16; ++j)
    y[j + 16] = d * static_cast<float>(static_cast<int>((q[j] >> 4) | (((qh >> (j + 16)) & 1) << 4))) + m;
}

// Q8_0: d, 32 int8.
[[gnu::always_inline]] inline void block_q8_0(const std::byte* b, float* y) {
  const float d = f16(b);
  const auto* q = reinterpret_cast<const int8_t*>(b + 2);
  for (int j = 0; j < 32; ++j) y[j] = static_cast<float>(q[j]) * d;
}

// The 2-bit layout of Q2_K and Q3_K: element e = 128 n + 32 s + l (l < 32) is the 2 bits at shift
// 2 s of byte 32 n + l; its scale is group e / 16 = 8 n + 2 s + l / 16.

// Q2_K (256 elements): 16 bytes of 4-bit scale and min, 64 bytes of 2-bit quants, d, dmin.
[[gnu::always_inline]] inline void block_q2_k(const std::byte* b, float* y) {
  const uint8_t *scales = bytes_of(b), *qs = bytes_of(b + 16);
  const float d = f16(b + 80), dmin = f16(b + 82);
  for (int n = 0; n < 2; ++n)
    for (int s = 0; s < 4; ++s)
      for (int half = 0; half < 2; ++half) {
        const int g = 8 * n + 2 * s + half;
        const float dl = d * static_cast<float>(scales[g] & 0xf), ml = dmin * static_cast<float>(scales[g] >> 4);
        const uint8_t* q = qs + 32 * n + 16 * half;
        for (int i = 0; i < 16; ++i) y[16 * g + i] = dl * static_cast<float>((q[i] >> (2 * s)) & 3) - ml;
      }
}

// Q3_K (256 elements): 32 bytes of high bits (bit e / 32 of byte e % 32), 64 bytes of 2-bit quants,
// 12 bytes of 6-bit signed scales, d. The high bit is set when the value is *not* offset by -4.
[[gnu::always_inline]] inline void block_q3_k(const std::byte* b, float* y) {
  const uint8_t *hmask = bytes_of(b), *qs = bytes_of(b + 32), *sc = bytes_of(b + 96);
  const float d = f16(b + 108);
  for (int n = 0; n < 2; ++n)
    for (int s = 0; s < 4; ++s)
      for (int half = 0; half < 2; ++half) {
        const int g = 8 * n + 2 * s + half;
        const uint8_t lo = g < 8 ? (sc[g] & 0xf) : (sc[g - 8] >> 4);
        const uint8_t hi = (sc[8 + g % 4] >> (2 * (g / 4))) & 3;
        const float dl = d * static_cast<float>(static_cast<int8_t>(lo | (hi << 4)) - 32);
        const uint8_t *q = qs + 32 * n + 16 * half, *h = hmask + 16 * half;
        for (int i = 0; i < 16; ++i) {
          const int ql = (q[i] >> (2 * s)) & 3, high = (h[i] >> (4 * n + s)) & 1;
          y[16 * g + i] = dl * static_cast<float>(ql - ((high ^ 1) << 2));
        }
      }
}

// Q4_K / Q5_K: 8 groups of 32 with 6-bit scales and mins packed in 12 bytes (get_scale_min).
[[gnu::always_inline]] inline void scale_min_k4(const uint8_t* s, int j, uint8_t& sc, uint8_t& m) {
  if (j < 4) {
    sc = s[j] & 63;
    m = s[j + 4] & 63;
  } else {
    sc = (s[j + 4] & 0xf) | ((s[j - 4] >> 6) << 4);
    m = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
  }
}

// Q4_K (256 elements): d, dmin, 12 bytes of scales, 128 bytes of nibbles; group j = 2c + s takes
// nibble s of bytes c * 32 .. c * 32 + 31.
[[gnu::always_inline]] inline void block_q4_k(const std::byte* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t *scales = bytes_of(b + 4), *qs = bytes_of(b + 16);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(scales, j, sc, m);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
    const uint8_t* q = qs + (j / 2) * 32;
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l) y[j * 32 + l] = dl * static_cast<float>((q[l] >> shift) & 0xf) - ml;
  }
}

// Q5_K (256 elements): as Q4_K with 32 bytes of fifth bits (bit j of byte l for group j) before
// the nibbles.
[[gnu::always_inline]] inline void block_q5_k(const std::byte* b, float* y) {
  const float d = f16(b), dmin = f16(b + 2);
  const uint8_t *scales = bytes_of(b + 4), *qh = bytes_of(b + 16), *qs = bytes_of(b + 48);
  for (int j = 0; j < 8; ++j) {
    uint8_t sc, m;
    scale_min_k4(scales, j, sc, m);
    const float dl = d * static_cast<float>(sc), ml = dmin * static_cast<float>(m);
    const uint8_t* q = qs + (j / 2) * 32;
    const int shift = 4 * (j % 2);
    for (int l = 0; l < 32; ++l)
      y[j * 32 + l] = dl * static_cast<float>(((q[l] >> shift) & 0xf) | (((qh[l] >> j) & 1) << 4)) - ml;
  }
}

// Q6_K (256 elements): 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 int8 scales, d.
// Element e = 128 h + 32 s + l (l < 32): nibble s / 2 of ql[64 h + 32 (s % 2) + l], 2 bits at
// shift 2 s of qh[32 h + l]; q - 32, scale e / 16 = 8 h + 2 s + l / 16.
[[gnu::always_inline]] inline void block_q6_k(const std::byte* b, float* y) {
  const uint8_t *ql = bytes_of(b), *qh = bytes_of(b + 128);
  const auto* scales = reinterpret_cast<const int8_t*>(b + 192);
  const float d = f16(b + 208);
  for (int h = 0; h < 2; ++h)
    for (int s = 0; s < 4; ++s)
      for (int half = 0; half < 2; ++half) {
        const int g = 8 * h + 2 * s + half;
        const float dl = d * static_cast<float>(scales[g]);
        const uint8_t *lo = ql + 64 * h + 32 * (s % 2) + 16 * half, *hi = qh + 32 * h + 16 * half;
        for (int i = 0; i < 16; ++i) {
          const int q = ((lo[i] >> (4 * (s / 2))) & 0xf) | (((hi[i] >> (2 * s)) & 3) << 4);
          y[16 * g + i] = dl * static_cast<float>(q - 32);
        }
      }
}

// `n` values (whole blocks) of type `tr` from `p` into `y`.
void dequantize_values(const TypeTraits& tr, const std::byte* p, size_t n, float* y) {
  const size_t blocks = n / tr.block_size, bb = tr.block_bytes, bs = tr.block_size;
  switch (tr.type) {
    case GgmlType::F32:
      std::memcpy(y, p, n * 4);
      return;
    case GgmlType::F16:
      for (size_t i = 0; i < n; ++i) y[i] = f16(p + 2 * i);
      return;
    case GgmlType::BF16:
      for (size_t i = 0; i < n; ++i) y[i] = std::bit_cast<float>(uint32_t{u16(p + 2 * i)} << 16);
      return;
    case GgmlType::Q4_0:
      for (size_t i = 0; i < blocks; ++i) block_q4_0(p + i * bb, y + i * bs);
      return;
    case GgmlType::Q4_1:
      for (size_t i = 0; i < blocks; ++i) block_q4_1(p + i * bb, y + i * bs);
      return;
    case GgmlType::Q5_0:
      for (size_t i = 0; i < blocks; ++i) block_q5_0(p + i * bb, y + i * bs);
      return;
    case GgmlType::Q5_1:
      for (size_t i = 0; i < blocks; ++i) block_q5_1(p + i * bb, y + i * bs);
      return;
    case GgmlType::Q8_0:
      for (size_t i = 0; i < blocks; ++i) block_q8_0(p + i * bb, y + i * bs);
      return;
    case GgmlType::Q2_K:
      for (size_t i = 0; i < blocks; ++i) block_q2_k(p + i * bb, y + i * bs);
      return;
    case GgmlType::Q3_K:
      for (size_t i = 0; i < blocks; ++i) block_q3_k(p + i * bb, y + i * bs);
      return;
    case GgmlType::Q4_K:
      for (size_t i = 0; i < blocks; ++i) block_q4_k(p + i * bb, y + i * bs);
      return;
    case GgmlType::Q5_K:
      for (size_t i = 0; i < blocks; ++i) block_q5_k(p + i * bb, y + i * bs);
      return;
    case GgmlType::Q6_K:
      for (size_t i = 0; i < blocks; ++i) block_q6_k(p + i * bb, y + i * bs);
      return;
    default:
      return;  // (dequantize() lets through only the types above)
  }
}

}  // namespace

void dequantize(GgmlType type, std::span<const std::byte> in, std::span<float> out) {
  const TypeTraits* tr = traits(static_cast<uint32_t>(type));
  if (!tr || !tr->dequantize)
    throw Error(
        fmt::format("ggml type {} cannot be dequantised (supported: {})", ggml_type_name(type), dequantizable_names()));
  if (in.size() % tr->block_bytes != 0 || in.size() / tr->block_bytes * tr->block_size != out.size())
    throw Error(fmt::format("dequantising {}: {} bytes do not make {} values", tr->name, in.size(), out.size()));
  dequantize_values(*tr, in.data(), out.size(), out.data());
}

namespace {

// Where a block of `type` holds its float16 scales (d, and dmin or m where it has one): -1 none.
std::array<int, 2> scale_offsets(GgmlType type) {
  switch (type) {
    case GgmlType::Q4_0:
    case GgmlType::Q5_0:
    case GgmlType::Q8_0:
      return {0, -1};
    case GgmlType::Q4_1:
    case GgmlType::Q5_1:
    case GgmlType::Q4_K:
    case GgmlType::Q5_K:
      return {0, 2};
    case GgmlType::Q2_K:
      return {80, 82};
    case GgmlType::Q3_K:
      return {108, -1};
    case GgmlType::Q6_K:
      return {208, -1};
    default:
      return {-1, -1};
  }
}

bool f16_finite(uint16_t h) { return (h & 0x7c00) != 0x7c00; }

// The index of the first value (F32, F16, BF16) or block (the block types) that is not finite.
std::optional<size_t> first_not_finite(GgmlType type, std::span<const std::byte> in, size_t block_bytes) {
  const std::byte* p = in.data();
  switch (type) {
    case GgmlType::F32:
      for (size_t i = 0; i < in.size() / 4; ++i) {
        uint32_t u;
        std::memcpy(&u, p + 4 * i, 4);
        if ((u & 0x7f800000u) == 0x7f800000u) return i;
      }
      return std::nullopt;
    case GgmlType::F16:
      for (size_t i = 0; i < in.size() / 2; ++i)
        if (!f16_finite(u16(p + 2 * i))) return i;
      return std::nullopt;
    case GgmlType::BF16:
      for (size_t i = 0; i < in.size() / 2; ++i)
        if ((u16(p + 2 * i) & 0x7f80) == 0x7f80) return i;
      return std::nullopt;
    default:
      break;
  }
  const std::array<int, 2> at = scale_offsets(type);
  for (size_t b = 0; at[0] >= 0 && b < in.size() / block_bytes; ++b)
    for (const int o : at)
      if (o >= 0 && !f16_finite(u16(p + b * block_bytes + static_cast<size_t>(o)))) return b;
  return std::nullopt;
}

}  // namespace

void check_finite(const GgufFile& file, const GgufTensorInfo& t) {
  if (!can_dequantize(t.type)) return;
  const TypeTraits& tr = traits(t.type);
  const std::optional<size_t> bad = first_not_finite(t.type, file.bytes(t), tr.block_bytes);
  if (!bad) return;
  throw ConfigError(fmt::format(
      "{}: tensor '{}' ({}) holds {} that is NaN or infinite: the file is damaged; download or convert it again",
      file.path(), t.name, tr.name,
      tr.block_size == 1 ? fmt::format("value {}", *bad) : fmt::format("block {} with a scale", *bad)));
}

void dequantize(const GgufFile& file, const GgufTensorInfo& t, std::span<float> out) {
  if (!can_dequantize(t.type))
    throw Error(
        fmt::format("{}: tensor '{}' has type {}, which lorarun cannot dequantise (supported: "
                    "{}); convert the model with one of those",
                    file.path(), t.name, ggml_type_name(t.type), dequantizable_names()));
  if (out.size() != static_cast<size_t>(t.numel()))
    throw Error(fmt::format("{}: tensor '{}' has {} values, not {}", file.path(), t.name, t.numel(), out.size()));
  dequantize(t.type, file.bytes(t), out);
}

}  // namespace lorarun::io
