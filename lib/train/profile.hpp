// train.profile_steps: LibTorch's profiler (torch.profiler's, Kineto) over a few optimizer steps of
// this process, after two to warm up; each rank writes <output_dir>/profile/rank_<R>.json, a Chrome
// trace with every operator's input shapes (Perfetto or chrome://tracing open it;
// bench/train/profile_bench.py sums it per kind of work, against PEFT's trace of the same step).
#pragma once
#include <cstdint>
#include <optional>
#include <string>

namespace lorarun::train {

class StepProfiler {
 public:
  // `steps`: train.profile_steps (none: this profiler does nothing).
  StepProfiler(std::optional<int> steps, const std::string& output_dir, int rank, bool cuda);
  // A run that ends while recording writes what it has.
  ~StepProfiler();
  StepProfiler(const StepProfiler&) = delete;
  StepProfiler& operator=(const StepProfiler&) = delete;

  // Around each optimizer step of this process.
  void before_step();
  void after_step();

 private:
  void write();

  const std::optional<int> steps_;
  const std::string path_;
  const bool cuda_;
  int64_t seen_ = 0;      // steps begun in this process
  int64_t recorded_ = 0;  // steps recorded
  bool on_ = false;
};

}  // namespace lorarun::train
