// lora-generate: look at what an adapter learned — continue a prompt, greedy or sampled (top-k, top-p).
#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/cuda.h>
#include <CLI/CLI.hpp>
#include <chrono>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>

#include "app_main.hpp"
#include "dist/env.hpp"
#include "dist/process_group.hpp"
#include "io/files.hpp"
#include "model/generate.hpp"
#include "model/lora.hpp"
#include "model/resolve.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "model_args.hpp"
#include "tokenizer/tokenizer.hpp"
#include "train/agreement.hpp"
#include "train/runtime.hpp"
#include "util/log.hpp"
#include "util/untrusted.hpp"

namespace {

using namespace lorarun;

// The prompts of a --prompts file: one JSON string a line (blank lines skipped).
std::vector<std::string> read_prompts(const std::string& path) {
  std::vector<std::string> prompts;
  std::istringstream lines(io::read_file(path));
  std::string line;
  for (int n = 1; std::getline(lines, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (!j.is_string())
      throw Error(fmt::format("--prompts {} line {}: not a JSON string; write one prompt a line, e.g. \"Hello\"",
                              printable(path), n));
    prompts.push_back(j.get<std::string>());
  }
  if (prompts.empty()) throw Error(fmt::format("--prompts {}: no prompts in it", printable(path)));
  return prompts;
}

// Every rank's completions (rank r's are prompts r, r + world, …), in prompt order; on one rank, `mine`.
std::vector<std::vector<int64_t>> gathered(std::vector<std::vector<int64_t>> mine, size_t prompts,
                                           const train::Agreement* agree) {
  if (!agree || agree->world() == 1) return mine;
  std::vector<double> flat;  // [length, ids…] a completion
  for (const auto& c : mine) {
    flat.push_back(static_cast<double>(c.size()));
    flat.insert(flat.end(), c.begin(), c.end());
  }
  const auto all = agree->gather(flat);
  std::vector<std::vector<int64_t>> out(prompts);
  for (size_t r = 0; r < all.size(); ++r)
    for (size_t at = 0, i = r; at < all[r].size(); i += all.size()) {
      const auto n = static_cast<size_t>(all[r][at++]);
      for (size_t k = 0; k < n; ++k) out[i].push_back(static_cast<int64_t>(all[r][at++]));
    }
  return out;
}

int run(int argc, char** argv) {
  CLI::App app{"lora-generate: continue a prompt with a base model and optionally a LoRA adapter"};
  std::string prompt;
  model::GenerateOptions opt;
  bool ids_only = false, no_echo = false, stats = false;
  ModelArgs model_args;
  model_args.add_to(app);
  std::string prompt_file, prompts_file;
  CLI::Option* text = app.add_option("--prompt", prompt, "text to continue");
  CLI::Option* file =
      app.add_option("--prompt-file", prompt_file, "read the text to continue from this file (kept byte for byte)")
          ->excludes(text);
  app.add_option("--prompts", prompts_file,
                 "a file of prompts, one JSON string a line, continued together in one batch: prints one JSON line "
                 "a prompt (its completion, or with --ids its ids)")
      ->excludes(text)
      ->excludes(file);
  app.add_option("--max-new-tokens", opt.max_new_tokens, "most tokens to generate")->check(CLI::Range(1, 1 << 20));
  model::Sampling& s = opt.sampling;
  uint64_t seed = 0;
  app.add_option("--temperature", s.temperature, "0 (default): greedy; > 0: sample")->check(CLI::NonNegativeNumber);
  app.add_option("--top-k", s.top_k, "sample from the k most likely tokens only (0: all)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--top-p", s.top_p, "nucleus sampling mass")->check(CLI::Range(0.0, 1.0));
  app.add_option("--seed", seed, "sampling seed (prompt i of --prompts draws from its own stream of it)");
  app.add_flag("--ids", ids_only, "print the generated token ids as a JSON array instead of text");
  app.add_flag("--no-echo", no_echo, "print only the generated text, not the prompt before it");
  app.add_flag("--stats", stats, "say on stderr how many tokens were generated, in how long");
  std::optional<int64_t> eos_id;
  app.add_option("--eos-id", eos_id, "end a completion at this id (default: the model's end-of-sequence id)");
  app.add_option("--device", model_args.device, "cpu, cuda (each rank its own) or cuda:N");
  bool shard_base = false;
  app.add_flag("--shard-base", shard_base,
               "under lorarun: each rank holds a slice of the base's linears, gathered as they are used "
               "(dist.shard_base); the ranks generate their shares of the prompts together");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  model_args.pull_adapter();
  std::vector<std::string> prompts;
  if (!prompts_file.empty()) {
    prompts = read_prompts(prompts_file);
  } else if (!prompt_file.empty()) {
    prompts = {io::read_file(prompt_file)};
  } else if (app.count("--prompt")) {
    prompts = {prompt};
  } else {
    throw Error("give the text to continue: --prompt TEXT, --prompt-file FILE or --prompts FILE");
  }
  // Under lorarun: prompt i is rank i % world's; rank 0 prints them all, in order.
  const dist::DistEnv env = dist::DistEnv::from_environment();
  const bool cuda = model_args.device.rfind("cuda", 0) == 0;
  if (model_args.device == "cuda" && env.world_size > 1 && torch::cuda::is_available())
    model_args.device = fmt::format("cuda:{}", env.local_rank % static_cast<int>(torch::cuda::device_count()));
  std::unique_ptr<dist::ProcessGroup> pg;
  if (env.world_size > 1 || shard_base)
    pg = std::make_unique<dist::ProcessGroup>(env, dist::backend_of(recipe::DistBackend::Auto, cuda),
                                              std::chrono::seconds(600));
  const model::CausalLM m =
      model_args.load(shard_base ? train::base_shards(true, env.rank, env.world_size, pg.get()) : nullptr);
  const tok::Tokenizer tokenizer = model::load_tokenizer(m.dir());
  m.check_tokenizer(tokenizer);
  std::vector<std::vector<int64_t>> ids;  // this rank's prompts
  std::vector<uint64_t> seeds;
  int64_t longest = 0;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const std::vector<int32_t> p32 = tokenizer.encode(prompts[i]);
    if (p32.empty()) throw Error(fmt::format("prompt {} has no tokens: give it some text", i + 1));
    longest = std::max(longest, static_cast<int64_t>(p32.size()));
    if (static_cast<int>(i % static_cast<size_t>(env.world_size)) != env.rank) continue;
    ids.emplace_back(p32.begin(), p32.end());
    seeds.push_back(model::completion_seed(seed, 0, i, 0));
  }
  // A model with learned positions (opt, gpt2) stops where its table ends: say so before, keep
  // what fits.
  m.check_length(longest + 1, fmt::format("the prompt ({} tokens) and one new token", longest));
  if (const auto limit = m.position_limit(); limit && longest + opt.max_new_tokens > *limit) {
    warn(
        fmt::format("--max-new-tokens {} with a prompt of {} tokens passes the {} positions of {}: generating at "
                    "most {}",
                    opt.max_new_tokens, longest, *limit, m.dir(), *limit - longest));
    opt.max_new_tokens = *limit - longest;
  }
  opt.eos_id = eos_id ? eos_id : model::default_eos_id(m);
  if (!opt.eos_id && tokenizer.eos_id()) opt.eos_id = *tokenizer.eos_id();
  std::optional<train::Agreement> agree;
  if (pg) agree.emplace(*pg, env.rank, env.world_size, m.device());
  if (m.passes_joined()) opt.any_running = [&](bool mine) { return agree->any(mine); };
  const auto start = std::chrono::steady_clock::now();
  const auto out = gathered(model::generate(m, ids, seeds, opt), prompts.size(), agree ? &*agree : nullptr);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (env.rank != 0) return 0;
  size_t tokens = 0;
  for (size_t i = 0; i < out.size(); ++i) {
    tokens += out[i].size();
    const std::string completion = tokenizer.decode(std::vector<int32_t>(out[i].begin(), out[i].end()), true);
    if (ids_only)
      fmt::print("[{}]\n", fmt::join(out[i], ","));
    else if (!prompts_file.empty())
      fmt::print("{}\n", nlohmann::json(completion).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace));
    else
      fmt::print("{}{}\n", no_echo ? "" : prompts[i], completion);
  }
  if (stats)
    fmt::print(stderr, "lora-generate: {} prompts, {} new tokens in {:.3f} s ({:.1f} tokens/s)\n", out.size(), tokens,
               seconds, static_cast<double>(tokens) / seconds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return lorarun::app_main("lora-generate", argc, argv, run); }
