#include "data/batches.hpp"

#include <algorithm>
#include <numeric>

#include "data/shard.hpp"

namespace lorarun::data {

MicroBatches::MicroBatches(const Documents& docs, const ExampleBuilder& builder, const ShardSpec& spec,
                           const BatchPlan& plan, int64_t first_step)
    : MicroBatches(plan, first_step,
                   [&](int64_t start) { return std::make_unique<ShardReader>(docs, builder, spec, start); }) {}

MicroBatches::MicroBatches(const Mixture& mix, const ShardSpec& spec, const BatchPlan& plan, int64_t first_step)
    : MicroBatches(plan, first_step, [&](int64_t start) { return std::make_unique<ShardReader>(mix, spec, start); }) {}

MicroBatches::MicroBatches(const BatchPlan& plan, int64_t first_step,
                           const std::function<std::unique_ptr<ShardReader>(int64_t)>& open)
    : plan_(plan), window_index_(first_step / plan.window) {
  reader_ = open(window_index_ * plan.window * plan.accum * plan.batch);
  fill_window();
  next_ = static_cast<size_t>((first_step % plan.window) * plan.accum);  // a resume mid-window
}

std::vector<Built> MicroBatches::next() {
  if (next_ == window_.size()) {
    ++window_index_;
    fill_window();
    next_ = 0;
  }
  return next_ < window_.size() ? std::move(window_[next_++]) : std::vector<Built>{};
}

void MicroBatches::fill_window() {
  const auto slots = static_cast<size_t>(plan_.window * plan_.accum);
  window_.assign(slots, {});
  if (plan_.window == 1) {  // reading order, no regrouping
    for (auto& mb : window_) mb = reader_->next(static_cast<size_t>(plan_.batch));
    return;
  }
  std::vector<Built> read = reader_->next(slots * static_cast<size_t>(plan_.batch));
  std::vector<Built> examples, rejected;
  for (Built& b : read) (std::holds_alternative<Example>(b) ? examples : rejected).push_back(std::move(b));
  std::stable_sort(examples.begin(), examples.end(), [](const Built& a, const Built& b) {
    return std::get<Example>(a).ids.size() > std::get<Example>(b).ids.size();
  });
  std::vector<std::vector<Built>> groups;
  for (size_t i = 0; i < examples.size(); i += static_cast<size_t>(plan_.batch)) {
    const size_t end = std::min(examples.size(), i + static_cast<size_t>(plan_.batch));
    groups.emplace_back(std::make_move_iterator(examples.begin() + static_cast<std::ptrdiff_t>(i)),
                        std::make_move_iterator(examples.begin() + static_cast<std::ptrdiff_t>(end)));
  }
  // Groups take the first slots in a drawn order; the empties (rejections' room) come last.
  const std::vector<int64_t> order = permutation(
      static_cast<int64_t>(groups.size()), plan_.seed ^ 0x9e3779b97f4a7c15ULL, plan_.epoch * 1000003 + window_index_);
  for (size_t k = 0; k < groups.size(); ++k) window_[k] = std::move(groups[static_cast<size_t>(order[k])]);
  if (!rejected.empty()) {
    auto& first = window_.front();
    first.insert(first.end(), std::make_move_iterator(rejected.begin()), std::make_move_iterator(rejected.end()));
  }
}

std::vector<std::vector<size_t>> pack_rows(const std::vector<size_t>& lengths, size_t capacity) {
  std::vector<size_t> by_length(lengths.size());
  std::iota(by_length.begin(), by_length.end(), 0);
  std::stable_sort(by_length.begin(), by_length.end(), [&](size_t a, size_t b) { return lengths[a] > lengths[b]; });
  std::vector<std::vector<size_t>> rows;
  std::vector<size_t> room;
  for (size_t i : by_length) {
    size_t r = 0;
    while (r < rows.size() && room[r] < lengths[i]) ++r;
    if (r == rows.size()) {
      rows.emplace_back();
      room.push_back(capacity);
    }
    rows[r].push_back(i);
    room[r] -= lengths[i];
  }
  return rows;
}

}  // namespace lorarun::data
