// What a run leaves in its output directory: the epoch adapters (epoch_<i>/) the checkpoint
// policy keeps, and the resumable state, what it takes to continue at the exact optimizer step
// after a crash or a preemption (adapter, AdamW moments, RNG of every rank, data position, counters).
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace torch::optim {
class AdamW;
}
namespace lorarun::model {
class CausalLM;
struct LoraConfig;
}  // namespace lorarun::model

namespace lorarun::train {

// Writes the adapter as <output_dir>/epoch_<epoch>: to <dir>.tmp.<pid>, synced, then renamed, so
// a reader never sees half of it. Returns the directory.
std::string save_epoch(const std::string& output_dir, int epoch, const model::CausalLM& m,
                       const model::LoraConfig& cfg);

// Writes the adapter as <output_dir>/best, atomically as save_epoch does, with `about` (step,
// eval loss, …) in best/best.json. Returns the directory.
std::string save_best(const std::string& output_dir, const model::CausalLM& m, const model::LoraConfig& cfg,
                      const nlohmann::json& about);

// Removes every epoch_<i>/ whose i is not in `kept`, and the temporary directories a crashed
// earlier run left behind.
void remove_unkept_epochs(const std::string& output_dir, const std::vector<int>& kept);

// What steering by the eval loss has seen so far (checkpoint.keep_best, early stopping).
struct Steering {
  std::optional<double> best_loss;  // the lowest eval loss so far (none before the first evaluation)
  int64_t best_step = 0;            // the optimizer step it was measured after
  int evals_since_best = 0;         // evaluations since the last improvement (by min_delta)
};

// Where a run stands between two optimizer steps.
struct Progress {
  int epoch = 0;              // the epoch to continue
  int64_t step_in_epoch = 0;  // optimizer steps of that epoch already done
  int64_t step = 0;           // optimizer steps done in all
  std::string run_id;         // the run record to continue ("" when not tracked)
  Steering steering;
  bool pending_eval = false;  // the evaluation due after `step` was stopped: it comes first (step_in_epoch
                              // may then equal the steps per epoch: that epoch's end is still to come)
};

// <output_dir>/resume_state: written to a temporary name and swapped in, so a reader finds
// either the previous state or the new one, never half of one.
std::string state_dir(const std::string& output_dir);

// This process's random generators (CPU, and CUDA's when `cuda`) as bytes.
at::Tensor rng_state(bool cuda);
void set_rng_state(const at::Tensor& bytes, bool cuda);

// The random stream a resumable state saves and restores for this rank, as bytes: the process's
// generators, or in a job of many adapters (adapters:) one adapter's dropout stream.
struct RngStream {
  std::function<at::Tensor()> get;
  std::function<void(const at::Tensor&)> set;
  static RngStream process(bool cuda) {
    return {[cuda] { return rng_state(cuda); }, [cuda](const at::Tensor& b) { set_rng_state(b, cuda); }};
  }
};

// Files an objective keeps in the state's directory: written into it before its manifest, read from
// it once it passed its checks.
using StateFiles = std::function<void(const std::string& dir)>;

// Writes the state (rank 0). `rngs` is [world, S] uint8: every rank's rng_state(); `recipe` the
// run's resolved recipe as JSON (checked on resume); `data` the selection's identity; `also` writes
// an objective's files into it.
void save_state(const std::string& output_dir, const model::CausalLM& m, const model::LoraConfig& cfg,
                torch::optim::AdamW& opt, const std::vector<at::Tensor>& params, const Progress& p,
                const at::Tensor& rngs, const nlohmann::json& recipe, const nlohmann::json& data,
                const StateFiles& also = {});

// What a state's counters must fit: this run's epochs and optimizer steps per epoch; and what it
// reads (data::Documents::identity()), saved with the state and compared on resume.
struct RunShape {
  int epochs = 0;
  int64_t steps_per_epoch = 0;
  nlohmann::json data;
};

// Restores a saved state into the LoRA `params`, `opt` and this rank's `rng`.
// Returns nullopt when there is none. Throws lorarun::Error, naming the problem and
// checkpoint.resume=never, when the state is incomplete or was changed (its manifest.json of
// sha256 sums, written last, does not match), holds non-finite tensors or counters outside
// `shape`, or was written by a different recipe (naming the first key that differs) or world size.
// When the data it read is not shape.data (documents added, removed or changed since), rank 0 says
// so in one line and the run resumes at the same step of the new selection, if its counters still
// fit; else the refusal names the change.
// `also` reads an objective's files from it.
std::optional<Progress> load_state(const std::string& output_dir, torch::optim::AdamW& opt,
                                   const std::vector<at::Tensor>& params, int rank, int world, const RngStream& rng,
                                   const nlohmann::json& recipe, const RunShape& shape, const StateFiles& also = {});

// How `now` differs from `saved` (two data::Documents::identity()), in words; "" when it does not
// or cannot be told (identities from before they held what differs).
std::string data_change(const nlohmann::json& saved, const nlohmann::json& now);

// Removes the state (the run finished).
void remove_state(const std::string& output_dir);

}  // namespace lorarun::train
