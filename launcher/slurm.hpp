// What a Slurm job tells lorarun about the node it runs on, read from SLURM_* variables
// (no scontrol), so `srun lorarun …` needs no --nnodes/--node-rank/--master-addr.
#pragma once
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lorarun::launch {

// "gpu[003-005,010],cpu1" -> gpu003 gpu004 gpu005 gpu010 cpu1 (zero padding kept; several
// bracket groups in one name expand as a product, as Slurm's hostlist does).
std::vector<std::string> expand_nodelist(std::string_view list);

struct SlurmNode {
  std::string job_id;      // SLURM_JOB_ID
  int nnodes = 1;          // SLURM_NNODES, or SLURM_JOB_NUM_NODES
  int node_rank = 0;       // SLURM_NODEID
  std::string first_host;  // first host of SLURM_JOB_NODELIST: node 0, where the master runs
};

// Reads a Slurm job's view of this node through `env` (a getenv: nullptr when unset).
// Empty when SLURM_JOB_ID is not set; throws lorarun::Error when a variable is malformed.
std::optional<SlurmNode> slurm_node(const std::function<const char*(const char*)>& env);

}  // namespace lorarun::launch
