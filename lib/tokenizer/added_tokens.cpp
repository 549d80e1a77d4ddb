#include "tokenizer/added_tokens.hpp"

#include <algorithm>

#include "tokenizer/unicode.hpp"

namespace lorarun::tok {
namespace {

// Byte offset where the trailing run of White_Space characters of s begins.
size_t trailing_space_start(std::string_view s) {
  size_t end = s.size();
  while (end > 0) {
    size_t k = end - 1;
    while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
    size_t i = k;
    if (!unicode::is_white_space(unicode::next_cp(s, i))) break;
    end = k;
  }
  return end;
}

// Byte length of the leading run of White_Space characters of s.
size_t leading_space_len(std::string_view s) {
  size_t i = 0;
  for (size_t at = 0; at < s.size(); i = at)
    if (!unicode::is_white_space(unicode::next_cp(s, at))) break;
  return i;
}

}  // namespace

void AddedVocabulary::Trie::add(std::string_view key, int32_t token) {
  if (key.empty()) return;
  if (nodes.empty()) nodes.emplace_back();
  int32_t n = 0;
  for (unsigned char b : key) {
    auto& ch = nodes[n].children;
    auto it = std::find_if(ch.begin(), ch.end(), [&](const auto& c) { return c.first == b; });
    if (it != ch.end()) {
      n = it->second;
      continue;
    }
    int32_t next = static_cast<int32_t>(nodes.size());
    nodes[n].children.emplace_back(b, next);
    nodes.emplace_back();
    n = next;
  }
  if (nodes[n].token < 0) nodes[n].token = token;  // first of equal contents wins, as in HF
}

int32_t AddedVocabulary::Trie::longest_at(std::string_view text, size_t pos, size_t* len) const {
  int32_t best = -1, n = 0;
  for (size_t i = pos; i < text.size(); ++i) {
    const auto& ch = nodes[n].children;
    auto b = static_cast<unsigned char>(text[i]);
    auto it = std::find_if(ch.begin(), ch.end(), [&](const auto& c) { return c.first == b; });
    if (it == ch.end()) break;
    n = it->second;
    if (nodes[n].token >= 0) {
      best = nodes[n].token;
      *len = i + 1 - pos;
    }
  }
  return best;
}

AddedVocabulary::AddedVocabulary(std::vector<AddedToken> tokens, const Normalizer* normalizer)
    : tokens_(std::move(tokens)), word_("[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}]") {
  // HF builds its matchers from the special tokens first, then the others.
  std::vector<int32_t> order(tokens_.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int32_t>(i);
  std::stable_partition(order.begin(), order.end(), [&](int32_t i) { return tokens_[i].special; });
  for (size_t i = 0; i < tokens_.size(); ++i) {
    by_id_.try_emplace(tokens_[i].id, i);
    by_content_.try_emplace(tokens_[i].content, static_cast<int32_t>(i));
  }
  for (int32_t i : order) {
    const AddedToken& t = tokens_[i];
    if (t.special) special_.insert(t.content);
    if (!t.normalized) {
      raw_.add(t.content, i);
      continue;
    }
    std::string key = t.content;
    if (normalizer) normalizer->normalize(key);
    normalized_.add(key, i);
  }
}

bool AddedVocabulary::word_char(std::string_view ch) const {
  std::vector<std::pair<size_t, size_t>> m;
  word_.find_all(ch, m);
  return !m.empty();
}

std::vector<AddedVocabulary::Match> AddedVocabulary::find_matches(std::string_view text, const Trie& trie) const {
  std::vector<Match> splits;
  if (trie.nodes.empty()) return splits;
  size_t start_offset = 0;
  for (size_t pos = 0; pos < text.size();) {
    size_t len = 0;
    int32_t ti = trie.longest_at(text, pos, &len);
    if (ti < 0) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + len;
    pos = stop;  // the matcher resumes after a match even when the rules below discard it
    const AddedToken& t = tokens_[ti];
    if (t.single_word) {
      auto last_char = [&](std::string_view s) {
        size_t k = s.size() - 1;
        while (k > 0 && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        return s.substr(k);
      };
      std::string_view before = text.substr(0, start), after = text.substr(stop);
      bool start_space = before.empty() || !word_char(last_char(before));
      bool stop_space =
          after.empty() || !word_char(after.substr(0, unicode::utf8_len(static_cast<unsigned char>(after[0]))));
      if (!start_space || !stop_space) continue;
    }
    if (t.lstrip) start = std::max(trailing_space_start(text.substr(0, start)), start_offset);
    if (t.rstrip) stop += leading_space_len(text.substr(stop));
    splits.push_back({start, stop, ti});
    start_offset = stop;
  }
  return splits;
}

void AddedVocabulary::split(std::string_view text, bool at_start, bool normalized, std::vector<Piece>& out) const {
  size_t prev = 0;
  for (const Match& m : find_matches(text, normalized ? normalized_ : raw_)) {
    if (prev < m.start) out.push_back({std::string(text.substr(prev, m.start - prev)), at_start && prev == 0});
    out.push_back({std::string(text.substr(m.start, m.end - m.start)), false, tokens_[m.token].id});
    prev = m.end;
  }
  if (prev < text.size()) out.push_back({std::string(text.substr(prev)), at_start && prev == 0});
}

const AddedToken* AddedVocabulary::by_id(int32_t id) const {
  auto it = by_id_.find(id);
  return it == by_id_.end() ? nullptr : &tokens_[it->second];
}

const AddedToken* AddedVocabulary::by_content(std::string_view content) const {
  auto it = by_content_.find(content);
  return it == by_content_.end() ? nullptr : &tokens_[static_cast<size_t>(it->second)];
}

bool AddedVocabulary::is_special(std::string_view content) const { return special_.find(content) != special_.end(); }

}  // namespace lorarun::tok
