// lora-merge: fold a LoRA adapter into its base model and write a Hugging Face model directory.
#include <CLI/CLI.hpp>
#include <ATen/ATen.h>
#include <fmt/format.h>

#include "app_main.hpp"
#include "model/export.hpp"
#include "model/lora.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"

namespace {

using namespace lorarun;

int run(int argc, char** argv) {
  CLI::App app{"lora-merge: fold a LoRA adapter into its base model, write a HF model directory"};
  std::string base, adapter, out, shard = "5GB", dtype = "auto";
  app.add_option("--model", base, "base model directory")->required();
  app.add_option("--adapter", adapter, "PEFT LoRA adapter directory")->required();
  app.add_option("--out", out, "output directory (must not exist)")->required();
  app.add_option("--max-shard-size", shard, "largest safetensors shard, e.g. 5GB, 500MB");
  app.add_option("--dtype", dtype, "auto (the base model's), fp32, bf16, fp16");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  const int64_t max_shard = model::parse_size(shard);
  // Merge in float32 whatever the output dtype, so B·A is not rounded twice.
  model::CausalLM m = model::CausalLM::load(base, at::kFloat, at::kCPU);
  const model::LoraConfig cfg = model::load_adapter(m, adapter);
  model::merge_lora(m);
  const at::ScalarType out_dtype = dtype == "auto" ? model::parse_dtype(m.config().torch_dtype) : model::parse_dtype(dtype);
  model::export_hf_model(m, out, out_dtype, max_shard);
  fmt::print("merged {} (r={}, alpha={}) into {} -> {} ({})\n", adapter, cfg.r, cfg.alpha, base, out,
             model::hf_dtype_name(out_dtype));
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return lorarun::app_main("lora-merge", argc, argv, run); }
