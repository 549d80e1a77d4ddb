// Dequantisation rate of every GGUF type lorarun reads (io::dequantize, one thread): the cost
// model.keep_quantized pays twice per linear per step, and a GGUF load once per tensor. Blocks are
// random with their float16 scales in [1e-4, 1e-3] (F16: values in ±[1, 2)). Prints one JSON line
// per type: {"type", "values", "seconds" (best of REPEATS), "mvalues_per_s"}.
//   dequant_bench [MVALUES (default 16)] [REPEATS (default 5)]
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "io/gguf.hpp"

namespace {

using lorarun::io::GgmlType;

struct Layout {
  GgmlType type;
  size_t block_size, block_bytes;
  std::vector<size_t> scales;  // byte offsets of the float16 scales in a block
};

uint16_t small_half(std::mt19937& rng) {  // a float16 in [1e-4, 1e-3): exponent 2^-14 .. 2^-10
  return static_cast<uint16_t>(((1 + rng() % 4) << 10) | (rng() & 0x3ff));
}

}  // namespace

int main(int argc, char** argv) {
  const size_t n = static_cast<size_t>(argc > 1 ? std::stod(argv[1]) : 16) << 20;
  const int repeats = argc > 2 ? std::stoi(argv[2]) : 5;
  const std::vector<Layout> layouts = {
      {GgmlType::F16, 1, 2, {}},          {GgmlType::BF16, 1, 2, {}},          {GgmlType::Q4_0, 32, 18, {0}},
      {GgmlType::Q4_1, 32, 20, {0, 2}},   {GgmlType::Q5_0, 32, 22, {0}},       {GgmlType::Q5_1, 32, 24, {0, 2}},
      {GgmlType::Q8_0, 32, 34, {0}},      {GgmlType::Q2_K, 256, 84, {80, 82}}, {GgmlType::Q3_K, 256, 110, {108}},
      {GgmlType::Q4_K, 256, 144, {0, 2}}, {GgmlType::Q5_K, 256, 176, {0, 2}},  {GgmlType::Q6_K, 256, 210, {208}},
  };
  std::mt19937 rng(7);
  std::vector<float> out(n);
  for (const Layout& l : layouts) {
    const size_t blocks = n / l.block_size;
    std::vector<std::byte> in(blocks * l.block_bytes);
    for (auto& b : in) b = static_cast<std::byte>(rng());
    for (size_t i = 0; i < blocks; ++i) {
      std::byte* block = in.data() + i * l.block_bytes;
      if (l.block_size == 1) {  // F16 / BF16: ±[1, 2)
        const uint16_t h = l.type == GgmlType::F16 ? static_cast<uint16_t>(0x3c00 | (rng() & 0x83ff))
                                                   : static_cast<uint16_t>(0x3f80 | (rng() & 0x807f));
        std::memcpy(block, &h, 2);
      }
      for (size_t at : l.scales) {
        const uint16_t h = small_half(rng);
        std::memcpy(block + at, &h, 2);
      }
    }
    double best = 1e30;
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      lorarun::io::dequantize(l.type, in, out);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    fmt::print("{{\"type\": \"{}\", \"values\": {}, \"seconds\": {:.4f}, \"mvalues_per_s\": {:.0f}}}\n",
               lorarun::io::ggml_type_name(l.type), n, best, static_cast<double>(n) / best / 1e6);
  }
  return 0;
}
