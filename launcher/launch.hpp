// lorarun's launcher: start one worker per local rank with torchrun's environment, relay
// their output line by line, and stop them all as soon as one fails.
#pragma once
#include <chrono>
#include <string>
#include <vector>

namespace lorarun::launch {

struct Config {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;  // 0: a free port (single node only)
  std::string run_id;
  std::chrono::milliseconds grace{15000};  // SIGTERM -> SIGKILL
  std::vector<std::string> command;        // argv of every worker
};

// Parses lorarun's command line. `self` is the path of the running lorarun (to find
// lora-train beside it). Returns exit status >= 0 when it handled --help or an error itself.
struct Parsed {
  Config config;
  int exit_code = -1;
};
Parsed parse_args(int argc, char** argv, const std::string& self);

// The environment torchrun gives each worker, as NAME=value strings (added to the parent's).
std::vector<std::string> worker_env(const Config& c, int local_rank);

// Runs the workers to completion. Returns 0 when every rank exited 0; 1 when a rank failed;
// 128+N when lorarun itself got signal N.
int run(const Config& c);

}  // namespace lorarun::launch
