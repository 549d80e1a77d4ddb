// Mixture-of-experts MLPs (qwen3_moe, mixtral) as transformers computes them: the router's softmax in
// float32 over every expert, the top k, renormalised when the family does, each token's k expert
// outputs summed by those weights; tokens grouped by expert so that each expert runs once, on its rows.
#include <ATen/ATen.h>

#include "model/fused_ops.hpp"
#include "model/transformer.hpp"

namespace lorarun::model {

at::Tensor Experts::forward(int64_t e, const at::Tensor& rows) const {
  const at::Tensor y = at::linear(rows, weight.select(0, e));
  if (!adapted() || adapter_off) return y;
  const int64_t r = lora_a.size(0) / count();
  const at::Tensor a = lora_a.narrow(0, e * r, r);                              // [r, in]
  const at::Tensor b = lora_b.view({out_features(), r, count()}).select(2, e);  // [out, r]
  const at::Tensor delta = at::linear(at::linear(rows.to(lora_a.scalar_type()), a), b) * scaling;
  return y + delta.to(y.scalar_type());
}

at::Tensor CausalLM::moe(const MoeMlp& m, const at::Tensor& x, bool record, const Routes* routes) const {
  const MoeConfig& c = config_.moe;
  const int64_t k = c.top_k, E = c.experts;
  const at::Tensor rows = x.reshape({-1, x.size(-1)});                                             // [N, H]
  const at::Tensor probs = at::softmax(m.router.forward(rows, training, routes), -1, at::kFloat);  // [N, E]
  auto [weights, chosen] = at::topk(probs, k, -1);                                                 // [N, k]
  if (c.normalize_top_k) weights = weights / weights.sum(-1, true);
  if (!c.float_weights) weights = weights.to(x.scalar_type());
  // The N·k assignments sorted by expert (stably: each expert's tokens in order), so each expert's
  // rows are one slice; the outputs summed per token in expert order, as transformers' loop adds them.
  const at::Tensor flat = chosen.flatten();
  const at::Tensor order = at::argsort(flat, /*stable=*/true);
  const at::Tensor token = at::floor_divide(order, k);
  const at::Tensor counts = at::bincount(flat, {}, E).cpu();
  const at::Tensor routed = rows.index_select(0, token);  // [N·k, H]
  std::vector<at::Tensor> outs;
  int64_t start = 0;
  const bool silu = config_.activation == "silu" || config_.activation == "swish";
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = counts[e].item<int64_t>();
    if (n == 0) continue;
    const auto gu = m.gate_up.forward(e, routed.narrow(0, start, n)).chunk(2, -1);
    const at::Tensor h =
        silu && fused::swiglu_applies(gu[0], gu[1]) ? fused::swiglu(gu[0], gu[1]) : at::silu(gu[0]) * gu[1];
    outs.push_back(m.down.forward(e, h));
    start += n;
  }
  const at::Tensor y = at::cat(outs) * weights.flatten().index_select(0, order).unsqueeze(1);
  if (record) {  // transformers' load_balancing_loss_func sums, over the real tokens only
    const at::Tensor& mask = router_mask_;
    const at::Tensor assigned = at::zeros({E}, probs.options()).scatter_add(0, flat, mask.repeat_interleave(k));
    router_sums_.emplace_back(assigned.detach(), (probs * mask.unsqueeze(1)).sum(0));
  }
  return at::zeros_like(rows).index_add(0, token, y.to(rows.scalar_type())).view(x.sizes());
}

RouterPass CausalLM::router_pass() const {
  if (router_sums_.empty()) return {};
  const auto layers = static_cast<double>(router_sums_.size());
  const at::Tensor tokens = router_mask_.sum() * layers;
  at::Tensor assigned = router_sums_[0].first, probs = router_sums_[0].second;
  std::vector<at::Tensor> load = {assigned};
  for (size_t l = 1; l < router_sums_.size(); ++l) {
    assigned = assigned + router_sums_[l].first;
    probs = probs + router_sums_[l].second;
    load.push_back(router_sums_[l].first);
  }
  const at::Tensor loss = ((assigned / tokens) * (probs / tokens)).sum() * static_cast<double>(config_.moe.experts);
  return {loss, at::stack(load).to(at::kDouble)};
}

std::vector<MoeMlp*> CausalLM::moe_layers() {
  std::vector<MoeMlp*> out;
  for (Block& b : blocks_)
    if (b.moe.defined()) out.push_back(&b.moe);
  return out;
}

std::vector<const MoeMlp*> CausalLM::moe_layers() const {
  std::vector<const MoeMlp*> out;
  for (MoeMlp* m : const_cast<CausalLM*>(this)->moe_layers()) out.push_back(m);
  return out;
}

}  // namespace lorarun::model
