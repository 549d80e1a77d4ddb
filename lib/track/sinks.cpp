#include "track/sinks.hpp"

#include <fmt/format.h>
#include <torch/version.h>
#include <filesystem>
#include <fstream>
#include <random>

#include "io/files.hpp"
#include "track/mlflow.hpp"
#include "track/record.hpp"
#include "track/tensorboard.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/untrusted.hpp"

namespace lorarun::track {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// What each sink takes of a row: TensorBoard tags by row key, and MLflow's keys.
using Tags = std::vector<std::pair<std::string, std::string>>;
const Tags kTrainTags = {{"loss", "train/loss"},
                         {"lr", "train/lr"},
                         {"grad_norm", "train/grad_norm"},
                         {"tokens_per_s", "train/tokens_per_s"}};
const Tags kEvalTags = {{"eval_loss", "eval/loss"}, {"eval_ppl", "eval/ppl"}};

// `tags`, and a job's (adapters:) per-adapter figures: "loss/acme" as "train/loss/acme" for each
// "loss" of `tags`. An evaluation row of one adapter ("adapter": acme) is tagged as that adapter's
// ("eval/loss/acme"), not as the run's.
Tags tags_of(const json& row, const Tags& tags) {
  const std::string adapter = row.contains("adapter") && row["adapter"].is_string() ? row["adapter"] : "";
  Tags out;
  for (const auto& [key, tag] : tags) {
    if (!adapter.empty()) {
      out.emplace_back(key, tag + "/" + adapter);
      continue;
    }
    out.emplace_back(key, tag);
    const std::string prefix = key + "/";
    for (const auto& [k, v] : row.items())
      if (k.starts_with(prefix)) out.emplace_back(k, tag + k.substr(key.size()));
  }
  return out;
}

// MLflow's metric names: the row keys `tags` take; an adapter's evaluation as its eval_loss/<adapter>
// (one name per adapter, as its figures have in metrics.jsonl).
std::vector<std::string> mlflow_keys(const json& row, const Tags& tags) {
  if (row.contains("adapter") && row["adapter"].is_string()) return {"eval_loss/" + row["adapter"].get<std::string>()};
  std::vector<std::string> out;
  for (const auto& [key, tag] : tags) out.push_back(key);
  return out;
}

std::string local_id() {
  std::random_device rd;
  std::string hex;
  for (int i = 0; i < 12; ++i) hex += fmt::format("{:02x}", rd() & 0xFF);
  return "local-" + hex;
}

// The output directory absolute, without a trailing '/'.
fs::path output_dir(const recipe::Recipe& r) {
  fs::path dir = fs::absolute(r.checkpoint.output_dir).lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();  // "runs/a/"
  return dir;
}

// track.mlflow_uri: the run on the MLflow server, named after the output directory (by default the
// recipe file's name), its recipe as params; a resumed run continues the MLflow run it began.
std::unique_ptr<MlflowRun> start_mlflow(const recipe::Recipe& r, int world_size, const RunRecorder* record,
                                        bool resumed) {
  const fs::path dir = output_dir(r);
  json tags = {{"lorarun.version", LORARUN_VERSION},
               {"lorarun.torch_version", TORCH_VERSION},
               {"lorarun.world_size", std::to_string(world_size)},
               {"lorarun.output_dir", dir.string()}};
  if (record) tags["lorarun.run_record"] = record->ref();
  return std::make_unique<MlflowRun>(MlflowOptions{.uri = r.track.mlflow_uri,
                                                   .experiment = r.track.mlflow_experiment,
                                                   .run_name = dir.filename().string(),
                                                   .params = recipe::to_json(r),
                                                   .tags = tags,
                                                   .id_file = (dir / "mlflow_run.json").string(),
                                                   .resume = resumed});
}

}  // namespace

RunSinks::RunSinks(const recipe::Recipe& r) : r_(r) {}

RunSinks::~RunSinks() = default;

std::string RunSinks::open(const RunInfo& about, std::optional<int64_t> resumed_step, const std::string& resumed_run,
                           int world_size) {
  const bool resumed = resumed_step.has_value();
  if (r_.track.mongodb && !r_.data.uri.empty() && !r_.track.database.empty()) {
    record_ = std::make_unique<RunRecorder>(r_.data.uri, r_.track.database, std::chrono::seconds(r_.data.timeout_s));
    RunInfo with_dir = about;
    with_dir["output_dir"] = output_dir(r_).string();
    const std::optional<std::string> again =
        resumed && is_run_id(resumed_run) ? std::optional(resumed_run) : std::nullopt;
    const std::string id = record_->begin(recipe::to_json(r_), with_dir, again);
    ref_ = record_->ref();
    open_files(resumed_step, world_size);
    return id;
  }
  ref_ = resumed && resumed_run.starts_with("local-") ? resumed_run : local_id();
  open_files(resumed_step, world_size);
  return ref_;
}

// After the record: the files in the output directory, and MLflow.
void RunSinks::open_files(std::optional<int64_t> resumed_step, int world_size) {
  const bool resumed = resumed_step.has_value();
  fs::create_directories(r_.checkpoint.output_dir);
  open_metrics(resumed_step);
  if (r_.track.tensorboard) {  // earlier events files go as metrics.jsonl's rows go
    const std::string dir = (fs::path(r_.checkpoint.output_dir) / "tensorboard").string();
    tensorboard_ = std::make_unique<TensorBoardWriter>(dir, resumed_step);
    info(fmt::format("TensorBoard events in {} (tensorboard --logdir {})", tensorboard_->path(), dir));
  }
  if (!r_.track.mlflow_uri.empty()) mlflow_ = start_mlflow(r_, world_size, record_.get(), resumed);
}

// metrics.jsonl: a resumed run keeps the rows of the steps it resumes after, so no step appears
// twice; a new run starts it afresh.
void RunSinks::open_metrics(std::optional<int64_t> resumed_step) {
  const fs::path path = fs::path(r_.checkpoint.output_dir) / "metrics.jsonl";
  if (resumed_step && fs::exists(path)) {
    std::string kept, line;
    std::ifstream in(path);
    while (std::getline(in, line)) {
      const json row = json::parse(line, nullptr, false);
      if (row.is_object() && row.value("step", int64_t{0}) <= *resumed_step) kept += line + "\n";
    }
    io::write_file_atomic(path.string(), kept);
  }
  metrics_ = io::OutFile(path.string(), resumed_step ? io::OutFile::Mode::Append : io::OutFile::Mode::Truncate);
}

void RunSinks::step(const json& row) {
  metrics_.write(row.dump() + "\n");
  if (record_) record_->metrics(row);
  const Tags tags = tags_of(row, kTrainTags);
  to_tensorboard(row.at("step").get<int64_t>(), row, tags);
  if (mlflow_) mlflow_->metrics(row.at("step").get<int64_t>(), row, mlflow_keys(row, tags));
  last_row_ = row;
}

void RunSinks::eval(const json& row) {
  metrics_.write(row.dump() + "\n");
  if (record_) record_->metrics(row);
  const Tags tags = tags_of(row, kEvalTags);
  to_tensorboard(row.at("step").get<int64_t>(), row, tags);
  if (mlflow_) mlflow_->metrics(row.at("step").get<int64_t>(), row, mlflow_keys(row, tags));
  for (const char* k : {"eval_loss", "eval_ppl", "eval_tokens", "best_eval_loss"})
    if (row.contains(k)) last_row_[k] = row[k];
}

// A failed TensorBoard write warns and ends the events file, never the run (as a failed record write).
void RunSinks::to_tensorboard(int64_t step, const json& row,
                              const std::vector<std::pair<std::string, std::string>>& tags) {
  if (!tensorboard_) return;
  std::vector<Scalar> values;
  for (const auto& [key, tag] : tags)
    if (row.contains(key) && row[key].is_number()) values.push_back({tag, row[key].get<double>()});
  try {
    tensorboard_->scalars(step, values);
  } catch (const Error& e) {
    warn(fmt::format("{}; TensorBoard events are no longer written for this run", e.what()));
    tensorboard_.reset();
  }
}

void RunSinks::checkpoint(int epoch, const std::string& dir) {
  if (record_) record_->checkpoint(epoch, dir);
}

void RunSinks::completed(const std::vector<std::pair<std::string, std::string>>& adapters) {
  if (record_) record_->finish("completed", last_row_);
  if (!mlflow_) return;
  for (const auto& [dir, path] : adapters) mlflow_->artifacts(dir, path);
  mlflow_->finish("FINISHED");
}

void RunSinks::interrupted(const std::string& why) {
  if (record_) record_->finish("interrupted", last_row_, why);
  if (mlflow_) mlflow_->finish("KILLED");
}

void RunSinks::failed(const std::string& error, bool server_gone) {
  if (record_ && !server_gone) record_->finish("failed", last_row_, error);
  if (mlflow_) mlflow_->finish("FAILED");
}

std::optional<std::string> RunSinks::lost_lease() const { return record_ ? record_->lost_lease() : std::nullopt; }

}  // namespace lorarun::track
