// --adapter mongodb-run:DB/ID[/epoch_N|/best]: an adapter a run stored in GridFS
// (checkpoint.store: mongodb), pulled into a temporary directory for the tools that load one.
#pragma once
#include <string>

namespace lorarun::track {

// The prefix that names a stored adapter instead of a directory.
inline constexpr const char* kRunAdapterPrefix = "mongodb-run:";

// An --adapter value as a directory: a plain directory as it is; "mongodb-run:DB/ID[/ARTIFACT]"
// pulled (sha256 checked) from the server of $LORARUN_MONGODB_URI into a temporary directory
// that lives as long as this object (the last epoch the run stored when no artifact is named).
class AdapterSource {
 public:
  explicit AdapterSource(const std::string& spec);
  ~AdapterSource();
  AdapterSource(const AdapterSource&) = delete;
  AdapterSource& operator=(const AdapterSource&) = delete;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_;
  std::string temp_;  // removed on destruction ("" for a plain directory)
};

}  // namespace lorarun::track
