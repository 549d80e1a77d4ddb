#include "io/safetensors.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <cstring>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "util/error.hpp"

namespace lorarun::io {
namespace {

constexpr size_t kMaxHeader = 100 << 20;           // the format's own limit is 100 MB
constexpr uint64_t kMaxNumel = uint64_t{1} << 48;  // elements of a tensor, and of each dimension

struct DTypeName {
  const char* name;
  DType dtype;
  size_t size;
};
constexpr DTypeName kDTypes[] = {{"F64", DType::F64, 8},   {"F32", DType::F32, 4}, {"F16", DType::F16, 2},
                                 {"BF16", DType::BF16, 2}, {"I64", DType::I64, 8}, {"I32", DType::I32, 4},
                                 {"I16", DType::I16, 2},   {"I8", DType::I8, 1},   {"U8", DType::U8, 1},
                                 {"BOOL", DType::Bool, 1}};

DType parse_dtype(const std::string& s, const std::string& where) {
  for (const auto& d : kDTypes)
    if (s == d.name) return d.dtype;
  throw Error(
      fmt::format("{}: dtype '{}' is not supported (F64, F32, F16, BF16, I64, I32, I16, "
                  "I8, U8, BOOL)",
                  where, s));
}

}  // namespace

const char* dtype_name(DType d) {
  for (const auto& x : kDTypes)
    if (x.dtype == d) return x.name;
  return "?";
}

size_t dtype_size(DType d) {
  for (const auto& x : kDTypes)
    if (x.dtype == d) return x.size;
  return 0;
}

// Copy-on-write: tensors may view the mapping directly (zero copy), and an in-place update of such
// a tensor (a LoRA merge) gets pages of its own.
SafetensorsFile::SafetensorsFile(const std::string& path)
    : path_(path), file_(path, MappedFile::Access::CopyOnWrite), map_(file_.data()), size_(file_.size()) {
  const auto corrupt = [&](const std::string& what) {
    return Error(
        fmt::format("{} is not a valid safetensors file: {}; the file is truncated or "
                    "corrupt, re-download or re-convert it",
                    path, what));
  };
  if (size_ < 8) throw corrupt(fmt::format("{} bytes is shorter than the 8-byte header length", size_));
  uint64_t header_len = 0;
  std::memcpy(&header_len, map_, 8);  // little-endian on every platform we build for
  if (header_len > kMaxHeader || header_len > size_ - 8)
    throw corrupt(fmt::format("header length {} runs past the end of the {}-byte file", header_len, size_));
  data_start_ = 8 + header_len;
  const size_t data_size = size_ - data_start_;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(reinterpret_cast<const char*>(map_) + 8,
                                   reinterpret_cast<const char*>(map_) + data_start_);
  } catch (const nlohmann::json::exception& e) {
    throw corrupt(fmt::format("header is not JSON ({})", e.what()));
  }
  if (!header.is_object()) throw corrupt("header is not a JSON object");
  for (auto& [name, v] : header.items()) {
    if (name == "__metadata__") {
      if (!v.is_object()) throw corrupt("__metadata__ is not an object");
      for (auto& [k, s] : v.items())
        if (s.is_string()) metadata_[k] = s.get<std::string>();
      continue;
    }
    const std::string where = fmt::format("{}: tensor '{}'", path, name);
    if (!v.is_object() || !v.contains("dtype") || !v.contains("shape") || !v.contains("data_offsets") ||
        !v["dtype"].is_string() || !v["shape"].is_array() || !v["data_offsets"].is_array() ||
        v["data_offsets"].size() != 2)
      throw corrupt(fmt::format("tensor '{}' lacks dtype, shape or data_offsets", name));
    TensorInfo t;
    t.name = name;
    t.dtype = parse_dtype(v["dtype"].get<std::string>(), where);
    size_t numel = 1;
    for (const auto& d : v["shape"]) {
      if (!d.is_number_unsigned()) throw corrupt(fmt::format("tensor '{}' has a bad shape", name));
      const uint64_t n = d.get<uint64_t>();
      // Each dimension too, not only the product: [0, 2^64 - 1] has no elements but its
      // second dimension does not fit the int64 of a tensor shape.
      if (n > kMaxNumel || (n != 0 && numel > kMaxNumel / n))
        throw corrupt(fmt::format("tensor '{}' is too large (shape dimension {})", name, n));
      numel *= n;
      t.shape.push_back(static_cast<int64_t>(n));
    }
    const auto& off = v["data_offsets"];
    if (!off[0].is_number_unsigned() || !off[1].is_number_unsigned())
      throw corrupt(fmt::format("tensor '{}' has bad data_offsets", name));
    const uint64_t begin = off[0].get<uint64_t>(), end = off[1].get<uint64_t>();
    if (begin > end || end > data_size)
      throw corrupt(
          fmt::format("tensor '{}' data [{}, {}) is outside the {}-byte data section", name, begin, end, data_size));
    if (end - begin != numel * dtype_size(t.dtype))
      throw corrupt(fmt::format("tensor '{}' has {} bytes but dtype {} and shape [{}] need {}", name, end - begin,
                                dtype_name(t.dtype), fmt::join(t.shape, ", "), numel * dtype_size(t.dtype)));
    t.offset = begin;
    t.nbytes = end - begin;
    tensors_.push_back(std::move(t));
  }
  std::vector<const TensorInfo*> by_offset;
  for (const auto& t : tensors_) by_offset.push_back(&t);
  std::sort(by_offset.begin(), by_offset.end(), [](auto* a, auto* b) { return a->offset < b->offset; });
  for (size_t i = 1; i < by_offset.size(); ++i)
    if (by_offset[i]->offset < by_offset[i - 1]->offset + by_offset[i - 1]->nbytes)
      throw corrupt(fmt::format("tensors '{}' and '{}' overlap", by_offset[i - 1]->name, by_offset[i]->name));
  for (size_t i = 0; i < tensors_.size(); ++i) index_[tensors_[i].name] = i;
}

SafetensorsFile::~SafetensorsFile() = default;

const TensorInfo* SafetensorsFile::find(const std::string& name) const {
  const auto it = index_.find(name);
  return it == index_.end() ? nullptr : &tensors_[it->second];
}

std::span<const std::byte> SafetensorsFile::bytes(const TensorInfo& t) const {
  return {map_ + data_start_ + t.offset, t.nbytes};
}

void SafetensorsFile::release(const TensorInfo& t) const { drop_pages(map_ + data_start_ + t.offset, t.nbytes); }

void write_safetensors(const std::string& path, const std::vector<TensorBytes>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  size_t offset = 0;
  for (const TensorBytes& t : tensors) {
    header[t.name] = {
        {"dtype", dtype_name(t.dtype)}, {"shape", t.shape}, {"data_offsets", {offset, offset + t.nbytes}}};
    offset += t.nbytes;
  }
  std::string head = header.dump();
  head.append((8 - head.size() % 8) % 8, ' ');  // align the data section to 8 bytes
  AtomicFile out(path);
  const uint64_t len = head.size();
  out.write(&len, 8);
  out.write(head.data(), head.size());
  for (const TensorBytes& t : tensors) out.write(t.data, t.nbytes);
  out.commit();
}

}  // namespace lorarun::io
