#include <catch2/catch.hpp>
#include <string>
#include <vector>

#include "launch.hpp"
#include "util/error.hpp"

using namespace lorarun::launch;

namespace {
Parsed parse(std::vector<std::string> args) {
  args.insert(args.begin(), "lorarun");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  return parse_args(static_cast<int>(argv.size()), argv.data(), "/opt/lorarun/bin/lorarun");
}
}  // namespace

TEST_CASE("a command after -- is run as given") {
  const Parsed p = parse({"--nproc-per-node", "3", "--master-port", "29999", "--", "echo", "--nproc-per-node", "x"});
  REQUIRE(p.exit_code < 0);
  CHECK(p.config.nproc_per_node == 3);
  CHECK(p.config.master_port == 29999);
  CHECK(p.config.command == std::vector<std::string>{"echo", "--nproc-per-node", "x"});
}

TEST_CASE("a recipe runs lora-train with the recipe and its overrides") {
  const Parsed p = parse({"--nproc-per-node", "2", "configs/q.yaml", "train.lr=1e-4"});
  REQUIRE(p.exit_code < 0);
  // Not installed beside this fake path, so lora-train comes from PATH.
  CHECK(p.config.command == std::vector<std::string>{"lora-train", "configs/q.yaml", "train.lr=1e-4"});
  CHECK(p.config.master_port > 0);  // single node: a free port was chosen
}

TEST_CASE("bad launcher arguments are one clear error") {
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "two", "--", "true"}), Catch::Contains("'two' is not a positive integer"));
  CHECK_THROWS_WITH(parse({"--nproc-per-node", "2"}), Catch::Contains("nothing to run"));
  CHECK_THROWS_WITH(parse({"--nnodes", "2", "--node-rank", "2", "--", "true"}),
                    Catch::Contains("--node-rank 2 must be below --nnodes 2"));
}

TEST_CASE("workers get torchrun's environment") {
  Config c;
  c.nproc_per_node = 4;
  c.nnodes = 2;
  c.node_rank = 1;
  c.master_addr = "10.0.0.1";
  c.master_port = 29500;
  c.run_id = "job7";
  const auto env = worker_env(c, 2);
  auto has = [&](const std::string& kv) { return std::find(env.begin(), env.end(), kv) != env.end(); };
  CHECK(has("RANK=6"));
  CHECK(has("LOCAL_RANK=2"));
  CHECK(has("WORLD_SIZE=8"));
  CHECK(has("LOCAL_WORLD_SIZE=4"));
  CHECK(has("GROUP_RANK=1"));
  CHECK(has("MASTER_ADDR=10.0.0.1"));
  CHECK(has("MASTER_PORT=29500"));
  CHECK(has("TORCHELASTIC_RUN_ID=job7"));
  CHECK(has("TORCHELASTIC_RESTART_COUNT=0"));
}
