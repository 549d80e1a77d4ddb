// What the key declarations imply: names, examples, the checks of one key, the wording of
// bounds, and docs/recipe.md's key tables.
#include "recipe/schema.hpp"

#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "util/error.hpp"

namespace lorarun::recipe {
namespace detail {

std::string quote_string(std::string_view s) {
  return nlohmann::json(std::string(s)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

std::string format_double(double v) {
  std::string s = fmt::format("{}", v);  // shortest text that reads back exactly
  if (s.find_first_of(".en") == std::string::npos) s += ".0";
  return s;
}

std::string section_of(std::string_view key) { return std::string(key.substr(0, key.find('.'))); }
std::string leaf_of(std::string_view key) { return std::string(key.substr(key.find('.') + 1)); }

bool is_section(std::string_view name) {
  return std::find(kSections.begin(), kSections.end(), name) != kSections.end();
}

namespace {
const std::vector<std::string>& all_keys() {
  static const std::vector<std::string> keys = known_keys();
  return keys;
}
}  // namespace

bool is_key(std::string_view dotted) {
  return std::find(all_keys().begin(), all_keys().end(), dotted) != all_keys().end();
}

std::vector<std::string> leaves(std::string_view section) {
  std::vector<std::string> out;
  for (const std::string& k : all_keys())
    if (section_of(k) == section) out.push_back(leaf_of(k));
  return out;
}

std::string example(std::string_view key) {
  std::string out;
  const Recipe defaults;
  for_each_key(defaults, [&](const Key& k, const auto& v) {
    if (k.name == key) out = k.example.empty() ? yaml_text(v) : std::string(k.example);
  });
  return out;
}

std::string hint(std::string_view key) {
  const std::string e = example(key);
  return e.empty() ? "" : fmt::format(" (e.g. {}: {})", key, e);
}

const std::vector<std::string>& source_keys() {
  static const std::vector<std::string> keys = {"name",       "collection",     "filter",          "path",
                                                "weight",     "format",         "prompt_template", "response_field",
                                                "text_field", "messages_field", "chat_format"};
  return keys;
}

nlohmann::json sources_json(const std::vector<DataSource>& sources) {
  nlohmann::json out = nlohmann::json::array();
  for (const DataSource& s : sources) {
    nlohmann::json j = {{"name", s.name}};
    if (!s.collection.empty()) j["collection"] = s.collection;
    if (!s.filter.empty()) j["filter"] = s.filter;
    if (!s.path.empty()) j["path"] = s.path;
    j["weight"] = s.weight;
    if (s.format) j["format"] = std::string(name(*s.format));
    for (const auto& [key, value] : {std::pair{"prompt_template", &s.prompt_template},
                                     {"response_field", &s.response_field},
                                     {"text_field", &s.text_field},
                                     {"messages_field", &s.messages_field}})
      if (*value) j[key] = **value;
    if (s.chat_format) j["chat_format"] = std::string(name(*s.chat_format));
    out.push_back(std::move(j));
  }
  return out;
}

const std::vector<std::string>& adapter_keys() {
  static const std::vector<std::string> keys = {"name", "filter", "collection",     "path", "eval_filter",
                                                "r",    "alpha",  "target_modules", "lr",   "epochs"};
  return keys;
}

nlohmann::json adapters_json(const std::vector<AdapterSpec>& list) {
  nlohmann::json out = nlohmann::json::array();
  for (const AdapterSpec& a : list) {
    nlohmann::json j = {{"name", a.name}};
    if (!a.filter.empty()) j["filter"] = a.filter;
    if (!a.collection.empty()) j["collection"] = a.collection;
    if (!a.path.empty()) j["path"] = a.path;
    if (!a.eval_filter.empty()) j["eval_filter"] = a.eval_filter;
    if (a.r) j["r"] = *a.r;
    if (a.alpha) j["alpha"] = *a.alpha;
    if (a.target_modules)
      j["target_modules"] = *a.target_modules == std::vector<std::string>{"all-linear"}
                                ? nlohmann::json("all-linear")
                                : nlohmann::json(*a.target_modules);
    if (a.lr) j["lr"] = *a.lr;
    if (a.epochs) j["epochs"] = *a.epochs;
    out.push_back(std::move(j));
  }
  return out;
}

std::string show(std::string_view text) {
  constexpr size_t kMax = 60;
  std::string out;
  for (size_t i = 0; i < text.size(); ++i) {
    if (out.size() >= kMax && (static_cast<unsigned char>(text[i]) & 0xC0) != 0x80) {
      out += "…";
      break;
    }
    const char c = text[i];
    if (c == '\n')
      out += "\\n";
    else if (c == '\t')
      out += "\\t";
    else if (c == '\r')
      out += "\\r";
    else if (static_cast<unsigned char>(c) < 0x20)
      out += fmt::format("\\x{:02x}", c);
    else
      out += c;
  }
  return out;
}

void fail(const RecipeOrigin& origin, std::string_view key, std::string_view problem) {
  throw Error(fmt::format("{}: {} {}", origin.at(key), key, problem));
}

void require(const RecipeOrigin& origin, std::string_view key, const std::string& value, std::string_view why) {
  if (value.empty()) fail(origin, key, fmt::format("must be set {}{}", why, hint(key)));
}

std::string bound_text(const Bound& b, bool whole_numbers) {
  // Bounds are small whole numbers: 0, 1, 2, 3600 ("{}" writes 0.0 as 0).
  const auto number = [&](double v) {
    return whole_numbers ? fmt::format("{}", static_cast<int64_t>(v)) : fmt::format("{}", v);
  };
  switch (b.kind) {
    case Bound::Kind::None:
      return "";
    case Bound::Kind::AtLeast:
      return whole_numbers ? "at least " + number(b.lo) : ">= " + number(b.lo);
    case Bound::Kind::Above:
      return "> " + number(b.lo);
    case Bound::Kind::AboveAtMost:
      return fmt::format("in ({}, {}]", number(b.lo), number(b.hi));
    case Bound::Kind::Within:
      return fmt::format("in [{}, {}{}{}", number(b.lo), number(b.hi), b.hi_open ? ")" : "]",
                         b.unit.empty() ? "" : " " + std::string(b.unit));
  }
  return "";
}

namespace {

template <class T>
bool inside(const Bound& b, T value) {
  const auto lo = static_cast<T>(b.lo), hi = static_cast<T>(b.hi);
  switch (b.kind) {
    case Bound::Kind::None:
      return true;
    case Bound::Kind::AtLeast:
      return value >= lo;
    case Bound::Kind::Above:
      return value > lo;
    case Bound::Kind::AboveAtMost:
      return value > lo && value <= hi;
    case Bound::Kind::Within:
      return value >= lo && (b.hi_open ? value < hi : value <= hi);
  }
  return true;
}

void out_of_bound(const Key& k, bool whole_numbers, std::string_view value, bool nullable, const RecipeOrigin& origin) {
  std::string or_null;
  if (nullable) or_null = k.bound.kind == Bound::Kind::Above ? fmt::format(" or null ({})", k.null_means) : " or null";
  fail(origin, k.name,
       fmt::format("must be {}{}, got {}{}", bound_text(k.bound, whole_numbers), or_null, value, hint(k.name)));
}

}  // namespace

void check_bound(const Key& k, int64_t value, bool nullable, const RecipeOrigin& origin) {
  if (!inside(k.bound, value)) out_of_bound(k, true, std::to_string(value), nullable, origin);
}

void check_bound(const Key& k, double value, bool nullable, const RecipeOrigin& origin) {
  if (!inside(k.bound, value)) out_of_bound(k, false, format_double(value), nullable, origin);  // NaN: outside
}

void check_names(const Key& k, const std::vector<std::string>& names, const RecipeOrigin& origin) {
  if (names.empty() && !k.may_be_empty)
    fail(origin, k.name, "must name at least one module or be all-linear" + hint(k.name));
  std::set<std::string> seen;
  for (const std::string& m : names) {
    if (m.empty()) fail(origin, k.name, "has an empty module name; remove it");
    if (m == "all-linear" && names.size() > 1)
      fail(origin, k.name, fmt::format("lists all-linear among other names; write {}: all-linear alone", k.name));
    if (!seen.insert(m).second) fail(origin, k.name, fmt::format("lists '{}' twice; list each module once", m));
  }
}

namespace {

// ---- docs/recipe.md ---------------------------------------------------------------------------

template <class T>
std::string type_text() {
  if constexpr (IsOptional<T>::value) {
    return type_text<typename T::value_type>() + " or null";
  } else if constexpr (std::is_same_v<T, std::string>) {
    return "text";
  } else if constexpr (std::is_same_v<T, bool>) {
    return "bool";
  } else if constexpr (std::is_enum_v<T>) {
    return "choice";
  } else if constexpr (std::is_integral_v<T>) {
    return "integer";
  } else if constexpr (std::is_floating_point_v<T>) {
    return "number";
  } else if constexpr (std::is_same_v<T, nlohmann::json>) {
    return "mapping";
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    return "list of names, or all-linear";
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    return "list of integers";
  } else if constexpr (std::is_same_v<T, std::vector<DataSource>>) {
    return "list of sources";
  } else if constexpr (std::is_same_v<T, std::vector<AdapterSpec>>) {
    return "list of adapters";
  } else {
    static_assert(std::is_same_v<T, EpochsToSave>);
    return "all, none, or list of integers";
  }
}

template <class T>
std::string allowed_text(const Key& k) {
  std::vector<std::string> parts;
  if constexpr (IsOptional<T>::value) {
    parts.push_back(allowed_text<typename T::value_type>(k));
    if (parts.back() == "—") parts.pop_back();
    parts.push_back(fmt::format("null: {}", k.null_means));
  } else if constexpr (std::is_enum_v<T>) {
    std::string values;
    for (const auto& [text, v] : EnumNames<T>::values)
      values += (values.empty() ? "`" : ", `") + std::string(text) + "`";
    parts.push_back(values);
  } else if constexpr (std::is_arithmetic_v<T> && !std::is_same_v<T, bool>) {
    if (k.bound.kind != Bound::Kind::None) parts.push_back(bound_text(k.bound, std::is_integral_v<T>));
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!k.required.empty()) parts.push_back("not empty");
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    parts.push_back(k.may_be_empty ? "each once" : "at least one, each once");
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
    parts.push_back("token ids, each once");
  } else if constexpr (std::is_same_v<T, std::vector<DataSource>>) {
    parts.push_back("names of [A-Za-z0-9_+-], each once; weights > 0");
  } else if constexpr (std::is_same_v<T, std::vector<AdapterSpec>>) {
    parts.push_back("names of [A-Za-z0-9_+-], each once");
  } else if constexpr (std::is_same_v<T, EpochsToSave>) {
    parts.push_back("epochs in [0, train.epochs), each once");
  }
  std::string out;
  for (const std::string& p : parts) out += (out.empty() ? "" : "; ") + p;
  return out.empty() ? "—" : out;
}

}  // namespace

}  // namespace detail

std::vector<std::string> known_keys() {
  std::vector<std::string> keys;
  const Recipe defaults;
  detail::for_each_key(defaults, [&](std::string_view key, const auto&) { keys.emplace_back(key); });
  return keys;
}

std::string reference_tables() {
  std::string out, section;
  const Recipe defaults;
  detail::for_each_key(defaults, [&](const detail::Key& k, const auto& value) {
    using T = std::decay_t<decltype(value)>;
    if (detail::section_of(k.name) != section) {
      section = detail::section_of(k.name);
      out += fmt::format("{}### {}\n\n| Key | Type | Default | Allowed | Meaning |\n|---|---|---|---|---|\n",
                         out.empty() ? "" : "\n", section);
    }
    out += fmt::format("| `{}` | {} | `{}` | {} | {} |\n", k.name,
                       k.name == "grpo.rewards" ? "list of rewards" : detail::type_text<T>(), detail::yaml_text(value),
                       detail::allowed_text<T>(k), k.meaning);
  });
  return out;
}

}  // namespace lorarun::recipe
