// Rewards declared in a recipe, checked against the prompt's own document: what GRPO scores each
// completion with (the step's reward is their weighted sum, as TRL's reward_weights).
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "data/document.hpp"

namespace lorarun::train {

// One reward of the recipe's `rewards:` list. Kinds, each 1.0 when it holds and 0.0 when not, but length:
//   exact     the completion (or the pattern's answer), stripped, equals the field's value
//   number    the last number in the completion (or the pattern's answer) equals the field's number
//             within `tolerance` (commas between thousands ignored)
//   regex     the pattern is found in the completion; with a field, its answer equals the field's value
//   contains  the completion contains the field's value
//   json      the completion, or its first fenced ``` block, parses as JSON; with keys, an object holding each
//   format    the pattern matches the whole completion (Python's re.fullmatch with re.DOTALL)
//   length    DAPO's soft overlong punishment, as TRL's get_soft_overlong_punishment: 0 up to
//             max_tokens - cache tokens, then falling linearly to -1 at max_tokens, -1 beyond
//   command   the user's program `run` (RewardCommand) scores each completion; `fields` are the
//             document's fields sent along (each must be in the document)
// A pattern's answer is its group named `answer`, else its first group, else the whole match.
struct RewardSpec {
  std::string name = {}, kind = {};
  double weight = 1.0;
  std::string field = {};    // a key of the document, or a dotted path into its objects ("meta.answer")
  std::string pattern = {};  // PCRE2 (Python re's syntax for what both share)
  bool ignore_case = false;
  double tolerance = 0.0;
  std::vector<std::string> keys = {};
  int64_t max_tokens = 0, cache = 0;
  std::vector<std::string> run = {}, fields = {};  // command
  double timeout_s = 60;                           // command: for each batch of completions
};

// The recipe's grpo.rewards (a list of mappings) as specs; throws ConfigError naming the entry
// ("grpo.rewards[1]: …") for a key it does not know, a value of the wrong type, a missing or repeated
// name, or a name other than letters, digits, '_', '-' and '.' (it names metrics).
std::vector<RewardSpec> reward_specs(const nlohmann::json& list);

class Reward {
 public:
  // Throws ConfigError naming `where` ("rewards[1] (answer)") when the spec does not hold together:
  // an unknown kind, a pattern that does not compile, a field missing or not wanted by its kind.
  Reward(RewardSpec spec, const std::string& where);
  ~Reward();
  Reward(Reward&&) noexcept;
  Reward& operator=(Reward&&) noexcept;

  const RewardSpec& spec() const { return spec_; }

  // Why `doc` cannot be scored against ("field 'answer' is missing"), or "": a bad document, which
  // the data path rejects (data.bad_documents) before its prompt is generated for.
  std::string check(const data::Document& doc) const;

  // The reward of `completion` (its text and its number of tokens) for the prompt of `doc`, which
  // check() accepted.
  double score(std::string_view completion, int64_t tokens, const data::Document& doc) const;

 private:
  struct Pattern;
  RewardSpec spec_;
  std::unique_ptr<Pattern> pattern_;
  const data::Document* field_value(const data::Document& doc) const;  // null when missing
  std::string field_text(const data::Document& doc) const;             // a string, or a number's JSON
};

// `s` without leading and trailing whitespace.
std::string_view strip(std::string_view s);

// The last number written in `text` ("-3", "1,234.5", "2e3"), if any.
std::optional<double> last_number(std::string_view text);

}  // namespace lorarun::train
