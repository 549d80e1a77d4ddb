// safetensors files: a validated, memory-mapped reader and an atomic writer. No LibTorch here;
// lib/model turns the byte spans into tensors.
#pragma once
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "io/mapped_file.hpp"

namespace lorarun::io {

enum class DType { F64, F32, F16, BF16, I64, I32, I16, I8, U8, Bool };

const char* dtype_name(DType d);  // "F32", as in the file
size_t dtype_size(DType d);

struct TensorInfo {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  size_t offset = 0;  // into the data section
  size_t nbytes = 0;
};

// A memory-mapped safetensors file. The constructor checks everything a corrupt or truncated
// file can get wrong (header length, JSON, dtypes, shapes vs sizes, offsets in bounds, no
// overlaps) and throws lorarun::Error naming the file and the problem.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::string& path);
  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  const std::vector<TensorInfo>& tensors() const { return tensors_; }
  const TensorInfo* find(const std::string& name) const;
  std::span<const std::byte> bytes(const TensorInfo& t) const;
  // Drops the tensor's pages from this process (they stay in the page cache): once a tensor is
  // copied out, its mapped bytes should not count as a second copy in resident memory.
  void release(const TensorInfo& t) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }

 private:
  std::string path_;
  MappedFile file_;
  const std::byte* map_;  // file_'s bytes
  size_t size_;
  size_t data_start_ = 0;
  std::vector<TensorInfo> tensors_;
  std::map<std::string, size_t> index_;
  std::map<std::string, std::string> metadata_;
};

// One tensor to write: raw little-endian bytes, contiguous, row-major.
struct TensorBytes {
  std::string name;
  DType dtype;
  std::vector<int64_t> shape;
  const void* data;
  size_t nbytes;
};

// Writes `path` via a temporary file in the same directory, fsync, rename.
void write_safetensors(const std::string& path, const std::vector<TensorBytes>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

}  // namespace lorarun::io
