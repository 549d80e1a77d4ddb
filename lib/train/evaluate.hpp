// The loss of a model over a set of documents built as training builds them: what lora-train
// reports as eval_loss and lora-eval --recipe prints. Each rank takes the documents r, r+W,
// r+2W, … (no padding, so each counts once); the ranks' sums, added, give the token-weighted mean
// over the whole set, the same on any number of ranks.
#pragma once
#include <cstdint>
#include <functional>
#include <string>

#include "recipe/recipe.hpp"

namespace c10 {
struct Device;
}
namespace lorarun::model {
class CausalLM;
}
namespace lorarun::data {
class Documents;
class ExampleBuilder;
}  // namespace lorarun::data

namespace lorarun::train {

// One rank's sums (float64), to be added across ranks.
struct EvalSums {
  double loss = 0;        // summed token losses
  int64_t tokens = 0;     // trained (scored) tokens
  int64_t documents = 0;  // documents built into examples
  int64_t rejected = 0;   // documents the builder rejected (bad, overlong with overlong=skip)
};

// A document's own figures (lora-eval --per-doc): its id ("#3", "_id 7"), tokens, summed loss.
using PerDocument = std::function<void(const std::string& id, int64_t tokens, double loss)>;

// This rank's share of `docs` through `m` in eval mode (no dropout) without gradients, in batches
// of eval.batch_size (default data.batch_size) documents, collated as training collates
// (data.packing, data.max_length). With `per_doc`, one document per forward pass, each reported.
// Leaves m.training as it found it.
EvalSums eval_shard(model::CausalLM& m, const data::Documents& docs, const data::ExampleBuilder& builder,
                    const recipe::Recipe& r, int rank, int world, const c10::Device& device,
                    const PerDocument& per_doc = {});

}  // namespace lorarun::train
