// Writing GGUF v3 files (the layout lib/io/gguf.hpp reads), and float32 quantisation to the types
// llama.cpp's converter writes (F32, F16, BF16, Q8_0), bit for bit as gguf-py's gguf.quants does.
// No LibTorch here; model/gguf_export.hpp feeds it a model's tensors.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include "io/gguf.hpp"

namespace lorarun::io {

class AtomicFile;

// Metadata values of the types gguf-py's GGUFWriter uses for llama.cpp's keys.
GgufValue gguf_u32(uint32_t v);
GgufValue gguf_i32(int32_t v);
GgufValue gguf_f32(float v);
GgufValue gguf_bool(bool v);
GgufValue gguf_string(std::string v);
GgufValue gguf_strings(std::vector<std::string> v);  // ARRAY of STRING
GgufValue gguf_i32s(std::vector<int64_t> v);         // ARRAY of INT32 (token types)
GgufValue gguf_bools(const std::vector<bool>& v);    // ARRAY of BOOL (a flag a layer)

// float32 -> IEEE half as numpy's astype(np.float16) rounds: to nearest even, subnormals kept,
// overflow to infinity, NaN stays NaN with the top of its payload.
uint16_t fp32_to_fp16(float f);
// float32 -> bfloat16 as gguf-py (and ggml_compute_fp32_to_bf16): NaN made quiet (bit 22 set,
// low half dropped), everything else rounded to nearest even (overflow to infinity).
uint16_t fp32_to_bf16(float f);

// Whether quantize() writes `t`: F32, F16, BF16, Q8_0.
bool can_quantize(GgmlType t);
// `in` as `type` into `out` (in.size() / block_size * block_bytes bytes), identical to gguf-py's
// gguf.quants.quantize(in, type). Q8_0: per block of 32, d = max|x| / 127 (float32, stored as
// f16) and q = x * (1/d) rounded half away from zero (0 when d is 0). lorarun::Error for another
// type or sizes that are not whole blocks.
void quantize(GgmlType type, std::span<const float> in, std::span<std::byte> out);

// A GGUF file written as gguf-py's GGUFWriter lays it out: header, metadata in the order added,
// tensor infos, data aligned to general.alignment (32 unless that key is added, before any tensor). Declare every key
// and tensor first, then write each tensor's bytes in the order declared; commit() fsyncs and renames the temporary
// file into place (an error on the way leaves nothing at `path`).
class GgufWriter {
 public:
  explicit GgufWriter(std::string path);
  ~GgufWriter();
  GgufWriter(const GgufWriter&) = delete;
  GgufWriter& operator=(const GgufWriter&) = delete;

  // lorarun::Error for a key added twice (or any key after the first tensor's data).
  void add(const std::string& key, GgufValue value);
  // shape in PyTorch order (outermost first); its innermost size a multiple of the type's block.
  void add_tensor(const std::string& name, GgmlType type, const std::vector<int64_t>& shape);
  // The next declared tensor's bytes: exactly what its type and shape take.
  void write_tensor(std::span<const std::byte> bytes);
  void commit();  // every declared tensor must have been written

 private:
  void write_header();

  std::string path_;
  std::unique_ptr<AtomicFile> file_;
  std::vector<std::pair<std::string, GgufValue>> metadata_;
  std::set<std::string> keys_, names_;
  std::vector<GgufTensorInfo> tensors_;
  size_t next_ = 0;        // the tensor write_tensor() takes next
  size_t alignment_ = 32;  // GGUF_DEFAULT_ALIGNMENT
  size_t data_size_ = 0;
  bool header_written_ = false;
};

}  // namespace lorarun::io
