// --model / --adapter / --dtype, shared by the tools that run a base model plus an adapter.
#pragma once
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <string>

#include "model/lora.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"

namespace lorarun {

struct ModelArgs {
  std::string base, adapter, dtype = "fp32";

  void add_to(CLI::App& app) {
    app.add_option("--model", base, "base model directory or cached model id")->required();
    app.add_option("--adapter", adapter, "PEFT LoRA adapter directory");
    app.add_option("--dtype", dtype, "fp32, bf16 or fp16");
  }
  model::CausalLM load() const {
    model::CausalLM m = model::CausalLM::load(base, model::parse_dtype(dtype), at::kCPU);
    if (!adapter.empty()) model::load_adapter(m, adapter, m.dtype());
    return m;
  }
};

}  // namespace lorarun
