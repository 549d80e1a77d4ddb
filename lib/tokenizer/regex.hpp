// Oniguruma-compatible regular expressions (as HF tokenizers uses them) on PCRE2 with JIT.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace lorarun::tok {

// One split of a text: bytes [start, end) and whether the pattern matched them.
struct Span {
  size_t start, end;
  bool match;
};

// A compiled pattern. HF writes patterns for Oniguruma (Ruby syntax); the few escapes whose
// meaning differs in PCRE2 (\s, \S, \w, \W, \h, \H) are rewritten to Oniguruma's sets.
class Regex {
 public:
  explicit Regex(std::string_view onig_pattern);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // Appends the [start, end) of every match, left to right, as onig's find_iter yields them.
  // The text must be valid UTF-8.
  void find_all(std::string_view text, std::vector<std::pair<size_t, size_t>>& out) const;

  // Translation of an Oniguruma pattern to PCRE2 syntax (exposed for tests).
  static std::string translate(std::string_view onig_pattern);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// HF's Pattern: a literal string or a Regex; find_matches splits a text into matching and
// non-matching spans that cover it (a single non-match span for an empty text).
class Pattern {
 public:
  static Pattern literal(std::string s);
  static Pattern regex(std::string_view onig_pattern);
  void find_matches(std::string_view text, std::vector<Span>& out) const;

 private:
  std::string literal_;
  std::shared_ptr<const Regex> regex_;
};

}  // namespace lorarun::tok
