// lora-eval: mean loss and perplexity of a base model (+ adapter) over JSONL documents,
// optionally the loss of every document, on the CPU or a GPU; --dump-logits writes the first
// batch's logits for reference checks (scripts/gpu-check compares them with transformers').
// With --recipe: the recipe's eval split (or its training documents), read and built exactly as
// lora-train reads them, on one rank or on N under lorarun (the ranks' sums are added).
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include <torch/cuda.h>

#include "app_main.hpp"
#include "data/example.hpp"
#include "data/source.hpp"
#include "dist/env.hpp"
#include "dist/process_group.hpp"
#include "io/files.hpp"
#include "model/lora.hpp"
#include "model/loss.hpp"
#include "model/resolve.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "model_args.hpp"
#include "recipe/recipe.hpp"
#include "tokenizer/tokenizer.hpp"
#include "train/agreement.hpp"
#include "train/evaluate.hpp"
#include "train/evaluation.hpp"
#include "train/job.hpp"
#include "train/objective.hpp"
#include "train/preference.hpp"
#include "train/runtime.hpp"

namespace {

using namespace lorarun;

// One document: `prompt` (not scored; empty without --prompt-field), then `text` (scored).
struct Document {
  std::string prompt, text;
};

std::vector<Document> read_documents(const std::string& path, const std::string& field,
                                     const std::string& prompt_field) {
  std::ifstream in(path);
  if (!in) throw Error(fmt::format("cannot read {}", path));
  std::vector<Document> docs;
  std::string line;
  auto string_field = [&](const nlohmann::json& j, const std::string& name, size_t n, const char* flag) {
    if (!j.is_object() || !j.contains(name) || !j[name].is_string())
      throw Error(fmt::format("{}:{}: not a JSON object with a string '{}' field ({})", path, n, name, flag));
    return j[name].get<std::string>();
  };
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    const auto j = nlohmann::json::parse(line, nullptr, false);
    Document d;
    if (!prompt_field.empty()) d.prompt = string_field(j, prompt_field, n, "--prompt-field");
    d.text = string_field(j, field, n, "--text-field");
    docs.push_back(std::move(d));
  }
  if (docs.empty()) throw Error(fmt::format("{} holds no documents", path));
  return docs;
}

// Each document's ids and how many of them (the prompt's) are not scored. The prompt is
// tokenized on its own, as training tokenizes a prompt template and its response.
std::vector<std::pair<std::vector<int32_t>, size_t>> tokenize(const tok::Tokenizer& tokenizer,
                                                              const std::vector<Document>& docs) {
  std::vector<std::string> prompts, texts;
  for (const Document& d : docs) {
    prompts.push_back(d.prompt);
    texts.push_back(d.text);
  }
  const bool prompted = std::any_of(docs.begin(), docs.end(), [](const Document& d) { return !d.prompt.empty(); });
  std::vector<std::vector<int32_t>> p = prompted ? tokenizer.encode_batch(prompts) : decltype(p)(docs.size());
  std::vector<std::vector<int32_t>> t = tokenizer.encode_batch(texts, /*add_special_tokens=*/!prompted);
  std::vector<std::pair<std::vector<int32_t>, size_t>> out;
  for (size_t i = 0; i < docs.size(); ++i) {
    p[i].insert(p[i].end(), t[i].begin(), t[i].end());
    out.emplace_back(std::move(p[i]), p[i].size() - t[i].size());
  }
  return out;
}

// The result line (or, with --json, one JSON object) both modes print.
void report(int64_t documents, int64_t tokens, double mean, int64_t skipped, bool as_json) {
  if (as_json) {
    fmt::print("{}\n", nlohmann::json{{"documents", documents},
                                      {"tokens", tokens},
                                      {"loss", mean},
                                      {"perplexity", std::exp(mean)},
                                      {"skipped", skipped}}
                           .dump());
    return;
  }
  fmt::print("documents {}, predicted tokens {}, mean loss {:.6f}, perplexity {:.4f}{}\n", documents, tokens, mean,
             std::exp(mean), skipped ? fmt::format(" ({} documents with no token to score skipped)", skipped) : "");
}

// A preference recipe's reference for the adapter `m` holds: lora.init_from's values (loaded over
// the adapter's, copied out, the adapter's put back), or none (the adapters off) without it.
std::vector<at::Tensor> reference_values(model::CausalLM& m, const recipe::Recipe& r) {
  if (r.lora.init_from.empty()) return {};
  c10::NoGradGuard no_grad;
  std::vector<at::Tensor> evaluated;
  for (const at::Tensor& p : model::lora_parameters(m)) evaluated.push_back(p.detach().clone());
  model::load_adapter(m, r.lora.init_from, evaluated.empty() ? at::kFloat : evaluated[0].scalar_type());
  const std::vector<at::Tensor> now = model::lora_parameters(m);
  bool same = now.size() == evaluated.size();
  for (size_t i = 0; same && i < now.size(); ++i) same = now[i].sizes() == evaluated[i].sizes();
  if (!same)
    throw Error(
        fmt::format("lora.init_from {} (the preference reference) adapts other layers or ranks than the "
                    "adapter evaluated: give the recipe its training run used",
                    r.lora.init_from));
  std::vector<at::Tensor> reference;
  for (size_t i = 0; i < now.size(); ++i) {
    reference.push_back(now[i].detach().clone());
    now[i].detach().copy_(evaluated[i]);
  }
  return reference;
}

// --recipe: what lora-eval needs besides the recipe.
struct RecipeEval {
  std::string recipe, adapter, split = "eval", per_doc, job_adapter;
  std::vector<std::string> overrides;
  bool as_json = false;
};

// The recipe's base model (model.path, dtype, device, QLoRA) with `adapter`, over its eval split
// or training documents, this rank's share; rank 0 prints the mean of all ranks' sums.
int eval_recipe(const RecipeEval& a) {
  const recipe::Recipe r = train::one_adapter(recipe::load_recipe(a.recipe, a.overrides), a.job_adapter, a.recipe);
  const dist::DistEnv env = dist::DistEnv::from_environment();
  if (env.world_size > 1 && !a.per_doc.empty())
    throw Error("--per-doc runs on one rank: drop it, or run lora-eval without lorarun");
  const bool eval_split = a.split == "eval";
  if (eval_split && !r.eval.enabled(r.data.source))
    throw Error(
        fmt::format("{} has no eval: split: set eval.fraction or {} (e.g. as an override), or give "
                    "--split train",
                    a.recipe, r.data.source == recipe::Source::MongoDB ? "eval.filter" : "eval.path"));
  if (!r.data.sources.empty() && !(eval_split && r.eval.fraction <= 0))
    throw Error(
        fmt::format("{} mixes data.sources, and lora-eval --recipe scores one selection: give it eval.filter with "
                    "eval.collection (or eval.path), or evaluate a source alone (data.sources=[] data.collection=…)",
                    a.recipe));
  train::Runtime rt(r, env, {.train = false, .adapter = a.adapter, .eval_split = eval_split});
  const data::Documents& docs = rt.data.eval ? rt.data.eval->docs() : *rt.data.docs;

  std::string lines;
  const auto per_doc = [&](const std::string& id, int64_t tokens, double loss) {
    lines += nlohmann::json{{"id", id}, {"tokens", tokens}, {"loss", loss / static_cast<double>(tokens)}}.dump() + "\n";
  };
  // The objective's own evaluation: a preference objective's pairs, or grpo's prompts completed
  // greedily and scored by its rewards (its ranks agree on each generation step: a process group).
  const bool grpo = r.train.objective == recipe::Objective::Grpo;
  if (r.train.objective != recipe::Objective::Sft && !a.per_doc.empty())
    throw Error(fmt::format("--per-doc scores documents, not {}: drop it", grpo ? "prompts" : "preference pairs"));
  std::optional<dist::ProcessGroup> pg;
  if (env.world_size > 1 || grpo)
    pg.emplace(env, dist::backend_of(r.dist.backend, train::uses_cuda(r)), std::chrono::seconds(r.dist.timeout_s));
  std::optional<train::Agreement> agree;
  std::unique_ptr<train::Objective> objective;
  std::optional<train::PreferenceObjective> pref;
  const train::Evaluation* by = nullptr;
  if (grpo) {
    agree.emplace(*pg, env.rank, env.world_size, rt.device);
    objective = train::make_objective(r, rt.model, model::lora_state(rt.model), *agree, rt.device, rt.tokenizer);
    by = objective->evaluation();
  } else if (r.train.objective != recipe::Objective::Sft) {
    by = &pref.emplace(r, rt.model, model::lora_state(rt.model), reference_values(rt.model, r));
  }
  const train::EvalSums mine = train::eval_shard(rt.model, docs, *rt.builder, r, env.rank, env.world_size, rt.device,
                                                 a.per_doc.empty() ? train::PerDocument{} : per_doc, {}, by);
  std::vector<double> all = {mine.loss, double(mine.tokens), double(mine.documents), double(mine.rejected)};
  all.insert(all.end(), mine.own.begin(), mine.own.end());
  at::Tensor sums = at::tensor(all, at::kDouble).to(rt.device);
  if (env.world_size > 1) {
    pg->all_reduce_sum(sums);
    pg->barrier();
  }
  sums = sums.cpu();
  const double* t = sums.data_ptr<double>();
  if (t[1] == 0)
    throw Error(fmt::format(
        "{} holds no token to score ({} of {} documents rejected: see data.max_length, "
        "data.overlong and the documents' fields)",
        rt.data.eval ? rt.data.eval->describe() : rt.data.docs->describe(), static_cast<int64_t>(t[3]), docs.size()));
  if (!a.per_doc.empty()) io::write_file_atomic(a.per_doc, lines);
  if (env.rank != 0) return 0;
  if (grpo) {  // the mean reward of the greedy completions and each reward's
    const nlohmann::json figures = by->figures(t + 4, "");
    nlohmann::json row = figures;
    row["prompts"] = static_cast<int64_t>(t[2]);
    row["skipped"] = static_cast<int64_t>(t[3]);
    if (a.as_json) {
      fmt::print("{}\n", row.dump());
    } else {
      std::string line =
          fmt::format("prompts {}, greedy completions scored by grpo.rewards", row["prompts"].get<int64_t>());
      for (const auto& [key, value] : figures.items())
        line += value.is_null() ? fmt::format(", {} null", key) : fmt::format(", {} {:.6f}", key, value.get<double>());
      fmt::print("{}{}\n", line, t[3] > 0 ? fmt::format(" ({} prompts skipped)", static_cast<int64_t>(t[3])) : "");
    }
    return 0;
  }
  if (pref) {  // the preference loss and TRL's figures
    const nlohmann::json figures = pref->figures(t + 4);
    nlohmann::json row = figures;
    row["loss"] = pref->loss_of(t + 4);
    const std::string what = pref->kto() ? "examples" : "pairs";
    row[what] = static_cast<int64_t>(t[4 + train::kPairs]);
    row["skipped"] = static_cast<int64_t>(t[3]);
    if (a.as_json) {
      fmt::print("{}\n", row.dump());
    } else {
      std::string line = fmt::format("{} {}, {} loss {:.6f}", what, row[what].get<int64_t>(),
                                     recipe::name(r.train.objective), row["loss"].get<double>());
      for (const auto& [key, value] : figures.items()) line += fmt::format(", {} {:.6f}", key, value.get<double>());
      fmt::print("{}{}\n", line, t[3] > 0 ? fmt::format(" ({} {} skipped)", static_cast<int64_t>(t[3]), what) : "");
    }
    return 0;
  }
  report(static_cast<int64_t>(t[2]), static_cast<int64_t>(t[1]), t[0] / t[1], static_cast<int64_t>(t[3]), a.as_json);
  return 0;
}

int run(int argc, char** argv) {
  CLI::App app{"lora-eval: loss and perplexity over JSONL documents, or over a recipe's eval split"};
  std::string data, field = "text", prompt_field, per_doc, dump_logits;
  int64_t max_length = 1024, batch_size = 8;
  bool as_json = false;
  ModelArgs model_args;
  RecipeEval recipe_eval;
  CLI::Option* model_opt = model_args.add_to(app);
  model_opt->required(false);
  CLI::Option* data_opt = app.add_option("--data", data, "JSONL file, one document per line");
  CLI::Option* recipe_opt =
      app.add_option("--recipe", recipe_eval.recipe,
                     "evaluate this recipe's eval split (or --split train) as lora-train builds it, with its model");
  app.add_option("--split", recipe_eval.split, "with --recipe: eval (the eval: section) or train (data's documents)")
      ->check(CLI::IsMember({"eval", "train"}))
      ->needs(recipe_opt);
  app.add_option("overrides", recipe_eval.overrides, "with --recipe: key=value overrides of recipe keys")
      ->needs(recipe_opt);
  app.add_option("--job-adapter", recipe_eval.job_adapter,
                 "with --recipe of many adapters (adapters:): evaluate this one's split (give its --adapter too)")
      ->needs(recipe_opt);
  app.add_flag("--json", as_json, "print the result as one JSON object (documents, tokens, loss, perplexity)");
  recipe_opt->excludes(model_opt)->excludes(data_opt);
  app.add_option("--text-field", field, "the field holding each document's text");
  app.add_option("--prompt-field", prompt_field,
                 "a field holding text that comes before --text-field's and is not scored (a prompt: the loss is "
                 "then the response's, as training measures it)");
  app.add_option("--max-length", max_length, "tokens per document (longer ones are truncated)")
      ->check(CLI::Range(2, 1 << 20));
  app.add_option("--batch-size", batch_size, "documents per forward pass")->check(CLI::Range(1, 4096));
  app.add_option("--per-doc", per_doc, "write {index, tokens, loss} of every document to this JSONL file");
  app.add_option("--device", model_args.device, "cpu, cuda or cuda:N");
  app.add_option("--dump-logits", dump_logits,
                 "write the first batch's input_ids, attention_mask [B, T] and logits [B, T, vocab] (fp32) to this "
                 ".safetensors file");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  model_args.pull_adapter();
  if (!recipe_eval.recipe.empty()) {
    recipe_eval.adapter = model_args.adapter;
    recipe_eval.per_doc = per_doc;
    recipe_eval.as_json = as_json;
    return eval_recipe(recipe_eval);
  }
  if (model_args.base.empty() || data.empty())
    throw Error("give --model and --data (JSONL documents), or --recipe R.yaml (its eval split)");
  const model::CausalLM m = model_args.load();
  const tok::Tokenizer tokenizer = model::load_tokenizer(m.dir());
  m.check_tokenizer(tokenizer);
  if (const auto limit = m.position_limit(); limit && !app.count("--max-length"))  // the default: what fits
    max_length = std::min(max_length, *limit);
  m.check_length(max_length, fmt::format("--max-length {}", max_length));
  std::vector<std::pair<std::vector<int32_t>, size_t>> docs =
      tokenize(tokenizer, read_documents(data, field, prompt_field));
  for (auto& [d, _] : docs)
    if (static_cast<int64_t>(d.size()) > max_length) d.resize(static_cast<size_t>(max_length));

  c10::NoGradGuard no_grad;
  std::string per_doc_lines;
  double loss_sum = 0;
  int64_t predicted = 0, skipped = 0;
  for (size_t start = 0; start < docs.size(); start += static_cast<size_t>(batch_size)) {
    const size_t end = std::min(docs.size(), start + static_cast<size_t>(batch_size));
    int64_t T = 0;
    for (size_t i = start; i < end; ++i) T = std::max<int64_t>(T, static_cast<int64_t>(docs[i].first.size()));
    at::Tensor ids = at::zeros({static_cast<int64_t>(end - start), T}, at::kLong);
    at::Tensor mask = at::zeros_like(ids);
    at::Tensor labels = at::full_like(ids, data::kIgnoreIndex);
    for (size_t i = start; i < end; ++i) {
      const auto& [doc, prompt] = docs[i];
      const auto n = static_cast<int64_t>(doc.size());
      if (n == 0) continue;
      const auto row = static_cast<int64_t>(i - start);
      const auto scored_from = std::min(n, static_cast<int64_t>(prompt));
      ids[row].narrow(0, 0, n).copy_(at::tensor(std::vector<int64_t>(doc.begin(), doc.end()), at::kLong));
      mask[row].narrow(0, 0, n).fill_(1);
      labels[row].narrow(0, scored_from, n - scored_from).copy_(ids[row].narrow(0, scored_from, n - scored_from));
    }
    const at::Tensor logits = m.forward(ids.to(m.device()), mask.to(m.device()));
    if (start == 0 && !dump_logits.empty())
      model::save_tensors(dump_logits,
                          {{"input_ids", ids}, {"attention_mask", mask}, {"logits", logits.to(at::kFloat)}});
    const at::Tensor losses = model::per_sequence_loss(logits, labels.to(m.device())).cpu();
    for (size_t i = start; i < end; ++i) {
      const auto& [doc, prompt] = docs[i];
      // Tokens that are predicted: all but the first, and none of the prompt's.
      const int64_t n = static_cast<int64_t>(doc.size()) - std::max<int64_t>(1, static_cast<int64_t>(prompt));
      if (n < 1) {
        ++skipped;
        continue;
      }
      const double loss = losses[static_cast<int64_t>(i - start)].item<double>();
      loss_sum += loss * static_cast<double>(n);
      predicted += n;
      per_doc_lines += nlohmann::json{{"index", i}, {"tokens", n}, {"loss", loss}}.dump() + "\n";
    }
  }
  if (predicted == 0)
    throw Error("no document has a token to score (two or more tokens, or one after its prompt): nothing to evaluate");
  const double mean = loss_sum / static_cast<double>(predicted);
  if (!per_doc.empty()) io::write_file_atomic(per_doc, per_doc_lines);
  report(static_cast<int64_t>(docs.size()) - skipped, predicted, mean, skipped, as_json);
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return lorarun::app_main("lora-eval", argc, argv, run); }
