#include "launch.hpp"

#include <CLI/CLI.hpp>
#include <arpa/inet.h>
#include <cerrno>
#include <csignal>
#include <cstring>
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <map>
#include <netinet/in.h>
#include <optional>
#include <poll.h>
#include <random>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

#include "util/error.hpp"

extern char** environ;

namespace lorarun::launch {
namespace {

using Clock = std::chrono::steady_clock;

int count_gpus() {
  int n = 0;
  for (int i = 0; i < 256; ++i)
    if (access(fmt::format("/dev/nvidia{}", i).c_str(), F_OK) == 0) ++n;
  return n;
}

// A port nobody listens on right now (the same trick torchrun's --standalone uses).
int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) throw Error(fmt::format("cannot create a socket: {}", std::strerror(errno)));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0 ||
      getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) != 0) {
    close(fd);
    throw Error("cannot find a free port: pass --master-port");
  }
  close(fd);
  return ntohs(addr.sin_port);
}

std::string random_id() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}", rd(), rd());
}

bool is_recipe(const std::string& arg) {
  auto ends = [&](std::string_view s) {
    return arg.size() >= s.size() && arg.compare(arg.size() - s.size(), s.size(), s) == 0;
  };
  return ends(".yaml") || ends(".yml");
}

std::string describe_status(int status) {
  if (WIFEXITED(status)) return fmt::format("exited with code {}", WEXITSTATUS(status));
  if (WIFSIGNALED(status))
    return fmt::format("was killed by signal {} ({})", WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format("ended with status {}", status);
}

// Relays one pipe to one of our streams, prefixing every complete line.
struct LineRelay {
  int fd = -1;
  FILE* sink = nullptr;
  std::string prefix;
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
  }
  void emit(std::string_view line) {
    fmt::print(sink, "{}{}\n", prefix, line);
    std::fflush(sink);
  }
};

struct Worker {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  bool alive = false;
  int status = 0;
  LineRelay out, err;
};

struct Failure {
  int index;
  int status;
};

// NAME=value strings of `base` with `overrides` replacing same-named entries.
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

class Supervisor {
 public:
  explicit Supervisor(const Config& c) : cfg_(c) {}

  int run() {
    block_signals();
    start_workers();
    loop();
    sigprocmask(SIG_SETMASK, &old_mask_, nullptr);
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

  void start_workers() {
    const pid_t self = getpid();
    workers_.resize(cfg_.nproc_per_node);
    std::vector<pid_t> pids;
    for (int lr = 0; lr < cfg_.nproc_per_node; ++lr) {
      Worker& w = workers_[lr];
      w.local_rank = lr;
      w.rank = cfg_.node_rank * cfg_.nproc_per_node + lr;
      int out[2], err[2];
      if (pipe2(out, O_CLOEXEC) != 0 || pipe2(err, O_CLOEXEC) != 0)
        throw Error(fmt::format("pipe failed: {}", std::strerror(errno)));
      std::vector<std::string> env = merged_env(worker_env(cfg_, lr));
      std::vector<std::string> argv = cfg_.command;
      auto envp = c_strings(env);
      auto argp = c_strings(argv);
      const pid_t pid = fork();
      if (pid < 0) throw Error(fmt::format("fork failed: {}", std::strerror(errno)));
      if (pid == 0) exec_worker(self, out[1], err[1], argp, envp);
      setpgid(pid, pid);  // also done in the child; whichever runs first wins the race
      close(out[1]);
      close(err[1]);
      const std::string prefix = fmt::format("[rank{}]: ", w.rank);
      w.pid = pid;
      w.alive = true;
      w.out = {out[0], stdout, prefix, {}};
      w.err = {err[0], stderr, prefix, {}};
      pids.push_back(pid);
    }
    fmt::print(stderr, "lorarun: started {} rank(s) of world size {} (pids {}), master {}:{}\n",
               cfg_.nproc_per_node, cfg_.nproc_per_node * cfg_.nnodes, fmt::join(pids, " "),
               cfg_.master_addr, cfg_.master_port);
    std::fflush(stderr);
  }

  // In the child: own process group, die with the launcher, stdio to our pipes, exec.
  [[noreturn]] void exec_worker(pid_t parent, int out, int err, std::vector<char*>& argv,
                                std::vector<char*>& envp) {
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
    for (const Worker& w : workers_)
      if (w.alive) {
        kill(-w.pid, sig);
        kill(w.pid, sig);
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
        timeout = static_cast<int>(std::max<long>(0, std::chrono::duration_cast<std::chrono::milliseconds>(
                                                         *wake - Clock::now()).count()));
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

  int report() {
    const bool stopped = first_failure_ || got_signal_;
    if (stopped)  // leave nothing behind that a rank started in its process group
      for (const Worker& w : workers_) kill(-w.pid, SIGKILL);
    close(sfd_);
    if (first_failure_) {
      const Worker& w = workers_[first_failure_->index];
      fmt::print(stderr, "lorarun: rank {} (local rank {}, pid {}) failed first: {}\n", w.rank,
                 w.local_rank, w.pid, describe_status(first_failure_->status));
      if (workers_.size() > 1)
        fmt::print(stderr, "lorarun: stopped the other {} rank(s) on this node\n", workers_.size() - 1);
      return 1;
    }
    if (got_signal_) return 128 + got_signal_;
    return 0;
  }

  const Config& cfg_;
  std::vector<Worker> workers_;
  sigset_t old_mask_{};
  int sfd_ = -1;
  std::optional<Failure> first_failure_;
  int got_signal_ = 0;
  std::optional<Clock::time_point> kill_deadline_;
};

}  // namespace

Parsed parse_args(int argc, char** argv, const std::string& self) {
  CLI::App app{"lorarun: start one lora-train (or any command) per GPU/CPU slot, torchrun-style.\n"
               "  lorarun [options] RECIPE.yaml [key=value ...]\n"
               "  lorarun [options] -- COMMAND [ARGS ...]"};
  app.prefix_command();
  Config c;
  std::string nproc = "1";
  double grace_s = 15;
  bool standalone = false;
  app.add_option("--nproc-per-node,--nproc_per_node", nproc, "workers on this node: N or auto");
  app.add_option("--nnodes", c.nnodes, "number of nodes")->check(CLI::Range(1, 100000));
  app.add_option("--node-rank,--node_rank", c.node_rank, "rank of this node")->check(CLI::NonNegativeNumber);
  app.add_option("--master-addr,--master_addr", c.master_addr, "address of rank 0's node");
  app.add_option("--master-port,--master_port", c.master_port,
                 "rendezvous port (default: a free port on one node, 29500 on several)")
      ->check(CLI::Range(1, 65535));
  app.add_flag("--standalone", standalone, "single node, free port, local master");
  app.add_option("--run-id,--rdzv-id", c.run_id, "job id given to workers as TORCHELASTIC_RUN_ID");
  app.add_option("--grace-period", grace_s, "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(CLI::Range(0.0, 3600.0));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return {c, app.exit(e)};
  }
  if (nproc == "auto") {
    const int gpus = count_gpus();
    c.nproc_per_node = gpus > 0 ? gpus : static_cast<int>(std::thread::hardware_concurrency());
  } else {
    try {
      size_t used = 0;
      c.nproc_per_node = std::stoi(nproc, &used);
      if (used != nproc.size() || c.nproc_per_node < 1) throw std::invalid_argument(nproc);
    } catch (const std::exception&) {
      throw Error(fmt::format("--nproc-per-node '{}' is not a positive integer or 'auto'", nproc));
    }
  }
  if (c.node_rank >= c.nnodes)
    throw Error(fmt::format("--node-rank {} must be below --nnodes {}", c.node_rank, c.nnodes));
  if (standalone) {
    if (c.nnodes != 1) throw Error("--standalone runs on one node: drop --nnodes or --standalone");
    c.master_addr = "127.0.0.1";
  }
  if (c.master_port == 0) c.master_port = c.nnodes == 1 ? free_port() : 29500;
  if (c.run_id.empty()) c.run_id = random_id();
  c.grace = std::chrono::milliseconds(static_cast<long>(grace_s * 1000));

  std::vector<std::string> rest = app.remaining();
  if (!rest.empty() && rest.front() == "--") rest.erase(rest.begin());
  if (rest.empty())
    throw Error("nothing to run: give a recipe (lorarun --nproc-per-node 2 RECIPE.yaml) or a "
                "command after -- (lorarun --nproc-per-node 2 -- CMD ARGS)");
  if (is_recipe(rest.front())) {
    const std::string dir = self.substr(0, self.rfind('/') + 1);
    const std::string beside = dir + "lora-train";
    rest.insert(rest.begin(), access(beside.c_str(), X_OK) == 0 ? beside : "lora-train");
  }
  c.command = rest;
  return {c, -1};
}

std::vector<std::string> worker_env(const Config& c, int local_rank) {
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
      "TORCHELASTIC_RESTART_COUNT=0",
      "TORCHELASTIC_MAX_RESTARTS=0",
      fmt::format("TORCHELASTIC_RUN_ID={}", c.run_id),
      "TORCHELASTIC_USE_AGENT_STORE=False",
      "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
  };
  // torchrun's default: one OpenMP thread per worker when several share a node.
  if (c.nproc_per_node > 1 && !std::getenv("OMP_NUM_THREADS")) env.push_back("OMP_NUM_THREADS=1");
  return env;
}

int run(const Config& c) { return Supervisor(c).run(); }

}  // namespace lorarun::launch
