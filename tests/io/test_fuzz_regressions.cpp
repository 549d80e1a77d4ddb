// Inputs found by fuzzing the safetensors reader (scripts/fuzz, fuzz/safetensors_fuzz.cpp):
// each was accepted with a shape lib/model cannot use, or worse, before the fix.
#include <catch2/catch.hpp>

#include <unistd.h>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>

#include "io/safetensors.hpp"
#include "util/error.hpp"

namespace fs = std::filesystem;
using lorarun::io::SafetensorsFile;

namespace {

// A safetensors file in a fresh temp directory: the 8-byte length, `header`, zero data bytes.
struct RawSafetensors {
  fs::path dir, path;
  RawSafetensors(const std::string& header, size_t data_bytes) {
    static int counter = 0;
    dir =
        fs::temp_directory_path() / ("lorarun-fuzzreg-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
    fs::create_directories(dir);
    path = dir / "t.safetensors";
    std::ofstream out(path, std::ios::binary);
    const uint64_t len = header.size();
    out.write(reinterpret_cast<const char*>(&len), 8);
    out << header << std::string(data_bytes, '\0');
  }
  ~RawSafetensors() { fs::remove_all(dir); }
};

std::string tensor(const std::string& shape, size_t nbytes) {
  return R"({"a":{"dtype":"F32","shape":)" + shape + R"(,"data_offsets":[0,)" + std::to_string(nbytes) + "]}}";
}

}  // namespace

TEST_CASE("safetensors: a dimension beyond int64 is rejected even when another one is 0") {
  // [0, 2^64 - 1] has no elements, so the size check passed, and the shape became [0, -1].
  for (const char* dim : {"18446744073709551615", "9223372036854775808", "281474976710657"}) {
    RawSafetensors f(tensor(std::string("[0,") + dim + "]", 0), 0);
    CHECK_THROWS_WITH(SafetensorsFile(f.path.string()),
                      Catch::Contains("tensor 'a' is too large (shape dimension " + std::string(dim) + ")"));
  }
  RawSafetensors empty(tensor("[0,281474976710656]", 0), 0);  // 2^48: the largest dimension
  CHECK(SafetensorsFile(empty.path.string()).tensors().at(0).shape == std::vector<int64_t>{0, int64_t{1} << 48});
  RawSafetensors scalar(tensor("[]", 4), 4);
  CHECK(SafetensorsFile(scalar.path.string()).tensors().at(0).nbytes == 4);
}
