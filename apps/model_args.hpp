// --model / --adapter / --dtype / --quantize-base, shared by the tools that run a base model plus
// an adapter (a tool that can run on a GPU also registers --device).
#pragma once
#include <ATen/ATen.h>
#include <CLI/CLI.hpp>
#include <memory>
#include <string>

#include "model/lora.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "track/pulled.hpp"

namespace lorarun {

struct ModelArgs {
  std::string base, adapter, dtype = "fp32";
  std::string device = "cpu";  // "cpu", "cuda" or "cuda:N"
  bool quantize = false, no_double_quant = false, keep_quantized = false;
  std::shared_ptr<track::AdapterSource> source;  // holds a pulled adapter's temporary directory

  // Returns --model's option (required; a tool with another way to name the model relaxes it).
  CLI::Option* add_to(CLI::App& app) {
    CLI::Option* model = app.add_option("--model", base, "base model directory or cached model id")->required();
    app.add_option("--adapter", adapter,
                   "PEFT LoRA adapter directory, or mongodb-run:DATABASE/ID[/epoch_N|/best], a run's stored adapter "
                   "(checkpoint.store: mongodb; server from $LORARUN_MONGODB_URI)");
    app.add_option("--dtype", dtype, "fp32, bf16 or fp16");
    CLI::Option* q =
        app.add_flag("--quantize-base", quantize,
                     "base linears in NF4, as QLoRA training holds them (lora.quantize_base); use --dtype of the "
                     "training run (model.dtype)");
    app.add_flag("--no-double-quant", no_double_quant, "with --quantize-base: as lora.double_quant: false")->needs(q);
    app.add_flag("--keep-quantized", keep_quantized,
                 "a .gguf model: its linears held as the file's blocks, dequantised per use (model.keep_quantized)")
        ->excludes(q);
    return model;
  }
  // After parsing: --adapter mongodb-run:… pulled (sha256 checked) into a temporary directory,
  // which --adapter then names for as long as this object lives.
  void pull_adapter() {
    source = std::make_shared<track::AdapterSource>(adapter);
    adapter = source->dir();
  }
  // `shards`: dist.shard_base's slices of this rank (none: the base whole).
  model::CausalLM load(std::shared_ptr<model::BaseShards> shards = nullptr) const {
    model::CausalLM m = model::CausalLM::load(base, model::parse_dtype(dtype), at::Device(device),
                                              {.quantize = quantize,
                                               .double_quant = !no_double_quant,
                                               .keep_quantized = keep_quantized,
                                               .shards = std::move(shards)});
    if (!adapter.empty()) model::load_adapter(m, adapter, m.dtype());
    return m;
  }
};

}  // namespace lorarun
