// Sharded tensors (lib/dist/sharded.hpp) rebuilt by all-gather over real Gloo ranks: sizes the
// world size does not divide, float32, bf16 and uint8, and two gathers in flight at once.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "support/process.hpp"

using namespace lorarun::test;

TEST_CASE("sharded tensors are rebuilt bit for bit by all-gather over Gloo on 1, 2 and 3 ranks", "[e2e]") {
  for (const int world : {1, 2, 3}) {
    const Result r =
        sh(fmt::format("{} --nproc-per-node {} -- {} --check", bin("lorarun"), world, bin("gather_bench")));
    INFO(r.output);
    CHECK(r.status == 0);
    int ranks = 0;
    for (size_t at = r.output.find("{\"rank\""); at != std::string::npos; at = r.output.find("{\"rank\"", at + 1)) {
      const nlohmann::json j = nlohmann::json::parse(r.output.substr(at, r.output.find('}', at) - at + 1));
      CHECK(j["world"] == world);
      CHECK(j["cases"] == 17);
      CHECK(j["wrong"] == 0);
      ++ranks;
    }
    CHECK(ranks == world);
  }
}
