// What adapters a job has (adapters.per's values, adapters.list), and one of them as a run.
#include "train/job.hpp"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <algorithm>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "data/source.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/untrusted.hpp"

namespace lorarun::train {
namespace {

// adapters.per: a value of the field as an adapter's name (text, or a whole number written out).
std::optional<std::string> name_of_value(const nlohmann::json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_number_integer()) return v.dump();
  return std::nullopt;
}

// Adapters whose names differ only in case would share a directory on a case-insensitive filesystem
// or object store: refused, `what` ("adapters.per: tenant holds") saying where the names came from.
void refuse_case_twins(const std::vector<recipe::AdapterSpec>& specs, const std::string& what) {
  std::map<std::string, std::string> folded;
  for (const recipe::AdapterSpec& s : specs)
    if (const auto [it, fresh] = folded.emplace(case_folded(s.name), s.name); !fresh)
      throw ConfigError(
          fmt::format("{} '{}' and '{}', which differ only in case: they would share a directory on a "
                      "case-insensitive filesystem or store; make them one, or narrow data.filter",
                      what, printable(it->second), printable(s.name)));
}

// The values of `field` in data's selection: in every source's, with data.sources.
data::FieldValues values_in_selection(const recipe::Recipe& r, const std::string& field) {
  if (r.data.sources.empty()) return data::field_values(r.data, field);
  data::FieldValues all;
  for (const recipe::DataSource& s : r.data.sources) {
    data::FieldValues one = data::field_values(r.data.of_source(s), field);
    for (nlohmann::json& v : one.values)
      if (std::find(all.values.begin(), all.values.end(), v) == all.values.end()) all.values.push_back(std::move(v));
    all.missing += one.missing;
    all.arrays += one.arrays;
  }
  return all;
}

}  // namespace

std::vector<recipe::AdapterSpec> job_adapters(const recipe::Recipe& r) {
  const recipe::AdaptersSection& a = r.adapters;
  if (a.per.empty()) return a.list;
  const data::FieldValues found = values_in_selection(r, a.per);
  if (found.arrays > 0)  // (a filter on one of its items would train the document in each item's adapter)
    throw ConfigError(fmt::format(
        "adapters.per: {} holds a list in {} document(s) of data's selection, which would train each of them in "
        "several adapters: its values must be text or whole numbers (narrow data.filter to leave those documents "
        "out)",
        a.per, found.arrays));
  std::vector<recipe::AdapterSpec> out;
  for (const nlohmann::json& v : found.values) {
    const std::optional<std::string> name = name_of_value(v);
    if (!name)
      throw ConfigError(fmt::format(
          "adapters.per: {} holds {} in some documents of data's selection, which cannot name an adapter: its values "
          "must be text or whole numbers (narrow data.filter to leave those documents out)",
          a.per, printable(v.dump(), 60)));
    if (!is_adapter_name(*name))
      throw ConfigError(fmt::format(
          "adapters.per: {} holds '{}', which cannot name an adapter's directory: values must be 1 to 64 letters, "
          "digits, '_', '+' or '-', not starting with '-' and not logs, tensorboard, best, resume_state or epoch_N "
          "(narrow data.filter to leave those documents out)",
          a.per, printable(*name, 80)));
    recipe::AdapterSpec spec;
    spec.name = *name;
    spec.filter = {{a.per, v}};
    out.push_back(std::move(spec));
  }
  if (out.empty())
    throw ConfigError(
        fmt::format("adapters.per: no document of data's selection ({}) has a field {}: check the field "
                    "name and data.filter",
                    r.data.filter.dump(), a.per));
  std::sort(out.begin(), out.end(), [](const auto& x, const auto& y) { return x.name < y.name; });
  for (size_t i = 1; i < out.size(); ++i)
    if (out[i].name == out[i - 1].name)  // the text "7" and the number 7
      throw ConfigError(fmt::format("adapters.per: {} holds '{}' both as text and as a number: make them one type",
                                    a.per, out[i].name));
  refuse_case_twins(out, fmt::format("adapters.per: {} holds", a.per));
  if (static_cast<int64_t>(out.size()) > a.max)
    throw ConfigError(
        fmt::format("adapters.per: {} has {} distinct values in data's selection, more than adapters.max "
                    "{}: raise adapters.max, or narrow data.filter",
                    a.per, out.size(), a.max));
  for (const recipe::AdapterSpec& own : a.list) {  // an entry's own keys (r, lr, …) for its value
    const auto it = std::find_if(out.begin(), out.end(), [&](const auto& s) { return s.name == own.name; });
    if (it == out.end())
      throw ConfigError(
          fmt::format("adapters.list sets keys for '{}', but no document of data's selection has {} "
                      "'{}': remove the entry or fix its name",
                      own.name, a.per, own.name));
    recipe::AdapterSpec merged = own;
    merged.filter = it->filter;
    *it = std::move(merged);
  }
  if (found.missing > 0)
    warn(fmt::format("adapters.per: {} documents of data's selection have no field {}: no adapter trains on them",
                     found.missing, a.per));
  if (r.eval.fraction <= 0 && !r.eval.filter.empty()) {  // each adapter evaluates on eval.filter's of its value
    recipe::DataSection held = r.data;
    held.sources.clear();
    held.filter = r.eval.filter;
    if (!r.eval.collection.empty()) held.collection = r.eval.collection;
    std::vector<std::string> unevaluated;
    for (const nlohmann::json& v : data::field_values(held, a.per).values) {
      const std::optional<std::string> name = name_of_value(v);
      if (std::none_of(out.begin(), out.end(), [&](const auto& s) { return name && s.name == *name; }))
        unevaluated.push_back(printable(name.value_or(v.dump()), 40));
    }
    if (!unevaluated.empty())
      warn(
          fmt::format("adapters.per: the evaluation documents hold {} {} that no training document has: no adapter "
                      "trains or evaluates on those",
                      a.per, fmt::join(unevaluated, ", ")));
  }
  return out;
}

recipe::Recipe one_adapter(const recipe::Recipe& r, const std::string& name, const std::string& file) {
  if (!r.adapters.enabled()) {
    if (!name.empty())
      throw Error(fmt::format("{} trains one adapter (it has no adapters: section): drop --job-adapter", file));
    return r;
  }
  const std::vector<recipe::AdapterSpec> all = job_adapters(r);
  std::string names;
  for (const recipe::AdapterSpec& a : all) {
    if (a.name == name) return recipe::adapter_recipe(r, a);
    names += (names.empty() ? "" : ", ") + a.name;
  }
  throw Error(fmt::format(
      "{} trains {} adapters ({}): {}", file, all.size(), names,
      name.empty() ? "name one with --job-adapter NAME" : fmt::format("it has none named '{}'", printable(name))));
}

}  // namespace lorarun::train
