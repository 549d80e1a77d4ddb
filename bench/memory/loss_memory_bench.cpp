// Peak memory of the loss and its backward at a large vocabulary: full float32 logits
// (causal_lm_loss) against the chunked loss from hidden states (lm_head_loss).
// usage: loss_memory_bench full|chunked TOKENS HIDDEN VOCAB   (bench/memory/bench.py runs it)
// Prints one JSON line: the peak RSS growth during the loss, forward and backward, in MiB.
#include <ATen/ATen.h>
#include <sys/resource.h>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>

#include "model/loss.hpp"

namespace {

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return double(u.ru_maxrss) / 1024.0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 5) {
    std::fprintf(stderr, "usage: loss_memory_bench full|chunked TOKENS HIDDEN VOCAB\n");
    return 2;
  }
  const std::string mode = argv[1];
  const int64_t N = std::atoll(argv[2]), H = std::atoll(argv[3]), V = std::atoll(argv[4]);
  at::manual_seed(0);
  const at::Tensor w = at::randn({V, H}) * 0.02;                        // frozen output projection
  const at::Tensor h = (at::randn({1, N, H})).set_requires_grad(true);  // final hidden states
  const at::Tensor labels = at::randint(V, {1, N}, at::kLong);
  const double before = peak_rss_mb();
  const auto t0 = std::chrono::steady_clock::now();
  at::Tensor loss;
  if (mode == "full") {
    loss = lorarun::model::causal_lm_loss(at::linear(h, w), labels).sum;
  } else {
    const at::Tensor rows = at::arange(N - 1, at::kLong);
    loss = lorarun::model::lm_head_loss(h, w, rows, labels.view(-1).narrow(0, 1, N - 1)).sum;
  }
  loss.backward();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("{\"mode\": \"%s\", \"loss\": %.6f, \"grad_sum\": %.6f, \"peak_growth_mb\": %.1f, \"seconds\": %.3f}\n",
              mode.c_str(), loss.item<double>(), h.grad().sum().item<double>(), peak_rss_mb() - before, seconds);
  return 0;
}
