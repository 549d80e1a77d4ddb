#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <sstream>

#include "support/process.hpp"
#include "train/schedule.hpp"

using namespace lorarun;

// transformers' own schedules (get_*_schedule_with_warmup) on the same steps are the reference.
TEST_CASE("lr schedules equal transformers' with warmup") {
  const int64_t warmup = 7, total = 50;
  for (const std::string name : {"constant", "linear", "cosine"}) {
    INFO(name);
    const test::Result r = test::sh(fmt::format(
        "'{}' -c \"import torch, transformers as t; o = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0); "
        "s = t.get_scheduler('{}' if '{}' != 'constant' else 'constant_with_warmup', o, num_warmup_steps={}, "
        "num_training_steps={}); print(' '.join(repr(l(i)) for l in s.lr_lambdas for i in range({})))\"",
        LORARUN_PYTHON, name, name, warmup, total, total + 3));
    REQUIRE(r.status == 0);
    std::istringstream in(r.output);
    for (int64_t step = 0; step < total + 3; ++step) {
      double want = -1;
      in >> want;
      CHECK(train::lr_factor(train::parse_schedule(name), step, warmup, total) == Approx(want).margin(1e-12));
    }
  }
}
