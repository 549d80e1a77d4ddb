// lora-merge: fold a LoRA adapter into its base model and write a Hugging Face model directory.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "app_main.hpp"
#include "model/export.hpp"
#include "model/lora.hpp"
#include "model/nf4.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"

namespace {

using namespace lorarun;

int run(int argc, char** argv) {
  CLI::App app{"lora-merge: fold a LoRA adapter into its base model, write a HF model directory"};
  std::string base, adapter, out, shard = "5GB", dtype = "auto", qlora_dtype = "bf16";
  bool qlora = false, no_double_quant = false;
  app.add_option("--model", base, "base model directory")->required();
  app.add_option("--adapter", adapter, "PEFT LoRA adapter directory")->required();
  app.add_option("--out", out, "output directory (must not exist)")->required();
  app.add_option("--max-shard-size", shard, "largest safetensors shard, e.g. 5GB, 500MB");
  app.add_option("--dtype", dtype, "auto (the base model's), fp32, bf16, fp16");
  CLI::Option* qlora_flag =
      app.add_flag("--qlora", qlora,
                   "the adapter was trained on an NF4 base (lora.quantize_base): merge into the base linears as "
                   "training saw them, dequantize(quantize(W)), rather than into W");
  app.add_option("--qlora-dtype", qlora_dtype,
                 "with --qlora: model.dtype of the training run, the dtype the base was quantised from (bf16, "
                 "fp32, fp16; default bf16)")
      ->needs(qlora_flag);
  app.add_flag("--no-double-quant", no_double_quant, "with --qlora: the run had lora.double_quant: false")
      ->needs(qlora_flag);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const int64_t max_shard = model::parse_size(shard);
  // Merge in float32 whatever the output dtype, so B·A is not rounded twice.
  model::CausalLM m = model::CausalLM::load(base, at::kFloat, at::kCPU);
  if (qlora) {
    const at::ScalarType from = model::parse_dtype(qlora_dtype);
    c10::NoGradGuard no_grad;
    for (model::Linear* l : m.linears())  // in place: state_dict() shares the storage
      l->weight.copy_(model::quantize_nf4(l->weight.to(from), !no_double_quant).dequantize());
  }
  const model::LoraConfig cfg = model::load_adapter(m, adapter);
  model::merge_lora(m);
  const at::ScalarType out_dtype =
      dtype == "auto" ? model::parse_dtype(m.config().torch_dtype) : model::parse_dtype(dtype);
  model::export_hf_model(m, out, out_dtype, max_shard);
  std::string nf4;
  if (qlora) nf4 = fmt::format(" (NF4 from {}{})", qlora_dtype, no_double_quant ? "" : ", double quant");
  fmt::print("merged {} (r={}, alpha={}) into {}{} -> {} ({})\n", adapter, cfg.r, cfg.alpha, base, nf4, out,
             model::hf_dtype_name(out_dtype));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return lorarun::app_main("lora-merge", argc, argv, run); }
