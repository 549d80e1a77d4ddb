// Documents/s one rank's ShardReader fetches, renders and tokenizes from MongoDB (driven by
// bench/data/data_bench.py, which times pymongo + HF tokenizers on the same collection).
//   data_bench URI DB COLLECTION TOKENIZER_DIR [global|stream|none] [prefetch]
// COLLECTION may list several (a,b,c): then they are data.sources of weight 1 each, mixed.
// Prints {"documents": n, "examples": e, "tokens": t, "seconds": s}.
#include <fmt/format.h>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "data/mixture.hpp"
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
  recipe::Recipe r;  // several collections: data.sources
  r.data = d;
  for (size_t at = 0; d.collection.find(',') != std::string::npos && at <= d.collection.size();) {
    const size_t end = std::min(d.collection.find(',', at), d.collection.size());
    recipe::DataSource& s = r.data.sources.emplace_back();
    s.name = s.collection = d.collection.substr(at, end - at);
    at = end + 1;
  }
  if (!r.data.sources.empty()) r.data.collection.clear();
  const data::ExampleBuilder builder(d, tok);
  const auto t0 = std::chrono::steady_clock::now();
  // listing the ids (and, mixed, planning the epoch) is part of the work
  std::unique_ptr<data::Documents> docs;
  std::unique_ptr<data::Mixture> mix;
  std::unique_ptr<data::ShardReader> shard;
  const data::ShardSpec spec{1, 0, 42, 0, d.shuffle};
  if (r.data.sources.empty()) {
    docs = std::make_unique<data::Documents>(d);
    shard = std::make_unique<data::ShardReader>(*docs, builder, spec);
  } else {
    mix = std::make_unique<data::Mixture>(r, tok, data::PairTokens::Dpo, data::Holdout{});
    shard = std::make_unique<data::ShardReader>(*mix, spec);
  }
  data::ShardReader& reader = *shard;
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
