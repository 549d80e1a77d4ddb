#include "model/recompute.hpp"

#include <ATen/ATen.h>
#include <ATen/core/ivalue.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/custom_class.h>
#include <mutex>
#include <optional>
#include <vector>

namespace lorarun::model {
namespace {

thread_local int backward_depth = 0;

// Marks this thread as running backward for its lifetime (nested: a recomputation's backward).
struct InBackward {
  InBackward() { ++backward_depth; }
  ~InBackward() { --backward_depth; }
  InBackward(const InBackward&) = delete;
  InBackward& operator=(const InBackward&) = delete;
};

// What backward needs besides x: the function and the random state it started from.
struct Replay : torch::CustomClassHolder {
  std::function<at::Tensor(const at::Tensor&)> fn;
  at::Generator gen;
  at::Tensor rng;
};

at::Tensor swap_state(at::Generator& gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  at::Tensor before = gen.get_state();
  gen.set_state(state);
  return before;
}

struct Checkpoint : torch::autograd::Function<Checkpoint> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            c10::intrusive_ptr<Replay> replay) {
    replay->gen = x.is_cuda() ? at::globalContext().defaultGenerator(x.device()) : at::detail::getDefaultCPUGenerator();
    {
      std::lock_guard<std::mutex> lock(replay->gen.mutex());
      replay->rng = replay->gen.get_state();
    }
    ctx->save_for_backward({x});
    at::Tensor y = replay->fn(x);  // grad mode is off here: nothing is kept
    ctx->saved_data["replay"] = at::IValue::make_capsule(std::move(replay));
    return y;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_out) {
    const InBackward marked;
    auto replay = c10::static_intrusive_pointer_cast<Replay>(ctx->saved_data["replay"].toCapsule());
    const at::Tensor x = ctx->get_saved_variables()[0].detach().requires_grad_(true);
    const at::Tensor now = swap_state(replay->gen, replay->rng);
    at::Tensor y;
    {
      at::AutoGradMode enable(true);
      y = replay->fn(x);
    }
    swap_state(replay->gen, now);
    torch::autograd::backward({y}, {grad_out[0]});
    return {x.grad(), at::Tensor()};
  }
};

}  // namespace

bool in_backward() { return backward_depth > 0; }

at::Tensor recomputed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x) {
  auto replay = c10::make_intrusive<Replay>();
  replay->fn = std::move(fn);
  return Checkpoint::apply(x, std::move(replay));
}

namespace {

struct Maker : torch::CustomClassHolder {
  std::function<at::Tensor()> weight;
};

// Saves only the maker of W for backward, never W.
struct RemadeWeightLinear : torch::autograd::Function<RemadeWeightLinear> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x,
                            const std::optional<at::Tensor>& bias, c10::intrusive_ptr<Maker> maker) {
    ctx->saved_data["w"] = at::IValue::make_capsule(maker);
    return at::linear(x, maker->weight(), bias);
  }
  // dy [N, out] -> dx = dy W [N, in]; none for b (frozen) or the maker.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list dy) {
    const InBackward marked;
    const auto maker = c10::static_intrusive_pointer_cast<Maker>(ctx->saved_data["w"].toCapsule());
    return {at::matmul(dy[0], maker->weight()), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor remade_weight_linear(const at::Tensor& x, const at::Tensor& bias, int64_t out_features,
                                std::function<at::Tensor()> weight) {
  // The Function sees [N, in] -> [N, out], as at::linear computes it, and the reshapes stay
  // outside: a view made inside a custom Function could not be modified in place afterwards
  // (Linear::forward adds the LoRA path into the result).
  const at::Tensor x2 = x.reshape({-1, x.size(-1)});
  std::optional<at::Tensor> b;
  if (bias.defined()) b = bias;
  at::Tensor y2;
  if (x.requires_grad()) {
    auto maker = c10::make_intrusive<Maker>();
    maker->weight = std::move(weight);
    y2 = RemadeWeightLinear::apply(x2, b, maker);
  } else {
    y2 = at::linear(x2, weight(), bias);
  }
  std::vector<int64_t> sizes = x.sizes().vec();
  sizes.back() = out_features;
  return y2.view(sizes);
}

}  // namespace lorarun::model
