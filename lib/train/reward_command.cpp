#include "train/reward_command.hpp"
#include "train/rewards.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <thread>

#include "util/error.hpp"
#include "util/untrusted.hpp"

extern char** environ;

namespace lorarun::train {
namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kLongestAnswer = 1 << 20;  // bytes of one answer line: a number, with room to spare

// An answer line's number; NaN for `nan` / `null` (unscorable); nullopt when it is neither.
std::optional<double> answer(const std::string& line) {
  const std::string t(strip(line));
  if (t == "nan" || t == "NaN" || t == "null" || t == "None") return std::nan("");
  if (t.empty()) return std::nullopt;
  char* end = nullptr;
  const double v = std::strtod(t.c_str(), &end);
  if (end != t.c_str() + t.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

}  // namespace

RewardCommand::RewardCommand(std::vector<std::string> argv, double timeout_s, std::string where)
    : argv_(std::move(argv)), timeout_s_(timeout_s), where_(std::move(where)) {
  if (argv_.empty() || argv_[0].empty()) throw ConfigError(where_ + ": give the program to run: run: [program, args…]");
  if (!(timeout_s_ > 0)) throw ConfigError(fmt::format("{}: timeout_s must be > 0", where_));
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    throw Error(fmt::format("{}: socketpair: {}", where_, std::strerror(errno)));
  posix_spawn_file_actions_t files;
  posix_spawn_file_actions_init(&files);
  posix_spawn_file_actions_adddup2(&files, sv[1], 0);  // dup2 clears close-on-exec on 0 and 1
  posix_spawn_file_actions_adddup2(&files, sv[1], 1);
  posix_spawnattr_t attr;
  posix_spawnattr_init(&attr);
  sigset_t none, defaults;
  sigemptyset(&none);
  sigemptyset(&defaults);
  for (const int s : {SIGPIPE, SIGINT, SIGTERM}) sigaddset(&defaults, s);
  posix_spawnattr_setsigmask(&attr, &none);
  posix_spawnattr_setsigdefault(&attr, &defaults);
  // its own process group: what it starts (a shell's children) is killed with it, and none keeps
  // this process's stderr open after it (a log reader would wait for them)
  posix_spawnattr_setpgroup(&attr, 0);
  posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF | POSIX_SPAWN_SETPGROUP);
  std::vector<char*> args;
  for (std::string& a : argv_) args.push_back(a.data());
  args.push_back(nullptr);
  const int rc = posix_spawnp(&pid_, args[0], &files, &attr, args.data(), environ);
  posix_spawn_file_actions_destroy(&files);
  posix_spawnattr_destroy(&attr);
  close(sv[1]);
  if (rc != 0) {
    close(sv[0]);
    pid_ = -1;
    throw ConfigError(fmt::format("{}: cannot start '{}': {}", where_, printable(argv_[0]), std::strerror(rc)));
  }
  fd_ = sv[0];
  fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) | O_NONBLOCK);
}

RewardCommand::~RewardCommand() { stop(); }

void RewardCommand::stop() {
  if (pid_ > 0) {
    shutdown(fd_, SHUT_WR);  // end of its input
    const auto until = Clock::now() + std::chrono::seconds(2);
    int status = 0;
    while (waitpid(pid_, &status, WNOHANG) == 0) {
      if (Clock::now() > until) {
        kill(-pid_, SIGKILL);
        waitpid(pid_, &status, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    kill(-pid_, SIGKILL);  // anything of its group still running
    pid_ = -1;
  }
  if (fd_ >= 0) close(fd_);
  fd_ = -1;
}

void RewardCommand::fail(const std::string& what) {
  if (pid_ > 0) kill(-pid_, SIGKILL);
  stop();
  throw Error(fmt::format("{}: reward command '{}' {}", where_, printable(argv_[0]), what));
}

std::vector<double> RewardCommand::score(const std::vector<nlohmann::json>& items) {
  if (pid_ < 0) throw Error(fmt::format("{}: reward command '{}' is not running", where_, printable(argv_[0])));
  // Lines it wrote past the last batch's answers, which would answer this batch's first completions.
  for (char chunk[4096];;) {
    const ssize_t n = read(fd_, chunk, sizeof chunk);
    if (n <= 0) break;  // nothing waiting (or it is gone, which the loop below says)
    buffer_.append(chunk, static_cast<size_t>(n));
  }
  if (const auto extra = std::count(buffer_.begin(), buffer_.end(), '\n'); extra > 0)
    fail(fmt::format("answered more lines than the completions it was given ({} too many)", extra));
  std::string input;
  for (const auto& item : items) input += item.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
  std::vector<double> out;
  size_t written = 0;
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s_);
  const auto progress = [&] { return fmt::format("after {} of {} answers", out.size(), items.size()); };
  while (out.size() < items.size()) {
    // answers already read
    for (size_t nl; out.size() < items.size() && (nl = buffer_.find('\n')) != std::string::npos;) {
      const std::string line = buffer_.substr(0, nl);
      buffer_.erase(0, nl + 1);
      const auto v = answer(line);
      if (!v)
        fail(fmt::format("answered '{}' for completion {}: not a number; print one number a line (null: unscorable)",
                         printable(line, 40), out.size() + 1));
      out.push_back(*v);
    }
    if (out.size() == items.size()) break;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) fail(fmt::format("did not answer within {} s (timeout_s) {}; killed", timeout_s_, progress()));
    pollfd p{fd_, static_cast<short>(POLLIN | (written < input.size() ? POLLOUT : 0)), 0};
    if (poll(&p, 1, static_cast<int>(std::min<int64_t>(left, 1000))) < 0) {
      if (errno == EINTR) continue;
      fail(fmt::format("poll: {}", std::strerror(errno)));
    }
    if ((p.revents & POLLOUT) && written < input.size()) {
      const ssize_t n = send(fd_, input.data() + written, input.size() - written, MSG_NOSIGNAL);
      if (n > 0) written += static_cast<size_t>(n);  // an error: it is gone, which the read below says
    }
    if (p.revents & (POLLIN | POLLHUP | POLLERR)) {
      char chunk[65536];
      const ssize_t n = read(fd_, chunk, sizeof chunk);
      if (n > 0) {
        buffer_.append(chunk, static_cast<size_t>(n));
        if (buffer_.size() > kLongestAnswer && buffer_.find('\n') == std::string::npos)
          fail(fmt::format("wrote more than {} bytes without ending a line {}", kLongestAnswer, progress()));
      } else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
        int status = 0;
        pid_t ended = 0;
        std::string how = "closed its output";
        const auto until = Clock::now() + std::chrono::milliseconds(500);
        while ((ended = waitpid(pid_, &status, WNOHANG)) == 0 && Clock::now() < until)
          std::this_thread::sleep_for(std::chrono::milliseconds(10));
        if (ended == pid_) {
          how = WIFEXITED(status) ? fmt::format("exited with status {}", WEXITSTATUS(status))
                                  : fmt::format("was killed by signal {}", WTERMSIG(status));
          pid_ = -1;  // reaped
        }
        fail(fmt::format("{} {} (its stderr is in this rank's log)", how, progress()));
      }
    }
  }
  return out;
}

}  // namespace lorarun::train
