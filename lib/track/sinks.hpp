// Where a run's figures and events go out, in one place: metrics.jsonl, TensorBoard
// (track.tensorboard), the MongoDB run record (track.mongodb) and MLflow (track.mlflow_uri).
// Rank 0 holds the sinks; the trainer hands them a row and they each take what they log.
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/files.hpp"
#include "recipe/recipe.hpp"

namespace lorarun::track {

class RunRecorder;
class TensorBoardWriter;
class MlflowRun;

// What the record says of the run when it begins (documents, steps per epoch, …).
using RunInfo = nlohmann::json;

class RunSinks {
 public:
  explicit RunSinks(const recipe::Recipe& r);
  ~RunSinks();
  RunSinks(const RunSinks&) = delete;
  RunSinks& operator=(const RunSinks&) = delete;

  // Before the first step, the record first (begun, or continued when `resumed_run` names one):
  // a live run's record or output directory refuses this run before anything is written (see
  // RunRecorder). Then metrics.jsonl (a resumed run keeps the rows up to `resumed_step`, so no
  // step shows twice), TensorBoard events and the MLflow run. Returns the run's id as the
  // resumable state keeps it: the record's id, or without a record `resumed_run` when it is one
  // of ours ("local-…"), else a new "local-…" id. `world_size` tags the MLflow run.
  std::string open(const RunInfo& about, std::optional<int64_t> resumed_step, const std::string& resumed_run,
                   int world_size);

  // A training step's metrics row ({"step", "loss", "lr", "grad_norm", "tokens_per_s", …}).
  void step(const nlohmann::json& row);
  // An evaluation's row ({"step", "eval_loss", "eval_ppl", …}).
  void eval(const nlohmann::json& row);
  // An epoch adapter written to `dir`.
  void checkpoint(int epoch, const std::string& dir);
  // The run's end: completed (with the adapter directories MLflow gets, each with its artifact
  // path there: "adapter", "best", a job's "<name>/adapter"), interrupted or failed.
  void completed(const std::vector<std::pair<std::string, std::string>>& adapters);
  void interrupted(const std::string& why = {});
  // (`server_gone`: the record's server already proved unreachable; its write is not tried.)
  void failed(const std::string& error, bool server_gone = false);

  // The MongoDB run record, when there is one (the artifact store lists its uploads there).
  RunRecorder* record() const { return record_.get(); }
  // Who took the run record over, once another process did (this run must stop).
  std::optional<std::string> lost_lease() const;
  // The run as people name it: the record's "DATABASE/ID", else the "local-…" id (run.json, logs).
  const std::string& ref() const { return ref_; }
  // The last metrics row with the last evaluation's figures: the record's final metrics.
  nlohmann::json& last_row() { return last_row_; }

 private:
  void open_files(std::optional<int64_t> resumed_step, int world_size);
  void open_metrics(std::optional<int64_t> resumed_step);
  void to_tensorboard(int64_t step, const nlohmann::json& row,
                      const std::vector<std::pair<std::string, std::string>>& tags);

  const recipe::Recipe& r_;
  io::OutFile metrics_;
  std::unique_ptr<RunRecorder> record_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
  std::unique_ptr<MlflowRun> mlflow_;
  nlohmann::json last_row_ = nlohmann::json::object();
  std::string ref_;
};

}  // namespace lorarun::track
