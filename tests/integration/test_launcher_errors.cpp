// lorarun's errors: each one line, printed once, quickly — a master that is not there, a rank
// count that is a typo, a recipe error on every rank, a recipe without .yaml.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "support/process.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;

TEST_CASE("a node whose master never starts fails after --rdzv-timeout with one line naming the master", "[e2e]") {
  const int port = free_port();
  const Result r =
      sh(fmt::format("{} --nnodes 2 --node-rank 1 --nproc-per-node 1 --master-addr 127.0.0.1 "
                     "--master-port {} --rdzv-timeout 3 -- {} --dist-check",
                     bin("lorarun"), port, bin("lora-train")));
  INFO(r.output);
  CHECK(r.status == 1);
  CHECK(r.seconds < 15);
  const auto errors = lines_with(r.output, "error");
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0],
             Catch::Contains(fmt::format("rank 1 could not reach the master at 127.0.0.1:{} within 3 s", port)));
  CHECK_THAT(errors[0],
             Catch::Contains("node 0 is started") && Catch::Contains("--master-addr") && Catch::Contains("firewall"));
  CHECK_THAT(r.output, !Catch::Contains("frame #") && !Catch::Contains("Exception raised from"));
}

TEST_CASE("node 0 whose other node never comes says how many ranks joined", "[e2e]") {
  const int port = free_port();
  const Result r =
      sh(fmt::format("{} --nnodes 2 --node-rank 0 --nproc-per-node 2 --master-addr 127.0.0.1 "
                     "--master-port {} --rdzv-conf join_timeout=3 -- {} --dist-check",
                     bin("lorarun"), port, bin("lora-train")));
  INFO(r.output);
  CHECK(r.status == 1);
  CHECK(r.seconds < 15);
  const auto errors = lines_with(r.output, "error");
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains(fmt::format("rendezvous at 127.0.0.1:{} timed out after 3 s with 2 of 4 ranks "
                                                    "joined",
                                                    port)));
  CHECK_THAT(r.output, !Catch::Contains("frame #"));
}

TEST_CASE("lorarun passes the rendezvous timeout to its ranks", "[e2e]") {
  const Result r = sh(fmt::format("{} --rdzv-timeout 42 -- sh -c 'echo rdzv $LORARUN_RDZV_TIMEOUT'", bin("lorarun")));
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("[rank0]: rdzv 42\n"));
}

TEST_CASE("lorarun --nproc-per-node beyond the limit is one line naming the limit and --nproc-limit", "[e2e]") {
  const Result r = sh(fmt::format("{} --nproc-per-node 100000 -- true", bin("lorarun")));
  INFO(r.output);
  CHECK(r.status == 1);
  CHECK(r.seconds < 5);
  CHECK(count_lines(r.output) == 1);
  CHECK_THAT(r.output, Catch::StartsWith("lorarun: error: --nproc-per-node 100000 is above the limit of "));
  CHECK_THAT(r.output, Catch::Contains("pass --nproc-limit 100000"));
  CHECK_THAT(r.output, !Catch::Contains("started"));
  const Result over = sh(fmt::format("{} --nproc-per-node 3 --nproc-limit 2 -- true", bin("lorarun")));
  CHECK(over.status == 1);
  CHECK_THAT(over.output, Catch::Contains("--nproc-per-node 3 is above --nproc-limit 2"));
  const Result allowed = sh(fmt::format("{} --nproc-per-node 3 --nproc-limit 3 -- true", bin("lorarun")));
  INFO(allowed.output);
  CHECK(allowed.status == 0);
}

TEST_CASE("a recipe error on every rank is printed once", "[e2e]") {
  const std::string error = "unknown key 'train.learning_rate'; did you mean 'train.lr'?";
  const Result r = sh(fmt::format("cd '{}' && {} --nproc-per-node 2 configs/quickstart.yaml train.learning_rate=2e-4",
                                  LORARUN_SOURCE_DIR, bin("lorarun")));
  INFO(r.output);
  CHECK(r.status == 78);
  CHECK(occurrences(r.output, error) == 1);
  CHECK(lines_with(r.output, "lora-train: error:").size() == 1);
  CHECK_THAT(r.output, Catch::Contains("failed first: exited with code 78"));
}

TEST_CASE("a runtime error on every rank is printed once", "[e2e]") {
  // Both ranks rendezvous, then fail the same way loading the model.
  const std::string dir = temp_dir("error-once");
  std::ofstream(dir + "/d.jsonl") << "{\"instruction\": \"a\", \"output\": \"b\"}\n";
  const Result r =
      sh(fmt::format("cd '{}' && {} --nproc-per-node 2 configs/quickstart.yaml model.path={}/no-model "
                     "data.source=jsonl data.path={}/d.jsonl track.mongodb=false checkpoint.keep_best=false "
                     "checkpoint.output_dir={}/out",
                     LORARUN_SOURCE_DIR, bin("lorarun"), dir, dir, dir));
  INFO(r.output);
  CHECK(r.status == 78);  // no model there: a restart cannot change it
  const auto errors = lines_with(r.output, "lora-train: error:");
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("no-model"));
}

TEST_CASE("a recipe file without .yaml is a recipe, a missing one is one line", "[e2e]") {
  const std::string dir = temp_dir("recipe-name");
  std::filesystem::copy_file(std::string(LORARUN_SOURCE_DIR) + "/configs/quickstart.yaml", dir + "/quickstart");
  const Result r = sh(fmt::format("cd '{}' && {} --nproc-per-node 2 {}/quickstart train.lr=2e-4 --dry-run",
                                  LORARUN_SOURCE_DIR, bin("lorarun"), dir));
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("[rank1]:   lr: 0.0002"));

  const Result missing = sh(fmt::format("{} --nproc-per-node 2 {}/nope train.lr=2e-4", bin("lorarun"), dir));
  INFO(missing.output);
  CHECK(missing.status == 1);
  CHECK(count_lines(missing.output) == 1);
  CHECK_THAT(missing.output, Catch::StartsWith(fmt::format("lorarun: error: '{}/nope' is neither a file nor a command "
                                                           "on PATH",
                                                           dir)));
  const Result typo = sh(fmt::format("{} --nproc-per-node 2 configs/quickstart", bin("lorarun")));
  CHECK(typo.status == 1);
  CHECK(count_lines(typo.output) == 1);
}
