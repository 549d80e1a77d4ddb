// libFuzzer harness for lorarun::io::SafetensorsFile, the reader of untrusted weight files.
//
// Each input is written to a file in /dev/shm and opened as a safetensors file. Accepted:
// success, or lorarun::Error. A finding: any other exception, a sanitizer report, a hang, or
// an accepted file whose tensors break the invariants lib/model relies on (shape dims >= 0,
// numel * dtype size == nbytes, bytes inside the data section); every tensor's bytes are read.
// Build and run with scripts/fuzz; seeds come from fuzz/make_seeds.py.
#include <fmt/format.h>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

#include "common.hpp"
#include "io/safetensors.hpp"

using lorarun::io::SafetensorsFile;

namespace {

volatile uint8_t g_sink;  // keeps the reads of the tensor bytes

// file: the input bytes. The data section starts after the 8-byte length and the header.
void check_invariants(const SafetensorsFile& f, std::string_view file) {
  uint64_t header_len = 0;
  std::memcpy(&header_len, file.data(), 8);
  const size_t data_size = file.size() - 8 - header_len;
  uint8_t sink = 0;
  for (const auto& t : f.tensors()) {
    // The mapping is not heap memory, so ASan cannot see a read past it: check the bounds.
    if (t.offset > data_size || t.nbytes > data_size - t.offset || f.bytes(t).size() != t.nbytes)
      lorarun::fuzz::finding(fmt::format("tensor '{}' [{}, +{}) is outside the {}-byte data section", t.name, t.offset,
                                         t.nbytes, data_size));
    unsigned __int128 numel = 1;
    for (int64_t d : t.shape) {
      if (d < 0) lorarun::fuzz::finding(fmt::format("tensor '{}' accepted with dimension {}", t.name, d));
      numel *= static_cast<uint64_t>(d);
    }
    if (numel * lorarun::io::dtype_size(t.dtype) != t.nbytes)
      lorarun::fuzz::finding(fmt::format("tensor '{}' accepted with {} bytes for its shape", t.name, t.nbytes));
    if (f.find(t.name) != &t) lorarun::fuzz::finding(fmt::format("find('{}') is not the tensor", t.name));
    for (std::byte b : f.bytes(t)) sink ^= static_cast<uint8_t>(b);
  }
  for (const auto& [k, v] : f.metadata()) sink ^= static_cast<uint8_t>(k.size() + v.size());
  g_sink = sink;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string path = lorarun::fuzz::scratch_path("input.safetensors");
  const std::string_view file(reinterpret_cast<const char*>(data), size);
  lorarun::fuzz::write_file(path, file);
  lorarun::fuzz::expect_only_lorarun_errors([&] {
    SafetensorsFile f(path);
    check_invariants(f, file);
  });
  return 0;
}
