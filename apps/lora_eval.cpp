// lora-eval: mean loss and perplexity of a base model (+ adapter) over JSONL documents,
// optionally the loss of every document, on the CPU or a GPU; --dump-logits writes the first
// batch's logits for reference checks (scripts/gpu-check compares them with transformers').
#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <CLI/CLI.hpp>
#include <cmath>
#include <fstream>
#include <nlohmann/json.hpp>

#include "app_main.hpp"
#include "data/example.hpp"
#include "io/files.hpp"
#include "model/lora.hpp"
#include "model/loss.hpp"
#include "model/resolve.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "model_args.hpp"
#include "tokenizer/tokenizer.hpp"

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

int run(int argc, char** argv) {
  CLI::App app{"lora-eval: loss and perplexity over JSONL documents"};
  std::string data, field = "text", prompt_field, per_doc, dump_logits;
  int64_t max_length = 1024, batch_size = 8;
  ModelArgs model_args;
  model_args.add_to(app);
  app.add_option("--data", data, "JSONL file, one document per line")->required();
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
  const model::CausalLM m = model_args.load();
  const tok::Tokenizer tokenizer = model::load_tokenizer(m.dir());
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
  fmt::print("documents {}, predicted tokens {}, mean loss {:.6f}, perplexity {:.4f}{}\n", docs.size() - skipped,
             predicted, mean, std::exp(mean),
             skipped ? fmt::format(" ({} documents with no token to score skipped)", skipped) : "");
  return 0;
}

}  // namespace

int main(int argc, char** argv) { return lorarun::app_main("lora-eval", argc, argv, run); }
