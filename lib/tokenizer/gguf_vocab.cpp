#include "tokenizer/gguf_vocab.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <nlohmann/json.hpp>
#include <set>
#include <string_view>
#include <unordered_map>
#include <unordered_set>

#include "tokenizer/components.hpp"
#include "tokenizer/unicode.hpp"
#include "util/error.hpp"

namespace lorarun::tok {

using nlohmann::json;
using nlohmann::ordered_json;

namespace {

constexpr int64_t kControl = 3, kUserDefined = 4;

// The split patterns transformers pairs with tokenizer.ggml.pre names (its
// GGUF_PRE_TOKENIZER_SPLITS); any other name keeps GPT-2's pattern (ByteLevel's own regex).
const char* split_pattern(std::string_view pre) {
  static constexpr const char* kLlama3 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static constexpr const char* kQwen2 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static constexpr const char* kQwen35 =
      R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static constexpr const char* kTekken =
      R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static constexpr const char* kGpt4o =
      R"([^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static const std::map<std::string_view, const char*> patterns = {
      {"llama3", kLlama3},       {"llama-v3", kLlama3},
      {"llama-bpe", kLlama3},    {"falcon3", kLlama3},
      {"falcon-h1", kLlama3},    {"pixtral", kLlama3},
      {"midm-2.0", kLlama3},     {"lfm2", kLlama3},
      {"jina-v5-nano", kLlama3}, {"dbrx", kLlama3},
      {"smaug-bpe", kLlama3},    {"tekken", kTekken},
      {"qwen2", kQwen2},         {"deepseek-r1-qwen", kQwen2},
      {"kormo", kQwen2},         {"f2llmv2", kQwen2},
      {"megrez", kQwen2},        {"qwen35", kQwen35},
      {"gpt-4o", kGpt4o},        {"llama4", kGpt4o},
      {"kanana2", kGpt4o},       {"talkie", kGpt4o},
      {"minimax-m2", kGpt4o}};
  auto it = patterns.find(pre);
  return it == patterns.end() ? nullptr : it->second;
}

ordered_json byte_level_step(bool use_regex) {
  return {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"trim_offsets", true}, {"use_regex", use_regex}};
}

// Whether every character of `token` is one of the 256 that spell bytes in a byte-level vocabulary.
bool spelled_in_bytes(std::string_view token) {
  static const std::unordered_set<char32_t> alphabet = [] {
    std::unordered_set<char32_t> s;
    for (int b = 0; b < 256; ++b) {
      size_t i = 0;
      s.insert(unicode::next_cp(byte_char(static_cast<unsigned char>(b)), i));
    }
    return s;
  }();
  for (size_t i = 0; i < token.size();)
    if (!alphabet.contains(unicode::next_cp(token, i))) return false;
  return true;
}

// A token written in plain UTF-8 (as some converters store added tokens), respelled byte by byte.
std::string respelled(std::string_view token) {
  std::string out;
  for (unsigned char b : token) out += byte_char(b);
  return out;
}

// The code points of `s` as byte offsets: cuts[k] is where code point k starts, cuts.back() == size.
std::vector<size_t> code_point_cuts(std::string_view s) {
  std::vector<size_t> cuts;
  for (size_t i = 0; i < s.size();) {
    cuts.push_back(i);
    unicode::next_cp(s, i);
  }
  cuts.push_back(s.size());
  return cuts;
}

struct Merge {
  std::string left, right;
  double score;
  size_t left_len, right_len;  // in code points
};

// transformers' generate_merges(vocab, scores): every split of a token into two vocabulary
// tokens, best score first (ties: longer left, then longer right; then the order found), tokens
// in the order they first appear and each token's splits by (id of left, id of right).
std::vector<Merge> merges_from_scores(const std::vector<std::string>& tokens, const std::vector<double>& scores,
                                      const std::unordered_map<std::string, int64_t>& vocab) {
  std::vector<std::string> order;
  std::unordered_map<std::string, double> score_of;
  for (size_t i = 0; i < tokens.size(); ++i)
    if (score_of.insert_or_assign(tokens[i], scores[i]).second) order.push_back(tokens[i]);
  std::vector<Merge> merges;
  for (const std::string& token : order) {
    const std::vector<size_t> cuts = code_point_cuts(token);
    const size_t n = cuts.size() - 1;
    std::vector<Merge> local;
    for (size_t k = 1; k < n; ++k) {
      std::string l = token.substr(0, cuts[k]), r = token.substr(cuts[k]);
      if (vocab.contains(l) && vocab.contains(r))
        local.push_back({std::move(l), std::move(r), score_of[token], k, n - k});
    }
    std::stable_sort(local.begin(), local.end(), [&](const Merge& a, const Merge& b) {
      return std::pair(vocab.at(a.left), vocab.at(a.right)) < std::pair(vocab.at(b.left), vocab.at(b.right));
    });
    std::move(local.begin(), local.end(), std::back_inserter(merges));
  }
  std::stable_sort(merges.begin(), merges.end(), [](const Merge& a, const Merge& b) {
    return std::tuple(a.score, a.left_len, a.right_len) > std::tuple(b.score, b.left_len, b.right_len);
  });
  return merges;
}

ordered_json added_token(const std::string& content, int64_t id, bool special) {
  return {{"id", id},        {"content", content},  {"single_word", false}, {"lstrip", false},
          {"rstrip", false}, {"normalized", false}, {"special", special}};
}

struct Built {
  ordered_json tokenizer;
  std::optional<std::string> bos, eos, unk, pad;
  bool add_bos = false, add_eos = false;
};

// What transformers builds from a vocabulary, by tokenizer.ggml.model and, for SentencePiece
// files, the kind lib/model tells by the architecture: GPT2Tokenizer, or the SentencePiece kinds.
enum class Kind { ByteLevel, Llama, Gemma, Phi3 };

Kind kind_of(const GgufVocab& v) {
  if (v.model == "gpt2") return Kind::ByteLevel;
  switch (v.sentencepiece) {
    case SentencePieceKind::Gemma:
      return Kind::Gemma;
    case SentencePieceKind::Phi3:
      return Kind::Phi3;
    case SentencePieceKind::Llama:
      break;
  }
  return Kind::Llama;
}

// The tokens every file of this kind gets as special ones when present (the defaults of the
// transformers class that builds it).
std::vector<std::string> default_specials(Kind kind) {
  if (kind == Kind::ByteLevel) return {"<|endoftext|>"};
  if (kind == Kind::Gemma) return {"<unk>", "<bos>", "<eos>", "<pad>", "<mask>"};
  return {"<unk>", "<s>", "</s>"};
}

// Python's str.isspace() for one code point.
bool python_space(char32_t c) {
  return c == ' ' || (c >= '\t' && c <= '\r') || (c >= 0x1c && c <= 0x1f) || c == 0x85 || c == 0xa0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

// Gemma files store a token of spaces as real spaces, which GemmaTokenizer looks up as "▁"s: a
// token of whitespace holding a space is respelled as that many "▁" (transformers' gemma_tokenizer);
// with no merges in the file, they are rebuilt with the file's order as the score.
GgufVocab gemma_respelled(const GgufVocab& v) {
  GgufVocab g = v;
  for (std::string& t : g.tokens) {
    size_t n = 0;
    bool spaces = !t.empty() && t.find(' ') != std::string::npos;
    for (size_t i = 0; spaces && i < t.size(); ++n) spaces = python_space(unicode::next_cp(t, i));
    if (!spaces) continue;
    t.clear();
    for (size_t k = 0; k < n; ++k) t += "\u2581";
  }
  if (g.merges.empty()) {
    g.scores.resize(g.tokens.size());
    for (size_t i = 0; i < g.scores.size(); ++i) g.scores[i] = -static_cast<double>(i);
  }
  return g;
}

std::string token_at(const GgufVocab& v, const std::optional<int64_t>& id, const char* key) {
  if (id && (*id < 0 || *id >= static_cast<int64_t>(v.tokens.size())))
    throw Error(fmt::format("{}: tokenizer.ggml.{} is {}, outside the {} tokens; re-convert the model", v.source, key,
                            *id, v.tokens.size()));
  return id ? v.tokens[static_cast<size_t>(*id)] : std::string();
}

Built build(const GgufVocab& file) {
  const Kind kind = kind_of(file);
  const GgufVocab gemma = kind == Kind::Gemma ? gemma_respelled(file) : GgufVocab{};
  const GgufVocab& v = kind == Kind::Gemma ? gemma : file;
  const bool byte_level = kind == Kind::ByteLevel;
  if (!byte_level && v.model != "llama")
    throw Error(fmt::format(
        "{}: tokenizer.ggml.model '{}' is not supported; supported: gpt2 (byte-level BPE), llama (SentencePiece BPE)",
        v.source, v.model));
  if (v.tokens.empty()) throw Error(fmt::format("{}: tokenizer.ggml.tokens is missing or empty", v.source));
  if (!v.token_types.empty() && v.token_types.size() != v.tokens.size())
    throw Error(fmt::format("{}: tokenizer.ggml.token_type has {} entries for {} tokens; re-convert the model",
                            v.source, v.token_types.size(), v.tokens.size()));
  if (!byte_level && v.merges.empty() && v.scores.size() != v.tokens.size())
    throw Error(fmt::format("{}: tokenizer.ggml.scores has {} entries for {} tokens (and there are no merges)",
                            v.source, v.scores.size(), v.tokens.size()));

  // Later duplicates win, as in a Python dict built from the list. (The JSON object is filled as
  // the vector it is: its own insertion searches every key before it, quadratic in a 262k vocabulary.)
  std::unordered_map<std::string, int64_t> vocab;
  std::unordered_map<std::string, size_t> slot;  // where each token sits in `entries`
  ordered_json::object_t entries;
  using Entries = std::vector<std::pair<const std::string, ordered_json>>;
  for (size_t i = 0; i < v.tokens.size(); ++i) {
    const std::string& t = v.tokens[i];
    std::string spelled = byte_level && !spelled_in_bytes(t) ? respelled(t) : t;
    vocab.insert_or_assign(spelled, static_cast<int64_t>(i));
    const auto [at, fresh] = slot.try_emplace(spelled, entries.size());
    if (fresh)
      static_cast<Entries&>(entries).emplace_back(std::move(spelled), static_cast<int64_t>(i));
    else
      static_cast<Entries&>(entries)[at->second].second = static_cast<int64_t>(i);
  }
  ordered_json vocab_json = ordered_json::object();
  vocab_json.get_ref<ordered_json::object_t&>() = std::move(entries);
  ordered_json merges = ordered_json::array();
  if (!v.merges.empty()) {
    for (const std::string& m : v.merges) {
      const size_t sp = m.find(' ');
      if (sp == std::string::npos)
        throw Error(fmt::format("{}: merge '{}' has no space between its two tokens", v.source, m));
      merges.push_back({m.substr(0, sp), m.substr(sp + 1)});
    }
  } else if (!byte_level) {
    for (Merge& m : merges_from_scores(v.tokens, v.scores, vocab)) merges.push_back({m.left, m.right});
  }

  Built b;
  b.bos = v.bos ? std::optional(token_at(v, v.bos, "bos_token_id")) : std::nullopt;
  b.eos = v.eos ? std::optional(token_at(v, v.eos, "eos_token_id")) : std::nullopt;
  b.unk = v.unk ? std::optional(token_at(v, v.unk, "unknown_token_id")) : std::nullopt;
  b.pad = v.pad ? std::optional(token_at(v, v.pad, "padding_token_id")) : std::nullopt;
  b.add_bos = v.add_bos.value_or(!byte_level);  // llama.cpp adds BOS to a SentencePiece vocabulary by default
  b.add_eos = v.add_eos.value_or(false);

  // Added tokens: the class's default specials, control tokens, the named specials (special), and
  // user-defined tokens (not special). Only tokens of the vocabulary: transformers would give a
  // missing default a new id past the model's embeddings.
  std::map<int64_t, ordered_json> added;
  auto add = [&](const std::string& t, bool special) {
    auto it = vocab.find(t);
    if (it == vocab.end()) return;
    auto [at, fresh] = added.try_emplace(it->second, added_token(t, it->second, special));
    if (!fresh && special) at->second["special"] = true;
  };
  for (const std::string& t : default_specials(kind)) add(t, true);
  for (size_t i = 0; i < v.token_types.size(); ++i)
    if (v.token_types[i] == kControl && (!byte_level || spelled_in_bytes(v.tokens[i]))) add(v.tokens[i], true);
  for (const auto* t : {&b.bos, &b.eos, &b.unk, &b.pad})
    if (*t) add(**t, true);
  // User-defined tokens come last and as plain ones, also over a class default (Gemma 3's <mask>).
  for (size_t i = 0; i < v.token_types.size(); ++i)
    if (v.token_types[i] == kUserDefined) {
      add(v.tokens[i], false);
      if (auto it = vocab.find(v.tokens[i]); it != vocab.end()) added.at(it->second)["special"] = false;
    }

  ordered_json& j = b.tokenizer;
  j["version"] = "1.0";
  j["truncation"] = nullptr;
  j["padding"] = nullptr;
  j["added_tokens"] = ordered_json::array();
  for (auto& [_, a] : added) j["added_tokens"].push_back(a);
  j["normalizer"] = nullptr;
  if (byte_level) {
    const char* split = split_pattern(v.pre);
    j["pre_tokenizer"] = split ? ordered_json{{"type", "Sequence"},
                                              {"pretokenizers",
                                               {{{"type", "Split"},
                                                 {"pattern", {{"Regex", split}}},
                                                 {"behavior", "Isolated"},
                                                 {"invert", false}},
                                                byte_level_step(false)}}}
                               : byte_level_step(true);
    j["decoder"] = byte_level_step(true);
  } else {
    const ordered_json spaces = {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\u2581"}};
    if (kind == Kind::Gemma) {
      j["normalizer"] = spaces;
      j["pre_tokenizer"] = {
          {"type", "Split"}, {"pattern", {{"String", " "}}}, {"behavior", "MergedWithPrevious"}, {"invert", false}};
    } else if (kind == Kind::Phi3) {
      j["normalizer"] = {{"type", "Sequence"}, {"normalizers", {{{"type", "Prepend"}, {"prepend", "\u2581"}}, spaces}}};
      j["pre_tokenizer"] = nullptr;
    } else {
      j["pre_tokenizer"] = {
          {"type", "Metaspace"}, {"replacement", "\u2581"}, {"prepend_scheme", "first"}, {"split", false}};
    }
    ordered_json steps = {{{"type", "Replace"}, {"pattern", {{"String", "\u2581"}}}, {"content", " "}},
                          {{"type", "ByteFallback"}},
                          {{"type", "Fuse"}}};
    if (kind != Kind::Gemma) steps.push_back({{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}});
    j["decoder"] = {{"type", "Sequence"}, {"decoders", steps}};
  }
  ordered_json single = ordered_json::array(), specials = ordered_json::object();
  auto special = [&](const std::optional<std::string>& t) {
    single.push_back({{"SpecialToken", {{"id", *t}, {"type_id", 0}}}});
    specials[*t] = {{"id", *t}, {"ids", {vocab.at(*t)}}, {"tokens", {*t}}};
  };
  b.add_bos = b.add_bos && b.bos;
  b.add_eos = b.add_eos && b.eos;
  if (b.add_bos) special(b.bos);
  single.push_back({{"Sequence", {{"id", "A"}, {"type_id", 0}}}});
  if (b.add_eos) special(b.eos);
  j["post_processor"] = {
      {"type", "TemplateProcessing"}, {"single", single}, {"pair", single}, {"special_tokens", specials}};
  j["model"] = {{"type", "BPE"},
                {"dropout", nullptr},
                {"unk_token", nullptr},
                {"continuing_subword_prefix", ""},
                {"end_of_word_suffix", ""},
                {"fuse_unk", !byte_level},
                {"byte_fallback", !byte_level},
                {"ignore_merges", false},
                {"vocab", std::move(vocab_json)},
                {"merges", std::move(merges)}};
  return b;
}

}  // namespace

HfTokenizerFiles hf_tokenizer_files(const GgufVocab& v) {
  Built b = build(v);
  ordered_json config = {{"add_bos_token", b.add_bos}, {"add_eos_token", b.add_eos}};
  const std::pair<const char*, const std::optional<std::string>*> named[] = {
      {"bos_token", &b.bos}, {"eos_token", &b.eos}, {"unk_token", &b.unk}, {"pad_token", &b.pad}};
  for (const auto& [key, t] : named) config[key] = *t ? json(**t) : json(nullptr);
  if (!v.chat_template.empty()) config["chat_template"] = v.chat_template;
  try {
    return {b.tokenizer.dump(), config.dump(2) + "\n"};
  } catch (const json::type_error& e) {  // a token that is not UTF-8
    throw Error(fmt::format("{}: the tokenizer metadata holds text that is not UTF-8 ({})", v.source, e.what()));
  }
}

}  // namespace lorarun::tok
