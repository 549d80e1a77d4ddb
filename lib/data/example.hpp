// One training example from one document: rendered by the recipe's format, tokenized, with
// labels that train only the response (and EOS).
#pragma once
#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "chat/chat_template.hpp"
#include "data/document.hpp"
#include "recipe/recipe.hpp"
#include "tokenizer/tokenizer.hpp"

namespace lorarun::data {

// The label of a token that is not trained (transformers' and PyTorch's ignore_index).
inline constexpr int32_t kIgnoreIndex = -100;

struct Example {
  std::vector<int32_t> ids;
  std::vector<int32_t> labels;  // the id where trained, kIgnoreIndex where not
  bool truncated = false;
  // data.format: preference: ids/labels are prompt + chosen completion (the completion labelled),
  // these prompt + rejected; empty otherwise.
  std::vector<int32_t> rejected_ids, rejected_labels;
  // data.format: unpaired: ids/labels are prompt + completion (the completion labelled); whether it
  // is desirable, and the completion's ids (up to data.max_length of them: KTO puts them after
  // another example's prompt).
  std::optional<bool> desirable;
  std::vector<int32_t> completion;
  // data.format: prompt: ids are the prompt (labels all kIgnoreIndex: the objective samples the
  // completions), and the document, which rewards check the completions against.
  std::shared_ptr<const Document> document;
  int32_t source = 0;  // data.sources: the index of the source it came from
  bool pair() const { return !rejected_ids.empty(); }
};

// The tokens of `e` the loss scores: those after the first whose label is trained (what collate
// counts as the batch's tokens).
int64_t trained_tokens(const Example& e);

// A document that yields no example, and why (data.bad_documents / data.overlong decide).
struct Rejection {
  enum Kind { BadDocument, Overlong } kind;
  std::string reason;
  std::string document = {};  // its _id (or "#position" in a JSONL file) when the reader knows it
  // What kind of bad document (a run counts skipped documents by cause; an Overlong kind is kOverlong).
  enum Cause { kMalformed, kUntrainable, kUnreadable, kDeleted, kTemplate, kOverlong, kCauses };
  Cause cause_of_bad = kMalformed;
  Cause cause() const { return kind == Overlong ? kOverlong : cause_of_bad; }
};

// The cause's name in metrics and messages: "malformed" (a field missing, of the wrong type or
// empty), "untrainable" (no token to train), "unreadable" (not JSON or not UTF-8), "deleted" (gone
// from the collection since it was listed), "template" (the chat template failed), "overlong".
std::string_view cause_name(Rejection::Cause c);

// How a preference pair is tokenised: as TRL's DPOTrainer does (its KTOTrainer tokenises a single
// completion alike), or as its ORPOTrainer (and CPOTrainer, whose tokenize_row is the same) does.
enum class PairTokens { Dpo, Orpo };
// The tokenisation of train.objective's trainer in TRL.
inline PairTokens pair_tokens(recipe::Objective o) {
  return o == recipe::Objective::Dpo || o == recipe::Objective::Kto ? PairTokens::Dpo : PairTokens::Orpo;
}

class ExampleBuilder {
 public:
  // `eos` ends every response; the tokenizer's EOS when not given. With chat_format: template,
  // throws lorarun::Error (one line) when there is no chat template (or data.chat_template
  // cannot be read), or when the template has no {% generation %} tags and no end-of-turn token
  // can be found after an assistant message. `stop` (a stop request's flag): a chat template's
  // render that takes long is given up once it is set, and build() throws DataUnavailable.
  ExampleBuilder(const recipe::DataSection& cfg, const tok::Tokenizer& tokenizer, std::optional<int32_t> eos = {},
                 PairTokens pairs = PairTokens::Dpo, const std::atomic<bool>* stop = nullptr);

  std::variant<Example, Rejection> build(const Document& doc) const;
  // format: prompt: `check` says why a document cannot be scored by the objective's rewards (a bad
  // document), or "".
  void check_documents(std::function<std::string(const Document&)> check) { check_ = std::move(check); }
  // The top-level fields build() reads (template fields + response, text or messages): the
  // projection a source fetches.
  std::vector<std::string> fields() const { return fields_of(cfg_); }
  recipe::Format format() const { return cfg_.format; }
  static std::vector<std::string> fields_of(const recipe::DataSection& cfg);

 private:
  std::variant<Example, Rejection> instruction(const Document& doc) const;
  std::variant<Example, Rejection> text(const Document& doc) const;
  std::variant<Example, Rejection> chat(const Document& doc) const;
  // format: preference, as TRL 1.16's DPOTrainer tokenises a pair: prompt, prompt + chosen and
  // prompt + rejected each tokenised whole (strings: each completion ends with EOS; messages:
  // rendered by data.chat_format, the prompt with the generation prompt); the completions start
  // where the prompt's ids and both sequences' part. Truncation: data.overlong truncate keeps the
  // start of each sequence (a pair whose prompt alone fills data.max_length is rejected as
  // overlong); skip rejects a pair with a sequence past it. PairTokens::Orpo: as TRL's
  // ORPOTrainer: the three texts tokenised without special tokens, each completion starting after
  // the prompt's ids (one token earlier when the last prompt token merges), BOS before each prompt
  // and EOS after each completion unless there, the completions cut to fit data.max_length.
  std::variant<Example, Rejection> preference(const Document& doc) const;
  std::variant<Example, Rejection> orpo_pair(const std::vector<std::string>& texts) const;
  // format: unpaired, as TRL 1.16's KTOTrainer tokenises an example: prompt and prompt + completion
  // as preference(), the completion starting where their ids part; data.label_field true/false or 1/0.
  std::variant<Example, Rejection> unpaired(const Document& doc) const;
  // format: prompt, as TRL 1.16's GRPOTrainer tokenises a prompt: a string with the special tokens, a
  // conversation rendered with the generation prompt (as preference()'s prompt); the whole document kept.
  // A prompt of data.max_length tokens or more is rejected as overlong.
  std::variant<Example, Rejection> prompt(const Document& doc) const;
  // `texts` (the prompt's, then prompt + each completion) tokenised whole, and where the prompt's ids
  // and every sequence's part; rejected as overlong when the prompt alone fills data.max_length or,
  // with data.overlong skip, a sequence is longer (TRL's DPOTrainer and KTOTrainer alike).
  struct Tokenised {
    std::vector<std::vector<int32_t>> ids;
    size_t prompt = 0;
  };
  std::variant<Tokenised, Rejection> tokenise(const std::vector<std::string>& texts, bool special) const;
  // The texts of the prompt and of the prompt followed by each of the fields `completions`, and
  // whether to add special tokens.
  std::variant<std::vector<std::string>, Rejection> completion_texts(const Document& doc,
                                                                     const std::vector<std::string>& completions,
                                                                     bool& special) const;
  // data.prompt_template with the document's fields, or why it cannot be filled.
  std::variant<std::string, Rejection> fill_template(const Document& doc) const;
  // chat_format: template: the model's Jinja chat template, as apply_chat_template renders and
  // tokenizes it. Trained: the {% generation %} spans when the template marks them; otherwise,
  // per assistant message i, from the end of render(messages[:i], add_generation_prompt) through
  // the first end-of-turn token (eot_) after it. When that rendering is not a prefix of the
  // conversation's but render(messages[:i]) is, the turn starts where the two texts part.
  std::variant<Example, Rejection> chat_template(const Document& doc) const;
  // The trained [begin, end) bytes of each assistant turn of `text` (the conversation rendered
  // with `context`), or why they cannot be found.
  std::variant<std::vector<std::pair<size_t, size_t>>, std::string> assistant_turns(
      const nlohmann::ordered_json& messages, const std::vector<size_t>& assistants, const std::string& text,
      const nlohmann::ordered_json& context) const;
  void setup_chat_template();
  // Appends `text` tokens, trained or not.
  void append(Example& e, const std::string& text, bool trained, bool add_special) const;
  std::variant<Example, Rejection> finish(Example e, bool add_eos = true) const;

  const recipe::DataSection& cfg_;
  const tok::Tokenizer& tok_;
  std::optional<int32_t> eos_;
  PairTokens pairs_;
  std::vector<recipe::TemplatePart> template_;
  std::string chat_template_;                          // chat_format: template: the Jinja text
  std::optional<chat::Template> compiled_template_;    // ... compiled once
  std::string chat_template_source_;                   // where it came from, for messages
  nlohmann::ordered_json chat_context_;                // bos_token, eos_token, ..., data.chat_template_kwargs
  const std::atomic<bool>* stop_ = nullptr;            // a stop request: long renders are given up
  std::function<std::string(const Document&)> check_;  // format: prompt: the rewards' check
  bool generation_tags_ = false;                       // the template marks assistant text with {% generation %}
  std::string eot_;                                    // the end-of-turn token's text (without generation tags)
};

// True when `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past
// U+10FFFF). The one check for documents from JSONL and MongoDB alike.
bool valid_utf8(std::string_view s);

// A bad document's reason when `field` (dotted inside documents and arrays) is not UTF-8.
std::string invalid_utf8_reason(std::string_view field);

}  // namespace lorarun::data
