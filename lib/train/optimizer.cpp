#include "train/optimizer.hpp"

#include <torch/optim/adamw.h>

namespace lorarun::train {

std::unique_ptr<torch::optim::AdamW> make_adamw(const std::vector<std::pair<std::string, at::Tensor>>& named, double lr,
                                                double weight_decay, std::optional<double> plus_lr_ratio) {
  std::vector<at::Tensor> a, b;
  for (const auto& [name, t] : named) (plus_lr_ratio && name.ends_with(".lora_A.weight") ? a : b).push_back(t);
  std::vector<torch::optim::OptimizerParamGroup> groups;
  if (plus_lr_ratio) groups.emplace_back(a);
  groups.emplace_back(b);
  return std::make_unique<torch::optim::AdamW>(std::move(groups),
                                               torch::optim::AdamWOptions(lr).weight_decay(weight_decay));
}

void set_lr(torch::optim::AdamW& opt, double lr, std::optional<double> plus_lr_ratio) {
  for (size_t g = 0; g < opt.param_groups().size(); ++g)
    static_cast<torch::optim::AdamWOptions&>(opt.param_groups()[g].options()).lr(g == 0 ? lr : lr * *plus_lr_ratio);
}

}  // namespace lorarun::train
