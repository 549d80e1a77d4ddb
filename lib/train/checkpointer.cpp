#include "train/checkpointer.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <algorithm>
#include <chrono>
#include <filesystem>

#include "data/mongo.hpp"
#include "io/files.hpp"
#include "track/artifacts.hpp"
#include "track/record.hpp"
#include "track/sinks.hpp"
#include "train/agreement.hpp"
#include "train/output_dir.hpp"
#include "util/error.hpp"
#include "util/log.hpp"

namespace lorarun::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

}  // namespace

std::vector<int> epochs_kept(const recipe::CheckpointSection& c, int epochs) {
  if (epochs < 1) return {};
  if (c.save_last_epoch_only) return {epochs - 1};
  std::vector<int> kept;
  switch (c.epochs_to_save.mode) {
    case recipe::EpochsToSave::Mode::All:
      for (int i = 0; i < epochs; ++i) kept.push_back(i);
      break;
    case recipe::EpochsToSave::Mode::None:
      break;
    case recipe::EpochsToSave::Mode::List:
      for (int e : c.epochs_to_save.epochs)
        if (e >= 0 && e < epochs) kept.push_back(e);
      std::sort(kept.begin(), kept.end());
      kept.erase(std::unique(kept.begin(), kept.end()), kept.end());
      break;
  }
  return kept;
}

bool save_after_epoch(const recipe::CheckpointSection& c, int epoch, int epochs) {
  const std::vector<int> kept = epochs_kept(c, epochs);
  return std::binary_search(kept.begin(), kept.end(), epoch);
}

Checkpointer::Checkpointer(const recipe::Recipe& r, const Agreement& agree, const model::CausalLM& m,
                           model::LoraConfig cfg, const std::vector<at::Tensor>& params, torch::optim::AdamW& opt,
                           nlohmann::json data, bool cuda, RngStream rng)
    : r_(r),
      agree_(agree),
      m_(m),
      cfg_(std::move(cfg)),
      params_(params),
      opt_(opt),
      data_(std::move(data)),
      rng_(rng.get ? std::move(rng) : RngStream::process(cuda)),
      out_(r.checkpoint.output_dir) {}

Checkpointer::~Checkpointer() = default;

std::string Checkpointer::state_dir() const { return train::state_dir(out_); }

void Checkpointer::attach(track::RunSinks& sinks) {
  sinks_ = &sinks;
  record_ = sinks.record();
  if (!record_ || r_.checkpoint.store != recipe::Store::MongoDB) return;
  store_ =
      std::make_unique<track::ArtifactStore>(r_.data.uri, r_.track.database, std::chrono::seconds(r_.data.timeout_s));
  store_->prepare();  // the bucket's indexes, before any upload is due: no later failure can cut them short
}

void Checkpointer::store_as_adapter(const std::string& name) { prefix_ = name + "/"; }

namespace {

// The artifacts the record of `run` lists (each name checked before it touches a path), not
// whatever GridFS holds; the states last, so that a restore cut short leaves no state and is done
// again. Each is written under a temporary name into <output_dir>/<artifact> and renamed when whole.
void restore_run(const recipe::Recipe& r, const nlohmann::json& run) {
  const auto t0 = Clock::now();
  const std::string out = r.checkpoint.output_dir;
  const std::string id = run["_id"].value("$oid", "");
  const std::string ref = fmt::format("{}/{}", r.track.database, id);
  const auto is_state = [](const std::string& a) { return a == "resume_state" || a.ends_with("/resume_state"); };
  try {
    track::ArtifactStore store(r.data.uri, r.track.database, std::chrono::seconds(r.data.timeout_s));
    std::vector<std::string> artifacts = track::recorded_artifacts(run);
    std::stable_partition(artifacts.begin(), artifacts.end(), [&](const std::string& a) { return !is_state(a); });
    // Every artifact's files read (and their names checked) before any is written: a record refused
    // for one name leaves the output directory as it was.
    std::vector<std::vector<track::ArtifactFile>> files;
    for (const std::string& a : artifacts) {
      files.push_back(track::recorded_files(run, a));
      if (files.back().empty())
        throw ConfigError(
            fmt::format("its record lists {} without a file: the record was not written by lora-train", a));
    }
    std::vector<std::string> restored;
    int64_t bytes = 0;
    for (size_t i = 0; i < artifacts.size(); ++i) {
      const std::string& a = artifacts[i];
      const fs::path dir = fs::path(out) / a;  // (a job's adapter's: <output_dir>/<adapter>/<artifact>)
      if (fs::exists(dir)) continue;           // what the output directory still has is its own
      fs::create_directories(dir.parent_path());
      store.download(id, a, files[i], dir.string());
      for (const track::ArtifactFile& f : files[i]) bytes += f.bytes;
      restored.push_back(a);
    }
    io::sync_dir(out);
    info(fmt::format("restored {} of run {} from GridFS into {} ({:.2f} MB in {:.2f} s)", fmt::join(restored, ", "),
                     ref, out, static_cast<double>(bytes) / 1e6,
                     std::chrono::duration<double>(Clock::now() - t0).count()));
  } catch (const ConfigError& e) {  // a record lora-train did not write so: the same command refuses it again
    throw ConfigError(fmt::format(
        "restoring run {} from the database: {} (lora-runs rm {} removes it; or set checkpoint.resume=never to "
        "start over)",
        ref, e.what(), ref));
  }
}

}  // namespace

void restore_from_store(const recipe::Recipe& r, const Agreement& agree, const std::vector<std::string>& states) {
  if (r.checkpoint.store != recipe::Store::MongoDB || r.checkpoint.resume != recipe::Resume::Auto) return;
  const bool none = std::none_of(states.begin(), states.end(),
                                 [](const std::string& dir) { return fs::exists(dir) || fs::exists(dir + ".old"); });
  std::string why;
  std::exception_ptr refused;  // what the same command cannot change: a live run, a record we do not trust
  if (agree.lead() && none) {
    try {
      const std::optional<nlohmann::json> run = track::find_resumable_run(
          r.data.uri, r.track.database, recipe::to_json(r), std::chrono::seconds(r.data.timeout_s));
      if (run) restore_run(r, *run);
    } catch (const ConfigError& e) {
      why = e.what();
      refused = std::current_exception();
    } catch (const std::exception& e) {
      why = fmt::format(
          "{} (checkpoint.store: mongodb; run again once the server is reachable, or set "
          "checkpoint.resume=never to start over)",
          e.what());
    }
  }
  agree.rank0_ok(why.empty(), why, "restoring the resumable state from the database", refused);
}

std::optional<Progress> Checkpointer::load(const RunShape& shape) {
  if (r_.checkpoint.resume != recipe::Resume::Auto) return std::nullopt;
  return load_state(out_, opt_, params_, agree_.rank(), agree_.world(), rng_, recipe::to_json(r_), shape, load_also_);
}

void Checkpointer::keep_in_state(StateFiles save, StateFiles load) {
  save_also_ = std::move(save);
  load_also_ = std::move(load);
}

// No adapter with a NaN or an infinity is ever written (every rank checks its replica).
void Checkpointer::check_finite(const std::string& what, int64_t step) const {
  std::vector<at::Tensor> each;
  for (const at::Tensor& p : params_) each.push_back(at::isfinite(p).all());
  const bool finite = each.empty() || at::stack(each).all().item<bool>();
  if (!agree_.same(finite ? 1.0 : 0.0) || !finite)
    throw Error(
        fmt::format("the LoRA weights hold non-finite values at step {}: {} was not written. Lower train.lr "
                    "(now {:g}) or set train.max_grad_norm, then start over (checkpoint.resume=never)",
                    step, what, r_.train.lr));
}

// checkpoint.store: mongodb (rank 0): the directory `dir`, just written, as the run's artifact in
// GridFS and in the run record; until both hold it, the save has not happened.
void Checkpointer::store(const std::string& artifact, const std::string& dir) {
  if (!store_) return;
  try {
    const std::vector<track::ArtifactFile> files = store_->upload(record_->id(), prefix_ + artifact, dir);
    record_->artifact(prefix_ + artifact, files);
    store_->retire(record_->id(), prefix_ + artifact, files);  // (only now: the record never lists a removed file)
    const track::UploadStats& s = store_->last_upload();
    info(fmt::format("stored {} in GridFS: {} files, {:.2f} MB in {:.2f} s ({:.1f} MB/s)", prefix_ + artifact,
                     files.size(), static_cast<double>(s.bytes) / 1e6, s.seconds,
                     s.seconds > 0 ? static_cast<double>(s.bytes) / 1e6 / s.seconds : 0.0));
  } catch (const std::exception& e) {
    if (dynamic_cast<const data::ConnectionError*>(&e)) store_unreachable_ = true;
    throw Error(fmt::format("{} (checkpoint.store: mongodb; {}{} kept: run the same command to resume)", e.what(), dir,
                            artifact == "resume_state" ? " is" : " and the resumable state are"));
  }
}

void Checkpointer::save_epoch(int epoch, int epochs, int64_t step) {
  check_finite(fmt::format("epoch_{}", epoch), step);
  std::string why;
  if (agree_.lead() && save_after_epoch(r_.checkpoint, epoch, epochs)) {
    try {
      const std::string dir = train::save_epoch(out_, epoch, m_, cfg_);
      info(fmt::format("saved {}", dir));
      if (sinks_) sinks_->checkpoint(epoch, dir);
      store(fmt::format("epoch_{}", epoch), dir);
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  agree_.rank0_ok(why.empty(), why, fmt::format("writing epoch_{}", epoch));
}

void Checkpointer::save_best(const nlohmann::json& about, int64_t step) {
  check_finite("best/", step);
  std::string why;
  if (agree_.lead()) {
    try {
      nlohmann::json best = about;
      const bool rewarded = about.contains("eval_reward");  // (grpo)
      best["best"] = rewarded ? "the highest eval_reward so far" : "the lowest eval_loss so far";
      const std::string dir = train::save_best(out_, m_, cfg_, best);
      const char* key = rewarded ? "eval_reward" : "eval_loss";
      info(fmt::format("saved {} ({} {:.6f} at step {})", dir, key, about.value(key, 0.0), step));
      store("best", dir);
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  agree_.rank0_ok(why.empty(), why, "writing best/");
}

// Every rank's RNG goes to rank 0 (each in its own row of a sum), which writes the state.
void Checkpointer::save_state(const Progress& p, bool store_it) {
  check_finite("the resumable state", p.step);
  const at::Tensor rngs = agree_.rows(rng_.get());
  std::string why;
  if (agree_.lead()) {
    try {
      train::save_state(out_, m_, cfg_, opt_, params_, p, rngs.to(at::kCPU, at::kByte), recipe::to_json(r_), data_,
                        save_also_);
      if (store_it) store("resume_state", state_dir());
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  agree_.rank0_ok(why.empty(), why, "writing " + state_dir());
}

std::vector<int> Checkpointer::finish(int epochs, const RunSummary& summary) {
  const std::vector<int> kept = epochs_kept(r_.checkpoint, epochs);
  std::string why;
  if (agree_.lead() && store_) {  // out of GridFS, as out of output_dir, go what the policy does not keep
    try {
      const auto unkept = [&](const std::string& stored) {  // (a job's adapter: its own artifacts only)
        if (!stored.starts_with(prefix_)) return false;
        const std::string artifact = stored.substr(prefix_.size());
        if (artifact == "resume_state") return !r_.checkpoint.keep_resume_state;
        if (!artifact.starts_with("epoch_")) return false;
        return std::find(kept.begin(), kept.end(), std::atoi(artifact.c_str() + 6)) == kept.end();
      };
      std::vector<std::string> gone;
      for (const track::ArtifactFile& f : store_->list(record_->id()))
        if (unkept(f.artifact) && std::find(gone.begin(), gone.end(), f.artifact) == gone.end())
          gone.push_back(f.artifact);
      for (const std::string& a : gone) store_->remove(record_->id(), a);
      if (!gone.empty()) record_->drop_artifacts(gone);
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  agree_.rank0_ok(why.empty(), why, "writing the run's artifacts in GridFS");
  if (!agree_.lead()) return kept;
  remove_unkept_epochs(out_, kept);
  if (!r_.checkpoint.keep_resume_state) remove_state(out_);
  nlohmann::json done = {{"status", "completed"},
                         {"run_id", summary.run_id},
                         {"steps", summary.steps},
                         {"finished", utc_stamp()},
                         {"epochs_kept", kept}};
  if (const Steering& s = summary.steering; s.best_loss)
    done["best"] = {{"eval_loss", *s.best_loss}, {"step", s.best_step}};
  if (summary.early_stopped_in) done["early_stopped"] = {{"step", summary.steps}, {"epoch", *summary.early_stopped_in}};
  io::write_file_atomic(finished_marker(out_), done.dump(1));
  return kept;
}

}  // namespace lorarun::train
