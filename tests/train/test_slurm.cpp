// scripts/slurm/lorarun.sbatch under a real Slurm (one host: scripts/slurm-cluster runs Debian's
// slurmctld, slurmd and munge): the time limit's warning signal stops the ranks with their state
// saved, the script requeues the job, and the requeued job resumes to the adapters of a run never
// stopped.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <regex>
#include <string>

#include "io/sha256.hpp"
#include "support/runs.hpp"

using namespace lorarun::test;
namespace fs = std::filesystem;

namespace {

// A one-host cluster for the test's life; `env` is the SLURM_CONF=… its clients need.
struct Cluster {
  std::string script = std::string(LORARUN_SOURCE_DIR) + "/scripts/slurm-cluster";
  std::string state, env;
  explicit Cluster(const std::string& dir) : state(dir) {
    const Result r = sh(fmt::format("'{}' start '{}'", script, state));
    INFO(r.output);
    // scripts/setup installs slurm-wlm and munge; the daemons need root (the test machine's user).
    REQUIRE(r.status == 0);
    env = r.output.substr(r.output.rfind("SLURM_CONF="));
    env = env.substr(0, env.find('\n'));
  }
  ~Cluster() { sh(fmt::format("'{}' stop '{}' >/dev/null 2>&1", script, state)); }
  Cluster(const Cluster&) = delete;
  Cluster& operator=(const Cluster&) = delete;
  Result run(const std::string& cmd) const { return sh(fmt::format("export {}; {}", env, cmd)); }
  // scontrol's FIELD=value for job `id` ("" when it is not known).
  std::string field(const std::string& id, const std::string& name) const {
    const std::string out = run("scontrol show job " + id).output;
    std::smatch m;
    return std::regex_search(out, m, std::regex("\\b" + name + "=(\\S+)")) ? m[1].str() : "";
  }
};

}  // namespace

TEST_CASE(
    "slurm: the sbatch example stopped by its time-limit signal saves, requeues itself, and the requeued job resumes "
    "to the uninterrupted adapters",
    "[e2e][slurm]") {
  const std::string dir = temp_dir("slurm");
  write_data(dir + "/data.jsonl", 240);
  const std::string train = "epochs: 2, lr: 1.0e-3";
  const std::string full = write_recipe(dir, "full", train, "", ", batch_size: 1");
  const std::string job = write_recipe(dir, "job", train, "", ", batch_size: 1");
  REQUIRE(sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), full)).status == 0);

  const Cluster slurm(dir + "/cluster");
  // The example as shipped, with what its header says to adapt on CPU nodes: no GPUs, the node's CPUs.
  const Result submitted = slurm.run(fmt::format(
      "cd '{1}' && LORARUN_BIN='{0}' sbatch --parsable --nodes=1 --gpus-per-node=0 --cpus-per-task=2 '{2}' '{3}'",
      LORARUN_BIN_DIR, dir, std::string(LORARUN_SOURCE_DIR) + "/scripts/slurm/lorarun.sbatch", job));
  INFO(submitted.output);
  REQUIRE(submitted.status == 0);
  const std::string id = submitted.output.substr(0, submitted.output.find_first_of(";\n"));
  const std::string out = fmt::format("{}/lorarun-{}.out", dir, id);
  // What --signal=TERM@120 does at the time limit (to the job step, not the batch shell): SIGTERM to lorarun.
  REQUIRE(wait_for([&] { return read_file(out).find("epoch 0/2 step 60/120") != std::string::npos; }, 120));
  REQUIRE(slurm.run("scancel --signal=TERM " + id).status == 0);
  REQUIRE(wait_for([&] { return slurm.field(id, "JobState") == "COMPLETED"; }, 300));
  const std::string log = read_file(out);
  INFO(log);
  CHECK(slurm.field(id, "Restarts") == "1");
  CHECK(slurm.field(id, "ExitCode") == "0:0");
  CHECK_THAT(log, Catch::Contains("lorarun: stopped on SIGTERM: every rank saved its resumable state"));
  CHECK_THAT(log, Catch::Contains(fmt::format("job {} stopped with its state saved: requeueing it (restart 1)", id)));
  CHECK_THAT(log, Catch::Contains("started 2 rank(s) of world size 2"));  // --nproc-per-node auto: the 2 CPUs given
  CHECK_THAT(log, Catch::Contains("resuming at epoch 0 step"));
  CHECK_THAT(log, Catch::Contains("done: 240 steps"));
  for (const char* epoch : {"epoch_0", "epoch_1"})
    CHECK(lorarun::io::sha256_file(fmt::format("{}/job/{}/adapter_model.safetensors", dir, epoch)) ==
          lorarun::io::sha256_file(fmt::format("{}/full/{}/adapter_model.safetensors", dir, epoch)));
}
