#include "tokenizer/components.hpp"

#include <fmt/format.h>

#include <array>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>

#include "tokenizer/regex.hpp"
#include "tokenizer/unicode.hpp"
#include "util/error.hpp"

namespace lorarun::tok {
namespace {

using nlohmann::json;

// GPT-2's pre-tokenization pattern, which ByteLevel applies when use_regex is set.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// Sequences inside Sequences: HF cannot load more (serde_json's recursion limit is 128), and
// each level is a stack frame here.
constexpr int kMaxSequenceDepth = 64;

int nested(int depth, std::string_view stage) {
  if (depth >= kMaxSequenceDepth)
    throw Error(fmt::format("tokenizer.json: {} Sequences are nested more than {} deep", stage, kMaxSequenceDepth));
  return depth + 1;
}

std::string type_of(const json& j, std::string_view stage) {
  if (!j.is_object() || !j.contains("type") || !j["type"].is_string())
    throw Error(fmt::format("tokenizer.json: {} must be an object with a string 'type'", stage));
  return j["type"].get<std::string>();
}

[[noreturn]] void unsupported(std::string_view stage, std::string_view type, std::string_view supported) {
  throw Error(fmt::format("tokenizer.json: {} type '{}' is not supported (supported: {})", stage, type, supported));
}

template <class T>
T value_or(const json& j, const char* key, T fallback) {
  auto it = j.find(key);
  return it == j.end() || it->is_null() ? fallback : it->get<T>();
}

// A Split/Replace "pattern": {"String": "..."} or {"Regex": "..."}.
Pattern make_pattern(const json& j) {
  if (j.is_object() && j.contains("String")) return Pattern::literal(j["String"].get<std::string>());
  if (j.is_object() && j.contains("Regex")) return Pattern::regex(j["Regex"].get<std::string>());
  throw Error("tokenizer.json: a 'pattern' must be {\"String\": ...} or {\"Regex\": ...}");
}

// A single character given as a JSON string (Metaspace's replacement, Strip's content).
std::string one_char(const json& j, std::string_view what) {
  auto s = j.get<std::string>();
  if (s.empty() || unicode::utf8_len(static_cast<unsigned char>(s[0])) != s.size())
    throw Error(fmt::format("tokenizer.json: {} must be a single character, got '{}'", what, s));
  return s;
}

std::string replace_all(std::string_view text, const Pattern& pattern, std::string_view content) {
  std::vector<Span> spans;
  pattern.find_matches(text, spans);
  std::string out;
  out.reserve(text.size());
  for (const Span& s : spans) {
    if (s.match)
      out += content;
    else
      out.append(text.substr(s.start, s.end - s.start));
  }
  return out;
}

// ---- normalizers ------------------------------------------------------------------------

struct NormalizerSequence : Normalizer {
  std::vector<std::unique_ptr<Normalizer>> steps;
  void normalize(std::string& s) const override {
    for (const auto& n : steps) n->normalize(s);
  }
};

struct Prepend : Normalizer {
  std::string prefix;
  void normalize(std::string& s) const override {
    if (!s.empty()) s.insert(0, prefix);
  }
};

struct Replace : Normalizer {
  Pattern pattern;
  std::string content;
  void normalize(std::string& s) const override { s = replace_all(s, pattern, content); }
};

struct Nfc : Normalizer {
  void normalize(std::string& s) const override { s = unicode::nfc(s); }
};

struct Nfd : Normalizer {
  void normalize(std::string& s) const override { s = unicode::nfd(s); }
};

struct Strip : Normalizer {
  bool left = true, right = true;
  void normalize(std::string& s) const override {
    size_t begin = 0, end = s.size();
    if (left)
      for (size_t i = 0; i < s.size(); begin = i)
        if (!unicode::is_white_space(unicode::next_cp(s, i))) break;
    if (right)
      while (end > begin) {
        size_t k = end - 1;
        while (k > begin && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        size_t i = k;
        if (!unicode::is_white_space(unicode::next_cp(s, i))) break;
        end = k;
      }
    s = s.substr(begin, end - begin);
  }
};

// ---- pre-tokenizers ---------------------------------------------------------------------

enum class Behavior { Removed, Isolated, MergedWithPrevious, MergedWithNext, Contiguous };

Behavior parse_behavior(const json& j) {
  auto b = j.get<std::string>();
  if (b == "Removed") return Behavior::Removed;
  if (b == "Isolated") return Behavior::Isolated;
  if (b == "MergedWithPrevious") return Behavior::MergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::MergedWithNext;
  if (b == "Contiguous") return Behavior::Contiguous;
  throw Error(
      fmt::format("tokenizer.json: split behavior '{}' is not one of Removed, Isolated, "
                  "MergedWithPrevious, MergedWithNext, Contiguous",
                  b));
}

// HF's NormalizedString::split: turns match/non-match spans into the kept parts.
std::vector<Span> apply_behavior(const std::vector<Span>& spans, Behavior behavior) {
  std::vector<Span> out;
  bool prev_match = false;
  switch (behavior) {
    case Behavior::Isolated:
      return spans;
    case Behavior::Removed:
      for (const Span& s : spans)
        if (!s.match) out.push_back(s);
      return out;
    case Behavior::MergedWithPrevious:
      for (const Span& s : spans) {
        if (s.match && !prev_match && !out.empty())
          out.back().end = s.end;
        else
          out.push_back(s);
        prev_match = s.match;
      }
      return out;
    case Behavior::MergedWithNext:
      for (auto it = spans.rbegin(); it != spans.rend(); ++it) {
        if (it->match && !prev_match && !out.empty())
          out.back().start = it->start;
        else
          out.push_back(*it);
        prev_match = it->match;
      }
      return {out.rbegin(), out.rend()};
    case Behavior::Contiguous:
      for (const Span& s : spans) {
        if (s.match == prev_match && !out.empty())
          out.back().end = s.end;
        else
          out.push_back(s);
        prev_match = s.match;
      }
      return out;
  }
  return out;
}

// Runs f(piece, out) on every piece that is not an added token, then drops empty pieces.
template <class F>
void split_pieces(std::vector<Piece>& pieces, F&& f) {
  std::vector<Piece> out;
  out.reserve(pieces.size() * 2);
  for (Piece& p : pieces) {
    if (p.id >= 0)
      out.push_back(std::move(p));
    else
      f(p, out);
  }
  std::erase_if(out, [](const Piece& p) { return p.id < 0 && p.text.empty(); });
  pieces.swap(out);
}

void emit_spans(const Piece& p, std::string_view text, const std::vector<Span>& spans, std::vector<Piece>& out) {
  for (const Span& s : spans)
    if (s.end > s.start)
      out.push_back({std::string(text.substr(s.start, s.end - s.start)), p.at_start && s.start == 0});
}

void split_by(const Pattern& pattern, Behavior behavior, bool invert, Piece& p, std::vector<Piece>& out) {
  std::vector<Span> spans;
  pattern.find_matches(p.text, spans);
  if (invert)
    for (Span& s : spans) s.match = !s.match;
  emit_spans(p, p.text, apply_behavior(spans, behavior), out);
}

struct PreTokenizerSequence : PreTokenizer {
  std::vector<std::unique_ptr<PreTokenizer>> steps;
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    for (const auto& s : steps) s->pre_tokenize(pieces);
  }
};

struct Split : PreTokenizer {
  Pattern pattern;
  Behavior behavior = Behavior::Isolated;
  bool invert = false;
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](Piece& p, std::vector<Piece>& out) { split_by(pattern, behavior, invert, p, out); });
  }
};

struct ByteLevelPre : PreTokenizer {
  bool add_prefix_space = true;
  std::optional<Pattern> regex;  // set when use_regex
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](Piece& p, std::vector<Piece>& out) {
      if (add_prefix_space && !p.text.starts_with(' ')) p.text = " " + p.text;
      if (regex)
        split_by(*regex, Behavior::Isolated, false, p, out);
      else
        out.push_back(std::move(p));
    });
    for (Piece& p : pieces) {
      if (p.id >= 0) continue;
      std::string mapped;
      mapped.reserve(p.text.size() * 2);
      for (unsigned char b : p.text) mapped += byte_char(b);
      p.text = std::move(mapped);
    }
  }
};

enum class PrependScheme { Always, First, Never };

struct MetaspacePre : PreTokenizer {
  std::string replacement;
  PrependScheme scheme = PrependScheme::Always;
  bool split = true;
  Pattern delimiter;
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    static const Pattern space = Pattern::literal(" ");
    split_pieces(pieces, [&](Piece& p, std::vector<Piece>& out) {
      p.text = replace_all(p.text, space, replacement);
      bool prepend = scheme == PrependScheme::Always || (scheme == PrependScheme::First && p.at_start);
      if (prepend && !p.text.starts_with(replacement)) p.text.insert(0, replacement);
      if (split)
        split_by(delimiter, Behavior::MergedWithNext, false, p, out);
      else
        out.push_back(std::move(p));
    });
  }
};

struct Digits : PreTokenizer {
  Pattern digit = Pattern::regex("\\p{N}");
  bool individual = false;
  void pre_tokenize(std::vector<Piece>& pieces) const override {
    split_pieces(pieces, [&](Piece& p, std::vector<Piece>& out) {
      split_by(digit, individual ? Behavior::Isolated : Behavior::Contiguous, false, p, out);
    });
  }
};

PrependScheme parse_prepend_scheme(const json& j) {
  if (j.contains("prepend_scheme")) {
    auto s = j["prepend_scheme"].get<std::string>();
    if (s == "always") return PrependScheme::Always;
    if (s == "first") return PrependScheme::First;
    if (s == "never") return PrependScheme::Never;
    throw Error(
        fmt::format("tokenizer.json: Metaspace prepend_scheme '{}' is not one of always, "
                    "first, never",
                    s));
  }
  // Files from before prepend_scheme existed say add_prefix_space.
  return value_or(j, "add_prefix_space", true) ? PrependScheme::Always : PrependScheme::Never;
}

// ---- post-processors --------------------------------------------------------------------

struct Template : PostProcessor {
  // Each step is the sequence itself (nullopt) or the ids of one special token.
  std::vector<std::optional<std::vector<int32_t>>> steps;
  void process(std::vector<int32_t>& ids, bool add_special_tokens) const override {
    if (!add_special_tokens) return;
    std::vector<int32_t> out;
    out.reserve(ids.size() + 4);
    for (const auto& s : steps) {
      if (s)
        out.insert(out.end(), s->begin(), s->end());
      else
        out.insert(out.end(), ids.begin(), ids.end());
    }
    ids.swap(out);
  }
  size_t added_tokens() const override {
    size_t n = 0;
    for (const auto& s : steps) n += s ? s->size() : 0;
    return n;
  }
};

struct NoOpProcessor : PostProcessor {
  void process(std::vector<int32_t>&, bool) const override {}
  size_t added_tokens() const override { return 0; }
};

struct ProcessorSequence : PostProcessor {
  std::vector<std::unique_ptr<PostProcessor>> steps;
  void process(std::vector<int32_t>& ids, bool add) const override {
    for (const auto& p : steps) p->process(ids, add);
  }
  size_t added_tokens() const override {
    size_t n = 0;
    for (const auto& p : steps) n += p->added_tokens();
    return n;
  }
};

std::unique_ptr<PostProcessor> make_template(const json& j) {
  auto t = std::make_unique<Template>();
  const json& specials = j.at("special_tokens");
  for (const json& item : j.at("single")) {
    if (item.contains("Sequence")) {
      t->steps.emplace_back(std::nullopt);
      continue;
    }
    auto name = item.at("SpecialToken").at("id").get<std::string>();
    if (!specials.contains(name))
      throw Error(
          fmt::format("tokenizer.json: TemplateProcessing uses special token '{}' that "
                      "is not in its special_tokens",
                      name));
    const json& id_list = specials[name].at("ids");
    if (!id_list.is_array())
      throw Error(fmt::format("tokenizer.json: TemplateProcessing special token '{}' has no ids array", name));
    std::vector<int32_t> ids;
    for (const json& id : id_list)
      ids.push_back(static_cast<int32_t>(json_int(id, "a TemplateProcessing special token id", 0, INT32_MAX)));
    t->steps.emplace_back(std::move(ids));
  }
  return t;
}

// BertProcessing / RobertaProcessing on one sequence: cls, the sequence, sep.
std::unique_ptr<PostProcessor> make_cls_sep(const json& j) {
  auto t = std::make_unique<Template>();
  auto id = [&](const char* key) {
    return static_cast<int32_t>(json_int(j.at(key).at(1), fmt::format("post_processor {} id", key), 0, INT32_MAX));
  };
  t->steps.emplace_back(std::vector<int32_t>{id("cls")});
  t->steps.emplace_back(std::nullopt);
  t->steps.emplace_back(std::vector<int32_t>{id("sep")});
  return t;
}

// ---- decoders ---------------------------------------------------------------------------

struct DecoderSequence : Decoder {
  std::vector<std::unique_ptr<Decoder>> steps;
  void decode_chain(std::vector<std::string>& t) const override {
    for (const auto& d : steps) d->decode_chain(t);
  }
};

struct ByteLevelDecoder : Decoder {
  std::array<int16_t, 0x200> byte_of{};  // byte for each byte-level character, -1 if none
  ByteLevelDecoder() {
    byte_of.fill(-1);
    for (int b = 0; b < 256; ++b) {
      size_t i = 0;
      byte_of[unicode::next_cp(byte_char(static_cast<unsigned char>(b)), i)] = static_cast<int16_t>(b);
    }
  }
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string bytes;
    for (const std::string& t : tokens) {
      size_t mark = bytes.size();
      bool ok = true;
      for (size_t i = 0; i < t.size() && ok;) {
        char32_t c = unicode::next_cp(t, i);
        ok = c < byte_of.size() && byte_of[c] >= 0;
        if (ok) bytes.push_back(static_cast<char>(byte_of[c]));
      }
      if (!ok) bytes.replace(mark, std::string::npos, t);  // not byte-level: its own bytes
    }
    tokens.assign(1, unicode::utf8_lossy(bytes));
  }
};

struct MetaspaceDecoder : Decoder {
  std::string replacement;
  PrependScheme scheme = PrependScheme::Always;
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (size_t i = 0; i < tokens.size(); ++i) {
      // HF drops every replacement character of the first token unless the scheme is never.
      bool drop = i == 0 && scheme != PrependScheme::Never;
      std::string out;
      std::string_view t = tokens[i];
      for (size_t at = 0;;) {
        size_t hit = t.find(replacement, at);
        out.append(t.substr(at, hit == std::string_view::npos ? hit : hit - at));
        if (hit == std::string_view::npos) break;
        if (!drop) out += ' ';
        at = hit + replacement.size();
      }
      tokens[i] = std::move(out);
    }
  }
};

// Rust's u8::from_str_radix(s, 16) for the two characters of "<0xXX>" (accepts "+X").
std::optional<unsigned char> parse_hex_byte(std::string_view s) {
  auto digit = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (s[0] == '+') {
    int d = digit(s[1]);
    return d < 0 ? std::nullopt : std::optional<unsigned char>(static_cast<unsigned char>(d));
  }
  int hi = digit(s[0]), lo = digit(s[1]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<unsigned char>(hi * 16 + lo);
}

struct ByteFallbackDecoder : Decoder {
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::vector<std::string> out;
    std::string pending;
    auto flush = [&] {
      if (pending.empty()) return;
      if (unicode::is_valid_utf8(pending))
        out.push_back(pending);
      else
        for (size_t i = 0; i < pending.size(); ++i) out.emplace_back("\xEF\xBF\xBD");
      pending.clear();
    };
    for (std::string& t : tokens) {
      std::optional<unsigned char> byte;
      if (t.size() == 6 && t.starts_with("<0x") && t.ends_with('>')) byte = parse_hex_byte(t.substr(3, 2));
      if (byte) {
        pending.push_back(static_cast<char>(*byte));
        continue;
      }
      flush();
      out.push_back(std::move(t));
    }
    flush();
    tokens.swap(out);
  }
};

struct FuseDecoder : Decoder {
  void decode_chain(std::vector<std::string>& tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    tokens.assign(1, std::move(all));
  }
};

struct StripDecoder : Decoder {
  char32_t content = ' ';
  size_t start = 0, stop = 0;
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) {
      std::u32string chars;
      for (size_t i = 0; i < t.size();) chars.push_back(unicode::next_cp(t, i));
      size_t begin = 0, end = chars.size();
      while (begin < std::min(start, chars.size()) && chars[begin] == content) ++begin;
      for (size_t k = 0; k < stop && end > begin && chars[end - 1] == content; ++k) --end;
      std::string out;
      for (size_t i = begin; i < end; ++i) unicode::append_utf8(out, chars[i]);
      t = std::move(out);
    }
  }
};

struct ReplaceDecoder : Decoder {
  Pattern pattern;
  std::string content;
  void decode_chain(std::vector<std::string>& tokens) const override {
    for (std::string& t : tokens) t = replace_all(t, pattern, content);
  }
};

}  // namespace

int64_t json_int(const json& j, std::string_view what, int64_t lo, int64_t hi) {
  const bool in_range = j.is_number_integer() && !(j.is_number_unsigned() && j.get<uint64_t>() > uint64_t{INT64_MAX}) &&
                        j.get<int64_t>() >= lo && j.get<int64_t>() <= hi;
  if (!in_range) {
    std::string got = j.dump();
    if (got.size() > 40) got = got.substr(0, 37) + "...";
    throw Error(fmt::format("tokenizer.json: {} must be an integer in [{}, {}], got {}", what, lo, hi, got));
  }
  return j.get<int64_t>();
}

const std::string& byte_char(unsigned char b) {
  static const auto table = [] {
    std::array<std::string, 256> t;
    int n = 0;
    for (int c = 0; c < 256; ++c) {
      bool printable = (c >= '!' && c <= '~') || (c >= 0xA1 && c <= 0xAC) || (c >= 0xAE && c <= 0xFF);
      unicode::append_utf8(t[c], printable ? static_cast<char32_t>(c) : static_cast<char32_t>(256 + n++));
    }
    return t;
  }();
  return table[b];
}

std::unique_ptr<Normalizer> make_normalizer(const json& j, int depth) {
  if (j.is_null()) return nullptr;
  std::string type = type_of(j, "normalizer");
  if (type == "Sequence") {
    auto s = std::make_unique<NormalizerSequence>();
    const int inner = nested(depth, "normalizer");
    for (const json& n : j.at("normalizers")) s->steps.push_back(make_normalizer(n, inner));
    std::erase(s->steps, nullptr);
    return s;
  }
  if (type == "Prepend") {
    auto p = std::make_unique<Prepend>();
    p->prefix = j.at("prepend").get<std::string>();
    return p;
  }
  if (type == "Replace") {
    auto r = std::make_unique<Replace>();
    r->pattern = make_pattern(j.at("pattern"));
    r->content = j.at("content").get<std::string>();
    return r;
  }
  if (type == "NFC") return std::make_unique<Nfc>();
  if (type == "NFD") return std::make_unique<Nfd>();
  if (type == "Strip") {
    auto s = std::make_unique<Strip>();
    s->left = value_or(j, "strip_left", true);
    s->right = value_or(j, "strip_right", true);
    return s;
  }
  unsupported("normalizer", type, "Sequence, Prepend, Replace, NFC, NFD, Strip");
}

std::unique_ptr<PreTokenizer> make_pre_tokenizer(const json& j, int depth) {
  if (j.is_null()) return nullptr;
  std::string type = type_of(j, "pre_tokenizer");
  if (type == "Sequence") {
    auto s = std::make_unique<PreTokenizerSequence>();
    const int inner = nested(depth, "pre_tokenizer");
    for (const json& p : j.at("pretokenizers")) s->steps.push_back(make_pre_tokenizer(p, inner));
    std::erase(s->steps, nullptr);
    return s;
  }
  if (type == "ByteLevel") {
    auto b = std::make_unique<ByteLevelPre>();
    b->add_prefix_space = value_or(j, "add_prefix_space", true);
    if (value_or(j, "use_regex", true)) b->regex = Pattern::regex(kGpt2Pattern);
    return b;
  }
  if (type == "Split") {
    auto s = std::make_unique<Split>();
    s->pattern = make_pattern(j.at("pattern"));
    s->behavior = parse_behavior(j.at("behavior"));
    s->invert = value_or(j, "invert", false);
    return s;
  }
  if (type == "Metaspace") {
    auto m = std::make_unique<MetaspacePre>();
    m->replacement = one_char(j.at("replacement"), "Metaspace replacement");
    m->scheme = parse_prepend_scheme(j);
    m->split = value_or(j, "split", true);
    m->delimiter = Pattern::literal(m->replacement);
    return m;
  }
  if (type == "Digits") {
    auto d = std::make_unique<Digits>();
    d->individual = value_or(j, "individual_digits", false);
    return d;
  }
  unsupported("pre_tokenizer", type, "Sequence, ByteLevel, Split, Metaspace, Digits");
}

std::unique_ptr<PostProcessor> make_post_processor(const json& j, int depth) {
  if (j.is_null()) return nullptr;
  std::string type = type_of(j, "post_processor");
  if (type == "TemplateProcessing") return make_template(j);
  if (type == "ByteLevel") return std::make_unique<NoOpProcessor>();  // only moves offsets
  if (type == "BertProcessing" || type == "RobertaProcessing") return make_cls_sep(j);
  if (type == "Sequence") {
    auto s = std::make_unique<ProcessorSequence>();
    const int inner = nested(depth, "post_processor");
    for (const json& p : j.at("processors")) s->steps.push_back(make_post_processor(p, inner));
    std::erase(s->steps, nullptr);
    return s;
  }
  unsupported("post_processor", type, "TemplateProcessing, ByteLevel, BertProcessing, RobertaProcessing, Sequence");
}

std::unique_ptr<Decoder> make_decoder(const json& j, int depth) {
  if (j.is_null()) return nullptr;
  std::string type = type_of(j, "decoder");
  if (type == "Sequence") {
    auto s = std::make_unique<DecoderSequence>();
    const int inner = nested(depth, "decoder");
    for (const json& d : j.at("decoders")) s->steps.push_back(make_decoder(d, inner));
    std::erase(s->steps, nullptr);
    return s;
  }
  if (type == "ByteLevel") return std::make_unique<ByteLevelDecoder>();
  if (type == "Metaspace") {
    auto m = std::make_unique<MetaspaceDecoder>();
    m->replacement = one_char(j.at("replacement"), "Metaspace replacement");
    m->scheme = parse_prepend_scheme(j);
    return m;
  }
  if (type == "ByteFallback") return std::make_unique<ByteFallbackDecoder>();
  if (type == "Fuse") return std::make_unique<FuseDecoder>();
  if (type == "Strip") {
    auto s = std::make_unique<StripDecoder>();
    std::string c = one_char(j.at("content"), "Strip content");
    size_t i = 0;
    s->content = unicode::next_cp(c, i);
    s->start = static_cast<size_t>(json_int(j.at("start"), "Strip decoder start", 0, INT64_MAX));
    s->stop = static_cast<size_t>(json_int(j.at("stop"), "Strip decoder stop", 0, INT64_MAX));
    return s;
  }
  if (type == "Replace") {
    auto r = std::make_unique<ReplaceDecoder>();
    r->pattern = make_pattern(j.at("pattern"));
    r->content = j.at("content").get<std::string>();
    return r;
  }
  unsupported("decoder", type, "Sequence, ByteLevel, Metaspace, ByteFallback, Fuse, Strip, Replace");
}

}  // namespace lorarun::tok
