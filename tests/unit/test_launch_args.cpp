#include <sched.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include "launch.hpp"
#include "slurm.hpp"
#include "util/error.hpp"

using namespace lorarun::launch;

namespace {
Parsed parse(std::vector<std::string> args) {
  args.insert(args.begin(), "lorarun");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return parse_args(static_cast<int>(argv.size()), argv.data(), "/opt/lorarun/bin/lorarun");
}

Config parsed(std::vector<std::string> args) {
  const Parsed p = parse(std::move(args));
  REQUIRE(p.exit_code < 0);
  return p.config;
}

// Sets SLURM_* variables for one scope (parse_args reads the real environment).
struct SlurmEnv {
  std::vector<std::string> names;
  explicit SlurmEnv(const std::map<std::string, std::string>& vars) {
    for (auto& [k, v] : vars) {
      setenv(k.c_str(), v.c_str(), 1);
      names.push_back(k);
    }
  }
  ~SlurmEnv() {
    for (auto& k : names) unsetenv(k.c_str());
  }
};

using Env = std::map<std::string, std::string>;
std::optional<SlurmNode> slurm(const Env& env) {
  return slurm_node([&](const char* name) -> const char* {
    const auto it = env.find(name);
    return it == env.end() ? nullptr : it->second.c_str();
  });
}
}  // namespace

TEST_CASE("a command after -- is run as given") {
  const Config c = parsed({"--nproc-per-node", "3", "--master-port", "29999", "--", "echo", "--nproc-per-node", "x"});
  CHECK(c.nproc_per_node == 3);
  CHECK(c.master_port == 29999);
  CHECK(c.command == std::vector<std::string>{"echo", "--nproc-per-node", "x"});
}

TEST_CASE("a recipe runs lora-train with the recipe and its overrides") {
  const Config c = parsed({"--nproc-per-node", "2", "configs/q.yaml", "train.lr=1e-4"});
  // Not installed beside this fake path, so lora-train comes from PATH.
  CHECK(c.command == std::vector<std::string>{"lora-train", "configs/q.yaml", "train.lr=1e-4"});
  CHECK(c.master_port > 0);  // single node: a free port was chosen
}

TEST_CASE("lorarun --from-run is passed to every lora-train rank") {
  CHECK(parsed({"--from-run", "r1", "train.lr=1e-4"}).command ==
        std::vector<std::string>{"lora-train", "--from-run", "r1", "train.lr=1e-4"});
  CHECK(parsed({"--from-run", "r1"}).command == std::vector<std::string>{"lora-train", "--from-run", "r1"});
  CHECK(parsed({"--from-run", "r1", "q.yaml"}).command ==
        std::vector<std::string>{"lora-train", "--from-run", "r1", "q.yaml"});
  CHECK(parsed({"--from-run", "r1", "--", "./my-train", "-v"}).command ==
        std::vector<std::string>{"./my-train", "--from-run", "r1", "-v"});
}

TEST_CASE("every torchrun flag is read") {
  const Config c = parsed({"--nproc_per_node",
                           "2",
                           "--nnodes",
                           "3",
                           "--node_rank",
                           "2",
                           "--master_addr",
                           "10.1.2.3",
                           "--master_port",
                           "29400",
                           "--run-id",
                           "job9",
                           "--max-restarts",
                           "4",
                           "--log-dir",
                           "/tmp/l",
                           "--redirects",
                           "3",
                           "--tee",
                           "0:1,1:2",
                           "--grace-period",
                           "2.5",
                           "--",
                           "true"});
  CHECK(c.nproc_per_node == 2);
  CHECK(c.nnodes == 3);
  CHECK(c.node_rank == 2);
  CHECK(c.master_addr == "10.1.2.3");
  CHECK(c.master_port == 29400);
  CHECK(c.run_id == "job9");
  CHECK(c.max_restarts == 4);
  CHECK(c.log_dir == "/tmp/l");
  CHECK(c.redirects.of(0) == 3);
  CHECK(c.redirects.of(7) == 3);
  CHECK(c.tee.of(0) == 1);
  CHECK(c.tee.of(1) == 2);
  CHECK(c.tee.of(2) == 0);
  CHECK(c.grace == std::chrono::milliseconds(2500));
  CHECK(parsed({"--rdzv-id", "j", "-r", "1", "-t", "2", "--", "true"}).run_id == "j");
}

TEST_CASE("defaults: one node, a free port, a random run id, no restarts") {
  const Config c = parsed({"--", "true"});
  CHECK(c.nproc_per_node == 1);
  CHECK(c.nnodes == 1);
  CHECK(c.master_addr == "127.0.0.1");
  CHECK(c.master_port > 0);
  CHECK(c.run_id.size() == 16);
  CHECK(c.run_id != parsed({"--", "true"}).run_id);
  CHECK(c.max_restarts == 0);
  CHECK(c.log_dir.empty());
  CHECK(c.redirects.of(0) == 0);
  CHECK(c.tee.of(0) == 0);
  CHECK(c.grace == std::chrono::milliseconds(30000));  // torchrun's wait for a stopping worker
}

TEST_CASE("several nodes meet on port 29500 unless told otherwise") {
  CHECK(parsed({"--nnodes", "2", "--", "true"}).master_port == 29500);
  CHECK(parsed({"--nnodes", "2", "--master-port", "1234", "--", "true"}).master_port == 1234);
}

TEST_CASE("lorarun --nproc-per-node auto counts GPUs, else CPUs") {
  const int n = parsed({"--nproc-per-node", "auto", "--", "true"}).nproc_per_node;
  CHECK(n >= 1);
  if (std::system("ls /dev/nvidia[0-9]* >/dev/null 2>&1") != 0)
    CHECK(n == static_cast<int>(std::thread::hardware_concurrency()));
}

TEST_CASE("lorarun --standalone is one node with a local master") {
  const Config c = parsed({"--standalone", "--master-addr", "10.0.0.9", "--", "true"});
  CHECK(c.nnodes == 1);
  CHECK(c.master_addr == "127.0.0.1");
  CHECK(c.master_port > 0);
}

TEST_CASE("bad launcher arguments are one clear error") {
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "two", "--", "true"}),
                    Catch::Contains("'two' is not a positive integer"));
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "0", "--", "true"}), Catch::Contains("'0' is not a positive integer"));
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "2"}), Catch::Contains("nothing to run"));
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "2", "--"}), Catch::Contains("nothing to run"));
  CHECK_THROWS_WITH(parse({"--nnodes", "2", "--node-rank", "2", "--", "true"}),
                    Catch::Contains("--node-rank 2 must be below --nnodes 2"));
  CHECK_THROWS_WITH(parse({"--standalone", "--nnodes", "2", "--", "true"}),
                    Catch::Contains("--standalone runs on one node"));
  CHECK_THROWS_WITH(parse({"--redirects", "4", "--", "true"}), Catch::Contains("--redirects '4': use 0-3"));
  CHECK_THROWS_WITH(parse({"--tee", "0:1,x:2", "--", "true"}), Catch::Contains("--tee '0:1,x:2'"));
  CHECK_THROWS_WITH(parse({"--tee", "0:", "--", "true"}), Catch::Contains("--tee '0:'"));
  CHECK_THROWS_WITH(parse({"--run-id", "a/b", "--", "true"}), Catch::Contains("use no '/'"));
  CHECK_THROWS_WITH(parse({"--max-restarts", "-1", "--", "true"}),
                    "--max-restarts (or PET_MAX_RESTARTS) '-1' is not a whole number from 0 to 1000000");
  CHECK_THROWS_WITH(parse({"--nnodes", "0", "--", "true"}), Catch::Contains("'0' is not a number of nodes"));
  CHECK_THROWS_WITH(parse({"--nnodes", "1:3", "--", "true"}), Catch::Contains("elastic world"));
  CHECK_THROWS_WITH(parse({"--master-port", "70000", "--", "true"}),
                    "--master-port (or PET_MASTER_PORT) '70000' is not a whole number from 1 to 65535");
  // CLI11's own checks print their message and give a non-zero exit status.
  CHECK(parse({"--grace-period", "x", "--", "true"}).exit_code > 0);
  CHECK_THROWS_WITH(parse({"--no-such-flag", "--", "true"}), Catch::Contains("unknown lorarun flag '--no-such-flag'"));
  CHECK(parse({"--help"}).exit_code == 0);
}

TEST_CASE("workers get torchrun's environment") {
  Config c;
  c.nproc_per_node = 4;
  c.nnodes = 2;
  c.node_rank = 1;
  c.master_addr = "10.0.0.1";
  c.master_port = 29500;
  c.run_id = "job7";
  c.max_restarts = 3;
  const auto env = worker_env(c, 2, 1, "/tmp/x/error.json");
  auto has = [&](const std::string& kv) { return std::find(env.begin(), env.end(), kv) != env.end(); };
  for (const char* kv :
       {"RANK=6", "LOCAL_RANK=2", "WORLD_SIZE=8", "LOCAL_WORLD_SIZE=4", "GROUP_RANK=1", "GROUP_WORLD_SIZE=2",
        "ROLE_RANK=6", "ROLE_WORLD_SIZE=8", "ROLE_NAME=default", "MASTER_ADDR=10.0.0.1", "MASTER_PORT=29500",
        "TORCHELASTIC_RUN_ID=job7", "TORCHELASTIC_RESTART_COUNT=1", "TORCHELASTIC_MAX_RESTARTS=3",
        "TORCHELASTIC_USE_AGENT_STORE=False", "TORCHELASTIC_ERROR_FILE=/tmp/x/error.json"}) {
    INFO(kv);
    CHECK(has(kv));
  }
}

TEST_CASE("Slurm node lists expand like scontrol show hostnames") {
  using V = std::vector<std::string>;
  CHECK(expand_nodelist("gpu[003-005,010],cpu1") == V{"gpu003", "gpu004", "gpu005", "gpu010", "cpu1"});
  CHECK(expand_nodelist("node1") == V{"node1"});
  CHECK(expand_nodelist("a1,b2") == V{"a1", "b2"});
  CHECK(expand_nodelist("n[8-10]") == V{"n8", "n9", "n10"});
  CHECK(expand_nodelist("n[09-10]-ib") == V{"n09-ib", "n10-ib"});
  CHECK(expand_nodelist("r[1-2]-n[01,03]") == V{"r1-n01", "r1-n03", "r2-n01", "r2-n03"});
  CHECK(expand_nodelist("x[7],y[1-2]") == V{"x7", "y1", "y2"});
  CHECK_THROWS_WITH(expand_nodelist("gpu[1-2"), Catch::Contains("'[' without ']'") && Catch::Contains("--master-addr"));
  CHECK_THROWS_WITH(expand_nodelist("gpu[5-2]"), Catch::Contains("bad range '5-2'"));
  CHECK_THROWS_WITH(expand_nodelist("gpu[a-b]"), Catch::Contains("'a' is not a number"));
  CHECK_THROWS_WITH(expand_nodelist("gpu1]"), Catch::Contains("']' without '['"));
}

TEST_CASE("a Slurm job gives nodes, node rank, master and run id") {
  CHECK_FALSE(slurm({{"SLURM_NNODES", "2"}}));  // no SLURM_JOB_ID: not a Slurm job
  const auto n = slurm({{"SLURM_JOB_ID", "777"},
                        {"SLURM_NNODES", "4"},
                        {"SLURM_NODEID", "3"},
                        {"SLURM_JOB_NODELIST", "gpu[003-005,010]"}});
  REQUIRE(n);
  CHECK(n->job_id == "777");
  CHECK(n->nnodes == 4);
  CHECK(n->node_rank == 3);
  CHECK(n->first_host == "gpu003");
  const auto old = slurm({{"SLURM_JOB_ID", "8"}, {"SLURM_JOB_NUM_NODES", "2"}, {"SLURM_NODELIST", "a,b"}});
  REQUIRE(old);
  CHECK(old->nnodes == 2);
  CHECK(old->node_rank == 0);
  CHECK(old->first_host == "a");
  CHECK_THROWS_WITH(slurm({{"SLURM_JOB_ID", "8"}, {"SLURM_NODEID", "x"}}),
                    Catch::Contains("SLURM_NODEID='x' is not a count: pass --node-rank"));
}

TEST_CASE("under Slurm, flags not given come from the job") {
  SlurmEnv env(
      {{"SLURM_JOB_ID", "4242"}, {"SLURM_NNODES", "2"}, {"SLURM_NODEID", "1"}, {"SLURM_JOB_NODELIST", "gpu[007-008]"}});
  const Config c = parsed({"--nproc-per-node", "8", "q.yaml"});
  CHECK(c.nnodes == 2);
  CHECK(c.node_rank == 1);
  CHECK(c.master_addr == "gpu007");
  CHECK(c.master_port == 29500);
  CHECK(c.run_id == "4242");
  const Config given = parsed({"--nnodes", "3", "--node-rank", "0", "--master-addr", "h", "--run-id", "r", "q.yaml"});
  CHECK(given.nnodes == 3);
  CHECK(given.node_rank == 0);
  CHECK(given.master_addr == "h");
  CHECK(given.run_id == "r");
  CHECK(parsed({"--standalone", "q.yaml"}).nnodes == 1);  // --standalone ignores the job
}

TEST_CASE("the rendezvous timeout: --rdzv-timeout, torchrun's --rdzv-conf join_timeout, 600 s by default") {
  CHECK(parsed({"--", "true"}).rdzv_timeout_s == 600);
  CHECK(parsed({"--rdzv-timeout", "30", "--", "true"}).rdzv_timeout_s == 30);
  CHECK(parsed({"--rdzv_conf", "join_timeout=45,read_timeout=60", "--", "true"}).rdzv_timeout_s == 45);
  CHECK(parsed({"--rdzv-conf", "join_timeout=45", "--rdzv-timeout", "7", "--", "true"}).rdzv_timeout_s == 7);
  CHECK_THROWS_WITH(parse({"--rdzv-conf", "join_timeout=soon", "--", "true"}),
                    Catch::Contains("join_timeout must be a whole number of seconds"));
  CHECK_THROWS_WITH(parse({"--rdzv-conf", "join_timeout", "--", "true"}), Catch::Contains("join_timeout"));
  CHECK(parse({"--rdzv-timeout", "0", "--", "true"}).exit_code > 0);
  Config c;
  c.rdzv_timeout_s = 12;
  const auto env = worker_env(c, 0, 0, "/tmp/x/error.json");
  CHECK(std::find(env.begin(), env.end(), "LORARUN_RDZV_TIMEOUT=12") != env.end());
  CHECK(std::find(env.begin(), env.end(), "LORARUN_ERROR_SUMMARY=1") != env.end());
}

TEST_CASE("lorarun --nproc-per-node is bounded by 4 per CPU unless --nproc-limit allows more") {
  const int cpus = static_cast<int>(std::thread::hardware_concurrency());
  CHECK(parsed({"--nproc-per-node", std::to_string(4 * cpus), "--", "true"}).nproc_per_node == 4 * cpus);
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "100000", "--", "true"}),
                    Catch::Contains(fmt::format("--nproc-per-node 100000 is above the limit of {} (4 per CPU, {} CPUs "
                                                "here): pass --nproc-limit 100000",
                                                4 * cpus, cpus)));
  CHECK(parsed({"--nproc-per-node", "100000", "--nproc-limit", "100000", "--", "true"}).nproc_per_node == 100000);
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "3", "--nproc-limit", "2", "--", "true"}),
                    Catch::Contains("--nproc-per-node 3 is above --nproc-limit 2"));
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "1000", "--nproc-limit", "1000", "--nnodes", "100000", "--", "true"}),
                    Catch::Contains("more ranks than lorarun supports"));
}

TEST_CASE("recipe or command: the extension, else what the file is, else PATH") {
  const std::string dir = std::filesystem::temp_directory_path() / fmt::format("lorarun-recipe-or-cmd-{}", getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text, bool exec) {
    std::ofstream(dir + "/" + name) << text;
    if (exec) std::filesystem::permissions(dir + "/" + name, std::filesystem::perms::owner_all);
    return dir + "/" + name;
  };
  using V = std::vector<std::string>;
  const std::string plain = write("recipe", "model: {path: m}\n", false);
  const std::string exec_yaml = write("recipe-x", "model: {path: m}\ntrain: {lr: 1}\n", true);
  const std::string script = write("train.sh", "#!/bin/sh\necho hi\n", true);
  const std::string exec_text = write("tool", "echo hi\n", true);  // a shell runs it: not a mapping
  CHECK(parsed({plain, "train.lr=1"}).command == V{"lora-train", plain, "train.lr=1"});
  CHECK(parsed({exec_yaml}).command == V{"lora-train", exec_yaml});
  CHECK(parsed({script, "-v"}).command == V{script, "-v"});
  CHECK(parsed({exec_text}).command == V{exec_text});
  CHECK(parsed({"missing.yaml"}).command == V{"lora-train", "missing.yaml"});  // lora-train says it is missing
  CHECK(parsed({"true", "x"}).command == V{"true", "x"});                      // a command on PATH
  CHECK_THROWS_WITH(parse({dir + "/nope", "train.lr=1"}),
                    Catch::Contains(fmt::format("'{}/nope' is neither a file nor a command on PATH", dir)) &&
                        Catch::Contains("RECIPE.yaml") && Catch::Contains("lorarun -- CMD ARGS"));
  CHECK_THROWS_WITH(parse({"no-such-command-here"}), Catch::Contains("neither a file nor a command on PATH"));
  write("q.yaml", "model: {path: m}\n", false);
  CHECK_THROWS_WITH(parse({dir + "/q"}), Catch::Contains(fmt::format("'{0}/q' does not exist: did you mean the recipe "
                                                                     "{0}/q.yaml?",
                                                                     dir)));
  CHECK_THROWS_WITH(parse({dir}), Catch::Contains("is a directory"));
  std::filesystem::remove_all(dir);
}

TEST_CASE("torchrun's PET_* environment gives the flags not given, as Kubeflow's PyTorchJob and TrainJob set it") {
  // What the Kubeflow training operator puts in each pod of a two-node job (node 1 here).
  const SlurmEnv pet({{"PET_NNODES", "2"},
                      {"PET_NPROC_PER_NODE", "3"},
                      {"PET_NODE_RANK", "1"},
                      {"PET_MASTER_ADDR", "job-master-0"},
                      {"PET_MASTER_PORT", "23456"},
                      {"PET_MAX_RESTARTS", "2"},
                      {"PET_RDZV_ID", "kubeflow-job"}});
  const Config c = parsed({"--", "true"});
  CHECK(c.nnodes == 2);
  CHECK(c.nproc_per_node == 3);
  CHECK(c.node_rank == 1);
  CHECK(c.master_addr == "job-master-0");
  CHECK(c.master_port == 23456);
  CHECK(c.max_restarts == 2);
  CHECK(c.run_id == "kubeflow-job");
  // The workers see exactly what the flags would have given them.
  CHECK(worker_env(c, 2) == worker_env(parsed({"--nnodes", "2", "--nproc-per-node", "3", "--node-rank", "1",
                                               "--master-addr", "job-master-0", "--master-port", "23456",
                                               "--max-restarts", "2", "--run-id", "kubeflow-job", "--", "true"}),
                                       2));
  // A flag given wins over its PET_ variable.
  CHECK(parsed({"--node-rank", "0", "--", "true"}).node_rank == 0);
  // ... and PET_* win over Slurm's defaults.
  const SlurmEnv slurm(
      {{"SLURM_JOB_ID", "77"}, {"SLURM_NNODES", "4"}, {"SLURM_NODEID", "3"}, {"SLURM_JOB_NODELIST", "gpu[1-4]"}});
  const Config both = parsed({"--", "true"});
  CHECK(both.nnodes == 2);
  CHECK(both.node_rank == 1);
  CHECK(both.master_addr == "job-master-0");
}

TEST_CASE("PET_RDZV_ENDPOINT and torchrun's MIN:MAX node counts") {
  {
    const SlurmEnv pet({{"PET_NNODES", "2:2"}, {"PET_RDZV_ENDPOINT", "trainer-node-0-0.trainer:29400"}});
    const Config c = parsed({"--", "true"});
    CHECK(c.nnodes == 2);
    CHECK(c.master_addr == "trainer-node-0-0.trainer");
    CHECK(c.master_port == 29400);
  }
  {
    const SlurmEnv elastic(Env{{"PET_NNODES", "1:4"}});
    CHECK_THROWS_WITH(parse({"--", "true"}), Catch::Contains("PET_NNODES) '1:4' asks for an elastic world"));
  }
  {  // a variable's value that is no number, or one of 309 digits: named, escaped, cut, one line
    const SlurmEnv port(Env{{"PET_MASTER_PORT", std::string(309, '9')}});
    CHECK_THROWS_WITH(parse({"--", "true"}), "--master-port (or PET_MASTER_PORT) '" + std::string(40, '9') +
                                                 "… (309 bytes)' is not a whole number from 1 to 65535");
  }
  {
    const SlurmEnv rank(Env{{"PET_NNODES", "2"}, {"PET_NODE_RANK", "one\x1b[2J"}});
    CHECK_THROWS_WITH(parse({"--", "true"}),
                      "--node-rank (or PET_NODE_RANK) 'one\\x1b[2J' is not a whole number from 0 to 99999");
  }
  CHECK(parsed({"--nnodes", "3:3", "--node-rank", "2", "--", "true"}).nnodes == 3);
}

TEST_CASE("lorarun's --nproc-per-node auto and cpu follow the CPUs this process may use, and Slurm's CPUs per task") {
  cpu_set_t all;
  REQUIRE(sched_getaffinity(0, sizeof all, &all) == 0);
  cpu_set_t one;
  CPU_ZERO(&one);
  for (int i = 0; i < CPU_SETSIZE; ++i)
    if (CPU_ISSET(i, &all)) {
      CPU_SET(i, &one);
      break;
    }
  REQUIRE(sched_setaffinity(0, sizeof one, &one) == 0);
  const bool gpus = parsed({"--nproc-per-node", "auto", "--", "true"}).nproc_per_node > 1;
  const int cpu_one = parsed({"--nproc-per-node", "cpu", "--", "true"}).nproc_per_node;
  REQUIRE(sched_setaffinity(0, sizeof all, &all) == 0);
  CHECK(cpu_one == 1);  // taskset, a cpuset or Slurm's binding left it one CPU: one rank
  if (!gpus) CHECK(parsed({"--nproc-per-node", "auto", "--", "true"}).nproc_per_node == CPU_COUNT(&all));
  const SlurmEnv slurm(Env{{"SLURM_CPUS_PER_TASK", "1"}});
  CHECK(parsed({"--nproc-per-node", "cpu", "--", "true"}).nproc_per_node == 1);
}
