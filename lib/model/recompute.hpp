// Activation recompute ("activation checkpointing"): run a piece of the model without keeping its activations, and run
// it again during backward to get its gradients (torch.utils.checkpoint, reentrant flavour).
#pragma once
#include <ATen/core/Tensor.h>
#include <functional>

namespace lorarun::model {

// y = fn(x), keeping only x for backward. In backward, fn runs again on x with grad enabled and
// the same random state (so dropout draws the same mask); the gradients of the parameters fn
// uses accumulate into their .grad as in a plain backward. x must require grad (the caller makes
// a frozen input a leaf that does), and fn must hold its captures by value: it runs after the
// caller has returned.
at::Tensor recomputed(std::function<at::Tensor(const at::Tensor&)> fn, const at::Tensor& x);

// y = x W^T + b, x [.., in] -> [.., out], with W made by `weight()` in forward and made again in
// backward (an NF4 weight dequantised, a sharded one gathered), so no whole W outlives the call.
// Gradients flow to x only; `weight` holds its captures by value.
at::Tensor remade_weight_linear(const at::Tensor& x, const at::Tensor& bias, int64_t out_features,
                                std::function<at::Tensor()> weight);

// Whether this thread is inside the backward of a recomputed piece or of a remade-weight linear
// (its weight made again, or its forward run again): dist.shard_base then fetches blocks in the
// order backward visits them.
bool in_backward();

}  // namespace lorarun::model
