#include "train/output_dir.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <unistd.h>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/process.hpp"
#include "util/untrusted.hpp"

namespace lorarun::train {
namespace {

namespace fs = std::filesystem;

std::string holder_text(int fd) {
  char buf[512] = {};
  const ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  std::string s(buf, n > 0 ? static_cast<size_t>(n) : 0);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\0')) s.pop_back();
  return s.empty() ? "another process" : printable(s);
}

}  // namespace

OutputDirLock::OutputDirLock(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec)
    throw ConfigError(fmt::format("cannot create checkpoint.output_dir {}: {}: choose a directory this user may write",
                                  dir, ec.message()));
  const std::string path = (fs::path(dir) / ".lock").string();
  fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd_ < 0)
    throw ConfigError(fmt::format("cannot create {}: {}: checkpoint.output_dir must be a writable directory", path,
                                  std::strerror(errno)));
  if (flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const std::string who = holder_text(fd_);
    ::close(fd_);
    fd_ = -1;
    throw ConfigError(
        fmt::format("checkpoint.output_dir {} is in use by another run ({}): wait for it to end, or give this "
                    "run another checkpoint.output_dir",
                    dir, who));
  }
  const std::string me = fmt::format("pid {} on {}, since {}\n", getpid(), host_name(), utc_stamp());
  if (ftruncate(fd_, 0) != 0 || pwrite(fd_, me.data(), me.size(), 0) != static_cast<ssize_t>(me.size())) {
    // The lock holds either way; only the holder's description is missing.
  }
}

OutputDirLock::~OutputDirLock() {
  if (fd_ >= 0) ::close(fd_);
}

std::string finished_marker(const std::string& dir) { return (fs::path(dir) / "run.json").string(); }

void claim_output_dir(const std::string& dir, bool overwrite, bool may_resume) {
  const std::string marker = finished_marker(dir);
  if (!fs::exists(marker)) return;
  // A state the finished run kept (checkpoint.keep_resume_state) is that run's to continue:
  // resuming checks it belongs to this recipe.
  const bool kept_state = fs::exists(fs::path(dir) / "resume_state") || fs::exists(fs::path(dir) / "resume_state.old");
  if (may_resume && kept_state && !overwrite) return;
  const nlohmann::json j = nlohmann::json::parse(io::read_file(marker), nullptr, false);
  const std::string what =
      j.is_object() ? fmt::format("run {} finished {} after {} steps", j.value("run_id", std::string("(not recorded)")),
                                  j.value("finished", std::string("?")), j.value("steps", int64_t{0}))
                    : "a finished run";
  if (!overwrite)
    throw ConfigError(
        fmt::format("checkpoint.output_dir {} holds the adapters of another run ({}): choose another "
                    "checkpoint.output_dir, or set checkpoint.overwrite=true to replace them",
                    dir, what));
  // Replacing: nothing of the old run may be taken for this one's (a job's adapters: their directories).
  if (j.is_object() && j.contains("adapters") && j["adapters"].is_array())
    for (const nlohmann::json& name : j["adapters"])
      if (name.is_string() && is_adapter_name(name.get<std::string>()))
        io::remove_tree((fs::path(dir) / name.get<std::string>()).string());
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind("epoch_", 0) == 0 || name.rfind("resume_state", 0) == 0 || name == "best")
      io::remove_tree(e.path().string());
  }
  fs::remove(marker);
  io::sync_dir(dir);
}

}  // namespace lorarun::train
