// The training loop's parts, for its three sources (trainer.cpp: the loop; trainer_setup.cpp: the
// adapters it trains; trainer_report.cpp: what it tells the log and the sinks). A run of one
// adapter and a job of many are one Trainer over its tenants.
#pragma once
#include <ATen/core/Tensor.h>
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "data/collate.hpp"
#include "dist/env.hpp"
#include "dist/grad_buckets.hpp"
#include "dist/process_group.hpp"
#include "model/tenants.hpp"
#include "recipe/recipe.hpp"
#include "track/sinks.hpp"
#include "train/adapter_run.hpp"
#include "train/agreement.hpp"
#include "train/profile.hpp"
#include "train/runtime.hpp"
#include "train/skips.hpp"
#include "train/state.hpp"

namespace lorarun::train::loop {

using Clock = std::chrono::steady_clock;

// One adapter in training: its run (AdapterRun: its own run's recipe, data, adapter, optimizer,
// schedule, checkpointer and where it stands), where its rows go through the model, and this step's
// sums. A run of one adapter has one, without a slot; a job of many (adapters:) one per adapter.
struct Tenant {
  std::optional<int> slot;  // a job's adapter: its slot among the model's; alone: the model's own LoRA
  RngStream rng;            // its dropout stream (alone: the process's generators)
  std::unique_ptr<AdapterRun> run;
  bool done = false;
  bool fresh = false;        // starts at its step 0 in this process
  bool state_saved = false;  // its state is saved where it stands now
  // this step: summed token losses on the device, trained tokens, document tokens, row slots
  at::Tensor loss;
  int64_t tokens = 0, real = 0, slots = 0;
  at::Tensor stats;  // its objective's (Objective::Sums::stats)
  at::Tensor rng_at_step_start;
  std::vector<double> source_logged;  // data.sources: source_step summed since the last metrics row
};

// How a step ended.
enum class StepEnd { Go, Stop, DataLost };

// The figures the ranks sum per step: first the step's, then per active adapter kPerTenant, its
// objective's stats and its data.sources counts.
enum StepSum { kStop, kDataWait, kDataFailed, kTakenOver, kStepSums };
enum TenantSum { kLoss, kTokens, kReal, kSlots, kSkipped, kPerTenant = kSkipped + Skips::kCauses };

// A figure of adapter `a` in a metrics row: "<figure>" alone, "<figure>/<name>" in a job.
std::string keyed(const std::string& figure, const AdapterRun& a);

// Adapter t's rows alone through the model: every row to its slot (none alone: the model's own
// LoRA), drawing dropout from `streams` (null: none drawn, as in evaluation).
std::shared_ptr<const model::Routes> alone(const Tenant& t, model::DropoutStreams* streams);

// The step's totals over its adapters and ranks, for the line and the row.
struct StepTotals {
  double loss = 0, tokens = 0, rank_tokens = 0, real = 0, slots = 0, data_wait = 0, seconds = 0;
};

// What a step's ranks summed (Trainer::reduce).
struct Reduced {
  // float64 on the host: the StepSum flags; per active adapter from first[i] its TenantSum figures, its
  // objective's stats and its data.sources counts; last, each adapter's gradient norm
  at::Tensor host;
  std::vector<int64_t> first;
  std::vector<std::vector<at::Tensor>> grads;  // each adapter's, normalised
  std::vector<at::Tensor> norms;               // ... and their norm, on the device
};

class Trainer {
 public:
  Trainer(const recipe::Recipe& r, const dist::DistEnv& env);
  int run();
  void failed(const std::string& error);

 private:
  void add_alone();
  void add_adapters();
  void open_data(AdapterRun& a);
  bool solo() const { return !tenants_.front()->slot; }
  void begin(bool resumed);
  track::RunInfo about() const;
  std::vector<std::string> plan_lines() const;
  bool settle(Tenant& t);
  void epoch_batches(const AdapterRun& a, int64_t step, std::optional<data::MicroBatches>& out) const;
  void open_batches(Tenant& t);
  bool precompute_reference(Tenant& t);
  void keep_objective_in_state(AdapterRun& a);
  StepEnd step(const std::vector<Tenant*>& active);
  Reduced reduce(const std::vector<Tenant*>& active, double data_wait);
  void update(Tenant& t, Reduced& sums, size_t i, StepTotals& totals, nlohmann::json& figures);
  void pass(const std::vector<data::Batch>& parts, const std::vector<Tenant*>& owners);
  void shared_passes(const std::vector<Tenant*>& active);
  void own_passes(Tenant& t);
  void log_step(const std::vector<Tenant*>& active, const nlohmann::json& figures, const StepTotals& s);
  bool after_step(Tenant& t, bool stopping, bool stop);
  bool end_epoch(Tenant& t, bool stopping);
  void close_epoch(Tenant& t);
  bool evaluate(Tenant& t, bool steers = true);
  int stopped(bool save = true);
  int data_lost();
  int finish();

  const recipe::Recipe& r_;
  const dist::DistEnv env_;
  const bool lead_, tty_, cuda_;
  dist::ProcessGroup pg_;
  Runtime rt_;
  model::CausalLM& m_;
  const Agreement agree_;
  model::DropoutStreams streams_;  // a job's adapters' dropout streams, one per slot
  std::vector<std::unique_ptr<Tenant>> tenants_;
  std::unique_ptr<dist::GradBuckets> sync_;
  std::unique_ptr<track::RunSinks> sinks_;
  int64_t step_ = 0;  // steps done (a job's: its adapters' steps, as they run in step)
  int64_t total_steps_ = 0;
  std::string run_id_;
  std::string data_error_;  // why this rank's data source gave up (empty: it did not)
  int warned_ = 0;          // skipped documents this rank has warned about
  Clock::time_point started_ = Clock::now();
  int64_t steps_this_process_ = 0;
  StepProfiler profile_{r_.train.profile_steps, r_.checkpoint.output_dir, env_.rank, cuda_};
};

}  // namespace lorarun::train::loop
