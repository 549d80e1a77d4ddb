#include "train/trainer.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>
#include <algorithm>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>

#include "data/batches.hpp"
#include "data/collate.hpp"
#include "io/files.hpp"
#include "model/loss.hpp"
#include "train/checkpointer.hpp"
#include "train/evaluate.hpp"
#include "train/objective.hpp"
#include "train/output_dir.hpp"
#include "train/stop.hpp"
#include "train/trainer_impl.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/process.hpp"

namespace lorarun::train::loop {

namespace fs = std::filesystem;

// A figure of adapter `a` in a metrics row: "<figure>" alone, "<figure>/<name>" in a job.
std::string keyed(const std::string& figure, const AdapterRun& a) {
  return a.name.empty() ? figure : figure + "/" + a.name;
}

// Adapter t's rows alone through the model: every row to its slot (none alone: the model's own
// LoRA), drawing dropout from `streams` (null: none drawn, as in evaluation).
std::shared_ptr<const model::Routes> alone(const Tenant& t, model::DropoutStreams* streams) {
  if (!t.slot) return nullptr;
  return std::make_shared<model::Routes>(model::Routes{.routes = {}, .all = *t.slot, .streams = streams});
}

// The run, as the recipe describes it: each adapter resumes from its own state (or starts, or has
// finished), then steps until every adapter has run its epochs, each epoch ending with its
// checkpoint (per the policy) and a resumable state.
int Trainer::run() {
  std::vector<std::string> states;  // checkpoint.store: mongodb: none here, the stored ones come back
  for (const auto& t : tenants_) states.push_back(t->run->ckpt->state_dir());
  restore_from_store(r_, agree_, states);
  bool resumed = false;
  for (auto& t : tenants_) {
    AdapterRun& a = *t->run;
    const std::optional<Progress> p = a.ckpt->load({a.epochs, a.steps_per_epoch, a.data.identity()});
    if (p) {
      a.p = *p;
      resumed = true;
      if (!p->run_id.empty()) run_id_ = p->run_id;
    } else if (!a.name.empty() && r_.checkpoint.resume == recipe::Resume::Auto &&
               fs::exists(finished_marker(a.r.checkpoint.output_dir))) {
      t->done = true;  // finished earlier in this job
      a.p.step = a.total_steps;
    } else {
      t->fresh = true;
    }
  }
  // Ranks must agree on each adapter's steps (a mismatch would hang a collective) and where it
  // stands (a state visible to only some ranks is an error).
  std::vector<double> plan, where;
  for (auto& t : tenants_) {
    plan.push_back(static_cast<double>(t->run->steps_per_epoch));
    where.push_back(static_cast<double>(t->run->p.step) + (t->done ? 0.5 : 0.0));
  }
  const auto weighted = [](const std::vector<double>& v) {
    double s = 0;
    for (size_t i = 0; i < v.size(); ++i) s += v[i] * static_cast<double>(i + 1);
    return s;
  };
  if (!agree_.same(weighted(plan)))
    throw Error(
        fmt::format("rank {} plans {} steps per epoch but the ranks disagree: every rank must see the same "
                    "documents and recipe",
                    env_.rank, fmt::join(plan, ", ")));
  if (!agree_.same(weighted(where)))
    throw Error(
        fmt::format("rank {} resumes at step {} but the ranks disagree: checkpoint.output_dir {} must be the same "
                    "directory (a shared filesystem) for every rank",
                    env_.rank, fmt::join(where, ", "), r_.checkpoint.output_dir));
  step_ = INT64_MAX;
  for (auto& t : tenants_) {
    total_steps_ = std::max(total_steps_, t->run->total_steps);
    if (!t->done) step_ = std::min(step_, t->run->p.step);
  }
  if (step_ == INT64_MAX) step_ = total_steps_;
  if (lead_) begin(resumed);
  for (auto& t : tenants_)
    if (!t->done && !precompute_reference(*t)) return stopped(false);
  m_.training = true;
  // eval.on_start: each adapter before its first step (a stop during it ends the run, which has
  // nothing to save)
  for (auto& t : tenants_)
    if (!resumed && r_.eval.on_start && t->run->data.evaluates() && !evaluate(*t, false)) return stopped(false);
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
    const bool all_done = std::all_of(tenants_.begin(), tenants_.end(), [](const auto& t) { return t->done; });
    if (end == StepEnd::Stop && !all_done) return stopped();
  }
  return finish();
}

// Before a step, what an adapter still owes: the evaluation a stop cut short, the end of an epoch
// whose steps are done; then its epoch's batches. False: a stop came during an evaluation.
bool Trainer::settle(Tenant& t) {
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

// Adapter a's batches of its current epoch from step `step` on, into `out` (reads the first window).
void Trainer::epoch_batches(const AdapterRun& a, int64_t step, std::optional<data::MicroBatches>& out) const {
  const auto seed = static_cast<uint64_t>(a.r.train.seed);
  const data::ShardSpec spec{env_.world_size, env_.rank, seed, a.p.epoch, a.r.data.shuffle, stop_flag()};
  const data::BatchPlan plan{a.r.data.batch_size, a.r.train.gradient_accumulation_steps,
                             a.r.data.group_by_length ? a.r.data.group_window : 1, seed, a.p.epoch};
  if (a.data.mix)
    out.emplace(*a.data.mix, spec, plan, step);
  else
    out.emplace(*a.data.docs, *rt_.builder, spec, plan, step);
}

// The adapter's batches of its epoch from its step on; none when the data is already gone (the
// steps then go on empty and the ranks stop together at the step's end).
void Trainer::open_batches(Tenant& t) {
  AdapterRun& a = *t.run;
  a.whole_epoch_here = a.p.step_in_epoch == 0;
  if (a.whole_epoch_here) a.epoch_tokens = 0;
  a.skips.new_epoch();
  try {
    epoch_batches(a, batches_read(a.r, a.p.step_in_epoch), a.batches);
  } catch (const data::DataUnavailable& e) {
    data_error_ = a.who() + e.what();
    log_error(fmt::format("rank {}: {}", env_.rank, data_error_));
  }
}

// preference.precompute_reference: when the adapter's objective has no reference log-probs yet (a
// new run, or a state of other data), those of every example of its current epoch, each rank's
// micro-batches as its steps read them, then every rank's on each; before its first step here. False:
// a stop came first.
bool Trainer::precompute_reference(Tenant& t) {
  AdapterRun& a = *t.run;
  if (!agree_.any(a.objective->wants_reference())) return true;
  const auto t0 = Clock::now();
  const model::CausalLM::Routing routing(m_, alone(t, nullptr));
  std::optional<data::MicroBatches> batches;
  std::string lost;  // why this rank's data gave up (its micro-batches are then empty: the passes stay in step)
  const auto read = [&](auto&& next) {
    try {
      if (lost.empty()) next();
    } catch (const data::DataUnavailable& e) {
      lost = fmt::format("rank {}: {}preference.precompute_reference: {}", env_.rank, a.who(), e.what());
    }
  };
  read([&] { epoch_batches(a, 0, batches); });
  for (int64_t s = 0;; ++s) {  // (between two steps the ranks agree on a stop and on data lost)
    at::Tensor flags = at::tensor({stop_requested() ? 1.0 : 0.0, lost.empty() ? 0.0 : 1.0}, at::kDouble).to(rt_.device);
    agree_.sum(flags);
    flags = flags.cpu();
    if (flags[1].item<double>() > 0) {
      if (!lost.empty()) throw Error(lost);
      throw PeerError(-1, "another rank's data gave up while the reference log-probs were computed; stopping");
    }
    if (flags[0].item<double>() > 0) return false;
    if (s == a.steps_per_epoch) break;
    for (int k = 0; k < a.r.train.gradient_accumulation_steps; ++k) {
      std::vector<data::Example> micro;
      read([&] {
        for (data::Built& b : batches->next())
          if (auto* e = std::get_if<data::Example>(&b)) micro.push_back(std::move(*e));
      });
      a.objective->reference(micro);
    }
  }
  const int64_t n = a.objective->reference_done();
  if (lead_)
    info(
        fmt::format("{}preference.precompute_reference: the reference's log-probs of {} examples of epoch {} in "
                    "{:.1f} s",
                    a.who(), n, a.p.epoch, std::chrono::duration<double>(Clock::now() - t0).count()));
  return true;
}

// Micro-batches of several adapters (parts[k] owners[k]'s), stacked, through the model once; each
// adapter's loss summed over its own tokens, and one backward.
void Trainer::pass(const std::vector<data::Batch>& parts, const std::vector<Tenant*>& owners) {
  const data::Stacked s = data::stack(parts);
  auto routes = std::make_shared<model::Routes>();
  routes->streams = &streams_;
  for (size_t k = 0; k < parts.size(); ++k)
    routes->routes.push_back({*owners[k]->slot, s.parts[k].row0, s.parts[k].rows, s.parts[k].length});
  const model::CausalLM::Routing routing(m_, routes);
  const at::Tensor hidden = m_.hidden_states(s.ids, s.mask, nullptr, r_.data.packing);
  at::Tensor total;
  for (size_t k = 0; k < parts.size(); ++k) {
    const model::LossSum l = model::lm_head_loss(hidden, m_.lm_head(*owners[k]->slot), s.parts[k].flat_rows,
                                                 s.parts[k].targets, m_.config().logit_softcap);
    total = total.defined() ? total + l.sum : l.sum;
    owners[k]->loss += l.sum.detach();
    owners[k]->tokens += parts[k].tokens;
  }
  total.backward();
}

// A job's SFT: micro-batch k of every active adapter's step through the model in passes of at most
// adapters.per_pass adapters, in slot order: the same passes on every rank (a sharded base gathers
// in each), whichever of them have rows here.
void Trainer::shared_passes(const std::vector<Tenant*>& active) {
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

// Adapter t's micro-batches of the step through its objective alone, every row through its adapter
// with its dropout stream: its own run's passes. The gradients are summed over the ranks during the
// last backward when it is the only adapter, else all at once after every adapter's passes.
void Trainer::own_passes(Tenant& t) {
  AdapterRun& a = *t.run;
  const model::CausalLM::Routing routing(m_, alone(t, &streams_));
  const Objective::Sums s = a.objective->forward_backward([&] { return a.examples(env_.rank, warned_, data_error_); },
                                                          r_.train.gradient_accumulation_steps,
                                                          [this] {
                                                            if (tenants_.size() == 1) sync_->arm();
                                                          },
                                                          {a.p.step, a.p.step_in_epoch});
  t.loss = s.loss;
  t.tokens = s.tokens;
  t.real = s.real;
  t.slots = s.slots;
  t.stats = s.stats;
}

// One optimizer step of every active adapter: its micro-batches through the model (a job's SFT
// stacked in shared passes; else each adapter's through its objective), one all-reduce of every
// adapter's figures (reduce), then per adapter what its own run does (update); then its
// evaluation, epoch end and state as its own run has them after that step. The host reads the
// device once, before the optimizer steps: a non-finite loss or gradient norm, or a rank that lost
// its data, leaves the adapters as they were, on every rank alike.
StepEnd Trainer::step(const std::vector<Tenant*>& active) {
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
    t->stats = at::Tensor();
    t->rng_at_step_start = t->rng.get();  // a step given up for lost data must not move the streams
    t->state_saved = false;
    std::fill(t->run->source_step.begin(), t->run->source_step.end(), 0.0);
  }
  if (solo() || r_.train.objective != recipe::Objective::Sft) {
    for (Tenant* t : active) own_passes(*t);
  } else {
    shared_passes(active);
  }
  const double busy = std::chrono::duration<double>(Clock::now() - t0).count();
  sync_->finish();
  Reduced sums = reduce(active, busy > 0 ? (waited() - wait0) / busy : 0.0);
  const double* d = sums.host.data_ptr<double>();
  if (d[kTakenOver] > 0) {
    if (!lead_) throw PeerError(0, "rank 0 lost the run record to another process; stopping");
    throw Error(fmt::format("{}: this process stops without writing anything more (a run record has one live run)",
                            *sinks_->lost_lease()));
  }
  if (d[kDataFailed] > 0) {
    for (Tenant* t : active) t->run->opt->zero_grad(solo());
    for (Tenant* t : active) t->rng.set(t->rng_at_step_start);
    return StepEnd::DataLost;
  }
  StepTotals totals{.data_wait = d[kDataWait] / env_.world_size};
  nlohmann::json figures = nlohmann::json::object();
  for (size_t i = 0; i < active.size(); ++i) update(*active[i], sums, i, totals, figures);
  totals.loss /= std::max(totals.tokens, 1.0);
  // A job's zeroed, not freed (the finished ones' zeros from the all-reduce too): allocated once, not
  // anew in each step's passes among their activations, which raised 8 adapters' peak RSS by 12%.
  // Alone, freed as torch's zero_grad does: a parameter without a gradient in a step is left be.
  for (auto& t : tenants_) t->run->opt->zero_grad(/*set_to_none=*/solo());
  totals.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  ++step_;
  ++steps_this_process_;
  log_step(active, figures, totals);
  for (Tenant* t : active) {
    const AdapterRun& a = *t->run;
    a.skips.check(a.p.epoch, a.epoch_documents, a.r.data.max_skipped_share, a.who());
  }
  if (r_.dist.debug_checksum_every_n_steps && step_ % *r_.dist.debug_checksum_every_n_steps == 0) {
    std::vector<const AdapterRun*> runs;
    for (const auto& t : tenants_) runs.push_back(t->run.get());
    check_replicas(agree_, runs, step_);
  }
  const bool stop = d[kStop] > 0;
  bool stopping = false;  // an evaluation of this step was cut short by a stop
  for (Tenant* t : active) stopping = !after_step(*t, stopping, stop) || stopping;
  return stopping || stop ? StepEnd::Stop : StepEnd::Go;
}

// The step's one all-reduce: its flags (this rank's share of the step spent waiting for data:
// `data_wait`), then each active adapter's figures, in slot order; each adapter's gradients divided
// by its global token count (unless its objective did), and their norm.
Reduced Trainer::reduce(const std::vector<Tenant*>& active, double data_wait) {
  std::vector<double> mine(kStepSums, 0.0);
  mine[kStop] = stop_requested() ? 1.0 : 0.0;
  mine[kDataWait] = data_wait;
  mine[kDataFailed] = data_error_.empty() ? 0.0 : 1.0;
  mine[kTakenOver] = sinks_ && sinks_->lost_lease() ? 1.0 : 0.0;
  Reduced out;
  for (Tenant* t : active) {
    out.first.push_back(static_cast<int64_t>(mine.size()));
    mine.resize(mine.size() + kPerTenant + static_cast<size_t>(t->run->objective->stats()), 0.0);
    double* f = &mine[static_cast<size_t>(out.first.back())];
    f[kTokens] = static_cast<double>(t->tokens);
    f[kReal] = static_cast<double>(t->real);
    f[kSlots] = static_cast<double>(t->slots);
    const Skips::Counts skipped = t->run->skips.take();
    std::copy(skipped.begin(), skipped.end(), f + kSkipped);
    mine.insert(mine.end(), t->run->source_step.begin(), t->run->source_step.end());
  }
  at::Tensor stats = at::tensor(mine, at::kDouble).to(rt_.device);
  for (size_t i = 0; i < active.size(); ++i) {  // (the device's losses are added on the device: no sync before)
    stats[out.first[i] + kLoss].add_(active[i]->loss);
    if (active[i]->stats.defined())
      stats.narrow(0, out.first[i] + kPerTenant, active[i]->run->objective->stats()).add_(active[i]->stats);
  }
  agree_.sum(stats);
  std::vector<at::Tensor> norms;
  for (size_t i = 0; i < active.size(); ++i) {
    std::vector<at::Tensor>& grads = out.grads.emplace_back();
    for (const at::Tensor& p : active[i]->run->params)
      if (p.grad().defined()) grads.push_back(p.grad());
    if (!grads.empty() && !active[i]->run->objective->normalised())
      at::_foreach_div_(grads, stats[out.first[i] + kTokens].clamp_min(1.0));
    out.norms.push_back(grads.empty() ? at::zeros({}, stats.options())
                                      : at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2)), 2));
    norms.push_back(out.norms.back().to(at::kDouble).view({1}));
  }
  out.host = at::cat({stats, at::cat(norms)}).cpu();
  return out;
}

// Active adapter i's optimizer step as its own run takes it, from the step's `sums`: its loss and
// gradient norm checked, clipping and AdamW at its learning rate, its progress; its figures into
// `figures` (a job's named for it) and the step's `totals`.
void Trainer::update(Tenant& t, Reduced& sums, size_t i, StepTotals& totals, nlohmann::json& figures) {
  AdapterRun& a = *t.run;
  const Objective& objective = *a.objective;
  const double* d = sums.host.data_ptr<double>();
  const double* f = d + sums.first[i];
  const double grad_norm = d[sums.host.numel() - static_cast<int64_t>(sums.norms.size() - i)];
  const double loss = objective.normalised() ? f[kLoss] : f[kLoss] / std::max(f[kTokens], 1.0);
  a.check_finite(loss, grad_norm);
  const double lr = a.lr();
  // One rank and no rows of it this step: its own run has no gradients, and AdamW skips them.
  if (env_.world_size > 1 || t.tokens > 0) a.apply(sums.grads[i], sums.norms[i], lr);
  ++a.p.step;
  ++a.p.step_in_epoch;
  a.epoch_tokens += f[kTokens];
  a.skips.add(f + kSkipped);
  totals.loss += objective.normalised() ? loss * f[kTokens] : f[kLoss];  // (weighted by tokens)
  totals.tokens += f[kTokens], totals.real += f[kReal], totals.slots += f[kSlots];
  totals.rank_tokens += static_cast<double>(t.tokens);
  nlohmann::json own = {
      {"loss", loss}, {"tokens", f[kTokens]}, {"lr", lr}, {"grad_norm", grad_norm}, {"epoch", a.p.epoch}};
  own.update(Skips::figures(f + kSkipped));
  own.update(objective.figures(f + kPerTenant));
  for (const auto& [key, value] : own.items()) figures[keyed(key, a)] = value;
  const double* sources = f + kPerTenant + objective.stats();
  for (size_t k = 0; k < t.source_logged.size(); ++k) t.source_logged[k] += sources[k];
}

// What adapter t's own run does after its step: an evaluation every eval.every_n_steps, the end of
// its epoch, its state every checkpoint.state_every_n_steps. Once `stopping` (an evaluation of this
// step was cut short), what is due is only marked for the resumed run. `stop`: the run stops after
// this step (its state is saved then). False: its evaluation was cut short.
bool Trainer::after_step(Tenant& t, bool stopping, bool stop) {
  AdapterRun& a = *t.run;
  const bool last = a.p.step_in_epoch == a.steps_per_epoch;
  const std::optional<int> every = a.r.eval.every_n_steps;
  if (a.data.evaluates() && !last && every && a.p.step % *every == 0) {
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
bool Trainer::end_epoch(Tenant& t, bool stopping) {
  AdapterRun& a = *t.run;
  if (a.whole_epoch_here && a.epoch_tokens == 0)
    throw Error(fmt::format(
        "{}epoch {} trained on no token: every document of the selection was rejected ({} skipped: bad, longer than "
        "data.max_length with data.overlong=skip, or with no trained token); fix the data or the data.* keys (see "
        "the warnings above)",
        a.who(), a.p.epoch, a.skips.epoch_total()));
  if (a.data.evaluates() && !a.stopping_early && (stopping || !evaluate(t))) {
    a.p.pending_eval = true;
    return false;
  }
  close_epoch(t);
  return true;
}

// Adapter t's epoch adapter per its policy, then the state its next epoch starts from, or, after
// its last epoch, its end: its kept epochs, its run.json.
void Trainer::close_epoch(Tenant& t) {
  AdapterRun& a = *t.run;
  if (tty_) std::fputs("\n", stdout);
  a.ckpt->save_epoch(a.p.epoch, a.epochs, a.p.step);
  a.batches.reset();
  a.p.pending_eval = false;
  if (a.p.epoch + 1 < a.epochs) {
    a.p.epoch += 1;
    a.p.step_in_epoch = 0;
    a.ckpt->save_state(a.p);
    t.state_saved = true;
    return;
  }
  const RunSummary summary{.run_id = run_id_,
                           .steps = a.p.step,
                           .steering = a.p.steering,
                           .early_stopped_in = a.stopping_early ? std::optional(a.epochs - 1) : std::nullopt};
  const std::vector<int> kept = a.ckpt->finish(a.epochs, summary);
  t.done = true;
  if (lead_ && !solo())
    info(fmt::format("adapter '{}' done: {} steps{}; epochs kept [{}] in {}", a.name, a.p.step,
                     a.stopping_early ? fmt::format(" (stopped early in epoch {})", a.epochs - 1) : "",
                     fmt::join(kept, ", "), a.r.checkpoint.output_dir));
}

// The loss over adapter t's evaluation documents, the model (its adapter alone) as it is now: each
// rank evaluates its share (eval_shard) and the ranks sum (loss, tokens, …) in float64, so every
// rank holds the same token-weighted mean and steers alike. Rank 0 reports it to the sinks.
//
// A stop request (SIGTERM/SIGINT) is honoured between two evaluation batches, the ranks agreeing
// before each: the partial evaluation is dropped (nothing logged or steered) and false returned;
// the state then saved says the evaluation is due, and a resumed run does it first. Without
// `steers` (eval.on_start's, before any step) it is reported but leaves best/ and early stopping be.
bool Trainer::evaluate(Tenant& t, bool steers) {
  AdapterRun& a = *t.run;
  const StopCheck stop = [this] { return agree_.any(stop_requested()); };
  const Evaluation* by = a.objective->evaluation();
  std::optional<nlohmann::json> row;
  {
    const model::CausalLM::Routing routing(m_, alone(t, nullptr));
    if (a.data.eval) {
      row = evaluate_split(m_, *a.data.eval, *rt_.builder, a.r, agree_, a.p.epoch, a.p.step, stop, by);
    } else {
      std::vector<NamedSplit> splits;
      for (size_t i = 0; i < a.data.source_evals.size(); ++i) {
        const data::MixSource& s = a.data.mix->sources()[i];
        splits.push_back({s.spec.name, a.data.source_evals[i].get(), s.builder.get()});
      }
      row = evaluate_sources(m_, splits, a.r, agree_, a.p.epoch, a.p.step, stop, by);
    }
  }
  if (!row) {
    if (lead_)
      info(fmt::format("{}evaluation at step {} stopped on request: it is done again when the {} resumes", a.who(),
                       a.p.step, solo() ? "run" : "job"));
    return false;
  }
  a.evaluated(*row, steers, lead_, tty_);
  if (!lead_) return true;
  if (!a.name.empty()) {
    (*row)["adapter"] = a.name;
    (*row)["eval_loss/" + a.name] = *a.last_eval_loss;
  }
  if (a.p.steering.best_loss) (*row)["best_eval_loss"] = *a.p.steering.best_loss;
  if (a.p.steering.best_loss && row->contains("eval_reward")) (*row)["best_eval_reward"] = -*a.p.steering.best_loss;
  sinks_->eval(*row);
  return true;
}

}  // namespace lorarun::train::loop

namespace lorarun::train {

namespace fs = std::filesystem;

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
  // A job step's tensors are every active adapter's micro-batch at once: with glibc's moving mmap
  // threshold they were mapped and faulted in anew each step (bench/train/adapters_bench.py, 8
  // adapters: 35.3 s -> 27.0 s, medians of 3)
  if (r.adapters.enabled()) keep_freed_memory_for_reuse();
  std::unique_ptr<loop::Trainer> t;
  try {
    t = std::make_unique<loop::Trainer>(r, env);
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
