// One adapter's training, as a run of one adapter and each adapter of a job (adapters:) hold it:
// its view of the recipe, its parameters, AdamW, schedule and checkpointer, where it stands, how
// its evaluations steer it, the documents it skipped and its epoch's batches.
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "data/batches.hpp"
#include "recipe/recipe.hpp"
#include "train/checkpointer.hpp"
#include "train/schedule.hpp"
#include "train/skips.hpp"
#include "train/state.hpp"
#include "train/training_data.hpp"

namespace torch::optim {
class AdamW;
}

namespace lorarun::train {

class Agreement;
class Objective;

class AdapterRun {
 public:
  // `name`: "" for a run of one adapter. `r`: its own run's recipe (recipe::adapter_recipe in a job).
  AdapterRun(std::string name, recipe::Recipe r, std::vector<at::Tensor> params,
             std::unique_ptr<torch::optim::AdamW> opt);
  ~AdapterRun();
  AdapterRun(const AdapterRun&) = delete;  // (its checkpointer holds references into it)
  AdapterRun& operator=(const AdapterRun&) = delete;

  const std::string name;
  recipe::Recipe r;
  TrainingData data;  // what it trains and is evaluated on (a job's adapter: read by r.data, r.eval)
  const std::vector<at::Tensor> params;
  const std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<Checkpointer> ckpt;    // its owner's to make (which random stream it saves)
  std::unique_ptr<Objective> objective;  // train.objective over its parameters
  const Schedule schedule;
  int64_t steps_per_epoch = 0, total_steps = 0;  // (plan's)
  int64_t epoch_documents = 0;                   // what an epoch's steps read, all ranks together
  int epochs;                                    // the epochs it ends with (fewer when early stopping ends it)
  Progress p;                                    // where it stands
  bool stopping_early = false;                   // patience ran out: the current epoch is its last
  Skips skips;  // documents skipped: this rank's in the current step, all ranks' in the epoch and the run
  std::optional<double> last_eval_loss;
  std::optional<data::MicroBatches> batches;  // its current epoch's, from p.step_in_epoch on
  double epoch_tokens = 0;                    // trained tokens of its current epoch, all ranks
  bool whole_epoch_here = false;              // this process runs its current epoch from step 0
  // data.sources: this rank's examples then trained tokens per source in the current step
  // ([documents of each source…, tokens of each source…]; empty without sources).
  std::vector<double> source_step;

  // Its epochs' steps on `world` ranks, once its data is known (every rank reads the same count of
  // documents an epoch).
  void plan(int world);
  // What starts its messages: "adapter 'a': " in a job, "" alone.
  std::string who() const;
  // The learning rate of its next optimizer step (train.lr by its schedule and warmup).
  double lr() const;
  // The examples of its next micro-batch: the rejected documents counted in `skips` and the first
  // three of this process warned about (`warned` counts), or a ConfigError for a bad one with
  // data.bad_documents: fail. None when it has no batches or the data is lost (`data_error` says
  // why, and is set here when its source gives up: the ranks then stop together at the step's end).
  std::vector<data::Example> examples(int rank, int& warned, std::string& data_error);
  // Throws lorarun::Error when a step's loss or gradient norm is not finite (nothing of it applied).
  void check_finite(double loss, double grad_norm) const;
  // Its optimizer step on the step's normalised `grads` (summed over ranks) of norm `norm`:
  // clipped as torch's clip_grad_norm_ by train.max_grad_norm, AdamW at `lr` (LoRA+'s B at
  // lr x plus_lr_ratio).
  void apply(std::vector<at::Tensor>& grads, const at::Tensor& norm, double lr);
  // After an evaluation (the same figures on every rank): the log line (rank 0, `lead`; after the
  // progress line on a `tty`), best/ when its loss is the lowest so far (checkpoint.keep_best), and
  // the end of the run when train.early_stopping_patience evaluations in a row did not lower the
  // best loss by more than train.early_stopping_min_delta. Without `steers` (eval.on_start's) only
  // the line.
  void evaluated(const nlohmann::json& row, bool steers, bool lead, bool tty);
};

// Replicas must stay identical: every rank puts the checksum of `runs`' parameters in its own slot;
// lorarun::Error when they differ after step `step`.
void check_replicas(const Agreement& agree, const std::vector<const AdapterRun*>& runs, int64_t step);

}  // namespace lorarun::train
