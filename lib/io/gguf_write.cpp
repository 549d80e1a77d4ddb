#include "io/gguf_write.hpp"

#include <fmt/format.h>
#include <bit>
#include <cmath>
#include <cstring>

#include "io/files.hpp"
#include "util/error.hpp"

namespace lorarun::io {
namespace {

constexpr uint32_t kVersion = 3;
size_t pad(size_t n, size_t alignment) { return (n + alignment - 1) / alignment * alignment; }

// Little-endian serialisation of the header area into one buffer.
class Bytes {
 public:
  template <typename T>
  void put(T v) {
    const size_t at = buf_.size();
    buf_.resize(at + sizeof(T));
    std::memcpy(buf_.data() + at, &v, sizeof(T));
  }
  void str(const std::string& s) {
    put<uint64_t>(s.size());
    buf_.append(s);
  }
  void zeros(size_t n) { buf_.append(n, '\0'); }
  const std::string& data() const { return buf_; }

 private:
  std::string buf_;
};

// One scalar of type `t` held as `x` (GgufValue's widened form).
template <typename X>
void put_scalar(Bytes& b, GgufType t, X x) {
  switch (t) {
    case GgufType::U8:
    case GgufType::Bool:
      return b.put(static_cast<uint8_t>(x));
    case GgufType::I8:
      return b.put(static_cast<int8_t>(x));
    case GgufType::U16:
      return b.put(static_cast<uint16_t>(x));
    case GgufType::I16:
      return b.put(static_cast<int16_t>(x));
    case GgufType::U32:
      return b.put(static_cast<uint32_t>(x));
    case GgufType::I32:
      return b.put(static_cast<int32_t>(x));
    case GgufType::U64:
      return b.put(static_cast<uint64_t>(x));
    case GgufType::I64:
      return b.put(static_cast<int64_t>(x));
    case GgufType::F32:
      return b.put(static_cast<float>(x));
    case GgufType::F64:
      return b.put(static_cast<double>(x));
    default:
      throw Error(fmt::format("GGUF value of type {} held as a number", gguf_type_name(t)));
  }
}

void put_value(Bytes& b, const GgufValue& v, const std::string& key);

// The items of an array whose item type is `t`, held as vector<X>.
template <typename X>
void put_items(Bytes& b, GgufType t, const std::vector<X>& items, const std::string& key) {
  for (const X& x : items) {
    if constexpr (std::is_same_v<X, std::string>)
      b.str(x);
    else if constexpr (std::is_same_v<X, GgufValue>)
      put_value(b, x, key);
    else
      put_scalar(b, t, x);
  }
}

void put_value(Bytes& b, const GgufValue& v, const std::string& key) {
  const bool array = v.type == GgufType::Array;
  if (array) {
    b.put(static_cast<uint32_t>(v.item_type));
    b.put<uint64_t>(v.size());
  }
  std::visit(
      [&](const auto& x) {
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<X, std::string>) {
          if (v.type != GgufType::String) throw Error(fmt::format("GGUF key '{}': a string held as another type", key));
          b.str(x);
        } else if constexpr (std::is_arithmetic_v<X>) {
          put_scalar(b, v.type, x);
        } else {
          if (!array) throw Error(fmt::format("GGUF key '{}': an array held as a scalar", key));
          put_items(b, v.item_type, x, key);
        }
      },
      v.data);
}

// numpy's npy_floatbits_to_halfbits (what astype(np.float16) does): round to nearest even.
uint16_t half_bits(uint32_t f) {
  const auto sign = static_cast<uint16_t>((f & 0x80000000u) >> 16);
  uint32_t exp = f & 0x7f800000u;
  if (exp >= 0x47800000u) {  // overflow, infinity or NaN
    const uint32_t sig = f & 0x007fffffu;
    if (exp == 0x7f800000u && sig != 0) {
      auto nan = static_cast<uint16_t>(0x7c00u + (sig >> 13));
      if (nan == 0x7c00u) ++nan;  // a payload only in the dropped bits stays NaN
      return sign + nan;
    }
    return sign + 0x7c00u;
  }
  if (exp <= 0x38000000u) {              // a half subnormal or zero
    if (exp < 0x33000000u) return sign;  // below half the smallest subnormal
    exp >>= 23;                          // 102..112
    uint32_t sig = 0x00800000u + (f & 0x007fffffu);
    sig >>= (113 - exp);                                             // aligned so that bit 13 is the half's last bit
    if ((sig & 0x3fffu) != 0x1000u || (f & 0x7ffu)) sig += 0x1000u;  // not an exact tie to even
    return static_cast<uint16_t>(sign + (sig >> 13));                // a carry makes the smallest normal
  }
  const auto hexp = static_cast<uint16_t>((exp - 0x38000000u) >> 13);
  uint32_t sig = f & 0x007fffffu;
  if ((sig & 0x3fffu) != 0x1000u) sig += 0x1000u;
  // A carry out of the significand increments the exponent (up to infinity), as it should.
  return static_cast<uint16_t>(sign + hexp + (sig >> 13));
}

// gguf-py's np_roundf on one float32: round half away from zero, in the same float32 steps.
float roundf_away(float n) {
  const float a = std::fabs(n);
  const float floored = std::floor(a);
  const float b = floored + std::floor(2.0f * (a - floored));
  return n > 0 ? b : (n < 0 ? -b : 0.0f * b);
}

// Q8_0: f16 d, then 32 int8 q (gguf-py's Q8_0.quantize_blocks).
void block_q8_0(const float* x, std::byte* out) {
  float amax = 0.0f;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d == 0.0f ? 0.0f : 1.0f / d;
  const uint16_t dh = fp32_to_fp16(d);
  std::memcpy(out, &dh, 2);
  for (int j = 0; j < 32; ++j) {
    const auto q = static_cast<int8_t>(roundf_away(x[j] * id));
    std::memcpy(out + 2 + j, &q, 1);
  }
}

}  // namespace

GgufValue gguf_u32(uint32_t v) { return {.type = GgufType::U32, .data = uint64_t{v}}; }
GgufValue gguf_i32(int32_t v) { return {.type = GgufType::I32, .data = int64_t{v}}; }
GgufValue gguf_f32(float v) { return {.type = GgufType::F32, .data = double{v}}; }
GgufValue gguf_bool(bool v) { return {.type = GgufType::Bool, .data = uint64_t{v}}; }
GgufValue gguf_string(std::string v) { return {.type = GgufType::String, .data = std::move(v)}; }
GgufValue gguf_strings(std::vector<std::string> v) {
  return {.type = GgufType::Array, .item_type = GgufType::String, .data = std::move(v)};
}
GgufValue gguf_i32s(std::vector<int64_t> v) {
  return {.type = GgufType::Array, .item_type = GgufType::I32, .data = std::move(v)};
}
GgufValue gguf_bools(const std::vector<bool>& v) {
  return {.type = GgufType::Array, .item_type = GgufType::Bool, .data = std::vector<uint64_t>(v.begin(), v.end())};
}

uint16_t fp32_to_fp16(float f) { return half_bits(std::bit_cast<uint32_t>(f)); }

uint16_t fp32_to_bf16(float f) {
  uint32_t n = std::bit_cast<uint32_t>(f);
  if ((n & 0x7fffffffu) > 0x7f800000u) n = (n & 0xffff0000u) | (64u << 16);  // quiet NaN
  return static_cast<uint16_t>((uint64_t{n} + (0x7fffu + ((n >> 16) & 1u))) >> 16);
}

bool can_quantize(GgmlType t) {
  return t == GgmlType::F32 || t == GgmlType::F16 || t == GgmlType::BF16 || t == GgmlType::Q8_0;
}

void quantize(GgmlType type, std::span<const float> in, std::span<std::byte> out) {
  if (!can_quantize(type))
    throw Error(fmt::format("cannot quantise to {}: supported are F32, F16, BF16, Q8_0", ggml_type_name(type)));
  const size_t block = ggml_block_size(type), bytes = ggml_block_bytes(type);
  if (in.size() % block != 0 || out.size() != in.size() / block * bytes)
    throw Error(fmt::format("quantising {} floats to {} needs whole blocks of {} and {} bytes, not {}", in.size(),
                            ggml_type_name(type), block, in.size() / block * bytes, out.size()));
  std::byte* o = out.data();
  switch (type) {
    case GgmlType::F32:
      std::memcpy(o, in.data(), in.size_bytes());
      break;
    case GgmlType::F16:
    case GgmlType::BF16:
      for (size_t i = 0; i < in.size(); ++i) {
        const uint16_t h = type == GgmlType::F16 ? fp32_to_fp16(in[i]) : fp32_to_bf16(in[i]);
        std::memcpy(o + 2 * i, &h, 2);
      }
      break;
    default:  // Q8_0
      for (size_t b = 0; b < in.size() / 32; ++b) block_q8_0(in.data() + 32 * b, o + 34 * b);
  }
}

GgufWriter::GgufWriter(std::string path) : path_(std::move(path)), file_(std::make_unique<AtomicFile>(path_)) {}

GgufWriter::~GgufWriter() = default;

void GgufWriter::add(const std::string& key, GgufValue value) {
  if (header_written_) throw Error(fmt::format("{}: GGUF key '{}' added after the tensor data began", path_, key));
  if (!keys_.insert(key).second) throw Error(fmt::format("{}: GGUF key '{}' added twice", path_, key));
  if (key == "general.alignment") {
    const auto* a = std::get_if<uint64_t>(&value.data);
    if (value.type != GgufType::U32 || !a || *a == 0 || (*a & (*a - 1)) != 0 || !tensors_.empty())
      throw Error(fmt::format("{}: general.alignment must be a UINT32 power of two, set before any tensor", path_));
    alignment_ = *a;
  }
  metadata_.emplace_back(key, std::move(value));
}

void GgufWriter::add_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& shape) {
  if (header_written_) throw Error(fmt::format("{}: tensor '{}' added after the tensor data began", path_, name));
  if (!names_.insert(name).second) throw Error(fmt::format("{}: tensor '{}' added twice", path_, name));
  if (shape.empty() || shape.size() > 4 || shape.back() % static_cast<int64_t>(ggml_block_size(type)) != 0)
    throw Error(fmt::format("{}: tensor '{}' of {} dimensions cannot be stored as {} (rows of whole blocks)", path_,
                            name, shape.size(), ggml_type_name(type)));
  GgufTensorInfo t;
  t.name = name;
  t.type = type;
  t.dims.assign(shape.rbegin(), shape.rend());
  t.offset = data_size_;
  t.nbytes = static_cast<size_t>(t.numel()) / ggml_block_size(type) * ggml_block_bytes(type);
  data_size_ += pad(t.nbytes, alignment_);
  tensors_.push_back(std::move(t));
}

void GgufWriter::write_header() {
  Bytes b;
  b.put<uint32_t>(0x46554747);  // "GGUF"
  b.put<uint32_t>(kVersion);
  b.put<uint64_t>(tensors_.size());
  b.put<uint64_t>(metadata_.size());
  for (const auto& [key, value] : metadata_) {
    b.str(key);
    b.put(static_cast<uint32_t>(value.type));
    put_value(b, value, key);
  }
  for (const GgufTensorInfo& t : tensors_) {
    b.str(t.name);
    b.put<uint32_t>(t.dims.size());
    for (int64_t d : t.dims) b.put<uint64_t>(d);
    b.put(static_cast<uint32_t>(t.type));
    b.put<uint64_t>(t.offset);
  }
  b.zeros(pad(b.data().size(), alignment_) - b.data().size());
  file_->write(b.data().data(), b.data().size());
  header_written_ = true;
}

void GgufWriter::write_tensor(std::span<const std::byte> bytes) {
  if (!header_written_) write_header();
  if (next_ >= tensors_.size()) throw Error(fmt::format("{}: more tensor data than tensors declared", path_));
  const GgufTensorInfo& t = tensors_[next_++];
  if (bytes.size() != t.nbytes)
    throw Error(fmt::format("{}: tensor '{}' takes {} bytes as {}, not {}", path_, t.name, t.nbytes,
                            ggml_type_name(t.type), bytes.size()));
  file_->write(bytes.data(), bytes.size());
  const std::vector<char> zeros(pad(t.nbytes, alignment_) - t.nbytes);
  file_->write(zeros.data(), zeros.size());
}

void GgufWriter::commit() {
  if (!header_written_) write_header();
  if (next_ != tensors_.size()) throw Error(fmt::format("{}: {} of {} tensors written", path_, next_, tensors_.size()));
  file_->commit();
}

}  // namespace lorarun::io
