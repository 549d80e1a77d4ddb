#include "data/example.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <optional>

#include "chat/chat_template.hpp"
#include "data/source.hpp"
#include "util/error.hpp"
#include "util/input_file.hpp"

namespace lorarun::data {
namespace {

Rejection bad(std::string reason, Rejection::Cause cause = Rejection::kMalformed) {
  return {Rejection::BadDocument, std::move(reason), {}, cause};
}
Rejection untrainable(std::string reason) { return bad(std::move(reason), Rejection::kUntrainable); }
Rejection unreadable(std::string reason) { return bad(std::move(reason), Rejection::kUnreadable); }
Rejection template_failed(std::string reason) { return bad(std::move(reason), Rejection::kTemplate); }
// `r` (of a part of the document) with `prefix` before its reason, its cause kept.
Rejection within(const std::string& prefix, const Rejection& r) { return bad(prefix + r.reason, r.cause_of_bad); }

// One document's renderings: its messages (or a prefix of them) with the template and context. A
// render given up for a stop request throws DataUnavailable (the step that needed it is not taken:
// a resumed run reads its documents again).
struct Renderer {
  const chat::Template& tmpl;
  nlohmann::ordered_json context;
  const std::atomic<bool>* stop = nullptr;
  std::variant<chat::Rendered, std::string> operator()(const nlohmann::ordered_json& messages, bool prompt) {
    context["messages"] = messages;
    context["add_generation_prompt"] = prompt;
    auto r = tmpl.render(context, stop);
    if (const auto* e = std::get_if<std::string>(&r); e && *e == chat::kRenderStopped)
      throw DataUnavailable("stopped while the chat template rendered a document (a stop was requested)");
    return r;
  }
};

// The string value of `field`, or why there is none.
std::variant<std::string, Rejection> string_field(const Document& doc, const std::string& field) {
  if (!doc.is_object() || !doc.contains(field)) return bad(fmt::format("field '{}' is missing", field));
  if (!doc[field].is_string()) return bad(fmt::format("field '{}' is not a string", field));
  std::string s = doc[field].get<std::string>();
  if (!valid_utf8(s)) return unreadable(invalid_utf8_reason(field));
  return s;
}

// Whether `field` marks the document's completion desirable: true/false or 1/0 (integers, or 1.0
// and 0.0), or why it does not.
std::variant<bool, Rejection> label_field(const Document& doc, const std::string& field) {
  if (!doc.contains(field)) return bad(fmt::format("field '{}' is missing", field));
  const Document& v = doc[field];
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_number() && (v.get<double>() == 0 || v.get<double>() == 1)) return v.get<double>() == 1;
  return bad(
      fmt::format("field '{}' is {}, neither true/false nor 1/0", field,
                  v.is_number() ? fmt::format("the number {}", v.get<double>()) : std::string("a ") + v.type_name()));
}

// How each chat format frames a turn: text before the content, text after it (after is
// trained together with an assistant's content, as the model must learn to end its turn).
struct Turn {
  std::string before, after;
};

Turn chat_turn(recipe::ChatFormat f, const std::string& role) {
  switch (f) {
    case recipe::ChatFormat::ChatML:
      return {"<|im_start|>" + role + "\n", "<|im_end|>\n"};
    case recipe::ChatFormat::Llama3:
      return {"<|start_header_id|>" + role + "<|end_header_id|>\n\n", "<|eot_id|>"};
    case recipe::ChatFormat::Mistral:
      return role == "assistant" ? Turn{"", "</s>"} : Turn{"[INST] ", " [/INST]"};
    case recipe::ChatFormat::Template:  // rendered by chat_template()
      break;
  }
  return {};
}

// The length of the UTF-8 sequence that lead byte `c` starts; 0 when `c` cannot lead one.
int lead_length(unsigned char c) {
  if (c < 0x80) return 1;
  if ((c >> 5) == 0x6) return 2;
  if ((c >> 4) == 0xE) return 3;
  if ((c >> 3) == 0x1E) return 4;
  return 0;
}

}  // namespace

bool valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const int n = lead_length(c);
    if (n == 0 || i + static_cast<size_t>(n) > s.size()) return false;
    uint32_t cp = n == 1 ? c : c & (0x7F >> n);
    for (int k = 1; k < n; ++k) {
      const auto cc = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((cc >> 6) != 0x2) return false;
      cp = (cp << 6) | (cc & 0x3F);
    }
    const uint32_t min[] = {0, 0, 0x80, 0x800, 0x10000};
    if (cp < min[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return false;  // overlong, surrogate
    i += static_cast<size_t>(n);
  }
  return true;
}

std::string_view cause_name(Rejection::Cause c) {
  static constexpr std::string_view kNames[] = {"malformed", "untrainable", "unreadable",
                                                "deleted",   "template",    "overlong"};
  return c >= 0 && c < Rejection::kCauses ? kNames[c] : "?";
}

std::string invalid_utf8_reason(std::string_view field) { return fmt::format("field '{}' is not valid UTF-8", field); }

ExampleBuilder::ExampleBuilder(const recipe::DataSection& cfg, const tok::Tokenizer& tokenizer,
                               std::optional<int32_t> eos, PairTokens tokens, const std::atomic<bool>* stop)
    : cfg_(cfg), tok_(tokenizer), eos_(eos ? eos : tokenizer.eos_id()), pairs_(tokens), stop_(stop) {
  const bool pairs = cfg.format == recipe::Format::Preference || cfg.format == recipe::Format::Unpaired ||
                     cfg.format == recipe::Format::Prompt;
  if (cfg.format == recipe::Format::Instruction || (pairs && !cfg.prompt_template.empty()))
    template_ = recipe::parse_template(cfg.prompt_template);
  if ((cfg.format == recipe::Format::Chat || pairs) && cfg.chat_format == recipe::ChatFormat::Template)
    setup_chat_template();
}

void ExampleBuilder::append(Example& e, const std::string& text, bool trained, bool add_special) const {
  const std::vector<int32_t> ids = tok_.encode(text, add_special);
  e.ids.insert(e.ids.end(), ids.begin(), ids.end());
  e.labels.insert(e.labels.end(), ids.begin(), ids.end());
  if (!trained) std::fill(e.labels.end() - static_cast<std::ptrdiff_t>(ids.size()), e.labels.end(), kIgnoreIndex);
}

std::variant<Example, Rejection> ExampleBuilder::finish(Example e, bool add_eos) const {
  if (add_eos && eos_) {
    e.ids.push_back(*eos_);
    e.labels.push_back(*eos_);
  }
  if (static_cast<int64_t>(e.ids.size()) > cfg_.max_length) {
    if (cfg_.overlong == recipe::Overlong::Skip)
      return Rejection{Rejection::Overlong,
                       fmt::format("{} tokens, data.max_length is {}", e.ids.size(), cfg_.max_length)};
    e.ids.resize(static_cast<size_t>(cfg_.max_length));
    e.labels.resize(static_cast<size_t>(cfg_.max_length));
    e.truncated = true;
  }
  if (std::all_of(e.labels.begin(), e.labels.end(), [](int32_t l) { return l == kIgnoreIndex; }))
    return untrainable("no token left to train on after truncation");
  return e;
}

std::variant<Example, Rejection> ExampleBuilder::build(const Document& doc) const {
  switch (cfg_.format) {
    case recipe::Format::Instruction:
      return instruction(doc);
    case recipe::Format::Text:
      return text(doc);
    case recipe::Format::Chat:
      return cfg_.chat_format == recipe::ChatFormat::Template ? chat_template(doc) : chat(doc);
    case recipe::Format::Preference:
      return preference(doc);
    case recipe::Format::Unpaired:
      return unpaired(doc);
    case recipe::Format::Prompt:
      return prompt(doc);
  }
  return bad("unknown format");
}

std::vector<std::string> ExampleBuilder::fields_of(const recipe::DataSection& cfg) {
  switch (cfg.format) {
    case recipe::Format::Instruction: {
      std::vector<std::string> f = cfg.template_fields();
      if (std::find(f.begin(), f.end(), cfg.response_field) == f.end()) f.push_back(cfg.response_field);
      return f;
    }
    case recipe::Format::Text:
      return {cfg.text_field};
    case recipe::Format::Chat:
      if (cfg.chat_format == recipe::ChatFormat::Template) return {cfg.messages_field, "tools"};
      return {cfg.messages_field};
    case recipe::Format::Preference: {
      std::vector<std::string> f = cfg.prompt_template.empty() ? std::vector{cfg.prompt_field} : cfg.template_fields();
      for (const std::string* c : {&cfg.chosen_field, &cfg.rejected_field})
        if (std::find(f.begin(), f.end(), *c) == f.end()) f.push_back(*c);
      return f;
    }
    case recipe::Format::Unpaired: {
      std::vector<std::string> f = cfg.prompt_template.empty() ? std::vector{cfg.prompt_field} : cfg.template_fields();
      for (const std::string* c : {&cfg.completion_field, &cfg.label_field})
        if (std::find(f.begin(), f.end(), *c) == f.end()) f.push_back(*c);
      return f;
    }
    case recipe::Format::Prompt:  // the whole document: rewards may read any of its fields
      return {};
  }
  return {};
}

std::variant<std::string, Rejection> ExampleBuilder::fill_template(const Document& doc) const {
  std::string prompt;
  for (const recipe::TemplatePart& part : template_) {
    if (!part.is_field) {
      prompt += part.text;
      continue;
    }
    auto value = string_field(doc, part.text);
    if (auto* r = std::get_if<Rejection>(&value)) return *r;
    prompt += std::get<std::string>(value);
  }
  return prompt;
}

std::variant<Example, Rejection> ExampleBuilder::instruction(const Document& doc) const {
  auto filled = fill_template(doc);
  if (auto* r = std::get_if<Rejection>(&filled)) return *r;
  const std::string& prompt = std::get<std::string>(filled);
  auto response = string_field(doc, cfg_.response_field);
  if (auto* r = std::get_if<Rejection>(&response)) return *r;
  if (std::get<std::string>(response).empty()) return bad(fmt::format("field '{}' is empty", cfg_.response_field));
  Example e;
  append(e, prompt, cfg_.train_on_input, true);
  append(e, std::get<std::string>(response), true, false);
  return finish(std::move(e));
}

std::variant<Example, Rejection> ExampleBuilder::text(const Document& doc) const {
  auto value = string_field(doc, cfg_.text_field);
  if (auto* r = std::get_if<Rejection>(&value)) return *r;
  if (std::get<std::string>(value).empty()) return bad(fmt::format("field '{}' is empty", cfg_.text_field));
  Example e;
  append(e, std::get<std::string>(value), true, true);
  return finish(std::move(e));
}

std::variant<Example, Rejection> ExampleBuilder::chat(const Document& doc) const {
  if (!doc.is_object() || !doc.contains(cfg_.messages_field) || !doc[cfg_.messages_field].is_array())
    return bad(fmt::format("field '{}' is missing or not a list of messages", cfg_.messages_field));
  Example e;
  bool any_assistant = false, first = true;
  for (const auto& m : doc[cfg_.messages_field]) {
    auto role = string_field(m, "role");
    auto content = string_field(m, "content");
    if (auto* r = std::get_if<Rejection>(&role)) return within("a message: ", *r);
    if (auto* r = std::get_if<Rejection>(&content)) return within("a message: ", *r);
    const std::string& who = std::get<std::string>(role);
    const bool trained = who == "assistant" || cfg_.train_on_input;
    any_assistant |= who == "assistant";
    const Turn t = chat_turn(cfg_.chat_format, who);
    // The template's special tokens come from the text; BOS (if any) from the first piece.
    append(e, t.before, cfg_.train_on_input, first);
    append(e, std::get<std::string>(content) + t.after, trained, false);
    first = false;
  }
  if (!any_assistant) return untrainable("no assistant message to train on");
  return finish(std::move(e), /*add_eos=*/false);  // each format's turn end is already trained
}

namespace {

// What transformers does to the messages before rendering: keys whose value is null dropped, and
// a message's reasoning (reasoning_content, thinking or reasoning) put under both
// "reasoning_content" and "thinking" (_normalize_chat_messages, _alias_reasoning_fields).
nlohmann::ordered_json template_message(const Document& m) {
  nlohmann::ordered_json out = nlohmann::ordered_json::object();
  const Document* reasoning = nullptr;
  for (const char* key : {"reasoning_content", "thinking", "reasoning"})
    if (auto it = m.find(key); it != m.end() && !it->is_null()) {
      reasoning = &*it;
      break;
    }
  if (reasoning) out["thinking"] = *reasoning;
  for (const auto& [key, value] : m.items())
    if (!value.is_null()) out[key] = value;
  if (reasoning) out["reasoning_content"] = *reasoning;
  return out;
}

std::string read_template(const std::string& path) { return read_input(path, "data.chat_template"); }

// transformers' assistant mask: a token is marked when its range overlaps a span (spans and
// ranges in order; a span cut by truncation keeps its remaining tokens).
void mark_spans(const tok::Tokenizer::Encoding& enc, const std::vector<std::pair<size_t, size_t>>& spans,
                std::vector<int32_t>& labels) {
  size_t s = 0;
  for (size_t k = 0; k < enc.ids.size(); ++k) {
    const auto [begin, end] = enc.offsets[k];
    while (s < spans.size() && begin >= spans[s].second) ++s;
    if (s == spans.size()) break;
    if (end > spans[s].first) labels[k] = enc.ids[k];
  }
}

}  // namespace

void ExampleBuilder::setup_chat_template() {
  if (!cfg_.chat_template.empty()) {
    chat_template_ = read_template(cfg_.chat_template);
    chat_template_source_ = cfg_.chat_template;
  } else {
    chat_template_ = tok_.chat_template();
    chat_template_source_ = "the model's chat template";
  }
  if (chat_template_.empty())
    throw Error(
        "data.chat_format: template, but the model has no chat template (no chat_template in "
        "tokenizer_config.json, no chat_template.jinja, no tokenizer.chat_template in the GGUF); set "
        "data.chat_template to a .jinja file, or choose data.chat_format chatml, llama3 or mistral");
  auto compiled = chat::Template::compile(chat_template_, static_cast<uint64_t>(cfg_.chat_template_fuel));
  if (const auto* e = std::get_if<std::string>(&compiled))
    throw Error(
        fmt::format("data.chat_format: template: {} is not a valid Jinja template: {}", chat_template_source_, *e));
  compiled_template_ = std::get<chat::Template>(std::move(compiled));
  // What transformers passes besides the messages: the special tokens, then the extra kwargs.
  chat_context_ = nlohmann::ordered_json::object();
  const auto token = [&](const char* name, std::optional<int32_t> id) {
    if (id)
      if (auto t = tok_.id_to_token(*id)) chat_context_[name] = *t;
  };
  token("bos_token", tok_.bos_id());
  token("eos_token", tok_.eos_id());
  token("pad_token", tok_.pad_id());
  chat_context_["tools"] = nullptr;
  chat_context_["documents"] = nullptr;
  for (const auto& [key, value] : cfg_.chat_template_kwargs.items()) chat_context_[key] = value;
  generation_tags_ = chat::has_generation_tags(chat_template_);
  // (pairs score their completions, found by the prompt's rendering, not by an end-of-turn token)
  if (generation_tags_ || cfg_.train_on_input || cfg_.format == recipe::Format::Preference ||
      cfg_.format == recipe::Format::Unpaired)
    return;
  // The end-of-turn token: the first added token the template writes after an assistant
  // message's content, in a probe conversation (with a system message if it needs one).
  const std::string reply = "lorarun probe reply";
  std::string failure;
  for (const bool system : {false, true}) {
    nlohmann::ordered_json messages = nlohmann::ordered_json::array();
    if (system) messages.push_back({{"role", "system"}, {"content", "lorarun probe system"}});
    messages.push_back({{"role", "user"}, {"content", "lorarun probe question"}});
    messages.push_back({{"role", "assistant"}, {"content", reply}});
    nlohmann::ordered_json context = chat_context_;
    context["messages"] = messages;
    context["add_generation_prompt"] = false;
    const auto r = Renderer{*compiled_template_, context, stop_}(messages, false);
    if (const auto* e = std::get_if<std::string>(&r)) {
      if (*e == chat::kFuelSpent)
        throw Error(
            fmt::format("data.chat_format: template: {} spent all of data.chat_template_fuel ({}) rendering "
                        "a three-message probe conversation: the template loops too long; fix it, or raise "
                        "data.chat_template_fuel",
                        chat_template_source_, cfg_.chat_template_fuel));
      failure = *e;
      continue;
    }
    const std::string& text = std::get<chat::Rendered>(r).text;
    const size_t at = text.rfind(reply);
    if (at == std::string::npos) {
      failure = "the assistant message's content does not appear in the rendered probe conversation";
      continue;
    }
    const tok::Tokenizer::Encoding enc = tok_.encode_with_offsets(text);
    for (size_t k = 0; k < enc.ids.size(); ++k)
      if (enc.offsets[k].first >= at + reply.size() && tok_.is_added(enc.ids[k])) {
        eot_ = *tok_.id_to_token(enc.ids[k]);
        return;
      }
    failure = "it writes no special token after an assistant message's content";
  }
  throw Error(fmt::format(
      "data.chat_format: template: {} has no {{% generation %}} tags and no end-of-turn token could be found "
      "({}); use a template that ends assistant turns with a special token, or data.train_on_input: true",
      chat_template_source_, failure));
}

namespace {

using Span = std::pair<size_t, size_t>;  // [begin, end) bytes of the rendered text

// Where assistant message i's turn starts in `text`: the end of render(messages[:i]) with the
// generation prompt when that is a prefix of the conversation; else, when render(messages[:i])
// without it is, where the prompt and the conversation part (Qwen3's empty <think></think> with
// enable_thinking false). nullopt when neither is a prefix.
std::optional<size_t> turn_start_by_prefix(Renderer& render, const nlohmann::ordered_json& messages, size_t i,
                                           const std::string& text) {
  const nlohmann::ordered_json before(messages.begin(), messages.begin() + static_cast<long>(i));
  const auto prompt = render(before, true);
  const auto* p = std::get_if<chat::Rendered>(&prompt);
  if (!p) return std::nullopt;
  if (text.starts_with(p->text)) return p->text.size();
  std::string history;
  if (i > 0) {
    const auto h = render(before, false);
    if (!std::holds_alternative<chat::Rendered>(h)) return std::nullopt;
    history = std::get<chat::Rendered>(h).text;
  }
  if (!text.starts_with(history)) return std::nullopt;
  const auto part = std::mismatch(p->text.begin(), p->text.end(), text.begin(), text.end()).first;
  return std::max(static_cast<size_t>(part - p->text.begin()), history.size());
}

// For templates that render earlier turns differently once more follow (a system message put in
// the last user turn): the conversation rendered with each assistant content between two
// noncharacters must give `text` once they are taken out; the contents' spans in `text`, or
// nullopt when the template alters the contents (trims them, say).
std::optional<std::vector<Span>> contents_by_marks(Renderer& render, nlohmann::ordered_json messages,
                                                   const std::vector<size_t>& assistants, const std::string& text) {
  static constexpr std::string_view kOpen = "\xEF\xB7\x92", kClose = "\xEF\xB7\x93";  // U+FDD2, U+FDD3
  for (const size_t i : assistants) {
    auto& c = messages[i]["content"];
    if (!c.is_string()) return std::nullopt;
    c = std::string(kOpen) + c.get<std::string>() + std::string(kClose);
  }
  const auto r = render(messages, false);
  if (!std::holds_alternative<chat::Rendered>(r)) return std::nullopt;
  const std::string& w = std::get<chat::Rendered>(r).text;
  std::string plain;
  std::vector<Span> turns;
  for (size_t k = 0; k < w.size();) {
    if (w.compare(k, kOpen.size(), kOpen) == 0) {
      turns.emplace_back(plain.size(), std::string::npos);
      k += kOpen.size();
    } else if (w.compare(k, kClose.size(), kClose) == 0) {
      if (turns.empty() || turns.back().second != std::string::npos) return std::nullopt;
      turns.back().second = plain.size();
      k += kClose.size();
    } else {
      plain += w[k++];
    }
  }
  if (plain != text || turns.size() != assistants.size()) return std::nullopt;
  return turns;
}

}  // namespace

std::variant<std::vector<std::pair<size_t, size_t>>, std::string> ExampleBuilder::assistant_turns(
    const nlohmann::ordered_json& messages, const std::vector<size_t>& assistants, const std::string& text,
    const nlohmann::ordered_json& context) const {
  Renderer render{*compiled_template_, context, stop_};
  std::optional<std::optional<std::vector<Span>>> marked;  // computed once, when first needed
  std::vector<Span> spans;
  for (size_t k = 0; k < assistants.size(); ++k) {
    const size_t i = assistants[k];
    std::optional<size_t> start = turn_start_by_prefix(render, messages, i, text), from = start;
    if (!start) {
      if (!marked) marked = contents_by_marks(render, messages, assistants, text);
      if (*marked) {
        start = (**marked)[k].first;
        from = (**marked)[k].second;
      }
    }
    if (!start)
      return fmt::format(
          "the chat template renders the messages before assistant message {} differently from the start of the "
          "whole conversation, and alters the assistant contents, so the turn cannot be located",
          i);
    const size_t end = text.find(eot_, *from);
    if (end == std::string::npos)
      return fmt::format("the chat template wrote no end-of-turn token {} after assistant message {}", eot_, i);
    spans.emplace_back(*start, end + eot_.size());
  }
  return spans;
}

std::variant<Example, Rejection> ExampleBuilder::chat_template(const Document& doc) const {
  if (!doc.is_object() || !doc.contains(cfg_.messages_field) || !doc[cfg_.messages_field].is_array() ||
      doc[cfg_.messages_field].empty())
    return bad(fmt::format("field '{}' is missing or not a list of messages", cfg_.messages_field));
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  std::vector<size_t> assistants;
  for (const auto& m : doc[cfg_.messages_field]) {
    auto role = string_field(m, "role");
    if (auto* r = std::get_if<Rejection>(&role)) return within("a message: ", *r);
    if (std::get<std::string>(role) == "assistant") assistants.push_back(messages.size());
    messages.push_back(template_message(m));
  }
  if (assistants.empty()) return untrainable("no assistant message to train on");
  nlohmann::ordered_json context = chat_context_;
  if (auto it = doc.find("tools"); it != doc.end() && !it->is_null()) context["tools"] = *it;
  const auto whole = Renderer{*compiled_template_, context, stop_}(messages, false);
  if (const auto* e = std::get_if<std::string>(&whole))
    return template_failed(
        *e == chat::kFuelSpent
            ? fmt::format("rendering it with the chat template ({}) spent all of data.chat_template_fuel ({}): "
                          "raise it, or fix the template",
                          chat_template_source_, cfg_.chat_template_fuel)
            : fmt::format("the chat template ({}) failed: {}", chat_template_source_, *e));
  const chat::Rendered& conversation = std::get<chat::Rendered>(whole);
  const std::string& text = conversation.text;
  if (!valid_utf8(text)) return unreadable(invalid_utf8_reason(cfg_.messages_field));
  tok::Tokenizer::Encoding enc;
  try {
    enc = tok_.encode_with_offsets(text);
  } catch (const Error& err) {
    return unreadable(err.what());
  }
  Example e;
  e.ids = enc.ids;
  e.labels.assign(enc.ids.size(), kIgnoreIndex);
  if (cfg_.train_on_input) {
    e.labels = e.ids;
  } else if (generation_tags_) {
    mark_spans(enc, conversation.generation, e.labels);
  } else {
    const auto turns = assistant_turns(messages, assistants, text, context);
    if (const auto* why = std::get_if<std::string>(&turns)) return template_failed(*why);
    mark_spans(enc, std::get<std::vector<Span>>(turns), e.labels);
  }
  return finish(std::move(e), /*add_eos=*/false);
}

namespace {

// The messages of a conversational field ({role, content} each, content a string), or why not.
std::variant<nlohmann::ordered_json, Rejection> messages_of(const Document& doc, const std::string& field) {
  const Document& list = doc[field];
  if (!list.is_array() || list.empty())
    return bad(fmt::format("field '{}' is not a non-empty list of messages", field));
  nlohmann::ordered_json out = nlohmann::ordered_json::array();
  for (const auto& m : list) {
    for (const char* key : {"role", "content"}) {
      auto v = string_field(m, key);
      if (auto* r = std::get_if<Rejection>(&v)) return within(fmt::format("a message of '{}': ", field), *r);
    }
    out.push_back(template_message(m));
  }
  return out;
}

size_t common_prefix(const std::vector<int32_t>& a, const std::vector<int32_t>& b) {
  return static_cast<size_t>(std::mismatch(a.begin(), a.end(), b.begin(), b.end()).first - a.begin());
}

}  // namespace

std::variant<std::vector<std::string>, Rejection> ExampleBuilder::completion_texts(
    const Document& doc, const std::vector<std::string>& completions, bool& special) const {
  if (!doc.is_object()) return unreadable("the document is not an object");
  for (const std::string& f : completions)
    if (!doc.contains(f)) return bad(fmt::format("field '{}' is missing", f));
  const size_t n = completions.size() + 1;
  const bool conversation =
      cfg_.prompt_template.empty() && doc.contains(cfg_.prompt_field) && doc[cfg_.prompt_field].is_array();
  if (!conversation) {  // strings: prompt + completion + EOS, tokenised with the special tokens
    special = true;
    auto prompt = template_.empty() ? string_field(doc, cfg_.prompt_field) : fill_template(doc);
    if (auto* r = std::get_if<Rejection>(&prompt)) return *r;
    const std::string eos = eos_ ? tok_.id_to_token(*eos_).value_or("") : "";
    std::vector<std::string> out(n);
    out[0] = std::get<std::string>(prompt);
    for (size_t k = 1; k < n; ++k) {
      auto c = string_field(doc, completions[k - 1]);
      if (auto* r = std::get_if<Rejection>(&c)) return *r;
      std::string& text = std::get<std::string>(c);
      if (!text.ends_with(eos)) text += eos;
      out[k] = out[0] + text;
    }
    return out;
  }
  std::vector<nlohmann::ordered_json> parts(n);
  for (size_t k = 0; k < n; ++k) {
    auto m = messages_of(doc, k == 0 ? cfg_.prompt_field : completions[k - 1]);
    if (auto* r = std::get_if<Rejection>(&m)) return *r;
    parts[k] = std::move(std::get<nlohmann::ordered_json>(m));
  }
  std::vector<std::string> out(n);
  if (cfg_.chat_format != recipe::ChatFormat::Template) {  // the built-in formats' turns, BOS first
    special = true;
    const auto render = [&](const nlohmann::ordered_json& messages) {
      std::string text;
      for (const auto& m : messages) {
        const Turn t = chat_turn(cfg_.chat_format, m["role"].get<std::string>());
        text += t.before + m["content"].get<std::string>() + t.after;
      }
      return text;
    };
    out[0] = render(parts[0]) + chat_turn(cfg_.chat_format, "assistant").before;
    for (size_t k = 1; k < n; ++k) out[k] = render(parts[0]) + render(parts[k]);
    return out;
  }
  special = false;  // (apply_chat_template tokenises without adding special tokens)
  nlohmann::ordered_json context = chat_context_;
  if (auto it = doc.find("tools"); it != doc.end() && !it->is_null()) context["tools"] = *it;
  Renderer render{*compiled_template_, context, stop_};
  for (size_t k = 0; k < n; ++k) {
    nlohmann::ordered_json messages = parts[0];
    if (k > 0) messages.insert(messages.end(), parts[k].begin(), parts[k].end());
    const auto r = render(messages, k == 0);
    if (const auto* e = std::get_if<std::string>(&r))
      return template_failed(fmt::format("the chat template ({}) failed: {}", chat_template_source_, *e));
    out[k] = std::get<chat::Rendered>(r).text;
  }
  return out;
}

std::variant<ExampleBuilder::Tokenised, Rejection> ExampleBuilder::tokenise(const std::vector<std::string>& texts,
                                                                            bool special) const {
  Tokenised out;
  try {
    for (const std::string& text : texts) out.ids.push_back(tok_.encode(text, special));
  } catch (const Error& err) {
    return unreadable(err.what());
  }
  out.prompt = out.ids[0].size();
  size_t longest = 0;
  for (size_t k = 1; k < out.ids.size(); ++k) {
    out.prompt = std::min(out.prompt, common_prefix(out.ids[0], out.ids[k]));
    longest = std::max(longest, out.ids[k].size());
  }
  const auto max = static_cast<size_t>(cfg_.max_length);
  if (out.prompt >= max || (longest > max && cfg_.overlong == recipe::Overlong::Skip))
    return Rejection{Rejection::Overlong,
                     out.prompt >= max
                         ? fmt::format("its prompt alone is {} tokens, data.max_length is {}", out.prompt, max)
                         : fmt::format("{} tokens, data.max_length is {}", longest, max)};
  return out;
}

std::variant<Example, Rejection> ExampleBuilder::preference(const Document& doc) const {
  bool special = true;
  auto texts = completion_texts(doc, {cfg_.chosen_field, cfg_.rejected_field}, special);
  if (auto* r = std::get_if<Rejection>(&texts)) return *r;
  const auto& t = std::get<std::vector<std::string>>(texts);
  if (t[1] == t[2]) return untrainable("the chosen and the rejected completion are the same");
  for (const std::string& text : t)
    if (!valid_utf8(text)) return unreadable("a rendered text is not valid UTF-8");
  if (pairs_ == PairTokens::Orpo) return orpo_pair(t);
  auto tokenised = tokenise(t, special);
  if (auto* r = std::get_if<Rejection>(&tokenised)) return *r;
  auto& [ids, prompt] = std::get<Tokenised>(tokenised);
  const auto max = static_cast<size_t>(cfg_.max_length);
  Example e;
  for (int k = 1; k < 3; ++k) {
    std::vector<int32_t>& seq = ids[k];
    if (seq.size() == prompt) return untrainable("a completion has no token");
    e.truncated |= seq.size() > max;
    if (seq.size() > max) seq.resize(max);
    std::vector<int32_t> labels = seq;
    std::fill(labels.begin(), labels.begin() + static_cast<std::ptrdiff_t>(prompt), kIgnoreIndex);
    (k == 1 ? e.ids : e.rejected_ids) = std::move(seq);
    (k == 1 ? e.labels : e.rejected_labels) = std::move(labels);
  }
  return e;
}

std::variant<Example, Rejection> ExampleBuilder::unpaired(const Document& doc) const {
  if (!doc.is_object()) return unreadable("the document is not an object");
  const auto label = label_field(doc, cfg_.label_field);
  if (auto* r = std::get_if<Rejection>(&label)) return *r;
  bool special = true;
  auto texts = completion_texts(doc, {cfg_.completion_field}, special);
  if (auto* r = std::get_if<Rejection>(&texts)) return *r;
  const auto& t = std::get<std::vector<std::string>>(texts);
  for (const std::string& text : t)
    if (!valid_utf8(text)) return unreadable("a rendered text is not valid UTF-8");
  auto tokenised = tokenise(t, special);
  if (auto* r = std::get_if<Rejection>(&tokenised)) return *r;
  auto& [ids, prompt] = std::get<Tokenised>(tokenised);
  const auto max = static_cast<size_t>(cfg_.max_length);
  std::vector<int32_t>& seq = ids[1];
  if (seq.size() == prompt) return untrainable("the completion has no token");
  Example e;
  e.desirable = std::get<bool>(label);
  // (up to max_length of it: another example's prompt, put before it for KTO's KL estimate, may be shorter)
  e.completion.assign(seq.begin() + static_cast<std::ptrdiff_t>(prompt),
                      seq.begin() + static_cast<std::ptrdiff_t>(std::min(seq.size(), prompt + max)));
  e.truncated = seq.size() > max;
  if (e.truncated) seq.resize(max);
  e.labels = seq;
  std::fill(e.labels.begin(), e.labels.begin() + static_cast<std::ptrdiff_t>(prompt), kIgnoreIndex);
  e.ids = std::move(seq);
  return e;
}

std::variant<Example, Rejection> ExampleBuilder::prompt(const Document& doc) const {
  if (!doc.is_object()) return unreadable("the document is not an object");
  if (check_)
    if (std::string why = check_(doc); !why.empty()) return bad(why);
  bool special = true;
  auto texts = completion_texts(doc, {}, special);
  if (auto* r = std::get_if<Rejection>(&texts)) return *r;
  const auto& t = std::get<std::vector<std::string>>(texts);
  if (!valid_utf8(t[0])) return unreadable("the rendered prompt is not valid UTF-8");
  auto tokenised = tokenise(t, special);
  if (auto* r = std::get_if<Rejection>(&tokenised)) return *r;
  Example e;
  e.ids = std::move(std::get<Tokenised>(tokenised).ids[0]);
  if (e.ids.empty()) return untrainable("the prompt has no token");
  e.labels.assign(e.ids.size(), kIgnoreIndex);
  e.document = std::make_shared<const Document>(doc);
  return e;
}

std::variant<Example, Rejection> ExampleBuilder::orpo_pair(const std::vector<std::string>& t) const {
  std::vector<int32_t> prompt, seq[2];
  size_t start[2];
  try {
    prompt = tok_.encode(t[0], false);
    for (int k = 0; k < 2; ++k) seq[k] = tok_.encode(t[static_cast<size_t>(k) + 1], false);
  } catch (const Error& err) {
    return unreadable(err.what());
  }
  const auto max = static_cast<size_t>(cfg_.max_length);
  const std::optional<int32_t> bos = tok_.bos_id();
  Example e;
  for (int k = 0; k < 2; ++k) {
    std::vector<int32_t>& ids = seq[k];
    start[k] = std::min(prompt.size(), ids.size());
    if (common_prefix(prompt, ids) < start[k]) start[k] = start[k] > 0 ? start[k] - 1 : 0;
    if (bos && (start[k] == 0 || ids[0] != *bos)) {
      ids.insert(ids.begin(), *bos);
      ++start[k];
    }
    if (eos_ && (ids.size() == start[k] || ids.back() != *eos_)) ids.push_back(*eos_);
    if (start[k] >= max)
      return Rejection{Rejection::Overlong,
                       fmt::format("its prompt alone is {} tokens, data.max_length is {}", start[k], max)};
    if (ids.size() > max && cfg_.overlong == recipe::Overlong::Skip)
      return Rejection{Rejection::Overlong, fmt::format("{} tokens, data.max_length is {}", ids.size(), max)};
    e.truncated |= ids.size() > max;
    if (ids.size() > max) ids.resize(max);
    if (ids.size() == start[k]) return untrainable("a completion has no token");
    std::vector<int32_t> labels = ids;
    std::fill(labels.begin(), labels.begin() + static_cast<std::ptrdiff_t>(start[k]), kIgnoreIndex);
    (k == 0 ? e.ids : e.rejected_ids) = std::move(ids);
    (k == 0 ? e.labels : e.rejected_labels) = std::move(labels);
  }
  return e;
}

int64_t trained_tokens(const Example& e) {
  return std::count_if(e.labels.begin() + (e.labels.empty() ? 0 : 1), e.labels.end(),
                       [](int32_t l) { return l != kIgnoreIndex; });
}

}  // namespace lorarun::data
