// How one rank's examples of an epoch become micro-batches, and how a micro-batch becomes rows.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

#include "data/source.hpp"

namespace lorarun::data {

struct BatchPlan {
  int64_t batch = 4;   // documents per micro-batch
  int64_t accum = 1;   // micro-batches per optimizer step
  int64_t window = 1;  // steps grouped by length together; 1 = no grouping (reading order)
  uint64_t seed = 42;
  int64_t epoch = 0;
};

// The micro-batches of one epoch from `first_step` on. Without grouping, micro-batch k holds
// documents [k*batch, (k+1)*batch) of the rank's order. With grouping, the documents of each
// window of steps are sorted by length (stable), cut into micro-batches, and those are put in an
// order drawn from (seed, epoch, window), so a step mixes lengths less but the window's documents
// stay the same. A window with rejected documents ends with empty micro-batches, so every window
// has window*accum of them and a resume at any step rebuilds exactly the same micro-batches.
class MicroBatches {
 public:
  MicroBatches(const Documents& docs, const ExampleBuilder& builder, const ShardSpec& spec, const BatchPlan& plan,
               int64_t first_step);
  // data.sources: the mixture's epoch, batched alike.
  MicroBatches(const Mixture& mix, const ShardSpec& spec, const BatchPlan& plan, int64_t first_step);
  // The next micro-batch (its examples and the rejections met while reading it).
  std::vector<Built> next();
  const ShardReader& reader() const { return *reader_; }

 private:
  // `open(start)`: the rank's reader from document `start` of its order on.
  MicroBatches(const BatchPlan& plan, int64_t first_step,
               const std::function<std::unique_ptr<ShardReader>(int64_t start)>& open);
  void fill_window();
  BatchPlan plan_;
  std::unique_ptr<ShardReader> reader_;
  std::vector<std::vector<Built>> window_;  // micro-batches of the current window, in order
  size_t next_ = 0;
  int64_t window_index_ = 0;
};

// First-fit decreasing: which documents (indices into `lengths`) share each row of `capacity`
// tokens. Every length must be <= capacity. Rows in the order they were opened.
std::vector<std::vector<size_t>> pack_rows(const std::vector<size_t>& lengths, size_t capacity);

}  // namespace lorarun::data
