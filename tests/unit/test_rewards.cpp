// Rewards checked against the prompt's document: each kind on completions that pass and fail, the
// recipe mistakes refused in one line, and the two TRL ships (think format, soft overlong
// punishment) against TRL's own functions on the same completions.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/oracle.hpp"
#include "support/process.hpp"
#include "train/rewards.hpp"
#include "util/error.hpp"

using namespace lorarun;
using namespace lorarun::train;

namespace {

const data::Document kDoc = data::Document::parse(
    R"({"question": "What is 6 x 7?", "answer": "42", "total": 1234.5, "code": "LQ-3RED-CHR",
        "meta": {"city": "Paris"}, "tags": ["a"], "gsm8k": "6 times 7 is 42.\n#### 42"})");

double score(RewardSpec spec, const std::string& completion, int64_t tokens = 10) {
  if (spec.name.empty()) spec.name = spec.kind;
  const Reward r(spec, "rewards[0]");
  REQUIRE(r.check(kDoc).empty());
  return r.score(completion, tokens, kDoc);
}

std::string refusal(const RewardSpec& spec) {
  try {
    Reward r(spec, "rewards[1] (" + spec.name + ")");
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("rewards: each kind scores what it says against the document's field") {
  // exact: stripped; case folded when asked; on the pattern's answer when one is given
  CHECK(score({.kind = "exact", .field = "answer"}, " 42\n") == 1.0);
  CHECK(score({.kind = "exact", .field = "answer"}, "The answer is 42") == 0.0);
  CHECK(score({.kind = "exact", .field = "answer", .pattern = "<answer>(.*?)</answer>"}, "so <answer> 42 </answer>") ==
        1.0);
  CHECK(score({.kind = "exact", .field = "code", .ignore_case = true}, "lq-3red-chr") == 1.0);
  CHECK(score({.kind = "exact", .field = "code"}, "lq-3red-chr") == 0.0);
  CHECK(score({.kind = "exact", .field = "meta.city"}, "Paris") == 1.0);  // a dotted path
  // number: the last number written, commas between thousands ignored, within the tolerance
  CHECK(score({.kind = "number", .field = "answer"}, "6 x 7 = 42") == 1.0);
  CHECK(score({.kind = "number", .field = "answer"}, "42, or rather 41") == 0.0);
  CHECK(score({.kind = "number", .field = "total"}, "It costs 1,234.5 dollars.") == 1.0);
  CHECK(score({.kind = "number", .field = "total", .tolerance = 0.6}, "about 1234") == 1.0);
  CHECK(score({.kind = "number", .field = "total"}, "about 1234") == 0.0);
  CHECK(score({.kind = "number", .field = "gsm8k"}, "#### 42") == 1.0);  // GSM8K's "#### 42" answers
  CHECK(score({.kind = "number", .field = "answer"}, "no idea") == 0.0);
  CHECK(score({.kind = "number", .field = "answer", .pattern = R"(\\boxed\{(?<answer>[^}]*)\})"},
              "7 * 6 = 42, so \\boxed{42}. Check: 43") == 1.0);
  // regex: found anywhere; with a field, its answer compared
  CHECK(score({.kind = "regex", .pattern = "LQ-[0-9]"}, "code LQ-3RED") == 1.0);
  CHECK(score({.kind = "regex", .pattern = "LQ-[0-9]"}, "code lq-3red") == 0.0);
  CHECK(score({.kind = "regex", .pattern = "lq-[0-9]", .ignore_case = true}, "code LQ-3RED") == 1.0);
  CHECK(score({.kind = "regex", .field = "code", .pattern = R"(Code: (\S+))"}, "Code: LQ-3RED-CHR.") == 0.0);
  CHECK(score({.kind = "regex", .field = "code", .pattern = R"(Code: ([A-Z0-9-]+))"}, "Code: LQ-3RED-CHR.") == 1.0);
  // contains
  CHECK(score({.kind = "contains", .field = "meta.city"}, "I would go to Paris in May") == 1.0);
  CHECK(score({.kind = "contains", .field = "meta.city"}, "I would go to paris") == 0.0);
  CHECK(score({.kind = "contains", .field = "meta.city", .ignore_case = true}, "I would go to PARIS") == 1.0);
  // json: the completion or its first fenced block; keys required when named
  CHECK(score({.kind = "json"}, R"({"a": 1})") == 1.0);
  CHECK(score({.kind = "json"}, "Here:\n```json\n{\"a\": [1, 2]}\n```\nDone.") == 1.0);
  CHECK(score({.kind = "json"}, "{\"a\": 1") == 0.0);
  CHECK(score({.kind = "json", .keys = {"a", "b"}}, R"({"a": 1, "b": null})") == 1.0);
  CHECK(score({.kind = "json", .keys = {"a", "b"}}, R"({"a": 1})") == 0.0);
  CHECK(score({.kind = "json", .keys = {"a"}}, R"([1, 2])") == 0.0);
  // format: the whole completion, newlines included
  const std::string tags = R"(<think>.*?</think>\s*<answer>.*?</answer>)";
  CHECK(score({.kind = "format", .pattern = tags}, "<think>a\nb</think>\n<answer>42</answer>") == 1.0);
  CHECK(score({.kind = "format", .pattern = tags}, "<think>a</think><answer>42</answer> and more") == 0.0);
  // invalid UTF-8 (a completion cut inside a character) is scored, not an error
  CHECK(score({.kind = "regex", .pattern = "42"}, "42 \xe2\x82") == 1.0);
  // length: DAPO's soft punishment
  CHECK(score({.kind = "length", .max_tokens = 20, .cache = 5}, "", 15) == 0.0);
  CHECK(score({.kind = "length", .max_tokens = 20, .cache = 5}, "", 18) == Approx(-0.6));
  CHECK(score({.kind = "length", .max_tokens = 20, .cache = 5}, "", 21) == -1.0);
}

TEST_CASE("rewards: last_number reads the last number as written") {
  CHECK(*last_number("3 apples and -2.5e1 pears") == -25.0);
  CHECK(*last_number("1,234,567") == 1234567.0);
  CHECK(*last_number("v2") == 2.0);
  CHECK(!last_number("none here"));
  CHECK(!last_number(""));
}

TEST_CASE("rewards: a document the reward cannot read is a bad document, with the reason") {
  const Reward exact({.name = "answer", .kind = "exact", .field = "solution"}, "rewards[0]");
  CHECK(exact.check(kDoc) == "field 'solution' (reward answer) is missing");
  const Reward tags({.name = "t", .kind = "contains", .field = "tags"}, "rewards[0]");
  CHECK(tags.check(kDoc) == "field 'tags' (reward t) is a array, not a string or a number");
  const Reward number({.name = "n", .kind = "number", .field = "meta.city"}, "rewards[0]");
  CHECK(number.check(kDoc) == "field 'meta.city' (reward n) holds no number");
}

TEST_CASE("rewards: a recipe's mistakes are refused in one line naming the reward") {
  CHECK(refusal({.name = "x", .kind = "exactly"}) ==
        "rewards[1] (x): kind 'exactly' is not one of exact, number, regex, contains, json, format, length, command");
  CHECK(refusal({.name = "x", .kind = "exact"}) ==
        "rewards[1] (x): a exact reward compares with a field of the document: give it `field`");
  CHECK(refusal({.name = "x", .kind = "regex", .pattern = "(unclosed"}) ==
        "rewards[1] (x): pattern '(unclosed' does not compile: missing closing parenthesis at offset 9");
  CHECK(refusal({.name = "x", .kind = "format"}) == "rewards[1] (x): a format reward needs `pattern`");
  CHECK(refusal({.name = "x", .kind = "json", .field = "a"}) ==
        "rewards[1] (x): a json reward reads no field: remove `field`");
  CHECK(refusal({.name = "x", .kind = "contains", .field = "a", .keys = {"k"}}) ==
        "rewards[1] (x): `keys` is for a json reward, not contains");
  CHECK(refusal({.name = "x", .kind = "length", .max_tokens = 10, .cache = 11}) ==
        "rewards[1] (x): a length reward needs max_tokens >= 1 and 0 <= cache <= max_tokens (got 10 and 11)");
  CHECK(refusal({.name = "x", .kind = "number", .field = "a", .tolerance = -1}) ==
        "rewards[1] (x): tolerance must be a number >= 0");
}

TEST_CASE("rewards: think format and the soft overlong punishment equal TRL's own reward functions", "[reference]") {
  const std::vector<std::string> completions = {"<think>\nThis is my reasoning.\n</think>\nThis is my answer.",
                                                "<think>\nThis is my reasoning.\nThis is my answer.",
                                                "<think>a</think><think>b</think>x",
                                                "no tags",
                                                "<think></think>",
                                                " <think>a</think>b",
                                                "<think>\n</think>\n\n"};
  const std::vector<int64_t> lengths = {1, 14, 15, 16, 17, 18, 19, 20, 21, 40};
  const std::string dir = test::temp_dir("rewards");
  std::ofstream(dir + "/in.json") << nlohmann::json{{"completions", completions}, {"lengths", lengths}}.dump();
  const test::Oracle ref = test::oracle(
      fmt::format("'{}' -c \"import sys, json; sys.path.insert(0, '{}/tests/support'); from oracle import report; "
                  "from trl.rewards import think_format_reward, get_soft_overlong_punishment as p; "
                  "d = json.load(open('{}/in.json')); "
                  "report(think=think_format_reward([[{{'content': c}}] for c in d['completions']]), "
                  "length=p(20, 5)([[0] * n for n in d['lengths']]))\" 2>&1",
                  LORARUN_PYTHON, LORARUN_SOURCE_DIR, dir));
  INFO(ref.run.output);
  REQUIRE(ref.fields.contains("think"));
  // TRL's think_format_reward pattern, matched over the whole completion
  const Reward think({.name = "think", .kind = "format", .pattern = R"(<think>(?!.*<think>)(.*?)</think>.*)"}, "t");
  for (size_t i = 0; i < completions.size(); ++i) {
    INFO(completions[i]);
    CHECK(think.score(completions[i], 1, kDoc) == ref.fields["think"][i].get<double>());
  }
  const Reward length({.name = "length", .kind = "length", .max_tokens = 20, .cache = 5}, "l");
  for (size_t i = 0; i < lengths.size(); ++i)
    CHECK(length.score("", lengths[i], kDoc) == Approx(ref.fields["length"][i].get<double>()).margin(1e-12));
}
