#include "data/example.hpp"

#include <fmt/format.h>
#include <algorithm>

namespace lorarun::data {
namespace {

Rejection bad(std::string reason) { return {Rejection::BadDocument, std::move(reason)}; }

// The string value of `field`, or why there is none.
std::variant<std::string, Rejection> string_field(const nlohmann::json& doc, const std::string& field) {
  if (!doc.is_object() || !doc.contains(field)) return bad(fmt::format("field '{}' is missing", field));
  if (!doc[field].is_string()) return bad(fmt::format("field '{}' is not a string", field));
  std::string s = doc[field].get<std::string>();
  if (!valid_utf8(s)) return bad(invalid_utf8_reason(field));
  return s;
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

std::string invalid_utf8_reason(std::string_view field) { return fmt::format("field '{}' is not valid UTF-8", field); }

ExampleBuilder::ExampleBuilder(const recipe::DataSection& cfg, const tok::Tokenizer& tokenizer,
                               std::optional<int32_t> eos)
    : cfg_(cfg), tok_(tokenizer), eos_(eos ? eos : tokenizer.eos_id()) {
  if (cfg.format == recipe::Format::Instruction) template_ = recipe::parse_template(cfg.prompt_template);
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
    return bad("no token left to train on after truncation");
  return e;
}

std::variant<Example, Rejection> ExampleBuilder::build(const nlohmann::json& doc) const {
  switch (cfg_.format) {
    case recipe::Format::Instruction:
      return instruction(doc);
    case recipe::Format::Text:
      return text(doc);
    case recipe::Format::Chat:
      return chat(doc);
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
      return {cfg.messages_field};
  }
  return {};
}

std::variant<Example, Rejection> ExampleBuilder::instruction(const nlohmann::json& doc) const {
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
  auto response = string_field(doc, cfg_.response_field);
  if (auto* r = std::get_if<Rejection>(&response)) return *r;
  if (std::get<std::string>(response).empty()) return bad(fmt::format("field '{}' is empty", cfg_.response_field));
  Example e;
  append(e, prompt, cfg_.train_on_input, true);
  append(e, std::get<std::string>(response), true, false);
  return finish(std::move(e));
}

std::variant<Example, Rejection> ExampleBuilder::text(const nlohmann::json& doc) const {
  auto value = string_field(doc, cfg_.text_field);
  if (auto* r = std::get_if<Rejection>(&value)) return *r;
  if (std::get<std::string>(value).empty()) return bad(fmt::format("field '{}' is empty", cfg_.text_field));
  Example e;
  append(e, std::get<std::string>(value), true, true);
  return finish(std::move(e));
}

std::variant<Example, Rejection> ExampleBuilder::chat(const nlohmann::json& doc) const {
  if (!doc.is_object() || !doc.contains(cfg_.messages_field) || !doc[cfg_.messages_field].is_array())
    return bad(fmt::format("field '{}' is missing or not a list of messages", cfg_.messages_field));
  Example e;
  bool any_assistant = false, first = true;
  for (const auto& m : doc[cfg_.messages_field]) {
    auto role = string_field(m, "role");
    auto content = string_field(m, "content");
    if (auto* r = std::get_if<Rejection>(&role)) return bad("a message: " + r->reason);
    if (auto* r = std::get_if<Rejection>(&content)) return bad("a message: " + r->reason);
    const std::string& who = std::get<std::string>(role);
    const bool trained = who == "assistant" || cfg_.train_on_input;
    any_assistant |= who == "assistant";
    const Turn t = chat_turn(cfg_.chat_format, who);
    // The template's special tokens come from the text; BOS (if any) from the first piece.
    append(e, t.before, cfg_.train_on_input, first);
    append(e, std::get<std::string>(content) + t.after, trained, false);
    first = false;
  }
  if (!any_assistant) return bad("no assistant message to train on");
  return finish(std::move(e), /*add_eos=*/false);  // each format's turn end is already trained
}

}  // namespace lorarun::data
