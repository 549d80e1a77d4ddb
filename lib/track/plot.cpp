#include "track/plot.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <string_view>

#include "io/files.hpp"
#include "util/error.hpp"
#include "util/untrusted.hpp"

namespace lorarun::track {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;
using Points = std::vector<std::pair<int64_t, double>>;

// The drawing: an 800 x 480 canvas, the plot area inside these edges.
constexpr double kWidth = 800, kHeight = 480;
constexpr double kLeft = 76, kRight = 776, kTop = 64, kBottom = 420;
constexpr std::string_view kTrainColour = "#1f77b4", kEvalColour = "#d62728";

// An axis: its domain [lo, hi] and the spacing of its ticks, which fall on whole multiples of it;
// or (log) a logarithmic one over whole decades [lo, hi], its ticks at 1, 2 and 5 of each decade
// (each power of ten alone beyond three decades).
struct Axis {
  double lo = 0, hi = 1, step = 1;
  bool log = false;
};

// Adds a metrics.jsonl row's figure (a training row) or eval_ figure (an evaluation row) to `c`.
void add_row(LossCurves& c, const json& row) {
  const auto step = row.find("step");
  if (step == row.end() || !step->is_number_integer()) return;
  const auto loss = row.find(c.metric), eval = row.find("eval_" + c.metric);
  if (loss != row.end() && loss->is_number()) c.train.emplace_back(step->get<int64_t>(), loss->get<double>());
  if (eval != row.end() && eval->is_number()) c.eval.emplace_back(step->get<int64_t>(), eval->get<double>());
}

// A tick spacing of 1, 2 or 5 times a power of ten that cuts `span` into about `target` pieces.
double nice_step(double span, int target) {
  const double raw = span / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  const double norm = raw / magnitude;
  return (norm < 1.5 ? 1 : norm < 3 ? 2 : norm < 7 ? 5 : 10) * magnitude;
}

// An axis holding [lo, hi], widened to whole tick spacings; `whole`: ticks on integers (steps).
Axis nice_axis(double lo, double hi, bool whole) {
  if (hi <= lo) {
    const double pad = whole ? 1.0 : std::max(std::abs(lo) * 0.1, 0.1);
    lo -= pad;
    hi += pad;
  }
  Axis a;
  a.step = nice_step(hi - lo, 6);
  if (whole) a.step = std::max(1.0, std::round(a.step));
  a.lo = std::floor(lo / a.step) * a.step;
  a.hi = std::ceil(hi / a.step) * a.step;
  return a;
}

// The decades holding [lo, hi] (both above 0), as a logarithmic axis.
Axis log_axis(double lo, double hi) {
  return {.lo = std::pow(10.0, std::floor(std::log10(lo))),
          .hi = std::pow(10.0, std::ceil(std::log10(hi))),
          .step = 10,
          .log = true};
}

// The tick values of `a`, lo to hi.
std::vector<double> ticks(const Axis& a) {
  std::vector<double> out;
  if (a.log) {
    const int decades = static_cast<int>(std::lround(std::log10(a.hi / a.lo)));
    for (int d = 0; d <= decades; ++d)
      for (const double m : decades <= 3 ? std::vector<double>{1, 2, 5} : std::vector<double>{1})
        if (const double v = a.lo * std::pow(10.0, d) * m; v <= a.hi * (1 + 1e-9)) out.push_back(v);
    return out;
  }
  for (int i = 0; a.lo + i * a.step <= a.hi + a.step * 1e-9; ++i) {
    const double v = a.lo + i * a.step;
    out.push_back(std::abs(v) < a.step * 1e-9 ? 0.0 : v);
  }
  return out;
}

// Canvas coordinates of a step and of a loss.
double px(const Axis& x, double v) { return kLeft + (v - x.lo) / (x.hi - x.lo) * (kRight - kLeft); }
double py(const Axis& y, double v) {
  const double at = y.log ? std::log10(v / y.lo) / std::log10(y.hi / y.lo) : (v - y.lo) / (y.hi - y.lo);
  return kBottom - at * (kBottom - kTop);
}

// `text` with XML's special characters escaped, for element content and attribute values.
std::string xml_escape(std::string_view text) {
  std::string out;
  for (const char ch : text) {
    switch (ch) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out += ch;
    }
  }
  return out;
}

// The axes of `c`: steps over both curves, losses over both curves, on a logarithmic axis when they
// span more than a decade (a loss that falls from 4.8 to 0.0009 is otherwise flat after its start).
std::pair<Axis, Axis> axes_of(const LossCurves& c) {
  double x0 = c.train.front().first, x1 = x0, y0 = c.train.front().second, y1 = y0;
  for (const Points* points : {&c.train, &c.eval})
    for (const auto& [step, loss] : *points) {
      x0 = std::min<double>(x0, step);
      x1 = std::max<double>(x1, step);
      y0 = std::min(y0, loss);
      y1 = std::max(y1, loss);
    }
  if (y0 > 0 && y1 > 10 * y0) return {nice_axis(x0, x1, true), log_axis(y0, y1)};
  return {nice_axis(x0, x1, true), nice_axis(y0, y1, false)};
}

// Grid lines, axis lines, tick marks and tick labels, and the axes' names.
std::string draw_axes(const Axis& x, const Axis& y, const std::string& metric) {
  std::string grid = R"(<g class="grid" stroke="#e5e5e5" stroke-width="1">)", labels = R"(<g class="ticks">)";
  for (const double v : ticks(x)) {
    const double at = px(x, v);
    grid += fmt::format(R"(<line x1="{0:.2f}" y1="{1}" x2="{0:.2f}" y2="{2}"/>)", at, kTop, kBottom);
    labels +=
        fmt::format(R"(<line x1="{0:.2f}" y1="{1}" x2="{0:.2f}" y2="{2}" stroke="#333"/>)", at, kBottom, kBottom + 5);
    labels += fmt::format(R"(<text x="{:.2f}" y="{}" text-anchor="middle">{:g}</text>)", at, kBottom + 19, v);
  }
  for (const double v : ticks(y)) {
    const double at = py(y, v);
    grid += fmt::format(R"(<line x1="{1}" y1="{0:.2f}" x2="{2}" y2="{0:.2f}"/>)", at, kLeft, kRight);
    labels += fmt::format(R"(<line x1="{1}" y1="{0:.2f}" x2="{2}" y2="{0:.2f}" stroke="#333"/>)", at, kLeft - 5, kLeft);
    labels += fmt::format(R"(<text x="{}" y="{:.2f}" text-anchor="end" dominant-baseline="middle">{:g}</text>)",
                          kLeft - 8, at, v);
  }
  grid += "</g>\n";
  labels += "</g>\n";
  const std::string lines =
      fmt::format(R"(<g class="axes" stroke="#333" stroke-width="1"><line x1="{0}" y1="{2}" x2="{1}" y2="{2}"/>)"
                  R"(<line x1="{0}" y1="{3}" x2="{0}" y2="{2}"/></g>)"
                  "\n",
                  kLeft, kRight, kBottom, kTop);
  const std::string names = fmt::format(
      R"(<text class="axis-name" x="{}" y="{}" text-anchor="middle">optimizer step</text>)"
      R"svg(<text class="axis-name" transform="translate(20 {}) rotate(-90)" text-anchor="middle">{}</text>)svg"
      "\n",
      (kLeft + kRight) / 2, kHeight - 14, (kTop + kBottom) / 2, xml_escape(y.log ? metric + " (log scale)" : metric));
  return grid + lines + labels + names;
}

// The train loss as one polyline, a point per row.
std::string draw_train(const Points& train, const Axis& x, const Axis& y) {
  std::string points;
  for (const auto& [step, loss] : train)
    fmt::format_to(std::back_inserter(points), "{}{:.2f},{:.2f}", points.empty() ? "" : " ", px(x, step), py(y, loss));
  return fmt::format(R"(<polyline class="train-loss" fill="none" stroke="{}" stroke-width="1.5" points="{}"/>)"
                     "\n",
                     kTrainColour, points);
}

// The eval loss as a marker per evaluation.
std::string draw_eval(const Points& eval, const Axis& x, const Axis& y, const std::string& metric) {
  std::string out = fmt::format(R"(<g class="eval-loss" fill="{}" stroke="white">)", kEvalColour);
  for (const auto& [step, loss] : eval)
    out += fmt::format(R"(<circle cx="{:.2f}" cy="{:.2f}" r="4"><title>step {}: eval {} {:.6g}</title></circle>)",
                       px(x, step), py(y, loss), step, xml_escape(metric), loss);
  return out + "</g>\n";
}

// The legend, top right inside the plot: a line for train loss, a marker for eval loss (when any).
std::string draw_legend(bool with_eval, const std::string& metric) {
  const double x = kRight - 128, y = kTop + 8;
  std::string out = fmt::format(
      R"(<g class="legend"><rect x="{}" y="{}" width="120" height="{}" fill="white" stroke="#bbb"/>)"
      R"(<line x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}" stroke-width="1.5"/>)"
      R"(<text x="{}" y="{}" dominant-baseline="middle">train {}</text>)",
      x, y, with_eval ? 44 : 26, x + 8, y + 13, x + 32, y + 13, kTrainColour, x + 40, y + 13, xml_escape(metric));
  if (with_eval)
    out += fmt::format(R"(<circle cx="{}" cy="{}" r="4" fill="{}"/><text x="{}" y="{}" dominant-baseline="middle">)"
                       "eval {}</text>",
                       x + 20, y + 31, kEvalColour, x + 40, y + 31, xml_escape(metric));
  return out + "</g>\n";
}

// The title, and under it the last values of each curve.
std::string draw_title(const std::string& title, const LossCurves& c) {
  std::string last =
      fmt::format("last train {} {:.4g} at step {}", c.metric, c.train.back().second, c.train.back().first);
  if (!c.eval.empty())
    last += fmt::format(", last eval {} {:.4g} at step {}", c.metric, c.eval.back().second, c.eval.back().first);
  return fmt::format(
      R"(<text class="title" x="{0}" y="26" text-anchor="middle" font-size="16" font-weight="bold">{1}</text>)"
      R"(<text class="subtitle" x="{0}" y="46" text-anchor="middle" fill="#555">{2}</text>)"
      "\n",
      kWidth / 2, xml_escape(title), last);
}

// The name a run directory is shown by: its last path component.
std::string run_name(const std::string& output_dir) {
  fs::path p = fs::absolute(output_dir).lexically_normal();
  if (!p.has_filename()) p = p.parent_path();
  return p.filename().string();
}

}  // namespace

LossCurves read_loss_curves(const std::string& metrics_path, const std::string& metric) {
  if (!fs::is_regular_file(metrics_path))
    throw Error(
        fmt::format("{} does not exist: give the checkpoint.output_dir of a run that has started", metrics_path));
  const std::string text = io::read_file(metrics_path);
  LossCurves c;
  c.metric = metric;
  size_t at = 0;
  for (int64_t n = 1; at < text.size(); ++n) {
    const size_t end = text.find('\n', at);
    const std::string_view line(text.data() + at, (end == std::string::npos ? text.size() : end) - at);
    at = end == std::string::npos ? text.size() : end + 1;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    const json row = json::parse(line, nullptr, false);
    if (row.is_object()) {
      add_row(c, row);
    } else if (end != std::string::npos) {
      throw Error(fmt::format("{}:{}: not a JSON object; fix or remove that line", metrics_path, n));
    }
  }
  const auto by_step = [](const auto& a, const auto& b) { return a.first < b.first; };
  std::stable_sort(c.train.begin(), c.train.end(), by_step);
  std::stable_sort(c.eval.begin(), c.eval.end(), by_step);
  return c;
}

std::string loss_svg(const LossCurves& curves, const std::string& title) {
  if (curves.train.empty()) throw Error("no training loss to plot: the run has logged no step yet");
  const auto [x, y] = axes_of(curves);
  std::string svg =
      fmt::format(R"(<?xml version="1.0" encoding="UTF-8"?>)"
                  "\n"
                  R"(<svg xmlns="http://www.w3.org/2000/svg" width="{0}" height="{1}" viewBox="0 0 {0} {1}" )"
                  R"(font-family="sans-serif" font-size="12">)"
                  "\n<title>{2}</title>\n"
                  R"(<rect width="{0}" height="{1}" fill="white"/>)"
                  "\n",
                  kWidth, kHeight, xml_escape(title));
  svg += draw_title(title, curves);
  svg += draw_axes(x, y, curves.metric);
  svg += draw_train(curves.train, x, y);
  if (!curves.eval.empty()) svg += draw_eval(curves.eval, x, y, curves.metric);
  svg += draw_legend(!curves.eval.empty(), curves.metric);
  return svg + "</svg>\n";
}

std::string plot_loss(const std::string& output_dir, const std::string& out, const std::string& metric) {
  const std::string metrics = (fs::path(output_dir) / "metrics.jsonl").string();
  const LossCurves curves = read_loss_curves(metrics, metric);
  if (curves.train.empty())
    throw Error(fmt::format("{} holds no training {} row: plot a run once it has logged a step{}", metrics,
                            printable(metric), metric == "loss" ? "" : ", and a figure its metrics rows hold"));
  std::string file = metric + ".svg";
  std::replace(file.begin(), file.end(), '/', '_');
  const std::string path = out.empty() ? (fs::path(output_dir) / file).string() : out;
  io::write_file_atomic(path, loss_svg(curves, run_name(output_dir) + ": " + metric + " by optimizer step"));
  return path;
}

}  // namespace lorarun::track
