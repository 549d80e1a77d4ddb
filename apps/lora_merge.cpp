// lora-merge: fold a LoRA adapter into its base model and write a Hugging Face model directory, or
// one GGUF file (--out FILE.gguf) as llama.cpp's converter writes it.
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <filesystem>

#include "app_main.hpp"
#include "model/export.hpp"
#include "model/gguf_export.hpp"
#include "model/gguf_weights.hpp"
#include "model/lora.hpp"
#include "model/nf4.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "track/pulled.hpp"

namespace {

using namespace lorarun;

int run(int argc, char** argv) {
  CLI::App app{"lora-merge: fold a LoRA adapter into its base model, write a HF model directory or a GGUF file"};
  std::string base, adapter, out, shard = "5GB", dtype = "auto", qlora_dtype = "bf16", gguf_type;
  bool qlora = false, no_double_quant = false;
  app.add_option("--model", base, "base model directory or .gguf file")->required();
  app.add_option("--adapter", adapter,
                 "PEFT LoRA adapter directory, or mongodb-run:DATABASE/ID[/epoch_N|/best], a run's stored adapter "
                 "(checkpoint.store: mongodb; server from $LORARUN_MONGODB_URI)")
      ->required();
  app.add_option("--out", out, "output directory, or FILE.gguf for one GGUF file (must not exist)")->required();
  app.add_option("--gguf-type", gguf_type,
                 "with --out FILE.gguf: type of the 2-D weights, f32, f16, bf16 or q8_0 (default f16, as llama.cpp's "
                 "converter; norms and biases stay f32)");
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
  const track::AdapterSource source(adapter);  // mongodb-run:…: pulled into a temporary directory
  adapter = source.dir();
  const bool gguf = model::is_gguf_path(out);
  if (!gguf && !gguf_type.empty())
    throw Error(fmt::format("--gguf-type {} needs a GGUF output: --out FILE.gguf", gguf_type));
  const io::GgmlType out_type = model::parse_gguf_type(gguf_type.empty() ? "f16" : gguf_type);
  if (gguf && std::filesystem::exists(out))  // before the merge, not after it
    throw Error(fmt::format("{} already exists: choose another output or remove it", out));
  const int64_t max_shard = model::parse_size(shard);
  // Merge in float32 whatever the output dtype, so B·A is not rounded twice.
  model::CausalLM m = model::CausalLM::load(base, at::kFloat, at::kCPU);
  if (qlora) {
    const at::ScalarType from = model::parse_dtype(qlora_dtype);
    c10::NoGradGuard no_grad;
    for (model::Linear* l : m.linears())  // in place: state_dict() shares the storage
      if (!l->router) l->weight.copy_(model::quantize_nf4(l->weight.to(from), !no_double_quant).dequantize());
  }
  const model::LoraConfig cfg = model::load_adapter(m, adapter);
  model::merge_lora(m);
  std::string nf4, written;
  if (qlora) nf4 = fmt::format(" (NF4 from {}{})", qlora_dtype, no_double_quant ? "" : ", double quant");
  if (gguf) {
    model::export_gguf(m, out, out_type);
    written = fmt::format("GGUF {}", io::ggml_type_name(out_type));
  } else {
    const at::ScalarType out_dtype =
        dtype == "auto" ? model::parse_dtype(m.config().torch_dtype) : model::parse_dtype(dtype);
    model::export_hf_model(m, out, out_dtype, max_shard);
    written = model::hf_dtype_name(out_dtype);
  }
  fmt::print("merged {} (r={}, alpha={}) into {}{} -> {} ({})\n", adapter, cfg.r, cfg.alpha, base, nf4, out, written);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return lorarun::app_main("lora-merge", argc, argv, run); }
