// A run's loss curves as an SVG drawn by hand (no plotting library): train loss by optimizer step
// as a line, eval loss at each evaluation as markers, with axes, tick labels, a legend and a title;
// or any other figure of metrics.jsonl the same way (GRPO's reward, its eval_ twin as markers).
// What `lora-data plot OUTPUT_DIR [--metric KEY]` writes.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lorarun::track {

// (step, loss) points of a run, in step order.
struct LossCurves {
  std::string metric = "loss";                    // the figure plotted
  std::vector<std::pair<int64_t, double>> train;  // metrics.jsonl rows with it
  std::vector<std::pair<int64_t, double>> eval;   // rows with "eval_" + it
};

// The `metric` rows of a metrics.jsonl file. A last line without its newline (a row being written)
// is left out. Throws lorarun::Error when the file is missing or a line is not a JSON object.
LossCurves read_loss_curves(const std::string& metrics_path, const std::string& metric = "loss");

// The SVG document of `curves` under `title`. Throws lorarun::Error when there is no train point.
std::string loss_svg(const LossCurves& curves, const std::string& title);

// Reads `output_dir`/metrics.jsonl and writes its `metric` curves to `out` (empty:
// `output_dir`/<metric>.svg, '/' as '_'). Returns the path written. Throws lorarun::Error when the
// file is missing or holds no row of it.
std::string plot_loss(const std::string& output_dir, const std::string& out = "", const std::string& metric = "loss");

}  // namespace lorarun::track
