// Many adapters on one frozen base (a job's adapters:): every linear holds one LoRA pair per
// adapter, and one forward pass sends each stretch of the batch's rows through its own adapter, so
// the base weights are read once for all of them.
#pragma once
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <cstdint>
#include <vector>

namespace lorarun::model {

struct Linear;

// One adapter's pair on one linear: a [r, in], b [out, r] (undefined: it does not adapt this layer);
// with DoRA its magnitude [out] (see dora.hpp).
struct TenantLora {
  at::Tensor a, b, magnitude;
  double scaling = 0;
};

// Rows [row0, row0 + rows) of a batch [B, T, ..] are adapter `slot`'s, and their first `length`
// positions its own micro-batch's [rows, length]; the positions past `length` (padding up to the
// batch's T) go through the base alone.
struct Route {
  int slot = 0;
  int64_t row0 = 0, rows = 0, length = 0;
};

// Each adapter's dropout stream: the default generators of its own run's rank, seeded alike, so
// that its masks are that run's masks, drawn in the same order.
class DropoutStreams {
 public:
  // `adapters` streams, each as at::manual_seed(seed) would leave the CPU generator (and `device`'s
  // CUDA one).
  DropoutStreams(size_t adapters, uint64_t seed, at::Device device);
  // at::dropout(x, p, train=true), drawn from adapter `slot`'s stream.
  at::Tensor dropout(int slot, const at::Tensor& x, double p);
  // Adapter `slot`'s stream as bytes (the CPU generator's state, then the CUDA one's), and back.
  at::Tensor state(int slot) const;
  void set_state(int slot, const at::Tensor& bytes);
  size_t size() const { return cpu_.size(); }

 private:
  std::vector<at::Tensor> cpu_;   // states of the default CPU generator
  std::vector<at::Tensor> cuda_;  // states of the device's default CUDA generator (empty on the CPU)
  at::Device device_;
};

// A pass's routing: which rows go through which adapter (`all` >= 0: every row through that one,
// whatever the batch); `streams`: where training's dropout draws.
struct Routes {
  std::vector<Route> routes;
  int all = -1;
  DropoutStreams* streams = nullptr;
};

// l's output for a job of many adapters: the base's (x [B, T, in] -> [B, T, out]) plus each route's
// adapter on that route's rows.
at::Tensor add_tenants(const Linear& l, const at::Tensor& x, bool training, const Routes& routes);

// y + scaling · B A xd: one GEMM that adds to y's values when y has the adapters' dtype, else summed
// in float32 and cast back to y's, as PEFT; xd is the (dropped-out) input [.., in].
at::Tensor add_lora(at::Tensor y, const at::Tensor& xd, const at::Tensor& a, const at::Tensor& b, double scaling);

}  // namespace lorarun::model
