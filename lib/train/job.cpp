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
#include <map>
#include <memory>
#include <optional>
#include <typeinfo>

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

// adapters.per: a value of the field as an adapter's name (text, or a whole number written out).
std::optional<std::string> name_of_value(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return v.dump();
  return std::nullopt;
}

// Adapters whose names differ only in case would share a directory on a case-insensitive filesystem
// or object store: refused, `what` ("adapters.per: tenant holds") saying where the names came from.
void refuse_case_twins(const std::vector<recipe::AdapterSpec>& specs, const std::string& what) {
  std::map<std::string, std::string> folded;
  for (const recipe::AdapterSpec& s : specs)
    if (const auto [it, fresh] = folded.emplace(case_folded(s.name), s.name); !fresh)
      throw ConfigError(
          fmt::format("{} '{}' and '{}', which differ only in case: they would share a directory on a "
                      "case-insensitive filesystem or store; make them one, or narrow data.filter",
                      what, printable(it->second), printable(s.name)));
}

// One adapter of the job: its own run's recipe, documents, adapter, optimizer, schedule,
// checkpointer and where it stands.
struct Tenant {
  std::string name;
  int slot = 0;
  recipe::Recipe r;  // its own run's (adapter_recipe): what lora-train would train it with
  std::unique_ptr<data::Documents> docs;
  std::unique_ptr<data::EvalSplit> eval;
  std::vector<at::Tensor> params;
  std::unique_ptr<torch::optim::AdamW> opt;
  std::unique_ptr<Checkpointer> ckpt;
  Schedule schedule = Schedule::Constant;
  int64_t steps_per_epoch = 0, total_steps = 0;
  int epochs = 0;  // the epochs it ends with (fewer when early stopping ends it)
  Progress p;      // where it stands
  bool done = false, stopping_early = false;
  std::optional<data::MicroBatches> batches;  // its current epoch's, from p.step_in_epoch on
  std::optional<double> last_eval_loss;
  double epoch_tokens = 0;
  // this step: summed token losses on the device, trained tokens, document tokens, row slots
  at::Tensor loss;
  int64_t tokens = 0, real = 0, slots = 0;
  Skips skips;                  // documents skipped: this rank's in the step, all ranks' in the epoch and the run
  int64_t epoch_documents = 0;  // what its epoch's steps read, all ranks together
  at::Tensor rng_at_step_start;
  bool whole_epoch_here = false;  // this process runs its current epoch from step 0
};

// How a job step ended.
enum class StepEnd { Go, Stop, DataLost };

// The figures the ranks sum per step, first the job's, then per active adapter kPerTenant.
enum JobSum { kStop, kDataWait, kDataFailed, kTakenOver, kJobSums };
enum TenantSum { kLoss, kTokens, kReal, kSlots, kSkipped, kPerTenant = kSkipped + Skips::kCauses };

class Job {
 public:
  Job(const recipe::Recipe& r, const dist::DistEnv& env);
  int run();
  void failed(const std::string& error);

 private:
  void begin(bool resumed, const std::string& run_id);
  bool settle(Tenant& t);
  void open_batches(Tenant& t);
  StepEnd step(const std::vector<Tenant*>& active);
  void pass(const std::vector<data::Batch>& parts, const std::vector<Tenant*>& owners);
  std::vector<data::Example> examples(Tenant& t);
  bool after_step(Tenant& t, bool stopping, bool stop);
  bool end_epoch(Tenant& t, bool stopping);
  void close_epoch(Tenant& t);
  void open_data(Tenant& t);
  bool evaluate(Tenant& t, bool steers = true);
  void steer(Tenant& t, const nlohmann::json& row);
  void check_replicas();
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
    t->name = specs[i].name;
    t->slot = static_cast<int>(i);
    t->r = recipe::adapter_recipe(r, specs[i]);
    try {  // (an Error or a ConfigError names the adapter; a lost server stays as it is)
      open_data(*t);
    } catch (const Error& e) {
      rethrow_within(e, fmt::format("adapter '{}': ", t->name));
    }
    model::LoraConfig cfg = model::lora_config_of(t->r.lora, r.model.path);
    cfg.tenant = t->slot;
    as_input_error([&] {
      model::attach_tenant(m_, cfg, static_cast<uint64_t>(r.train.seed), t->slot, static_cast<int>(specs.size()));
    });
    t->params = model::tenant_parameters(m_, t->slot);
    t->opt =
        make_adamw(model::tenant_state(m_, t->slot), t->r.train.lr, t->r.train.weight_decay, t->r.lora.plus_lr_ratio);
    model::DropoutStreams* streams = &streams_;
    const int slot = t->slot;
    const RngStream rng{[streams, slot] { return streams->state(slot); },
                        [streams, slot](const at::Tensor& b) { streams->set_state(slot, b); }};
    t->ckpt =
        std::make_unique<Checkpointer>(t->r, agree_, m_, cfg, t->params, *t->opt, t->docs->identity(), cuda_, rng);
    t->ckpt->store_as_adapter(t->name);
    t->schedule = schedule_of(t->r.train.lr_scheduler);
    const int64_t per_rank = data::examples_per_rank(t->docs->size(), env.world_size);
    t->steps_per_epoch = steps_per_epoch(t->r, per_rank);
    t->epoch_documents = epoch_documents(t->r, per_rank, env.world_size);
    t->epochs = t->r.train.epochs;
    t->total_steps = t->steps_per_epoch * t->epochs;
    all.insert(all.end(), t->params.begin(), t->params.end());
    tenants_.push_back(std::move(t));
  }
  sync_ = std::make_unique<dist::GradBuckets>(pg_, all, static_cast<int64_t>(r.dist.bucket_mb * (1 << 20) / 4));
}

// Adapter t's documents and evaluation split. When eval.fraction holds out none of its documents,
// or all of them (a tenant of a few), it trains on them all, unevaluated, as its own run with
// eval.fraction 0 does: one small tenant does not stop the job.
void Job::open_data(Tenant& t) {
  try {
    t.docs = std::make_unique<data::Documents>(t.r.data, data::Holdout::training(t.r.eval.fraction));
    if (t.r.eval.enabled(t.r.data.source)) {
      t.eval = std::make_unique<data::EvalSplit>(t.r, t.docs.get());
      require_scored_token(t.eval->docs(), *rt_.builder, t.eval->describe());
    }
    return;
  } catch (const data::EmptySplit&) {
  }
  const bool none = t.docs != nullptr;  // training kept every document: none held out
  const double fraction = t.r.eval.fraction;
  t.r.eval.fraction = 0;
  t.r.checkpoint.keep_best = false;
  t.r.train.early_stopping_patience.reset();
  t.eval.reset();
  t.docs = std::make_unique<data::Documents>(t.r.data);
  if (lead_)
    warn(
        fmt::format("adapter '{}': eval.fraction {:g} holds out {} of its {} documents: it trains on them all and "
                    "is not evaluated (no eval_loss, best/ or early stop of its own)",
                    t.name, fraction, none ? "none" : "every one", t.docs->size()));
}

// Each adapter resumes from its own state (or starts, or has finished), then job steps until every
// adapter has run its own steps.
int Job::run() {
  std::vector<std::string> states;  // checkpoint.store: mongodb: none here, the job's stored ones come back
  for (const auto& t : tenants_) states.push_back(t->ckpt->state_dir());
  restore_from_store(r_, agree_, states);
  bool resumed = false;
  for (auto& t : tenants_) {
    const fs::path out = t->r.checkpoint.output_dir;
    const std::optional<Progress> p = t->ckpt->load({t->epochs, t->steps_per_epoch, t->docs->identity()});
    if (p) {
      t->p = *p;
      resumed = true;
      if (!p->run_id.empty()) run_id_ = p->run_id;
    } else if (r_.checkpoint.resume == recipe::Resume::Auto && fs::exists(finished_marker(out.string()))) {
      t->done = true;  // finished earlier in this job
      t->p.step = t->total_steps;
    }
  }
  std::vector<double> where;
  for (auto& t : tenants_) where.push_back(static_cast<double>(t->p.step) + (t->done ? 0.5 : 0.0));
  at::Tensor mine = at::tensor(where, at::kDouble);
  if (!agree_.same(at::sum(mine * at::arange(1, mine.numel() + 1, at::kDouble)).item<double>()))
    throw Error(fmt::format(
        "rank {} resumes its adapters at other steps than another rank: checkpoint.output_dir {} must be the same "
        "directory (a shared filesystem) for every rank",
        env_.rank, r_.checkpoint.output_dir));
  step_ = INT64_MAX;
  for (auto& t : tenants_) {
    total_steps_ = std::max(total_steps_, t->total_steps);
    if (!t->done) step_ = std::min(step_, t->p.step);
  }
  if (step_ == INT64_MAX) step_ = total_steps_;
  if (lead_) begin(resumed, run_id_);
  m_.training = true;
  for (auto& t : tenants_)  // eval.on_start: each adapter before its first step, as its own run
    if (!resumed && r_.eval.on_start && t->eval && !evaluate(*t, false)) return stopped();
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
    adapters.push_back({{"name", t->name},
                        {"documents", t->docs->size()},
                        {"steps_per_epoch", t->steps_per_epoch},
                        {"epochs", t->r.train.epochs},
                        {"r", t->r.lora.r},
                        {"lr", t->r.train.lr},
                        {"output_dir", t->r.checkpoint.output_dir}});
    documents += t->docs->size();
  }
  const track::RunInfo about = {
      {"torch_version", TORCH_VERSION}, {"world_size", env_.world_size}, {"device", cuda_ ? "cuda" : "cpu"},
      {"documents", documents},         {"adapters", adapters},          {"job_steps", total_steps_},
      {"restart", env_.restart}};
  run_id_ = sinks_->open(about, resumed ? std::optional(step_) : std::nullopt, run_id, env_.world_size);
  for (auto& t : tenants_) {
    t->p.run_id = run_id_;  // (saved with each state: a resumed job continues this record)
    t->ckpt->attach(*sinks_);
  }
  if (sinks_->record())
    info(fmt::format("run recorded as {} (lora-train --from-run {} repeats it)", sinks_->ref(), sinks_->ref()));
  io::write_file_atomic((fs::path(r_.checkpoint.output_dir) / "recipe.yaml").string(), recipe::to_yaml(r_));
  info(fmt::format("{} adapters on one base ({} rank(s)), {} job steps at most: {}", tenants_.size(), env_.world_size,
                   total_steps_, model::trainable_summary(m_)));
  for (const auto& t : tenants_)
    info(fmt::format("adapter '{}': {}; {} documents from {}, {} steps per epoch x {} epochs{}{}", t->name,
                     model::describe_adapter(t->r.lora), t->docs->size(), t->docs->describe(), t->steps_per_epoch,
                     t->r.train.epochs, t->eval ? fmt::format("; evaluating on {}", t->eval->describe()) : "",
                     t->done ? " (finished)" : ""));
  if (r_.model.keep_quantized) info(model::gguf_blocks_summary(m_));
  if (r_.lora.quantize_base) info(model::nf4_summary(m_));
  if (resumed) info(fmt::format("resuming the job at step {} of at most {}", step_, total_steps_));
}

// Before a step, what an adapter still owes: the evaluation a stop cut short, the end of an epoch
// whose steps are done; then its epoch's batches. False: a stop came during an evaluation.
bool Job::settle(Tenant& t) {
  if (t.p.pending_eval) {
    if (!evaluate(t)) return false;
    t.p.pending_eval = false;
    if (t.stopping_early || t.p.step_in_epoch == t.steps_per_epoch) close_epoch(t);
  } else if (t.p.step_in_epoch == t.steps_per_epoch) {
    if (!end_epoch(t, false)) return false;
  }
  if (!t.done && !t.batches) open_batches(t);
  return true;
}

// The adapter's batches of its epoch from its step on, read as its own run reads them.
void Job::open_batches(Tenant& t) {
  const auto seed = static_cast<uint64_t>(t.r.train.seed);
  const data::ShardSpec spec{env_.world_size, env_.rank, seed, t.p.epoch, t.r.data.shuffle, stop_flag()};
  const data::BatchPlan plan{t.r.data.batch_size, t.r.train.gradient_accumulation_steps,
                             t.r.data.group_by_length ? t.r.data.group_window : 1, seed, t.p.epoch};
  t.whole_epoch_here = t.p.step_in_epoch == 0;
  if (t.whole_epoch_here) t.epoch_tokens = 0;
  t.skips.new_epoch();
  try {
    t.batches.emplace(*t.docs, *rt_.builder, spec, plan, t.p.step_in_epoch);
  } catch (const data::DataUnavailable& e) {
    data_error_ = fmt::format("adapter '{}': {}", t.name, e.what());
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
  m_.routes = routes;
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
  m_.routes.reset();
}

// One job step: micro-batch k of every active adapter's step through the model, in passes of
// adapters.per_pass adapters. Then one all-reduce of every adapter's figures, and per adapter what
// its own run does: gradients divided by its global token count, clipped by its own norm, its AdamW
// step at its own learning rate; then its evaluation, epoch end and state as its own run has them
// after that step.
StepEnd Job::step(const std::vector<Tenant*>& active) {
  const auto t0 = Clock::now();
  const auto waited = [&] {
    double s = 0;
    for (Tenant* t : active)
      if (t->batches) s += t->batches->reader().wait_seconds();
    return s;
  };
  const double wait0 = waited();
  const auto device_zero = at::TensorOptions().dtype(at::kFloat).device(rt_.device);
  for (Tenant* t : active) {
    t->loss = at::zeros({}, device_zero);
    t->tokens = t->real = t->slots = 0;
    t->rng_at_step_start = streams_.state(t->slot);
  }
  // The adapters in passes of at most adapters.per_pass, in slot order: the same passes on every rank
  // (a sharded base gathers in each), whichever of them have rows here.
  const auto per_pass = static_cast<size_t>(adapters_per_pass(r_, static_cast<int>(active.size())));
  const int accum = r_.train.gradient_accumulation_steps;
  for (int a = 0; a < accum; ++a) {
    if (a + 1 == accum) sync_->arm();
    for (size_t first = 0; first < active.size(); first += per_pass) {
      std::vector<data::Batch> parts;
      std::vector<Tenant*> owners;
      for (size_t i = first; i < std::min(active.size(), first + per_pass); ++i) {
        Tenant* t = active[i];
        data::Batch b =
            data::collate(examples(*t), r_.data.packing, static_cast<size_t>(r_.data.max_length), rt_.device);
        t->real += b.real;
        t->slots += b.slots;
        if (b.tokens == 0) continue;  // as its own run: no pass, no dropout drawn
        parts.push_back(std::move(b));
        owners.push_back(t);
      }
      if (parts.empty()) {  // the other ranks' gathers, joined with zero gradients
        if (m_.base_sharded() && env_.world_size > 1) m_.idle_pass(true, r_.data.packing);
        continue;
      }
      pass(parts, owners);
    }
  }
  const double busy = std::chrono::duration<double>(Clock::now() - t0).count();
  sync_->finish();

  // One all-reduce: the job's flags, then each active adapter's figures, in slot order.
  std::vector<double> mine(kJobSums + kPerTenant * active.size(), 0.0);
  mine[kStop] = stop_requested() ? 1.0 : 0.0;
  mine[kDataWait] = busy > 0 ? (waited() - wait0) / busy : 0.0;
  mine[kDataFailed] = data_error_.empty() ? 0.0 : 1.0;
  mine[kTakenOver] = sinks_ && sinks_->lost_lease() ? 1.0 : 0.0;
  for (size_t i = 0; i < active.size(); ++i) {
    double* f = &mine[kJobSums + kPerTenant * i];
    f[kTokens] = static_cast<double>(active[i]->tokens);
    f[kReal] = static_cast<double>(active[i]->real);
    f[kSlots] = static_cast<double>(active[i]->slots);
    const Skips::Counts skipped = active[i]->skips.take();
    std::copy(skipped.begin(), skipped.end(), f + kSkipped);
  }
  at::Tensor stats = at::tensor(mine, at::kDouble).to(rt_.device);
  for (size_t i = 0; i < active.size(); ++i) stats[kJobSums + kPerTenant * i + kLoss].add_(active[i]->loss);
  agree_.sum(stats);
  std::vector<std::vector<at::Tensor>> grads(active.size());
  std::vector<at::Tensor> norms;
  for (size_t i = 0; i < active.size(); ++i) {
    for (at::Tensor& p : active[i]->params)
      if (p.grad().defined()) grads[i].push_back(p.mutable_grad());
    if (!grads[i].empty()) at::_foreach_div_(grads[i], stats[kJobSums + kPerTenant * i + kTokens].clamp_min(1.0));
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
    for (Tenant* t : active) t->opt->zero_grad(false);
    for (Tenant* t : active) streams_.set_state(t->slot, t->rng_at_step_start);
    return StepEnd::DataLost;
  }
  const bool stop = d[kStop] > 0;
  double loss_all = 0, tokens_all = 0, real_all = 0, slots_all = 0;
  nlohmann::json per = nlohmann::json::object();
  for (size_t i = 0; i < active.size(); ++i) {
    Tenant& t = *active[i];
    const double* f = d + kJobSums + kPerTenant * i;
    const double grad_norm = d[done.numel() - static_cast<int64_t>(active.size()) + static_cast<int64_t>(i)];
    const double loss = f[kLoss] / std::max(f[kTokens], 1.0);
    if (!std::isfinite(loss) || !std::isfinite(grad_norm))
      throw Error(fmt::format(
          "adapter '{}' diverged at its step {}: the loss is {} and the gradient norm {}; nothing of this step was "
          "applied or saved. Lower its lr (now {:g}), set train.max_grad_norm, or check its data, then start over "
          "(checkpoint.resume=never)",
          t.name, t.p.step + 1, loss, grad_norm, t.r.train.lr));
    const double lr = t.r.train.lr * lr_factor(t.schedule, t.p.step, t.r.train.warmup_steps, t.total_steps);
    {
      RECORD_USER_SCOPE("optimizer");
      if (t.r.train.max_grad_norm && !grads[i].empty())  // torch's clip_grad_norm_
        at::_foreach_mul_(grads[i], (*t.r.train.max_grad_norm / (norms[i] + 1e-6)).clamp_max(1.0));
      set_lr(*t.opt, lr, t.r.lora.plus_lr_ratio);
      // One rank and no rows of it this step: its own run has no gradients, and AdamW skips them.
      if (env_.world_size > 1 || t.tokens > 0) t.opt->step();
    }
    t.epoch_tokens += f[kTokens];
    t.skips.add(f + kSkipped);
    loss_all += f[kLoss], tokens_all += f[kTokens], real_all += f[kReal], slots_all += f[kSlots];
    per[t.name] = {{"loss", loss}, {"tokens", f[kTokens]}, {"lr", lr}, {"grad_norm", grad_norm}, {"epoch", t.p.epoch}};
    per[t.name].update(Skips::figures(f + kSkipped));
  }
  // Zeroed, not freed (the finished ones' zeros from the all-reduce too): allocated once, not anew in
  // each step's passes among their activations, which raised 8 adapters' peak RSS by 12%.
  for (auto& t : tenants_) t->opt->zero_grad(false);
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
  for (Tenant* t : active)
    t->skips.check(t->p.epoch, t->epoch_documents, t->r.data.max_skipped_share, fmt::format("adapter '{}': ", t->name));
  if (r_.dist.debug_checksum_every_n_steps && step_ % *r_.dist.debug_checksum_every_n_steps == 0) check_replicas();
  bool stopping = false;  // an evaluation of this step was cut short by a stop
  for (Tenant* t : active) stopping = !after_step(*t, stopping, stop) || stopping;
  return stopping || stop ? StepEnd::Stop : StepEnd::Go;
}

// What adapter t's own run does after its step: an evaluation every eval.every_n_steps, the end of
// its epoch, its state every checkpoint.state_every_n_steps. Once `stopping` (an evaluation of this
// step was cut short), what is due is only marked for the resumed job. `stop`: the job stops after
// this step (its state is saved then). False: its evaluation was cut short.
bool Job::after_step(Tenant& t, bool stopping, bool stop) {
  ++t.p.step;
  ++t.p.step_in_epoch;
  const bool last = t.p.step_in_epoch == t.steps_per_epoch;
  const std::optional<int> every = t.r.eval.every_n_steps;
  if (t.eval && !last && every && t.p.step % *every == 0) {
    if (stopping || !evaluate(t)) {
      t.p.pending_eval = true;
      return false;
    }
    if (t.stopping_early) {  // this epoch, cut short, is its last
      close_epoch(t);
      return true;
    }
  }
  if (last) return end_epoch(t, stopping);
  const std::optional<int> state_every = r_.checkpoint.state_every_n_steps;
  if (!stop && !stopping && state_every && t.p.step % *state_every == 0) t.ckpt->save_state(t.p);
  return true;
}

// Adapter t's epoch has run its steps: its evaluation (unless early stopping ended it), then
// close_epoch. False: the evaluation was cut short (or `stopping` defers it): it is pending.
bool Job::end_epoch(Tenant& t, bool stopping) {
  if (t.whole_epoch_here && t.epoch_tokens == 0)
    throw Error(fmt::format(
        "adapter '{}': epoch {} trained on no token: every document of its selection was rejected (bad, longer than "
        "data.max_length with data.overlong=skip, or with no trained token); fix the data or the data.* keys (see "
        "the warnings above)",
        t.name, t.p.epoch));
  if (t.eval && !t.stopping_early && (stopping || !evaluate(t))) {
    t.p.pending_eval = true;
    return false;
  }
  close_epoch(t);
  return true;
}

// Adapter t's epoch adapter per its policy, then the state its next epoch starts from, or, after
// its last epoch, its end: its kept epochs, its run.json.
void Job::close_epoch(Tenant& t) {
  t.ckpt->save_epoch(t.p.epoch, t.epochs, t.p.step);
  t.batches.reset();
  t.p.pending_eval = false;
  if (t.p.epoch + 1 < t.epochs) {
    t.p.epoch += 1;
    t.p.step_in_epoch = 0;
    t.ckpt->save_state(t.p);
    return;
  }
  const RunSummary summary{.run_id = run_id_,
                           .steps = t.p.step,
                           .steering = t.p.steering,
                           .early_stopped_in = t.stopping_early ? std::optional(t.epochs - 1) : std::nullopt};
  const std::vector<int> kept = t.ckpt->finish(t.epochs, summary);
  t.done = true;
  if (lead_) {
    if (tty_) std::fputs("\n", stdout);
    info(fmt::format("adapter '{}' done: {} steps{}; epochs kept [{}] in {}", t.name, t.p.step,
                     t.stopping_early ? fmt::format(" (stopped early in epoch {})", t.epochs - 1) : "",
                     fmt::join(kept, ", "), t.r.checkpoint.output_dir));
  }
}

// Adapter t's evaluation split through the model with its adapter alone, as its own run evaluates;
// a stop between two batches cuts it short (false: nothing logged or steered).
bool Job::evaluate(Tenant& t, bool steers) {
  const StopCheck stop = [this] { return agree_.any(stop_requested()); };
  m_.routes = std::make_shared<model::Routes>(model::Routes{.routes = {}, .all = t.slot, .streams = nullptr});
  std::optional<nlohmann::json> row;
  try {
    row = evaluate_split(m_, *t.eval, *rt_.builder, t.r, agree_, t.p.epoch, t.p.step, stop);
  } catch (...) {
    m_.routes.reset();
    throw;
  }
  m_.routes.reset();
  if (!row) {
    if (lead_)
      info(
          fmt::format("evaluation of adapter '{}' at its step {} stopped on request: it is done again when the job "
                      "resumes",
                      t.name, t.p.step));
    return false;
  }
  const double mean = (*row)["eval_loss"].get<double>();
  t.last_eval_loss = mean;
  if (lead_) {
    if (tty_) std::fputs("\n", stdout);
    info(
        fmt::format("eval of adapter '{}' at epoch {} step {}: eval_loss {:.6f} eval_ppl {:.4f} over {} tokens of {} "
                    "documents ({:.1f} s)",
                    t.name, t.p.epoch, t.p.step, mean, std::exp(mean), (*row)["eval_tokens"].get<int64_t>(),
                    (*row)["eval_documents"].get<int64_t>(), (*row)["eval_seconds"].get<double>()));
  }
  if (steers) steer(t, *row);
  if (!lead_) return true;
  (*row)["adapter"] = t.name;
  (*row)["eval_loss/" + t.name] = mean;
  if (t.p.steering.best_loss) (*row)["best_eval_loss"] = *t.p.steering.best_loss;
  sinks_->eval(*row);
  return true;
}

// After an evaluation of t (the same figures on every rank): its best/ and its early stop, as its
// own run steers.
void Job::steer(Tenant& t, const nlohmann::json& row) {
  const double loss = row["eval_loss"].get<double>();
  Steering& s = t.p.steering;
  const std::optional<double> before = s.best_loss;
  s.evals_since_best = !before || loss < *before - t.r.train.early_stopping_min_delta ? 0 : s.evals_since_best + 1;
  if (!before || loss < *before) {
    s.best_loss = loss;
    s.best_step = t.p.step;
    if (t.r.checkpoint.keep_best) t.ckpt->save_best(row, t.p.step);
  }
  const std::optional<int> patience = t.r.train.early_stopping_patience;
  if (!patience || s.evals_since_best < *patience || t.p.step >= t.total_steps) return;
  t.stopping_early = true;
  t.epochs = t.p.epoch + 1;
  if (lead_)
    info(
        fmt::format("adapter '{}' stops early after its step {} (epoch {}): {} evaluations without lowering its best "
                    "eval_loss {:.6f} (step {}) by more than {:g}",
                    t.name, t.p.step, t.p.epoch, s.evals_since_best, *s.best_loss, s.best_step,
                    t.r.train.early_stopping_min_delta));
}

// Replicas must stay identical: every rank puts its parameters' checksum in its own slot.
void Job::check_replicas() {
  double mine = 0, i = 0;
  for (const auto& t : tenants_)
    for (const at::Tensor& p : t->params) mine += p.to(at::kDouble).sum().item<double>() * ++i;
  if (!agree_.same(mine))
    throw Error(
        fmt::format("rank {}'s LoRA parameters differ from another rank's at job step {} (checksum {}): the "
                    "replicas diverged",
                    env_.rank, step_, mine));
}

// Stopped on request: every unfinished adapter's state, each where it stands (an evaluation cut
// short marked pending), then exit 75 like a single run.
int Job::stopped() {
  for (auto& t : tenants_)
    if (!t->done) t->ckpt->save_state(t->p);
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
    if (!t->done) t->ckpt->save_state(t->p, false);
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
    names.push_back(t->name);
    const fs::path out = t->r.checkpoint.output_dir;
    const std::vector<int> kept = epochs_kept(t->r.checkpoint, t->epochs);
    if (!kept.empty())
      adapters.emplace_back((out / fmt::format("epoch_{}", kept.back())).string(), t->name + "/adapter");
    if (t->r.checkpoint.keep_best && fs::exists(out / "best"))
      adapters.emplace_back((out / "best").string(), t->name + "/best");
  }
  if (lead_) {
    for (const auto& t : tenants_)
      if (t->skips.run_total() > 0) warn(fmt::format("adapter '{}': {}", t->name, t->skips.summary()));
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

// The next micro-batch of adapter `t`'s examples; rejected documents counted (or fatal).
std::vector<data::Example> Job::examples(Tenant& t) {
  std::vector<data::Example> out;
  if (!data_error_.empty() || !t.batches) return out;
  std::vector<data::Built> next;
  try {
    next = t.batches->next();
  } catch (const data::DataUnavailable& e) {
    data_error_ = fmt::format("adapter '{}': {}", t.name, e.what());
    log_error(fmt::format("rank {}: {}", env_.rank, data_error_));
    return out;
  }
  for (data::Built& built : next) {
    if (auto* e = std::get_if<data::Example>(&built)) {
      out.push_back(std::move(*e));
      continue;
    }
    const auto& why = std::get<data::Rejection>(built);
    if (r_.data.bad_documents == recipe::BadDocuments::Fail && why.kind == data::Rejection::BadDocument)
      throw ConfigError(fmt::format(
          "rank {}: adapter '{}': bad document {}({}) and data.bad_documents is fail: fix the document or set "
          "data.bad_documents=skip",
          env_.rank, t.name, why.document.empty() ? "" : why.document + " ", why.reason));
    t.skips.count(why);
    if (warned_++ < 3)
      warn(fmt::format("rank {}: adapter '{}': skipping {}: {}", env_.rank, t.name,
                       why.document.empty() ? "a document" : "document " + why.document, why.reason));
  }
  return out;
}

}  // namespace

std::vector<recipe::AdapterSpec> job_adapters(const recipe::Recipe& r) {
  const recipe::AdaptersSection& a = r.adapters;
  if (a.per.empty()) return a.list;
  const data::FieldValues found = data::field_values(r.data, a.per);
  if (found.arrays > 0)  // (a filter on one of its items would train the document in each item's adapter)
    throw ConfigError(fmt::format(
        "adapters.per: {} holds a list in {} document(s) of data's selection, which would train each of them in "
        "several adapters: its values must be text or whole numbers (narrow data.filter to leave those documents "
        "out)",
        a.per, found.arrays));
  std::vector<recipe::AdapterSpec> out;
  for (const nlohmann::json& v : found.values) {
    const std::optional<std::string> name = name_of_value(v);
    if (!name)
      throw ConfigError(fmt::format(
          "adapters.per: {} holds {} in some documents of data's selection, which cannot name an adapter: its values "
          "must be text or whole numbers (narrow data.filter to leave those documents out)",
          a.per, printable(v.dump(), 60)));
    if (!is_adapter_name(*name))
      throw ConfigError(fmt::format(
          "adapters.per: {} holds '{}', which cannot name an adapter's directory: values must be 1 to 64 letters, "
          "digits, '_', '+' or '-', not starting with '-' and not logs, tensorboard, best, resume_state or epoch_N "
          "(narrow data.filter to leave those documents out)",
          a.per, printable(*name, 80)));
    recipe::AdapterSpec spec;
    spec.name = *name;
    spec.filter = {{a.per, v}};
    out.push_back(std::move(spec));
  }
  if (out.empty())
    throw ConfigError(
        fmt::format("adapters.per: no document of data's selection ({}) has a field {}: check the field "
                    "name and data.filter",
                    r.data.filter.dump(), a.per));
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.name < y.name; });
  for (size_t i = 1; i < out.size(); ++i)
    if (out[i].name == out[i - 1].name)  // the text "7" and the number 7
      throw ConfigError(fmt::format("adapters.per: {} holds '{}' both as text and as a number: make them one type",
                                    a.per, out[i].name));
  refuse_case_twins(out, fmt::format("adapters.per: {} holds", a.per));
  if (static_cast<int64_t>(out.size()) > a.max)
    throw ConfigError(
        fmt::format("adapters.per: {} has {} distinct values in data's selection, more than adapters.max "
                    "{}: raise adapters.max, or narrow data.filter",
                    a.per, out.size(), a.max));
  for (const recipe::AdapterSpec& own : a.list) {  // an entry's own keys (r, lr, …) for its value
    const auto it = std::find_if(out.begin(), out.end(), [&](const auto& s) { return s.name == own.name; });
    if (it == out.end())
      throw ConfigError(
          fmt::format("adapters.list sets keys for '{}', but no document of data's selection has {} "
                      "'{}': remove the entry or fix its name",
                      own.name, a.per, own.name));
    recipe::AdapterSpec merged = own;
    merged.filter = it->filter;
    *it = std::move(merged);
  }
  if (found.missing > 0)
    warn(fmt::format("adapters.per: {} documents of data's selection have no field {}: no adapter trains on them",
                     found.missing, a.per));
  if (r.eval.fraction <= 0 && !r.eval.filter.empty()) {  // each adapter evaluates on eval.filter's of its value
    recipe::DataSection held = r.data;
    held.filter = r.eval.filter;
    if (!r.eval.collection.empty()) held.collection = r.eval.collection;
    std::vector<std::string> unevaluated;
    for (const nlohmann::json& v : data::field_values(held, a.per).values) {
      const std::optional<std::string> name = name_of_value(v);
      if (std::none_of(out.begin(), out.end(), [&](const auto& s) { return name && s.name == *name; }))
        unevaluated.push_back(printable(name.value_or(v.dump()), 40));
    }
    if (!unevaluated.empty())
      warn(
          fmt::format("adapters.per: the evaluation documents hold {} {} that no training document has: no adapter "
                      "trains or evaluates on those",
                      a.per, fmt::join(unevaluated, ", ")));
  }
  return out;
}

recipe::Recipe one_adapter(const recipe::Recipe& r, const std::string& name, const std::string& file) {
  if (!r.adapters.enabled()) {
    if (!name.empty())
      throw Error(fmt::format("{} trains one adapter (it has no adapters: section): drop --job-adapter", file));
    return r;
  }
  const std::vector<recipe::AdapterSpec> all = job_adapters(r);
  std::string names;
  for (const recipe::AdapterSpec& a : all) {
    if (a.name == name) return recipe::adapter_recipe(r, a);
    names += (names.empty() ? "" : ", ") + a.name;
  }
  throw Error(fmt::format(
      "{} trains {} adapters ({}): {}", file, all.size(), names,
      name.empty() ? "name one with --job-adapter NAME" : fmt::format("it has none named '{}'", printable(name))));
}

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
