#include "tokenizer/tokenizer.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <thread>
#include <unordered_map>

#include "tokenizer/added_tokens.hpp"
#include "tokenizer/bpe.hpp"
#include "tokenizer/components.hpp"
#include "tokenizer/unicode.hpp"
#include "util/error.hpp"
#include "util/input_file.hpp"

namespace lorarun::tok {

using nlohmann::json;

// tokenizer.json "truncation" and "padding", as HF applies them around post-processing.
struct Truncation {
  size_t max_length = 0;
  bool left = false;
};
struct Padding {
  std::optional<size_t> fixed;  // nullopt: BatchLongest, which is a no-op for one sequence
  std::optional<size_t> multiple;
  int32_t pad_id = 0;
  bool left = false;
};

// The special tokens a config names, by content.
struct SpecialNames {
  std::optional<std::string> bos, eos, pad;
};

struct Tokenizer::Impl {
  std::optional<Truncation> truncation;
  std::optional<Padding> padding;
  std::unique_ptr<Normalizer> normalizer;
  std::unique_ptr<PreTokenizer> pre_tokenizer;
  std::unique_ptr<Bpe> model;
  std::unique_ptr<PostProcessor> post_processor;
  std::unique_ptr<Decoder> decoder;
  std::unique_ptr<AddedVocabulary> added;
  std::optional<int32_t> bos, eos, pad;
  bool add_bos = false, add_eos = false;
  bool byte_level = false;  // tokens are GPT-2 byte characters (a ByteLevel pre-tokenizer or decoder)
  std::string chat_template;
};

namespace {

// Far above any real vocabulary (~256k); an id table this size is 128 MB.
constexpr int64_t kMaxTokenId = (int64_t{1} << 24) - 1;
// Padding allocates its length in every encode (and decode of the ids): cap a corrupt value.
constexpr int64_t kMaxPadLength = int64_t{1} << 22;

std::string read_file(const std::filesystem::path& path) { return read_input(path.string()); }

json parse_json(const std::filesystem::path& path) {
  std::string text = read_file(path);
  try {
    return json::parse(text);
  } catch (const json::parse_error& e) {
    throw Error(
        fmt::format("{}: not valid JSON at byte {} (truncated or corrupt download?); "
                    "fetch the file again",
                    path.string(), e.byte));
  } catch (const json::exception& e) {  // out_of_range: a number beyond double, like 1e500
    throw Error(fmt::format("{}: not valid JSON ({}); fetch the file again", path.string(), e.what()));
  }
}

// "a b" (the first space separates) or ["a", "b"].
std::pair<std::string, std::string> parse_merge(const json& m) {
  if (m.is_array() && m.size() == 2) return {m[0].get<std::string>(), m[1].get<std::string>()};
  if (!m.is_string()) throw Error("tokenizer.json: model.merges entries must be \"a b\" or [\"a\", \"b\"]");
  const auto& s = m.get_ref<const std::string&>();
  size_t sp = s.find(' ');
  if (sp == std::string::npos)
    throw Error(fmt::format("tokenizer.json: merge '{}' has no space between its two tokens", s));
  return {s.substr(0, sp), s.substr(sp + 1)};
}

std::optional<std::string> string_or_null(const json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return std::nullopt;
  if (it->is_string()) return it->get<std::string>();
  return it->at("content").get<std::string>();
}

std::unique_ptr<Bpe> make_model(const json& m) {
  if (!m.is_object()) throw Error("tokenizer.json: 'model' must be an object");
  std::string type = m.value("type", m.contains("merges") ? "BPE" : "");
  if (type != "BPE")
    throw Error(fmt::format("tokenizer.json: model type '{}' is not supported (supported: BPE)",
                            type.empty() ? "(none)" : type));
  if (m.contains("dropout") && !m["dropout"].is_null() && m["dropout"].get<double>() > 0)
    throw Error("tokenizer.json: BPE dropout is not supported (it makes ids random); set it to null");
  Vocab vocab;
  const json& v = m.at("vocab");
  if (!v.is_object()) throw Error("tokenizer.json: model.vocab must be an object of token -> id");
  if (m.contains("merges") && !m["merges"].is_array()) throw Error("tokenizer.json: model.merges must be an array");
  vocab.reserve(v.size());
  for (const auto& [tok, id] : v.items()) {
    // Ids index a table (id -> token): a stray 2^30 would allocate gigabytes.
    if (!id.is_number_unsigned() || id.get<uint64_t>() > uint64_t{kMaxTokenId})
      json_int(id, fmt::format("model.vocab id of '{}'", tok), 0, kMaxTokenId);  // throws, naming it
    vocab.emplace(tok, static_cast<int32_t>(id.get<uint64_t>()));
  }
  std::vector<std::pair<std::string, std::string>> merges;
  if (m.contains("merges")) {
    merges.reserve(m["merges"].size());
    for (const json& e : m["merges"]) merges.push_back(parse_merge(e));
  }
  BpeOptions o;
  o.unk_token = string_or_null(m, "unk_token");
  o.continuing_subword_prefix = string_or_null(m, "continuing_subword_prefix").value_or("");
  o.end_of_word_suffix = string_or_null(m, "end_of_word_suffix").value_or("");
  o.fuse_unk = m.value("fuse_unk", false);
  o.byte_fallback = m.value("byte_fallback", false);
  o.ignore_merges = m.value("ignore_merges", false);
  return std::make_unique<Bpe>(std::move(vocab), merges, std::move(o));
}

// HF re-derives added-token ids on load instead of trusting the "id" fields: in file order,
// a content already in the model vocabulary takes that id, a new one the next free id; a
// repeated content keeps its first id and takes the later flags.
std::vector<AddedToken> parse_added_tokens(const json& j, const Bpe& model) {
  std::vector<AddedToken> out;
  if (j.is_null()) return out;
  Vocab index;
  std::optional<int64_t> max_id;
  const auto vocab_len = static_cast<int64_t>(model.vocab().size());
  for (const json& t : j) {
    AddedToken a;
    a.content = t.at("content").get<std::string>();
    a.special = t.value("special", false);
    a.single_word = t.value("single_word", false);
    a.lstrip = t.value("lstrip", false);
    a.rstrip = t.value("rstrip", false);
    a.normalized = t.value("normalized", !a.special);
    if (a.content.empty()) continue;
    if (auto it = index.find(a.content); it != index.end()) {
      a.id = out[static_cast<size_t>(it->second)].id;
      out[static_cast<size_t>(it->second)] = std::move(a);
      continue;
    }
    if (auto id = model.token_to_id(a.content))
      a.id = *id;
    else
      a.id = static_cast<int32_t>(max_id && (*max_id >= vocab_len || vocab_len == 0) ? *max_id + 1 : vocab_len);
    max_id = std::max(max_id.value_or(a.id), static_cast<int64_t>(a.id));
    index.emplace(a.content, static_cast<int32_t>(out.size()));
    out.push_back(std::move(a));
  }
  return out;
}

std::optional<Truncation> parse_truncation(const json& j) {
  if (j.is_null()) return std::nullopt;
  auto strategy = j.value("strategy", std::string("LongestFirst"));
  if (strategy != "LongestFirst" && strategy != "OnlyFirst")
    throw Error(
        fmt::format("tokenizer.json: truncation strategy '{}' is not supported for one "
                    "sequence (supported: LongestFirst, OnlyFirst)",
                    strategy));
  return Truncation{static_cast<size_t>(json_int(j.at("max_length"), "truncation.max_length", 0, INT64_MAX)),
                    j.value("direction", std::string("Right")) == "Left"};
}

std::optional<Padding> parse_padding(const json& j) {
  if (j.is_null()) return std::nullopt;
  Padding p;
  const json& strategy = j.at("strategy");
  if (strategy.is_object() && strategy.contains("Fixed"))
    p.fixed = static_cast<size_t>(json_int(strategy["Fixed"], "padding Fixed length", 0, kMaxPadLength));
  if (j.contains("pad_to_multiple_of") && !j["pad_to_multiple_of"].is_null())
    p.multiple = static_cast<size_t>(json_int(j["pad_to_multiple_of"], "padding.pad_to_multiple_of", 0, kMaxPadLength));
  if (j.contains("pad_id")) p.pad_id = static_cast<int32_t>(json_int(j["pad_id"], "padding.pad_id", 0, INT32_MAX));
  p.left = j.value("direction", std::string("Right")) == "Left";
  return p;
}

// True when `j` (a component, or a Sequence of them at any depth) has a part of type `type`.
bool has_type(const json& j, std::string_view type) {
  if (j.is_object()) {
    if (auto it = j.find("type"); it != j.end() && it->is_string() && *it == type) return true;
    for (const auto& [key, value] : j.items())
      if (value.is_array() || value.is_object())
        if (has_type(value, type)) return true;
  } else if (j.is_array()) {
    for (const json& v : j)
      if (has_type(v, type)) return true;
  }
  return false;
}

void load_tokenizer_json(Tokenizer::Impl& t, const json& j) {
  if (!j.is_object()) throw Error("tokenizer.json: the top level must be a JSON object");
  auto get = [&](const char* key) -> const json& {
    static const json null;
    auto it = j.find(key);
    return it == j.end() ? null : *it;
  };
  t.model = make_model(j.at("model"));
  t.normalizer = make_normalizer(get("normalizer"));
  t.pre_tokenizer = make_pre_tokenizer(get("pre_tokenizer"));
  t.post_processor = make_post_processor(get("post_processor"));
  t.decoder = make_decoder(get("decoder"));
  t.truncation = parse_truncation(get("truncation"));
  t.padding = parse_padding(get("padding"));
  t.added = std::make_unique<AddedVocabulary>(parse_added_tokens(get("added_tokens"), *t.model), t.normalizer.get());
  t.byte_level = has_type(get("pre_tokenizer"), "ByteLevel") || has_type(get("decoder"), "ByteLevel");
}

// tokenizer_config.json's chat_template: a string, or a list of {name, template} ("default").
std::string config_chat_template(const json& c, const std::string& what) {
  auto it = c.find("chat_template");
  if (it == c.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array())
    for (const json& t : *it)
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string())
        return t["template"].get<std::string>();
  throw Error(fmt::format("{}: chat_template is neither a string nor a list holding a \"default\" template", what));
}

// bos/eos/pad and the add_*_token flags of one config file (`c`, read from `what`); later files win.
void apply_config(Tokenizer::Impl& t, const json& c, const std::string& what, SpecialNames& names) {
  try {
    if (!c.is_object()) throw Error(fmt::format("{}: the top level must be a JSON object", what));
    if (auto s = string_or_null(c, "bos_token")) names.bos = s;
    if (auto s = string_or_null(c, "eos_token")) names.eos = s;
    if (auto s = string_or_null(c, "pad_token")) names.pad = s;
    if (c.contains("add_bos_token") && !c["add_bos_token"].is_null()) t.add_bos = c["add_bos_token"].get<bool>();
    if (c.contains("add_eos_token") && !c["add_eos_token"].is_null()) t.add_eos = c["add_eos_token"].get<bool>();
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed ({})", what, e.what()));
  }
}

void resolve_specials(const Tokenizer& tok, Tokenizer::Impl& t, const SpecialNames& names) {
  auto id = [&](const std::optional<std::string>& s) { return s ? tok.token_to_id(*s) : std::nullopt; };
  t.bos = id(names.bos);
  t.eos = id(names.eos);
  t.pad = id(names.pad);
}

std::unique_ptr<Tokenizer::Impl> impl_from_json(const json& j, const std::string& what) {
  auto impl = std::make_unique<Tokenizer::Impl>();
  try {
    load_tokenizer_json(*impl, j);
  } catch (const json::exception& e) {
    throw Error(fmt::format("{}: malformed ({})", what, e.what()));
  }
  return impl;
}

// HF's post_process: truncate (leaving room for the special tokens), add them, then pad.
void finish(const Tokenizer::Impl& t, std::vector<int32_t>& ids, bool add_special_tokens) {
  if (t.truncation) {
    size_t room = t.truncation->max_length;
    size_t added = add_special_tokens && t.post_processor ? t.post_processor->added_tokens() : 0;
    room = room > added ? room - added : 0;
    if (ids.size() > room) {
      if (t.truncation->left)
        ids.erase(ids.begin(), ids.end() - static_cast<std::ptrdiff_t>(room));
      else
        ids.resize(room);
    }
  }
  if (t.post_processor) t.post_processor->process(ids, add_special_tokens);
  if (t.padding) {
    size_t length = t.padding->fixed.value_or(ids.size());
    if (size_t m = t.padding->multiple.value_or(0); m > 0 && length % m) length += m - length % m;
    if (ids.size() < length)
      ids.insert(t.padding->left ? ids.begin() : ids.end(), length - ids.size(), t.padding->pad_id);
  }
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::from_file(const std::string& path) {
  if (!std::filesystem::is_regular_file(path))
    throw Error(fmt::format("{}: not found; a Hugging Face tokenizer.json is needed", path));
  return Tokenizer(impl_from_json(parse_json(path), path));
}

Tokenizer Tokenizer::from_dir(const std::string& dir) {
  if (!std::filesystem::is_directory(dir))
    throw Error(
        fmt::format("model directory '{}' does not exist; pass a Hugging Face model "
                    "directory that contains tokenizer.json",
                    dir));
  auto path = std::filesystem::path(dir) / "tokenizer.json";
  if (!std::filesystem::exists(path))
    throw Error(
        fmt::format("{}: not found; only tokenizer.json (fast tokenizer) files are read, "
                    "save one with transformers' save_pretrained",
                    path.string()));
  Tokenizer tok = from_file(path.string());
  // tokenizer_config.json wins over special_tokens_map.json.
  SpecialNames names;
  for (const char* name : {"special_tokens_map.json", "tokenizer_config.json"}) {
    auto config = std::filesystem::path(dir) / name;
    if (std::filesystem::exists(config)) apply_config(*tok.impl_, parse_json(config), config.string(), names);
  }
  resolve_specials(tok, *tok.impl_, names);
  // transformers reads chat_template.jinja over the config's chat_template.
  const auto config = std::filesystem::path(dir) / "tokenizer_config.json";
  if (const auto jinja = std::filesystem::path(dir) / "chat_template.jinja"; std::filesystem::exists(jinja))
    tok.impl_->chat_template = read_file(jinja);
  else if (std::filesystem::exists(config))
    tok.impl_->chat_template = config_chat_template(parse_json(config), config.string());
  return tok;
}

Tokenizer Tokenizer::from_files(const HfTokenizerFiles& files, const std::string& source) {
  auto parse = [&](const std::string& text) {
    try {
      return json::parse(text);
    } catch (const json::exception& e) {
      throw Error(fmt::format("{}: the tokenizer made from it is not valid JSON ({})", source, e.what()));
    }
  };
  Tokenizer tok(impl_from_json(parse(files.tokenizer_json), source));
  SpecialNames names;
  const json config = parse(files.tokenizer_config_json);
  apply_config(*tok.impl_, config, source, names);
  resolve_specials(tok, *tok.impl_, names);
  if (config.is_object()) tok.impl_->chat_template = config_chat_template(config, source);
  return tok;
}

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  if (!unicode::is_valid_utf8(text)) throw Error("tokenizer: the text is not valid UTF-8");
  const Impl& t = *impl_;
  // 1. Added tokens matched in the raw text; 2. the rest normalized, then normalized tokens.
  std::vector<Piece> pieces, normalized;
  t.added->split(text, true, false, pieces);
  for (Piece& p : pieces) {
    if (p.id >= 0) {
      normalized.push_back(std::move(p));
      continue;
    }
    if (t.normalizer) t.normalizer->normalize(p.text);
    if (t.added->has_normalized())
      t.added->split(p.text, p.at_start, true, normalized);
    else
      normalized.push_back(std::move(p));
  }
  std::erase_if(normalized, [](const Piece& p) { return p.id < 0 && p.text.empty(); });
  // 3. Pre-tokenization into words, 4. the model on each word, 5. special tokens.
  if (t.pre_tokenizer) t.pre_tokenizer->pre_tokenize(normalized);
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  for (const Piece& p : normalized) {
    if (p.id >= 0)
      ids.push_back(p.id);
    else
      t.model->tokenize(p.text, ids);
  }
  finish(t, ids, add_special_tokens);
  return ids;
}

Tokenizer::Encoding Tokenizer::encode_with_offsets(std::string_view text) const {
  const Impl& t = *impl_;
  Encoding e;
  e.ids = encode(text, false);
  // The bytes each token stands for: an added token's content; a byte-level token's bytes; a
  // SentencePiece piece with "▁" as a space and <0xXX> as that byte.
  static const auto byte_of = [] {
    std::unordered_map<std::string, char> m;
    for (int b = 0; b < 256; ++b) m[byte_char(static_cast<unsigned char>(b))] = static_cast<char>(b);
    return m;
  }();
  // SentencePiece spelling: "▁" is a space (the normalizer made it of one).
  const auto spaces = [](const std::string& s) {
    std::string out;
    for (size_t i = 0; i < s.size();) {
      if (s.compare(i, 3, "\xE2\x96\x81") == 0) {
        out += ' ';
        i += 3;
      } else {
        out += s[i++];
      }
    }
    return out;
  };
  const auto bytes_of = [&](int32_t id) {
    // An added token may also be a model piece the model produced (Gemma's "▁▁"): spelled as one.
    if (const AddedToken* a = t.added->by_id(id)) return t.byte_level ? a->content : spaces(a->content);
    const std::string* s = t.model->id_to_token(id);
    if (!s) return std::string();
    std::string out;
    if (t.byte_level) {
      for (size_t i = 0; i < s->size();) {
        const size_t n = std::max<size_t>(1, unicode::utf8_len(static_cast<unsigned char>((*s)[i])));
        const std::string ch = s->substr(i, n);
        auto it = byte_of.find(ch);
        out += it == byte_of.end() ? ch : std::string(1, it->second);
        i += n;
      }
      return out;
    }
    if (s->size() == 6 && s->starts_with("<0x") && s->back() == '>')
      return std::string(1, static_cast<char>(std::stoi(s->substr(3, 2), nullptr, 16)));
    return spaces(*s);
  };
  // Align the tokens' bytes with the text: a space the tokenizer added (a prepended "▁") or
  // whitespace it dropped (an added token's lstrip/rstrip) stands for nothing.
  size_t at = 0;
  for (int32_t id : e.ids) {
    const std::string b = bytes_of(id);
    std::optional<size_t> first;
    size_t end = at;
    for (char c : b) {
      if (c != ' ' || at >= text.size() || text[at] != c)
        while (c != ' ' && at < text.size() && text[at] != c && std::isspace(static_cast<unsigned char>(text[at])))
          ++at;
      if (at < text.size() && text[at] == c) {
        if (!first) first = at;
        end = ++at;
      } else if (c != ' ') {
        throw Error(
            fmt::format("tokenizer: the tokens do not spell the text at byte {} (a normalizer rewrote it?)", at));
      }
    }
    e.offsets.emplace_back(first.value_or(end), end);
  }
  return e;
}

std::vector<std::vector<int32_t>> Tokenizer::encode_batch(std::span<const std::string> texts, bool add_special_tokens,
                                                          unsigned threads) const {
  std::vector<std::vector<int32_t>> out(texts.size());
  if (threads == 0) threads = std::max(1u, std::thread::hardware_concurrency());
  threads = static_cast<unsigned>(std::min<size_t>(threads, texts.size()));
  std::atomic<size_t> next{0};
  std::exception_ptr error;
  std::atomic<bool> failed{false};
  auto work = [&] {
    try {
      for (size_t i; (i = next.fetch_add(1)) < texts.size() && !failed;) out[i] = encode(texts[i], add_special_tokens);
    } catch (...) {
      if (!failed.exchange(true)) error = std::current_exception();
    }
  };
  {
    std::vector<std::jthread> pool;
    for (unsigned k = 1; k < threads; ++k) pool.emplace_back(work);
    work();
  }
  if (error) std::rethrow_exception(error);
  return out;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  const Impl& t = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    const AddedToken* a = t.added->by_id(id);
    const std::string* s = a ? &a->content : t.model->id_to_token(id);
    if (!s || (skip_special_tokens && t.added->is_special(*s))) continue;
    tokens.push_back(*s);
  }
  std::string out;
  if (t.decoder) {
    t.decoder->decode_chain(tokens);
    for (const auto& s : tokens) out += s;
  } else {
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
  }
  return out;
}

std::optional<int32_t> Tokenizer::token_to_id(std::string_view token) const {
  if (const AddedToken* a = impl_->added->by_content(token)) return a->id;
  return impl_->model->token_to_id(token);
}

bool Tokenizer::is_added(int32_t id) const { return impl_->added->by_id(id) != nullptr; }

const std::string& Tokenizer::chat_template() const { return impl_->chat_template; }

std::optional<std::string> Tokenizer::id_to_token(int32_t id) const {
  if (const AddedToken* a = impl_->added->by_id(id)) return a->content;
  if (const std::string* s = impl_->model->id_to_token(id)) return *s;
  return std::nullopt;
}

size_t Tokenizer::vocab_size() const {
  size_t n = impl_->model->vocab().size();
  for (const AddedToken& a : impl_->added->tokens())
    if (!impl_->model->token_to_id(a.content)) ++n;
  return n;
}

int64_t Tokenizer::id_bound() const {
  int64_t top = -1;
  for (const auto& [token, id] : impl_->model->vocab()) top = std::max<int64_t>(top, id);
  for (const AddedToken& a : impl_->added->tokens()) top = std::max<int64_t>(top, a.id);
  return top + 1;
}

std::optional<int32_t> Tokenizer::bos_id() const { return impl_->bos; }
std::optional<int32_t> Tokenizer::eos_id() const { return impl_->eos; }
std::optional<int32_t> Tokenizer::pad_id() const { return impl_->pad; }
bool Tokenizer::add_bos_token() const { return impl_->add_bos; }
bool Tokenizer::add_eos_token() const { return impl_->add_eos; }

}  // namespace lorarun::tok
