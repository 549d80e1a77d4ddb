// lorarun's launcher: start one worker per local rank with torchrun's environment, relay
// their output line by line, stop them all as soon as one fails, and restart the group when
// asked to.
#pragma once
#include <chrono>
#include <map>
#include <string>
#include <vector>

namespace lorarun::launch {

// Which of a worker's streams a --redirects/--tee spec names: torchrun's "3" (every local
// rank) or "0:1,1:2" (per local rank). Bits: 1 stdout, 2 stderr.
struct StdSpec {
  int all = 0;
  std::map<int, int> per_rank;
  int of(int local_rank) const;
};
StdSpec parse_std_spec(const std::string& spec, const std::string& flag);

struct Config {
  int nproc_per_node = 1;
  int nproc_limit = 0;  // 0: 4 x this node's CPUs; --nproc-per-node above it is refused
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port (single node only)
  std::string run_id;
  int max_restarts = 0;
  int rdzv_timeout_s = 600;  // how long a rank waits for the master and the others (torchrun's join_timeout)
  std::string log_dir;       // empty: error files (and any redirected output) go to a temp dir
  StdSpec redirects;         // streams written to DIR/<run_id>/attempt_<n>/<local_rank>/ only
  StdSpec tee;               // streams written there and to the console
  std::chrono::milliseconds grace{30000};  // SIGTERM -> SIGKILL (torchrun waits 30 s too)
  std::vector<std::string> command;        // argv of every worker
};

// Parses lorarun's command line. `self` is the path of the running lorarun (to find
// lora-train beside it). Returns exit status >= 0 when it handled --help or an error itself.
// Under Slurm (SLURM_JOB_ID set), nodes, node rank, master and run id not given come from it.
struct Parsed {
  Config config;
  int exit_code = -1;
};
Parsed parse_args(int argc, char** argv, const std::string& self);

// The environment torchrun gives each worker, as NAME=value strings (added to the parent's).
// `restart` is TORCHELASTIC_RESTART_COUNT; `error_file` is TORCHELASTIC_ERROR_FILE (if any).
std::vector<std::string> worker_env(const Config& c, int local_rank, int restart = 0,
                                    const std::string& error_file = "");

// Runs the workers to completion, restarting the group up to c.max_restarts times (never after a
// rank's kExitConfig: a restart cannot change it). Returns 0 when every rank exited 0; 1 when a
// rank failed (75 or 78 when the first failure exited so); when lorarun itself got signal N, 75
// if every rank stopped with its state saved (exit 75), else 128+N.
int run(const Config& c);

}  // namespace lorarun::launch
