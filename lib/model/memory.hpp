// What training needs in memory, per rank: estimated from the model's shapes before anything is
// loaded (lora-train --dry-run), and measured (the tensor bytes c10's allocators hand out).
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace lorarun::recipe {
struct Recipe;
}

namespace lorarun::model {

// Bytes one rank holds while it trains the recipe's model on `world` ranks.
struct MemoryEstimate {
  int world = 1;
  bool shard_base = false;
  int64_t base = 0;         // base weights: whole, or this rank's slices (dist.shard_base)
  int64_t gathered = 0;     // dist.shard_base: the decoder blocks gathered whole at a time
  int64_t lora = 0;         // LoRA weights, their gradients and AdamW's two moments (float32: 16 B each)
  int64_t activations = 0;  // one micro-batch (data.batch_size x data.max_length): CausalLM::activation_bytes
  int64_t total() const { return base + gathered + lora + activations; }
};

// The recipe's model read as shapes only (no weight data), with its adapters, on `world` ranks.
MemoryEstimate estimate_memory(const recipe::Recipe& r, int world, bool shard_base);

// Lines for lora-train --dry-run: the estimate without dist.shard_base and with it on 2, 4 and 8
// ranks (and `world`), the recipe's own setting marked.
std::string memory_report(const recipe::Recipe& r, int world);

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
