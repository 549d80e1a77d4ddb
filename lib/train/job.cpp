#include "train/job.hpp"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>
#include <optional>

#include "data/batches.hpp"
#include "data/collate.hpp"
#include "dist/grad_buckets.hpp"
#include "dist/process_group.hpp"
#include "io/files.hpp"
#include "model/lora.hpp"
#include "model/loss.hpp"
#include "track/sinks.hpp"
#include "train/adapter_run.hpp"
#include "train/agreement.hpp"
#include "train/checkpointer.hpp"
#include "train/evaluate.hpp"
#include "train/objective.hpp"
#include "train/optimizer.hpp"
#include "train/output_dir.hpp"
#include "train/profile.hpp"
#include "train/runtime.hpp"
#include "train/schedule.hpp"
#include "train/skips.hpp"
#include "train/stop.hpp"
#include "train/trainer.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/process.hpp"
#include "util/untrusted.hpp"

namespace lorarun::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// One adapter of the job: its run (AdapterRun: its own run's recipe, documents, adapter, optimizer,
// schedule, checkpointer and where it stands), its slot in the model, and this step's sums.
struct Tenant {
  int slot = 0;
  std::unique_ptr<AdapterRun> run;
  bool done = false;
  // this step: summed token losses on the device, trained tokens, document tokens, row slots
  at::Tensor loss;
  int64_t tokens = 0, real = 0, slots = 0;
  at::Tensor stats;  // its objective's (Objective::Sums::stats)
  at::Tensor rng_at_step_start;
};

// How a job step ended.
enum class StepEnd { Go, Stop, DataLost };

// The figures the ranks sum per step, first the job's, then per active adapter kPerTenant and its
// objective's stats.
enum JobSum { kStop, kDataWait, kDataFailed, kTakenOver, kJobSums };
enum TenantSum { kLoss, kTokens, kReal, kSlots, kSkipped, kPerTenant = kSkipped + Skips::kCauses };

class Job {
 public:
  Job(const recipe::Recipe& r, const dist::DistEnv& env);
  int run();
  void failed(const std::string& error);

 private:
  void open_data(AdapterRun& a);
  void begin(bool resumed, const std::string& run_id);
  bool settle(Tenant& t);
  void open_batches(Tenant& t);
  StepEnd step(const std::vector<Tenant*>& active);
  void pass(const std::vector<data::Batch>& parts, const std::vector<Tenant*>& owners);
  void shared_passes(const std::vector<Tenant*>& active);
  void own_passes(Tenant& t);
  bool after_step(Tenant& t, bool stopping, bool stop);
  bool end_epoch(Tenant& t, bool stopping);
  void close_epoch(Tenant& t);
  bool evaluate(Tenant& t, bool steers = true);
  int stopped();
  int data_lost();
  int finish();

  const recipe::Recipe& r_;
  const dist::DistEnv env_;
  const bool lead_, tty_, cuda_;
  dist::ProcessGroup pg_;
  Runtime rt_;
  model::CausalLM& m_;
  const Agreement agree_;
  model::DropoutStreams streams_;
  std::vector<std::unique_ptr<Tenant>> tenants_;
  std::unique_ptr<dist::GradBuckets> sync_;
  std::unique_ptr<track::RunSinks> sinks_;
  int64_t step_ = 0;  // job steps done (its adapters' steps, as they run in step)
  int64_t total_steps_ = 0;
  std::string run_id_;
  std::string data_error_;
  int warned_ = 0;
  Clock::time_point started_ = Clock::now();
  int64_t steps_this_process_ = 0;
  StepProfiler profile_{r_.train.profile_steps, r_.checkpoint.output_dir, env_.rank, cuda_};
};

Job::Job(const recipe::Recipe& r, const dist::DistEnv& env)
    : r_(r),
      env_(env),
      lead_(env.rank == 0),
      tty_(lead_ && isatty(STDOUT_FILENO)),
      cuda_(uses_cuda(r)),
      pg_(env, dist::backend_of(r.dist.backend, cuda_), std::chrono::seconds(r.dist.timeout_s)),
      rt_(r, env, {.pg = &pg_, .tenants = true}),
      m_(rt_.model),
      agree_(pg_, env.rank, env.world_size, rt_.device),
      streams_(0, 0, rt_.device) {
  const std::vector<recipe::AdapterSpec> specs = job_adapters(r);
  // Every rank must train the same adapters in the same slots (a value added between two ranks'
  // queries would shift them).
  std::string names;
  for (const recipe::AdapterSpec& s : specs) names += s.name + "/";
  if (!agree_.same(static_cast<double>(std::hash<std::string>{}(names) % (1LL << 52))))
    throw Error(
        fmt::format("rank {} found the adapters {} but another rank found others: the data changed while "
                    "the job started; start it again",
                    env.rank, printable(names)));
  streams_ = model::DropoutStreams(specs.size(), dropout_seed(r.train.seed, env.rank), rt_.device);
  std::vector<at::Tensor> all;
  for (size_t i = 0; i < specs.size(); ++i) {
    auto t = std::make_unique<Tenant>();
    t->slot = static_cast<int>(i);
    recipe::Recipe own = recipe::adapter_recipe(r, specs[i]);
    model::LoraConfig cfg = model::lora_config_of(own.lora, r.model.path);
    cfg.tenant = t->slot;
    try {
      as_input_error([&] {
        model::attach_tenant(m_, cfg, static_cast<uint64_t>(r.train.seed), t->slot, static_cast<int>(specs.size()));
        if (!own.lora.init_from.empty()) model::start_tenant_from(m_, t->slot, cfg, own.lora.init_from);
      });
    } catch (const Error& e) {
      rethrow_within(e, fmt::format("adapter '{}': ", specs[i].name));
    }
    auto opt =
        make_adamw(model::tenant_state(m_, t->slot), own.train.lr, own.train.weight_decay, own.lora.plus_lr_ratio);
    t->run = std::make_unique<AdapterRun>(specs[i].name, std::move(own), model::tenant_parameters(m_, t->slot),
                                          std::move(opt));
    AdapterRun& a = *t->run;
    try {  // (an Error or a ConfigError names the adapter; a lost server stays as it is)
      open_data(a);
    } catch (const Error& e) {
      rethrow_within(e, a.who());
    }
    a.plan(data::examples_per_rank(a.docs->size(), env.world_size), env.world_size);
    model::DropoutStreams* streams = &streams_;
    const int slot = t->slot;
    const RngStream rng{[streams, slot] { return streams->state(slot); },
                        [streams, slot](const at::Tensor& b) { streams->set_state(slot, b); }};
    a.ckpt = std::make_unique<Checkpointer>(a.r, agree_, m_, cfg, a.params, *a.opt, a.docs->identity(), cuda_, rng);
    a.ckpt->store_as_adapter(a.name);
    a.objective = make_objective(a.r, m_, model::tenant_state(m_, t->slot), agree_, rt_.device);
    all.insert(all.end(), a.params.begin(), a.params.end());
    tenants_.push_back(std::move(t));
  }
  sync_ = std::make_unique<dist::GradBuckets>(pg_, all, static_cast<int64_t>(r.dist.bucket_mb * (1 << 20) / 4));
}

// Adapter a's documents and evaluation split. When eval.fraction holds out none of its documents,
// or all of them (a tenant of a few), it trains on them all, unevaluated, as its own run with
// eval.fraction 0 does: one small tenant does not stop the job.
void Job::open_data(AdapterRun& a) {
  try {
    a.docs = std::make_unique<data::Documents>(a.r.data, data::Holdout::training(a.r.eval.fraction));
    if (a.r.eval.enabled(a.r.data.source)) {
      a.eval = std::make_unique<data::EvalSplit>(a.r, a.docs.get());
      require_scored_token(a.eval->docs(), *rt_.builder, a.eval->describe());
    }
    return;
  } catch (const data::EmptySplit&) {
  }
  const bool none = a.docs != nullptr;  // training kept every document: none held out
  const double fraction = a.r.eval.fraction;
  a.r.eval.fraction = 0;
  a.r.checkpoint.keep_best = false;
  a.r.train.early_stopping_patience.reset();
  a.eval.reset();
  a.docs = std::make_unique<data::Documents>(a.r.data);
  if (lead_)
    warn(
        fmt::format("adapter '{}': eval.fraction {:g} holds out {} of its {} documents: it trains on them all and "
                    "is not evaluated (no eval_loss, best/ or early stop of its own)",
                    a.name, fraction, none ? "none" : "every one", a.docs->size()));
}

// Each adapter resumes from its own state (or starts, or has finished), then job steps until every
// adapter has run its own steps.
int Job::run() {
  std::vector<std::string> states;  // checkpoint.store: mongodb: none here, the job's stored ones come back
  for (const auto& t : tenants_) states.push_back(t->run->ckpt->state_dir());
  restore_from_store(r_, agree_, states);
  bool resumed = false;
  for (auto& t : tenants_) {
    AdapterRun& a = *t->run;
    const fs::path out = a.r.checkpoint.output_dir;
    const std::optional<Progress> p = a.ckpt->load({a.epochs, a.steps_per_epoch, a.docs->identity()});
    if (p) {
      a.p = *p;
      resumed = true;
      if (!p->run_id.empty()) run_id_ = p->run_id;
    } else if (r_.checkpoint.resume == recipe::Resume::Auto && fs::exists(finished_marker(out.string()))) {
      t->done = true;  // finished earlier in this job
      a.p.step = a.total_steps;
    }
  }
  std::vector<double> where;
  for (auto& t : tenants_) where.push_back(static_cast<double>(t->run->p.step) + (t->done ? 0.5 : 0.0));
  at::Tensor mine = at::tensor(where, at::kDouble);
  if (!agree_.same(at::sum(mine * at::arange(1, mine.numel() + 1, at::kDouble)).item<double>()))
    throw Error(fmt::format(
        "rank {} resumes its adapters at other steps than another rank: checkpoint.output_dir {} must be the same "
        "directory (a shared filesystem) for every rank",
        env_.rank, r_.checkpoint.output_dir));
  step_ = INT64_MAX;
  for (auto& t : tenants_) {
    total_steps_ = std::max(total_steps_, t->run->total_steps);
    if (!t->done) step_ = std::min(step_, t->run->p.step);
  }
  if (step_ == INT64_MAX) step_ = total_steps_;
  if (lead_) begin(resumed, run_id_);
  m_.training = true;
  for (auto& t : tenants_)  // eval.on_start: each adapter before its first step, as its own run
    if (!resumed && r_.eval.on_start && t->run->eval && !evaluate(*t, false)) return stopped();
  while (true) {
    std::vector<Tenant*> active;
    for (auto& t : tenants_) {
      if (t->done) continue;
      if (!settle(*t)) return stopped();
      if (!t->done) active.push_back(t.get());
    }
    if (active.empty()) break;
    profile_.before_step();
    const StepEnd end = step(active);
    profile_.after_step();
    if (end == StepEnd::DataLost) return data_lost();
    if (end == StepEnd::Stop) return stopped();
  }
  return finish();
}

// Rank 0, before the first step: the sinks (the record first), the job's recipe, the plan.
void Job::begin(bool resumed, const std::string& run_id) {
  sinks_ = std::make_unique<track::RunSinks>(r_);
  nlohmann::json adapters = nlohmann::json::array();
  int64_t documents = 0;
  for (const auto& t : tenants_) {
    const AdapterRun& a = *t->run;
    adapters.push_back({{"name", a.name},
                        {"documents", a.docs->size()},
                        {"steps_per_epoch", a.steps_per_epoch},
                        {"epochs", a.r.train.epochs},
                        {"r", a.r.lora.r},
                        {"lr", a.r.train.lr},
                        {"output_dir", a.r.checkpoint.output_dir}});
    documents += a.docs->size();
  }
  const track::RunInfo about = {
      {"torch_version", TORCH_VERSION}, {"world_size", env_.world_size}, {"device", cuda_ ? "cuda" : "cpu"},
      {"documents", documents},         {"adapters", adapters},          {"job_steps", total_steps_},
      {"restart", env_.restart}};
  run_id_ = sinks_->open(about, resumed ? std::optional(step_) : std::nullopt, run_id, env_.world_size);
  for (auto& t : tenants_) {
    t->run->p.run_id = run_id_;  // (saved with each state: a resumed job continues this record)
    t->run->ckpt->attach(*sinks_);
  }
  if (sinks_->record())
    info(fmt::format("run recorded as {} (lora-train --from-run {} repeats it)", sinks_->ref(), sinks_->ref()));
  io::write_file_atomic((fs::path(r_.checkpoint.output_dir) / "recipe.yaml").string(), recipe::to_yaml(r_));
  info(fmt::format("{} adapters on one base ({} rank(s)), {} job steps at most: {}", tenants_.size(), env_.world_size,
                   total_steps_, model::trainable_summary(m_)));
  for (const auto& t : tenants_) {
    const AdapterRun& a = *t->run;
    info(fmt::format("adapter '{}': {}; {} documents from {}, {} steps per epoch x {} epochs{}{}", a.name,
                     model::describe_adapter(a.r.lora), a.docs->size(), a.docs->describe(), a.steps_per_epoch,
                     a.r.train.epochs, a.eval ? fmt::format("; evaluating on {}", a.eval->describe()) : "",
                     t->done ? " (finished)" : ""));
  }
  if (r_.model.keep_quantized) info(model::gguf_blocks_summary(m_));
  if (r_.lora.quantize_base) info(model::nf4_summary(m_));
  if (resumed) info(fmt::format("resuming the job at step {} of at most {}", step_, total_steps_));
}

// Before a step, what an adapter still owes: the evaluation a stop cut short, the end of an epoch
// whose steps are done; then its epoch's batches. False: a stop came during an evaluation.
bool Job::settle(Tenant& t) {
  AdapterRun& a = *t.run;
  if (a.p.pending_eval) {
    if (!evaluate(t)) return false;
    a.p.pending_eval = false;
    if (a.stopping_early || a.p.step_in_epoch == a.steps_per_epoch) close_epoch(t);
  } else if (a.p.step_in_epoch == a.steps_per_epoch) {
    if (!end_epoch(t, false)) return false;
  }
  if (!t.done && !a.batches) open_batches(t);
  return true;
}

// The adapter's batches of its epoch from its step on, read as its own run reads them.
void Job::open_batches(Tenant& t) {
  AdapterRun& a = *t.run;
  const auto seed = static_cast<uint64_t>(a.r.train.seed);
  const data::ShardSpec spec{env_.world_size, env_.rank, seed, a.p.epoch, a.r.data.shuffle, stop_flag()};
  const data::BatchPlan plan{a.r.data.batch_size, a.r.train.gradient_accumulation_steps,
                             a.r.data.group_by_length ? a.r.data.group_window : 1, seed, a.p.epoch};
  a.whole_epoch_here = a.p.step_in_epoch == 0;
  if (a.whole_epoch_here) a.epoch_tokens = 0;
  a.skips.new_epoch();
  try {
    a.batches.emplace(*a.docs, *rt_.builder, spec, plan, a.p.step_in_epoch);
  } catch (const data::DataUnavailable& e) {
    data_error_ = fmt::format("adapter '{}': {}", a.name, e.what());
    log_error(fmt::format("rank {}: {}", env_.rank, data_error_));
  }
}

// Micro-batches of several adapters (parts[k] owners[k]'s), stacked, through the model once; each
// adapter's loss summed over its own tokens, and one backward.
void Job::pass(const std::vector<data::Batch>& parts, const std::vector<Tenant*>& owners) {
  const data::Stacked s = data::stack(parts);
  auto routes = std::make_shared<model::Routes>();
  routes->streams = &streams_;
  for (size_t k = 0; k < parts.size(); ++k)
    routes->routes.push_back({owners[k]->slot, s.parts[k].row0, s.parts[k].rows, s.parts[k].length});
  const model::CausalLM::Routing routing(m_, routes);
  const at::Tensor hidden = m_.hidden_states(s.ids, s.mask, nullptr, r_.data.packing);
  at::Tensor total;
  for (size_t k = 0; k < parts.size(); ++k) {
    const model::LossSum l =
        model::lm_head_loss(hidden, m_.lm_head(), s.parts[k].flat_rows, s.parts[k].targets, m_.config().logit_softcap);
    total = total.defined() ? total + l.sum : l.sum;
    owners[k]->loss += l.sum.detach();
    owners[k]->tokens += parts[k].tokens;
  }
  total.backward();
}

// SFT: micro-batch k of every active adapter's step through the model in passes of at most
// adapters.per_pass adapters, in slot order: the same passes on every rank (a sharded base gathers
// in each), whichever of them have rows here.
void Job::shared_passes(const std::vector<Tenant*>& active) {
  const auto per_pass = static_cast<size_t>(adapters_per_pass(r_, static_cast<int>(active.size())));
  const int accum = r_.train.gradient_accumulation_steps;
  for (int a = 0; a < accum; ++a) {
    if (a + 1 == accum) sync_->arm();
    for (size_t first = 0; first < active.size(); first += per_pass) {
      std::vector<data::Batch> parts;
      std::vector<Tenant*> owners;
      for (size_t i = first; i < std::min(active.size(), first + per_pass); ++i) {
        Tenant* t = active[i];
        data::Batch b = data::collate(t->run->examples(env_.rank, warned_, data_error_), r_.data.packing,
                                      static_cast<size_t>(r_.data.max_length), rt_.device);
        t->real += b.real;
        t->slots += b.slots;
        if (b.tokens == 0) continue;  // as its own run: no pass, no dropout drawn
        parts.push_back(std::move(b));
        owners.push_back(t);
      }
      if (parts.empty()) {  // (the other ranks' gathers joined, with zero gradients)
        m_.skip_pass(true, r_.data.packing);
        continue;
      }
      pass(parts, owners);
    }
  }
}

// Adapter t's micro-batches of the step through its objective alone (pairs are read first, to be
// divided by the step's pairs), every row through its adapter with its dropout stream: its own run's
// passes.
void Job::own_passes(Tenant& t) {
  AdapterRun& a = *t.run;
  const model::CausalLM::Routing alone(
      m_, std::make_shared<model::Routes>(model::Routes{.routes = {}, .all = t.slot, .streams = &streams_}));
  const Objective::Sums s = a.objective->forward_backward([&] { return a.examples(env_.rank, warned_, data_error_); },
                                                          r_.train.gradient_accumulation_steps, [] {});
  t.loss = s.loss;
  t.tokens = s.tokens;
  t.real = s.real;
  t.slots = s.slots;
  t.stats = s.stats;
}

// One job step: every active adapter's micro-batches through the model (SFT's stacked in shared
// passes, pairs each adapter's in its own). Then one all-reduce of every adapter's figures, and per
// adapter what its own run does: gradients divided by its global token count (unless its objective
// did), clipped by its own norm, its AdamW step at its own learning rate; then its evaluation,
// epoch end and state as its own run has them after that step.
StepEnd Job::step(const std::vector<Tenant*>& active) {
  const auto t0 = Clock::now();
  const auto waited = [&] {
    double s = 0;
    for (Tenant* t : active)
      if (t->run->batches) s += t->run->batches->reader().wait_seconds();
    return s;
  };
  const double wait0 = waited();
  const auto device_zero = at::TensorOptions().dtype(at::kFloat).device(rt_.device);
  for (Tenant* t : active) {
    t->loss = at::zeros({}, device_zero);
    t->tokens = t->real = t->slots = 0;
    t->rng_at_step_start = streams_.state(t->slot);
  }
  if (r_.train.objective == recipe::Objective::Sft) {
    shared_passes(active);
  } else {  // pairs (dpo, orpo): unarmed, the gradients all-reduced at finish, each adapter's step summed first
    for (Tenant* t : active) own_passes(*t);
  }
  const double busy = std::chrono::duration<double>(Clock::now() - t0).count();
  sync_->finish();

  // One all-reduce: the job's flags, then each active adapter's figures, in slot order.
  const Objective& objective = *active.front()->run->objective;  // (every adapter's is the recipe's)
  const int64_t width = kPerTenant + objective.stats();
  std::vector<double> mine(kJobSums + width * active.size(), 0.0);
  mine[kStop] = stop_requested() ? 1.0 : 0.0;
  mine[kDataWait] = busy > 0 ? (waited() - wait0) / busy : 0.0;
  mine[kDataFailed] = data_error_.empty() ? 0.0 : 1.0;
  mine[kTakenOver] = sinks_ && sinks_->lost_lease() ? 1.0 : 0.0;
  for (size_t i = 0; i < active.size(); ++i) {
    double* f = &mine[kJobSums + width * i];
    f[kTokens] = static_cast<double>(active[i]->tokens);
    f[kReal] = static_cast<double>(active[i]->real);
    f[kSlots] = static_cast<double>(active[i]->slots);
    const Skips::Counts skipped = active[i]->run->skips.take();
    std::copy(skipped.begin(), skipped.end(), f + kSkipped);
  }
  at::Tensor stats = at::tensor(mine, at::kDouble).to(rt_.device);
  for (size_t i = 0; i < active.size(); ++i) {
    stats[kJobSums + width * i + kLoss].add_(active[i]->loss);
    if (active[i]->stats.defined())
      stats.narrow(0, kJobSums + width * i + kPerTenant, width - kPerTenant).add_(active[i]->stats);
  }
  agree_.sum(stats);
  std::vector<std::vector<at::Tensor>> grads(active.size());
  std::vector<at::Tensor> norms;
  for (size_t i = 0; i < active.size(); ++i) {
    for (const at::Tensor& p : active[i]->run->params)
      if (p.grad().defined()) grads[i].push_back(p.grad());
    if (!grads[i].empty() && !objective.normalised())
      at::_foreach_div_(grads[i], stats[kJobSums + width * i + kTokens].clamp_min(1.0));
    norms.push_back(grads[i].empty() ? at::zeros({}, stats.options())
                                     : at::linalg_vector_norm(at::stack(at::_foreach_norm(grads[i], 2)), 2));
  }
  std::vector<at::Tensor> all_norms;
  for (const at::Tensor& n : norms) all_norms.push_back(n.to(at::kDouble).view({1}));
  const at::Tensor done = at::cat({stats, at::cat(all_norms)}).cpu();
  const double* d = done.data_ptr<double>();
  if (d[kTakenOver] > 0) {
    if (!lead_) throw PeerError(0, "rank 0 lost the run record to another process; stopping");
    throw Error(fmt::format("{}: this process stops without writing anything more (a run record has one live run)",
                            *sinks_->lost_lease()));
  }
  if (d[kDataFailed] > 0) {
    for (Tenant* t : active) t->run->opt->zero_grad(false);
    for (Tenant* t : active) streams_.set_state(t->slot, t->rng_at_step_start);
    return StepEnd::DataLost;
  }
  const bool stop = d[kStop] > 0;
  double loss_all = 0, tokens_all = 0, real_all = 0, slots_all = 0;
  nlohmann::json per = nlohmann::json::object();
  for (size_t i = 0; i < active.size(); ++i) {
    AdapterRun& a = *active[i]->run;
    const double* f = d + kJobSums + width * i;
    const double grad_norm = d[done.numel() - static_cast<int64_t>(active.size()) + static_cast<int64_t>(i)];
    const double loss = objective.normalised() ? f[kLoss] : f[kLoss] / std::max(f[kTokens], 1.0);
    a.check_finite(loss, grad_norm);
    const double lr = a.lr();
    // One rank and no rows of it this step: its own run has no gradients, and AdamW skips them.
    if (env_.world_size > 1 || active[i]->tokens > 0) a.apply(grads[i], norms[i], lr);
    a.epoch_tokens += f[kTokens];
    a.skips.add(f + kSkipped);
    loss_all += objective.normalised() ? loss * f[kTokens] : f[kLoss];  // (the job's: weighted by tokens)
    tokens_all += f[kTokens], real_all += f[kReal], slots_all += f[kSlots];
    per[a.name] = {{"loss", loss}, {"tokens", f[kTokens]}, {"lr", lr}, {"grad_norm", grad_norm}, {"epoch", a.p.epoch}};
    per[a.name].update(Skips::figures(f + kSkipped));
    per[a.name].update(objective.figures(f + kPerTenant));
  }
  // Zeroed, not freed (the finished ones' zeros from the all-reduce too): allocated once, not anew in
  // each step's passes among their activations, which raised 8 adapters' peak RSS by 12%.
  for (auto& t : tenants_) t->run->opt->zero_grad(false);
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  ++step_;
  ++steps_this_process_;

  // The step's line and metrics row (rank 0), then what each adapter's own run does after it.
  const double elapsed = std::chrono::duration<double>(Clock::now() - started_).count();
  const double eta = elapsed / static_cast<double>(steps_this_process_) * static_cast<double>(total_steps_ - step_);
  const std::string line =
      fmt::format("step {}/{} adapters {} loss {:.4f} tokens/s {:.0f} data_wait {:.0f}% eta {}", step_, total_steps_,
                  active.size(), loss_all / std::max(tokens_all, 1.0), tokens_all / seconds,
                  100 * d[kDataWait] / env_.world_size, clock_text(static_cast<int64_t>(eta)));
  if (tty_) {
    std::fputs(("\r\033[K" + line).c_str(), stdout);
    std::fflush(stdout);
  }
  if (step_ % r_.track.log_every_n_steps == 0) {
    info(line, lead_ && !tty_);
    if (lead_) {
      nlohmann::json row = {{"step", step_},
                            {"loss", loss_all / std::max(tokens_all, 1.0)},
                            {"tokens", tokens_all},
                            {"tokens_per_s", tokens_all / seconds},
                            {"data_wait_share", d[kDataWait] / env_.world_size},
                            {"padding_share", slots_all > 0 ? 1.0 - real_all / slots_all : 0.0},
                            {"peak_rss_mb", peak_resident_mib()},
                            {"rss_mb", resident_mib()},
                            {"seconds", seconds},
                            {"adapters_active", active.size()}};
      for (const auto& [name, f] : per.items())
        for (const auto& [key, value] : f.items()) row[key + "/" + name] = value;
      row["base_mb"] = static_cast<double>(m_.base_bytes() + (rt_.shards ? rt_.shards->buffer_bytes() : 0)) / (1 << 20);
      sinks_->step(row);
    }
  }
  for (Tenant* t : active) {
    const AdapterRun& a = *t->run;
    a.skips.check(a.p.epoch, a.epoch_documents, a.r.data.max_skipped_share, a.who());
  }
  if (r_.dist.debug_checksum_every_n_steps && step_ % *r_.dist.debug_checksum_every_n_steps == 0) {
    std::vector<const AdapterRun*> runs;
    for (const auto& t : tenants_) runs.push_back(t->run.get());
    check_replicas(agree_, runs, step_);
  }
  bool stopping = false;  // an evaluation of this step was cut short by a stop
  for (Tenant* t : active) stopping = !after_step(*t, stopping, stop) || stopping;
  return stopping || stop ? StepEnd::Stop : StepEnd::Go;
}

// What adapter t's own run does after its step: an evaluation every eval.every_n_steps, the end of
// its epoch, its state every checkpoint.state_every_n_steps. Once `stopping` (an evaluation of this
// step was cut short), what is due is only marked for the resumed job. `stop`: the job stops after
// this step (its state is saved then). False: its evaluation was cut short.
bool Job::after_step(Tenant& t, bool stopping, bool stop) {
  AdapterRun& a = *t.run;
  ++a.p.step;
  ++a.p.step_in_epoch;
  const bool last = a.p.step_in_epoch == a.steps_per_epoch;
  const std::optional<int> every = a.r.eval.every_n_steps;
  if (a.eval && !last && every && a.p.step % *every == 0) {
    if (stopping || !evaluate(t)) {
      a.p.pending_eval = true;
      return false;
    }
    if (a.stopping_early) {  // this epoch, cut short, is its last
      close_epoch(t);
      return true;
    }
  }
  if (last) return end_epoch(t, stopping);
  const std::optional<int> state_every = r_.checkpoint.state_every_n_steps;
  if (!stop && !stopping && state_every && a.p.step % *state_every == 0) a.ckpt->save_state(a.p);
  return true;
}

// Adapter t's epoch has run its steps: its evaluation (unless early stopping ended it), then
// close_epoch. False: the evaluation was cut short (or `stopping` defers it): it is pending.
bool Job::end_epoch(Tenant& t, bool stopping) {
  AdapterRun& a = *t.run;
  if (a.whole_epoch_here && a.epoch_tokens == 0)
    throw Error(fmt::format(
        "adapter '{}': epoch {} trained on no token: every document of its selection was rejected (bad, longer than "
        "data.max_length with data.overlong=skip, or with no trained token); fix the data or the data.* keys (see "
        "the warnings above)",
        a.name, a.p.epoch));
  if (a.eval && !a.stopping_early && (stopping || !evaluate(t))) {
    a.p.pending_eval = true;
    return false;
  }
  close_epoch(t);
  return true;
}

// Adapter t's epoch adapter per its policy, then the state its next epoch starts from, or, after
// its last epoch, its end: its kept epochs, its run.json.
void Job::close_epoch(Tenant& t) {
  AdapterRun& a = *t.run;
  a.ckpt->save_epoch(a.p.epoch, a.epochs, a.p.step);
  a.batches.reset();
  a.p.pending_eval = false;
  if (a.p.epoch + 1 < a.epochs) {
    a.p.epoch += 1;
    a.p.step_in_epoch = 0;
    a.ckpt->save_state(a.p);
    return;
  }
  const RunSummary summary{.run_id = run_id_,
                           .steps = a.p.step,
                           .steering = a.p.steering,
                           .early_stopped_in = a.stopping_early ? std::optional(a.epochs - 1) : std::nullopt};
  const std::vector<int> kept = a.ckpt->finish(a.epochs, summary);
  t.done = true;
  if (lead_) {
    if (tty_) std::fputs("\n", stdout);
    info(fmt::format("adapter '{}' done: {} steps{}; epochs kept [{}] in {}", a.name, a.p.step,
                     a.stopping_early ? fmt::format(" (stopped early in epoch {})", a.epochs - 1) : "",
                     fmt::join(kept, ", "), a.r.checkpoint.output_dir));
  }
}

// Adapter t's evaluation split through the model with its adapter alone, as its own run evaluates;
// a stop between two batches cuts it short (false: nothing logged or steered).
bool Job::evaluate(Tenant& t, bool steers) {
  AdapterRun& a = *t.run;
  const StopCheck stop = [this] { return agree_.any(stop_requested()); };
  std::optional<nlohmann::json> row;
  {
    const model::CausalLM::Routing alone(
        m_, std::make_shared<model::Routes>(model::Routes{.routes = {}, .all = t.slot, .streams = nullptr}));
    row = evaluate_split(m_, *a.eval, *rt_.builder, a.r, agree_, a.p.epoch, a.p.step, stop, a.objective->preference());
  }
  if (!row) {
    if (lead_)
      info(
          fmt::format("evaluation of adapter '{}' at its step {} stopped on request: it is done again when the job "
                      "resumes",
                      a.name, a.p.step));
    return false;
  }
  a.evaluated(*row, steers, lead_, tty_);
  if (!lead_) return true;
  (*row)["adapter"] = a.name;
  (*row)["eval_loss/" + a.name] = *a.last_eval_loss;
  if (a.p.steering.best_loss) (*row)["best_eval_loss"] = *a.p.steering.best_loss;
  sinks_->eval(*row);
  return true;
}

// Stopped on request: every unfinished adapter's state, each where it stands (an evaluation cut
// short marked pending), then exit 75 like a single run.
int Job::stopped() {
  for (auto& t : tenants_)
    if (!t->done) t->run->ckpt->save_state(t->run->p);
  if (lead_) {
    if (tty_) std::fputs("\n", stdout);
    info(
        fmt::format("stopped at job step {} on request; each adapter's resumable state is in {}/<name>/resume_state: "
                    "run the same command to resume",
                    step_, r_.checkpoint.output_dir));
    sinks_->interrupted();
  }
  pg_.barrier();
  return kExitStopped;
}

// Some rank's data source gave up: every unfinished adapter's state as of the last completed step
// (its dropout stream put back), then exit 75, so a rerun continues.
int Job::data_lost() {
  for (auto& t : tenants_)
    if (!t->done) t->run->ckpt->save_state(t->run->p, false);
  const std::string why = data_error_.empty() ? "another rank lost its data source (its log says why)" : data_error_;
  if (lead_ || !data_error_.empty())
    warn(
        fmt::format("rank {}: {}; the resumable states of job step {} are in {}/<name>/resume_state: run the same "
                    "command to continue",
                    env_.rank, why, step_, r_.checkpoint.output_dir));
  if (lead_) sinks_->interrupted(why);
  pg_.barrier();
  return kExitStopped;
}

// Every adapter has ended: the job's run.json (its adapters named, for checkpoint.overwrite).
int Job::finish() {
  std::vector<std::string> names;
  std::vector<std::pair<std::string, std::string>> adapters;  // each one's last kept epoch and best/, for MLflow
  for (const auto& t : tenants_) {
    const AdapterRun& a = *t->run;
    names.push_back(a.name);
    const fs::path out = a.r.checkpoint.output_dir;
    const std::vector<int> kept = epochs_kept(a.r.checkpoint, a.epochs);
    if (!kept.empty())
      adapters.emplace_back((out / fmt::format("epoch_{}", kept.back())).string(), a.name + "/adapter");
    if (a.r.checkpoint.keep_best && fs::exists(out / "best"))
      adapters.emplace_back((out / "best").string(), a.name + "/best");
  }
  if (lead_) {
    for (const auto& t : tenants_)
      if (t->run->skips.run_total() > 0) warn(t->run->who() + t->run->skips.summary());
    const nlohmann::json done = {{"status", "completed"},
                                 {"run_id", lead_ ? sinks_->ref() : ""},
                                 {"steps", step_},
                                 {"finished", utc_stamp()},
                                 {"adapters", names}};
    io::write_file_atomic(finished_marker(r_.checkpoint.output_dir), done.dump(1));
    info(fmt::format("done: {} adapters in {} job steps; each in {}/<name>/", tenants_.size(), step_,
                     r_.checkpoint.output_dir));
  }
  pg_.barrier();
  if (lead_) sinks_->completed(adapters);
  return 0;
}

void Job::failed(const std::string& error) {
  if (!sinks_) return;
  try {  // (the error being reported is the one that matters)
    sinks_->failed(error);
  } catch (const std::exception& e) {
    warn(fmt::format("the job's end was not recorded: {}", e.what()));
  }
}
}  // namespace

int run_job(const recipe::Recipe& r, const dist::DistEnv& env) {
  // A step's tensors are every active adapter's micro-batch at once: with glibc's moving mmap
  // threshold they were mapped and faulted in anew each step (bench/train/adapters_bench.py, 8
  // adapters: 35.3 s -> 27.0 s, medians of 3)
  keep_freed_memory_for_reuse();
  std::unique_ptr<Job> job;
  try {
    job = std::make_unique<Job>(r, env);
    return job->run();
  } catch (const std::exception& e) {  // (run_training logs it)
    if (job) job->failed(e.what());
    throw;
  }
}

}  // namespace lorarun::train
