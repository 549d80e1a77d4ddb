// What training holds in memory, measured: the tensor bytes c10's allocators hand out (the
// estimate from the shapes alone is train/memory_estimate.hpp's).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lorarun::model {

// Bytes of tensors allocated (less those freed) on this thread, and on the threads that run its
// autograd, while the meter lives: now and at the most. Counts what c10's CPU and CUDA allocators
// hand out, as PyTorch's memory profiler does; allocator caches and malloc overheads are not in it.
class TensorMemoryMeter {
 public:
  TensorMemoryMeter();
  ~TensorMemoryMeter();
  TensorMemoryMeter(const TensorMemoryMeter&) = delete;
  TensorMemoryMeter& operator=(const TensorMemoryMeter&) = delete;
  int64_t now() const;
  int64_t peak() const;
  void reset_peak();  // the peak from now on

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorarun::model
