#include "train/profile.hpp"

#include <fmt/format.h>
#include <torch/csrc/autograd/profiler_kineto.h>

#include <cstdlib>
#include <filesystem>
#include <memory>
#include <set>

#include "util/log.hpp"

namespace lorarun::train {

namespace fs = std::filesystem;
namespace prof = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;

namespace {
constexpr int64_t kWarmUp = 2;  // the first steps allocate and fill caches: not what a step costs
}

StepProfiler::StepProfiler(std::optional<int> steps, const std::string& output_dir, int rank, bool cuda)
    : steps_(steps),
      path_(steps ? (fs::path(output_dir) / "profile" / fmt::format("rank_{}.json", rank)).string() : ""),
      cuda_(cuda) {}

StepProfiler::~StepProfiler() {
  if (!on_) return;
  try {
    write();
  } catch (const std::exception& e) {
    warn(fmt::format("train.profile_steps: the trace was not written: {}", e.what()));
  }
}

void StepProfiler::before_step() {
  if (!steps_ || seen_++ != kWarmUp) return;
  std::set<ActivityType> what{ActivityType::CPU};
  if (cuda_)
    what.insert(ActivityType::CUDA);
  else
    setenv("KINETO_LOG_LEVEL", "5", 0);  // (Kineto says it found no GPU, as an error, where none is sought)
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO,
                                                     /*report_input_shapes=*/true);
  prof::prepareProfiler(config, what);
  prof::enableProfiler(config, what);
  on_ = true;
}

void StepProfiler::after_step() {
  if (!on_ || ++recorded_ < *steps_) return;
  write();
}

// The trace, written to a temporary name and renamed: a reader never sees half of it.
void StepProfiler::write() {
  on_ = false;
  const std::unique_ptr<prof::ProfilerResult> result = prof::disableProfiler();
  fs::create_directories(fs::path(path_).parent_path());
  const std::string tmp = path_ + ".tmp";
  result->save(tmp);
  fs::rename(tmp, path_);
  info(fmt::format("profiled {} step{} (after {}) into {}{}", recorded_, recorded_ == 1 ? "" : "s", kWarmUp, path_,
                   recorded_ < *steps_ ? fmt::format(" (the run ended before train.profile_steps {})", *steps_) : ""));
}

}  // namespace lorarun::train
