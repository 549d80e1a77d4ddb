// Run records in MongoDB: what ran (recipe, versions, data), how it went (metrics), what it left
// (checkpoints with sha256) and how it ended. Rank 0 records; the other ranks do not.
#pragma once
#include <chrono>
#include <memory>
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "track/artifacts.hpp"

namespace lorarun::data {
class Client;
}

namespace lorarun::track {

// A run recorded in MongoDB: one document in <db>.runs, one per logged step in <db>.metrics.
//
// <db>.runs:    {_id: ObjectId, recipe: {…, data: {filter: "<extended JSON text>", …}},
//                <info's keys>…, lorarun_version, hostname, status: running|completed|failed|interrupted,
//                started_at: date, ended_at: date|null, checkpoints: [{epoch, path, saved_at, files:
//                [{name, bytes, sha256}]}], final_metrics, error, resumes: [{resumed_at, restart,
//                previous_status}], metrics_dropped (only when some were), artifacts (checkpoint.store:
//                mongodb): [{artifact, saved_at, files: [{name, bytes, sha256, file_id}]}]}
// <db>.metrics: {_id, run_id: ObjectId, time: date, <row's keys: step, loss, …>}
// Every string stored is scrubbed of passwords; an object with a key MongoDB refuses (starting
// with '$' or containing '.') is stored as its JSON text.
class RunRecorder {
 public:
  // Connects (uri from the recipe's data.uri; db = recipe track.database). Throws lorarun::Error when unreachable.
  RunRecorder(const std::string& uri, const std::string& database, std::chrono::milliseconds timeout);
  // A run begun and never finished (an exception on the way) is marked "failed".
  ~RunRecorder();
  RunRecorder(const RunRecorder&) = delete;
  RunRecorder& operator=(const RunRecorder&) = delete;

  // Inserts the run document (status "running") and returns its id (hex ObjectId). `resume_id`: continue that run
  // instead (status back to "running", a {"resumed_at", "restart"} entry appended to its "resumes" array). `info`
  // ({"torch_version", "world_size", "data", "documents", …}) goes to the top level of the document; lorarun_version
  // and hostname are added unless given; the record's own fields win. "restart" is info["restart"], else
  // $TORCHELASTIC_RESTART_COUNT, else 0.
  std::string begin(const nlohmann::json& recipe_redacted, const nlohmann::json& info,
                    const std::optional<std::string>& resume_id = {});
  // One metrics document {run_id, step, ...row}; failures after begin() warn once and do not stop training.
  void metrics(const nlohmann::json& row);
  // Appends {epoch, path, files: [{name, bytes, sha256}]} to the run's "checkpoints" (computes the hashes of the files
  // in dir).
  void checkpoint(int epoch, const std::string& dir);
  // Lists `files` as the run's artifact `artifact` (replacing an entry of that name). Unlike the
  // other writes, a failure throws: the artifact is not saved until the record says so.
  void artifact(const std::string& artifact, const std::vector<ArtifactFile>& files);
  // Removes the entries of these artifacts from the list (throws on failure).
  void drop_artifacts(const std::vector<std::string>& artifacts);
  // status: "completed" | "failed" | "interrupted"; final: last metrics; sets ended_at.
  void finish(const std::string& status, const nlohmann::json& final_metrics, const std::string& error = {});
  const std::string& id() const;
  // "<database>/<id>": what lora-train prints and --from-run takes.
  std::string ref() const;

 private:
  std::string resume(const std::string& id, const nlohmann::json& info);
  template <class Write>
  void attempt(const char* what, bool skippable, Write write);

  std::unique_ptr<data::Client> client_;
  std::string database_, id_;
  bool finished_ = false;
  bool warned_ = false;
  int64_t dropped_ = 0;  // metrics documents not recorded
  std::chrono::steady_clock::time_point paused_until_{};
};

// The stored (redacted) recipe of run `id` in <database>.runs; throws lorarun::Error naming the id if absent.
nlohmann::json load_run_recipe(const std::string& uri, const std::string& database, const std::string& id,
                               std::chrono::milliseconds timeout);

// The newest run in <database>.runs recorded with `recipe` (the resolved recipe, as begin() takes
// it) that did not complete and lists a stored resumable state (checkpoint.store: mongodb): the
// run a rerun whose output_dir lost its state continues. nullopt when there is none.
std::optional<std::string> find_resumable_run(const std::string& uri, const std::string& database,
                                              const nlohmann::json& recipe, std::chrono::milliseconds timeout);

}  // namespace lorarun::track
