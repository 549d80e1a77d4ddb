// Where this process sits in the job: read from torchrun's environment variables.
#pragma once
#include <string>

namespace lorarun::dist {

struct DistEnv {
  int rank = 0;
  int local_rank = 0;
  int world_size = 1;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 29500;  // 0: any free port (a world of one without MASTER_PORT)
  bool launched = false;    // true when RANK/WORLD_SIZE came from a launcher
  int rdzv_timeout_s = 0;   // how long to wait for the master and the other ranks; 0: the collective timeout
  int restart = 0;          // the launcher's restarts of the group so far (torchrun's TORCHELASTIC_RESTART_COUNT)

  // Reads RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT,
  // LORARUN_RDZV_TIMEOUT (seconds, from lorarun --rdzv-timeout) and TORCHELASTIC_RESTART_COUNT.
  // Without them: a standalone world of one. Throws lorarun::Error on inconsistent values.
  static DistEnv from_environment();
};

}  // namespace lorarun::dist
