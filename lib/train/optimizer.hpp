// AdamW over an adapter's tensors, grouped as PEFT groups them (LoRA+), for a run and for each
// adapter of a job alike.
#pragma once
#include <ATen/core/Tensor.h>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace torch::optim {
class AdamW;
}

namespace lorarun::train {

// AdamW (lr, weight decay) over `named` (PEFT's state-dict names and tensors, in order): one group,
// or with LoRA+ (`plus_lr_ratio`) the A's in the first and B's and the 1-D ones (DoRA's magnitudes,
// the trained tables) in a second, as PEFT's create_loraplus_optimizer groups them.
std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<std::pair<std::string, at::Tensor>>& named, double lr,
                                                double weight_decay, std::optional<double> plus_lr_ratio);

// The learning rate of the next step: `lr` for the first group, lr × plus_lr_ratio for LoRA+'s second.
void set_lr(torch::optim::AdamW& opt, double lr, std::optional<double> plus_lr_ratio);

}  // namespace lorarun::train
