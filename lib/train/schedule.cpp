#include "train/schedule.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cmath>

#include "recipe/recipe.hpp"
#include "util/error.hpp"

namespace lorarun::train {

Schedule parse_schedule(std::string_view name) {
  if (name == "constant") return Schedule::Constant;
  if (name == "linear") return Schedule::Linear;
  if (name == "cosine") return Schedule::Cosine;
  throw Error(fmt::format("train.lr_scheduler must be one of cosine|linear|constant, got '{}'", name));
}

double lr_factor(Schedule s, int64_t step, int64_t warmup, int64_t total) {
  if (step < warmup) return static_cast<double>(step) / static_cast<double>(std::max<int64_t>(1, warmup));
  const double after = static_cast<double>(step - warmup) / static_cast<double>(std::max<int64_t>(1, total - warmup));
  switch (s) {
    case Schedule::Constant:
      return 1.0;
    case Schedule::Linear:
      return std::max(0.0, 1.0 - after);
    case Schedule::Cosine:
      return std::max(0.0, 0.5 * (1.0 + std::cos(M_PI * after)));  // half a cycle
  }
  return 1.0;
}

Schedule schedule_of(recipe::Scheduler s) {
  switch (s) {
    case recipe::Scheduler::Cosine:
      return Schedule::Cosine;
    case recipe::Scheduler::Linear:
      return Schedule::Linear;
    case recipe::Scheduler::Constant:
      return Schedule::Constant;
  }
  return Schedule::Cosine;
}

}  // namespace lorarun::train
