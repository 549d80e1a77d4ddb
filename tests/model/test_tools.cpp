// lora-eval and lora-generate against transformers + PEFT on the fixture models.
#include <fmt/format.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "support/oracle.hpp"

using namespace lorarun::test;

namespace {
const std::string kFixtures = LORARUN_MODEL_FIXTURES;

std::string check(const std::string& args) {
  return fmt::format("'{}' '{}/tests/reference/check.py' {}", LORARUN_PYTHON, LORARUN_SOURCE_DIR, args);
}
}  // namespace

TEST_CASE("lora-eval per-document losses equal transformers + PEFT's", "[e2e][reference]") {
  const std::string dir = temp_dir("eval");
  {
    std::ofstream data(dir + "/docs.jsonl");
    const char* texts[] = {"The quick brown fox jumps over the lazy dog.", "LoRA adapts a frozen layer.",
                           "Ünïcödé 🦊 0123456789 and a longer sentence that goes on and on to be truncated here", "x",
                           "Instruction: add two numbers. Response: 3 + 4 = 7"};
    for (const char* t : texts) data << nlohmann::json{{"text", t}}.dump() << "\n";
  }
  // One python reference run costs seconds: three cases cover base-only, adapters and families.
  for (const auto& [family, with_adapter] : {std::pair{"llama", true}, {"gpt2", true}, {"opt", false}}) {
    INFO(family);
    const std::string base = kFixtures + "/" + family;
    {
      const std::string adapter = with_adapter ? base + "/peft_adapter" : "-";
      const Result r =
          sh(fmt::format("{} --model {} {} --data {}/docs.jsonl --max-length 16 --batch-size 2 "
                         "--per-doc {}/losses.jsonl",
                         bin("lora-eval"), base, adapter == "-" ? "" : "--adapter " + adapter, dir, dir));
      INFO(r.output);
      REQUIRE(r.status == 0);
      CHECK_THAT(r.output, Catch::Contains("documents 4, predicted tokens"));  // "x" is one token: skipped
      const Result c = sh(check(fmt::format("eval {} {} {}/docs.jsonl 16 {}/losses.jsonl", base, adapter, dir, dir)));
      INFO(c.output);
      CHECK(c.status == 0);
    }
  }
}

// scripts/gpu-check compares these dumps with transformers on a GPU; here the same comparison
// (bench/gpu/bench.py ref-small) runs on the CPU, so the dump format and the check cannot drift.
TEST_CASE("lora-eval --dump-logits writes transformers' logits in bf16 and fp32", "[e2e][reference]") {
  const std::string dir = temp_dir("dump-logits");
  {
    std::ofstream data(dir + "/docs.jsonl");
    for (const char* t : {"The quick brown fox jumps over the lazy dog.", "LoRA adapts", "x y z 0123456789"})
      data << nlohmann::json{{"text", t}}.dump() << "\n";
  }
  const std::string base = kFixtures + "/llama";
  for (const char* dtype : {"bf16", "fp32"}) {
    const Result r =
        sh(fmt::format("{} --model {} --data {}/docs.jsonl --batch-size 3 --dtype {} --device cpu "
                       "--dump-logits {}/{}.safetensors",
                       bin("lora-eval"), base, dir, dtype, dir, dtype));
    INFO(r.output);
    REQUIRE(r.status == 0);
  }
  const Oracle c =
      oracle(fmt::format("'{}' '{}/bench/gpu/bench.py' ref-small --model {} --ours-bf16 {}/bf16.safetensors "
                         "--ours-fp32 {}/fp32.safetensors --device cpu",
                         LORARUN_PYTHON, LORARUN_SOURCE_DIR, base, dir, dir));
  INFO(c.run.output);
  REQUIRE(c.run.status == 0);
  const nlohmann::json rows = c.fields.value("rows", nlohmann::json::array());
  CHECK(rows.size() == 2);
  for (const auto& row : rows) CHECK(row.value("status", "") == "PASS");
}

TEST_CASE("lora-generate greedy ids equal transformers' generate", "[e2e][reference]") {
  for (const std::string family : {"llama", "gpt2", "opt", "qwen3", "gemma2", "gemma3", "phi3"}) {
    INFO(family);
    const std::string base = kFixtures + "/" + family;
    const Result r =
        sh(fmt::format("{} --model {} --adapter {}/peft_adapter --prompt 'The quick brown' "
                       "--max-new-tokens 12 --ids",
                       bin("lora-generate"), base, base));
    INFO(r.output);
    REQUIRE(r.status == 0);
    const std::string ids = r.output.substr(0, r.output.find('\n'));
    const Result c = sh(check(fmt::format("generate {} {}/peft_adapter 'The quick brown' 12 '{}'", base, base, ids)));
    INFO(c.output);
    CHECK(c.status == 0);
  }
}

TEST_CASE("lora-generate prints text and samples reproducibly", "[e2e]") {
  const std::string base = kFixtures + "/llama";
  const std::string cmd = fmt::format(
      "{} --model {} --prompt 'LoRA adapts' --max-new-tokens 8 --temperature 0.8 "
      "--top-p 0.9 --seed 3",
      bin("lora-generate"), base);
  const Result a = sh(cmd), b = sh(cmd);
  INFO(a.output);
  CHECK(a.status == 0);
  CHECK_THAT(a.output, Catch::StartsWith("LoRA adapts"));
  CHECK(a.output == b.output);
}

TEST_CASE("lora-generate --prompts continues a file of prompts in one batch, each as it would alone", "[e2e]") {
  const std::string base = kFixtures + "/llama", dir = temp_dir("generate-prompts");
  const std::vector<std::string> prompts = {"The quick brown", "LoRA", "a b c d e f g"};
  {
    std::ofstream f(dir + "/prompts.jsonl");
    for (const auto& p : prompts) f << nlohmann::json(p).dump() << "\n\n";  // blank lines are skipped
  }
  for (const char* sampling : {"", "--temperature 0.9 --top-k 20 --top-p 0.95 --seed 4"}) {
    INFO(sampling);
    const Result all = sh(fmt::format("{} --model {} --prompts {}/prompts.jsonl --max-new-tokens 8 --ids {}",
                                      bin("lora-generate"), base, dir, sampling));
    INFO(all.output);
    REQUIRE(all.status == 0);
    std::istringstream lines(all.output);
    std::string line;
    for (size_t i = 0; i < prompts.size(); ++i) {
      REQUIRE(std::getline(lines, line));
      if (*sampling && i > 0) continue;  // a sampled row draws from the stream of its place in the file
      const Result one = sh(fmt::format("{} --model {} --prompt '{}' --max-new-tokens 8 --ids {}", bin("lora-generate"),
                                        base, prompts[i], sampling));
      CHECK(one.output.substr(0, one.output.find('\n')) == line);
    }
  }
  std::ofstream(dir + "/bad.jsonl") << "\"fine\"\n{\"prompt\": \"not a string\"}\n";
  const Result bad = sh(fmt::format("{} --model {} --prompts {}/bad.jsonl", bin("lora-generate"), base, dir));
  CHECK(bad.status != 0);
  CHECK_THAT(bad.output, Catch::Contains("bad.jsonl line 2: not a JSON string"));
}

// Under lorarun each rank generates its share of the prompts (prompt i is rank i % world's) and rank
// 0 prints them all; with --shard-base every pass gathers the base from the ranks' slices, so a rank
// whose rows have ended (or that has none) joins the others' passes until they end.
TEST_CASE("lora-generate on 2 ranks, the base whole or sharded, prints the completions one process prints", "[e2e]") {
  const std::string base = kFixtures + "/llama", dir = temp_dir("generate-ranks");
  const auto write_prompts = [&](const std::string& name, const std::vector<std::string>& prompts) {
    std::ofstream f(dir + "/" + name);
    for (const auto& p : prompts) f << nlohmann::json(p).dump() << "\n";
  };
  write_prompts("five.jsonl", {"The quick brown", "LoRA", "a b c d e f g", "Hello world", "x"});
  write_prompts("two.jsonl", {"LoRA", "Hello"});
  // rank 0's lines, without the launcher's "[rank0]: "
  const auto lines = [](const std::string& output) {
    std::string out;
    std::istringstream in(output);
    for (std::string line; std::getline(in, line);)
      if (line.rfind("[rank0]: ", 0) == 0) out += line.substr(9) + "\n";
    return out;
  };
  const auto run = [&](int world, const std::string& args) {
    const std::string cmd = fmt::format("{} --model {} --max-new-tokens 8 --ids {}", bin("lora-generate"), base, args);
    const Result r =
        world == 1
            ? sh(cmd + " 2>/dev/null")
            : sh(fmt::format("timeout 300 {} --nproc-per-node {} -- {} 2>/dev/null", bin("lorarun"), world, cmd));
    INFO(r.output);
    REQUIRE(r.status == 0);
    return world == 1 ? r.output : lines(r.output);
  };
  const std::string sampled = fmt::format("--prompts {}/five.jsonl --temperature 0.9 --top-k 20 --seed 7", dir);
  const std::string one = run(1, sampled);
  CHECK(std::count(one.begin(), one.end(), '\n') == 5);
  CHECK(run(2, sampled) == one);
  CHECK(run(2, sampled + " --shard-base") == one);
  CHECK(run(3, sampled + " --shard-base") == one);  // ranks of 2, 2 and 1 prompts
  // Rank 0's one row ends at its first token (made the end-of-sequence id), rank 1's runs all 8.
  const std::string greedy = run(1, fmt::format("--prompts {}/two.jsonl", dir));
  const std::string eos = greedy.substr(1, greedy.find_first_of(",]") - 1);
  const std::string ended = run(1, fmt::format("--prompts {}/two.jsonl --eos-id {}", dir, eos));
  CHECK(ended.substr(0, ended.find('\n')) == "[" + eos + "]");
  const std::string second = ended.substr(ended.find('\n') + 1);
  CHECK(std::count(second.begin(), second.end(), ',') == 7);  // 8 ids: it ran on alone
  CHECK(run(2, fmt::format("--prompts {}/two.jsonl --eos-id {} --shard-base", dir, eos)) == ended);
}
