// --model / --adapter / --dtype, shared by the tools that run a base model plus an adapter
// (a tool that can run on a GPU also registers --device).
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
  std::string device = "cpu";  // "cpu", "cuda" or "cuda:N"

  void add_to(CLI::App& app) {
    app.add_option("--model", base, "base model directory or cached model id")->required();
    app.add_option("--adapter", adapter, "PEFT LoRA adapter directory");
    app.add_option("--dtype", dtype, "fp32, bf16 or fp16");
  }
  model::CausalLM load() const {
    model::CausalLM m = model::CausalLM::load(base, model::parse_dtype(dtype), at::Device(device));
    if (!adapter.empty()) model::load_adapter(m, adapter, m.dtype());
    return m;
  }
};

}  // namespace lorarun
