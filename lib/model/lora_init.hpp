// How a fresh adapter starts (PEFT's init_lora_weights): Kaiming-uniform or Gaussian A with B = 0,
// or A and B taken from the base weight (PiSSA, OLoRA), which then keeps only the residual.
#pragma once
#include <ATen/core/Generator.h>
#include <cstdint>
#include <optional>
#include <string>

namespace lorarun::model {

struct Linear;

enum class LoraInit { Default, Gaussian, Pissa, Olora };

struct InitMethod {
  LoraInit kind = LoraInit::Default;
  std::optional<int64_t> niter;  // pissa_niter_N: a randomised SVD with N subspace iterations
  bool decomposes() const { return kind == LoraInit::Pissa || kind == LoraInit::Olora; }
};

// "default" | "gaussian" | "pissa" | "pissa_niter_N" (N >= 1) | "olora"; std::nullopt otherwise.
std::optional<InitMethod> parse_init(const std::string& name);

// Sets l.lora_a [r, in] and l.lora_b [out, r] (float32, on W's device) as `how` says, drawing from `gen`:
//   default   A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming_uniform_, a = sqrt(5)), B = 0
//   gaussian  A ~ N(0, 1/r), B = 0
//   pissa     W = U S Vh: B = U_r sqrt(S_r / s), A = sqrt(S_r / s) Vh_r (_niter_N: torch's svd_lowrank)
//   olora     W = Q R: B = Q_r, A = R_r
// With pissa and olora W becomes W - s·BA in its own dtype (NF4 re-quantised from float32, as PEFT
// does), and lora_a0 / lora_b0 keep the start. `scaling` is s. Throws lorarun::Error for a sharded
// weight, pissa on NF4, olora on GPT-2's Conv1D layers (PEFT takes QR of the stored [in, out]) and
// r > min(out, in).
void init_adapter(Linear& l, int64_t r, double scaling, const InitMethod& how, at::Generator& gen);

}  // namespace lorarun::model
