#include <catch2/catch.hpp>
#include <cstdlib>

#include "dist/env.hpp"
#include "util/error.hpp"

using lorarun::dist::DistEnv;

namespace {
void clear_env() {
  for (const char* v : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"})
    unsetenv(v);
}
}  // namespace

TEST_CASE("DistEnv without a launcher is a world of one") {
  clear_env();
  const DistEnv e = DistEnv::from_environment();
  CHECK_FALSE(e.launched);
  CHECK(e.rank == 0);
  CHECK(e.world_size == 1);
  CHECK(e.master_addr == "127.0.0.1");
  CHECK(e.master_port == 0);  // any free port: two hand-started runs never collide
}

TEST_CASE("DistEnv reads torchrun's variables") {
  clear_env();
  setenv("RANK", "5", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("WORLD_SIZE", "8", 1);
  setenv("LOCAL_WORLD_SIZE", "4", 1);
  setenv("MASTER_ADDR", "node0", 1);
  setenv("MASTER_PORT", "29512", 1);
  const DistEnv e = DistEnv::from_environment();
  CHECK(e.launched);
  CHECK(e.rank == 5);
  CHECK(e.local_rank == 1);
  CHECK(e.world_size == 8);
  CHECK(e.local_world_size == 4);
  CHECK(e.master_addr == "node0");
  CHECK(e.master_port == 29512);
  clear_env();
}

TEST_CASE("DistEnv rejects inconsistent values with a message naming the variable") {
  clear_env();
  setenv("RANK", "2", 1);
  setenv("WORLD_SIZE", "2", 1);
  CHECK_THROWS_WITH(DistEnv::from_environment(), Catch::Contains("RANK=2 is not below WORLD_SIZE=2"));
  setenv("RANK", "x", 1);
  CHECK_THROWS_WITH(DistEnv::from_environment(), Catch::Contains("RANK='x'"));
  setenv("RANK", "0", 1);
  setenv("MASTER_PORT", "70000", 1);
  CHECK_THROWS_WITH(DistEnv::from_environment(), Catch::Contains("MASTER_PORT=70000"));
  clear_env();
}
