#include "train/trainer.hpp"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <fmt/format.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>
#include <unistd.h>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>

#include "data/batches.hpp"
#include "data/collate.hpp"
#include "dist/grad_buckets.hpp"
#include "dist/process_group.hpp"
#include "io/files.hpp"
#include "model/lora.hpp"
#include "model/loss.hpp"
#include "track/sinks.hpp"
#include "train/agreement.hpp"
#include "train/checkpointer.hpp"
#include "train/evaluate.hpp"
#include "train/job.hpp"
#include "train/optimizer.hpp"
#include "train/output_dir.hpp"
#include "train/preference.hpp"
#include "train/profile.hpp"
#include "train/runtime.hpp"
#include "train/schedule.hpp"
#include "train/skips.hpp"
#include "train/stop.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/process.hpp"

namespace lorarun::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// What one step's ranks sum, as one all-reduce of these doubles in this order; then the gradient
// norm of the summed (and normalised) gradients.
struct StepSums {
  double loss;            // summed token losses (a trivial type: memcpy reads it from the reduced tensor)
  double tokens;          // trained tokens
  double stop;            // ranks asked to stop
  double data_wait;       // shares of the step spent waiting for data
  double real;            // document tokens
  double slots;           // row slots, padding included
  double data_failed;     // ranks whose data source gave up
  double taken_over;      // ranks whose run record another process took over (rank 0's)
  Skips::Counts skipped;  // documents skipped, by cause
};
constexpr int64_t kStepSums = sizeof(StepSums) / sizeof(double);

// What one optimizer step did, summed over ranks where it says so.
struct StepResult {
  double loss = 0, lr = 0, grad_norm = 0, seconds = 0;
  double tokens = 0;            // trained tokens, all ranks
  double rank_tokens = 0;       // trained tokens, this rank
  double data_wait = 0;         // mean share of the step the ranks spent waiting for data
  double padding = 0;           // share of the row slots that held padding, all ranks
  Skips::Counts skipped{};      // documents skipped in this step by cause, all ranks
  std::vector<double> sources;  // data.sources: examples then trained tokens per source, all ranks
  bool stop = false;            // some rank was asked to stop
  bool data_failed = false;     // some rank lost its data source: nothing of this step was applied
  bool taken_over = false;      // another process holds the run record's lease now: stop, writing nothing
  nlohmann::json figures = nlohmann::json::object();  // the objective's own (train.objective: dpo, orpo)
};

// What this rank's micro-batches of one step added up to, before the ranks compare.
struct LocalSums {
  at::Tensor loss;     // float32 scalar on the device: summed token losses
  int64_t tokens = 0;  // trained tokens
  int64_t real = 0;    // document tokens
  int64_t slots = 0;   // row slots (padding included)
  at::Tensor pref;     // train.objective: dpo, orpo: float64 [kPrefStats]; `loss` and the gradients are then
                       // already divided by the step's pairs (see forward_backward_pairs)
};

class Trainer {
 public:
  Trainer(const recipe::Recipe& r, const dist::DistEnv& env);
  int run();
  void failed(const std::string& error);

 private:
  void begin(Progress& p, bool resumed);
  std::optional<int> run_epoch(int epoch, int64_t first, const std::string& run_id, bool pending_eval);
  std::optional<data::MicroBatches> open_epoch(int epoch, int64_t first);
  StepResult step(data::MicroBatches* batches);
  LocalSums forward_backward(data::MicroBatches* batches);
  LocalSums forward_backward_pairs(data::MicroBatches* batches);
  StepResult reduce(const LocalSums& sums, double data_wait, const std::vector<at::Tensor>& grads, at::Tensor& norm);
  std::vector<data::Example> examples(data::MicroBatches* batches);
  void lose_data(const std::string& why);
  void log_step(const StepResult& s, int epoch, int64_t s_in_epoch);
  bool evaluate(int epoch, bool steers = true);
  void steer(int epoch, const nlohmann::json& eval_row);
  void check_replicas();
  int stopped(const std::optional<Progress>& save = std::nullopt);
  int data_lost(const Progress& p);
  int finish();

  const recipe::Recipe& r_;
  const dist::DistEnv env_;
  const bool lead_, tty_, cuda_;
  dist::ProcessGroup pg_;
  Runtime rt_;
  model::CausalLM& m_;  // rt_'s
  const Agreement agree_;
  std::vector<at::Tensor> params_;
  std::optional<PreferenceObjective> pref_;  // train.objective: dpo, orpo
  std::unique_ptr<torch::optim::AdamW> opt_;
  dist::GradBuckets sync_;
  Checkpointer ckpt_;
  std::unique_ptr<track::RunSinks> sinks_;  // rank 0
  const Schedule schedule_;
  const int64_t steps_per_epoch_, total_steps_;
  const int64_t epoch_documents_;  // what an epoch's steps read, all ranks together
  std::optional<double> last_eval_loss_;
  Steering steer_;                    // best eval loss so far, evaluations since it improved
  int epochs_ran_ = r_.train.epochs;  // the epochs the run ends with (fewer when it stops early)
  bool stopping_early_ = false;       // patience ran out: the current epoch is the last
  int64_t step_ = 0;
  Skips skips_;  // documents skipped: this rank's in the current step, all ranks' in the epoch and the run
  // data.sources: this rank's examples and trained tokens per source in the current step, and all
  // ranks' since the last metrics row ([documents of each source…, tokens of each source…]).
  std::vector<double> source_here_ = std::vector<double>(2 * (rt_.mix ? rt_.mix->sources().size() : 0));
  std::vector<double> source_logged_ = source_here_;
  int warned_ = 0;                // skipped documents this rank has warned about
  at::Tensor rng_at_step_start_;  // this rank's generators before the current step
  std::string data_error_;        // why this rank's data source gave up (empty: it did not)
  Clock::time_point started_ = Clock::now();
  int64_t steps_this_process_ = 0;
  StepProfiler profile_{r_.train.profile_steps, r_.checkpoint.output_dir, env_.rank, cuda_};
};

// The process group and the runtime first; AdamW over the LoRA parameters, their gradient buckets.
Trainer::Trainer(const recipe::Recipe& r, const dist::DistEnv& env)
    : r_(r),
      env_(env),
      lead_(env.rank == 0),
      tty_(lead_ && isatty(STDOUT_FILENO)),
      cuda_(uses_cuda(r)),
      pg_(env, dist::backend_of(r.dist.backend, cuda_), std::chrono::seconds(r.dist.timeout_s)),
      rt_(r, env, {.pg = &pg_}),
      m_(rt_.model),
      agree_(pg_, env.rank, env.world_size, rt_.device),
      params_(model::lora_parameters(m_)),
      pref_(r.train.objective != recipe::Objective::Sft
                ? std::optional<PreferenceObjective>(std::in_place, r, m_, params_)
                : std::nullopt),
      opt_(make_adamw(model::lora_state(m_), r.train.lr, r.train.weight_decay, r.lora.plus_lr_ratio)),
      sync_(pg_, params_, static_cast<int64_t>(r.dist.bucket_mb * (1 << 20) / 4)),
      ckpt_(r, agree_, m_, model::lora_config_of(r.lora, r.model.path), params_, *opt_, rt_.data_identity(), cuda_),
      schedule_(schedule_of(r.train.lr_scheduler)),
      steps_per_epoch_(steps_per_epoch(r, rt_.per_rank(env.world_size))),
      total_steps_(steps_per_epoch_ * r.train.epochs),
      epoch_documents_(epoch_documents(r, rt_.per_rank(env.world_size), env.world_size)) {}

// The run, as the recipe describes it: resume if there is a state, then epochs of steps, each
// epoch ending with its checkpoint (per the policy) and a resumable state.
int Trainer::run() {
  ckpt_.restore_from_store();
  const std::optional<Progress> resumed = ckpt_.load({r_.train.epochs, steps_per_epoch_, rt_.data_identity()});
  Progress p = resumed.value_or(Progress{});
  steer_ = p.steering;
  // Ranks must agree on where they stand (a state visible to only some ranks is an error).
  if (!agree_.same(static_cast<double>(p.step)))
    throw Error(
        fmt::format("rank {} resumes at step {} but the ranks disagree: checkpoint.output_dir {} must be the same "
                    "directory (a shared filesystem) for every rank",
                    env_.rank, p.step, r_.checkpoint.output_dir));
  step_ = p.step;
  if (lead_) begin(p, resumed.has_value());
  m_.training = true;
  // eval.on_start: the model before any step (a stop during it ends the run, which has nothing to save)
  if (!resumed && r_.eval.on_start && rt_.evaluates() && !evaluate(p.epoch, false)) return stopped();
  for (int epoch = p.epoch; epoch < epochs_ran_; ++epoch) {
    const bool first = epoch == p.epoch;
    if (const auto ended = run_epoch(epoch, first ? p.step_in_epoch : 0, p.run_id, first && p.pending_eval))
      return *ended;
  }
  return finish();
}

// Rank 0, before the first step: the sinks (the run record first: a live run's record or output
// directory refuses this run before anything is written), the resolved recipe, what is about to run.
void Trainer::begin(Progress& p, bool resumed) {
  sinks_ = std::make_unique<track::RunSinks>(r_);
  int64_t eval_documents = rt_.eval ? rt_.eval->docs().size() : 0;
  for (const auto& e : rt_.source_evals) eval_documents += e->docs().size();
  track::RunInfo about = {{"torch_version", TORCH_VERSION},      {"world_size", env_.world_size},
                          {"device", cuda_ ? "cuda" : "cpu"},    {"data", rt_.describe_data()},
                          {"documents", rt_.documents()},        {"eval_documents", eval_documents},
                          {"steps_per_epoch", steps_per_epoch_}, {"restart", env_.restart}};
  if (rt_.mix) about["mixture"] = rt_.mix->plan();
  p.run_id = sinks_->open(about, resumed ? std::optional(p.step) : std::nullopt, p.run_id, env_.world_size);
  ckpt_.attach(*sinks_);  // (the store's indexes are made before the record is announced: see Checkpointer)
  if (sinks_->record())
    info(fmt::format("run recorded as {} (lora-train --from-run {} repeats it)", sinks_->ref(), sinks_->ref()));
  const fs::path out = r_.checkpoint.output_dir;
  io::write_file_atomic((out / "recipe.yaml").string(), recipe::to_yaml(r_));
  for (const std::string& line : rt_.summary(r_, env_.world_size, steps_per_epoch_, sync_.buckets())) info(line);
  if (r_.checkpoint.keep_best && !resumed) io::remove_tree((out / "best").string());  // an older run's
  if (resumed)
    info(fmt::format("resuming at epoch {} step {} (step {} of {})", p.epoch, p.step_in_epoch, p.step, total_steps_));
}

// One epoch from step `first`: its steps, then its checkpoint and the state the next one starts
// from. Returns the exit status when the run ends inside it (stopped, data lost). `pending_eval`:
// the evaluation due after step `first` was stopped before it ended; it is done first.
std::optional<int> Trainer::run_epoch(int epoch, int64_t first, const std::string& run_id, bool pending_eval) {
  if (!agree_.same(static_cast<double>(steps_per_epoch_ - first)))  // a mismatch would hang a collective
    throw Error(
        fmt::format("rank {} plans {} steps in epoch {} but the ranks disagree: every rank must see the same "
                    "documents and recipe",
                    env_.rank, steps_per_epoch_ - first, epoch));
  if (pending_eval && first < steps_per_epoch_ && !evaluate(epoch))
    return stopped(Progress{epoch, first, step_, run_id, steer_, true});
  std::optional<data::MicroBatches> batches;
  if (first < steps_per_epoch_) batches = open_epoch(epoch, first);
  double epoch_tokens = 0;
  bool stop = false;
  skips_.new_epoch();
  for (int64_t s = first; s < steps_per_epoch_ && !stopping_early_; ++s) {
    profile_.before_step();
    const StepResult res = step(batches ? &*batches : nullptr);
    profile_.after_step();
    if (res.data_failed) return data_lost({epoch, s, step_, run_id, steer_});
    stop = res.stop;
    epoch_tokens += res.tokens;
    ++step_;
    ++steps_this_process_;
    log_step(res, epoch, s);
    skips_.add(res.skipped.data());
    skips_.check(epoch, epoch_documents_, r_.data.max_skipped_share);
    if (r_.dist.debug_checksum_every_n_steps && step_ % *r_.dist.debug_checksum_every_n_steps == 0) check_replicas();
    const bool last = s + 1 == steps_per_epoch_;
    if (rt_.evaluates() && !last && r_.eval.every_n_steps && step_ % *r_.eval.every_n_steps == 0) {
      if (!evaluate(epoch)) return stopped(Progress{epoch, s + 1, step_, run_id, steer_, true});
      if (stopping_early_) break;  // this epoch, cut short, is the run's last
    }
    const auto every = r_.checkpoint.state_every_n_steps;
    if (!last && stop) return stopped(Progress{epoch, s + 1, step_, run_id, steer_});
    if (!last && every && step_ % *every == 0) ckpt_.save_state({epoch, s + 1, step_, run_id, steer_});
  }
  if (tty_) std::fputs("\n", stdout);
  if (first == 0 && epoch_tokens == 0)
    throw Error(
        fmt::format("epoch {} trained on no token: every document of the selection was rejected ({} skipped: "
                    "bad, longer than data.max_length with data.overlong=skip, or with no trained token); fix "
                    "the data or the data.* keys (see the warnings above)",
                    epoch, skips_.epoch_total()));
  // (a step's evaluation that stopped the run early is the last; one stopped by a signal is redone
  // when the run resumes, at the end of this epoch's steps)
  if (rt_.evaluates() && !stopping_early_ && !evaluate(epoch))
    return stopped(Progress{epoch, steps_per_epoch_, step_, run_id, steer_, true});
  ckpt_.save_epoch(epoch, epochs_ran_, step_);
  if (epoch + 1 < epochs_ran_) ckpt_.save_state({epoch + 1, 0, step_, run_id, steer_});
  if (stop && epoch + 1 < epochs_ran_) return stopped();
  return std::nullopt;
}

// This rank's batches of `epoch` from step `first`; none when the data is already gone (the
// steps then go on empty and the ranks stop together at the step's end).
std::optional<data::MicroBatches> Trainer::open_epoch(int epoch, int64_t first) {
  const auto seed = static_cast<uint64_t>(r_.train.seed);
  const data::ShardSpec spec{env_.world_size, env_.rank, seed, epoch, r_.data.shuffle, stop_flag()};
  const data::BatchPlan plan{r_.data.batch_size, r_.train.gradient_accumulation_steps,
                             r_.data.group_by_length ? r_.data.group_window : 1, seed, epoch};
  try {  // reads the first window
    if (rt_.mix) return std::optional<data::MicroBatches>(std::in_place, *rt_.mix, spec, plan, first);
    return std::optional<data::MicroBatches>(std::in_place, *rt_.docs, *rt_.builder, spec, plan, first);
  } catch (const data::DataUnavailable& e) {
    lose_data(e.what());
    return std::nullopt;
  }
}

// One optimizer step: `accum` micro-batches forward and backward (the last backward sums the
// gradients over ranks in buckets), then one small all-reduce of the step's figures, so the
// gradient is normalised by the global number of trained tokens. The host reads the device once,
// before the optimizer step: a non-finite loss or gradient norm, or a rank that lost its data,
// leaves the adapter as it was, on every rank alike.
StepResult Trainer::step(data::MicroBatches* batches) {
  const auto t0 = Clock::now();
  const auto waited = [&] { return batches ? batches->reader().wait_seconds() : 0.0; };
  const double wait0 = waited();
  std::fill(source_here_.begin(), source_here_.end(), 0.0);
  rng_at_step_start_ = rng_state(cuda_);  // a step given up for lost data must not move the streams
  const LocalSums sums = pref_ ? forward_backward_pairs(batches) : forward_backward(batches);
  const double busy = std::chrono::duration<double>(Clock::now() - t0).count();
  sync_.finish();
  std::vector<at::Tensor> grads;
  for (at::Tensor& p : params_)
    if (p.grad().defined()) grads.push_back(p.mutable_grad());
  at::Tensor grad_norm;
  StepResult res = reduce(sums, busy > 0 ? (waited() - wait0) / busy : 0.0, grads, grad_norm);
  if (res.taken_over) {
    if (!lead_) throw PeerError(0, "rank 0 lost the run record to another process; stopping");
    throw Error(fmt::format("{}: this process stops without writing anything more (a run record has one live run)",
                            *sinks_->lost_lease()));
  }
  if (res.data_failed) {
    opt_->zero_grad();
    return res;
  }
  if (!std::isfinite(res.loss) || !std::isfinite(res.grad_norm))
    throw Error(
        fmt::format("training diverged at step {}: the loss is {} and the gradient norm {}; nothing of this "
                    "step was applied or saved. Lower train.lr (now {:g}), set train.max_grad_norm, or check "
                    "the data, then start over (checkpoint.resume=never)",
                    step_ + 1, res.loss, res.grad_norm, r_.train.lr));
  RECORD_USER_SCOPE("optimizer");                // (train.profile_steps: the clipping and AdamW's step, as one)
  if (r_.train.max_grad_norm && !grads.empty())  // torch's clip_grad_norm_
    at::_foreach_mul_(grads, (*r_.train.max_grad_norm / (grad_norm + 1e-6)).clamp_max(1.0));
  set_lr(*opt_, res.lr, r_.lora.plus_lr_ratio);
  opt_->step();
  opt_->zero_grad();
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return res;
}

// The step's micro-batches through the model and back; the gradients accumulate in .grad.
LocalSums Trainer::forward_backward(data::MicroBatches* batches) {
  LocalSums sums;
  sums.loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(rt_.device));
  for (int a = 0; a < r_.train.gradient_accumulation_steps; ++a) {
    if (a + 1 == r_.train.gradient_accumulation_steps) sync_.arm();
    const data::Batch b =
        data::collate(examples(batches), r_.data.packing, static_cast<size_t>(r_.data.max_length), rt_.device);
    sums.real += b.real;
    sums.slots += b.slots;
    if (b.tokens == 0) {                             // an empty micro-batch: GradBuckets::finish() still joins in
      if (m_.base_sharded() && env_.world_size > 1)  // and the other ranks' gathers, with zero gradients
        m_.idle_pass(true, r_.data.packing);
      continue;
    }
    const at::Tensor hidden = m_.hidden_states(b.ids, b.mask, nullptr, r_.data.packing);
    const model::LossSum l = model::lm_head_loss(hidden, m_.lm_head(), b.rows, b.targets, m_.config().logit_softcap);
    l.sum.backward();
    sums.loss += l.sum.detach();
    sums.tokens += b.tokens;
  }
  return sums;
}

// A step of pairs: its micro-batches read first, so that each one's loss can be divided by the
// pairs (and chosen tokens) of the whole step, every rank's: the loss is a mean over the global
// batch's pairs, whatever the ranks and accumulation. The gradients accumulate in .grad.
LocalSums Trainer::forward_backward_pairs(data::MicroBatches* batches) {
  LocalSums sums;
  sums.loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(rt_.device));
  sums.pref = at::zeros({kPrefStats}, at::TensorOptions().dtype(at::kDouble).device(rt_.device));
  std::vector<PairBatch> micro;
  double mine[2] = {0, 0};
  for (int a = 0; a < r_.train.gradient_accumulation_steps; ++a) {
    micro.push_back(collate_pairs(examples(batches), rt_.device, pref_->whole_chosen()));
    mine[0] += static_cast<double>(micro.back().pairs);
    mine[1] += static_cast<double>(micro.back().chosen_tokens);
  }
  at::Tensor total = at::tensor({mine[0], mine[1]}, at::kDouble).to(rt_.device);
  agree_.sum(total);
  total = total.cpu();
  const double pairs = std::max(total[0].item<double>(), 1.0), chosen = total[1].item<double>();
  for (size_t a = 0; a < micro.size(); ++a) {
    if (a + 1 == micro.size()) sync_.arm();
    const PairBatch& b = micro[a];
    sums.real += b.rows.real;
    sums.slots += b.rows.slots;
    if (b.pairs == 0) {  // the others' reference and policy passes, joined
      if (m_.base_sharded() && env_.world_size > 1) {
        if (pref_->has_reference()) m_.idle_pass(false, false);
        m_.idle_pass(true, false);
      }
      continue;
    }
    const PreferenceObjective::Result res = pref_->forward(b, pairs, chosen);
    res.loss.backward();
    sums.loss += res.loss.detach();
    sums.pref += res.stats;
    sums.tokens += b.rows.tokens;
  }
  return sums;
}

// The step's figures summed over ranks (StepSums, then the objective's); the gradients divided by
// the global token count (unless the objective did), and their norm.
StepResult Trainer::reduce(const LocalSums& local, double data_wait, const std::vector<at::Tensor>& grads,
                           at::Tensor& norm) {
  StepSums mine{.loss = 0,  // (the device's loss is added on the device: no sync before the all-reduce)
                .tokens = double(local.tokens),
                .stop = stop_requested() ? 1.0 : 0.0,
                .data_wait = data_wait,
                .real = double(local.real),
                .slots = double(local.slots),
                .data_failed = data_error_.empty() ? 0.0 : 1.0,
                .taken_over = sinks_ && sinks_->lost_lease() ? 1.0 : 0.0,
                .skipped = skips_.take()};
  at::Tensor stats = at::from_blob(&mine, {kStepSums}, at::kDouble).to(rt_.device, /*non_blocking=*/false);
  stats[0].add_(local.loss);
  const bool normalised = local.pref.defined();
  if (normalised) stats = at::cat({stats, local.pref});
  if (!source_here_.empty()) stats = at::cat({stats, at::tensor(source_here_, at::kDouble).to(rt_.device)});
  agree_.sum(stats);
  if (!grads.empty() && !normalised) at::_foreach_div_(grads, stats[1].clamp_min(1.0));
  norm = grads.empty() ? at::zeros({}, stats.options())
                       : at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2)), 2);
  const at::Tensor done = at::cat({stats, norm.to(at::kDouble).view({1})}).cpu();
  StepSums all{};
  std::memcpy(&all, done.data_ptr<double>(), sizeof all);
  StepResult res;
  if (normalised) res.figures = pref_->figures(done.data_ptr<double>() + kStepSums);
  const double* sources = done.data_ptr<double>() + kStepSums + (normalised ? int64_t{kPrefStats} : 0);
  res.sources.assign(sources, sources + source_here_.size());
  res.tokens = all.tokens;
  res.rank_tokens = double(local.tokens);
  res.stop = all.stop > 0;
  res.data_wait = all.data_wait / env_.world_size;
  res.loss = normalised ? all.loss : all.loss / std::max(res.tokens, 1.0);  // 0 without tokens, unless non-finite
  res.padding = all.slots > 0 ? 1.0 - all.real / all.slots : 0.0;
  res.skipped = all.skipped;
  res.data_failed = all.data_failed > 0;
  res.taken_over = all.taken_over > 0;
  res.grad_norm = done.data_ptr<double>()[done.numel() - 1];
  res.lr = r_.train.lr * lr_factor(schedule_, step_, r_.train.warmup_steps, total_steps_);
  return res;
}

// The next micro-batch's examples; rejected documents are counted (or fatal, per the recipe).
std::vector<data::Example> Trainer::examples(data::MicroBatches* batches) {
  std::vector<data::Example> out;
  if (!data_error_.empty() || !batches) return out;
  std::vector<data::Built> next;
  try {
    next = batches->next();
  } catch (const data::DataUnavailable& e) {
    lose_data(e.what());
    return out;
  }
  for (data::Built& built : next) {
    if (auto* e = std::get_if<data::Example>(&built)) {
      if (!source_here_.empty()) {  // data.sources: [documents…, tokens…]
        source_here_[static_cast<size_t>(e->source)] += 1;
        source_here_[rt_.mix->sources().size() + static_cast<size_t>(e->source)] +=
            static_cast<double>(data::trained_tokens(*e));
      }
      out.push_back(std::move(*e));
      continue;
    }
    const auto& why = std::get<data::Rejection>(built);
    if (r_.data.bad_documents == recipe::BadDocuments::Fail && why.kind == data::Rejection::BadDocument)
      throw ConfigError(
          fmt::format("rank {}: bad document {}({}) and data.bad_documents is fail: fix the document or set "
                      "data.bad_documents=skip",
                      env_.rank, why.document.empty() ? "" : why.document + " ", why.reason));
    skips_.count(why);
    if (warned_++ < 3)
      warn(fmt::format("rank {}: skipping {}: {}", env_.rank,
                       why.document.empty() ? "a document" : "document " + why.document, why.reason));
  }
  return out;
}

// This rank's data source gave up: its steps go on empty, and at the step's end all ranks learn
// it and stop together (data_lost).
void Trainer::lose_data(const std::string& why) {
  data_error_ = why;
  log_error(fmt::format("rank {}: {}", env_.rank, why));
}

// Rank 0: a progress line on a TTY every step; every log_every_n_steps a line (log file, and the
// console when not a TTY) and a metrics row to the sinks. Other ranks: their own log file.
void Trainer::log_step(const StepResult& s, int epoch, int64_t s_in_epoch) {
  const double elapsed = std::chrono::duration<double>(Clock::now() - started_).count();
  const double eta = elapsed / static_cast<double>(steps_this_process_) * static_cast<double>(total_steps_ - step_);
  const std::string line = fmt::format(
      "epoch {}/{} step {}/{} loss {:.4f} lr {:.3g} grad_norm {:.3f} tokens/s {:.0f} data_wait {:.0f}% "
      "eta {}",
      epoch, r_.train.epochs, s_in_epoch + 1, steps_per_epoch_, s.loss, s.lr, s.grad_norm, s.tokens / s.seconds,
      100 * s.data_wait, clock_text(static_cast<int64_t>(eta)));
  const std::string shown = last_eval_loss_ ? fmt::format("{} eval_loss {:.4f}", line, *last_eval_loss_) : line;
  if (tty_) {
    std::fputs(("\r\033[K" + shown).c_str(), stdout);
    std::fflush(stdout);
  }
  for (size_t i = 0; i < s.sources.size(); ++i) source_logged_[i] += s.sources[i];
  if (step_ % r_.track.log_every_n_steps != 0) return;
  info(shown, lead_ && !tty_);
  if (!lead_) return;
  nlohmann::json row = {{"epoch", epoch},
                        {"step", step_},
                        {"loss", s.loss},
                        {"lr", s.lr},
                        {"grad_norm", s.grad_norm},
                        {"tokens", s.tokens},
                        {"tokens_per_s", s.tokens / s.seconds},
                        {"tokens_per_s_rank0", s.rank_tokens / s.seconds},
                        {"data_wait_share", s.data_wait},
                        {"padding_share", s.padding},
                        {"peak_rss_mb", peak_resident_mib()},
                        {"rss_mb", resident_mib()},
                        {"seconds", s.seconds}};
  row.update(s.figures);
  row.update(Skips::figures(s.skipped.data()));
  if (rt_.mix) {  // since the last row: the rows of an epoch add up to its mixture
    const auto& sources = rt_.mix->sources();
    nlohmann::json docs = nlohmann::json::object(), tokens = nlohmann::json::object();
    for (size_t i = 0; i < sources.size(); ++i) {
      docs[sources[i].spec.name] = static_cast<int64_t>(source_logged_[i]);
      tokens[sources[i].spec.name] = static_cast<int64_t>(source_logged_[sources.size() + i]);
    }
    row["source_documents"] = std::move(docs);
    row["source_tokens"] = std::move(tokens);
    std::fill(source_logged_.begin(), source_logged_.end(), 0.0);
  }
  // the base this rank holds (dist.shard_base: its slices and the blocks gathered whole now)
  row["base_mb"] = static_cast<double>(m_.base_bytes() + (rt_.shards ? rt_.shards->buffer_bytes() : 0)) / (1 << 20);
  sinks_->step(row);
}

// The loss over the evaluation documents, the model as it is now: each rank evaluates its share
// (eval_shard) and the ranks sum (loss, tokens, …) in float64, so every rank holds the same
// token-weighted mean and steers alike. Rank 0 reports it to the sinks.
//
// A stop request (SIGTERM/SIGINT) is honoured between two evaluation batches, the ranks agreeing
// before each: the partial evaluation is dropped (nothing logged or steered) and false returned;
// the state then saved says the evaluation is due, and a resumed run does it first. Without
// `steers` (eval.on_start's, before any step) it is reported but leaves best/ and early stopping be.
bool Trainer::evaluate(int epoch, bool steers) {
  const StopCheck stop = [this] { return agree_.any(stop_requested()); };
  const PreferenceObjective* pref = pref_ ? &*pref_ : nullptr;
  std::optional<nlohmann::json> row;
  if (rt_.eval) {
    row = evaluate_split(m_, *rt_.eval, *rt_.builder, r_, agree_, epoch, step_, stop, pref);
  } else {
    std::vector<NamedSplit> splits;
    for (size_t i = 0; i < rt_.source_evals.size(); ++i) {
      const data::MixSource& s = rt_.mix->sources()[i];
      splits.push_back({s.spec.name, rt_.source_evals[i].get(), s.builder.get()});
    }
    row = evaluate_sources(m_, splits, r_, agree_, epoch, step_, stop, pref);
  }
  if (!row) {
    if (lead_)
      info(fmt::format("evaluation at step {} stopped on request: it is done again when the run resumes", step_));
    return false;
  }
  const double mean = (*row)["eval_loss"].get<double>();
  last_eval_loss_ = mean;
  if (lead_) {
    if (tty_) std::fputs("\n", stdout);
    info(fmt::format(
        "eval at epoch {} step {}: eval_loss {:.6f} eval_ppl {:.4f} over {} tokens of {} documents ({:.1f} s)", epoch,
        step_, mean, std::exp(mean), (*row)["eval_tokens"].get<int64_t>(), (*row)["eval_documents"].get<int64_t>(),
        (*row)["eval_seconds"].get<double>()));
  }
  if (steers) steer(epoch, *row);
  if (!lead_) return true;
  if (steer_.best_loss) (*row)["best_eval_loss"] = *steer_.best_loss;
  sinks_->eval(*row);
  return true;
}

// After an evaluation (the same figures on every rank): best/ when the loss is the lowest so far
// (checkpoint.keep_best), and the end of the run when train.early_stopping_patience evaluations
// in a row did not lower the best loss by more than train.early_stopping_min_delta.
void Trainer::steer(int epoch, const nlohmann::json& eval_row) {
  const double loss = eval_row["eval_loss"].get<double>();
  const std::optional<double> before = steer_.best_loss;
  steer_.evals_since_best =
      !before || loss < *before - r_.train.early_stopping_min_delta ? 0 : steer_.evals_since_best + 1;
  if (!before || loss < *before) {
    steer_.best_loss = loss;
    steer_.best_step = step_;
    if (r_.checkpoint.keep_best) ckpt_.save_best(eval_row, step_);
  }
  const std::optional<int> patience = r_.train.early_stopping_patience;
  if (!patience || steer_.evals_since_best < *patience || step_ >= total_steps_) return;  // (the end anyway)
  stopping_early_ = true;
  epochs_ran_ = epoch + 1;
  if (lead_)
    info(fmt::format(
        "early stopping after step {} (epoch {}): {} evaluations without lowering the best eval_loss "
        "{:.6f} (step {}) by more than {:g}",
        step_, epoch, steer_.evals_since_best, *steer_.best_loss, steer_.best_step, r_.train.early_stopping_min_delta));
}

// Replicas must stay identical: every rank puts its parameter checksum in its own slot.
void Trainer::check_replicas() {
  double mine = 0;
  for (size_t i = 0; i < params_.size(); ++i) mine += params_[i].to(at::kDouble).sum().item<double>() * double(i + 1);
  if (!agree_.same(mine))
    throw Error(
        fmt::format("rank {}'s LoRA parameters differ from another rank's at step {} (checksum {}): the "
                    "replicas diverged",
                    env_.rank, step_, mine));
}

// Stopped on request (SIGTERM/SIGINT): `save`, when given, is the state to save first.
int Trainer::stopped(const std::optional<Progress>& save) {
  if (save) ckpt_.save_state(*save);
  if (lead_) {
    info(
        fmt::format("stopped at step {} on request; the resumable state is in {}: run the same command to "
                    "resume",
                    step_, ckpt_.state_dir()));
    sinks_->interrupted();
  }
  pg_.barrier();
  return kExitStopped;
}

// Some rank's data source gave up (retries spent, or stopped while waiting to retry): every rank
// saves the state of the last completed step and stops as on SIGTERM, so a rerun continues.
int Trainer::data_lost(const Progress& p) {
  set_rng_state(rng_at_step_start_, cuda_);
  ckpt_.save_state(p, false);  // (not to GridFS: the server is likely the data source that was lost)
  const std::string why = data_error_.empty() ? "another rank lost its data source (its log says why)" : data_error_;
  if (lead_ || !data_error_.empty())
    warn(fmt::format("rank {}: {}; the resumable state of step {} is in {}: run the same command to continue",
                     env_.rank, why, step_, ckpt_.state_dir()));
  if (lead_) sinks_->interrupted(why);
  pg_.barrier();
  return kExitStopped;
}

int Trainer::finish() {
  const RunSummary summary{.run_id = lead_ ? sinks_->ref() : "",
                           .steps = step_,
                           .steering = steer_,
                           .early_stopped_in = stopping_early_ ? std::optional(epochs_ran_ - 1) : std::nullopt};
  const std::vector<int> kept = ckpt_.finish(epochs_ran_, summary);
  if (lead_) {
    if (skips_.run_total() > 0) warn(skips_.summary());
    info(fmt::format("done: {} steps{}; adapters in {}", step_,
                     stopping_early_ ? fmt::format(" (stopped early in epoch {})", epochs_ran_ - 1) : "",
                     r_.checkpoint.output_dir));
    if (stopping_early_) sinks_->last_row()["early_stopped"] = true;
  }
  pg_.barrier();
  if (lead_) {  // (MLflow's uploads after the barrier: the other ranks need not wait for them)
    std::vector<std::pair<std::string, std::string>> adapters;  // the last kept epoch, best/
    const fs::path out = r_.checkpoint.output_dir;
    if (!kept.empty()) adapters.emplace_back((out / fmt::format("epoch_{}", kept.back())).string(), "adapter");
    if (r_.checkpoint.keep_best && fs::exists(out / "best")) adapters.emplace_back((out / "best").string(), "best");
    sinks_->completed(adapters);
  }
  return 0;
}

// (Not to the record when its server already proved unreachable: rank 0 then ends at once, with
// its own error.)
void Trainer::failed(const std::string& error) {
  if (!sinks_) return;
  try {  // (the error being reported is the one that matters)
    sinks_->failed(error, ckpt_.store_unreachable());
  } catch (const std::exception& e) {
    warn(fmt::format("the run's end was not recorded: {}", e.what()));
  }
}

}  // namespace

int run_training(const recipe::Recipe& r, const dist::DistEnv& env) {
  install_stop_handlers(env.rank == 0);
  // Rank 0 holds the output directory for the run's life, before anything is written there; no
  // rank writes a line into it while a link planted there could take the line elsewhere.
  std::optional<OutputDirLock> lock;
  if (env.rank == 0) lock.emplace(r.checkpoint.output_dir);
  io::refuse_links(r.checkpoint.output_dir, "checkpoint.output_dir");
  if (env.rank == 0)
    claim_output_dir(r.checkpoint.output_dir, r.checkpoint.overwrite, r.checkpoint.resume == recipe::Resume::Auto);
  const fs::path logs = fs::path(r.checkpoint.output_dir) / "logs";
  fs::create_directories(logs);
  log_to_file(io::OutFile((logs / fmt::format("rank_{}.log", env.rank)).string(), io::OutFile::Mode::Append).release());
  info(fmt::format("rank {}/{} (local {}) on {}; lorarun {}, torch {}", env.rank, env.world_size, env.local_rank,
                   uses_cuda(r) ? "cuda" : "cpu", LORARUN_VERSION, TORCH_VERSION),
       false);
  std::unique_ptr<Trainer> t;
  try {
    if (r.adapters.enabled()) return run_job(r, env);
    t = std::make_unique<Trainer>(r, env);
    return t->run();
  } catch (const std::exception& e) {
    log_error(e.what());
    if (t) t->failed(e.what());
    // Gloo reports a peer that died as an I/O error; the peer's own error is the one that matters.
    const std::string what = e.what();
    if (!dynamic_cast<const Error*>(&e) && what.find("gloo") != std::string::npos)
      throw PeerError(-1, fmt::format("rank {} lost its connection to another rank ({}): that rank stopped first, and "
                                      "its error says why",
                                      env.rank, what.substr(what.find(']') + 2)));
    throw;
  }
}

}  // namespace lorarun::train
