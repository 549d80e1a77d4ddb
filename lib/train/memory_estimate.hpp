// What training needs in memory per rank, estimated from the recipe's model as shapes (nothing
// of the weights is read): for lora-train --dry-run.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "recipe/recipe.hpp"

namespace lorarun::train {

// Bytes one rank holds while it trains the recipe's model on `world` ranks.
struct MemoryEstimate {
  int world = 1;
  bool shard_base = false;
  int64_t base = 0;                // base weights: whole, or this rank's slices (dist.shard_base)
  int64_t gathered = 0;            // dist.shard_base: the decoder blocks gathered whole at a time
  int64_t trainable = 0;           // adapter parameters
  int64_t lora = 0;                // LoRA weights, their gradients and AdamW's two moments (float32: 16 B each)
  int64_t activations = 0;         // one micro-batch (data.batch_size x data.max_length): CausalLM::activation_bytes
  int64_t parameters = 0;          // the base's
  int64_t active = 0;              // ... that one token passes through (a mixture of experts': its top k experts only)
  int64_t experts = 0, top_k = 0;  // a mixture of experts'
  int64_t total() const { return base + gathered + lora + activations; }
};

// The recipe's model read as shapes only (no weight data), with its adapters, on `world` ranks. A
// job of many (`adapters`, its adapters as job_adapters gives them): every adapter's LoRA and AdamW,
// and a micro-batch of data.batch_size documents of each.
MemoryEstimate estimate_memory(const recipe::Recipe& r, int world, bool shard_base,
                               const std::vector<recipe::AdapterSpec>& adapters = {});

// Lines for lora-train --dry-run: the estimate without dist.shard_base and with it on 2, 4 and 8
// ranks (and `world`), the recipe's own setting marked.
std::string memory_report(const recipe::Recipe& r, int world, const std::vector<recipe::AdapterSpec>& adapters = {});

}  // namespace lorarun::train
