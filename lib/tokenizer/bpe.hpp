// The BPE model of HF tokenizers: a word (one pre-token) to ids by ranked pair merges.
#pragma once
#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lorarun::tok {

// String-keyed map that can be probed with a string_view without allocating.
struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using Vocab = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

struct BpeOptions {
  std::optional<std::string> unk_token;
  std::string continuing_subword_prefix;  // "" when absent
  std::string end_of_word_suffix;         // "" when absent
  bool fuse_unk = false;
  bool byte_fallback = false;
  bool ignore_merges = false;
};

class Bpe {
 public:
  // merges: pairs in rank order (a later duplicate of a pair takes the later rank, as in HF).
  Bpe(Vocab vocab, const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options);
  Bpe(Bpe&&) = delete;

  // Appends the ids of one pre-token.
  void tokenize(std::string_view word, std::vector<int32_t>& out) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  const std::string* id_to_token(int32_t id) const;  // nullptr when unknown
  const Vocab& vocab() const { return vocab_; }

 private:
  struct MergeValue {
    int32_t rank, new_id;
  };
  // Open addressing on the (left id, right id) pair: the hot lookup of every merge step.
  class MergeMap {
   public:
    void reserve(size_t n);
    void insert_or_assign(uint64_t key, MergeValue v);
    const MergeValue* find(uint64_t key) const;

   private:
    std::vector<uint64_t> keys_;
    std::vector<MergeValue> values_;
    size_t mask_ = 0, size_ = 0;
  };

  void merge_word(std::string_view word, std::vector<int32_t>& out) const;
  void initial_symbols(std::string_view word, std::vector<int32_t>& ids, std::vector<uint32_t>& lens) const;
  std::optional<int32_t> char_id(std::string_view ch) const;

  Vocab vocab_;
  std::vector<const std::string*> id_to_token_;
  MergeMap merges_;
  BpeOptions opt_;
  std::optional<int32_t> unk_id_;
  std::array<int32_t, 256> byte_fallback_ids_{};  // -1 where <0xXX> is missing
  std::vector<int32_t> bmp_char_ids_;             // id of each single BMP character, or -1

  // Results for short words; sharded so that parallel encoders rarely wait on one lock.
  static constexpr size_t kShards = 64, kShardCapacity = 4096, kMaxCachedWord = 256;
  struct Shard {
    std::mutex mu;
    std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> map;
  };
  mutable std::array<Shard, kShards> cache_;
};

}  // namespace lorarun::tok
