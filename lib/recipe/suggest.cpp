#include "recipe/suggest.hpp"

#include <algorithm>

namespace lorarun::recipe::detail {
namespace {

std::vector<std::string_view> split_words(std::string_view s) {
  std::vector<std::string_view> words;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == '_' || s[i] == '-') {
      if (i > start) words.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  return words;
}

// Whether `abbrev` (separators ignored) is a concatenation of non-empty prefixes of each word,
// in order: "lr" of {learning, rate}, "gas" of {gradient, accumulation, steps}.
bool prefixes_of(std::string_view abbrev, const std::vector<std::string_view>& words, size_t w) {
  if (w == words.size()) return abbrev.empty();
  for (size_t k = 1; k <= std::min(abbrev.size(), words[w].size()) && abbrev[k - 1] == words[w][k - 1]; ++k)
    if (prefixes_of(abbrev.substr(k), words, w + 1)) return true;
  return false;
}

bool abbreviates(std::string_view shorter, std::string_view longer) {
  std::string compact;
  for (char c : shorter)
    if (c != '_' && c != '-') compact += c;
  return !compact.empty() && prefixes_of(compact, split_words(longer), 0);
}

// Whether every word of `shorter` is a whole word of `longer`: "batch" / "batch_size".
bool words_within(std::string_view shorter, std::string_view longer) {
  const std::vector<std::string_view> inner = split_words(shorter), outer = split_words(longer);
  if (inner.empty() || shorter.size() < 3 || inner.size() >= outer.size()) return false;
  return std::all_of(inner.begin(), inner.end(),
                     [&](std::string_view w) { return std::find(outer.begin(), outer.end(), w) != outer.end(); });
}

}  // namespace

size_t edit_distance(std::string_view a, std::string_view b) {
  // d[i][j]: distance between a[:i] and b[:j], three rows kept for the swap case.
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

bool is_close(std::string_view word, std::string_view candidate) {
  const size_t shortest = std::min(word.size(), candidate.size());
  if (edit_distance(word, candidate) <= std::max<size_t>(1, shortest / 3)) return true;
  return abbreviates(word, candidate) || abbreviates(candidate, word) || words_within(word, candidate) ||
         words_within(candidate, word);
}

std::optional<std::string> closest(std::string_view word, const std::vector<std::string>& candidates) {
  std::optional<std::string> best;
  size_t best_distance = 0;
  for (const std::string& c : candidates) {
    if (!is_close(word, c)) continue;
    const size_t d = edit_distance(word, c);
    if (!best || d < best_distance) best = c, best_distance = d;
  }
  return best;
}

}  // namespace lorarun::recipe::detail
