// The reference policy of DPO, KTO and GRPO: the model being trained with its adapters off, or set to
// lora.init_from's values — no second model in memory.
#pragma once
#include <ATen/core/Tensor.h>
#include <string>
#include <utility>
#include <vector>

#include "recipe/recipe.hpp"

namespace lorarun::model {
class CausalLM;
}

namespace lorarun::train {

// While it lives, the model is the reference: eval mode, the adapters off (`values` empty) or its
// tensors `params` set to `values`.
class AsReference {
 public:
  AsReference(model::CausalLM& m, const std::vector<at::Tensor>& params, const std::vector<at::Tensor>& values);
  ~AsReference();
  AsReference(const AsReference&) = delete;
  AsReference& operator=(const AsReference&) = delete;

 private:
  model::CausalLM& m_;
  const std::vector<at::Tensor>& params_;
  std::vector<at::Tensor> saved_;
  const bool was_training_;
};

// The reference's values of the adapter's tensors `named`: copies of `values` (or, from the recipe,
// of lora.init_from's, read now), or none when they add nothing to the base (plain LoRA pairs whose B
// are zero): the adapters off are then the same.
std::vector<at::Tensor> reference_values(const std::vector<at::Tensor>& values,
                                         const std::vector<std::pair<std::string, at::Tensor>>& named);
std::vector<at::Tensor> reference_values(const recipe::Recipe& r,
                                         const std::vector<std::pair<std::string, at::Tensor>>& named);

}  // namespace lorarun::train
