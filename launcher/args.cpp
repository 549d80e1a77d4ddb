// lorarun's command line: torchrun's flags, Slurm's defaults, and the worker command.
#include <arpa/inet.h>
#include <fmt/format.h>
#include <netinet/in.h>
#include <sched.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>
#include <yaml-cpp/yaml.h>
#include <CLI/CLI.hpp>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <fstream>
#include <random>
#include <thread>

#include "launch.hpp"
#include "slurm.hpp"
#include "util/error.hpp"
#include "util/untrusted.hpp"

namespace lorarun::launch {
namespace {

// GPUs torch would see: /dev/nvidiaN, narrowed by CUDA_VISIBLE_DEVICES when it is set.
int count_gpus() {
  int n = 0;
  for (int i = 0; i < 256; ++i)
    if (access(fmt::format("/dev/nvidia{}", i).c_str(), F_OK) == 0) ++n;
  const char* visible = std::getenv("CUDA_VISIBLE_DEVICES");
  if (n == 0 || !visible) return n;
  int listed = 0;
  for (std::string_view v(visible); !v.empty();) {
    const size_t comma = v.find(',');
    listed += !v.substr(0, comma).empty();
    v = comma == std::string_view::npos ? std::string_view() : v.substr(comma + 1);
  }
  return std::min(n, listed);
}

// The CPUs this process may run on (its affinity: what taskset, cgroups' cpusets and Slurm's task
// binding leave it), narrowed by Slurm's SLURM_CPUS_PER_TASK when the job step sets it.
int cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  int n = sched_getaffinity(0, sizeof set, &set) == 0 ? CPU_COUNT(&set) : 0;
  if (n <= 0) n = static_cast<int>(std::thread::hardware_concurrency());
  if (const char* per_task = std::getenv("SLURM_CPUS_PER_TASK"); per_task && *per_task) {
    const int slurm = std::atoi(per_task);
    if (slurm > 0) n = std::min(n, slurm);
  }
  return std::max(1, n);
}

// torchrun's `auto`: one worker per GPU, else one per CPU; `gpu`: one per GPU (there must be one);
// `cpu`: one per CPU.
int parse_nproc(const std::string& nproc) {
  if (nproc == "auto") {
    const int gpus = count_gpus();
    return gpus > 0 ? gpus : cpu_count();
  }
  if (nproc == "cpu") return cpu_count();
  if (nproc == "gpu") {
    const int gpus = count_gpus();
    if (gpus == 0) throw Error("--nproc-per-node gpu, but no GPU is visible here: give a number, or auto or cpu");
    return gpus;
  }
  int n = 0;
  const auto [end, ec] = std::from_chars(nproc.data(), nproc.data() + nproc.size(), n);
  if (ec != std::errc() || end != nproc.data() + nproc.size() || n < 1)
    throw Error(fmt::format("--nproc-per-node '{}' is not a positive integer, auto, gpu or cpu", nproc));
  return n;
}

// A whole number from `lo` to `hi` given as `flag` (or its PET_ variable `env`), or one line naming
// both and the range (the value escaped and cut: it may be a variable's whatever).
int whole_number(const std::string& text, std::string_view flag, std::string_view env, int lo, int hi) {
  int n = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), n);
  if (ec != std::errc() || end != text.data() + text.size() || n < lo || n > hi)
    throw Error(
        fmt::format("{} (or {}) '{}' is not a whole number from {} to {}", flag, env, printable(text, 40), lo, hi));
  return n;
}

// --nnodes N, or torchrun's MIN:MAX with MIN = MAX (a fixed world: Kubeflow writes PET_NNODES so).
int parse_nnodes(const std::string& text) {
  const size_t colon = text.find(':');
  const auto number = [&](std::string_view s) {
    int n = 0;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), n);
    if (ec != std::errc() || end != s.data() + s.size() || n < 1 || n > 100000)
      throw Error(fmt::format("--nnodes (or PET_NNODES) '{}' is not a number of nodes from 1 to 100000", text));
    return n;
  };
  const int lo = number(std::string_view(text).substr(0, colon));
  if (colon != std::string::npos && number(std::string_view(text).substr(colon + 1)) != lo)
    throw Error(
        fmt::format("--nnodes (or PET_NNODES) '{}' asks for an elastic world of MIN:MAX nodes: lorarun runs a "
                    "fixed one; give one number, or MIN equal to MAX",
                    text));
  return lo;
}

// --rdzv-endpoint HOST[:PORT]: the master's address and port, where those flags are not given.
void apply_endpoint(Config& c, const std::string& endpoint, bool addr_given, bool port_given) {
  const size_t colon = endpoint.rfind(':');
  const bool has_port = colon != std::string::npos && endpoint.find(']', colon) == std::string::npos;
  const std::string host = has_port ? endpoint.substr(0, colon) : endpoint;
  if (host.empty()) throw Error(fmt::format("--rdzv-endpoint (or PET_RDZV_ENDPOINT) '{}' names no host", endpoint));
  if (!addr_given) c.master_addr = host;
  if (!has_port || port_given) return;
  const std::string port = endpoint.substr(colon + 1);
  int p = 0;
  const auto [end, ec] = std::from_chars(port.data(), port.data() + port.size(), p);
  if (ec != std::errc() || end != port.data() + port.size() || p < 1 || p > 65535)
    throw Error(fmt::format("--rdzv-endpoint (or PET_RDZV_ENDPOINT) '{}': the port is not 1-65535", endpoint));
  c.master_port = p;
}

// More ranks than 4 per CPU is a typo far more often than a plan: it takes --nproc-limit.
void check_nproc(const Config& c, bool limit_given) {
  const int limit = limit_given ? c.nproc_limit : 4 * cpu_count();
  if (c.nproc_per_node > limit)
    throw Error(limit_given
                    ? fmt::format("--nproc-per-node {} is above --nproc-limit {}: raise --nproc-limit to "
                                  "start that many ranks",
                                  c.nproc_per_node, limit)
                    : fmt::format("--nproc-per-node {} is above the limit of {} (4 per CPU, {} CPUs here): pass "
                                  "--nproc-limit {} to start that many ranks anyway",
                                  c.nproc_per_node, limit, cpu_count(), c.nproc_per_node));
  if (static_cast<long long>(c.nproc_per_node) * c.nnodes > (1 << 24))
    throw Error(fmt::format("--nproc-per-node {} x --nnodes {} is more ranks than lorarun supports ({})",
                            c.nproc_per_node, c.nnodes, 1 << 24));
}

// torchrun's --rdzv-conf "key=value,...": join_timeout is the rendezvous timeout; the other keys
// torchrun knows do not apply to a static rendezvous and are ignored with a warning.
void apply_rdzv_conf(Config& c, const std::string& conf) {
  for (std::string_view rest(conf); !rest.empty();) {
    const size_t comma = rest.find(',');
    const std::string_view kv = rest.substr(0, comma);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
    const size_t eq = kv.find('=');
    const std::string_view key = kv.substr(0, eq);
    const std::string_view value = eq == std::string_view::npos ? std::string_view() : kv.substr(eq + 1);
    if (key == "join_timeout") {
      int s = 0;
      const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), s);
      if (ec != std::errc() || end != value.data() + value.size() || s < 1)
        throw Error(
            fmt::format("--rdzv-conf '{}': join_timeout must be a whole number of seconds, at least 1 "
                        "(or use --rdzv-timeout SECONDS)",
                        conf));
      c.rdzv_timeout_s = s;
    } else if (eq == std::string_view::npos || key.empty()) {
      throw Error(fmt::format("--rdzv-conf '{}': use key=value pairs, e.g. join_timeout=300", conf));
    } else {
      fmt::print(stderr, "lorarun: warning: --rdzv-conf {} is ignored (only join_timeout applies here)\n", key);
    }
  }
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

bool has_yaml_extension(const std::string& arg) {
  auto ends = [&](std::string_view s) {
    return arg.size() >= s.size() && arg.compare(arg.size() - s.size(), s.size(), s) == 0;
  };
  return ends(".yaml") || ends(".yml");
}

// An executable file that is not a script or a program but a YAML mapping: a recipe someone
// made executable.
bool holds_yaml_mapping(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::string head(1 << 20, '\0');
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  head.resize(static_cast<size_t>(in.gcount()));
  if (head.starts_with("#!") ||
      head.starts_with("\x7f"
                       "ELF") ||
      head.find('\0') != std::string::npos)
    return false;
  try {
    return YAML::Load(head).IsMap();
  } catch (const std::exception&) {
    return false;
  }
}

bool on_path(const std::string& name) {
  const char* path = std::getenv("PATH");
  for (std::string_view dirs(path ? path : ""); !dirs.empty();) {
    const size_t colon = dirs.find(':');
    const std::string dir(dirs.substr(0, colon));
    dirs = colon == std::string_view::npos ? std::string_view() : dirs.substr(colon + 1);
    struct stat st{};
    const std::string file = (dir.empty() ? "." : dir) + "/" + name;
    if (stat(file.c_str(), &st) == 0 && S_ISREG(st.st_mode) && access(file.c_str(), X_OK) == 0) return true;
  }
  return false;
}

// Whether the first argument (without --) is a recipe for lora-train or a command to run: a
// .yaml/.yml name is a recipe; so is an existing file that is not executable, or that holds a
// YAML mapping; another existing file, or a name found on PATH, is a command. Anything else is
// an error here rather than one failed rank per slot.
bool is_recipe(const std::string& arg) {
  if (has_yaml_extension(arg)) return true;
  struct stat st{};
  if (stat(arg.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode))
      throw Error(
          fmt::format("'{}' is a directory: give a recipe file (lorarun RECIPE.yaml) or a command after -- "
                      "(lorarun -- CMD ARGS)",
                      arg));
    return access(arg.c_str(), X_OK) != 0 || holds_yaml_mapping(arg);
  }
  if (arg.find('/') == std::string::npos && on_path(arg)) return false;
  for (const char* ext : {".yaml", ".yml"})
    if (access((arg + ext).c_str(), F_OK) == 0)
      throw Error(fmt::format("'{}' does not exist: did you mean the recipe {}{}?", arg, arg, ext));
  throw Error(
      fmt::format("'{}' is neither a file nor a command on PATH: give a recipe file (lorarun RECIPE.yaml) or "
                  "a command after -- (lorarun -- CMD ARGS)",
                  arg));
}

// Flags the user gave; Slurm only fills in the others.
struct Given {
  bool nnodes, node_rank, master_addr, run_id;
};

void apply_slurm(Config& c, const Given& given) {
  const auto node = slurm_node([](const char* name) { return std::getenv(name); });
  if (!node) return;
  if (!given.nnodes) c.nnodes = node->nnodes;
  if (!given.node_rank) c.node_rank = node->node_rank;
  if (!given.master_addr && !node->first_host.empty()) c.master_addr = node->first_host;
  if (!given.run_id) c.run_id = node->job_id;
}

// The worker argv: `-- CMD ARGS`, or lora-train (beside lorarun) for a recipe or --from-run.
std::vector<std::string> worker_command(std::vector<std::string> rest, const std::string& from_run,
                                        const std::string& self) {
  const bool explicit_cmd = !rest.empty() && rest.front() == "--";
  if (explicit_cmd) rest.erase(rest.begin());
  if (rest.empty() && (explicit_cmd || from_run.empty()))
    throw Error(
        "nothing to run: give a recipe (lorarun --nproc-per-node 2 RECIPE.yaml) or a "
        "command after -- (lorarun --nproc-per-node 2 -- CMD ARGS)");
  if (!explicit_cmd && from_run.empty() && rest.front().starts_with('-'))
    throw Error(
        fmt::format("unknown lorarun flag '{}': see lorarun --help (a command's own flags go "
                    "after --: lorarun -- CMD ARGS)",
                    rest.front()));
  if (!explicit_cmd && (!from_run.empty() || is_recipe(rest.front()))) {
    const std::string beside = self.substr(0, self.rfind('/') + 1) + "lora-train";
    rest.insert(rest.begin(), access(beside.c_str(), X_OK) == 0 ? beside : "lora-train");
  }
  if (!from_run.empty()) rest.insert(rest.begin() + 1, {"--from-run", from_run});
  return rest;
}

}  // namespace

int StdSpec::of(int local_rank) const {
  const auto it = per_rank.find(local_rank);
  return it == per_rank.end() ? all : it->second;
}

StdSpec parse_std_spec(const std::string& spec, const std::string& flag) {
  // A number in [0, max]; anything else is the one error below.
  auto number = [&](std::string_view s, int max) {
    int v = -1;
    const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
    if (ec != std::errc() || end != s.data() + s.size() || v < 0 || v > max)
      throw Error(
          fmt::format("{} '{}': use 0-3 (1 stdout, 2 stderr, 3 both) for every rank, or "
                      "LOCAL_RANK:VALUE pairs like 0:3,1:2",
                      flag, spec));
    return v;
  };
  StdSpec out;
  if (spec.find(':') == std::string::npos) {
    out.all = number(spec, 3);
    return out;
  }
  for (std::string_view rest(spec); !rest.empty();) {
    const size_t comma = rest.find(',');
    const std::string_view pair = rest.substr(0, comma);
    const size_t colon = pair.find(':');
    const int local_rank = number(pair.substr(0, colon), 1 << 20);
    out.per_rank[local_rank] = number(colon == std::string_view::npos ? "" : pair.substr(colon + 1), 3);
    rest = comma == std::string_view::npos ? std::string_view() : rest.substr(comma + 1);
  }
  return out;
}

Parsed parse_args(int argc, char** argv, const std::string& self) {
  CLI::App app{
      "lorarun: start one lora-train (or any command) per GPU/CPU slot, torchrun-style.\n"
      "  lorarun [options] RECIPE.yaml [key=value ...]\n"
      "  lorarun [options] --from-run DATABASE/ID [key=value ...]\n"
      "  lorarun [options] -- COMMAND [ARGS ...]"};
  app.prefix_command();
  Config c;
  std::string nproc = "1", nnodes_text = "1", redirects = "0", tee = "0", from_run, rdzv_conf, rdzv_endpoint;
  std::string node_rank_text, master_port_text, max_restarts_text;  // (parsed below: messages name PET_*)
  double grace_s = 30;
  bool standalone = false;
  // Each flag torchrun has also comes from PET_<FLAG> when not given, as torchrun reads it (Kubeflow's
  // PyTorchJob and TrainJob start a launcher so); flags given win, and PET_* win over Slurm's.
  app.add_option("--nproc-per-node,--nproc_per_node", nproc,
                 "workers on this node: N, auto (GPUs, else CPUs), gpu or cpu")
      ->envname("PET_NPROC_PER_NODE");
  auto* nproc_limit =
      app.add_option("--nproc-limit", c.nproc_limit, "most workers --nproc-per-node may start (default: 4 per CPU)")
          ->check(CLI::Range(1, 1 << 24));
  auto* nnodes = app.add_option("--nnodes", nnodes_text, "number of nodes: N (or torchrun's MIN:MAX with MIN = MAX)")
                     ->envname("PET_NNODES");
  auto* node_rank =
      app.add_option("--node-rank,--node_rank", node_rank_text, "rank of this node")->envname("PET_NODE_RANK");
  auto* master_addr =
      app.add_option("--master-addr,--master_addr", c.master_addr, "address of node 0")->envname("PET_MASTER_ADDR");
  auto* master_port = app.add_option("--master-port,--master_port", master_port_text,
                                     "rendezvous port (default: a free port on one node, 29500 on several)")
                          ->envname("PET_MASTER_PORT");
  app.add_option("--rdzv-endpoint,--rdzv_endpoint", rdzv_endpoint,
                 "HOST[:PORT] of the rendezvous: torchrun's form of --master-addr and --master-port")
      ->envname("PET_RDZV_ENDPOINT");
  auto* rdzv_timeout = app.add_option("--rdzv-timeout,--rdzv_timeout", c.rdzv_timeout_s,
                                      "seconds a rank waits for the master and the other ranks to join (default 600)")
                           ->check(CLI::Range(1, 86400));
  app.add_option("--rdzv-conf,--rdzv_conf", rdzv_conf, "torchrun's rendezvous options: join_timeout=SECONDS")
      ->envname("PET_RDZV_CONF");
  app.add_flag("--standalone", standalone, "single node, free port, local master");
  auto* run_id = app.add_option("--run-id,--rdzv-id,--rdzv_id", c.run_id,
                                "job id given to workers as TORCHELASTIC_RUN_ID (default: SLURM_JOB_ID or random)")
                     ->envname("PET_RDZV_ID");
  app.add_option("--max-restarts,--max_restarts", max_restarts_text,
                 "restart the whole group up to N times when a rank fails")
      ->envname("PET_MAX_RESTARTS");
  app.add_option("--log-dir,--log_dir", c.log_dir, "per-rank files go to DIR/RUN_ID/attempt_N/LOCAL_RANK/")
      ->envname("PET_LOG_DIR");
  app.add_option("-r,--redirects", redirects, "streams written only to the log files: 0-3 or 0:1,1:2 (1 out, 2 err)")
      ->envname("PET_REDIRECTS");
  app.add_option("-t,--tee", tee, "streams written to the log files and the console (as --redirects)")
      ->envname("PET_TEE");
  app.add_option("--from-run", from_run, "repeat a recorded run (DATABASE/ID): passed to every lora-train rank");
  app.add_option("--grace-period", grace_s, "seconds between SIGTERM and SIGKILL when stopping ranks")
      ->check(CLI::Range(0.0, 3600.0));
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return {c, app.exit(e)};
  }
  c.nproc_per_node = parse_nproc(nproc);
  c.nnodes = parse_nnodes(nnodes_text);
  if (!node_rank_text.empty()) c.node_rank = whole_number(node_rank_text, "--node-rank", "PET_NODE_RANK", 0, 99999);
  if (!master_port_text.empty())
    c.master_port = whole_number(master_port_text, "--master-port", "PET_MASTER_PORT", 1, 65535);
  if (!max_restarts_text.empty())
    c.max_restarts = whole_number(max_restarts_text, "--max-restarts", "PET_MAX_RESTARTS", 0, 1000000);
  if (!rdzv_endpoint.empty()) apply_endpoint(c, rdzv_endpoint, master_addr->count() > 0, master_port->count() > 0);
  if (!rdzv_conf.empty()) {
    const int flag = c.rdzv_timeout_s;
    apply_rdzv_conf(c, rdzv_conf);
    if (rdzv_timeout->count() > 0) c.rdzv_timeout_s = flag;  // --rdzv-timeout wins
  }
  c.redirects = parse_std_spec(redirects, "--redirects");
  c.tee = parse_std_spec(tee, "--tee");
  if (standalone) {
    if (c.nnodes != 1) throw Error("--standalone runs on one node: drop --nnodes or --standalone");
    c.master_addr = "127.0.0.1";
  } else {
    apply_slurm(c, {nnodes->count() > 0, node_rank->count() > 0, master_addr->count() > 0 || !rdzv_endpoint.empty(),
                    run_id->count() > 0});
  }
  if (c.nnodes < 1) throw Error(fmt::format("--nnodes {} must be at least 1", c.nnodes));
  if (c.node_rank >= c.nnodes)
    throw Error(fmt::format("--node-rank {} must be below --nnodes {}", c.node_rank, c.nnodes));
  check_nproc(c, nproc_limit->count() > 0);
  if (c.master_port == 0) c.master_port = c.nnodes == 1 ? free_port() : 29500;
  if (c.run_id.empty()) c.run_id = random_id();
  if (c.run_id.find('/') != std::string::npos || c.run_id == "." || c.run_id == "..")
    throw Error(fmt::format("--run-id '{}' names a directory under --log-dir: use no '/'", c.run_id));
  c.grace = std::chrono::milliseconds(static_cast<long>(grace_s * 1000));
  c.command = worker_command(app.remaining(), from_run, self);
  return {c, -1};
}

}  // namespace lorarun::launch
