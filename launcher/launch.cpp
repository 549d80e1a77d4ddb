#include "launch.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <poll.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <algorithm>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>

#include "util/error.hpp"

extern char** environ;

namespace lorarun::launch {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr size_t kTailLines = 10;    // lines of the failing rank shown in the summary
constexpr size_t kTailWidth = 2000;  // a longer line is cut there
constexpr int kExitResumable = 75;   // lora-train stopped with its state saved (EX_TEMPFAIL)

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("ended with status {}", status);
}

// What a rank's torchrun error file says: {"message": {"message": "...", "extraInfo": {...}}}, or
// {"message": "..."}. lora-train adds extraInfo.blamed_rank when another rank caused its error.
struct ErrorFile {
  std::string message;  // empty when the rank wrote none
  std::optional<int> blamed_rank;
  std::optional<std::chrono::nanoseconds> written;  // since the epoch: the file's modification time
};

ErrorFile read_error_file(const fs::path& path) {
  std::ifstream in(path);
  if (!in) return {};
  try {
    const nlohmann::json j = nlohmann::json::parse(in);
    const nlohmann::json& m = j.at("message");
    ErrorFile out;
    out.message = m.is_string() ? m.get<std::string>() : m.at("message").get<std::string>();
    if (m.contains("extraInfo") && m["extraInfo"].contains("blamed_rank"))
      out.blamed_rank = m["extraInfo"]["blamed_rank"].get<int>();
    if (struct stat st{}; stat(path.c_str(), &st) == 0)
      out.written = std::chrono::seconds(st.st_mtim.tv_sec) + std::chrono::nanoseconds(st.st_mtim.tv_nsec);
    return out;
  } catch (const std::exception&) {
    return {fmt::format("(unreadable error file {})", path.string()), {}, {}};
  }
}

struct FileCloser {
  void operator()(FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<FILE, FileCloser>;

// Relays one pipe line by line: to the console with the rank's prefix (unless redirected),
// to a log file (when redirected or teed), and into the rank's last-lines buffer.
struct LineRelay {
  int fd = -1;
  FILE* console = nullptr;
  File file;
  std::string prefix;
  std::deque<std::string>* tail = nullptr;
  std::string partial;

  void read_some() {
    char buf[65536];
    const ssize_t n = read(fd, buf, sizeof buf);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return;
    if (n <= 0) return close_and_flush();
    partial.append(buf, static_cast<size_t>(n));
    size_t start = 0;
    for (size_t nl; (nl = partial.find('\n', start)) != std::string::npos; start = nl + 1)
      emit(std::string_view(partial).substr(start, nl - start));
    partial.erase(0, start);
  }
  void close_and_flush() {
    if (!partial.empty()) emit(partial);
    partial.clear();
    if (fd >= 0) close(fd);
    fd = -1;
    file.reset();
  }
  void emit(std::string_view line) {
    if (console) {
      fmt::print(console, "{}{}\n", prefix, line);
      std::fflush(console);
    }
    if (file) {
      fmt::print(file.get(), "{}\n", line);
      std::fflush(file.get());  // current on disk even if lorarun is killed
    }
    tail->emplace_back(line.substr(0, kTailWidth));
    if (tail->size() > kTailLines) tail->pop_front();
  }
};

struct Worker {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  bool alive = false;
  bool signalled = false;  // lorarun sent it a stop signal while it ran
  int status = 0;
  std::chrono::nanoseconds ended{};  // since the epoch: when it was reaped
  fs::path dir;                      // DIR/<run_id>/attempt_<n>/<local_rank>: error.json, stdout.log, stderr.log
  std::deque<std::string> tail;
  LineRelay out, err;
};

struct Failure {
  int index;
  int status;
};

// NAME=value strings of our environment with `overrides` replacing same-named entries.
std::vector<std::string> merged_env(const std::vector<std::string>& overrides) {
  std::map<std::string, std::string> env;
  for (char** e = environ; *e; ++e) {
    std::string kv(*e);
    env[kv.substr(0, kv.find('='))] = kv;
  }
  for (const std::string& kv : overrides) env[kv.substr(0, kv.find('='))] = kv;
  std::vector<std::string> out;
  for (auto& [k, kv] : env) out.push_back(kv);
  return out;
}

std::vector<char*> c_strings(std::vector<std::string>& v) {
  std::vector<char*> out;
  for (std::string& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

bool writes_files(const Config& c) {
  auto any = [](const StdSpec& s) {
    if (s.all) return true;
    for (auto& [rank, bits] : s.per_rank)
      if (bits) return true;
    return false;
  };
  return any(c.redirects) || any(c.tee);
}

// Where the per-rank files go: --log-dir, or a temp dir (torchrun's torchelastic_* dir), which
// is removed at the end unless output was redirected into it.
class LogRoot {
 public:
  explicit LogRoot(const Config& c) : run_id_(c.run_id) {
    if (!c.log_dir.empty()) {
      base_ = c.log_dir;
      return;
    }
    const char* tmp = std::getenv("TMPDIR");
    std::string pattern = fmt::format("{}/lorarun_{}_XXXXXX", tmp && *tmp ? tmp : "/tmp", run_id_);
    if (!mkdtemp(pattern.data()))
      throw Error(fmt::format("cannot create a temp dir in {}: {} (set TMPDIR or pass --log-dir)",
                              tmp && *tmp ? tmp : "/tmp", std::strerror(errno)));
    base_ = pattern;
    remove_ = !writes_files(c);
    if (!remove_) fmt::print(stderr, "lorarun: redirected rank output goes to {}/{}\n", base_.string(), run_id_);
  }
  ~LogRoot() {
    std::error_code ec;
    if (remove_) fs::remove_all(base_, ec);
  }
  LogRoot(const LogRoot&) = delete;
  LogRoot& operator=(const LogRoot&) = delete;

  // A fresh directory for one rank of one attempt.
  fs::path rank_dir(int attempt, int local_rank) const {
    const fs::path dir = base_ / run_id_ / fmt::format("attempt_{}", attempt) / std::to_string(local_rank);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw Error(fmt::format("cannot create {}: {} (check --log-dir)", dir.string(), ec.message()));
    fs::remove(dir / "error.json", ec);  // a stale one from a run with the same id
    return dir;
  }
  bool temporary() const { return remove_; }

 private:
  std::string run_id_;
  fs::path base_;
  bool remove_ = false;
};

File open_log(const fs::path& path) {
  File f(std::fopen(path.c_str(), "we"));
  if (!f) throw Error(fmt::format("cannot write {}: {} (check --log-dir)", path.string(), std::strerror(errno)));
  return f;
}

class Supervisor {
 public:
  explicit Supervisor(const Config& c) : cfg_(c), logs_(c) {}

  int run() {
    block_signals();
    for (int attempt = 0;; ++attempt) {
      start_workers(attempt);
      loop();
      drain_signals();                    // a signal that came as the last rank ended still stops restarts
      if (first_failure_ || got_signal_)  // leave nothing behind that a rank started in its group
        for (const Worker& w : workers_)
          if (w.pid > 0) kill(-w.pid, SIGKILL);
      if (got_signal_ || !first_failure_ || attempt >= cfg_.max_restarts || !restartable()) break;
      announce_restart();
    }
    sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
    close(sfd_);
    return report();
  }

 private:
  void block_signals() {
    sigset_t set;
    sigemptyset(&set);
    for (int s : {SIGCHLD, SIGINT, SIGTERM, SIGHUP, SIGQUIT}) sigaddset(&set, s);
    sigprocmask(SIG_BLOCK, &set, &old_mask_);
    signal(SIGPIPE, SIG_IGN);
    sfd_ = signalfd(-1, &set, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sfd_ < 0) throw Error(fmt::format("signalfd failed: {}", std::strerror(errno)));
  }

  void start_workers(int attempt) {
    attempt_ = attempt;
    first_failure_.reset();
    kill_deadline_.reset();
    workers_.clear();
    workers_.resize(cfg_.nproc_per_node);  // never resized again this attempt: relays point into it
    std::vector<pid_t> pids;
    for (int lr = 0; lr < cfg_.nproc_per_node; ++lr) {
      Worker& w = workers_[lr];
      w.local_rank = lr;
      w.rank = cfg_.node_rank * cfg_.nproc_per_node + lr;
      w.dir = logs_.rank_dir(attempt, lr);
      spawn(w);
      pids.push_back(w.pid);
    }
    std::string where = cfg_.nnodes > 1 ? fmt::format(", node {} of {}", cfg_.node_rank, cfg_.nnodes) : "";
    if (attempt > 0) where += fmt::format(", restart {} of {}", attempt, cfg_.max_restarts);
    fmt::print(stderr, "lorarun: started {} rank(s) of world size {} (pids {}){}, master {}:{}, run {}\n",
               cfg_.nproc_per_node, cfg_.nproc_per_node * cfg_.nnodes, fmt::join(pids, " "), where, cfg_.master_addr,
               cfg_.master_port, cfg_.run_id);
    std::fflush(stderr);
  }

  // Pipes and log files first (an error then starts nothing), then the child.
  void spawn(Worker& w) {
    int out[2], err[2];
    if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0)
      throw Error(fmt::format("pipe failed: {}", std::strerror(errno)));
    attach(w.out, w, out[0], stdout, 1, "stdout.log");
    attach(w.err, w, err[0], stderr, 2, "stderr.log");
    std::vector<std::string> env =
        merged_env(worker_env(cfg_, w.local_rank, attempt_, (w.dir / "error.json").string()));
    // The MongoDB driver's shared-memory counters: a rank killed by a signal leaves its
    // /dev/shm/mongoc-<pid> behind, and a later process given that pid warns on stderr. The driver
    // reads this when the library loads, before lora-train's own code runs.
    if (std::none_of(env.begin(), env.end(),
                     [](const std::string& e) { return e.rfind("MONGOC_DISABLE_SHM=", 0) == 0; }))
      env.push_back("MONGOC_DISABLE_SHM=1");
    std::vector<std::string> argv = cfg_.command;
    auto envp = c_strings(env);
    auto argp = c_strings(argv);
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid < 0) throw Error(fmt::format("fork failed: {}", std::strerror(errno)));
    if (pid == 0) exec_worker(parent, out[1], err[1], argp, envp);
    setpgid(pid, pid);  // also done in the child; whichever runs first wins the race
    close(out[1]);
    close(err[1]);
    w.pid = pid;
    w.alive = true;
  }

  // torchrun's --redirects/--tee: a redirected stream goes to its file only, a teed one to its
  // file and the console, any other to the console only.
  void attach(LineRelay& r, Worker& w, int fd, FILE* console, int bit, const char* file_name) {
    const int redirect = cfg_.redirects.of(w.local_rank), tee = cfg_.tee.of(w.local_rank);
    r.fd = fd;
    r.console = (redirect & bit) && !(tee & bit) ? nullptr : console;
    if ((redirect | tee) & bit) r.file = open_log(w.dir / file_name);
    r.prefix = fmt::format("[rank{}]: ", w.rank);
    r.tail = &w.tail;
  }

  // In the child: own process group, die with the launcher, stdio to our pipes, exec.
  [[noreturn]] void exec_worker(pid_t parent, int out, int err, std::vector<char*>& argv, std::vector<char*>& envp) {
    sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
    signal(SIGPIPE, SIG_DFL);
    prctl(PR_SET_PDEATHSIG, SIGKILL);
    if (getppid() != parent) _exit(1);  // the launcher died before prctl took effect
    setpgid(0, 0);
    const int devnull = open("/dev/null", O_RDONLY);
    dup2(devnull, 0);
    dup2(out, 1);
    dup2(err, 2);
    execvpe(argv[0], argv.data(), envp.data());
    const std::string msg = fmt::format("lorarun: cannot run '{}': {}\n", argv[0], std::strerror(errno));
    (void)!write(2, msg.data(), msg.size());
    _exit(127);
  }

  int alive_count() const {
    int n = 0;
    for (const Worker& w : workers_) n += w.alive;
    return n;
  }

  void signal_all(int sig) {
    for (Worker& w : workers_)
      if (w.alive) {
        kill(-w.pid, sig);
        kill(w.pid, sig);
        // A stopped (SIGSTOP'ed) rank acts on SIGTERM only once it runs again, as systemd knows.
        if (sig != SIGKILL && sig != SIGCONT) kill(-w.pid, SIGCONT);
        w.signalled = true;
      }
  }

  void begin_stop(int sig) {
    signal_all(sig);
    if (!kill_deadline_) kill_deadline_ = Clock::now() + cfg_.grace;
  }

  void reap() {
    int status = 0;
    for (pid_t pid; (pid = waitpid(-1, &status, WNOHANG)) > 0;) {
      for (size_t i = 0; i < workers_.size(); ++i) {
        Worker& w = workers_[i];
        if (w.pid != pid) continue;
        w.alive = false;
        w.status = status;
        w.ended = std::chrono::system_clock::now().time_since_epoch();
        const bool ok = WIFEXITED(status) && WEXITSTATUS(status) == 0;
        if (!ok && !first_failure_ && !got_signal_) {
          first_failure_ = Failure{static_cast<int>(i), status};
          begin_stop(SIGTERM);
        }
      }
    }
  }

  void on_signal(int sig) {
    if (got_signal_) {  // a second Ctrl-C: no more patience
      signal_all(SIGKILL);
      return;
    }
    got_signal_ = sig;
    fmt::print(stderr, "lorarun: got SIG{}, stopping all ranks\n", sigabbrev_np(sig));
    begin_stop(sig == SIGINT || sig == SIGQUIT ? sig : SIGTERM);
  }

  // Relays output and handles signals until every rank has ended and its pipes are drained.
  void loop() {
    std::optional<Clock::time_point> drain_deadline;
    for (;;) {
      std::vector<pollfd> fds{{sfd_, POLLIN, 0}};
      std::vector<LineRelay*> relays;
      for (Worker& w : workers_)
        for (LineRelay* r : {&w.out, &w.err})
          if (r->fd >= 0) {
            fds.push_back({r->fd, POLLIN, 0});
            relays.push_back(r);
          }
      if (alive_count() == 0) {
        if (relays.empty()) return;
        // All ranks are gone but something they started still holds a pipe: give it a moment.
        if (!drain_deadline) drain_deadline = Clock::now() + std::chrono::milliseconds(500);
      }
      std::optional<Clock::time_point> wake = drain_deadline ? drain_deadline : kill_deadline_;
      int timeout = -1;
      if (wake)
        timeout = static_cast<int>(
            std::max<long>(0, std::chrono::duration_cast<std::chrono::milliseconds>(*wake - Clock::now()).count()));
      if (poll(fds.data(), fds.size(), timeout) < 0 && errno != EINTR)
        throw Error(fmt::format("poll failed: {}", std::strerror(errno)));
      for (size_t i = 1; i < fds.size(); ++i)
        if (fds[i].revents) relays[i - 1]->read_some();
      if (fds[0].revents & POLLIN) drain_signals();
      const auto now = Clock::now();
      if (kill_deadline_ && now >= *kill_deadline_) {
        signal_all(SIGKILL);
        kill_deadline_.reset();
      }
      if (drain_deadline && now >= *drain_deadline) {
        for (Worker& w : workers_) {
          w.out.close_and_flush();
          w.err.close_and_flush();
        }
        return;
      }
    }
  }

  void drain_signals() {
    signalfd_siginfo si;
    while (read(sfd_, &si, sizeof si) == sizeof si) {
      if (si.ssi_signo == SIGCHLD)
        reap();
      else
        on_signal(static_cast<int>(si.ssi_signo));
    }
    reap();
  }

  // The first failure is the one that happened first, not the first reaped: a stopped rank that
  // our SIGCONT lets go can end before the rank that found it stopped. A failure's time is when
  // its error file was written (or, without one, when it was reaped); an error that only lost an
  // unknown peer (blamed rank -1) is a consequence and gives way to any other. Called once every
  // rank has ended.
  void settle_first_failure() {
    std::optional<std::pair<bool, std::chrono::nanoseconds>> earliest;
    for (size_t i = 0; i < workers_.size(); ++i) {
      const Worker& w = workers_[i];
      if (w.alive || (WIFEXITED(w.status) && WEXITSTATUS(w.status) == 0)) continue;
      const ErrorFile error = read_error_file(w.dir / "error.json");
      const bool consequence = error.blamed_rank && *error.blamed_rank < 0;
      const std::pair<bool, std::chrono::nanoseconds> at{consequence, error.written.value_or(w.ended)};
      if (!earliest || at < *earliest) {
        earliest = at;
        first_failure_ = Failure{static_cast<int>(i), w.status};
      }
    }
  }

  // "rank 1 (local rank 1, pid 42)", or "rank 9" for a rank of another node.
  std::string who(int rank) const {
    for (const Worker& w : workers_)
      if (w.rank == rank) return fmt::format("rank {} (local rank {}, pid {})", w.rank, w.local_rank, w.pid);
    return fmt::format("rank {}", rank);
  }

  // "rank 1 (local rank 1, pid 42) failed first: exited with code 3", or when its error blames
  // another rank: "rank 2 timed out: detected by rank 1 (…), which failed first: exited with code 1".
  std::string first_failure_line(const ErrorFile& error) const {
    const Worker& w = workers_[first_failure_->index];
    const std::string status = describe_status(first_failure_->status);
    if (!error.blamed_rank || *error.blamed_rank < 0 || *error.blamed_rank == w.rank)  // < 0: a peer, unknown which
      return fmt::format("{} failed first: {}", who(w.rank), status);
    return fmt::format("{} timed out: detected by {}, which failed first: {}", who(*error.blamed_rank), who(w.rank),
                       status);
  }

  // A rank that failed for a reason running it again cannot change (a recipe error, an output
  // directory another run owns, a missing model) exits kExitConfig: no restart is spent on it.
  bool restartable() {
    settle_first_failure();
    const int st = first_failure_->status;
    if (!WIFEXITED(st) || WEXITSTATUS(st) != kExitConfig) return true;
    if (cfg_.max_restarts > 0)
      fmt::print(stderr, "lorarun: rank {} failed with an error a restart cannot change (exit {}): not restarting\n",
                 workers_[first_failure_->index].rank, kExitConfig);
    return false;
  }

  void announce_restart() {
    settle_first_failure();
    const Worker& w = workers_[first_failure_->index];
    const ErrorFile error = read_error_file(w.dir / "error.json");
    fmt::print(stderr, "lorarun: {}{}\n", first_failure_line(error),
               error.message.empty() ? "" : " (" + error.message + ")");
    fmt::print(stderr, "lorarun: restarting all {} rank(s) on this node (restart {} of {})\n", workers_.size(),
               attempt_ + 1, cfg_.max_restarts);
    std::fflush(stderr);
  }

  // One block on stderr: who failed first, how, its error file's message and its last lines.
  // Every message appears once: a line of the tail that is the error itself is left out, and
  // other ranks' errors only when they failed on their own with a different message.
  void print_summary() const {
    const Worker& w = workers_[first_failure_->index];
    const fs::path error_file = w.dir / "error.json";
    const ErrorFile error = read_error_file(error_file);
    const std::string& message = error.message;
    const std::string rule(64, '=');
    std::string out = fmt::format("lorarun: {}\nlorarun: run {} failed", rule, cfg_.run_id);
    if (cfg_.max_restarts > 0)
      out += fmt::format(" after {} restart(s) (--max-restarts {})", attempt_, cfg_.max_restarts);
    out += fmt::format("\nlorarun: {}\n", first_failure_line(error));
    if (!message.empty()) {
      out += fmt::format("lorarun:   error: {}\n", indent(message));
      if (!logs_.temporary()) out += fmt::format("lorarun:   error file: {}\n", error_file.string());
    }
    std::vector<std::string> tail;
    for (const std::string& line : w.tail)
      if (message.empty() || line != message.substr(0, message.find_last_not_of('\n') + 1)) tail.push_back(line);
    if (!tail.empty()) {
      out += fmt::format("lorarun:   last {} line(s) of rank {}:\n", tail.size(), w.rank);
      for (const std::string& line : tail) out += fmt::format("lorarun:     [rank{}]: {}\n", w.rank, line);
    }
    std::vector<std::string> seen{message};
    for (const Worker& other : workers_) {
      if (&other == &w || other.signalled || (WIFEXITED(other.status) && WEXITSTATUS(other.status) == 0)) continue;
      const ErrorFile e = read_error_file(other.dir / "error.json");
      const std::string& m = e.message;
      if (e.blamed_rank && (*e.blamed_rank < 0 || *e.blamed_rank == w.rank)) continue;  // a consequence of the above
      if (m.empty() || std::find(seen.begin(), seen.end(), m) != seen.end()) continue;
      seen.push_back(m);
      out += fmt::format("lorarun:   rank {} also failed: {}\n", other.rank, indent(m));
    }
    if (workers_.size() > 1)
      out += fmt::format("lorarun: stopped the other {} rank(s) on this node\n", workers_.size() - 1);
    fmt::print(stderr, "{}lorarun: {}\n", out, rule);
  }

  // A Python message may span lines: continue them under the first.
  static std::string indent(const std::string& message) {
    std::string indented = message.substr(0, message.find_last_not_of('\n') + 1);
    for (size_t at = 0; (at = indented.find('\n', at)) != std::string::npos; ++at)
      indented.replace(at, 1, "\nlorarun:          ");
    return indented;
  }

  // After SIGTERM/SIGINT: 75 (EX_TEMPFAIL) when every rank stopped with its state saved (exit 75)
  // or had finished (0), so a scheduler can requeue the job (scripts/slurm/lorarun.sbatch does);
  // 0 when all had finished; else 128 + the signal, as a process killed by it.
  int stopped_status() const {
    bool saved = false;
    for (const Worker& w : workers_) {
      const bool exited = WIFEXITED(w.status);
      if (!exited || (WEXITSTATUS(w.status) != 0 && WEXITSTATUS(w.status) != kExitResumable)) return 128 + got_signal_;
      saved |= WEXITSTATUS(w.status) == kExitResumable;
    }
    if (!saved) return 0;
    fmt::print(stderr,
               "lorarun: stopped on SIG{}: every rank saved its resumable state; the same command resumes (exit {})\n",
               sigabbrev_np(got_signal_), kExitResumable);
    return kExitResumable;
  }

  int report() {
    if (first_failure_) {
      settle_first_failure();
      print_summary();
      // 75 (EX_TEMPFAIL): the ranks agreed to stop with their resumable state saved (the data
      // went away, say); the same command continues, so say so in the exit status too.
      const int st = first_failure_->status;
      if (WIFEXITED(st) && (WEXITSTATUS(st) == kExitResumable || WEXITSTATUS(st) == kExitConfig))
        return WEXITSTATUS(st);
      return 1;
    }
    if (got_signal_) return stopped_status();
    if (attempt_ > 0) fmt::print(stderr, "lorarun: all ranks finished after {} restart(s)\n", attempt_);
    return 0;
  }

  const Config& cfg_;
  LogRoot logs_;
  std::vector<Worker> workers_;
  int attempt_ = 0;
  sigset_t old_mask_{};
  int sfd_ = -1;
  std::optional<Failure> first_failure_;
  int got_signal_ = 0;
  std::optional<Clock::time_point> kill_deadline_;
};

}  // namespace

std::vector<std::string> worker_env(const Config& c, int local_rank, int restart, const std::string& error_file) {
  const int world = c.nproc_per_node * c.nnodes;
  const int rank = c.node_rank * c.nproc_per_node + local_rank;
  std::vector<std::string> env = {
      fmt::format("RANK={}", rank),
      fmt::format("LOCAL_RANK={}", local_rank),
      fmt::format("WORLD_SIZE={}", world),
      fmt::format("LOCAL_WORLD_SIZE={}", c.nproc_per_node),
      fmt::format("GROUP_RANK={}", c.node_rank),
      fmt::format("GROUP_WORLD_SIZE={}", c.nnodes),
      fmt::format("ROLE_RANK={}", rank),
      fmt::format("ROLE_WORLD_SIZE={}", world),
      "ROLE_NAME=default",
      fmt::format("MASTER_ADDR={}", c.master_addr),
      fmt::format("MASTER_PORT={}", c.master_port),
      fmt::format("LORARUN_RDZV_TIMEOUT={}", c.rdzv_timeout_s),
      fmt::format("TORCHELASTIC_RESTART_COUNT={}", restart),
      fmt::format("TORCHELASTIC_MAX_RESTARTS={}", c.max_restarts),
      fmt::format("TORCHELASTIC_RUN_ID={}", c.run_id),
      "TORCHELASTIC_USE_AGENT_STORE=False",
      "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
  };
  if (!error_file.empty()) {
    env.push_back("TORCHELASTIC_ERROR_FILE=" + error_file);
    // lora-train then leaves its error line to the summary, which prints it once for all ranks.
    env.push_back("LORARUN_ERROR_SUMMARY=1");
  }
  // torchrun's default: one OpenMP thread per worker when several share a node.
  if (c.nproc_per_node > 1 && !std::getenv("OMP_NUM_THREADS")) env.push_back("OMP_NUM_THREADS=1");
  return env;
}

int run(const Config& c) { return Supervisor(c).run(); }

}  // namespace lorarun::launch
