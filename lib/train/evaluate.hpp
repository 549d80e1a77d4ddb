// The loss of a model over a set of documents built as training builds them: what lora-train
// reports as eval_loss and lora-eval --recipe prints. Each rank takes the documents r, r+W,
// r+2W, … (no padding, so each counts once); the ranks' sums, added, give the token-weighted mean
// over the whole set, the same on any number of ranks.
#pragma once
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "recipe/recipe.hpp"

namespace c10 {
struct Device;
}
namespace lorarun::model {
class CausalLM;
}
namespace lorarun::data {
class Documents;
class EvalSplit;
class ExampleBuilder;
}  // namespace lorarun::data

namespace lorarun::train {

class Agreement;
class Evaluation;

// Throws ConfigError, naming `what` (the eval selection) and how many documents were rejected, when
// no document of `docs` built by `builder` has a token to score (data.format: prompt: none builds):
// an evaluation that could only fail is refused before training, not after an epoch. Reads
// documents until the first that has.
void require_scored_token(const data::Documents& docs, const data::ExampleBuilder& builder, const std::string& what);

// One rank's sums (float64), to be added across ranks.
struct EvalSums {
  double loss = 0;               // summed token losses
  int64_t tokens = 0;            // trained (scored) tokens
  int64_t documents = 0;         // documents built into examples
  int64_t rejected = 0;          // documents the builder rejected (bad, overlong with overlong=skip)
  bool stopped = false;          // `stop` said so before the last batch: the sums are partial, to be dropped
  std::vector<double> own = {};  // with an objective's own evaluation: its sums
};

// Asked before each batch: whether any rank was asked to stop. A collective when the ranks must
// agree (every rank then calls it equally often: as many times as rank 0 has batches).
using StopCheck = std::function<bool()>;

// A document's own figures (lora-eval --per-doc): its id ("#3", "_id 7"), tokens, summed loss.
using PerDocument = std::function<void(const std::string& id, int64_t tokens, double loss)>;

// This rank's share of `docs` through `m` in eval mode (no dropout) without gradients, in batches
// of eval.batch_size (default data.batch_size) documents, collated as training collates
// (data.packing, data.max_length). With `per_doc`, one document per forward pass, each reported.
// With `stop`, every rank runs as many passes as rank 0 and asks it before each; when it says
// stop, the evaluation ends there (EvalSums::stopped). With `by`, the objective's own evaluation
// (preference pairs, GRPO's prompts), its sums are EvalSums::own and `tokens` what it scored.
// Leaves m.training as it found it.
EvalSums eval_shard(model::CausalLM& m, const data::Documents& docs, const data::ExampleBuilder& builder,
                    const recipe::Recipe& r, int rank, int world, const c10::Device& device,
                    const PerDocument& per_doc = {}, const StopCheck& stop = {}, const Evaluation* by = nullptr);

// One evaluation of `split` during training: every rank's share (eval_shard), the sums added over
// the ranks, as the row metrics.jsonl gets — {epoch, step, eval_loss, eval_ppl, eval_tokens,
// eval_documents, eval_rejected, eval_seconds}, the same on every rank; nullopt when `stop` said
// so. With `by`, eval_loss is its loss_of and its figures follow ("eval_rewards/chosen", …;
// GRPO: "eval_reward", …). Throws lorarun::Error when the split held no token to score.
std::optional<nlohmann::json> evaluate_split(model::CausalLM& m, const data::EvalSplit& split,
                                             const data::ExampleBuilder& builder, const recipe::Recipe& r,
                                             const Agreement& agree, int epoch, int64_t step, const StopCheck& stop,
                                             const Evaluation* by = nullptr);

// data.sources with eval.fraction: one source's held-out documents and how they are built.
struct NamedSplit {
  std::string name;
  const data::EvalSplit* split;
  const data::ExampleBuilder* builder;
};

// Each split evaluated as evaluate_split does it, and one row of them together: eval_loss over all
// their tokens (with `by`: over all their documents), eval_ppl (GRPO: eval_reward), the counts and
// seconds summed, and each source's own eval_loss/<name>; nullopt when `stop` said so.
std::optional<nlohmann::json> evaluate_sources(model::CausalLM& m, const std::vector<NamedSplit>& splits,
                                               const recipe::Recipe& r, const Agreement& agree, int epoch, int64_t step,
                                               const StopCheck& stop, const Evaluation* by = nullptr);

}  // namespace lorarun::train
