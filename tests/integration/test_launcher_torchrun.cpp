// lorarun's torchrun parity: several nodes, restarts, error files, log files, environment, Slurm.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <csignal>
#include <filesystem>
#include <fstream>

#include "support/process.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;

namespace {

// Writes an executable shell script and returns its path.
std::string script(const std::string& dir, const std::string& name, const std::string& body) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << "#!/bin/sh\n" << body;
  std::filesystem::permissions(path, std::filesystem::perms::owner_all);
  return path;
}

// The launcher's failure summary: everything from its first "lorarun: ====" rule on.
std::string summary(const std::string& output) {
  const size_t at = output.find("lorarun: ====");
  return at == std::string::npos ? std::string() : output.substr(at);
}

// Runs two lorarun "nodes" on this machine (node 1 in the background); the output is node 0's,
// then node 1's, then "statuses S0 S1".
Result two_nodes(const std::string& dir, const std::string& node0, const std::string& node1) {
  return sh(
      fmt::format("{{ ( {n1} > '{d}/node1' 2>&1; echo $? > '{d}/status1' ) & {n0}; s0=$?; wait; "
                  "cat '{d}/node1'; echo \"statuses $s0 $(cat '{d}/status1')\"; }}",
                  fmt::arg("n0", node0), fmt::arg("n1", node1), fmt::arg("d", dir)));
}

void check_world(const Result& r, int world) {
  INFO(r.output);
  CHECK_THAT(r.output, Catch::Contains("statuses 0 0"));
  const double sum = world * (world + 1) / 2.0;
  for (int rank = 0; rank < world; ++rank)
    CHECK_THAT(r.output, Catch::Contains(fmt::format(
                             "[rank{0}]: rank {0}/{1}: all-reduce over gloo on cpu ok (sum {2} = expected {2})", rank,
                             world, sum)));
  CHECK_THAT(r.output, Catch::Contains("node 1 of 2"));
}

std::string dist_check() { return bin("lora-train") + " --dist-check --dist-timeout-s 60"; }

}  // namespace

TEST_CASE("two nodes of 2 ranks, started with --nnodes/--node-rank, are one world of 4", "[e2e]") {
  const std::string flags = fmt::format("{} --nnodes 2 --nproc-per-node 2 --master-addr 127.0.0.1 --master-port {}",
                                        bin("lorarun"), free_port());
  check_world(two_nodes(temp_dir("two-nodes"), flags + " --node-rank 0 -- " + dist_check(),
                        flags + " --node-rank 1 -- " + dist_check()),
              4);
}

TEST_CASE("two nodes of 1 rank take nodes, node rank and master from a Slurm job", "[e2e]") {
  const std::string slurm = "SLURM_JOB_ID=31337 SLURM_NNODES=2 SLURM_JOB_NODELIST='localhost,nohost[1-3]'";
  const std::string flags = fmt::format("{} --master-port {} -- ", bin("lorarun"), free_port());
  const Result r =
      two_nodes(temp_dir("slurm-nodes"), fmt::format("env {} SLURM_NODEID=0 {}", slurm, flags + dist_check()),
                fmt::format("env {} SLURM_NODEID=1 {}", slurm, flags + dist_check()));
  check_world(r, 2);
  CHECK_THAT(r.output, Catch::Contains("master localhost:"));
  CHECK_THAT(r.output, Catch::Contains("run 31337"));
}

TEST_CASE("two pods of a Kubeflow PyTorchJob: lorarun as the command, told who it is by PET_* only", "[e2e]") {
  // What the training operator sets in each pod (the master's address is its service's name).
  const std::string pet = fmt::format(
      "PET_NNODES=2 PET_NPROC_PER_NODE=2 PET_MASTER_ADDR=localhost PET_MASTER_PORT={} PET_RDZV_ID=pytorchjob-1",
      free_port());
  const std::string cmd = bin("lorarun") + " -- " + dist_check();
  const Result r = two_nodes(temp_dir("pet-nodes"), fmt::format("env {} PET_NODE_RANK=0 {}", pet, cmd),
                             fmt::format("env {} PET_NODE_RANK=1 {}", pet, cmd));
  check_world(r, 4);
  CHECK_THAT(r.output, Catch::Contains("master localhost:"));
  CHECK_THAT(r.output, Catch::Contains("run pytorchjob-1"));
}

TEST_CASE("lorarun --max-restarts restarts the whole group with TORCHELASTIC_RESTART_COUNT counting", "[e2e]") {
  const std::string dir = temp_dir("restarts");
  const std::string worker = script(dir, "worker.sh",
                                    "echo \"attempt $TORCHELASTIC_RESTART_COUNT of $TORCHELASTIC_MAX_RESTARTS\"\n"
                                    "if [ \"$TORCHELASTIC_RESTART_COUNT\" = 0 ]; then exit 5; fi\n");
  const Result r =
      sh(fmt::format("{} --nproc-per-node 2 --max-restarts 2 --log-dir '{}/logs' --run-id rr --tee 1 -- {}",
                     bin("lorarun"), dir, worker));
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("failed first: exited with code 5"));
  CHECK_THAT(r.output, Catch::Contains("restarting all 2 rank(s) on this node (restart 1 of 2)"));
  CHECK_THAT(r.output, Catch::Contains("[rank0]: attempt 1 of 2\n"));
  CHECK_THAT(r.output, Catch::Contains("[rank1]: attempt 1 of 2\n"));
  CHECK_THAT(r.output, Catch::Contains("lorarun: all ranks finished after 1 restart(s)"));
  CHECK_THAT(r.output, !Catch::Contains("restart 2 of 2"));
  CHECK(launched_pids(r.output).size() == 2);
  // Each attempt has its own directory of per-rank files.
  CHECK(read_file(dir + "/logs/rr/attempt_1/1/stdout.log") == "attempt 1 of 2\n");
  CHECK(std::filesystem::is_directory(dir + "/logs/rr/attempt_0/0"));
}

TEST_CASE("restarts that run out end in the failure summary", "[e2e]") {
  const Result r =
      sh(fmt::format("{} --nproc-per-node 1 --max-restarts 1 -- sh -c 'echo try $TORCHELASTIC_RESTART_COUNT; exit 4'",
                     bin("lorarun")));
  INFO(r.output);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Catch::Contains("restart 1 of 1"));
  CHECK_THAT(summary(r.output), Catch::Contains("failed after 1 restart(s) (--max-restarts 1)"));
  CHECK_THAT(summary(r.output), Catch::Contains("failed first: exited with code 4"));
  CHECK_THAT(summary(r.output), Catch::Contains("[rank0]: try 1\n"));
}

TEST_CASE("the summary names the first failing rank, its exit code, error file and last lines", "[e2e]") {
  const std::string dir = temp_dir("summary");
  const std::string worker = script(dir, "worker.sh", R"(
if [ "$RANK" = 1 ]; then
  i=1; while [ $i -le 14 ]; do echo "line $i"; i=$((i+1)); done
  echo "last words" >&2
  printf '{"message": {"message": "ValueError: worker says \\"no\\"", "extraInfo": {"timestamp": "1"}}}' > "$TORCHELASTIC_ERROR_FILE"
  exit 3
fi
exec sleep 30
)");
  const Result r =
      sh(fmt::format("{} --nproc-per-node 2 --max-restarts 0 --grace-period 5 -- {}", bin("lorarun"), worker));
  INFO(r.output);
  CHECK(r.status == 1);
  CHECK(r.seconds < 10);
  const std::string s = summary(r.output);
  const auto pids = launched_pids(r.output);
  REQUIRE(pids.size() == 2);
  CHECK_THAT(s,
             Catch::Contains(fmt::format("rank 1 (local rank 1, pid {}) failed first: exited with code 3", pids[1])));
  CHECK_THAT(s, Catch::Contains("lorarun:   error: ValueError: worker says \"no\"\n"));
  CHECK_THAT(s, Catch::Contains("last 10 line(s) of rank 1:"));
  CHECK_THAT(s, Catch::Contains("[rank1]: line 6\n"));
  CHECK_THAT(s, Catch::Contains("[rank1]: line 14\n"));
  CHECK_THAT(s, Catch::Contains("[rank1]: last words\n"));
  CHECK_THAT(s, !Catch::Contains("[rank1]: line 5\n"));
  CHECK_THAT(s, Catch::Contains("stopped the other 1 rank(s) on this node"));
}

TEST_CASE("a lora-train error reaches the summary through its error file", "[e2e]") {
  const Result r = sh(fmt::format("cd '{}' && {} --nproc-per-node 2 configs/quickstart.yaml train.learning_rate=2e-4",
                                  LORARUN_SOURCE_DIR, bin("lorarun")));
  INFO(r.output);
  CHECK(r.status == 78);
  CHECK_THAT(summary(r.output),
             Catch::Contains("lorarun:   error: lora-train: error: configs/quickstart.yaml "
                             "(override 'train.learning_rate=2e-4'): unknown key 'train.learning_rate'; "
                             "did you mean 'train.lr'?\n"));
}

TEST_CASE("lora-train writes torchrun's error file, secrets scrubbed", "[e2e]") {
  const std::string dir = temp_dir("error-file");
  const Result r =
      sh(fmt::format("cd '{}' && TORCHELASTIC_ERROR_FILE='{}/error.json' {} configs/quickstart.yaml "
                     "data.uri=mongodb://u:hunter2@db:27017/ train.nope=1",
                     LORARUN_SOURCE_DIR, dir, bin("lora-train")));
  INFO(r.output);
  CHECK(r.status == 78);
  const std::string json = read_file(dir + "/error.json");
  CHECK_THAT(json, Catch::StartsWith("{\"message\": {\"message\": \"lora-train: error: "));
  CHECK_THAT(json, Catch::Contains("unknown key 'train.nope'"));
  CHECK_THAT(json, Catch::Matches(R"(.*"extraInfo": \{"timestamp": "[0-9]+"\}\}\})"));
  CHECK_THAT(json, !Catch::Contains("hunter2"));
}

TEST_CASE("lorarun --log-dir with --redirects and --tee writes each rank's streams to files", "[e2e]") {
  const std::string dir = temp_dir("log-dir");
  const Result r =
      sh(fmt::format("{} --nproc-per-node 2 --log-dir '{}' --run-id lg --redirects 1 --tee 2 -- "
                     "sh -c 'echo out $RANK; echo err $RANK >&2'",
                     bin("lorarun"), dir));
  INFO(r.output);
  CHECK(r.status == 0);
  for (int rank : {0, 1}) {
    const std::string rank_dir = fmt::format("{}/lg/attempt_0/{}", dir, rank);
    CHECK(read_file(rank_dir + "/stdout.log") == fmt::format("out {}\n", rank));
    CHECK(read_file(rank_dir + "/stderr.log") == fmt::format("err {}\n", rank));
    CHECK_THAT(r.output, !Catch::Contains(fmt::format("out {}", rank)));               // redirected: file only
    CHECK_THAT(r.output, Catch::Contains(fmt::format("[rank{0}]: err {0}\n", rank)));  // teed: both
  }
}

TEST_CASE("workers get every variable torchrun sets", "[e2e]") {
  const std::string dir = temp_dir("env");
  const Result r =
      sh(fmt::format("env -u OMP_NUM_THREADS {} --nproc-per-node 2 --master-port 29321 --run-id ev "
                     "--max-restarts 3 --log-dir '{}/logs' -- sh -c 'env > {}/env_$RANK; "
                     "test -d \"$(dirname \"$TORCHELASTIC_ERROR_FILE\")\"'",
                     bin("lorarun"), dir, dir));
  INFO(r.output);
  CHECK(r.status == 0);
  const std::string env = read_file(dir + "/env_1");
  for (const std::string kv :
       {"RANK=1", "LOCAL_RANK=1", "WORLD_SIZE=2", "LOCAL_WORLD_SIZE=2", "GROUP_RANK=0", "GROUP_WORLD_SIZE=1",
        "ROLE_RANK=1", "ROLE_WORLD_SIZE=2", "ROLE_NAME=default", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=29321",
        "TORCHELASTIC_RESTART_COUNT=0", "TORCHELASTIC_MAX_RESTARTS=3", "TORCHELASTIC_RUN_ID=ev",
        "TORCHELASTIC_USE_AGENT_STORE=False", "OMP_NUM_THREADS=1"}) {
    INFO(kv);
    CHECK_THAT(env, Catch::Contains("\n" + kv + "\n") || Catch::StartsWith(kv + "\n"));
  }
  CHECK_THAT(env, Catch::Contains(fmt::format("TORCHELASTIC_ERROR_FILE={}/logs/ev/attempt_0/1/error.json\n", dir)));
  CHECK_THAT(read_file(dir + "/env_0"), Catch::Contains("\nRANK=0\n"));
}

TEST_CASE("SIGTERM to lorarun during restarts stops the group for good and exits 143", "[e2e]") {
  const std::string dir = temp_dir("restart-sigterm");
  sh(
      fmt::format("( {} --nproc-per-node 2 --max-restarts 5 --grace-period 5 -- sh -c "
                  "'if [ $TORCHELASTIC_RESTART_COUNT = 0 ]; then exit 1; fi; exec sleep 30' & echo $! > '{d}/pid'; "
                  "wait $!; echo $? > '{d}/status' ) > '{d}/log' 2>&1 &",
                  bin("lorarun"), fmt::arg("d", dir)));
  REQUIRE(wait_for([&] { return read_file(dir + "/log").find("restart 1 of 5, master") != std::string::npos; }, 10.0));
  kill(std::stoi(read_file(dir + "/pid")), SIGTERM);
  REQUIRE(wait_for([&] { return !read_file(dir + "/status").empty(); }, 10.0));
  const std::string log = read_file(dir + "/log");
  INFO(log);
  CHECK(std::stoi(read_file(dir + "/status")) == 143);
  CHECK_THAT(log, Catch::Contains("lorarun: got SIGTERM, stopping all ranks"));
  CHECK_THAT(log, !Catch::Contains("restart 2 of 5"));
}
