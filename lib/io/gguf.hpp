// GGUF files (llama.cpp's model format, v2 and v3): a validated, memory-mapped reader, and float32
// dequantisation of the ggml tensor types published models use. No LibTorch here; lib/model turns
// the floats into tensors (model/gguf_weights.hpp).
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <span>
#include <string>
#include <variant>
#include <vector>

#include "io/mapped_file.hpp"

namespace lorarun::io {

// ggml's tensor types, with the ids a GGUF file stores (ggml.h's enum ggml_type).
enum class GgmlType : uint32_t {
  F32 = 0,
  F16 = 1,
  Q4_0 = 2,
  Q4_1 = 3,
  Q5_0 = 6,
  Q5_1 = 7,
  Q8_0 = 8,
  Q8_1 = 9,
  Q2_K = 10,
  Q3_K = 11,
  Q4_K = 12,
  Q5_K = 13,
  Q6_K = 14,
  Q8_K = 15,
  IQ2_XXS = 16,
  IQ2_XS = 17,
  IQ3_XXS = 18,
  IQ1_S = 19,
  IQ4_NL = 20,
  IQ3_S = 21,
  IQ2_S = 22,
  IQ4_XS = 23,
  I8 = 24,
  I16 = 25,
  I32 = 26,
  I64 = 27,
  F64 = 28,
  IQ1_M = 29,
  BF16 = 30,
  TQ1_0 = 34,
  TQ2_0 = 35,
  MXFP4 = 39,
};

const char* ggml_type_name(GgmlType t);  // "Q4_K", as llama.cpp prints it
// Elements per block and bytes per block: a row of n elements (n a multiple of the block size)
// takes n / block_size * block_bytes bytes.
size_t ggml_block_size(GgmlType t);
size_t ggml_block_bytes(GgmlType t);
// Whether dequantize() handles `t`: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K..Q6_K.
bool can_dequantize(GgmlType t);

// The type of a metadata value (gguf.h's enum gguf_type).
enum class GgufType : uint32_t {
  U8 = 0,
  I8 = 1,
  U16 = 2,
  I16 = 3,
  U32 = 4,
  I32 = 5,
  F32 = 6,
  Bool = 7,
  String = 8,
  Array = 9,
  U64 = 10,
  I64 = 11,
  F64 = 12,
};
const char* gguf_type_name(GgufType t);  // "UINT32", as gguf-py names it

// One metadata value. Scalars and array items are widened without loss: unsigned integers and
// bools to uint64_t, signed integers to int64_t, F32 and F64 to double; `type` (and `item_type`
// for an array) says what the file holds.
struct GgufValue {
  GgufType type = GgufType::U8;
  GgufType item_type = GgufType::U8;                    // arrays only
  std::variant<uint64_t, int64_t, double, std::string,  // scalars
               std::vector<uint64_t>, std::vector<int64_t>, std::vector<double>, std::vector<std::string>,
               std::vector<GgufValue>>  // arrays (of arrays)
      data;

  size_t size() const;  // items of an array; 1 for a scalar
};

struct GgufTensorInfo {
  std::string name;
  GgmlType type = GgmlType::F32;
  std::vector<int64_t> dims;  // GGUF order: dims[0] (ne[0]) is the innermost, contiguous one
  size_t offset = 0;          // into the data section
  size_t nbytes = 0;

  int64_t numel() const;
  std::vector<int64_t> torch_shape() const;  // dims reversed: PyTorch's row-major shape
};

// A memory-mapped GGUF file. The constructor checks every count, length and offset against the
// file before using it (a truncated or hostile file never allocates more than the file could
// hold), and throws lorarun::Error naming the file and the problem.
class GgufFile {
 public:
  explicit GgufFile(const std::string& path);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  const std::string& path() const { return path_; }
  uint32_t version() const { return version_; }
  size_t alignment() const { return alignment_; }      // general.alignment, default 32
  size_t data_offset() const { return data_offset_; }  // where the data section starts

  // Metadata, in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return metadata_; }
  const GgufValue* find_key(const std::string& key) const;
  bool has(const std::string& key) const { return find_key(key) != nullptr; }
  // Typed lookups. Without a default a missing key is an error; a key of another type always is
  // (naming the key, its type and the one wanted). get_int accepts any integer type, get_float
  // F32 or F64, and the array getters arrays of such items.
  std::string get_string(const std::string& key) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  int64_t get_int(const std::string& key) const;
  int64_t get_int(const std::string& key, int64_t fallback) const;
  double get_float(const std::string& key) const;
  double get_float(const std::string& key, double fallback) const;
  bool get_bool(const std::string& key) const;
  bool get_bool(const std::string& key, bool fallback) const;
  const std::vector<std::string>& get_strings(const std::string& key) const;
  std::vector<int64_t> get_ints(const std::string& key) const;
  const std::vector<double>& get_floats(const std::string& key) const;

  const std::vector<GgufTensorInfo>& tensors() const { return tensors_; }
  const GgufTensorInfo* find(const std::string& name) const;
  std::span<const std::byte> bytes(const GgufTensorInfo& t) const;
  // Drops the tensor's mapped pages from this process once it has been dequantised.
  void release(const GgufTensorInfo& t) const;

 private:
  const GgufValue& typed(const std::string& key, std::initializer_list<GgufType> types, const char* want) const;

  std::string path_;
  MappedFile file_;
  const std::byte* map_;  // file_'s bytes
  size_t size_;
  uint32_t version_ = 0;
  size_t alignment_ = 32;
  size_t data_offset_ = 0;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::map<std::string, size_t> key_index_;
  std::vector<GgufTensorInfo> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

// `in` (whole blocks of `type`) as float32 into `out` (block_size floats per block), computed as
// gguf-py's gguf.quants.dequantize does, to the bit. lorarun::Error when the type is not one
// can_dequantize() accepts or the sizes disagree.
void dequantize(GgmlType type, std::span<const std::byte> in, std::span<float> out);

// Tensor `t` of `file` as float32 into `out` (t.numel() floats, PyTorch row-major order, which is
// the file's order); the error for an unsupported type names the file, the tensor and the types.
void dequantize(const GgufFile& file, const GgufTensorInfo& t, std::span<float> out);

// Throws ConfigError naming the file and the tensor when `t` would dequantise to a value that is
// not finite (a damaged file): for F32, F16 and BF16 any value that is NaN or infinite, for the
// block types a block scale that is (each value of a block is its scales times small whole
// numbers, so finite scales make finite values). Types dequantize() refuses pass unchecked.
void check_finite(const GgufFile& file, const GgufTensorInfo& t);

}  // namespace lorarun::io
