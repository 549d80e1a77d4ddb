// LoRA adapters as PEFT defines them: which layers, how they start, how they are saved.
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lorarun::recipe {
struct LoraSection;
}

namespace lorarun::model {

class CausalLM;
struct Linear;

struct LoraConfig {
  int64_t r = 8;
  double alpha = 16;
  double dropout = 0.0;
  bool use_rslora = false;
  bool use_dora = false;         // DoRA: a learnt magnitude per output row of each adapted layer
  std::string init = "default";  // PEFT's init_lora_weights: default | gaussian | pissa | pissa_niter_N | olora
  std::vector<std::string> modules_to_save = {};      // the embedding and/or "lm_head", trained whole (copies)
  std::vector<int64_t> trainable_token_indices = {};  // embedding rows trained alone (PEFT's TrainableTokens)
  std::vector<std::string> target_modules = {"q_proj", "v_proj"};  // or {"all-linear"}
  // PEFT's target_parameters: stacked expert tensors ("mlp.experts.gate_up_proj"), one adapter per expert
  std::vector<std::string> target_parameters = {};
  // PEFT's conversion of gate_proj + up_proj targets on fused experts: gate_up_proj at rank 2r, alpha 2·alpha
  bool fused_gate_up = false;
  std::string base_model_name_or_path = {};
  int tenant = -1;  // adapters: (a job of many) which adapter of each linear this is (its slot); -1: the one

  double scaling() const;  // alpha / r, or alpha / sqrt(r) with rsLoRA
};

// The recipe's lora.* keys as the adapter's config, for the base model at `base_model`.
LoraConfig lora_config_of(const recipe::LoraSection& lora, const std::string& base_model);

// One line naming the recipe's adapter variant for --dry-run and lora-data preview:
// "LoRA r 8, alpha 16 (scale 2) on q_proj, v_proj; DoRA; LoRA+ …; init pissa …".
std::string describe_adapter(const recipe::LoraSection& lora);

// PEFT's rule: a listed name matches a module whose full name equals it or ends with ".name";
// "all-linear" matches every linear layer but the output projection.
bool matches_target(const std::string& module_name, const LoraConfig& cfg);

// PEFT's reading of a config on a mixture-of-experts model (transformers 5 fused its experts): the
// experts' and router's transformers-4 module names in target_modules (all-linear's included) become
// target_parameters: gate_proj and up_proj (mixtral: w1, w3) together gate_up_proj at rank 2r and
// alpha 2·alpha, down_proj (w2) down_proj, gate the router's gate.weight. Other models: cfg as it is.
// Throws lorarun::Error for gate_proj without up_proj (one tensor holds both).
LoraConfig for_model(const CausalLM& model, LoraConfig cfg);

// Whether a config for_model has made adapts `l`: target_modules match it (a router: target_parameters).
bool adapts(const Linear& l, const LoraConfig& cfg);

// PEFT's rule for target_parameters: the parameter's full name equals a listed one or ends with ".name".
bool matches_parameter(const std::string& parameter_name, const LoraConfig& cfg);

// Adds adapters to the matching layers (and expert tensors), started as cfg.init says (lora_init.hpp; PEFT's default:
// A ~ Kaiming-uniform(a=sqrt(5)), i.e. U(-1/sqrt(in), 1/sqrt(in)); B = 0), drawing from one
// generator seeded with `seed`, layer by layer in model order. Adapters are float32 unless `dtype`
// says otherwise. Throws lorarun::Error, listing the model's layer names, when nothing matches.
void attach_lora(CausalLM& model, const LoraConfig& cfg, uint64_t seed, at::ScalarType dtype = at::kFloat);

// A job of many adapters (adapters:): adapter `slot` of `slots` added to the matching layers, started
// as attach_lora starts an adapter with the same config and seed (default or gaussian init); the
// linears' other slots stay empty until theirs are added. Throws as attach_lora does.
void attach_tenant(CausalLM& model, const LoraConfig& cfg, uint64_t seed, int slot, int slots);
// Adapter `slot`'s A and B of each layer it adapts, in model order: under PEFT's names, and alone.
std::vector<std::pair<std::string, at::Tensor>> tenant_state(const CausalLM& model, int slot);
std::vector<at::Tensor> tenant_parameters(const CausalLM& model, int slot);
// lora.init_from for adapter `slot` of a job: its A and B set to the PEFT adapter's in `dir`, which
// must hold exactly those tensors, with `cfg`'s r, alpha and use_rslora; ConfigError naming what
// differs, lorarun::Error for a damaged file.
void start_tenant_from(CausalLM& model, int slot, const LoraConfig& cfg, const std::string& dir);

// The trainable tensors, A, B (and DoRA's magnitude) for each adapted layer in model order, then
// the trained tables (modules_to_save's embedding and head copies, trainable tokens' rows).
std::vector<at::Tensor> lora_parameters(const CausalLM& model);
// PEFT's state-dict names and tensors: "base_model.model.<module>.lora_A.weight", …, and for the
// tables "base_model.model.<embedding>.weight", "base_model.model.lm_head.weight",
// "base_model.model.<embedding>.token_adapter.trainable_tokens_delta".
std::vector<std::pair<std::string, at::Tensor>> lora_state(const CausalLM& model);

// "trainable params: 1,024 || all params: 9,999 || trainable%: 10.2410", like PEFT's summary.
std::string trainable_summary(const CausalLM& model);
// "base linears in NF4: 6815744 parameters in 3.4 MiB (0.5159 bytes each)" (whole, before sharding).
std::string nf4_summary(const CausalLM& model);
// "base linears kept as the GGUF's blocks (Q4_1 210): 106168320 parameters in 59.7 MiB (0.5625 bytes each)".
std::string gguf_blocks_summary(const CausalLM& model);

// Writes adapter_config.json + adapter_model.safetensors into `dir` (created; files atomic); with
// cfg.tenant, that adapter of a job of many.
// Layers started by PiSSA or OLoRA are saved for the original base, as PEFT's
// save_pretrained(path_initial_model_for_weight_conversion=…) does: A' = [A; A0], B' = [B, -B0],
// r' = 2r and alpha' = 2·alpha (sqrt(2)·alpha with rsLoRA), so W + s·B'A' = (W - s·B0A0) + s·BA.
void save_adapter(const CausalLM& model, const LoraConfig& cfg, const std::string& dir);

// Reads a PEFT LoRA adapter directory and attaches it. Throws lorarun::Error for a missing
// file, a non-LoRA or unsupported config, unknown keys, or shapes made for another base model.
LoraConfig load_adapter(CausalLM& model, const std::string& dir, at::ScalarType dtype = at::kFloat);

// Folds every adapter into its base weight (W += s·BA; DoRA: W = m/||W + s·BA||_row ⊙ (W + s·BA))
// and the trained tables into the embedding and head, and drops them. Throws lorarun::Error for an
// NF4 weight, and for tables that would untie a tied head.
void merge_lora(CausalLM& model);

}  // namespace lorarun::model
