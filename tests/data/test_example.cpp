// Examples from documents on real tokenizers: what is trained is exactly the response and EOS.
#include <catch2/catch.hpp>

#include "data/example.hpp"
#include "recipe/recipe.hpp"
#include "tokenizer/tokenizer.hpp"

using namespace lorarun;

namespace {

const std::string kTokenizers = LORARUN_TOKENIZER_FIXTURES;

recipe::DataSection instruction_cfg() {
  recipe::DataSection d;
  d.format = recipe::Format::Instruction;
  d.prompt_template = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";
  d.response_field = "output";
  return d;
}

std::vector<int32_t> trained(const data::Example& e) {
  std::vector<int32_t> out;
  for (int32_t l : e.labels)
    if (l != -100) out.push_back(l);
  return out;
}

}  // namespace

TEST_CASE("instruction examples train exactly the response and EOS") {
  const nlohmann::json doc = {
      {"instruction", "Add the numbers."}, {"input", "3 and 4 ☃"}, {"output", " 7, since 3 + 4 = 7."}};
  for (const std::string name : {"llama3", "llama2", "gpt2", "qwen3"}) {
    INFO(name);
    const auto tok = tok::Tokenizer::from_dir(kTokenizers + "/" + name);
    const auto cfg = instruction_cfg();
    const int32_t eos = tok.eos_id().value_or(0);
    const data::ExampleBuilder b(cfg, tok, eos);
    const auto e = std::get<data::Example>(b.build(doc));
    const std::string prompt = "### Instruction:\nAdd the numbers.\n\n### Input:\n3 and 4 ☃\n\n### Response:\n";
    std::vector<int32_t> want = tok.encode(prompt, true);
    const std::vector<int32_t> response = tok.encode(" 7, since 3 + 4 = 7.", false);
    want.insert(want.end(), response.begin(), response.end());
    want.push_back(eos);
    CHECK(e.ids == want);
    std::vector<int32_t> want_trained = response;
    want_trained.push_back(eos);
    CHECK(trained(e) == want_trained);
    std::vector<int32_t> body(want_trained.begin(), want_trained.end() - 1);
    CHECK(tok.decode(body) == " 7, since 3 + 4 = 7.");
    auto on_input = cfg;
    on_input.train_on_input = true;
    CHECK(trained(std::get<data::Example>(data::ExampleBuilder(on_input, tok, eos).build(doc))) == want);
  }
}

TEST_CASE("bad documents and overlong examples are rejected with the reason") {
  const auto tok = tok::Tokenizer::from_dir(kTokenizers + "/llama3");
  auto cfg = instruction_cfg();
  const data::ExampleBuilder b(cfg, tok);
  auto reason = [&](const nlohmann::json& doc) {
    auto r = b.build(doc);
    REQUIRE(std::holds_alternative<data::Rejection>(r));
    return std::get<data::Rejection>(r).reason;
  };
  CHECK(reason({{"input", "x"}, {"output", "y"}}) == "field 'instruction' is missing");
  CHECK(reason({{"instruction", 3}, {"input", "x"}, {"output", "y"}}) == "field 'instruction' is not a string");
  CHECK(reason({{"instruction", "a"}, {"input", "x"}, {"output", ""}}) == "field 'output' is empty");
  CHECK(reason({{"instruction", std::string("\xff\xfe")}, {"input", "x"}, {"output", "y"}}) ==
        "field 'instruction' is not valid UTF-8");
  cfg.max_length = 8;
  cfg.overlong = recipe::Overlong::Skip;
  const data::ExampleBuilder skip(cfg, tok);
  const auto r = skip.build({{"instruction", "a long instruction here"}, {"input", "x"}, {"output", "y"}});
  REQUIRE(std::holds_alternative<data::Rejection>(r));
  CHECK(std::get<data::Rejection>(r).kind == data::Rejection::Overlong);
  cfg.overlong = recipe::Overlong::Truncate;
  const data::ExampleBuilder cut(cfg, tok);
  // Truncation that leaves no response token is a bad document, not a silent empty example.
  const auto t = cut.build({{"instruction", "a long instruction here"}, {"input", "x"}, {"output", "y"}});
  REQUIRE(std::holds_alternative<data::Rejection>(t));
  CHECK(std::get<data::Rejection>(t).reason == "no token left to train on after truncation");
}

TEST_CASE("chat examples train only assistant turns, with their end-of-turn token") {
  const auto tok = tok::Tokenizer::from_dir(kTokenizers + "/qwen3");
  recipe::DataSection cfg;
  cfg.format = recipe::Format::Chat;
  cfg.chat_format = recipe::ChatFormat::ChatML;
  const nlohmann::json doc = {{"messages",
                               {{{"role", "system"}, {"content", "Be brief."}},
                                {{"role", "user"}, {"content", "Hi?"}},
                                {{"role", "assistant"}, {"content", "Hello."}}}}};
  const auto e = std::get<data::Example>(data::ExampleBuilder(cfg, tok).build(doc));
  CHECK(tok.decode(e.ids) ==
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n");
  CHECK(tok.decode(trained(e)) == "Hello.<|im_end|>\n");
}
