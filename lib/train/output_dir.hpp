// One output directory belongs to one run: an exclusive lock for the run's life, and a marker
// saying a run finished there, so a new run never silently replaces another run's adapters.
#pragma once
#include <string>

namespace lorarun::train {

// flock(LOCK_EX | LOCK_NB) on <dir>/.lock, held until destruction or process exit (SIGKILL
// included: the kernel drops it with the descriptor). Creates `dir`. Throws lorarun::Error
// naming the holder (pid, host, start time) when another process holds it.
class OutputDirLock {
 public:
  explicit OutputDirLock(const std::string& dir);
  ~OutputDirLock();
  OutputDirLock(const OutputDirLock&) = delete;
  OutputDirLock& operator=(const OutputDirLock&) = delete;

 private:
  int fd_ = -1;
};

// <dir>/run.json: written when a run completes (status, run id, steps, time, epochs kept).
std::string finished_marker(const std::string& dir);

// A new run may start in `dir`: refuses (lorarun::Error) a directory holding another run's
// finished adapters unless `overwrite`, in which case that run's marker, epoch adapters, best/ and
// resumable state are removed first. Directories of interrupted runs pass (they resume), and so
// does a finished run's kept resumable state when `may_resume` (checkpoint.resume=auto).
void claim_output_dir(const std::string& dir, bool overwrite, bool may_resume);

}  // namespace lorarun::train
