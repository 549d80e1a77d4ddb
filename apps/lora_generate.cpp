// lora-generate: look at what an adapter learned — continue a prompt, greedy or top-p.
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>

#include "app_main.hpp"
#include "io/files.hpp"
#include "model/generate.hpp"
#include "model/lora.hpp"
#include "model/resolve.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "model_args.hpp"
#include "tokenizer/tokenizer.hpp"
#include "util/log.hpp"

namespace {

using namespace lorarun;

int run(int argc, char** argv) {
  CLI::App app{"lora-generate: continue a prompt with a base model and optionally a LoRA adapter"};
  std::string prompt;
  model::GenerateOptions opt;
  bool ids_only = false, no_echo = false;
  ModelArgs model_args;
  model_args.add_to(app);
  std::string prompt_file;
  CLI::Option* text = app.add_option("--prompt", prompt, "text to continue");
  app.add_option("--prompt-file", prompt_file, "read the text to continue from this file (kept byte for byte)")
      ->excludes(text);
  app.add_option("--max-new-tokens", opt.max_new_tokens, "most tokens to generate")->check(CLI::Range(1, 1 << 20));
  app.add_option("--temperature", opt.temperature, "0 (default): greedy; > 0: sample")->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", opt.top_p, "nucleus sampling mass")->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", opt.seed, "sampling seed");
  app.add_flag("--ids", ids_only, "print the generated token ids as a JSON array instead of text");
  app.add_flag("--no-echo", no_echo, "print only the generated text, not the prompt before it");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  model_args.pull_adapter();
  if (!prompt_file.empty()) {
    prompt = io::read_file(prompt_file);
  } else if (!app.count("--prompt")) {
    throw Error("give the text to continue: --prompt TEXT or --prompt-file FILE");
  }
  const model::CausalLM m = model_args.load();
  const tok::Tokenizer tokenizer = model::load_tokenizer(m.dir());
  m.check_tokenizer(tokenizer);
  const std::vector<int32_t> p32 = tokenizer.encode(prompt);
  // A model with learned positions (opt, gpt2) stops where its table ends: say so before, keep
  // what fits.
  const auto prompt_tokens = static_cast<int64_t>(p32.size());
  m.check_length(prompt_tokens + 1, fmt::format("the prompt ({} tokens) and one new token", prompt_tokens));
  if (const auto limit = m.position_limit(); limit && prompt_tokens + opt.max_new_tokens > *limit) {
    warn(
        fmt::format("--max-new-tokens {} with a prompt of {} tokens passes the {} positions of {}: generating at "
                    "most {}",
                    opt.max_new_tokens, prompt_tokens, *limit, m.dir(), *limit - prompt_tokens));
    opt.max_new_tokens = *limit - prompt_tokens;
  }
  opt.eos_id = model::default_eos_id(m);
  if (!opt.eos_id && tokenizer.eos_id()) opt.eos_id = *tokenizer.eos_id();
  const std::vector<int64_t> out = model::generate(m, std::vector<int64_t>(p32.begin(), p32.end()), opt);
  if (ids_only) {
    fmt::print("[{}]\n", fmt::join(out, ","));
  } else {
    const std::vector<int32_t> o32(out.begin(), out.end());
    fmt::print("{}{}\n", no_echo ? "" : prompt, tokenizer.decode(o32, true));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return lorarun::app_main("lora-generate", argc, argv, run); }
