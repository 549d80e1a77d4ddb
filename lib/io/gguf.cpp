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
#include "io/ggml_types.hpp"
#include "util/error.hpp"

// The layout is llama.cpp's gguf.h / docs/gguf.md: "GGUF", u32 version, u64 tensor count, u64
// key count, the keys (string, u32 type, value), the tensor infos (string, u32 n_dims, u64
// ne[n_dims], u32 ggml type, u64 offset), padding to general.alignment, the data section. Strings
// are u64 length + bytes; an array is u32 item type + u64 count + items. Everything little-endian.

namespace lorarun::io {

namespace detail {

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

}  // namespace detail

using detail::traits;
using detail::TypeTraits;

namespace {

constexpr uint32_t kMaxDims = 4;      // GGML_MAX_DIMS
constexpr size_t kMaxArrayDepth = 8;  // arrays of arrays: gguf-py writes at most 2 levels
constexpr uint64_t kMaxNumel = uint64_t{1} << 48;

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

}  // namespace lorarun::io
