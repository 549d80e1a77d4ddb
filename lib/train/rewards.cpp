#include "train/rewards.hpp"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <fmt/format.h>
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdlib>
#include <type_traits>

#include "util/error.hpp"
#include "util/untrusted.hpp"

namespace lorarun::train {

namespace {

// A compiled PCRE2 pattern; subjects may be invalid UTF-8 (a completion cut inside a character).
class Compiled {
 public:
  struct Match {
    size_t start, end;   // of the whole match
    std::string answer;  // the group named `answer`, else the first group, else the whole match
  };

  Compiled(const std::string& pattern, uint32_t options, const std::string& where) {
    int err = 0;
    PCRE2_SIZE offset = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          options | PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &offset, nullptr);
    if (!code_) {
      PCRE2_UCHAR message[256];
      pcre2_get_error_message(err, message, sizeof message);
      throw ConfigError(fmt::format("{}: pattern '{}' does not compile: {} at offset {}", where, printable(pattern),
                                    reinterpret_cast<const char*>(message), offset));
    }
    uint32_t groups = 0;
    pcre2_pattern_info(code_, PCRE2_INFO_CAPTURECOUNT, &groups);
    const int named = pcre2_substring_number_from_name(code_, reinterpret_cast<PCRE2_SPTR>("answer"));
    answer_group_ = named > 0 ? static_cast<size_t>(named) : groups > 0 ? 1 : 0;
  }
  ~Compiled() { pcre2_code_free(code_); }
  Compiled(const Compiled&) = delete;
  Compiled& operator=(const Compiled&) = delete;

  // The first match in `text` at or after `from` (`whole`: one of all of it), or nullopt.
  std::optional<Match> find(std::string_view text, size_t from = 0, bool whole = false) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(text.data()), text.size(), from,
                               whole ? PCRE2_ANCHORED | PCRE2_ENDANCHORED : 0, md, nullptr);
    std::optional<Match> out;
    if (rc > 0) {
      const PCRE2_SIZE* v = pcre2_get_ovector_pointer(md);
      const size_t g = answer_group_;
      out = Match{v[0], v[1], ""};
      if (g < static_cast<size_t>(rc) && v[2 * g] != PCRE2_UNSET)  // else the group took no part: ""
        out->answer = std::string(text.substr(v[2 * g], v[2 * g + 1] - v[2 * g]));
    }
    pcre2_match_data_free(md);
    return out;
  }

 private:
  pcre2_code* code_ = nullptr;
  size_t answer_group_ = 0;
};

}  // namespace

struct Reward::Pattern : Compiled {
  using Compiled::Compiled;
};

namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(), [](unsigned char c) { return std::tolower(c); });
  return out;
}

bool same(std::string_view a, std::string_view b, bool ignore_case) {
  a = strip(a);
  b = strip(b);
  return ignore_case ? lower(a) == lower(b) : a == b;
}

// The first fenced ``` block's content (its language word dropped), or the whole text.
std::string_view fenced_or_whole(std::string_view text) {
  const size_t open = text.find("```");
  if (open == std::string_view::npos) return text;
  const size_t line = text.find('\n', open);
  if (line == std::string_view::npos) return text;
  const size_t close = text.find("```", line + 1);
  return text.substr(line + 1, close == std::string_view::npos ? std::string_view::npos : close - line - 1);
}

const char* const kKinds[] = {"exact", "number", "regex", "contains", "json", "format", "length", "command"};

}  // namespace

std::string_view strip(std::string_view s) {
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return s;
}

std::optional<double> last_number(std::string_view text) {
  static const Compiled number(R"([-+]?(?:[0-9]{1,3}(?:,[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?)", 0,
                               "last_number");
  std::optional<double> last;
  for (auto m = number.find(text); m; m = number.find(text, std::max(m->end, m->start + 1))) {
    std::string digits;
    for (const char c : text.substr(m->start, m->end - m->start))
      if (c != ',') digits += c;
    last = std::strtod(digits.c_str(), nullptr);
  }
  return last;
}

Reward::Reward(RewardSpec spec, const std::string& where) : spec_(std::move(spec)) {
  const std::string& k = spec_.kind;
  if (std::find(std::begin(kKinds), std::end(kKinds), k) == std::end(kKinds))
    throw ConfigError(
        fmt::format("{}: kind '{}' is not one of exact, number, regex, contains, json, format, length, command", where,
                    printable(k)));
  if (k == "command" && spec_.run.empty())
    throw ConfigError(fmt::format("{}: a command reward needs `run`: [program, args…]", where));
  if (k != "command" && (!spec_.run.empty() || !spec_.fields.empty()))
    throw ConfigError(fmt::format("{}: `run` and `fields` are for a command reward, not {}", where, k));
  if (!(spec_.timeout_s > 0) || !std::isfinite(spec_.timeout_s))
    throw ConfigError(fmt::format("{}: timeout_s must be a number > 0", where));
  const bool reads_field = k == "exact" || k == "number" || k == "contains" || k == "regex";
  const bool needs_field = reads_field && k != "regex";
  if (needs_field && spec_.field.empty())
    throw ConfigError(fmt::format("{}: a {} reward compares with a field of the document: give it `field`", where, k));
  if (!reads_field && !spec_.field.empty())
    throw ConfigError(fmt::format("{}: a {} reward reads no field: remove `field`", where, k));
  if ((k == "regex" || k == "format") && spec_.pattern.empty())
    throw ConfigError(fmt::format("{}: a {} reward needs `pattern`", where, k));
  if (!spec_.keys.empty() && k != "json")
    throw ConfigError(fmt::format("{}: `keys` is for a json reward, not {}", where, k));
  if (!std::isfinite(spec_.weight)) throw ConfigError(fmt::format("{}: weight must be a finite number", where));
  if (!(spec_.tolerance >= 0) || !std::isfinite(spec_.tolerance))
    throw ConfigError(fmt::format("{}: tolerance must be a number >= 0", where));
  if (k == "length" && (spec_.max_tokens < 1 || spec_.cache < 0 || spec_.cache > spec_.max_tokens))
    throw ConfigError(
        fmt::format("{}: a length reward needs max_tokens >= 1 and 0 <= cache <= max_tokens (got {} and {})", where,
                    spec_.max_tokens, spec_.cache));
  if (!spec_.pattern.empty()) {
    if (k != "exact" && k != "number" && k != "regex" && k != "format")
      throw ConfigError(fmt::format("{}: `pattern` is for exact, number, regex and format rewards, not {}", where, k));
    const uint32_t options = (k == "format" ? PCRE2_DOTALL : 0) | (spec_.ignore_case ? PCRE2_CASELESS : 0);
    pattern_ = std::make_unique<Pattern>(spec_.pattern, options, where);
  }
}

Reward::~Reward() = default;
Reward::Reward(Reward&&) noexcept = default;
Reward& Reward::operator=(Reward&&) noexcept = default;

const data::Document* Reward::field_value(const data::Document& doc) const {
  const data::Document* at = &doc;
  size_t from = 0;
  while (true) {
    const size_t dot = spec_.field.find('.', from);
    const std::string key = spec_.field.substr(from, dot == std::string::npos ? std::string::npos : dot - from);
    if (!at->is_object()) return nullptr;
    const auto it = at->find(key);
    if (it == at->end()) return nullptr;
    at = &*it;
    if (dot == std::string::npos) return at;
    from = dot + 1;
  }
}

std::string Reward::check(const data::Document& doc) const {
  for (const std::string& f : spec_.fields)
    if (!doc.is_object() || !doc.contains(f))
      return fmt::format("field '{}' (reward {}) is missing", printable(f), printable(spec_.name));
  if (spec_.field.empty()) return "";
  const data::Document* v = field_value(doc);
  const std::string field = printable(spec_.field), name = printable(spec_.name);
  if (!v) return fmt::format("field '{}' (reward {}) is missing", field, name);
  if (!v->is_string() && !v->is_number())
    return fmt::format("field '{}' (reward {}) is a {}, not a string or a number", field, name, v->type_name());
  if (spec_.kind == "number" && !last_number(field_text(doc)))
    return fmt::format("field '{}' (reward {}) holds no number", field, name);
  return "";
}

std::string Reward::field_text(const data::Document& doc) const {
  const data::Document* v = field_value(doc);
  if (!v)
    throw Error(
        fmt::format("reward {}: the document has no field '{}'", printable(spec_.name), printable(spec_.field)));
  return v->is_string() ? v->get<std::string>() : v->dump();
}

double Reward::score(std::string_view completion, int64_t tokens, const data::Document& doc) const {
  const std::string& k = spec_.kind;
  const auto answer = [&]() -> std::optional<std::string> {
    if (!pattern_) return std::string(completion);
    const auto m = pattern_->find(completion);
    return m ? std::optional<std::string>(m->answer) : std::nullopt;
  };
  if (k == "exact") {
    const auto a = answer();
    return a && same(*a, field_text(doc), spec_.ignore_case) ? 1.0 : 0.0;
  }
  if (k == "number") {
    const auto a = answer();
    const auto got = a ? last_number(*a) : std::nullopt;
    const auto want = last_number(field_text(doc));
    return got && want && std::abs(*got - *want) <= spec_.tolerance ? 1.0 : 0.0;
  }
  if (k == "regex") {
    const auto m = pattern_->find(completion);
    if (!m) return 0.0;
    return spec_.field.empty() || same(m->answer, field_text(doc), spec_.ignore_case) ? 1.0 : 0.0;
  }
  if (k == "contains") {
    const std::string want(strip(field_text(doc)));
    return spec_.ignore_case ? (lower(completion).find(lower(want)) != std::string::npos ? 1.0 : 0.0)
                             : (completion.find(want) != std::string_view::npos ? 1.0 : 0.0);
  }
  if (k == "json") {
    const auto j = nlohmann::json::parse(strip(fenced_or_whole(completion)), nullptr, false);
    if (j.is_discarded()) return 0.0;
    for (const std::string& key : spec_.keys)
      if (!j.is_object() || !j.contains(key)) return 0.0;
    return 1.0;
  }
  if (k == "format") return pattern_->find(completion, 0, /*whole=*/true) ? 1.0 : 0.0;
  if (k == "command") throw Error(fmt::format("reward {} is scored by its program", printable(spec_.name)));
  // length: DAPO's soft overlong punishment
  const int64_t soft = spec_.max_tokens - spec_.cache;
  if (tokens <= soft) return 0.0;
  if (tokens <= spec_.max_tokens) return static_cast<double>(soft - tokens) / static_cast<double>(spec_.cache);
  return -1.0;
}

namespace {

// grpo.rewards[i]'s `key` read into `out` (json's own types), or ConfigError naming it.
template <class T>
void read_key(const nlohmann::json& entry, const char* key, T& out, const std::string& where) {
  const auto it = entry.find(key);
  if (it == entry.end() || it->is_null()) return;
  const nlohmann::json& v = *it;
  bool fits = false;
  const char* what = "";
  if constexpr (std::is_same_v<T, std::string>) {
    fits = v.is_string(), what = "a string";
  } else if constexpr (std::is_same_v<T, bool>) {
    fits = v.is_boolean(), what = "true or false";
  } else if constexpr (std::is_integral_v<T>) {
    fits = v.is_number_integer(), what = "a whole number";
  } else if constexpr (std::is_floating_point_v<T>) {
    fits = v.is_number(), what = "a number";
  } else {
    static_assert(std::is_same_v<T, std::vector<std::string>>);
    fits = v.is_array() && std::all_of(v.begin(), v.end(), [](const nlohmann::json& x) { return x.is_string(); });
    what = "a list of strings";
  }
  if (!fits) throw ConfigError(fmt::format("{}: `{}` must be {}, got {}", where, key, what, printable(v.dump())));
  out = v.get<T>();
}

bool metric_name(std::string_view s) {
  return !s.empty() && s.size() <= 64 && std::all_of(s.begin(), s.end(), [](unsigned char c) {
    return std::isalnum(c) || c == '_' || c == '-' || c == '.';
  });
}

}  // namespace

std::vector<RewardSpec> reward_specs(const nlohmann::json& list) {
  static const char* const kKeys[] = {"name", "kind",       "weight", "field", "pattern",   "ignore_case", "tolerance",
                                      "keys", "max_tokens", "cache",  "run",   "timeout_s", "fields"};
  std::vector<RewardSpec> out;
  for (size_t i = 0; i < list.size(); ++i) {
    const nlohmann::json& e = list[i];
    const std::string where = fmt::format("grpo.rewards[{}]", i);
    if (!e.is_object())
      throw ConfigError(where + ": must be a mapping such as {name: answer, kind: exact, field: answer}");
    for (const auto& [key, value] : e.items())
      if (std::find_if(std::begin(kKeys), std::end(kKeys), [&](const char* k) { return key == k; }) == std::end(kKeys))
        throw ConfigError(
            fmt::format("{}: unknown key '{}' (known: name, kind, weight, field, pattern, ignore_case, "
                        "tolerance, keys, max_tokens, cache, run, timeout_s, fields)",
                        where, printable(key)));
    RewardSpec s;
    read_key(e, "name", s.name, where);
    read_key(e, "kind", s.kind, where);
    read_key(e, "weight", s.weight, where);
    read_key(e, "field", s.field, where);
    read_key(e, "pattern", s.pattern, where);
    read_key(e, "ignore_case", s.ignore_case, where);
    read_key(e, "tolerance", s.tolerance, where);
    read_key(e, "keys", s.keys, where);
    read_key(e, "max_tokens", s.max_tokens, where);
    read_key(e, "cache", s.cache, where);
    read_key(e, "run", s.run, where);
    read_key(e, "timeout_s", s.timeout_s, where);
    read_key(e, "fields", s.fields, where);
    if (!metric_name(s.name))
      throw ConfigError(
          fmt::format("{}: `name` must be set, of letters, digits, '_', '-' and '.' (it names the "
                      "metrics rewards/<name>/mean and /std), got '{}'",
                      where, printable(s.name)));
    for (const RewardSpec& o : out)
      if (o.name == s.name) throw ConfigError(fmt::format("{}: name '{}' is used twice", where, s.name));
    if (s.kind.empty()) throw ConfigError(fmt::format("{}: `kind` must be set (exact, number, regex, …)", where));
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace lorarun::train
