// Run records in MongoDB: what ran (recipe, versions, data), how it went (metrics), what it left
// (checkpoints with sha256) and how it ended. Rank 0 records; the other ranks do not.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <nlohmann/json.hpp>

#include "track/artifacts.hpp"
#include "util/error.hpp"

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
//                mongodb): [{artifact, saved_at, files: [{name, bytes, sha256, file_id}]}],
//                lease: {host, boot_id, pid, started, token, renewed_ms, renewed_at, every_ms} while
//                the run is live, null once it ended}
// <db>.metrics: {_id, run_id: ObjectId, time: date, <row's keys: step, loss, …>}
// Every string stored is scrubbed of passwords; an object with a key MongoDB refuses (starting
// with '$' or containing '.') is stored as its JSON text.
// A live run owns its record: the process that began or resumed it holds the record's lease and
// renews it every few seconds (LORARUN_LEASE_RENEW_S, default 10) from a thread of its own;
// every write to the run document requires it. A run whose lease is live is never resumed,
// restored or written by another process, and a new run refuses an output directory a live run
// writes; a stale lease (its holder gone) is taken over, and the takeover recorded.
class RunRecorder {
 public:
  // Connects (uri from the recipe's data.uri; db = recipe track.database). Throws lorarun::Error when unreachable.
  RunRecorder(const std::string& uri, const std::string& database, std::chrono::milliseconds timeout);
  // A run begun and never finished (an exception on the way) is marked "failed".
  ~RunRecorder();
  RunRecorder(const RunRecorder&) = delete;
  RunRecorder& operator=(const RunRecorder&) = delete;

  // Inserts the run document (status "running", the lease ours) and returns its id (hex ObjectId). `resume_id`:
  // continue that run instead (status back to "running", a {"resumed_at", "restart", "previous_status",
  // "took_over"?} entry appended to its "resumes" array). Throws LiveRunError when that run, or another run writing
  // info["output_dir"], is live (a process holds its lease). `info`
  // ({"torch_version", "world_size", "data", "documents", …}) goes to the top level of the document; lorarun_version
  // and hostname are added unless given; the record's own fields win. "restart" is info["restart"] (the
  // launcher's restarts: DistEnv::restart), else 0.
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
  // Set once another process took the record over (our lease lapsed): who, in words. This run
  // must stop without writing anything more.
  std::optional<std::string> lost_lease() const;

 private:
  std::string resume(const std::string& id, const nlohmann::json& info);
  void refuse_live_output_dir(const nlohmann::json& info);
  nlohmann::json mine() const;  // the filter of our run document while we hold its lease
  void update_mine(const char* what, const nlohmann::json& update);
  void start_renewing();
  void stop_renewing();
  template <class Write>
  void attempt(const char* what, bool skippable, Write write);

  std::unique_ptr<data::Client> client_;
  std::string database_, id_;
  bool finished_ = false;
  bool warned_ = false;
  int64_t dropped_ = 0;  // metrics documents not recorded
  std::chrono::steady_clock::time_point paused_until_{};
  // The lease: our token, and the renewing thread (its own connection) with what it found.
  std::string uri_, token_;
  std::chrono::milliseconds timeout_{};
  std::thread renewer_;
  mutable std::mutex mu_;
  std::condition_variable wake_;
  bool stopping_ = false;
  std::optional<std::string> lost_;  // guarded by mu_
};

// A run's record is held by a live process: the second command refuses (the launcher does not
// restart it: the exit status says so).
struct LiveRunError : ConfigError {
  using ConfigError::ConfigError;
};

// Who holds `run`'s lease when that process is alive, in words ("pid 42 on host-a, renewed 3 s
// ago"): on this host, its pid runs with the recorded start time; on another, the lease was
// renewed within three renewal periods by that host's clock, and is renewed again while `client`
// watches it (for at most that long). nullopt: no lease, or its holder is gone.
std::optional<std::string> live_holder(data::Client& client, const std::string& database, const nlohmann::json& run);

// The stored (redacted) recipe of run `id` in <database>.runs; throws lorarun::Error naming the id if absent.
nlohmann::json load_run_recipe(const std::string& uri, const std::string& database, const std::string& id,
                               std::chrono::milliseconds timeout);

// The newest run in <database>.runs recorded with `recipe` (the resolved recipe, as begin() takes
// it) that did not complete and lists a stored resumable state (checkpoint.store: mongodb): the
// run a rerun whose output_dir lost its state continues, as its run document. nullopt when there
// is none. Throws LiveRunError naming its holder, host, pid and output_dir when that run is live.
std::optional<nlohmann::json> find_resumable_run(const std::string& uri, const std::string& database,
                                                 const nlohmann::json& recipe, std::chrono::milliseconds timeout);

}  // namespace lorarun::track
