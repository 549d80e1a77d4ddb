// A run's artifacts in MongoDB GridFS (checkpoint.store: mongodb): the adapter directories the
// checkpoint policy keeps (epoch_<i>, best) and the kept resumable state (resume_state), each
// file one GridFS file of bucket `lorarun` in the run-record database, streamed in chunks.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
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

  // Uploads every regular file under `dir` as `artifact` of run `run_id`. The artifact's older
  // files are removed only after every new one is complete; a failure removes the new ones
  // uploaded so far (as far as the server allows) and throws one line.
  std::vector<ArtifactFile> upload(const std::string& run_id, const std::string& artifact, const std::string& dir);

  // The stored files of `artifact` of run `run_id` (all its artifacts when `artifact` is empty),
  // sorted by artifact and name.
  std::vector<ArtifactFile> list(const std::string& run_id, const std::string& artifact = {});

  // Writes `artifact`'s files under `dir` (created), each checked against its sha256 while it is
  // written; a mismatch removes the file and throws. Returns the files written.
  std::vector<ArtifactFile> download(const std::string& run_id, const std::string& artifact, const std::string& dir);

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

}  // namespace lorarun::track
