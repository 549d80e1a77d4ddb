#include <fmt/format.h>
#include <catch2/catch.hpp>

#include "support/oracle.hpp"
#include "train/schedule.hpp"

using namespace lorarun;

// transformers' own schedules (get_*_schedule_with_warmup) on the same steps are the reference.
TEST_CASE("lr schedules equal transformers' with warmup", "[reference]") {
  const int64_t warmup = 7, total = 50;
  for (const std::string name : {"constant", "linear", "cosine"}) {
    INFO(name);
    const test::Oracle r =
        test::oracle(fmt::format("'{}' '{}/tests/reference/probe.py' lr-schedule {} {} {} {}", LORARUN_PYTHON,
                                 LORARUN_SOURCE_DIR, name, warmup, total, total + 3));
    INFO(r.run.output);
    REQUIRE(r.run.status == 0);
    const std::vector<double> want = r.fields.at("factors");
    REQUIRE(want.size() == size_t(total + 3));
    for (int64_t step = 0; step < total + 3; ++step) {
      INFO("step " << step);
      CHECK(train::lr_factor(train::parse_schedule(name), step, warmup, total) == Approx(want[step]).margin(1e-12));
    }
  }
}
