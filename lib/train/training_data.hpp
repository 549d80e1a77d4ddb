// What one adapter trains and is evaluated on: data's selection or data.sources' mixture, and the
// eval: section's documents or each source's held-out ones.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/mixture.hpp"
#include "data/source.hpp"

namespace lorarun::train {

struct TrainingData {
  std::unique_ptr<data::Documents> docs;  // data's selection (the training side of eval.fraction)
  std::unique_ptr<data::Mixture> mix;     // data.sources instead: the sources and their mixture
  std::unique_ptr<data::EvalSplit> eval;  // the eval: section's documents, when asked and set
  // data.sources with eval.fraction: each source's held-out documents (then `eval` is null).
  std::vector<std::unique_ptr<data::EvalSplit>> source_evals;

  // What training reads per epoch: the selection or the mixture.
  int64_t documents() const { return mix ? mix->size() : docs->size(); }
  int64_t per_rank(int world) const {  // ... and what each of `world` ranks reads of it
    return mix ? mix->per_rank(world) : data::examples_per_rank(docs->size(), world);
  }
  nlohmann::json identity() const { return mix ? mix->identity() : docs->identity(); }
  std::string describe() const { return mix ? mix->describe() : docs->describe(); }
  bool evaluates() const { return eval || !source_evals.empty(); }
  int64_t eval_documents() const {
    int64_t n = eval ? eval->docs().size() : 0;
    for (const auto& e : source_evals) n += e->docs().size();
    return n;
  }
};

}  // namespace lorarun::train
