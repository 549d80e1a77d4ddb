// Documents/s one rank's ShardReader fetches, renders and tokenizes from MongoDB (driven by
// bench/data/data_bench.py, which times pymongo + HF tokenizers on the same collection).
//   data_bench URI DB COLLECTION TOKENIZER_DIR [global|stream|none] [prefetch]
// Prints {"documents": n, "examples": e, "tokens": t, "seconds": s}.
#include <fmt/format.h>
#include <chrono>
#include <cstdio>
#include <string>

#include "data/source.hpp"
#include "tokenizer/tokenizer.hpp"
#include "util/error.hpp"

using namespace lorarun;

int main(int argc, char** argv) try {
  if (argc < 5) throw Error("usage: data_bench URI DB COLLECTION TOKENIZER_DIR [global|stream|none] [prefetch]");
  recipe::DataSection d;
  d.uri = argv[1];
  d.database = argv[2];
  d.collection = argv[3];
  d.prompt_template =
      "Below is an instruction that describes a task. Write a response that appropriately "
      "completes the request.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n";
  const std::string mode = argc > 5 ? argv[5] : "global";
  d.shuffle = recipe::Shuffle::Global;
  if (mode == "stream") d.shuffle = recipe::Shuffle::Stream;
  if (mode == "none") d.shuffle = recipe::Shuffle::None;
  d.prefetch = argc > 6 ? std::stoi(argv[6]) : 4;
  d.timeout_s = 30;
  const tok::Tokenizer tok = tok::Tokenizer::from_dir(argv[4]);
  const data::ExampleBuilder builder(d, tok);
  const auto t0 = std::chrono::steady_clock::now();
  const data::Documents docs(d);  // listing the ids is part of the work
  data::ShardReader reader(docs, builder, {1, 0, 42, 0, d.shuffle});
  int64_t n = 0, examples = 0, tokens = 0;
  for (auto batch = reader.next(64); !batch.empty(); batch = reader.next(64))
    for (const auto& b : batch) {
      ++n;
      if (const auto* e = std::get_if<data::Example>(&b)) {
        ++examples;
        tokens += static_cast<int64_t>(e->ids.size());
      }
    }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("{{\"documents\": {}, \"examples\": {}, \"tokens\": {}, \"seconds\": {}, \"wait_seconds\": {}}}\n", n,
             examples, tokens, s, reader.wait_seconds());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "data_bench: error: %s\n", e.what());
  return 1;
}
