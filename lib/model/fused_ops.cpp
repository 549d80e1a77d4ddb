#include "model/fused_ops.hpp"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cstdlib>
#include <cstring>
#include <string>

#include "model/cpu_kernels.hpp"

namespace lorarun::model::cpu {
namespace DEFAULT {
extern const Kernels table;
}
#ifdef LORARUN_CPU_X86
namespace AVX2 {
extern const Kernels table;
}
namespace AVX512 {
extern const Kernels table;
}
#endif

const Kernels* kernels_for(std::string_view capability) {
#ifdef LORARUN_CPU_X86
  if (capability == "AVX512") return &AVX512::table;
  if (capability == "AVX2") return &AVX2::table;
#endif
  return capability == "DEFAULT" ? &DEFAULT::table : nullptr;
}

const Kernels& kernels() {
  static const Kernels* chosen = [] {
    const Kernels* k = kernels_for(at::get_cpu_capability());
    return k ? k : &DEFAULT::table;
  }();
  return *chosen;
}

}  // namespace lorarun::model::cpu

namespace lorarun::model::fused {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t kGrainValues = 32768;  // ATen's grain for elementwise loops
constexpr int64_t kGrainRows = 32;

bool cpu_float(const at::Tensor& t) {
  return t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous();
}

struct SwiGlu : torch::autograd::Function<SwiGlu> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& g, const at::Tensor& u) {
    RECORD_FUNCTION("lorarun::swiglu", {});
    at::Tensor y = at::empty_like(g);
    const float *gp = g.const_data_ptr<float>(), *up = u.const_data_ptr<float>();
    float* yp = y.mutable_data_ptr<float>();
    at::parallel_for(0, g.numel(), kGrainValues,
                     [&](int64_t b, int64_t e) { cpu::kernels().swiglu(gp + b, up + b, yp + b, e - b); });
    ctx->save_for_backward({g, u});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("lorarun::swiglu_backward", {});
    const auto saved = ctx->get_saved_variables();
    const at::Tensor dy = grad[0].contiguous();
    at::Tensor dg = at::empty_like(saved[0]), du = at::empty_like(saved[1]);
    const float *dp = dy.const_data_ptr<float>(), *gp = saved[0].const_data_ptr<float>(),
                *up = saved[1].const_data_ptr<float>();
    float *dgp = dg.mutable_data_ptr<float>(), *dup = du.mutable_data_ptr<float>();
    at::parallel_for(0, dy.numel(), kGrainValues, [&](int64_t b, int64_t e) {
      cpu::kernels().swiglu_backward(dp + b, gp + b, up + b, dgp + b, dup + b, e - b);
    });
    return {dg, du};
  }
};

struct RmsNorm : torch::autograd::Function<RmsNorm> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, double eps) {
    RECORD_FUNCTION("lorarun::rms_norm", {});
    const int64_t cols = x.size(-1), rows = x.numel() / cols;
    at::Tensor y = at::empty_like(x), rstd = at::empty({rows}, x.options());
    const float *xp = x.const_data_ptr<float>(), *wp = w.const_data_ptr<float>();
    float *yp = y.mutable_data_ptr<float>(), *sp = rstd.mutable_data_ptr<float>();
    at::parallel_for(0, rows, kGrainRows, [&](int64_t b, int64_t e) {
      cpu::kernels().rms_norm(xp + b * cols, wp, static_cast<float>(eps), yp + b * cols, sp + b, e - b, cols);
    });
    ctx->save_for_backward({x, w, rstd});
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("lorarun::rms_norm_backward", {});
    const auto saved = ctx->get_saved_variables();
    const at::Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    const at::Tensor dy = grad[0].contiguous();
    const int64_t cols = x.size(-1), rows = x.numel() / cols;
    at::Tensor dx = at::empty_like(x);
    const float *dp = dy.const_data_ptr<float>(), *xp = x.const_data_ptr<float>(), *wp = w.const_data_ptr<float>(),
                *sp = rstd.const_data_ptr<float>();
    float* dxp = dx.mutable_data_ptr<float>();
    at::parallel_for(0, rows, kGrainRows, [&](int64_t b, int64_t e) {
      cpu::kernels().rms_norm_backward(dp + b * cols, xp + b * cols, wp, sp + b, dxp + b * cols, e - b, cols);
    });
    return {dx, at::Tensor(), at::Tensor()};
  }
};

// x [B, T, H, D] -> [B, H, T, D]; backward the reverse. cos, sin [B, T, D] (a [B, 1, T, D] view).
struct Rope : torch::autograd::Function<Rope> {
  // f(row of x, row of the output, row of cos/sin) over every (b, t, h), in parallel.
  template <class F>
  static void rows(const at::Tensor& x, F&& f) {
    const int64_t B = x.size(0), T = x.size(1), H = x.size(2), D = x.size(3);
    at::parallel_for(0, B * T * H, kGrainRows, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t b = i / (T * H), t = i / H % T, h = i % H;
        f(i * D, ((b * H + h) * T + t) * D, (b * T + t) * D);
      }
    });
  }

  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    RECORD_FUNCTION("lorarun::rope", {});
    const int64_t D = x.size(3);
    at::Tensor out = at::empty({x.size(0), x.size(2), x.size(1), D}, x.options());
    const float *xp = x.const_data_ptr<float>(), *cp = cos.const_data_ptr<float>(), *sp = sin.const_data_ptr<float>();
    float* op = out.mutable_data_ptr<float>();
    rows(x, [&](int64_t xi, int64_t oi, int64_t ci) { cpu::kernels().rope(xp + xi, cp + ci, sp + ci, op + oi, D); });
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["shape"] = x.sizes();
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad) {
    RECORD_FUNCTION("lorarun::rope_backward", {});
    const auto saved = ctx->get_saved_variables();
    const at::Tensor g = grad[0].contiguous();
    at::Tensor dx = at::empty(ctx->saved_data["shape"].toIntVector(), g.options());
    const int64_t D = dx.size(3);
    const float *gp = g.const_data_ptr<float>(), *cp = saved[0].const_data_ptr<float>(),
                *sp = saved[1].const_data_ptr<float>();
    float* dp = dx.mutable_data_ptr<float>();
    rows(dx, [&](int64_t xi, int64_t oi, int64_t ci) {
      cpu::kernels().rope_backward(gp + oi, cp + ci, sp + ci, dp + xi, D);
    });
    return {dx, at::Tensor(), at::Tensor()};
  }
};

}  // namespace

bool enabled() {
  static const bool on = [] {
    const char* v = std::getenv("LORARUN_CPU_KERNELS");
    return !(v && std::strcmp(v, "aten") == 0);
  }();
  return on;
}

bool swiglu_applies(const at::Tensor& g, const at::Tensor& u) {
  return enabled() && cpu_float(g) && cpu_float(u) && g.sizes() == u.sizes();
}

at::Tensor swiglu(const at::Tensor& g, const at::Tensor& u) { return SwiGlu::apply(g, u); }

bool rms_norm_applies(const at::Tensor& x, const at::Tensor& w) {
  return enabled() && cpu_float(x) && cpu_float(w) && !w.requires_grad() && x.dim() >= 1 && x.size(-1) == w.numel() &&
         x.numel() > 0;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) { return RmsNorm::apply(x, w, eps); }

bool rope_applies(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto table = [&](const at::Tensor& t) {  // [B, 1, T, D], constant
    return cpu_float(t) && !t.requires_grad() && t.dim() == 4 && t.size(0) == x.size(0) && t.size(1) == 1 &&
           t.size(2) == x.size(1) && t.size(3) == x.size(3);
  };
  return enabled() && cpu_float(x) && x.dim() == 4 && x.size(3) % 2 == 0 && table(cos) && table(sin);
}

at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return Rope::apply(x, cos.squeeze(1), sin.squeeze(1));
}

}  // namespace lorarun::model::fused
