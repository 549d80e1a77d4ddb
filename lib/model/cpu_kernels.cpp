// Compiled once per CPU capability (CMakeLists: CPU_CAPABILITY = DEFAULT, AVX2, AVX512, with that
// capability's flags), like ATen's own kernels: at::vec::Vectorized<float> is then that ISA's vector.
// Every value goes through the vector path (a short tail is a partial load), so a value's result does
// not depend on where a range starts: a row computed in a job of many adapters or in its own run, or
// split differently across threads, gets the same bits. The expressions are ATen's own (silu,
// silu_backward, log_softmax), so SwiGLU's results equal at::silu(g) * u's.
#include <ATen/cpu/vec/vec.h>

#include <array>
#include <cmath>
#include <limits>

#include "model/cpu_kernels.hpp"

#ifndef CPU_CAPABILITY
#error "cpu_kernels.cpp is compiled with CPU_CAPABILITY defined (see lib/model/CMakeLists.txt)"
#endif

namespace lorarun::model::cpu {
namespace CPU_CAPABILITY {
namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

// f(Vec values, offset, count) over [0, n) in vector steps, the last one partial.
template <class F>
void each_vector(int64_t n, F&& f) {
  for (int64_t i = 0; i < n; i += kLanes) f(i, std::min<int64_t>(kLanes, n - i));
}

float lane_sum(const Vec& v) {
  std::array<float, kLanes> a;
  v.store(a.data());
  float s = 0;
  for (const float x : a) s += x;
  return s;
}

float lane_max(const Vec& v) {
  std::array<float, kLanes> a;
  v.store(a.data());
  float m = -std::numeric_limits<float>::infinity();
  for (const float x : a) m = std::max(m, x);
  return m;
}

void swiglu(const float* g, const float* u, float* y, int64_t n) {
  const Vec one(1.f);
  each_vector(n, [&](int64_t i, int64_t c) {
    const Vec x = Vec::loadu(g + i, c);
    const Vec silu = x / (one + x.neg().exp());  // at::silu's expression
    (silu * Vec::loadu(u + i, c)).store(y + i, static_cast<int>(c));
  });
}

// As autograd runs silu(g) * u backward: du = dy * silu(g), then silu_backward(dy * u, g).
void swiglu_backward(const float* dy, const float* g, const float* u, float* dg, float* du, int64_t n) {
  const Vec one(1.f);
  each_vector(n, [&](int64_t i, int64_t c) {
    const Vec x = Vec::loadu(g + i, c), d = Vec::loadu(dy + i, c);
    const Vec denominator = one + x.neg().exp();  // silu's and sigmoid's, computed once
    const Vec silu = x / denominator;
    (d * silu).store(du + i, static_cast<int>(c));
    const Vec sigmoid = one / denominator;
    ((d * Vec::loadu(u + i, c)) * sigmoid * (one + x * (one - sigmoid))).store(dg + i, static_cast<int>(c));
  });
}

void rms_norm(const float* x, const float* w, float eps, float* y, float* rstd, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * cols;
    Vec acc(0.f);
    each_vector(cols, [&](int64_t i, int64_t c) {
      const Vec v = Vec::loadu(xr + i, c);
      acc = at::vec::fmadd(v, v, acc);
    });
    const float s = 1.f / std::sqrt(lane_sum(acc) / static_cast<float>(cols) + eps);
    rstd[r] = s;
    const Vec sv(s);
    each_vector(cols, [&](int64_t i, int64_t c) {
      (Vec::loadu(w + i, c) * (Vec::loadu(xr + i, c) * sv)).store(y + r * cols + i, static_cast<int>(c));
    });
  }
}

// dx = s * (w dy) - x * s^3 * mean(w dy x), s the row's rstd.
void rms_norm_backward(const float* dy, const float* x, const float* w, const float* rstd, float* dx, int64_t rows,
                       int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) {
    const float *xr = x + r * cols, *dr = dy + r * cols;
    Vec acc(0.f);
    each_vector(cols, [&](int64_t i, int64_t c) {
      acc = at::vec::fmadd(Vec::loadu(dr + i, c) * Vec::loadu(w + i, c), Vec::loadu(xr + i, c), acc);
    });
    const float s = rstd[r];
    const Vec sv(s), kv(lane_sum(acc) / static_cast<float>(cols) * s * s * s);
    each_vector(cols, [&](int64_t i, int64_t c) {
      const Vec gw = Vec::loadu(dr + i, c) * Vec::loadu(w + i, c);
      (gw * sv - Vec::loadu(xr + i, c) * kv).store(dx + r * cols + i, static_cast<int>(c));
    });
  }
}

// out = x * cos + rotate_half(x) * sin, as ATen computes it: two products, then their sum.
void rope(const float* x, const float* cos, const float* sin, float* out, int64_t d) {
  const int64_t h = d / 2;
  each_vector(h, [&](int64_t i, int64_t c) {
    const Vec x1 = Vec::loadu(x + i, c), x2 = Vec::loadu(x + h + i, c);
    (x1 * Vec::loadu(cos + i, c) + x2.neg() * Vec::loadu(sin + i, c)).store(out + i, static_cast<int>(c));
    (x2 * Vec::loadu(cos + h + i, c) + x1 * Vec::loadu(sin + h + i, c)).store(out + h + i, static_cast<int>(c));
  });
}

// dx1 = g1 cos1 + g2 sin2, dx2 = g2 cos2 - g1 sin1 (the transpose of the rotation above).
void rope_backward(const float* g, const float* cos, const float* sin, float* dx, int64_t d) {
  const int64_t h = d / 2;
  each_vector(h, [&](int64_t i, int64_t c) {
    const Vec g1 = Vec::loadu(g + i, c), g2 = Vec::loadu(g + h + i, c);
    (g1 * Vec::loadu(cos + i, c) + g2 * Vec::loadu(sin + h + i, c)).store(dx + i, static_cast<int>(c));
    (g2 * Vec::loadu(cos + h + i, c) - g1 * Vec::loadu(sin + i, c)).store(dx + h + i, static_cast<int>(c));
  });
}

// log_softmax as ATen's: (z - max) - log(sum(exp(z - max))); then exp of it, less one at the target.
void softmax_cross_entropy(float* z, const int64_t* targets, float* loss, int64_t rows, int64_t vocab) {
  const Vec lowest(-std::numeric_limits<float>::infinity()), zero(0.f);
  for (int64_t r = 0; r < rows; ++r) {
    float* zr = z + r * vocab;
    Vec m = lowest;
    each_vector(vocab,
                [&](int64_t i, int64_t c) { m = at::vec::maximum(m, Vec::set(lowest, Vec::loadu(zr + i, c), c)); });
    const float mx = lane_max(m);
    const Vec mv(mx);
    Vec acc(0.f);
    each_vector(vocab,
                [&](int64_t i, int64_t c) { acc = acc + Vec::set(zero, (Vec::loadu(zr + i, c) - mv).exp(), c); });
    const float logsum = std::log(lane_sum(acc));
    const Vec lv(logsum);
    const int64_t t = targets[r];
    loss[r] = -((zr[t] - mx) - logsum);
    each_vector(vocab, [&](int64_t i, int64_t c) {
      ((Vec::loadu(zr + i, c) - mv - lv).exp()).store(zr + i, static_cast<int>(c));
    });
    zr[t] -= 1.f;
  }
}

}  // namespace

extern const Kernels table;
const Kernels table{swiglu, swiglu_backward, rms_norm, rms_norm_backward, rope, rope_backward, softmax_cross_entropy};

}  // namespace CPU_CAPABILITY
}  // namespace lorarun::model::cpu
