// A run's artifacts in MongoDB GridFS (checkpoint.store: mongodb): the adapter directories the
// checkpoint policy keeps (epoch_<i>, best) and the kept resumable state (resume_state), each
// file one GridFS file of bucket `lorarun` in the run-record database, streamed in chunks.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <utility>
#include <vector>

namespace lorarun::track {

// One stored file. GridFS metadata: {run_id, artifact, name, bytes, sha256}; its GridFS
// filename is "<run_id>/<artifact>/<name>".
struct ArtifactFile {
  std::string artifact;  // "epoch_3", "best", "resume_state"
  std::string name;      // path relative to the artifact's directory ("adapter_model.safetensors")
  int64_t bytes = 0;
  std::string sha256;   // 64 lowercase hex digits
  std::string file_id;  // the GridFS file's _id (24 hex digits)
};

// Rates of the last upload, for logs and benches.
struct UploadStats {
  int64_t bytes = 0;
  double seconds = 0;
};

class ArtifactStore {
 public:
  // Connects to `uri` (its password is redacted in every error); `database` holds the bucket.
  // Throws lorarun::Error (one line) when the server cannot be reached.
  ArtifactStore(const std::string& uri, const std::string& database, std::chrono::milliseconds timeout);
  ~ArtifactStore();
  ArtifactStore(const ArtifactStore&) = delete;
  ArtifactStore& operator=(const ArtifactStore&) = delete;

  // Creates the bucket's indexes if they are missing (upload() does it otherwise): a writer calls
  // it before its first upload is due, so that no later failure can cut it short.
  void prepare();

  // Uploads every regular file under `dir` as `artifact` of run `run_id` and returns them; the
  // artifact's older files stay (list() shows the newer copy) until retire() removes them, once the
  // run record lists the new ones: a process lost in between leaves a record whose files exist. A
  // failure removes the new files uploaded so far (as far as the server allows) and throws one line.
  std::vector<ArtifactFile> upload(const std::string& run_id, const std::string& artifact, const std::string& dir);

  // Removes every stored file of `artifact` of run `run_id` but `keep` (what the record lists now).
  void retire(const std::string& run_id, const std::string& artifact, const std::vector<ArtifactFile>& keep);

  // The stored files of `artifact` of run `run_id` (all its artifacts when `artifact` is empty),
  // sorted by artifact and name.
  std::vector<ArtifactFile> list(const std::string& run_id, const std::string& artifact = {});

  // Writes `files` of `artifact` of run `run_id` (as the run record lists them: names, sizes,
  // sha256 and GridFS ids) into the new directory `dir`: first into a temporary sibling, each
  // file checked against its sha256 as it is written, then renamed to `dir`, so a failure
  // leaves nothing. Every name is checked first (artifact, relative file names: see
  // util/untrusted.hpp); `dir` must not exist yet. Throws one line naming the file and run.
  void download(const std::string& run_id, const std::string& artifact, const std::vector<ArtifactFile>& files,
                const std::string& dir);

  // The run document `run_id` of <database>.runs (relaxed extended JSON), whose "artifacts" list
  // (recorded_files) says what the run stored; lorarun::Error naming the run when there is none.
  nlohmann::json run_record(const std::string& run_id);

  // Removes the files of `artifact` (every artifact of the run when empty); returns how many.
  int64_t remove(const std::string& run_id, const std::string& artifact = {});

  // What the last upload() moved and how long it took.
  const UploadStats& last_upload() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Splits "ID[/ARTIFACT]" into its parts (artifact empty when not given).
std::pair<std::string, std::string> split_run_ref(const std::string& ref);

// The files of artifact `artifact` that the run document `run` (relaxed extended JSON of
// <db>.runs) lists in its "artifacts" array: the record is what a reader trusts, not whatever
// GridFS holds under that name. Every name, id and checksum is checked (lorarun::Error naming
// the run and the entry when one is malformed); empty when the run lists no such artifact.
std::vector<ArtifactFile> recorded_files(const nlohmann::json& run, const std::string& artifact);

// The artifacts `run` lists, each name checked, in the record's order.
std::vector<std::string> recorded_artifacts(const nlohmann::json& run);

// What a reader names in a run ("", an artifact, or the adapter NAME of a job of many), as the
// artifact to read: the run's last epoch adapter for "" ("epoch_3"), NAME's for a NAME
// ("NAME/epoch_3"), else `named` itself. lorarun::Error, beginning with `who`, when the run
// stored no such epoch (a job's run names its adapters).
std::string artifact_named(const nlohmann::json& run, const std::string& named, const std::string& who);

}  // namespace lorarun::track
