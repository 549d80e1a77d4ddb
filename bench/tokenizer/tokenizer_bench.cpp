// tokenizer_bench: times lorarun's tokenizer on a corpus (one JSON string per line on stdin).
// Prints one JSON object: tokens, seconds single-threaded and batched (THREADS threads).
//   tokenizer_bench MODEL_DIR THREADS REPEAT < corpus.jsonl
#include <fmt/format.h>

#include <chrono>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "tokenizer/tokenizer.hpp"
#include "util/error.hpp"

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    fmt::print(stderr, "usage: tokenizer_bench MODEL_DIR THREADS REPEAT < corpus.jsonl\n");
    return 2;
  }
  try {
    auto t0 = std::chrono::steady_clock::now();
    auto tok = lorarun::tok::Tokenizer::from_dir(argv[1]);
    double load_s = seconds_since(t0);
    unsigned threads = static_cast<unsigned>(std::stoul(argv[2]));
    int repeat = std::stoi(argv[3]);
    std::vector<std::string> texts;
    for (std::string line; std::getline(std::cin, line);) texts.push_back(nlohmann::json::parse(line));

    size_t tokens = 0;
    t0 = std::chrono::steady_clock::now();
    for (int r = 0; r < repeat; ++r)
      for (const auto& t : texts) tokens += tok.encode(t, false).size();
    double single_s = seconds_since(t0);

    // A fresh instance, so that the batched run does not start with the first run's word cache.
    tok = lorarun::tok::Tokenizer::from_dir(argv[1]);
    t0 = std::chrono::steady_clock::now();
    size_t batch_tokens = 0;
    for (int r = 0; r < repeat; ++r)
      for (const auto& ids : tok.encode_batch(texts, false, threads)) batch_tokens += ids.size();
    double batch_s = seconds_since(t0);
    fmt::print(
        "{{\"tokens\": {}, \"single_s\": {:.4f}, \"batch_tokens\": {}, \"batch_s\": {:.4f}, \"load_s\": {:.3f}}}\n",
        tokens, single_s, batch_tokens, batch_s, load_s);
  } catch (const lorarun::Error& e) {
    fmt::print(stderr, "tokenizer_bench: error: {}\n", e.what());
    return 1;
  }
  return 0;
}
