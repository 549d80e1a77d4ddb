// Documents a run skips (bad, overlong, nothing to train, deleted), by cause: counted on each rank
// in a step, summed over the ranks with the step's figures, kept for the epoch and the run. An
// epoch that skips more than data.max_skipped_share of its documents stops the run.
#pragma once
#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>

#include "data/example.hpp"

namespace lorarun::train {

class Skips {
 public:
  static constexpr int kCauses = data::Rejection::kCauses;
  using Counts = std::array<double, kCauses>;

  // A document this rank skipped in the current step (the first of each cause kept as an example).
  void count(const data::Rejection& r);
  // This rank's counts of the current step, then zero.
  Counts take();
  // All ranks' counts of a step (kCauses doubles), added to the epoch's and the run's.
  void add(const double* all);
  // Throws ConfigError when the epoch has skipped more than `share` of its `epoch_documents` (those
  // its steps read on every rank together), naming the commonest cause; `who` starts the message
  // ("adapter 'a': ", or empty).
  void check(int epoch, int64_t epoch_documents, double share, const std::string& who = "") const;
  // A new epoch (or a resumed one, counted from where it resumes).
  void new_epoch() { epoch_ = {}; }

  double epoch_total() const;
  double run_total() const;
  // A step's metrics: {"skipped": n, "skipped/<cause>": m for each cause with some}.
  static nlohmann::json figures(const double* all);
  // The run's, as one line: "23 documents were skipped on all ranks together: 20 overlong, 3 malformed".
  std::string summary() const;

 private:
  Counts step_{}, epoch_{}, run_{};
  std::array<std::string, kCauses> example_;  // "document 7: field 'output' is missing"
};

}  // namespace lorarun::train
