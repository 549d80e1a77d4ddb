// Loads a HF model directory the way lora-train does and prints one JSON line:
// {"seconds": load time, "peak_rss_mb": peak resident memory, "base_rss_mb": before loading}.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <chrono>
#include <fstream>
#include <string>

#include "model/transformer.hpp"
#include "model/weights.hpp"

// VmHWM: the peak resident set of this address space (ru_maxrss would carry the parent's over exec).
static double peak_rss_mb() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("VmHWM:", 0) == 0) return std::stod(line.substr(6)) / 1024.0;
  return 0;
}

int main(int argc, char** argv) {
  if (argc < 2) {
    fmt::print(stderr, "usage: model_load_bench MODEL_DIR [fp32|bf16]\n");
    return 2;
  }
  at::ones({1});  // initialise ATen before the baseline
  const double base = peak_rss_mb();
  const auto t0 = std::chrono::steady_clock::now();
  const auto m =
      lorarun::model::CausalLM::load(argv[1], lorarun::model::parse_dtype(argc > 2 ? argv[2] : "fp32"), at::kCPU);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double rss_loaded = peak_rss_mb();
  // One forward pass of 16 tokens touches every weight: the cost of being ready to train.
  {
    c10::NoGradGuard no_grad;
    m.forward(at::arange(16, at::kLong).unsqueeze(0), {});
  }
  const double s_ready = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print(
      "{{\"seconds\": {:.3f}, \"peak_rss_mb\": {:.1f}, \"ready_seconds\": {:.3f}, \"ready_rss_mb\": {:.1f}, "
      "\"base_rss_mb\": {:.1f}, \"params\": {}}}\n",
      s, rss_loaded, s_ready, peak_rss_mb(), base, m.base_parameter_count());
  return 0;
}
