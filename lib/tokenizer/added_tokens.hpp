// Added tokens (tokenizer.json "added_tokens"): found in the text before the model runs.
#pragma once
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "tokenizer/bpe.hpp"

#include "tokenizer/components.hpp"
#include "tokenizer/regex.hpp"

namespace lorarun::tok {

struct AddedToken {
  std::string content;
  int32_t id = -1;
  bool special = false, single_word = false, lstrip = false, rstrip = false, normalized = true;
};

// HF's AddedVocabulary: leftmost-longest matching of token contents in a text, with the
// single_word / lstrip / rstrip rules. Non-normalized tokens are matched in the raw text,
// normalized ones (by their normalized content) in each normalized piece.
class AddedVocabulary {
 public:
  AddedVocabulary(std::vector<AddedToken> tokens, const Normalizer* normalizer);

  // Splits text into pieces; matched tokens become pieces with their id.
  void split(std::string_view text, bool at_start, bool normalized, std::vector<Piece>& out) const;
  bool has_normalized() const { return !normalized_.nodes.empty(); }

  const AddedToken* by_id(int32_t id) const;
  const AddedToken* by_content(std::string_view content) const;
  bool is_special(std::string_view content) const;
  const std::vector<AddedToken>& tokens() const { return tokens_; }

 private:
  // A byte trie over the token contents; leaf holds the index into tokens_.
  struct Trie {
    struct Node {
      std::vector<std::pair<unsigned char, int32_t>> children;
      int32_t token = -1;
    };
    std::vector<Node> nodes;
    void add(std::string_view key, int32_t token);
    // Index of the longest token starting at text[pos], or -1; *len gets its length.
    int32_t longest_at(std::string_view text, size_t pos, size_t* len) const;
  };

  struct Match {
    size_t start, end;
    int32_t token;
  };
  std::vector<Match> find_matches(std::string_view text, const Trie& trie) const;
  bool word_char(std::string_view ch) const;

  std::vector<AddedToken> tokens_;
  Trie raw_, normalized_;
  std::unordered_set<std::string, StringHash, std::equal_to<>> special_;
  std::unordered_map<int32_t, size_t> by_id_;
  Vocab by_content_;  // content -> index into tokens_
  Regex word_;        // Rust regex's \w, used by the single_word rule
};

}  // namespace lorarun::tok
