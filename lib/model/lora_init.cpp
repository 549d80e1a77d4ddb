#include "model/lora_init.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <algorithm>
#include <cmath>
#include <tuple>

#include "model/transformer.hpp"
#include "util/error.hpp"

namespace lorarun::model {
namespace {

// torch.svd_lowrank(w, q, niter) (Halko et al. 2009, Algorithm 5.1; torch/_lowrank.py): (U, S, V)
// of rank q, its random test matrix drawn from `gen` as torch draws it from its default generator.
std::tuple<at::Tensor, at::Tensor, at::Tensor> svd_lowrank(const at::Tensor& w, int64_t q, int64_t niter,
                                                           at::Generator& gen) {
  const bool wide = w.size(0) < w.size(1);
  const at::Tensor a = wide ? w.t() : w;  // tall
  const at::Tensor test = at::randn({a.size(1), q}, gen, a.options().device(at::kCPU)).to(a.device());
  at::Tensor basis = std::get<0>(at::linalg_qr(at::matmul(a, test)));
  for (int64_t i = 0; i < niter; ++i) {
    basis = std::get<0>(at::linalg_qr(at::matmul(a.t(), basis)));
    basis = std::get<0>(at::linalg_qr(at::matmul(a, basis)));
  }
  auto [u, s, vh] = at::linalg_svd(at::matmul(basis.t(), a), false);
  at::Tensor left = at::matmul(basis, u), right = vh.t();
  if (wide) std::swap(left, right);
  return {left, s, right};
}

// (A, B) of PiSSA: the r principal singular directions of w [out, in], split evenly by sqrt(S / s).
std::pair<at::Tensor, at::Tensor> pissa(const at::Tensor& w, int64_t r, double scaling, const InitMethod& how,
                                        at::Generator& gen) {
  at::Tensor u, s, vh;
  if (how.niter) {
    at::Tensor v;
    std::tie(u, s, v) = svd_lowrank(w, r, *how.niter, gen);
    vh = v.t();
  } else {
    std::tie(u, s, vh) = at::linalg_svd(w, false);
    u = u.narrow(1, 0, r);
    s = s.narrow(0, 0, r);
    vh = vh.narrow(0, 0, r);
  }
  const at::Tensor root = at::sqrt(s / scaling);
  return {(root.unsqueeze(1) * vh).contiguous(), (u * root.unsqueeze(0)).contiguous()};
}

}  // namespace

std::optional<InitMethod> parse_init(const std::string& name) {
  if (name == "default") return InitMethod{};
  if (name == "gaussian") return InitMethod{.kind = LoraInit::Gaussian, .niter = {}};
  if (name == "pissa") return InitMethod{.kind = LoraInit::Pissa, .niter = {}};
  if (name == "olora") return InitMethod{.kind = LoraInit::Olora, .niter = {}};
  constexpr std::string_view prefix = "pissa_niter_";
  if (!name.starts_with(prefix) || name.size() == prefix.size() || name.size() > prefix.size() + 4) return std::nullopt;
  int64_t n = 0;
  for (const char c : name.substr(prefix.size())) {
    if (c < '0' || c > '9') return std::nullopt;
    n = n * 10 + (c - '0');
  }
  if (n < 1 || n > 1000) return std::nullopt;  // (the recipe's bound)
  return InitMethod{.kind = LoraInit::Pissa, .niter = n};
}

void init_adapter(Linear& l, int64_t r, double scaling, const InitMethod& how, at::Generator& gen) {
  const int64_t in = l.in_features(), out = l.out_features();
  const at::TensorOptions f32 = at::TensorOptions().dtype(at::kFloat);
  if (!how.decomposes()) {
    l.lora_a = how.kind == LoraInit::Gaussian
                   ? at::empty({r, in}, f32).normal_(0.0, 1.0 / double(r), gen)
                   : at::empty({r, in}, f32).uniform_(-1.0 / std::sqrt(double(in)), 1.0 / std::sqrt(double(in)), gen);
    l.lora_b = at::zeros({out, r}, f32);
    return;
  }
  const char* what = how.kind == LoraInit::Pissa ? "pissa" : "olora";
  if (l.sharded)
    throw Error(
        fmt::format("lora.init {} needs {}'s whole weight, which dist.shard_base splits: set "
                    "dist.shard_base: false",
                    what, l.name));
  if (l.blocks)
    throw Error(
        fmt::format("lora.init {} rewrites {}'s weight, which model.keep_quantized holds as the GGUF's own "
                    "blocks: set model.keep_quantized: false, or lora.init: default",
                    what, l.name));
  if (l.nf4 && how.kind == LoraInit::Pissa)
    throw Error(
        fmt::format("lora.init pissa needs {}'s weight in float, and lora.quantize_base holds it in NF4 (PEFT "
                    "refuses this too): drop quantize_base, or use lora.init olora",
                    l.name));
  if (l.conv1d && how.kind == LoraInit::Olora)
    throw Error(
        fmt::format("lora.init olora does not fit GPT-2's Conv1D layer {} (PEFT takes the QR of the stored "
                    "[in, out] weight, which gives A and B the wrong shapes): use lora.init pissa",
                    l.name));
  // (a decomposition has min(out, in) directions: a larger r would give A and B of another rank)
  if (r > std::min(in, out))
    throw Error(
        fmt::format("lora.init {} takes r directions of each weight, but {} is [{}, {}] and lora.r is {}: "
                    "set lora.r to at most {}",
                    what, l.name, out, in, r, std::min(in, out)));
  c10::NoGradGuard no_grad;
  const at::Tensor w = (l.nf4 ? l.nf4->dequantize() : l.weight).to(at::kFloat);
  at::Tensor a, b;
  if (how.kind == LoraInit::Pissa) {
    std::tie(a, b) = pissa(w, r, scaling, how, gen);
  } else {
    auto [q, rr] = at::linalg_qr(w);
    a = rr.narrow(0, 0, r).contiguous();
    b = q.narrow(1, 0, r).contiguous();
  }
  const at::Tensor residual = w - scaling * at::matmul(b, a);
  if (l.nf4) {
    const at::ScalarType dtype = l.nf4->dtype;
    l.nf4 = quantize_nf4(residual, l.nf4->double_quant());  // from float32, as PEFT's Params4bit
    l.nf4->dtype = dtype;
  } else {
    l.weight = residual.to(l.weight.scalar_type());
  }
  l.lora_a = a;
  l.lora_b = b;
  l.lora_a0 = a.clone();
  l.lora_b0 = b.clone();
}

}  // namespace lorarun::model
