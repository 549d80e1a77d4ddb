#include "io/gguf.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <algorithm>
#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <optional>
#include <span>

#include "io/files.hpp"
#include "util/error.hpp"

// The layout is llama.cpp's gguf.h / docs/gguf.md: "GGUF", u32 version, u64 tensor count, u64
// key count, the keys (string, u32 type, value), the tensor infos (string, u32 n_dims, u64
// ne[n_dims], u32 ggml type, u64 offset), padding to general.alignment, the data section. Strings
// are u64 length + bytes; an array is u32 item type + u64 count + items. Everything little-endian.

namespace lorarun::io {
namespace {

constexpr uint32_t kMaxDims = 4;      // GGML_MAX_DIMS
constexpr size_t kMaxArrayDepth = 8;  // arrays of arrays: gguf-py writes at most 2 levels
constexpr uint64_t kMaxNumel = uint64_t{1} << 48;

struct TypeTraits {
  GgmlType type;
  const char* name;
  size_t block_size, block_bytes;
  bool dequantize;
};
// ggml's type_traits (block size, bytes per block), for every type a file may hold.
constexpr TypeTraits kTypes[] = {
    {GgmlType::F32, "F32", 1, 4, true},
    {GgmlType::F16, "F16", 1, 2, true},
    {GgmlType::Q4_0, "Q4_0", 32, 18, true},
    {GgmlType::Q4_1, "Q4_1", 32, 20, true},
    {GgmlType::Q5_0, "Q5_0", 32, 22, true},
    {GgmlType::Q5_1, "Q5_1", 32, 24, true},
    {GgmlType::Q8_0, "Q8_0", 32, 34, true},
    {GgmlType::Q8_1, "Q8_1", 32, 40, false},
    {GgmlType::Q2_K, "Q2_K", 256, 84, true},
    {GgmlType::Q3_K, "Q3_K", 256, 110, true},
    {GgmlType::Q4_K, "Q4_K", 256, 144, true},
    {GgmlType::Q5_K, "Q5_K", 256, 176, true},
    {GgmlType::Q6_K, "Q6_K", 256, 210, true},
    {GgmlType::Q8_K, "Q8_K", 256, 292, false},
    {GgmlType::IQ2_XXS, "IQ2_XXS", 256, 66, false},
    {GgmlType::IQ2_XS, "IQ2_XS", 256, 74, false},
    {GgmlType::IQ3_XXS, "IQ3_XXS", 256, 98, false},
    {GgmlType::IQ1_S, "IQ1_S", 256, 50, false},
    {GgmlType::IQ4_NL, "IQ4_NL", 32, 18, false},
    {GgmlType::IQ3_S, "IQ3_S", 256, 110, false},
    {GgmlType::IQ2_S, "IQ2_S", 256, 82, false},
    {GgmlType::IQ4_XS, "IQ4_XS", 256, 136, false},
    {GgmlType::I8, "I8", 1, 1, false},
    {GgmlType::I16, "I16", 1, 2, false},
    {GgmlType::I32, "I32", 1, 4, false},
    {GgmlType::I64, "I64", 1, 8, false},
    {GgmlType::F64, "F64", 1, 8, false},
    {GgmlType::IQ1_M, "IQ1_M", 256, 56, false},
    {GgmlType::BF16, "BF16", 1, 2, true},
    {GgmlType::TQ1_0, "TQ1_0", 256, 54, false},
    {GgmlType::TQ2_0, "TQ2_0", 256, 66, false},
    {GgmlType::MXFP4, "MXFP4", 32, 17, false},
};

const TypeTraits* traits(uint32_t id) {
  for (const auto& t : kTypes)
    if (static_cast<uint32_t>(t.type) == id) return &t;
  return nullptr;
}

const TypeTraits& traits(GgmlType t) {
  const TypeTraits* tr = traits(static_cast<uint32_t>(t));
  if (!tr) throw Error(fmt::format("ggml type {} is unknown", static_cast<uint32_t>(t)));
  return *tr;
}

std::string dequantizable_names() {
  std::string s;
  for (const auto& t : kTypes)
    if (t.dequantize) s += (s.empty() ? "" : ", ") + std::string(t.name);
  return s;
}

constexpr const char* kValueTypeNames[] = {"UINT8", "INT8",   "UINT16", "INT16",  "UINT32", "INT32",  "FLOAT32",
                                           "BOOL",  "STRING", "ARRAY",  "UINT64", "INT64",  "FLOAT64"};

// The smallest number of bytes a value of type `t` takes in the file: what bounds an array's
// count before anything is allocated for it.
size_t min_value_bytes(GgufType t) {
  switch (t) {
    case GgufType::U8:
    case GgufType::I8:
    case GgufType::Bool:
      return 1;
    case GgufType::U16:
    case GgufType::I16:
      return 2;
    case GgufType::U32:
    case GgufType::I32:
    case GgufType::F32:
      return 4;
    case GgufType::U64:
    case GgufType::I64:
    case GgufType::F64:
    case GgufType::String:
      return 8;
    case GgufType::Array:
      return 12;
  }
  return 1;
}

// Reads the header area with a bounds check before every read. Errors say what was being read
// and where, e.g. "key 'tokenizer.ggml.tokens': array count 2^60 needs more than the 812 bytes left".
class Cursor {
 public:
  Cursor(const std::byte* p, size_t size, const std::string& path) : p_(p), size_(size), path_(path) {}

  size_t pos() const { return pos_; }
  size_t left() const { return size_ - pos_; }

  Error corrupt(const std::string& what) const {
    return Error(
        fmt::format("{} is not a valid GGUF file: {}; the file is truncated or corrupt, "
                    "re-download or re-convert it",
                    path_, what));
  }
  void need(size_t n, const std::string& what) const {
    if (n > left())
      throw corrupt(fmt::format("{} at byte {} runs past the end of the {}-byte file", what, pos_, size_));
  }
  template <typename T>
  T read(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));  // little-endian on every platform we build for
    pos_ += sizeof(T);
    return v;
  }
  std::string string(const std::string& what) {
    const uint64_t n = read<uint64_t>(what + " (length)");
    if (n > left())
      throw corrupt(fmt::format("{} has length {} but only {} bytes are left at byte {}", what, n, left(), pos_));
    std::string s(reinterpret_cast<const char*>(p_ + pos_), n);
    pos_ += n;
    return s;
  }

 private:
  const std::byte* p_;
  size_t size_;
  size_t pos_ = 0;
  const std::string& path_;
};

GgufType value_type(Cursor& c, const std::string& what) {
  const uint32_t t = c.read<uint32_t>(what + " (type)");
  if (t > static_cast<uint32_t>(GgufType::F64)) throw c.corrupt(fmt::format("{} has unknown value type {}", what, t));
  return static_cast<GgufType>(t);
}

GgufValue read_value(Cursor& c, GgufType type, const std::string& what, size_t depth);

template <typename Item>
std::vector<Item> read_items(Cursor& c, uint64_t n, GgufType item, const std::string& what, size_t depth) {
  std::vector<Item> v;
  v.reserve(n);  // bounded by the caller: n * min_value_bytes(item) <= bytes left
  for (uint64_t i = 0; i < n; ++i) {
    GgufValue x = read_value(c, item, what, depth + 1);
    if constexpr (std::is_same_v<Item, GgufValue>)
      v.push_back(std::move(x));
    else
      v.push_back(std::get<Item>(std::move(x.data)));
  }
  return v;
}

GgufValue read_array(Cursor& c, const std::string& what, size_t depth) {
  if (depth >= kMaxArrayDepth) throw c.corrupt(fmt::format("{} nests arrays deeper than {}", what, kMaxArrayDepth));
  GgufValue v;
  v.type = GgufType::Array;
  v.item_type = value_type(c, what + " (array item type)");
  const uint64_t n = c.read<uint64_t>(what + " (array count)");
  if (n > c.left() / min_value_bytes(v.item_type))
    throw c.corrupt(fmt::format("{} is an array of {} {} items, more than the {} bytes left at byte {} can hold", what,
                                n, gguf_type_name(v.item_type), c.left(), c.pos()));
  switch (v.item_type) {
    case GgufType::U8:
    case GgufType::U16:
    case GgufType::U32:
    case GgufType::U64:
    case GgufType::Bool:
      v.data = read_items<uint64_t>(c, n, v.item_type, what, depth);
      break;
    case GgufType::I8:
    case GgufType::I16:
    case GgufType::I32:
    case GgufType::I64:
      v.data = read_items<int64_t>(c, n, v.item_type, what, depth);
      break;
    case GgufType::F32:
    case GgufType::F64:
      v.data = read_items<double>(c, n, v.item_type, what, depth);
      break;
    case GgufType::String:
      v.data = read_items<std::string>(c, n, v.item_type, what, depth);
      break;
    case GgufType::Array:
      v.data = read_items<GgufValue>(c, n, v.item_type, what, depth);
      break;
  }
  return v;
}

GgufValue read_value(Cursor& c, GgufType type, const std::string& what, size_t depth) {
  GgufValue v;
  v.type = type;
  switch (type) {
    case GgufType::U8:
      v.data = uint64_t{c.read<uint8_t>(what)};
      break;
    case GgufType::I8:
      v.data = int64_t{c.read<int8_t>(what)};
      break;
    case GgufType::U16:
      v.data = uint64_t{c.read<uint16_t>(what)};
      break;
    case GgufType::I16:
      v.data = int64_t{c.read<int16_t>(what)};
      break;
    case GgufType::U32:
      v.data = uint64_t{c.read<uint32_t>(what)};
      break;
    case GgufType::I32:
      v.data = int64_t{c.read<int32_t>(what)};
      break;
    case GgufType::U64:
      v.data = c.read<uint64_t>(what);
      break;
    case GgufType::I64:
      v.data = c.read<int64_t>(what);
      break;
    case GgufType::F32:
      v.data = double{c.read<float>(what)};
      break;
    case GgufType::F64:
      v.data = c.read<double>(what);
      break;
    case GgufType::Bool: {
      // Any non-zero byte is true, as llama.cpp and gguf-py read it.
      v.data = uint64_t{c.read<uint8_t>(what) != 0};
      break;
    }
    case GgufType::String:
      v.data = c.string(what);
      break;
    case GgufType::Array:
      return read_array(c, what, depth);
  }
  return v;
}

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

const char* ggml_type_name(GgmlType t) {
  const TypeTraits* tr = traits(static_cast<uint32_t>(t));
  return tr ? tr->name : "?";
}
size_t ggml_block_size(GgmlType t) { return traits(t).block_size; }
size_t ggml_block_bytes(GgmlType t) { return traits(t).block_bytes; }
bool can_dequantize(GgmlType t) {
  const TypeTraits* tr = traits(static_cast<uint32_t>(t));
  return tr && tr->dequantize;
}

const char* gguf_type_name(GgufType t) {
  const auto i = static_cast<size_t>(t);
  return i < std::size(kValueTypeNames) ? kValueTypeNames[i] : "?";
}

size_t GgufValue::size() const {
  if (type != GgufType::Array) return 1;
  return std::visit(
      [](const auto& x) -> size_t {
        if constexpr (requires { x.size(); } && !std::is_same_v<std::decay_t<decltype(x)>, std::string>)
          return x.size();
        else
          return 1;
      },
      data);
}

int64_t GgufTensorInfo::numel() const {
  int64_t n = 1;
  for (int64_t d : dims) n *= d;
  return n;
}

std::vector<int64_t> GgufTensorInfo::torch_shape() const { return {dims.rbegin(), dims.rend()}; }

GgufFile::GgufFile(const std::string& path)
    : path_(path), file_(path, MappedFile::Access::ReadOnly), map_(file_.data()), size_(file_.size()) {
  if (size_ == 0)
    throw Error(fmt::format("{} is not a valid GGUF file: it is empty; re-download or re-convert it", path));
  Cursor c(map_, size_, path_);
  c.need(4, "the magic number");
  if (std::memcmp(map_, "GGUF", 4) != 0)
    throw Error(
        fmt::format("{} is not a GGUF file (it does not start with \"GGUF\"); give a .gguf "
                    "model file or a Hugging Face model directory",
                    path));
  c.read<uint32_t>("the magic number");
  version_ = c.read<uint32_t>("the version");
  if (version_ == 1)
    throw Error(
        fmt::format("{} is GGUF version 1, which lorarun does not read (versions 2 and 3); "
                    "re-convert it with a current llama.cpp",
                    path));
  if ((version_ & 0xffff) == 0 && version_ != 0)
    throw Error(
        fmt::format("{} is a big-endian GGUF file, which lorarun does not read; convert it "
                    "to little-endian (llama.cpp's gguf_convert_endian.py)",
                    path));
  if (version_ != 2 && version_ != 3)
    throw Error(fmt::format("{} is GGUF version {}, which lorarun does not read (versions 2 and 3)", path, version_));
  const uint64_t n_tensors = c.read<uint64_t>("the tensor count");
  const uint64_t n_keys = c.read<uint64_t>("the metadata key count");
  // The smallest key is 13 bytes (empty name, type, one byte); the smallest tensor info 24.
  if (n_keys > c.left() / 13)
    throw c.corrupt(fmt::format("{} metadata keys cannot fit in the {}-byte file", n_keys, size_));
  if (n_tensors > c.left() / 24)
    throw c.corrupt(fmt::format("{} tensors cannot fit in the {}-byte file", n_tensors, size_));

  metadata_.reserve(n_keys);
  for (uint64_t i = 0; i < n_keys; ++i) {
    std::string key = c.string(fmt::format("metadata key {}", i));
    const std::string what = fmt::format("key '{}'", key);
    if (key_index_.count(key)) throw c.corrupt(fmt::format("{} appears twice", what));
    GgufValue v = read_value(c, value_type(c, what), what, 0);
    key_index_[key] = metadata_.size();
    metadata_.emplace_back(std::move(key), std::move(v));
  }
  if (const GgufValue* a = find_key("general.alignment")) {
    if (a->type != GgufType::U32)
      throw c.corrupt(fmt::format("general.alignment is {}, not UINT32", gguf_type_name(a->type)));
    alignment_ = std::get<uint64_t>(a->data);
    if (alignment_ == 0 || (alignment_ & (alignment_ - 1)) != 0)
      throw c.corrupt(fmt::format("general.alignment {} is not a power of two", alignment_));
  }

  tensors_.reserve(n_tensors);
  for (uint64_t i = 0; i < n_tensors; ++i) {
    GgufTensorInfo t;
    t.name = c.string(fmt::format("tensor name {}", i));
    const std::string what = fmt::format("tensor '{}'", t.name);
    if (tensor_index_.count(t.name)) throw c.corrupt(fmt::format("{} appears twice", what));
    const uint32_t n_dims = c.read<uint32_t>(what + " (dimension count)");
    if (n_dims > kMaxDims) throw c.corrupt(fmt::format("{} has {} dimensions (at most {})", what, n_dims, kMaxDims));
    uint64_t numel = 1;
    for (uint32_t d = 0; d < n_dims; ++d) {
      const uint64_t n = c.read<uint64_t>(what + " (dimensions)");
      // Each dimension too, not only the product: a zero elsewhere must not hide one that
      // does not fit the int64 of a tensor shape.
      if (n > kMaxNumel || (n != 0 && numel > kMaxNumel / n))
        throw c.corrupt(fmt::format("{} is too large (dimension {} is {})", what, d, n));
      numel *= n;
      t.dims.push_back(static_cast<int64_t>(n));
    }
    const uint32_t type = c.read<uint32_t>(what + " (type)");
    const TypeTraits* tr = traits(type);
    if (!tr) throw c.corrupt(fmt::format("{} has unknown ggml type {}", what, type));
    t.type = tr->type;
    const uint64_t row = t.dims.empty() ? 1 : t.dims[0];
    if (row % tr->block_size != 0)
      throw c.corrupt(
          fmt::format("{} of type {} has rows of {} elements, not a multiple of its "
                      "block size {}",
                      what, tr->name, row, tr->block_size));
    t.nbytes = numel / tr->block_size * tr->block_bytes;
    t.offset = c.read<uint64_t>(what + " (offset)");
    tensor_index_[t.name] = tensors_.size();
    tensors_.push_back(std::move(t));
  }

  // The data section starts at the next multiple of the alignment; each tensor lies inside it.
  const size_t pos = c.pos();
  data_offset_ = pos + (alignment_ - pos % alignment_) % alignment_;
  if (data_offset_ > size_) {
    if (!tensors_.empty())
      throw c.corrupt(
          fmt::format("the data section would start at byte {}, past the end of the "
                      "{}-byte file",
                      data_offset_, size_));
    data_offset_ = size_;
  }
  const size_t data_size = size_ - data_offset_;
  for (const GgufTensorInfo& t : tensors_) {
    if (t.offset % alignment_ != 0)
      throw c.corrupt(
          fmt::format("tensor '{}' has offset {}, not a multiple of the alignment {}", t.name, t.offset, alignment_));
    if (t.offset > data_size || t.nbytes > data_size - t.offset)
      throw c.corrupt(
          fmt::format("tensor '{}' data ({} bytes at offset {}) is outside the {}-byte "
                      "data section",
                      t.name, t.nbytes, t.offset, data_size));
  }
  std::vector<const GgufTensorInfo*> by_offset;
  for (const auto& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->offset < by_offset[i - 1]->offset + by_offset[i - 1]->nbytes)
      throw c.corrupt(fmt::format("tensors '{}' and '{}' overlap", by_offset[i - 1]->name, by_offset[i]->name));
}

GgufFile::~GgufFile() = default;

const GgufValue* GgufFile::find_key(const std::string& key) const {
  const auto it = key_index_.find(key);
  return it == key_index_.end() ? nullptr : &metadata_[it->second].second;
}

const GgufValue& GgufFile::typed(const std::string& key, std::initializer_list<GgufType> types,
                                 const char* want) const {
  const GgufValue* v = find_key(key);
  if (!v)
    throw Error(
        fmt::format("{} has no metadata key '{}' (wanted {}): the file is not a "
                    "complete model for this architecture",
                    path_, key, want));
  const bool array = std::string_view(want).starts_with("an array");
  const GgufType t = array ? v->item_type : v->type;
  if ((!array || v->type == GgufType::Array) && std::find(types.begin(), types.end(), t) != types.end()) return *v;
  const std::string has = v->type == GgufType::Array ? fmt::format("an array of {}", gguf_type_name(v->item_type))
                                                     : gguf_type_name(v->type);
  throw Error(fmt::format("{}: metadata key '{}' is {}, not {}", path_, key, has, want));
}

namespace {
constexpr std::initializer_list<GgufType> kInts = {GgufType::U8,  GgufType::I8,  GgufType::U16, GgufType::I16,
                                                   GgufType::U32, GgufType::I32, GgufType::U64, GgufType::I64};
}

std::string GgufFile::get_string(const std::string& key) const {
  return std::get<std::string>(typed(key, {GgufType::String}, "a string").data);
}
std::string GgufFile::get_string(const std::string& key, const std::string& fallback) const {
  return has(key) ? get_string(key) : fallback;
}

int64_t GgufFile::get_int(const std::string& key) const {
  const GgufValue& v = typed(key, kInts, "an integer");
  if (const auto* i = std::get_if<int64_t>(&v.data)) return *i;
  const uint64_t u = std::get<uint64_t>(v.data);
  if (u > static_cast<uint64_t>(INT64_MAX))
    throw Error(fmt::format("{}: metadata key '{}' is {}, too large", path_, key, u));
  return static_cast<int64_t>(u);
}
int64_t GgufFile::get_int(const std::string& key, int64_t fallback) const { return has(key) ? get_int(key) : fallback; }

double GgufFile::get_float(const std::string& key) const {
  return std::get<double>(typed(key, {GgufType::F32, GgufType::F64}, "a float").data);
}
double GgufFile::get_float(const std::string& key, double fallback) const {
  return has(key) ? get_float(key) : fallback;
}

bool GgufFile::get_bool(const std::string& key) const {
  return std::get<uint64_t>(typed(key, {GgufType::Bool}, "a bool").data) != 0;
}
bool GgufFile::get_bool(const std::string& key, bool fallback) const { return has(key) ? get_bool(key) : fallback; }

const std::vector<std::string>& GgufFile::get_strings(const std::string& key) const {
  return std::get<std::vector<std::string>>(typed(key, {GgufType::String}, "an array of strings").data);
}

std::vector<int64_t> GgufFile::get_ints(const std::string& key) const {
  const GgufValue& v = typed(key, kInts, "an array of integers");
  if (const auto* i = std::get_if<std::vector<int64_t>>(&v.data)) return *i;
  std::vector<int64_t> out;
  for (uint64_t u : std::get<std::vector<uint64_t>>(v.data)) {
    if (u > static_cast<uint64_t>(INT64_MAX))
      throw Error(fmt::format("{}: metadata key '{}' holds {}, too large", path_, key, u));
    out.push_back(static_cast<int64_t>(u));
  }
  return out;
}

const std::vector<double>& GgufFile::get_floats(const std::string& key) const {
  return std::get<std::vector<double>>(typed(key, {GgufType::F32, GgufType::F64}, "an array of floats").data);
}

const GgufTensorInfo* GgufFile::find(const std::string& name) const {
  const auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const std::byte> GgufFile::bytes(const GgufTensorInfo& t) const {
  return {map_ + data_offset_ + t.offset, t.nbytes};
}

void GgufFile::release(const GgufTensorInfo& t) const { drop_pages(map_ + data_offset_ + t.offset, t.nbytes); }

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
