// lorarun with real ranks: Gloo all-reduce across processes, failure handling, signals.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <csignal>
#include <fstream>
#include <regex>

#include "support/process.hpp"

using namespace lorarun::test;

namespace {

void check_all_reduce(int n) {
  const Result r = sh(fmt::format("{} --nproc-per-node {} -- {} --dist-check --dist-timeout-s 60", bin("lorarun"), n,
                                  bin("lora-train")));
  INFO(r.output);
  CHECK(r.status == 0);
  const double sum = n * (n + 1) / 2.0;
  for (int rank = 0; rank < n; ++rank)
    CHECK_THAT(r.output,
               Catch::Contains(fmt::format(
                   "[rank{0}]: rank {0}/{1}: all-reduce over gloo on cpu ok (sum {2} = expected {2})", rank, n, sum)));
}

void check_gone(const std::vector<pid_t>& pids) {
  for (pid_t p : pids) {
    INFO("pid " << p);
    CHECK(wait_for([&] { return !alive(p) && !group_alive(p); }, 3.0));
  }
}

}  // namespace

TEST_CASE("2 ranks all-reduce over Gloo on CPU", "[e2e]") { check_all_reduce(2); }

TEST_CASE("3 ranks all-reduce over Gloo on CPU", "[e2e]") { check_all_reduce(3); }

TEST_CASE("lora-train alone is a world of one", "[e2e]") {
  const Result r = sh(bin("lora-train") + " --dist-check");
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("rank 0/1: all-reduce over gloo on cpu ok"));
}

TEST_CASE("a recipe runs lora-train on every rank, with the overrides", "[e2e]") {
  const Result r = sh(fmt::format("cd '{}' && {} --nproc-per-node 2 configs/quickstart.yaml train.lr=2e-4 --dry-run",
                                  LORARUN_SOURCE_DIR, bin("lorarun")));
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("[rank0]:   lr: 0.0002"));
  CHECK_THAT(r.output, Catch::Contains("[rank1]:   lr: 0.0002"));
}

TEST_CASE("a bad recipe fails on every rank with one clear line", "[e2e]") {
  const Result r = sh(fmt::format("cd '{}' && {} --nproc-per-node 2 configs/quickstart.yaml train.learning_rate=2e-4",
                                  LORARUN_SOURCE_DIR, bin("lorarun")));
  INFO(r.output);
  CHECK(r.status == 78);  // a recipe error: a restart cannot change it
  CHECK_THAT(r.output,
             Catch::Contains("lora-train: error: configs/quickstart.yaml (override 'train.learning_rate=2e-4'): "
                             "unknown key 'train.learning_rate'; did you mean 'train.lr'?"));
  CHECK_THAT(r.output, Catch::Contains("failed first: exited with code 78"));
}

TEST_CASE("lora-train --dry-run prints the resolved recipe, the epochs it will keep and the memory", "[e2e]") {
  // Nothing listens on port 1: the data cannot be checked, which is a warning, not a failure.
  const Result r =
      sh(fmt::format("cd '{}' && {} --dry-run configs/quickstart.yaml model.dtype=fp32 train.epochs=3 "
                     "checkpoint.epochs_to_save=[0,2] data.uri=mongodb://u:hunter2@127.0.0.1:1/",
                     LORARUN_SOURCE_DIR, bin("lora-train")));
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("# epoch checkpoints kept at the end: [0, 2]"));
  // The memory a rank needs, from the model's shapes (the quickstart's SmolLM2: 0.50 GiB of float32 base).
  CHECK_THAT(r.output, Catch::Contains("# memory per rank, estimated in GiB"));
  CHECK_THAT(r.output, Catch::Matches(
                           "[^]*#   whole base, any ranks +0\\.50 +0\\.0[0-9]+ +[0-9.]+ +[0-9.]+   <- this run\n[^]*"));
  CHECK_THAT(r.output, Catch::Contains("#   dist.shard_base, 8 ranks"));
  CHECK_THAT(r.output, Catch::Contains("mongodb://u:****@127.0.0.1:1/"));
  CHECK_THAT(r.output, Catch::Contains("warning: could not check data.filter: cannot reach MongoDB at "
                                       "mongodb://u:****@127.0.0.1:1/"));
  CHECK_THAT(r.output, !Catch::Contains("hunter2"));
}

// model.dtype: auto holds the base in bf16 where the CPU has bf16 instructions (as the kernel lists
// them), else in fp32: the dry run's memory estimate shows which.
TEST_CASE("model.dtype auto is bf16 where the CPU computes bf16, else fp32", "[e2e]") {
  std::ifstream cpuinfo("/proc/cpuinfo");
  bool bf16 = false;
  for (std::string line; std::getline(cpuinfo, line);)
    if (line.starts_with("flags") &&
        (line.find(" avx512_bf16") != std::string::npos || line.find(" amx_bf16") != std::string::npos))
      bf16 = true;
  const auto base_gib = [](const std::string& dtype) {
    const Result r =
        sh(fmt::format("cd '{}' && {} --dry-run configs/quickstart.yaml model.dtype={} "
                       "data.uri=mongodb://127.0.0.1:1/",
                       LORARUN_SOURCE_DIR, bin("lora-train"), dtype));
    INFO(r.output);
    CHECK(r.status == 0);
    std::smatch m;
    REQUIRE(std::regex_search(r.output, m, std::regex("#   whole base, any ranks +([0-9.]+)")));
    return m[1].str();
  };
  const std::string fp32 = base_gib("fp32"), bf16_gib = base_gib("bf16");
  CHECK(fp32 != bf16_gib);
  CHECK(base_gib("auto") == (bf16 ? bf16_gib : fp32));
}

TEST_CASE("workers see torchrun's environment and their output is prefixed", "[e2e]") {
  const Result r =
      sh(fmt::format("{} --nproc-per-node 2 --master-port 29123 --run-id job42 -- sh -c "
                     "'echo \"env $RANK $LOCAL_RANK $WORLD_SIZE $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT "
                     "$TORCHELASTIC_RUN_ID $OMP_NUM_THREADS\"; printf partial; echo oops >&2'",
                     bin("lorarun")));
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("[rank0]: env 0 0 2 2 127.0.0.1 29123 job42 1\n"));
  CHECK_THAT(r.output, Catch::Contains("[rank1]: env 1 1 2 2 127.0.0.1 29123 job42 1\n"));
  CHECK_THAT(r.output, Catch::Contains("[rank1]: partial\n"));
  CHECK_THAT(r.output, Catch::Contains("[rank0]: oops\n"));
}

TEST_CASE("a rank that exits 3 at start-up stops the group within 10 s", "[e2e]") {
  // Ranks 0 and 2 start a grandchild and wait on it: the whole process group must go.
  const Result r =
      sh(fmt::format("{} --nproc-per-node 3 --grace-period 5 -- sh -c "
                     "'if [ \"$RANK\" = 1 ]; then sleep 0.5; exit 3; fi; sleep 60 & wait'",
                     bin("lorarun")));
  INFO(r.output);
  CHECK(r.status == 1);
  CHECK(r.seconds < 10);
  const auto pids = launched_pids(r.output);
  REQUIRE(pids.size() == 3);
  CHECK_THAT(r.output,
             Catch::Contains(fmt::format("rank 1 (local rank 1, pid {}) failed first: exited with code 3", pids[1])));
  check_gone(pids);
}

TEST_CASE("a rank killed by a signal is reported as such", "[e2e]") {
  const Result r = sh(fmt::format(
      "{} --nproc-per-node 2 -- sh -c 'if [ \"$RANK\" = 0 ]; then kill -9 $$; fi; exec sleep 60'", bin("lorarun")));
  INFO(r.output);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Catch::Contains("rank 0 (local rank 0"));
  CHECK_THAT(r.output, Catch::Contains("was killed by signal 9"));
  check_gone(launched_pids(r.output));
}

TEST_CASE("a command that cannot be started fails cleanly", "[e2e]") {
  const Result r = sh(fmt::format("{} --nproc-per-node 2 -- /nonexistent/cmd", bin("lorarun")));
  INFO(r.output);
  CHECK(r.status == 1);
  CHECK_THAT(r.output, Catch::Contains("cannot run '/nonexistent/cmd'"));
  CHECK_THAT(r.output, Catch::Contains("exited with code 127"));
}

namespace {
// Starts lorarun in the background; returns its pid and the pids of its ranks.
std::pair<pid_t, std::vector<pid_t>> start_background(const std::string& log) {
  const Result r =
      sh(fmt::format("{} --nproc-per-node 2 --grace-period 5 -- sleep 60 > '{}' 2>&1 & echo $!", bin("lorarun"), log));
  const pid_t launcher = std::stoi(r.output);
  std::vector<pid_t> pids;
  wait_for([&] { return (pids = launched_pids(read_file(log))).size() == 2; }, 10.0);
  return {launcher, pids};
}
}  // namespace

TEST_CASE("SIGTERM to the launcher stops every rank and exits 143", "[e2e]") {
  const std::string dir = temp_dir("sigterm");
  // A wrapper shell records the launcher's pid and, once it ends, its exit status.
  sh(
      fmt::format("( {lorarun} --nproc-per-node 2 --grace-period 5 -- sleep 60 & echo $! > '{d}/pid'; "
                  "wait $!; echo $? > '{d}/status' ) > '{d}/log' 2>&1 &",
                  fmt::arg("lorarun", bin("lorarun")), fmt::arg("d", dir)));
  REQUIRE(wait_for([&] { return !read_file(dir + "/pid").empty(); }, 10.0));
  const pid_t launcher = std::stoi(read_file(dir + "/pid"));
  std::vector<pid_t> pids;
  REQUIRE(wait_for([&] { return (pids = launched_pids(read_file(dir + "/log"))).size() == 2; }, 10.0));
  kill(launcher, SIGTERM);
  REQUIRE(wait_for([&] { return !read_file(dir + "/status").empty(); }, 10.0));
  CHECK(std::stoi(read_file(dir + "/status")) == 143);
  CHECK_THAT(read_file(dir + "/log"), Catch::Contains("lorarun: got SIGTERM, stopping all ranks"));
  check_gone(pids);
}

TEST_CASE("no rank outlives a launcher killed with SIGKILL", "[e2e]") {
  const std::string dir = temp_dir("sigkill");
  auto [launcher, pids] = start_background(dir + "/log");
  REQUIRE(pids.size() == 2);
  for (pid_t p : pids) CHECK(alive(p));
  kill(launcher, SIGKILL);
  check_gone(pids);
}
