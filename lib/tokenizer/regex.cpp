#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/regex.hpp"

#include <fmt/format.h>
#include <pcre2.h>

#include <optional>

#include "tokenizer/unicode.hpp"
#include "util/error.hpp"

namespace lorarun::tok {
namespace {

// Oniguruma's \s is Unicode White_Space; PCRE2's also takes U+180E, so spell it out.
constexpr std::string_view kSpaceSet =
    "\\t\\n\\x0B\\f\\r\\x20\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";
// Oniguruma's \w is Letter | Mark | Decimal_Number | Connector_Punctuation.
constexpr std::string_view kWordSet = "\\p{L}\\p{M}\\p{Nd}\\p{Pc}";
// In Ruby syntax \h is a hex digit, not horizontal space.
constexpr std::string_view kHexSet = "0-9a-fA-F";

// Per category, as class members: what HF's engine has beyond PCRE2, and what only PCRE2 has.
struct PropertyAdditions {
  std::string_view name, added, removed;
};
#include "tokenizer/regex_props.inc"

const PropertyAdditions* additions(std::string_view name) {
  for (const auto& p : kPropertyAdditions)
    if (p.name == name) return &p;
  return nullptr;
}

// Rewrites one \p{X} / \P{X} / \pX at p[i] (i at the 'p'); returns the characters consumed.
size_t translate_property(std::string_view p, size_t i, bool in_class, std::string& out) {
  bool negated = p[i] == 'P';
  size_t end = i + 2;
  std::string_view name = p.substr(i + 1, 1);
  if (name == "{") {
    end = p.find('}', i);
    if (end == std::string_view::npos) end = p.size() - 1;
    name = p.substr(i + 2, end - i - 2);
    ++end;
  }
  std::string_view raw = p.substr(i - 1, end - (i - 1));
  if (name.starts_with('^')) {
    negated = !negated;
    name.remove_prefix(1);
  }
  const PropertyAdditions* fix = additions(name);
  if (!fix || (in_class && negated)) {
    out += raw;  // nothing known to fix (or no way inside a class: PCRE2's own set)
  } else if (in_class) {
    out += fmt::format("\\p{{{}}}{}", name, fix->added);  // removals cannot be expressed here
  } else if (fix->removed.empty()) {
    out += fmt::format("[{}\\p{{{}}}{}]", negated ? "^" : "", name, fix->added);
  } else if (negated) {
    out += fmt::format("(?:[{}]|[^\\p{{{}}}{}])", fix->removed, name, fix->added);
  } else {
    out += fmt::format("(?:(?![{}])[\\p{{{}}}{}])", fix->removed, name, fix->added);
  }
  return end - i;
}

std::string pcre2_message(int code) {
  PCRE2_UCHAR buf[256];
  pcre2_get_error_message(code, buf, sizeof buf);
  return reinterpret_cast<const char*>(buf);
}

struct MatchData {
  pcre2_match_data* md = nullptr;
  pcre2_match_context* ctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  ~MatchData() {
    pcre2_match_data_free(md);
    pcre2_match_context_free(ctx);
    pcre2_jit_stack_free(stack);
  }
  // Long runs (e.g. 100k spaces against \s+(?!\S)) outgrow the JIT's default 32 KiB stack.
  void grow_stack() {
    ctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(64 * 1024, 256 * 1024 * 1024, nullptr);
    if (!ctx || !stack) throw Error("tokenizer: out of memory for the regex JIT stack");
    pcre2_jit_stack_assign(ctx, nullptr, stack);
  }
};

}  // namespace

struct Regex::Impl {
  pcre2_code* code = nullptr;
  bool jit = false;
  ~Impl() { pcre2_code_free(code); }
};

std::string Regex::translate(std::string_view p) {
  std::string out;
  out.reserve(p.size() * 2);
  int class_depth = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      char e = p[++i];
      if (e == 'p' || e == 'P') {
        i += translate_property(p, i, class_depth > 0, out) - 1;
        continue;
      }
      std::string_view set;
      switch (e) {
        case 's':
        case 'S':
          set = kSpaceSet;
          break;
        case 'w':
        case 'W':
          set = kWordSet;
          break;
        case 'h':
        case 'H':
          set = kHexSet;
          break;
        default:
          out += c;
          out += e;
          continue;
      }
      bool negated = e == 'S' || e == 'W' || e == 'H';
      std::string members;
      for (size_t k = 0; k < set.size(); ++k) {
        if (set[k] == '\\' && set[k + 1] == 'p')
          k += translate_property(set, k + 1, true, members);
        else
          members += set[k];
      }
      if (class_depth == 0)
        out += fmt::format("[{}{}]", negated ? "^" : "", members);
      else if (!negated)
        out += members;
      else
        throw Error(
            fmt::format("tokenizer.json: regex escape \\{} inside a character class is "
                        "not supported in pattern '{}'",
                        e, p));
      continue;
    }
    out += c;
    if (c == '[') {
      ++class_depth;
      // A ']' right after '[' or '[^' is a literal member, not the end of the class.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
    } else if (c == ']' && class_depth > 0) {
      --class_depth;
    }
  }
  return out;
}

Regex::Regex(std::string_view onig_pattern) : impl_(std::make_unique<Impl>()) {
  std::string pattern = translate(onig_pattern);
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  // Ruby syntax (what HF's onig uses) makes ^ and $ line anchors.
  impl_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                              PCRE2_UTF | PCRE2_UCP | PCRE2_MULTILINE, &err, &err_offset, nullptr);
  if (!impl_->code)
    throw Error(fmt::format("tokenizer.json: cannot compile regex '{}' at offset {}: {}", onig_pattern, err_offset,
                            pcre2_message(err)));
  impl_->jit = pcre2_jit_compile(impl_->code, PCRE2_JIT_COMPLETE) == 0;
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

void Regex::find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const {
  MatchData m;
  m.md = pcre2_match_data_create_from_pattern(impl_->code, nullptr);
  if (!m.md) throw Error("tokenizer: out of memory for regex match data");
  auto subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  std::optional<size_t> last_match_end;
  while (pos <= text.size()) {
    int rc = impl_->jit ? pcre2_jit_match(impl_->code, subject, text.size(), pos, 0, m.md, m.ctx)
                        : pcre2_match(impl_->code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, m.md, m.ctx);
    if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !m.stack) {
      m.grow_stack();
      continue;
    }
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) throw Error(fmt::format("tokenizer: regex match failed: {}", pcre2_message(rc)));
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(m.md);
    size_t s = ov[0], e = ov[1];
    // Like onig's find_iter: no empty match right where the previous match ended.
    if (s == e && last_match_end == e) {
      pos += pos < text.size() ? unicode::utf8_len(static_cast<unsigned char>(text[pos])) : 1;
      continue;
    }
    out.emplace_back(s, e);
    pos = e;
    last_match_end = e;
  }
}

Pattern Pattern::literal(std::string s) {
  Pattern p;
  p.literal_ = std::move(s);
  return p;
}

Pattern Pattern::regex(std::string_view onig_pattern) {
  Pattern p;
  p.regex_ = std::make_shared<const Regex>(onig_pattern);
  return p;
}

void Pattern::find_matches(std::string_view text, std::vector<Span>& out) const {
  if (text.empty()) {
    out.push_back({0, 0, false});
    return;
  }
  if (!regex_ && literal_.empty()) {
    out.push_back({0, text.size(), false});
    return;
  }
  std::vector<std::pair<size_t, size_t>> found;
  if (regex_) {
    regex_->find_all(text, found);
  } else {
    for (size_t at = text.find(literal_); at != std::string_view::npos; at = text.find(literal_, at + literal_.size()))
      found.emplace_back(at, at + literal_.size());
  }
  size_t prev = 0;
  for (auto [s, e] : found) {
    if (prev != s) out.push_back({prev, s, false});
    out.push_back({s, e, true});
    prev = e;
  }
  if (prev != text.size()) out.push_back({prev, text.size(), false});
}

}  // namespace lorarun::tok
