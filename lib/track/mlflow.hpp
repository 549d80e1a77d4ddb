// A run on an MLflow tracking server, through its REST API (libcurl): the experiment got or
// created by name, the run with its tags and the recipe as params, metrics by runs/log-batch, the
// final adapter uploaded through the server's artifact proxy, and the run's end status. Rank 0
// logs; the other ranks do not. A server that is unreachable or fails never stops or slows
// training: requests go out from a thread of their own, and the first failure is one warning,
// after which nothing more is sent.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace lorarun::track {

struct MlflowOptions {
  std::string uri;         // http(s)://[user:password@]host:port[/prefix] of `mlflow server`
  std::string experiment;  // got, or created, by name
  std::string run_name;
  nlohmann::json params;  // the (redacted) recipe as JSON: logged as flat dotted keys when the run is created
  nlohmann::json tags = nlohmann::json::object();  // {"lorarun.version": "0.1.0", …}
  // Where the run id is kept (JSON): written once the run exists; with `resume`, a run recorded
  // there on the same server is continued (status RUNNING again) instead of a new one created.
  std::string id_file;
  bool resume = false;
  std::chrono::milliseconds timeout{10000};  // per request; uploads: while bytes keep moving
};

// One MLflow run, logged from a background thread: the calls below only queue, except finish(),
// which waits for what was queued (bounded by the timeouts). Credentials: the URI's user:password
// (HTTP basic), else $MLFLOW_TRACKING_USERNAME / $MLFLOW_TRACKING_PASSWORD, or $MLFLOW_TRACKING_TOKEN
// (bearer), as MLflow's own client reads them.
class MlflowRun {
 public:
  explicit MlflowRun(MlflowOptions options);
  // A run never finished (an exception on the way) ends FAILED.
  ~MlflowRun();
  MlflowRun(const MlflowRun&) = delete;
  MlflowRun& operator=(const MlflowRun&) = delete;

  // Queues row[key] for each of `keys` that is a finite number, at optimizer step `step`.
  void metrics(int64_t step, const nlohmann::json& row, const std::vector<std::string>& keys);
  // Queues the upload of every regular file under `dir` as artifacts under `artifact_path`.
  void artifacts(const std::string& dir, const std::string& artifact_path);
  // Queues the end (FINISHED, FAILED or KILLED), then waits until everything queued was sent or
  // given up. Later calls do nothing.
  void finish(const std::string& status);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// A recipe's JSON as MLflow params: {"lora": {"r": 8}, "data": {"filter": {…}}} -> ("lora.r", "8"),
// ("data.filter", "{…}"): sections and keys joined by '.', strings as they are, other values as
// JSON text, every value with passwords hidden and cut to MLflow's 6,000 characters.
std::vector<std::pair<std::string, std::string>> flat_params(const nlohmann::json& nested);

}  // namespace lorarun::track
