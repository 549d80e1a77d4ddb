#include "train/memory_estimate.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <algorithm>
#include <set>

#include "model/lora.hpp"
#include "model/transformer.hpp"
#include "train/runtime.hpp"

namespace lorarun::train {

MemoryEstimate estimate_memory(const recipe::Recipe& r, int world, bool shard_base,
                               const std::vector<recipe::AdapterSpec>& adapters) {
  const std::shared_ptr<model::BaseShards> shards = shard_base ? base_shards(r, 0, world, nullptr) : nullptr;
  model::CausalLM m = model::CausalLM::load(r.model.path, model::dtype_of(r.model.dtype, uses_cuda(r)), at::kCPU,
                                            load_options(r, shards, true));
  model::LoraConfig cfg = model::lora_config_of(r.lora, r.model.path);
  cfg.init = "default";           // shapes only: no weights to decompose (PiSSA/OLoRA keep A and B's start below)
  model::attach_lora(m, cfg, 0);  // (one adapter's activations: what a micro-batch's rows keep alike)
  std::vector<at::Tensor> trained = model::lora_parameters(m);
  if (!adapters.empty()) {
    trained.clear();
    for (size_t i = 0; i < adapters.size(); ++i) {
      const recipe::Recipe own = recipe::adapter_recipe(r, adapters[i]);
      model::LoraConfig c = model::lora_config_of(own.lora, r.model.path);
      c.init = "default";
      model::attach_tenant(m, c, 0, static_cast<int>(i), static_cast<int>(adapters.size()));
      for (const at::Tensor& p : model::tenant_parameters(m, static_cast<int>(i))) trained.push_back(p);
    }
  }
  m.training = true;
  m.recompute_activations = r.train.activation_checkpointing;
  MemoryEstimate e;
  e.world = world;
  e.shard_base = shards != nullptr;
  e.base = m.base_bytes();
  e.gathered = shards ? shards->block_buffer_bytes() : 0;
  e.parameters = e.active = m.base_parameter_count();
  const model::MoeConfig& moe = m.config().moe;
  e.experts = moe.experts;
  e.top_k = moe.top_k;
  for (const model::MoeMlp* x : m.moe_layers())  // the experts a token does not visit
    e.active -= (moe.experts - moe.top_k) * (x->gate_up.weight.numel() + x->down.weight.numel()) / moe.experts;
  const int64_t start = r.lora.init.starts_with("pissa") || r.lora.init == "olora" ? 4 : 0;
  for (const at::Tensor& p : trained) {
    e.trainable += p.numel();
    e.lora += p.numel() * (16 + start);
  }
  const int stacked = adapters_per_pass(r, static_cast<int>(adapters.size()));  // micro-batches in a pass
  e.activations = m.activation_bytes(r.data.batch_size * stacked, r.data.max_length);
  return e;
}

std::string memory_report(const recipe::Recipe& r, int world, const std::vector<recipe::AdapterSpec>& adapters) {
  const auto gib = [](int64_t n) { return static_cast<double>(n) / (1 << 30); };
  std::set<int> worlds = {2, 4, 8};
  if (r.dist.shard_base) worlds.insert(world);
  std::string out = fmt::format(
      "# memory per rank, estimated in GiB (a micro-batch of {} x {} tokens: data.batch_size x data.max_length{}{}):\n"
      "#   {:<28} {:>9} {:>11} {:>12} {:>9}\n",
      r.data.batch_size, r.data.max_length,
      adapters.empty() ? ""
                       : fmt::format(", for each of {} of the {} adapters in a pass",
                                     adapters_per_pass(r, static_cast<int>(adapters.size())), adapters.size()),
      r.train.activation_checkpointing ? ", activation checkpointing" : "", "", "base", "LoRA+AdamW", "activations",
      "total");
  const auto row = [&](const std::string& what, const MemoryEstimate& e, bool chosen) {
    // (a space before each column: a figure wider than its column still stands apart)
    out += fmt::format("#   {:<28} {:>9.2f} {:>11.3f} {:>12.2f} {:>9.2f}{}\n", what, gib(e.base + e.gathered),
                       gib(e.lora), gib(e.activations), gib(e.total()), chosen ? "   <- this run" : "");
  };
  const MemoryEstimate whole = estimate_memory(r, 1, false, adapters);
  out = (adapters.empty()
             ? fmt::format("# adapter: {}; {} trainable parameters\n", model::describe_adapter(r.lora), whole.trainable)
             : fmt::format("# {} adapters: {} trainable parameters in all\n", adapters.size(), whole.trainable)) +
        out;
  if (whole.active < whole.parameters)
    out = fmt::format(
              "# mixture of experts: {} of {} base parameters active per token ({:.1f}%, its top {} of {} "
              "experts); every expert is held in memory\n",
              whole.active, whole.parameters,
              100.0 * static_cast<double>(whole.active) / static_cast<double>(whole.parameters), whole.top_k,
              whole.experts) +
          out;
  row("whole base, any ranks", whole, !r.dist.shard_base);
  for (const int w : r.model.keep_quantized ? std::set<int>{} : worlds)  // (blocks are not sliced yet)
    row(fmt::format("dist.shard_base, {} rank{}", w, w == 1 ? "" : "s"), estimate_memory(r, w, true, adapters),
        r.dist.shard_base && w == world);
  if (!r.model.keep_quantized)
    out += fmt::format("#   (sharded base: this rank's slices and {} decoder block(s) gathered whole)\n",
                       r.dist.shard_base_prefetch ? 2 : 1);
  return out;
}

}  // namespace lorarun::train
