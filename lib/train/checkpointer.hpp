// What a run keeps, and where: the epoch adapters the checkpoint policy keeps, best/, the
// resumable state, their copies in GridFS (checkpoint.store: mongodb), a lost output directory
// restored from those, and what is left at the end. Rank 0 writes; every rank learns whether
// it worked (a failure stops them all). No adapter holding a NaN or an infinity is written.
#pragma once
#include <ATen/core/Tensor.h>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "model/lora.hpp"
#include "recipe/recipe.hpp"
#include "train/state.hpp"

namespace torch::optim {
class AdamW;
}
namespace lorarun::track {
class ArtifactStore;
class RunRecorder;
class RunSinks;
}  // namespace lorarun::track

namespace lorarun::train {

class Agreement;

// The epochs whose adapters remain at the end of a run of `epochs` epochs: checkpoint.epochs_to_save
// (all, none, a list), or only the last with save_last_epoch_only.
std::vector<int> epochs_kept(const recipe::CheckpointSection& c, int epochs);
// Whether epoch `epoch` of a run of `epochs` is written (it is kept).
bool save_after_epoch(const recipe::CheckpointSection& c, int epoch, int epochs);

// How a run ended, for <output_dir>/run.json.
struct RunSummary {
  std::string run_id;  // "DATABASE/ID" of its record, or "local-…"
  int64_t steps = 0;
  Steering steering;                    // its best evaluation
  std::optional<int> early_stopped_in;  // the epoch early stopping ended
};

class Checkpointer {
 public:
  // `params` and `opt` are the LoRA parameters and their AdamW; `data` the training selection's
  // identity (data::Documents::identity()), saved with each state; `rng` the random stream saved
  // with it (the process's generators, unless an adapter of a job of many has its own).
  Checkpointer(const recipe::Recipe& r, const Agreement& agree, const model::CausalLM& m, model::LoraConfig cfg,
               const std::vector<at::Tensor>& params, torch::optim::AdamW& opt, nlohmann::json data, bool cuda,
               RngStream rng = {});
  ~Checkpointer();
  Checkpointer(const Checkpointer&) = delete;
  Checkpointer& operator=(const Checkpointer&) = delete;

  // The state in output_dir into the parameters, AdamW and this rank's RNG (nullopt: none);
  // see train::load_state.
  std::optional<Progress> load(const RunShape& shape);

  // Files its adapter's objective keeps in each resumable state (preference.precompute_reference's):
  // `save` writes them into a state's directory as it is written, `load` reads them from the state load() restores.
  void keep_in_state(StateFiles save, StateFiles load);

  // A job of many adapters: this adapter's artifacts go to GridFS as <name>/<artifact>.
  void store_as_adapter(const std::string& name);

  // Rank 0, once the run's sinks are open: each epoch saved is reported to them, and with
  // checkpoint.store: mongodb each save also goes to GridFS and is listed in their run record.
  void attach(track::RunSinks& sinks);

  // epoch_<epoch>/, when the policy keeps it in a run of `epochs` epochs (every rank calls it).
  void save_epoch(int epoch, int epochs, int64_t step);
  // best/ with `about` (the evaluation's row) in best.json.
  void save_best(const nlohmann::json& about, int64_t step);
  // The resumable state of `p` (every rank's RNG with it); `store`: also to GridFS.
  void save_state(const Progress& p, bool store = true);
  // The end of a run of `epochs` epochs: output_dir and GridFS keep the epochs the policy keeps,
  // and the resumable state only with checkpoint.keep_resume_state; run.json says the run
  // completed (`summary`; rank 0's). Returns the kept epochs.
  std::vector<int> finish(int epochs, const RunSummary& summary);

  // Whether an upload found the record's server gone (its last write would only wait for it).
  bool store_unreachable() const { return store_unreachable_; }
  std::string state_dir() const;

 private:
  void check_finite(const std::string& what, int64_t step) const;
  void store(const std::string& artifact, const std::string& dir);

  const recipe::Recipe& r_;
  const Agreement& agree_;
  const model::CausalLM& m_;
  const model::LoraConfig cfg_;
  const std::vector<at::Tensor>& params_;
  torch::optim::AdamW& opt_;
  const nlohmann::json data_;
  const RngStream rng_;
  StateFiles save_also_, load_also_;
  const std::string out_;
  track::RunSinks* sinks_ = nullptr;
  track::RunRecorder* record_ = nullptr;  // sinks_'s, when the run is recorded
  std::unique_ptr<track::ArtifactStore> store_;
  bool store_unreachable_ = false;
  std::string prefix_;  // a job's adapter's artifacts: "<name>/"
};

// checkpoint.store: mongodb with checkpoint.resume: auto, and none of `states` (the resumable state
// directories of the run, or of a job's adapters) there (a new node, a wiped disk): rank 0 restores
// the newest unfinished run of this very recipe that stored one — its kept epochs, best/ and, last,
// the states — into checkpoint.output_dir as its record lists them. A live run's (its lease) is
// refused (LiveRunError); every rank learns whether it worked.
void restore_from_store(const recipe::Recipe& r, const Agreement& agree, const std::vector<std::string>& states);

}  // namespace lorarun::train
