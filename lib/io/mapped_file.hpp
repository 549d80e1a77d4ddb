// A whole file mapped into memory: the one mapped-file type the safetensors and GGUF readers hold.
#pragma once
#include <cstddef>
#include <string>

namespace lorarun::io {

class MappedFile {
 public:
  // ReadOnly: PROT_READ. CopyOnWrite: private and writable, so a tensor viewing the mapping may be
  // updated in place (a LoRA merge) and gets its own pages instead of a fault.
  enum class Access { ReadOnly, CopyOnWrite };

  // Maps `path` whole; lorarun::Error "cannot open PATH: reason" (or "cannot map") when it cannot.
  // An empty file maps to no memory: data() is null and size() 0.
  MappedFile(const std::string& path, Access access);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::byte* data() const { return data_; }
  size_t size() const { return size_; }

 private:
  const std::byte* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace lorarun::io
