// Loading a recipe: YAML text → tree + overrides → known keys only → typed Recipe → resolved
// defaults → validate(). And the way back: to_yaml / to_json. The keys themselves are declared
// in schema.hpp.
#include "recipe/recipe.hpp"

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <limits>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "recipe/schema.hpp"
#include "recipe/suggest.hpp"
#include "util/error.hpp"
#include "util/input_file.hpp"
#include "util/secrets.hpp"

namespace lorarun::recipe {

using detail::fail;
using detail::hint;
using detail::is_key;
using detail::is_section;
using detail::leaf_of;
using detail::leaves;
using detail::section_of;
using detail::show;
using detail::unknown_key_message;
using detail::unknown_top_message;

std::string RecipeOrigin::at(std::string_view key) const {
  const auto it = overrides.find(key);
  if (it == overrides.end()) return file;
  return fmt::format("{} (override '{}')", file, it->second);
}

namespace {

// ---- what users wrote, for messages ----------------------------------------------------------

// A YAML value in one short line: 'fast' for scalars, flow style for lists and mappings.
std::string show_node(const YAML::Node& n) {
  if (!n || n.IsNull()) return "null";
  if (n.IsScalar()) return "'" + show(n.Scalar()) + "'";
  YAML::Emitter e;
  e.SetMapFormat(YAML::Flow);
  e.SetSeqFormat(YAML::Flow);
  e << n;
  return show(e.c_str());
}

// ---- scalars ---------------------------------------------------------------------------------

std::optional<int64_t> parse_int(std::string_view s) {
  if (s.size() > 1 && s[0] == '+' && s[1] != '-') s.remove_prefix(1);
  int64_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

// Decimal and exponent forms alike: 2.0e-4, 1e-4, .5, 3. Infinity and NaN are not numbers here.
std::optional<double> parse_float(std::string_view s) {
  if (s.size() > 1 && s[0] == '+' && s[1] != '-') s.remove_prefix(1);
  double v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size() || !std::isfinite(v)) return std::nullopt;
  return v;
}

std::optional<bool> parse_bool(std::string_view s) {
  std::string lower(s);
  std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
  if (lower == "true" || lower == "yes" || lower == "on") return true;
  if (lower == "false" || lower == "no" || lower == "off") return false;
  return std::nullopt;
}

// A YAML scalar in data.filter as JSON, by YAML 1.2's core schema: quoted text stays a string.
nlohmann::json filter_scalar(const YAML::Node& n) {
  const std::string& s = n.Scalar();
  const std::string& tag = n.Tag();
  if (tag == "!" || (tag.size() >= 4 && tag.ends_with(":str"))) return s;
  if (s == "true" || s == "True" || s == "TRUE") return true;
  if (s == "false" || s == "False" || s == "FALSE") return false;
  if (const auto i = parse_int(s)) return *i;
  if (const auto f = parse_float(s)) return *f;
  return s;
}

// ---- typing one key --------------------------------------------------------------------------

// The key being read, for messages.
struct Field {
  std::string_view key;
  const RecipeOrigin& origin;
  bool nullable = false;

  [[noreturn]] void expected(std::string_view what, const YAML::Node& got, bool with_hint = true) const {
    fail(origin, key,
         fmt::format("must be {}{}, got {}{}", what, nullable ? " or null" : "", show_node(got),
                     with_hint ? hint(key) : ""));
  }
};

template <class E>
std::string choices() {
  std::string out;
  for (const auto& [text, v] : EnumNames<E>::values) {
    if (!out.empty()) out += '|';
    out += text;
  }
  return out;
}

nlohmann::json yaml_to_json(const YAML::Node& n, const Field& f) {
  switch (n.Type()) {
    case YAML::NodeType::Scalar:
      return filter_scalar(n);
    case YAML::NodeType::Sequence: {
      nlohmann::json array = nlohmann::json::array();
      for (const YAML::Node& item : n) array.push_back(yaml_to_json(item, f));
      return array;
    }
    case YAML::NodeType::Map: {
      nlohmann::json object = nlohmann::json::object();
      for (const auto& kv : n) {
        if (!kv.first.IsScalar())
          fail(f.origin, f.key, fmt::format("has a key that is not a name: {}", show_node(kv.first)));
        const std::string& name = kv.first.Scalar();
        if (object.contains(name)) fail(f.origin, f.key, fmt::format("has the key '{}' twice; keep one", show(name)));
        object[name] = yaml_to_json(kv.second, f);
      }
      return object;
    }
    default:
      return nullptr;
  }
}

void read_modules(const YAML::Node& n, std::vector<std::string>& out, const Field& f) {
  constexpr std::string_view what = "a list of module names or all-linear";
  if (n.IsScalar() && n.Scalar() == "all-linear") {
    out = {"all-linear"};
    return;
  }
  if (!n.IsSequence()) f.expected(what, n);
  out.clear();
  for (const YAML::Node& item : n) {
    if (!item.IsScalar()) f.expected(what, n);
    out.push_back(item.Scalar());
  }
}

void read_epochs(const YAML::Node& n, EpochsToSave& out, const Field& f) {
  constexpr std::string_view what = "all, none or a list of 0-based epoch indices";
  if (n.IsScalar() && n.Scalar() == "all") {
    out = {EpochsToSave::Mode::All, {}};
  } else if (n.IsScalar() && n.Scalar() == "none") {
    out = {EpochsToSave::Mode::None, {}};
  } else if (n.IsSequence()) {
    out = {n.size() == 0 ? EpochsToSave::Mode::None : EpochsToSave::Mode::List, {}};
    for (const YAML::Node& item : n) {
      const auto i = item.IsScalar() ? parse_int(item.Scalar()) : std::nullopt;
      if (!i || *i < std::numeric_limits<int>::min() || *i > std::numeric_limits<int>::max()) f.expected(what, n);
      out.epochs.push_back(static_cast<int>(*i));
    }
  } else {
    f.expected(what, n);
  }
}

template <class T>
void read(const YAML::Node& n, T& out, Field f);

// data.sources: a list of mappings, each of source_keys(); a data.* key that cannot differ per
// source is named as such.
void read_sources(const YAML::Node& n, std::vector<DataSource>& out, const Field& f) {
  out.clear();
  if (n.IsNull()) return;
  if (!n.IsSequence()) f.expected("a list of sources such as [{name: chat, collection: chat, weight: 1}]", n, false);
  const std::vector<std::string>& allowed = detail::source_keys();
  for (size_t i = 0; i < n.size(); ++i) {
    const YAML::Node item = n[i];
    if (!item.IsMap())
      fail(f.origin, f.key,
           fmt::format("entry {} is {}, not a mapping such as {{name: chat, collection: chat, weight: 1}}", i,
                       show_node(item)));
    DataSource s;
    for (const auto& kv : item) {
      if (!kv.first.IsScalar()) fail(f.origin, f.key, fmt::format("entry {} has a key that is not a name", i));
      const std::string key = kv.first.Scalar();
      if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
        if (detail::is_key("data." + key))
          fail(f.origin, f.key,
               fmt::format("entry {} sets {}, which is shared by every source and cannot differ per source: set "
                           "data.{} once (a source may set {})",
                           i, show(key), key, fmt::join(allowed, ", ")));
        fail(f.origin, f.key,
             fmt::format("entry {} has the unknown key {}; a source's keys are {}", i, show(key),
                         fmt::join(allowed, ", ")));
      }
      const std::string dotted = fmt::format("{}[{}].{}", f.key, i, key);
      const Field g{dotted, f.origin};
      const YAML::Node& v = kv.second;
      if (key == "name")
        read(v, s.name, g);
      else if (key == "collection")
        read(v, s.collection, g);
      else if (key == "filter")
        read(v, s.filter, g);
      else if (key == "path")
        read(v, s.path, g);
      else if (key == "weight")
        read(v, s.weight, g);
      else if (key == "format")
        read(v, s.format, g);
      else if (key == "prompt_template")
        read(v, s.prompt_template, g);
      else if (key == "response_field")
        read(v, s.response_field, g);
      else if (key == "text_field")
        read(v, s.text_field, g);
      else if (key == "messages_field")
        read(v, s.messages_field, g);
      else
        read(v, s.chat_format, g);
    }
    out.push_back(std::move(s));
  }
}

// adapters.list: a list of mappings, each of adapter_keys(); a lora.*, train.* or data.* key that
// cannot differ per adapter is named as such.
void read_adapters(const YAML::Node& n, std::vector<AdapterSpec>& out, const Field& f) {
  out.clear();
  if (n.IsNull()) return;
  if (!n.IsSequence()) f.expected("a list of adapters such as [{name: acme, filter: {tenant: acme}}]", n, false);
  const std::vector<std::string>& allowed = detail::adapter_keys();
  for (size_t i = 0; i < n.size(); ++i) {
    const YAML::Node item = n[i];
    if (!item.IsMap())
      fail(f.origin, f.key,
           fmt::format("entry {} is {}, not a mapping such as {{name: acme, filter: {{tenant: acme}}}}", i,
                       show_node(item)));
    AdapterSpec a;
    for (const auto& kv : item) {
      if (!kv.first.IsScalar()) fail(f.origin, f.key, fmt::format("entry {} has a key that is not a name", i));
      const std::string key = kv.first.Scalar();
      if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
        for (const char* section : {"lora.", "train.", "data.", "checkpoint."})
          if (detail::is_key(section + key))
            fail(f.origin, f.key,
                 fmt::format("entry {} sets {}, which one base pass shares between the adapters and cannot differ "
                             "per adapter: set {}{} for all, or train that adapter in a job of its own (an adapter "
                             "may set r, alpha, target_modules, lr, epochs)",
                             i, show(key), section, key));
        fail(f.origin, f.key,
             fmt::format("entry {} has the unknown key {}; an adapter's keys are {}", i, show(key),
                         fmt::join(allowed, ", ")));
      }
      const std::string dotted = fmt::format("{}[{}].{}", f.key, i, key);
      const Field g{dotted, f.origin};
      const YAML::Node& v = kv.second;
      if (key == "name")
        read(v, a.name, g);
      else if (key == "filter")
        read(v, a.filter, g);
      else if (key == "collection")
        read(v, a.collection, g);
      else if (key == "path")
        read(v, a.path, g);
      else if (key == "eval_filter")
        read(v, a.eval_filter, g);
      else if (key == "r")
        read(v, a.r, g);
      else if (key == "alpha")
        read(v, a.alpha, g);
      else if (key == "target_modules")
        read(v, a.target_modules, g);
      else if (key == "lr")
        read(v, a.lr, g);
      else
        read(v, a.epochs, g);
    }
    out.push_back(std::move(a));
  }
}

// Reads a YAML value into a member of the member's type, or throws naming the key.
template <class T>
void read(const YAML::Node& n, T& out, Field f) {
  if constexpr (detail::IsOptional<T>::value) {
    if (n.IsNull()) {
      out.reset();
      return;
    }
    typename T::value_type v{};
    f.nullable = true;
    read(n, v, f);
    out = v;
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (n.IsNull()) {  // `key:` with nothing, or null: unset
      out.clear();
      return;
    }
    if (!n.IsScalar()) f.expected("a string", n);
    out = n.Scalar();
  } else if constexpr (std::is_same_v<T, bool>) {
    const auto b = n.IsScalar() ? parse_bool(n.Scalar()) : std::nullopt;
    if (!b) f.expected("true or false", n, false);
    out = *b;
  } else if constexpr (std::is_enum_v<T>) {
    if (n.IsScalar())
      for (const auto& [text, v] : EnumNames<T>::values)
        if (n.Scalar() == text) {
          out = v;
          return;
        }
    f.expected("one of " + choices<T>(), n, false);
  } else if constexpr (std::is_integral_v<T>) {
    std::optional<int64_t> i = n.IsScalar() ? parse_int(n.Scalar()) : std::nullopt;
    if (!i && n.IsScalar())  // 1e6: a whole number written as YAML writes a float
      if (const auto d = parse_float(n.Scalar()); d && *d == std::floor(*d) && std::abs(*d) < 9e18)
        i = static_cast<int64_t>(*d);
    if (!i) f.expected("a whole number", n);
    if (*i < std::numeric_limits<T>::min() || *i > std::numeric_limits<T>::max())
      f.expected(
          fmt::format("a whole number from {} to {}", std::numeric_limits<T>::min(), std::numeric_limits<T>::max()), n);
    out = static_cast<T>(*i);
  } else if constexpr (std::is_floating_point_v<T>) {
    const auto d = n.IsScalar() ? parse_float(n.Scalar()) : std::nullopt;
    if (!d) f.expected("a number", n);
    out = *d;
  } else if constexpr (std::is_same_v<T, nlohmann::json>) {  // data.filter, eval.filter; grpo.rewards (a list)
    const bool list = f.key == "grpo.rewards";
    if (n.IsNull()) {
      out = list ? nlohmann::json::array() : nlohmann::json::object();
      return;
    }
    if (list) {
      if (!n.IsSequence())
        f.expected("a list of rewards such as [{name: answer, kind: exact, field: answer}]", n, false);
      for (const YAML::Node& item : n)
        if (!item.IsMap()) f.expected("a list of mappings, one per reward ({name, kind, field, …})", n, false);
      out = yaml_to_json(n, f);
      return;
    }
    if (!n.IsMap())
      f.expected(f.key == "data.filter" || f.key == "eval.filter" ? "a mapping (a MongoDB query such as {split: train})"
                                                                  : "a mapping",
                 n, false);
    out = yaml_to_json(n, f);
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {  // lora.target_modules, modules_to_save
    read_modules(n, out, f);
  } else if constexpr (std::is_same_v<T, std::vector<DataSource>>) {
    read_sources(n, out, f);
  } else if constexpr (std::is_same_v<T, std::vector<AdapterSpec>>) {
    read_adapters(n, out, f);
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {  // lora.trainable_token_indices
    out.clear();
    if (n.IsNull()) return;
    if (!n.IsSequence()) f.expected("a list of token ids", n);
    for (const YAML::Node& item : n) {
      const auto i = item.IsScalar() ? parse_int(item.Scalar()) : std::nullopt;
      if (!i) f.expected("a list of token ids (whole numbers)", n);
      out.push_back(*i);
    }
  } else {
    static_assert(std::is_same_v<T, EpochsToSave>);
    read_epochs(n, out, f);
  }
}

// ---- the tree: structure, overrides, typing ---------------------------------------------------

std::string key_name(const YAML::Node& key, const std::string& file) {
  if (!key.IsScalar()) throw Error(fmt::format("{}: a key must be a name, got {}", file, show_node(key)));
  return key.Scalar();
}

// Every section and key is known and appears once. Values are typed later.
void check_structure(const YAML::Node& root, const RecipeOrigin& origin) {
  const std::string& file = origin.file;
  if (!root || root.IsNull()) return;
  if (!root.IsMap())
    throw Error(
        fmt::format("{}: a recipe is a mapping of sections (model:, lora:, data:, train:, checkpoint:, "
                    "dist:, track:), got {}",
                    file, show_node(root)));
  std::set<std::string> sections;
  for (const auto& kv : root) {
    const std::string section = key_name(kv.first, file);
    if (!is_section(section)) throw Error(fmt::format("{}: {}", file, unknown_top_message(section)));
    if (!sections.insert(section).second)
      throw Error(
          fmt::format("{}: section '{}' appears twice; merge its keys under one '{}:'", file, section, section));
    const YAML::Node& body = kv.second;
    if (body.IsNull()) continue;
    if (!body.IsMap())
      throw Error(
          fmt::format("{}: section '{}' must be a mapping of keys, got {}; write its keys indented "
                      "below '{}:' (e.g. {}: {{{}: …}})",
                      file, section, show_node(body), section, section, leaves(section).front()));
    std::set<std::string> keys;
    for (const auto& entry : body) {
      const std::string leaf = key_name(entry.first, file);
      const std::string dotted = section + "." + leaf;
      if (!is_key(dotted)) throw Error(fmt::format("{}: {}", file, unknown_key_message(section, leaf)));
      if (!keys.insert(leaf).second) throw Error(fmt::format("{}: {} appears twice; keep one", file, dotted));
    }
  }
}

bool is_string_key(std::string_view dotted) {
  bool result = false;
  const Recipe defaults;
  detail::for_each_key(defaults, [&](std::string_view k, const auto& v) {
    if (k == dotted) result = std::is_same_v<std::decay_t<decltype(v)>, std::string>;
  });
  return result;
}

std::vector<std::string> split(std::string_view s, char sep) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i < s.size() && s[i] != sep) continue;
    parts.emplace_back(s.substr(start, i - start));
    start = i + 1;
  }
  return parts;
}

// The value of `key=value`: YAML flow syntax, except that text keys (paths, templates, URIs)
// take the text as written unless it is quoted, so '#', ':' and '{' need no escaping there.
YAML::Node override_value(const std::string& value, bool literal, const std::string& where) {
  if (literal && !value.starts_with('"') && !value.starts_with('\'')) return YAML::Node(value);
  try {
    return YAML::Load(value);
  } catch (const YAML::ParserException& e) {
    throw Error(
        fmt::format("{}: malformed YAML value at column {}: {}; use YAML flow syntax such as [a, b] or "
                    "{{k: v}}, or quote the value",
                    where, e.mark.column + 1, e.msg));
  }
}

// Sets tree[parts[0]][parts[1]]… = value, creating mappings on the way.
void set_path(YAML::Node& root, const std::vector<std::string>& parts, const YAML::Node& value) {
  YAML::Node node;
  node.reset(root);
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    YAML::Node next = node[parts[i]];
    if (!next.IsMap()) next = YAML::Node(YAML::NodeType::Map);
    node.reset(next);
  }
  node[parts.back()] = value;
}

// Applies "section.key=value" overrides to the tree; data.filter.a.b=… (and eval.filter.…) reaches
// into the filter.
void apply_overrides(YAML::Node& tree, const std::vector<std::string>& overrides, RecipeOrigin& origin) {
  for (const std::string& o : overrides) {
    const size_t eq = o.find('=');
    const std::string key = o.substr(0, eq);
    const std::string shown = eq == std::string::npos ? redact_uri(o) : key + "=" + redact_uri(o.substr(eq + 1));
    if (eq == std::string::npos || eq == 0)
      throw Error(fmt::format("{}: override '{}' is not key=value; write e.g. train.lr=1e-4", origin.file, shown));
    const std::string where = fmt::format("{} (override '{}')", origin.file, shown);
    const std::vector<std::string> parts = split(key, '.');
    if (parts.size() == 1 && is_section(key))
      throw Error(
          fmt::format("{}: '{}' is a section; override one key such as {}.{}=…", where, key, key, leaves(key).front()));
    if (!is_section(parts[0])) throw Error(fmt::format("{}: {}", where, unknown_top_message(parts[0])));
    const std::string dotted = parts[0] + "." + parts[1];
    if (!is_key(dotted)) throw Error(fmt::format("{}: {}", where, unknown_key_message(parts[0], parts[1])));
    if (parts.size() > 2 && dotted != "data.filter" && dotted != "eval.filter" && dotted != "data.chat_template_kwargs")
      throw Error(fmt::format("{}: {} has no sub-keys; write {}=VALUE", where, dotted, dotted));
    const YAML::Node value = override_value(o.substr(eq + 1), parts.size() == 2 && is_string_key(dotted), where);
    set_path(tree, parts, value);
    origin.overrides.insert_or_assign(dotted, shown);
  }
}

std::optional<YAML::Node> lookup(const YAML::Node& tree, std::string_view dotted) {
  const YAML::Node section = tree[section_of(dotted)];
  if (!section || !section.IsMap()) return std::nullopt;
  const YAML::Node value = section[leaf_of(dotted)];
  if (!value) return std::nullopt;
  return value;
}

// Defaults that depend on other keys, the recipe's name or the environment.
void resolve(Recipe& r, const std::string& file) {
  r.data.uri = mongodb_uri(r.data.uri);
  register_uri_secret(r.track.mlflow_uri);
  if (r.track.database.empty()) r.track.database = r.data.database;
  // As MLflow's own client: the experiment the environment names, else the server's Default one.
  if (!r.track.mlflow_uri.empty() && r.track.mlflow_experiment.empty()) {
    const char* env = std::getenv("MLFLOW_EXPERIMENT_NAME");
    r.track.mlflow_experiment = env && *env ? env : "Default";
  }
  if (r.checkpoint.output_dir.empty()) {
    std::string name = std::filesystem::path(file).stem().string();
    for (char& c : name)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-') c = '-';
    r.checkpoint.output_dir = "runs/" + (name.empty() ? std::string("run") : name);
  }
}

}  // namespace

Recipe recipe_from_yaml(const YAML::Node& root, const std::vector<std::string>& overrides, const std::string& file) {
  RecipeOrigin origin{file, {}};
  try {
    check_structure(root, origin);
    YAML::Node tree = (!root || root.IsNull()) ? YAML::Node(YAML::NodeType::Map) : YAML::Clone(root);
    apply_overrides(tree, overrides, origin);
    Recipe r;
    const YAML::Node& typed = tree;  // const: lookups must not insert keys
    detail::for_each_key(r, [&](std::string_view key, auto& member) {
      if (const auto n = lookup(typed, key)) read(*n, member, Field{key, origin});
    });
    resolve(r, file);
    r.warnings = validate(r, origin);
    return r;
  } catch (const YAML::Exception& e) {  // not expected: every access above is checked
    throw Error(fmt::format("{}: {}", file, e.what()));
  }
}

Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides) {
  if (std::filesystem::is_directory(path))
    throw Error(fmt::format("{}: is a directory, not a recipe; give a .yaml file (see configs/)", path));
  const std::string text = read_input(path, "the recipe");
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    throw Error(
        fmt::format("{}: malformed YAML at line {}, column {}: {} (check the indentation, colons and "
                    "quotes there)",
                    path, e.mark.line + 1, e.mark.column + 1, e.msg));
  }
  return recipe_from_yaml(root, overrides, path);
}

Recipe recipe_from_json(const nlohmann::json& j, const std::vector<std::string>& overrides, const std::string& file) {
  // JSON is YAML flow syntax: one loader, one set of checks.
  const std::string text = j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& e) {
    throw Error(fmt::format("{}: not a recipe: {}", file, e.msg));
  }
  return recipe_from_yaml(root, overrides, file);
}

std::string to_yaml(const Recipe& r, bool redact_secrets) {
  Recipe shown = r;
  if (redact_secrets) {
    shown.data.uri = redact_uri(shown.data.uri);
    shown.track.mlflow_uri = redact_uri(shown.track.mlflow_uri);
  }
  std::string out, section;
  detail::for_each_key(std::as_const(shown), [&](std::string_view key, const auto& value) {
    if (section_of(key) != section) {
      section = section_of(key);
      out += section + ":\n";
    }
    out += fmt::format("  {}: {}\n", leaf_of(key), detail::yaml_text(value));
  });
  return out;
}

nlohmann::json to_json(const Recipe& r, bool redact_secrets) {
  Recipe shown = r;
  if (redact_secrets) {
    shown.data.uri = redact_uri(shown.data.uri);
    shown.track.mlflow_uri = redact_uri(shown.track.mlflow_uri);
  }
  nlohmann::json j = nlohmann::json::object();
  detail::for_each_key(std::as_const(shown), [&](std::string_view key, const auto& value) {
    using T = std::decay_t<decltype(value)>;
    nlohmann::json& slot = j[section_of(key)][leaf_of(key)];
    if constexpr (std::is_enum_v<T>) {
      slot = std::string(name(value));
    } else if constexpr (detail::IsOptional<T>::value) {
      slot = value ? nlohmann::json(*value) : nlohmann::json(nullptr);
    } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
      slot = value == std::vector<std::string>{"all-linear"} ? nlohmann::json("all-linear") : nlohmann::json(value);
    } else if constexpr (std::is_same_v<T, std::vector<DataSource>>) {
      slot = detail::sources_json(value);
    } else if constexpr (std::is_same_v<T, std::vector<AdapterSpec>>) {
      slot = detail::adapters_json(value);
    } else if constexpr (std::is_same_v<T, EpochsToSave>) {
      slot = value.mode == EpochsToSave::Mode::List ? nlohmann::json(value.epochs)
                                                    : nlohmann::json(detail::yaml_text(value));
    } else {
      slot = value;
    }
  });
  return j;
}

}  // namespace lorarun::recipe
