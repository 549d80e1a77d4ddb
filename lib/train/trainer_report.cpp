// What a Trainer tells: the run record and the plan at its start, each step's line and metrics row,
// a stop, a lost data source, its end.
#include <fmt/format.h>
#include <torch/version.h>
#include <algorithm>
#include <cstdio>
#include <filesystem>

#include "io/files.hpp"
#include "model/lora.hpp"
#include "train/checkpointer.hpp"
#include "train/output_dir.hpp"
#include "train/trainer.hpp"
#include "train/trainer_impl.hpp"
#include "util/log.hpp"
#include "util/process.hpp"

namespace lorarun::train::loop {

namespace fs = std::filesystem;

// Rank 0, before the first step: the sinks (the run record first: a live run's record or output
// directory refuses this run before anything is written), the resolved recipe, what is about to run.
void Trainer::begin(bool resumed) {
  sinks_ = std::make_unique<track::RunSinks>(r_);
  run_id_ = sinks_->open(about(), resumed ? std::optional(step_) : std::nullopt, run_id_, env_.world_size);
  for (auto& t : tenants_) {
    t->run->p.run_id = run_id_;     // (saved with each state: a resumed run continues this record)
    t->run->ckpt->attach(*sinks_);  // (the store's indexes are made before the record is announced)
  }
  if (sinks_->record())
    info(fmt::format("run recorded as {} (lora-train --from-run {} repeats it)", sinks_->ref(), sinks_->ref()));
  io::write_file_atomic((fs::path(r_.checkpoint.output_dir) / "recipe.yaml").string(), recipe::to_yaml(r_));
  for (const std::string& line : plan_lines()) info(line);
  for (const auto& t : tenants_)  // an older run's
    if (t->fresh && t->run->r.checkpoint.keep_best)
      io::remove_tree((fs::path(t->run->r.checkpoint.output_dir) / "best").string());
  if (!resumed) return;
  const AdapterRun& a = *tenants_.front()->run;
  info(solo() ? fmt::format("resuming at epoch {} step {} (step {} of {})", a.p.epoch, a.p.step_in_epoch, a.p.step,
                            a.total_steps)
              : fmt::format("resuming the job at step {} of at most {}", step_, total_steps_));
}

// What the run record says of the run: its data and plan, or a job's adapters.
track::RunInfo Trainer::about() const {
  track::RunInfo about = {{"torch_version", TORCH_VERSION},
                          {"world_size", env_.world_size},
                          {"device", cuda_ ? "cuda" : "cpu"},
                          {"restart", env_.restart}};
  if (solo()) {
    const AdapterRun& a = *tenants_.front()->run;
    about["data"] = a.data.describe();
    about["documents"] = a.data.documents();
    about["eval_documents"] = a.data.eval_documents();
    about["steps_per_epoch"] = a.steps_per_epoch;
    if (a.data.mix) about["mixture"] = a.data.mix->plan();
    return about;
  }
  nlohmann::json adapters = nlohmann::json::array();
  int64_t documents = 0;
  for (const auto& t : tenants_) {
    const AdapterRun& a = *t->run;
    adapters.push_back({{"name", a.name},
                        {"documents", a.data.documents()},
                        {"steps_per_epoch", a.steps_per_epoch},
                        {"epochs", a.r.train.epochs},
                        {"r", a.r.lora.r},
                        {"lr", a.r.train.lr},
                        {"output_dir", a.r.checkpoint.output_dir}});
    documents += a.data.documents();
  }
  about["documents"] = documents;
  about["adapters"] = std::move(adapters);
  about["job_steps"] = total_steps_;
  return about;
}

// What is about to train, for the log.
std::vector<std::string> Trainer::plan_lines() const {
  if (solo()) {
    const AdapterRun& a = *tenants_.front()->run;
    return rt_.summary(r_, a.data, env_.world_size, a.steps_per_epoch, sync_->buckets());
  }
  std::vector<std::string> lines = {fmt::format("{} adapters on one base ({} rank(s)), {} job steps at most: {}",
                                                tenants_.size(), env_.world_size, total_steps_,
                                                model::trainable_summary(m_))};
  for (const auto& t : tenants_) {
    const AdapterRun& a = *t->run;
    lines.push_back(fmt::format(
        "adapter '{}': {}; {} documents from {}, {} steps per epoch x {} epochs{}{}", a.name,
        model::describe_adapter(a.r.lora), a.data.documents(), a.data.describe(), a.steps_per_epoch, a.r.train.epochs,
        a.data.eval ? fmt::format("; evaluating on {}", a.data.eval->describe()) : "", t->done ? " (finished)" : ""));
  }
  if (r_.model.keep_quantized) lines.push_back(model::gguf_blocks_summary(m_));
  if (r_.lora.quantize_base) lines.push_back(model::nf4_summary(m_));
  return lines;
}

// Rank 0: a progress line on a TTY every step; every log_every_n_steps a line (log file, and the
// console when not a TTY) and a metrics row to the sinks: the step's totals, then each adapter's
// `figures` (a job's as "<figure>/<adapter>"). Other ranks: their own log file.
void Trainer::log_step(const std::vector<Tenant*>& active, const nlohmann::json& figures, const StepTotals& s) {
  const double elapsed = std::chrono::duration<double>(Clock::now() - started_).count();
  const double eta = elapsed / static_cast<double>(steps_this_process_) * static_cast<double>(total_steps_ - step_);
  const std::string left = clock_text(static_cast<int64_t>(eta));
  std::string line;
  if (solo()) {
    const AdapterRun& a = *active.front()->run;
    line = fmt::format(
        "epoch {}/{} step {}/{} loss {:.4f} lr {:.3g} grad_norm {:.3f} tokens/s {:.0f} data_wait {:.0f}% eta {}",
        a.p.epoch, r_.train.epochs, a.p.step_in_epoch, a.steps_per_epoch, figures.at("loss").get<double>(),
        figures.at("lr").get<double>(), figures.at("grad_norm").get<double>(), s.tokens / s.seconds, 100 * s.data_wait,
        left);
    if (a.last_eval_loss && a.r.train.objective == recipe::Objective::Grpo)  // (its eval_loss: minus eval_reward)
      line += fmt::format(" eval_reward {:.4f}", -*a.last_eval_loss);
    else if (a.last_eval_loss)
      line += fmt::format(" eval_loss {:.4f}", *a.last_eval_loss);
  } else {
    line = fmt::format("step {}/{} adapters {} loss {:.4f} tokens/s {:.0f} data_wait {:.0f}% eta {}", step_,
                       total_steps_, active.size(), s.loss, s.tokens / s.seconds, 100 * s.data_wait, left);
  }
  if (tty_) {
    std::fputs(("\r\033[K" + line).c_str(), stdout);
    std::fflush(stdout);
  }
  if (step_ % r_.track.log_every_n_steps != 0) return;
  info(line, lead_ && !tty_);
  if (!lead_) return;
  nlohmann::json row = {{"step", step_},
                        {"loss", s.loss},
                        {"tokens", s.tokens},
                        {"tokens_per_s", s.tokens / s.seconds},
                        {"tokens_per_s_rank0", s.rank_tokens / s.seconds},
                        {"data_wait_share", s.data_wait},
                        {"padding_share", s.slots > 0 ? 1.0 - s.real / s.slots : 0.0},
                        {"peak_rss_mb", peak_resident_mib()},
                        {"rss_mb", resident_mib()},
                        {"seconds", s.seconds}};
  if (!solo()) row["adapters_active"] = active.size();
  row.update(figures);
  for (auto& t : tenants_) {  // data.sources, since the last row: the rows of an epoch add up to its mixture
    const AdapterRun& a = *t->run;
    if (!a.data.mix) continue;
    const auto& sources = a.data.mix->sources();
    nlohmann::json docs = nlohmann::json::object(), tokens = nlohmann::json::object();
    for (size_t i = 0; i < sources.size(); ++i) {
      docs[sources[i].spec.name] = static_cast<int64_t>(t->source_logged[i]);
      tokens[sources[i].spec.name] = static_cast<int64_t>(t->source_logged[sources.size() + i]);
    }
    row[keyed("source_documents", a)] = std::move(docs);
    row[keyed("source_tokens", a)] = std::move(tokens);
    std::fill(t->source_logged.begin(), t->source_logged.end(), 0.0);
  }
  // the base this rank holds (dist.shard_base: its slices and the blocks gathered whole now)
  row["base_mb"] = static_cast<double>(m_.base_bytes() + (rt_.shards ? rt_.shards->buffer_bytes() : 0)) / (1 << 20);
  sinks_->step(row);
}

// Stopped on request (SIGTERM/SIGINT): with `save`, every unfinished adapter's state where it
// stands (an evaluation cut short marked pending), then exit 75.
int Trainer::stopped(bool save) {
  if (save)
    for (auto& t : tenants_)
      if (!t->done && !t->state_saved) t->run->ckpt->save_state(t->run->p);
  if (lead_) {
    if (tty_) std::fputs("\n", stdout);
    info(solo() ? fmt::format("stopped at step {} on request; the resumable state is in {}: run the same command to "
                              "resume",
                              step_, tenants_.front()->run->ckpt->state_dir())
                : fmt::format("stopped at job step {} on request; each adapter's resumable state is in "
                              "{}/<name>/resume_state: run the same command to resume",
                              step_, r_.checkpoint.output_dir));
    sinks_->interrupted();
  }
  pg_.barrier();
  return kExitStopped;
}

// Some rank's data source gave up (retries spent, or stopped while waiting to retry): every
// unfinished adapter's state as of the last completed step (its dropout stream put back by step),
// not to GridFS (the server is likely the data source that was lost), then exit 75 as on SIGTERM,
// so a rerun continues.
int Trainer::data_lost() {
  for (auto& t : tenants_)
    if (!t->done) t->run->ckpt->save_state(t->run->p, false);
  const std::string why = data_error_.empty() ? "another rank lost its data source (its log says why)" : data_error_;
  if (lead_ || !data_error_.empty())
    warn(solo() ? fmt::format("rank {}: {}; the resumable state of step {} is in {}: run the same command to continue",
                              env_.rank, why, step_, tenants_.front()->run->ckpt->state_dir())
                : fmt::format("rank {}: {}; the resumable states of job step {} are in {}/<name>/resume_state: run "
                              "the same command to continue",
                              env_.rank, why, step_, r_.checkpoint.output_dir));
  if (lead_) sinks_->interrupted(why);
  pg_.barrier();
  return kExitStopped;
}

// Every adapter has ended (each its run.json): a job's run.json (its adapters named, for
// checkpoint.overwrite), the record completed with each adapter's last kept epoch and best/.
int Trainer::finish() {
  std::vector<std::string> names;
  std::vector<std::pair<std::string, std::string>> adapters;  // for MLflow
  for (const auto& t : tenants_) {
    const AdapterRun& a = *t->run;
    names.push_back(a.name);
    const fs::path out = a.r.checkpoint.output_dir;
    const std::string prefix = a.name.empty() ? "" : a.name + "/";
    const std::vector<int> kept = epochs_kept(a.r.checkpoint, a.epochs);
    if (!kept.empty()) adapters.emplace_back((out / fmt::format("epoch_{}", kept.back())).string(), prefix + "adapter");
    if (a.r.checkpoint.keep_best && fs::exists(out / "best"))
      adapters.emplace_back((out / "best").string(), prefix + "best");
  }
  if (lead_) {
    for (const auto& t : tenants_) {
      const AdapterRun& a = *t->run;
      if (a.skips.run_total() > 0) warn(a.who() + a.skips.summary());
      if (a.stopping_early) sinks_->last_row()[keyed("early_stopped", a)] = true;
    }
    if (solo()) {
      const AdapterRun& a = *tenants_.front()->run;
      info(fmt::format("done: {} steps{}; adapters in {}", a.p.step,
                       a.stopping_early ? fmt::format(" (stopped early in epoch {})", a.epochs - 1) : "",
                       r_.checkpoint.output_dir));
    } else {
      const nlohmann::json done = {{"status", "completed"},
                                   {"run_id", sinks_->ref()},
                                   {"steps", step_},
                                   {"finished", utc_stamp()},
                                   {"adapters", names}};
      io::write_file_atomic(finished_marker(r_.checkpoint.output_dir), done.dump(1));
      info(fmt::format("done: {} adapters in {} job steps; each in {}/<name>/", tenants_.size(), step_,
                       r_.checkpoint.output_dir));
    }
  }
  pg_.barrier();
  if (lead_) sinks_->completed(adapters);  // (MLflow's uploads after the barrier: the other ranks need not wait)
  return 0;
}

// (Not to the record when its server already proved unreachable: rank 0 then ends at once, with
// its own error.)
void Trainer::failed(const std::string& error) {
  if (!sinks_) return;
  const bool gone =
      std::any_of(tenants_.begin(), tenants_.end(), [](const auto& t) { return t->run->ckpt->store_unreachable(); });
  try {  // (the error being reported is the one that matters)
    sinks_->failed(error, gone);
  } catch (const std::exception& e) {
    warn(fmt::format("the run's end was not recorded: {}", e.what()));
  }
}

}  // namespace lorarun::train::loop
