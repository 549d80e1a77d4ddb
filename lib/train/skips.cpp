#include "train/skips.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <numeric>

#include "util/error.hpp"

namespace lorarun::train {
namespace {

double total_of(const Skips::Counts& c) { return std::accumulate(c.begin(), c.end(), 0.0); }

// "20 overlong, 3 malformed": the causes with some, commonest first.
std::string by_cause(const Skips::Counts& c) {
  std::array<int, Skips::kCauses> order;
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int a, int b) { return c[a] > c[b]; });
  std::string out;
  for (const int i : order)
    if (c[i] > 0)
      out += fmt::format("{}{:.0f} {}", out.empty() ? "" : ", ", c[i],
                         data::cause_name(static_cast<data::Rejection::Cause>(i)));
  return out;
}

}  // namespace

void Skips::count(const data::Rejection& r) {
  const int c = r.cause();
  step_[c] += 1;
  if (example_[c].empty())
    example_[c] = fmt::format("{}: {}", r.document.empty() ? "a document" : "document " + r.document, r.reason);
}

Skips::Counts Skips::take() { return std::exchange(step_, Counts{}); }

void Skips::add(const double* all) {
  for (int i = 0; i < kCauses; ++i) {
    epoch_[i] += all[i];
    run_[i] += all[i];
  }
}

void Skips::check(int epoch, int64_t epoch_documents, double share, const std::string& who) const {
  const double skipped = epoch_total();
  if (skipped <= share * static_cast<double>(epoch_documents)) return;
  const int commonest = static_cast<int>(std::max_element(epoch_.begin(), epoch_.end()) - epoch_.begin());
  const std::string example = example_[commonest].empty() ? "" : fmt::format(" (here: {})", example_[commonest]);
  throw ConfigError(
      fmt::format("{}epoch {} skipped {:.0f} of its {} documents ({}), more than data.max_skipped_share {:g} allows: "
                  "most were {}{}; "
                  "fix the data or the data.* keys, or raise data.max_skipped_share",
                  who, epoch, skipped, epoch_documents, by_cause(epoch_), share,
                  data::cause_name(static_cast<data::Rejection::Cause>(commonest)), example));
}

double Skips::epoch_total() const { return total_of(epoch_); }
double Skips::run_total() const { return total_of(run_); }

nlohmann::json Skips::figures(const double* all) {
  double total = 0;
  nlohmann::json out = nlohmann::json::object();
  for (int i = 0; i < kCauses; ++i) {
    total += all[i];
    if (all[i] > 0)
      out[fmt::format("skipped/{}", data::cause_name(static_cast<data::Rejection::Cause>(i)))] =
          static_cast<int64_t>(all[i]);
  }
  out["skipped"] = static_cast<int64_t>(total);
  return out;
}

std::string Skips::summary() const {
  return fmt::format("{:.0f} documents were skipped on all ranks together: {}", run_total(), by_cause(run_));
}

}  // namespace lorarun::train
