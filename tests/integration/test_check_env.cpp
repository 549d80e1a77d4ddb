// lora-train --check-env against the FerretDB that scripts/test started, and against nothing.
#include <fmt/format.h>
#include <catch2/catch.hpp>

#include "support/oracle.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;

namespace {

// A TCP port on 127.0.0.1 that nothing listens on: the launcher's free-port choice.
int closed_port() {
  const Result r = sh(bin("lorarun") + " -- sh -c 'echo $MASTER_PORT'");
  const auto pos = r.output.rfind("[rank0]: ");
  REQUIRE(pos != std::string::npos);
  return std::stoi(r.output.substr(pos + 9));
}

}  // namespace

TEST_CASE("check-env prints torch, CUDA and NCCL facts", "[e2e]") {
  const Result r = sh(fmt::format("env -u LORARUN_MONGODB_URI {} --check-env", bin("lora-train")));
  INFO(r.output);
  CHECK(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("torch      2.11.0"));
  CHECK_THAT(r.output, Catch::Contains("cuda       not available, 0 GPUs"));
  CHECK_THAT(r.output, Catch::Contains("nccl       compiled in (NCCL 2."));
  CHECK_THAT(r.output, Catch::Contains("mongodb    not checked"));
}

TEST_CASE("check-env reports the real server version of FerretDB", "[e2e][db][reference]") {
  const std::string uri = test_uri();
  // The reference: what pymongo reads from the same server.
  const Oracle ref = oracle(
      fmt::format("'{}' '{}/tests/reference/probe.py' mongodb-version '{}'", LORARUN_PYTHON, LORARUN_SOURCE_DIR, uri));
  INFO(ref.run.output);
  REQUIRE(ref.run.status == 0);
  const std::string version = ref.fields.at("version");
  for (const std::string& how : {"--uri '" + uri + "'", std::string()}) {
    const Result r = sh(fmt::format("LORARUN_MONGODB_URI='{}' {} --check-env {}", uri, bin("lora-train"), how));
    INFO(r.output);
    CHECK(r.status == 0);
    CHECK_THAT(r.output, Catch::Contains(fmt::format("mongodb    {} (FerretDB v1.24.2) at 127.0.0.1:", version)));
  }
}

TEST_CASE("an unreachable server is one redacted line, a non-zero exit, within the timeout", "[e2e]") {
  const int port = closed_port();
  const std::string uri = fmt::format("mongodb://alice:s3cr3t-pw@127.0.0.1:{}/train", port);
  const Result r =
      sh(fmt::format("{} --check-env --timeout-ms 2000 --uri '{}'", bin("lora-train"), uri), Capture::StderrOnly);
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(r.seconds < 10);
  CHECK(count_lines(r.output) == 1);
  CHECK_THAT(r.output, Catch::StartsWith("lora-train: error: cannot reach MongoDB at mongodb://alice:****@127.0.0.1:"));
  CHECK_THAT(r.output, !Catch::Contains("s3cr3t"));
}

TEST_CASE("a malformed URI is one redacted line and a non-zero exit", "[e2e]") {
  for (const std::string uri :
       {"mongo://alice:s3cr3t-pw@localhost/", "mongodb://alice:s3cr3t-pw@/x", "mongodb://alice:s3cr3t-pw@h:99999/"}) {
    const Result r =
        sh(fmt::format("env LORARUN_MONGODB_URI='{}' {} --check-env", uri, bin("lora-train")), Capture::StderrOnly);
    INFO(r.output);
    CHECK(r.status != 0);
    CHECK(count_lines(r.output) == 1);
    CHECK_THAT(r.output, Catch::StartsWith("lora-train: error: invalid MongoDB URI"));
    CHECK_THAT(r.output, !Catch::Contains("s3cr3t"));
  }
}

TEST_CASE("a rank whose rendezvous fails exits with a clear error, not a hang", "[e2e]") {
  const int port = closed_port();
  const Result r =
      sh(fmt::format("RANK=1 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT={} {} --dist-check "
                     "--dist-timeout-s 3",
                     port, bin("lora-train")));
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(r.seconds < 20);
  CHECK(count_lines(r.output) == 1);
  CHECK_THAT(r.output, Catch::StartsWith(fmt::format("lora-train: error: rank 1 could not reach the master at "
                                                     "127.0.0.1:{} within 3 s",
                                                     port)));
  CHECK_THAT(r.output, !Catch::Contains("frame #"));
}
