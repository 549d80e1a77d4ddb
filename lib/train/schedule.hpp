// Learning-rate schedules with linear warmup, as transformers' get_*_schedule_with_warmup.
#pragma once
#include <cstdint>
#include <string_view>

namespace lorarun::recipe {
enum class Scheduler;
}

namespace lorarun::train {

enum class Schedule { Constant, Linear, Cosine };

Schedule parse_schedule(std::string_view name);  // constant | linear | cosine
Schedule schedule_of(recipe::Scheduler s);       // the recipe's train.lr_scheduler

// The multiplier of the base lr for the optimizer step that follows `step` completed steps,
// out of `total` steps, the first `warmup` of them warming up linearly from 0.
double lr_factor(Schedule s, int64_t step, int64_t warmup, int64_t total);

}  // namespace lorarun::train
