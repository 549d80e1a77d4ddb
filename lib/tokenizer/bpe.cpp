#include "tokenizer/bpe.hpp"

#include <fmt/format.h>

#include <queue>

#include "tokenizer/unicode.hpp"
#include "util/error.hpp"
#include "util/mix.hpp"

namespace lorarun::tok {
namespace {

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

constexpr uint64_t mix(uint64_t k) { return mix64(k); }  // spreads ids that differ in few bits

constexpr uint64_t kEmptyKey = ~uint64_t{0};

}  // namespace

void Bpe::MergeMap::reserve(size_t n) {
  size_t cap = 16;
  while (cap < n * 2) cap <<= 1;
  keys_.assign(cap, kEmptyKey);
  values_.assign(cap, {});
  mask_ = cap - 1;
}

void Bpe::MergeMap::insert_or_assign(uint64_t key, MergeValue v) {
  for (size_t i = mix(key) & mask_;; i = (i + 1) & mask_) {
    if (keys_[i] == kEmptyKey) {
      keys_[i] = key;
      values_[i] = v;
      ++size_;
      return;
    }
    if (keys_[i] == key) {
      values_[i] = v;
      return;
    }
  }
}

const Bpe::MergeValue* Bpe::MergeMap::find(uint64_t key) const {
  if (keys_.empty()) return nullptr;
  for (size_t i = mix(key) & mask_;; i = (i + 1) & mask_) {
    if (keys_[i] == key) return &values_[i];
    if (keys_[i] == kEmptyKey) return nullptr;
  }
}

Bpe::Bpe(Vocab vocab, const std::vector<std::pair<std::string, std::string>>& merges, BpeOptions options)
    : vocab_(std::move(vocab)), opt_(std::move(options)) {
  int32_t max_id = -1;
  for (const auto& [tok, id] : vocab_) {
    if (id < 0) throw Error(fmt::format("tokenizer.json: model.vocab has a negative id for '{}'", tok));
    max_id = std::max(max_id, id);
  }
  id_to_token_.assign(static_cast<size_t>(max_id + 1), nullptr);
  for (const auto& [tok, id] : vocab_) id_to_token_[static_cast<size_t>(id)] = &tok;

  merges_.reserve(merges.size());
  size_t prefix_len = opt_.continuing_subword_prefix.size();
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    auto ia = token_to_id(a), ib = token_to_id(b);
    std::string joined = a + (b.size() >= prefix_len ? b.substr(prefix_len) : b);
    auto inew = token_to_id(joined);
    if (!ia || !ib || !inew) {
      std::string missing = joined;
      if (!ib) missing = b;
      if (!ia) missing = a;
      throw Error(
          fmt::format("tokenizer.json: merge '{} {}' uses a token missing from "
                      "model.vocab ('{}'); the file is inconsistent",
                      a, b, missing));
    }
    merges_.insert_or_assign(pair_key(*ia, *ib), {static_cast<int32_t>(rank), *inew});
  }
  if (opt_.unk_token) unk_id_ = token_to_id(*opt_.unk_token);
  for (int b = 0; b < 256; ++b) byte_fallback_ids_[b] = token_to_id(fmt::format("<0x{:02X}>", b)).value_or(-1);
  bmp_char_ids_.assign(0x10000, -1);
  for (const auto& [tok, id] : vocab_) {
    size_t i = 0;
    if (tok.empty()) continue;
    char32_t c = unicode::next_cp(tok, i);
    if (i == tok.size() && c < 0x10000) bmp_char_ids_[c] = id;
  }
}

std::optional<int32_t> Bpe::token_to_id(std::string_view token) const {
  auto it = vocab_.find(token);
  if (it == vocab_.end()) return std::nullopt;
  return it->second;
}

const std::string* Bpe::id_to_token(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= id_to_token_.size()) return nullptr;
  return id_to_token_[static_cast<size_t>(id)];
}

std::optional<int32_t> Bpe::char_id(std::string_view ch) const {
  size_t i = 0;
  char32_t c = unicode::next_cp(ch, i);
  if (c < 0x10000) {
    int32_t id = bmp_char_ids_[c];
    return id < 0 ? std::nullopt : std::optional<int32_t>(id);
  }
  return token_to_id(ch);
}

// HF's merge_word: one symbol per character (with prefix/suffix), unknown characters as
// byte-fallback tokens or (fused) unk. ids/lens receive the symbols; len is in bytes.
void Bpe::initial_symbols(std::string_view w, std::vector<int32_t>& ids, std::vector<uint32_t>& lens) const {
  const bool plain = opt_.continuing_subword_prefix.empty() && opt_.end_of_word_suffix.empty();
  std::optional<std::pair<int32_t, uint32_t>> unk;
  std::string s;
  for (size_t i = 0; i < w.size();) {
    size_t n = unicode::utf8_len(static_cast<unsigned char>(w[i]));
    std::string_view ch = w.substr(i, n);
    bool first = i == 0, last = i + n == w.size();
    i += n;
    std::optional<int32_t> id;
    if (plain) {
      id = char_id(ch);
    } else {
      s.assign(first ? "" : opt_.continuing_subword_prefix).append(ch);
      if (last) s += opt_.end_of_word_suffix;
      id = token_to_id(s);
    }
    if (id) {
      if (unk) {
        ids.push_back(unk->first);
        lens.push_back(unk->second);
        unk.reset();
      }
      ids.push_back(*id);
      lens.push_back(static_cast<uint32_t>(n));
      continue;
    }
    std::string_view full = plain ? ch : std::string_view(s);
    if (opt_.byte_fallback) {
      bool all = true;
      for (unsigned char b : full) all = all && byte_fallback_ids_[b] >= 0;
      if (all) {
        for (unsigned char b : full) {
          ids.push_back(byte_fallback_ids_[b]);
          lens.push_back(1);
        }
        continue;
      }
    }
    if (!opt_.unk_token) continue;
    if (!unk_id_) throw Error(fmt::format("tokenizer.json: unk_token '{}' is not in model.vocab", *opt_.unk_token));
    if (unk && opt_.fuse_unk) {
      unk->second += static_cast<uint32_t>(n);
      continue;
    }
    if (unk) {
      ids.push_back(unk->first);
      lens.push_back(unk->second);
    }
    unk = std::pair{*unk_id_, static_cast<uint32_t>(n)};
  }
  if (unk) {
    ids.push_back(unk->first);
    lens.push_back(unk->second);
  }
}

void Bpe::merge_word(std::string_view word, std::vector<int32_t>& out) const {
  struct Symbol {
    int32_t id, prev, next;
    uint32_t len;
  };
  struct Merge {
    int32_t rank, pos, new_id;
  };
  // Min-heap on (rank, pos), as HF's BinaryHeap<Merge> orders it.
  auto later = [](const Merge& a, const Merge& b) { return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos; };
  std::vector<int32_t> ids;
  std::vector<uint32_t> lens;
  initial_symbols(word, ids, lens);
  const int32_t n = static_cast<int32_t>(ids.size());
  std::vector<Symbol> sym(ids.size());
  for (int32_t i = 0; i < n; ++i) sym[i] = {ids[i], i - 1, i + 1 < n ? i + 1 : -1, lens[i]};

  std::priority_queue<Merge, std::vector<Merge>, decltype(later)> queue(later);
  for (int32_t i = 0; i + 1 < n; ++i)
    if (const MergeValue* m = merges_.find(pair_key(sym[i].id, sym[i + 1].id))) queue.push({m->rank, i, m->new_id});
  while (!queue.empty()) {
    Merge top = queue.top();
    queue.pop();
    Symbol& cur = sym[top.pos];
    if (cur.len == 0 || cur.next == -1) continue;
    Symbol right = sym[cur.next];
    const MergeValue* m = merges_.find(pair_key(cur.id, right.id));
    if (!m || m->new_id != top.new_id) continue;  // a stale entry
    sym[cur.next].len = 0;
    cur.id = top.new_id;
    cur.len += right.len;
    cur.next = right.next;
    if (right.next >= 0) sym[right.next].prev = top.pos;
    if (cur.prev >= 0)
      if (const MergeValue* p = merges_.find(pair_key(sym[cur.prev].id, cur.id)))
        queue.push({p->rank, cur.prev, p->new_id});
    if (cur.next >= 0)
      if (const MergeValue* q = merges_.find(pair_key(cur.id, sym[cur.next].id)))
        queue.push({q->rank, top.pos, q->new_id});
  }
  for (const Symbol& s : sym)
    if (s.len != 0) out.push_back(s.id);
}

void Bpe::tokenize(std::string_view word, std::vector<int32_t>& out) const {
  if (word.empty()) return;
  if (opt_.ignore_merges)
    if (auto id = token_to_id(word)) {
      out.push_back(*id);
      return;
    }
  if (word.size() >= kMaxCachedWord) {
    merge_word(word, out);
    return;
  }
  Shard& shard = cache_[StringHash{}(word) % kShards];
  {
    std::lock_guard lock(shard.mu);
    if (auto it = shard.map.find(word); it != shard.map.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  size_t start = out.size();
  merge_word(word, out);
  std::lock_guard lock(shard.mu);
  if (shard.map.size() < kShardCapacity)
    shard.map.try_emplace(std::string(word), out.begin() + static_cast<std::ptrdiff_t>(start), out.end());
}

}  // namespace lorarun::tok
