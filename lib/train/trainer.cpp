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
#include "dist/grad_buckets.hpp"
#include "dist/process_group.hpp"
#include "io/files.hpp"
#include "model/lora.hpp"
#include "track/sinks.hpp"
#include "train/adapter_run.hpp"
#include "train/agreement.hpp"
#include "train/checkpointer.hpp"
#include "train/evaluate.hpp"
#include "train/job.hpp"
#include "train/objective.hpp"
#include "train/optimizer.hpp"
#include "train/output_dir.hpp"
#include "train/profile.hpp"
#include "train/runtime.hpp"
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

class Trainer {
 public:
  Trainer(const recipe::Recipe& r, const dist::DistEnv& env);
  int run();
  void failed(const std::string& error);

 private:
  void begin(bool resumed);
  std::optional<int> run_epoch();
  void open_epoch();
  StepResult step();
  StepResult reduce(const Objective::Sums& sums, double data_wait, const std::vector<at::Tensor>& grads,
                    at::Tensor& norm);
  void log_step(const StepResult& s);
  bool evaluate(bool steers = true);
  int stopped(bool save = false);
  int data_lost();
  int finish();

  const recipe::Recipe& r_;
  const dist::DistEnv env_;
  const bool lead_, tty_, cuda_;
  dist::ProcessGroup pg_;
  Runtime rt_;
  model::CausalLM& m_;  // rt_'s
  const Agreement agree_;
  AdapterRun a_;  // the run's adapter: parameters, AdamW, schedule, checkpointer, progress, batches
  dist::GradBuckets sync_;
  std::unique_ptr<track::RunSinks> sinks_;  // rank 0
  // data.sources: all ranks' examples and trained tokens per source since the last metrics row
  // ([documents of each source…, tokens of each source…]).
  std::vector<double> source_logged_;
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
      a_("", r, model::lora_parameters(m_),
         make_adamw(model::lora_state(m_), r.train.lr, r.train.weight_decay, r.lora.plus_lr_ratio)),
      sync_(pg_, a_.params, static_cast<int64_t>(r.dist.bucket_mb * (1 << 20) / 4)) {
  a_.objective = make_objective(r, m_, model::lora_state(m_), agree_, rt_.device);
  a_.plan(rt_.per_rank(env.world_size), env.world_size);
  a_.ckpt = std::make_unique<Checkpointer>(a_.r, agree_, m_, model::lora_config_of(r.lora, r.model.path), a_.params,
                                           *a_.opt, rt_.data_identity(), cuda_);
  a_.source_step.assign(2 * (rt_.mix ? rt_.mix->sources().size() : 0), 0.0);
  source_logged_ = a_.source_step;
}

// The run, as the recipe describes it: resume if there is a state, then epochs of steps, each
// epoch ending with its checkpoint (per the policy) and a resumable state.
int Trainer::run() {
  a_.ckpt->restore_from_store();
  const std::optional<Progress> resumed = a_.ckpt->load({r_.train.epochs, a_.steps_per_epoch, rt_.data_identity()});
  Progress& p = a_.p;
  if (resumed) p = *resumed;
  // Ranks must agree on where they stand (a state visible to only some ranks is an error).
  if (!agree_.same(static_cast<double>(p.step)))
    throw Error(
        fmt::format("rank {} resumes at step {} but the ranks disagree: checkpoint.output_dir {} must be the same "
                    "directory (a shared filesystem) for every rank",
                    env_.rank, p.step, r_.checkpoint.output_dir));
  if (lead_) begin(resumed.has_value());
  m_.training = true;
  // eval.on_start: the model before any step (a stop during it ends the run, which has nothing to save)
  if (!resumed && r_.eval.on_start && rt_.evaluates() && !evaluate(false)) return stopped();
  while (p.epoch < a_.epochs)
    if (const auto ended = run_epoch()) return *ended;
  return finish();
}

// Rank 0, before the first step: the sinks (the run record first: a live run's record or output
// directory refuses this run before anything is written), the resolved recipe, what is about to run.
void Trainer::begin(bool resumed) {
  Progress& p = a_.p;
  sinks_ = std::make_unique<track::RunSinks>(r_);
  int64_t eval_documents = rt_.eval ? rt_.eval->docs().size() : 0;
  for (const auto& e : rt_.source_evals) eval_documents += e->docs().size();
  track::RunInfo about = {{"torch_version", TORCH_VERSION},        {"world_size", env_.world_size},
                          {"device", cuda_ ? "cuda" : "cpu"},      {"data", rt_.describe_data()},
                          {"documents", rt_.documents()},          {"eval_documents", eval_documents},
                          {"steps_per_epoch", a_.steps_per_epoch}, {"restart", env_.restart}};
  if (rt_.mix) about["mixture"] = rt_.mix->plan();
  p.run_id = sinks_->open(about, resumed ? std::optional(p.step) : std::nullopt, p.run_id, env_.world_size);
  a_.ckpt->attach(*sinks_);  // (the store's indexes are made before the record is announced: see Checkpointer)
  if (sinks_->record())
    info(fmt::format("run recorded as {} (lora-train --from-run {} repeats it)", sinks_->ref(), sinks_->ref()));
  const fs::path out = r_.checkpoint.output_dir;
  io::write_file_atomic((out / "recipe.yaml").string(), recipe::to_yaml(r_));
  for (const std::string& line : rt_.summary(r_, env_.world_size, a_.steps_per_epoch, sync_.buckets())) info(line);
  if (r_.checkpoint.keep_best && !resumed) io::remove_tree((out / "best").string());  // an older run's
  if (resumed)
    info(fmt::format("resuming at epoch {} step {} (step {} of {})", p.epoch, p.step_in_epoch, p.step, a_.total_steps));
}

// The epoch a_.p stands in, from its step on: its steps, then its checkpoint and the state the next
// one starts from. Returns the exit status when the run ends inside it (stopped, data lost). With
// p.pending_eval the evaluation due after that step was stopped before it ended; it comes first.
std::optional<int> Trainer::run_epoch() {
  Progress& p = a_.p;
  const int epoch = p.epoch;
  const int64_t first = p.step_in_epoch;
  if (!agree_.same(static_cast<double>(a_.steps_per_epoch - first)))  // a mismatch would hang a collective
    throw Error(
        fmt::format("rank {} plans {} steps in epoch {} but the ranks disagree: every rank must see the same "
                    "documents and recipe",
                    env_.rank, a_.steps_per_epoch - first, epoch));
  if (p.pending_eval && first < a_.steps_per_epoch && !evaluate()) return stopped(true);
  p.pending_eval = false;
  if (first < a_.steps_per_epoch) open_epoch();
  a_.epoch_tokens = 0;
  bool stop = false;
  a_.skips.new_epoch();
  while (p.step_in_epoch < a_.steps_per_epoch && !a_.stopping_early) {
    profile_.before_step();
    const StepResult res = step();
    profile_.after_step();
    if (res.data_failed) return data_lost();
    stop = res.stop;
    a_.epoch_tokens += res.tokens;
    ++p.step;
    ++p.step_in_epoch;
    ++steps_this_process_;
    log_step(res);
    a_.skips.add(res.skipped.data());
    a_.skips.check(epoch, a_.epoch_documents, r_.data.max_skipped_share);
    if (r_.dist.debug_checksum_every_n_steps && p.step % *r_.dist.debug_checksum_every_n_steps == 0)
      check_replicas(agree_, {&a_}, p.step);
    const bool last = p.step_in_epoch == a_.steps_per_epoch;
    if (rt_.evaluates() && !last && r_.eval.every_n_steps && p.step % *r_.eval.every_n_steps == 0) {
      if (!evaluate()) return stopped(true);
      if (a_.stopping_early) break;  // this epoch, cut short, is the run's last
    }
    const auto every = r_.checkpoint.state_every_n_steps;
    if (!last && stop) return stopped(true);
    if (!last && every && p.step % *every == 0) a_.ckpt->save_state(p);
  }
  if (tty_) std::fputs("\n", stdout);
  if (first == 0 && a_.epoch_tokens == 0)
    throw Error(
        fmt::format("epoch {} trained on no token: every document of the selection was rejected ({} skipped: "
                    "bad, longer than data.max_length with data.overlong=skip, or with no trained token); fix "
                    "the data or the data.* keys (see the warnings above)",
                    epoch, a_.skips.epoch_total()));
  // (a step's evaluation that stopped the run early is the last; one stopped by a signal is redone
  // when the run resumes, at the end of this epoch's steps)
  if (rt_.evaluates() && !a_.stopping_early && !evaluate()) return stopped(true);
  a_.ckpt->save_epoch(epoch, a_.epochs, p.step);
  a_.batches.reset();
  p.epoch += 1;
  p.step_in_epoch = 0;
  if (p.epoch < a_.epochs) a_.ckpt->save_state(p);
  if (stop && p.epoch < a_.epochs) return stopped();
  return std::nullopt;
}

// This rank's batches of the epoch from its step on; none when the data is already gone (the
// steps then go on empty and the ranks stop together at the step's end).
void Trainer::open_epoch() {
  const auto seed = static_cast<uint64_t>(r_.train.seed);
  const int epoch = a_.p.epoch;
  const data::ShardSpec spec{env_.world_size, env_.rank, seed, epoch, r_.data.shuffle, stop_flag()};
  const data::BatchPlan plan{r_.data.batch_size, r_.train.gradient_accumulation_steps,
                             r_.data.group_by_length ? r_.data.group_window : 1, seed, epoch};
  try {  // reads the first window
    if (rt_.mix)
      a_.batches.emplace(*rt_.mix, spec, plan, a_.p.step_in_epoch);
    else
      a_.batches.emplace(*rt_.docs, *rt_.builder, spec, plan, a_.p.step_in_epoch);
  } catch (const data::DataUnavailable& e) {
    data_error_ = e.what();
    log_error(fmt::format("rank {}: {}", env_.rank, data_error_));
  }
}

// One optimizer step: `accum` micro-batches forward and backward (the last backward sums the
// gradients over ranks in buckets), then one small all-reduce of the step's figures, so the
// gradient is normalised by the global number of trained tokens. The host reads the device once,
// before the optimizer step: a non-finite loss or gradient norm, or a rank that lost its data,
// leaves the adapter as it was, on every rank alike.
StepResult Trainer::step() {
  const auto t0 = Clock::now();
  const auto waited = [&] { return a_.batches ? a_.batches->reader().wait_seconds() : 0.0; };
  const double wait0 = waited();
  std::fill(a_.source_step.begin(), a_.source_step.end(), 0.0);
  rng_at_step_start_ = rng_state(cuda_);  // a step given up for lost data must not move the streams
  const Objective::Sums sums =
      a_.objective->forward_backward([this] { return a_.examples(env_.rank, warned_, data_error_); },
                                     r_.train.gradient_accumulation_steps, [this] { sync_.arm(); });
  const double busy = std::chrono::duration<double>(Clock::now() - t0).count();
  sync_.finish();
  std::vector<at::Tensor> grads;
  for (const at::Tensor& p : a_.params)
    if (p.grad().defined()) grads.push_back(p.grad());
  at::Tensor grad_norm;
  StepResult res = reduce(sums, busy > 0 ? (waited() - wait0) / busy : 0.0, grads, grad_norm);
  if (res.taken_over) {
    if (!lead_) throw PeerError(0, "rank 0 lost the run record to another process; stopping");
    throw Error(fmt::format("{}: this process stops without writing anything more (a run record has one live run)",
                            *sinks_->lost_lease()));
  }
  if (res.data_failed) {
    a_.opt->zero_grad();
    return res;
  }
  a_.check_finite(res.loss, res.grad_norm);
  a_.apply(grads, grad_norm, res.lr);
  a_.opt->zero_grad();
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return res;
}

// The step's figures summed over ranks (StepSums, then the objective's); the gradients divided by
// the global token count (unless the objective did), and their norm.
StepResult Trainer::reduce(const Objective::Sums& local, double data_wait, const std::vector<at::Tensor>& grads,
                           at::Tensor& norm) {
  StepSums mine{.loss = 0,  // (the device's loss is added on the device: no sync before the all-reduce)
                .tokens = double(local.tokens),
                .stop = stop_requested() ? 1.0 : 0.0,
                .data_wait = data_wait,
                .real = double(local.real),
                .slots = double(local.slots),
                .data_failed = data_error_.empty() ? 0.0 : 1.0,
                .taken_over = sinks_ && sinks_->lost_lease() ? 1.0 : 0.0,
                .skipped = a_.skips.take()};
  at::Tensor stats = at::from_blob(&mine, {kStepSums}, at::kDouble).to(rt_.device, /*non_blocking=*/false);
  stats[0].add_(local.loss);
  const bool normalised = a_.objective->normalised();
  if (local.stats.defined()) stats = at::cat({stats, local.stats});
  if (!a_.source_step.empty()) stats = at::cat({stats, at::tensor(a_.source_step, at::kDouble).to(rt_.device)});
  agree_.sum(stats);
  if (!grads.empty() && !normalised) at::_foreach_div_(grads, stats[1].clamp_min(1.0));
  norm = grads.empty() ? at::zeros({}, stats.options())
                       : at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2)), 2);
  const at::Tensor done = at::cat({stats, norm.to(at::kDouble).view({1})}).cpu();
  StepSums all{};
  std::memcpy(&all, done.data_ptr<double>(), sizeof all);
  StepResult res;
  res.figures = a_.objective->figures(done.data_ptr<double>() + kStepSums);
  const double* sources = done.data_ptr<double>() + kStepSums + a_.objective->stats();
  res.sources.assign(sources, sources + a_.source_step.size());
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
  res.lr = a_.lr();
  return res;
}

// Rank 0: a progress line on a TTY every step; every log_every_n_steps a line (log file, and the
// console when not a TTY) and a metrics row to the sinks. Other ranks: their own log file.
void Trainer::log_step(const StepResult& s) {
  const Progress& p = a_.p;
  const double elapsed = std::chrono::duration<double>(Clock::now() - started_).count();
  const double eta = elapsed / static_cast<double>(steps_this_process_) * static_cast<double>(a_.total_steps - p.step);
  const std::string line = fmt::format(
      "epoch {}/{} step {}/{} loss {:.4f} lr {:.3g} grad_norm {:.3f} tokens/s {:.0f} data_wait {:.0f}% "
      "eta {}",
      p.epoch, r_.train.epochs, p.step_in_epoch, a_.steps_per_epoch, s.loss, s.lr, s.grad_norm, s.tokens / s.seconds,
      100 * s.data_wait, clock_text(static_cast<int64_t>(eta)));
  const std::string shown = a_.last_eval_loss ? fmt::format("{} eval_loss {:.4f}", line, *a_.last_eval_loss) : line;
  if (tty_) {
    std::fputs(("\r\033[K" + shown).c_str(), stdout);
    std::fflush(stdout);
  }
  for (size_t i = 0; i < s.sources.size(); ++i) source_logged_[i] += s.sources[i];
  if (p.step % r_.track.log_every_n_steps != 0) return;
  info(shown, lead_ && !tty_);
  if (!lead_) return;
  nlohmann::json row = {{"epoch", p.epoch},
                        {"step", p.step},
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
bool Trainer::evaluate(bool steers) {
  const StopCheck stop = [this] { return agree_.any(stop_requested()); };
  const PreferenceObjective* pref = a_.objective->preference();
  const Progress& p = a_.p;
  std::optional<nlohmann::json> row;
  if (rt_.eval) {
    row = evaluate_split(m_, *rt_.eval, *rt_.builder, r_, agree_, p.epoch, p.step, stop, pref);
  } else {
    std::vector<NamedSplit> splits;
    for (size_t i = 0; i < rt_.source_evals.size(); ++i) {
      const data::MixSource& s = rt_.mix->sources()[i];
      splits.push_back({s.spec.name, rt_.source_evals[i].get(), s.builder.get()});
    }
    row = evaluate_sources(m_, splits, r_, agree_, p.epoch, p.step, stop, pref);
  }
  if (!row) {
    if (lead_)
      info(fmt::format("evaluation at step {} stopped on request: it is done again when the run resumes", p.step));
    a_.p.pending_eval = true;
    return false;
  }
  a_.evaluated(*row, steers, lead_, tty_);
  if (!lead_) return true;
  if (p.steering.best_loss) (*row)["best_eval_loss"] = *p.steering.best_loss;
  sinks_->eval(*row);
  return true;
}

// Stopped on request (SIGTERM/SIGINT): with `save`, the state where the run stands saved first.
int Trainer::stopped(bool save) {
  if (save) a_.ckpt->save_state(a_.p);
  if (lead_) {
    info(
        fmt::format("stopped at step {} on request; the resumable state is in {}: run the same command to "
                    "resume",
                    a_.p.step, a_.ckpt->state_dir()));
    sinks_->interrupted();
  }
  pg_.barrier();
  return kExitStopped;
}

// Some rank's data source gave up (retries spent, or stopped while waiting to retry): every rank
// saves the state of the last completed step and stops as on SIGTERM, so a rerun continues.
int Trainer::data_lost() {
  set_rng_state(rng_at_step_start_, cuda_);
  a_.ckpt->save_state(a_.p, false);  // (not to GridFS: the server is likely the data source that was lost)
  const std::string why = data_error_.empty() ? "another rank lost its data source (its log says why)" : data_error_;
  if (lead_ || !data_error_.empty())
    warn(fmt::format("rank {}: {}; the resumable state of step {} is in {}: run the same command to continue",
                     env_.rank, why, a_.p.step, a_.ckpt->state_dir()));
  if (lead_) sinks_->interrupted(why);
  pg_.barrier();
  return kExitStopped;
}

int Trainer::finish() {
  const int64_t steps = a_.p.step;
  const std::optional<int> early = a_.stopping_early ? std::optional(a_.epochs - 1) : std::nullopt;
  const RunSummary summary{
      .run_id = lead_ ? sinks_->ref() : "", .steps = steps, .steering = a_.p.steering, .early_stopped_in = early};
  const std::vector<int> kept = a_.ckpt->finish(a_.epochs, summary);
  if (lead_) {
    if (a_.skips.run_total() > 0) warn(a_.skips.summary());
    info(fmt::format("done: {} steps{}; adapters in {}", steps,
                     early ? fmt::format(" (stopped early in epoch {})", *early) : "", r_.checkpoint.output_dir));
    if (early) sinks_->last_row()["early_stopped"] = true;
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
    sinks_->failed(error, a_.ckpt->store_unreachable());
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
