// The fused CPU ops (SwiGLU, RMSNorm, rotary embedding, softmax cross-entropy) against ATen's composition of the same
// maths, in every capability this CPU runs, on sizes that leave partial vectors.
#include <ATen/ATen.h>
#include <ATen/Version.h>
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "model/cpu_kernels.hpp"
#include "model/fused_ops.hpp"
#include "model/loss.hpp"

using namespace lorarun::model;

namespace {

// The capabilities built that this CPU can run, up to ATen's own choice.
std::vector<std::string> runnable() {
  std::vector<std::string> out;
  const std::string mine = at::get_cpu_capability();
  for (const std::string c : {"DEFAULT", "AVX2", "AVX512"}) {
    if (cpu::kernels_for(c)) out.push_back(c);
    if (c == mine) break;
  }
  return out;
}

double rel_diff(const at::Tensor& a, const at::Tensor& b) {
  return (a - b).abs().max().item<double>() / b.abs().max().item<double>();
}

}  // namespace

TEST_CASE("fused SwiGLU equals silu(g) * u and its autograd gradients, in every CPU capability") {
  at::manual_seed(3);
  const at::Tensor g = at::randn({3, 37, 101}) * 4, u = at::randn({3, 37, 101}), dy = at::randn({3, 37, 101});
  const at::Tensor ga = g.clone().requires_grad_(), ua = u.clone().requires_grad_();
  const at::Tensor ya = at::silu(ga) * ua;
  ya.backward(dy);
  const int64_t n = g.numel();
  for (const std::string& cap : runnable()) {
    INFO(cap);
    const cpu::Kernels& k = *cpu::kernels_for(cap);
    at::Tensor y = at::empty_like(g), dg = at::empty_like(g), du = at::empty_like(g);
    k.swiglu(g.const_data_ptr<float>(), u.const_data_ptr<float>(), y.mutable_data_ptr<float>(), n);
    k.swiglu_backward(dy.const_data_ptr<float>(), g.const_data_ptr<float>(), u.const_data_ptr<float>(),
                      dg.mutable_data_ptr<float>(), du.mutable_data_ptr<float>(), n);
    CHECK(rel_diff(y, ya) <= 1e-6);
    CHECK(rel_diff(du, ua.grad()) <= 1e-6);
    CHECK(rel_diff(dg, ga.grad()) <= 1e-6);
    // A value's bits do not depend on where its range starts (threads split ranges anywhere).
    at::Tensor part = at::empty({n - 5});
    k.swiglu(g.const_data_ptr<float>() + 5, u.const_data_ptr<float>() + 5, part.mutable_data_ptr<float>(), n - 5);
    CHECK(at::equal(part, y.flatten().narrow(0, 5, n - 5)));
  }
  // The autograd op, as the model calls it.
  const at::Tensor gf = g.clone().requires_grad_(), uf = u.clone().requires_grad_();
  REQUIRE(fused::swiglu_applies(gf, uf));
  const at::Tensor yf = fused::swiglu(gf, uf);
  yf.backward(dy);
  CHECK(rel_diff(yf, ya) <= 1e-6);
  CHECK(rel_diff(gf.grad(), ga.grad()) <= 1e-6);
  CHECK(rel_diff(uf.grad(), ua.grad()) <= 1e-6);
  CHECK_FALSE(fused::swiglu_applies(g.to(at::kBFloat16), u.to(at::kBFloat16)));
  CHECK_FALSE(fused::swiglu_applies(g.transpose(0, 1), u.transpose(0, 1)));
}

TEST_CASE("fused RMSNorm equals HF's float32 RMSNorm and its input gradient, in every CPU capability") {
  at::manual_seed(4);
  const int64_t rows = 29, cols = 83;
  const double eps = 1e-5;
  const at::Tensor x = at::randn({rows, cols}) * 3, w = at::rand({cols}) + 0.5, dy = at::randn({rows, cols});
  const at::Tensor xa = x.clone().requires_grad_();
  const at::Tensor ya = w * (xa * at::rsqrt(xa.pow(2).mean(-1, true) + eps));
  ya.backward(dy);
  for (const std::string& cap : runnable()) {
    INFO(cap);
    const cpu::Kernels& k = *cpu::kernels_for(cap);
    at::Tensor y = at::empty_like(x), rstd = at::empty({rows}), dx = at::empty_like(x);
    k.rms_norm(x.const_data_ptr<float>(), w.const_data_ptr<float>(), eps, y.mutable_data_ptr<float>(),
               rstd.mutable_data_ptr<float>(), rows, cols);
    k.rms_norm_backward(dy.const_data_ptr<float>(), x.const_data_ptr<float>(), w.const_data_ptr<float>(),
                        rstd.const_data_ptr<float>(), dx.mutable_data_ptr<float>(), rows, cols);
    CHECK(rel_diff(y, ya) <= 2e-6);
    CHECK(rel_diff(dx, xa.grad()) <= 2e-6);
    // A row's bits are its own: rows 7.. alone give what they gave in the whole batch.
    at::Tensor part = at::empty({rows - 7, cols}), prstd = at::empty({rows - 7});
    k.rms_norm(x[7].const_data_ptr<float>(), w.const_data_ptr<float>(), eps, part.mutable_data_ptr<float>(),
               prstd.mutable_data_ptr<float>(), rows - 7, cols);
    CHECK(at::equal(part, y.narrow(0, 7, rows - 7)));
  }
  const at::Tensor xf = x.clone().requires_grad_();
  REQUIRE(fused::rms_norm_applies(xf, w));
  const at::Tensor yf = fused::rms_norm(xf, w, eps);
  yf.backward(dy);
  CHECK(rel_diff(yf, ya) <= 2e-6);
  CHECK(rel_diff(xf.grad(), xa.grad()) <= 2e-6);
  CHECK_FALSE(fused::rms_norm_applies(x, w.clone().requires_grad_()));  // a trained weight: ATen's ops
}

TEST_CASE("fused softmax cross-entropy equals log_softmax's loss and softmax - one-hot, in every CPU capability") {
  at::manual_seed(5);
  const int64_t rows = 6, vocab = 1001;
  const at::Tensor z = at::randn({rows, vocab}) * 5, t = at::randint(vocab, {rows}, at::kLong);
  const at::Tensor logp = at::log_softmax(z, 1);
  const at::Tensor loss_ref = logp.gather(1, t.unsqueeze(1)).squeeze(1).neg();
  const at::Tensor grad_ref = logp.exp().scatter_add(1, t.unsqueeze(1), at::full({rows, 1}, -1.0));
  for (const std::string& cap : runnable()) {
    INFO(cap);
    at::Tensor zc = z.clone(), loss = at::empty({rows});
    cpu::kernels_for(cap)->softmax_cross_entropy(zc.mutable_data_ptr<float>(), t.const_data_ptr<int64_t>(),
                                                 loss.mutable_data_ptr<float>(), rows, vocab);
    CHECK(rel_diff(loss, loss_ref) <= 1e-6);
    CHECK((zc - grad_ref).abs().max().item<double>() <= 1e-6);
  }
}

TEST_CASE("fused rotary embedding equals x * cos + rotate_half(x) * sin on [B, H, T, D] and its gradient") {
  at::manual_seed(6);
  const int64_t B = 2, T = 11, H = 3, D = 38;  // half of D = 19: partial vectors in every capability
  const at::Tensor x = at::randn({B, T, H, D}), angles = at::randn({B, 1, T, D / 2}).repeat({1, 1, 1, 2}) * 3;
  const at::Tensor cos = angles.cos(), sin = angles.sin(), dy = at::randn({B, H, T, D});
  const auto rotate_half = [](const at::Tensor& t) {
    return at::cat({t.narrow(-1, t.size(-1) / 2, t.size(-1) / 2).neg(), t.narrow(-1, 0, t.size(-1) / 2)}, -1);
  };
  const at::Tensor xa = x.clone().requires_grad_();
  const at::Tensor xt = xa.transpose(1, 2);
  const at::Tensor ya = xt * cos + rotate_half(xt) * sin;
  ya.backward(dy);
  for (const std::string& cap : runnable()) {
    INFO(cap);
    const cpu::Kernels& k = *cpu::kernels_for(cap);
    at::Tensor row = at::empty({D}), back = at::empty({D});
    // One row: batch 1, position 4, head 2.
    k.rope(x[1][4][2].const_data_ptr<float>(), cos[1][0][4].const_data_ptr<float>(),
           sin[1][0][4].const_data_ptr<float>(), row.mutable_data_ptr<float>(), D);
    CHECK(rel_diff(row, ya[1][2][4]) <= 1e-6);
    k.rope_backward(dy[1][2][4].const_data_ptr<float>(), cos[1][0][4].const_data_ptr<float>(),
                    sin[1][0][4].const_data_ptr<float>(), back.mutable_data_ptr<float>(), D);
    CHECK(rel_diff(back, xa.grad()[1][4][2]) <= 1e-6);
  }
  const at::Tensor xf = x.clone().requires_grad_();
  REQUIRE(fused::rope_applies(xf, cos, sin));
  const at::Tensor yf = fused::rope(xf, cos, sin);
  CHECK(yf.sizes() == ya.sizes());
  CHECK(yf.is_contiguous());
  yf.backward(dy);
  CHECK(rel_diff(yf, ya) <= 1e-6);
  CHECK(rel_diff(xf.grad(), xa.grad()) <= 1e-6);
  CHECK_FALSE(fused::rope_applies(x, cos.narrow(-1, 0, D / 2), sin.narrow(-1, 0, D / 2)));  // partial rotary
  CHECK_FALSE(fused::rope_applies(x, cos.expand({B, 1, T, D}).narrow(0, 0, 1), sin.narrow(0, 0, 1)));
}

TEST_CASE("the fused loss refuses a target token id outside the vocabulary instead of writing past the logits") {
  const at::Tensor hidden = at::randn({1, 4, 8}), head = at::randn({10, 8}), rows = at::arange(4);
  CHECK_NOTHROW(lm_head_loss(hidden, head, rows, at::tensor({1, 2, 3, 9}, at::kLong)));
  CHECK_THROWS_WITH(lm_head_loss(hidden, head, rows, at::tensor({1, 2, 3, 10}, at::kLong)),
                    Catch::Contains("outside the model's vocabulary of 10"));
  CHECK_THROWS_WITH(lm_head_loss(hidden, head, rows, at::tensor({-1, 2, 3, 4}, at::kLong)),
                    Catch::Contains("outside the model's vocabulary"));
}
