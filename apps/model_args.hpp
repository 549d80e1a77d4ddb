// --model / --adapter / --dtype / --quantize-base, shared by the tools that run a base model plus
// an adapter (a tool that can run on a GPU also registers --device).
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
  bool quantize = false, no_double_quant = false;

  // Returns --model's option (required; a tool with another way to name the model relaxes it).
  CLI::Option* add_to(CLI::App& app) {
    CLI::Option* model = app.add_option("--model", base, "base model directory or cached model id")->required();
    app.add_option("--adapter", adapter, "PEFT LoRA adapter directory");
    app.add_option("--dtype", dtype, "fp32, bf16 or fp16");
    CLI::Option* q =
        app.add_flag("--quantize-base", quantize,
                     "base linears in NF4, as QLoRA training holds them (lora.quantize_base); use --dtype of the "
                     "training run (model.dtype)");
    app.add_flag("--no-double-quant", no_double_quant, "with --quantize-base: as lora.double_quant: false")->needs(q);
    return model;
  }
  model::CausalLM load() const {
    model::CausalLM m = model::CausalLM::load(base, model::parse_dtype(dtype), at::Device(device),
                                              {.quantize = quantize, .double_quant = !no_double_quant});
    if (!adapter.empty()) model::load_adapter(m, adapter, m.dtype());
    return m;
  }
};

}  // namespace lorarun
