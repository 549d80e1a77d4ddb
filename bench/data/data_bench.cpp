// Documents/s one rank's ShardReader fetches, renders and tokenizes from MongoDB (driven by
// bench/data/data_bench.py, which times pymongo + HF tokenizers on the same collection, and by
// bench/data/scale_bench.py, which runs one per rank against collections of growing size).
//   data_bench URI DB COLLECTION TOKENIZER_DIR [global|stream|none] [prefetch] [KEY=VALUE…]
// COLLECTION may list several (a,b,c): then they are data.sources of weight 1 each, mixed.
// KEY=VALUE: world=W rank=R (the shard read, default 1 0), max=N (stop after N documents),
// eval_fraction=F (also hold out F of the selection as lora-train's eval.fraction does, with its
// overlap check, and count that in the start-up).
// Prints {"documents": n, "examples": e, "tokens": t, "seconds": s, "wait_seconds": w,
// "startup_seconds": until the first chunk is delivered, "order_anon_mib"/"order_file_mib": the
// resident memory (anonymous / file-backed) start-up added, "peak_rss_mib"}.
#include <fmt/format.h>
#include <malloc.h>
#include <chrono>
#include <climits>
#include <cstdio>
#include <fstream>
#include <memory>
#include <string>

#include "data/mixture.hpp"
#include "data/source.hpp"
#include "tokenizer/tokenizer.hpp"
#include "util/error.hpp"

using namespace lorarun;

namespace {

// This process's resident memory in KiB (/proc/self/status): anonymous, file-backed, peak.
struct Resident {
  double anon = 0, file = 0, peak = 0;
};
Resident resident() {
  Resident r;
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    double* to = line.starts_with("RssAnon:")   ? &r.anon
                 : line.starts_with("RssFile:") ? &r.file
                 : line.starts_with("VmHWM:")   ? &r.peak
                                                : nullptr;
    if (to) *to = std::stod(line.substr(line.find(':') + 1));
  }
  return r;
}

}  // namespace

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
  int world = 1, rank = 0;
  int64_t max = INT64_MAX;
  double eval_fraction = 0;
  for (int i = 7; i < argc; ++i) {
    const std::string a = argv[i];
    const size_t eq = a.find('=');
    const std::string key = a.substr(0, eq), value = eq == std::string::npos ? "" : a.substr(eq + 1);
    if (key == "world")
      world = std::stoi(value);
    else if (key == "rank")
      rank = std::stoi(value);
    else if (key == "max")
      max = std::stoll(value);
    else if (key == "eval_fraction")
      eval_fraction = std::stod(value);
    else
      throw Error(fmt::format("unknown option {}: world=, rank=, max= or eval_fraction=", a));
  }
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
  r.eval.fraction = eval_fraction;
  const data::ExampleBuilder builder(d, tok);
  malloc_trim(0);  // memory the tokenizer's load freed is given back, so what the order takes shows
  const Resident before = resident();
  const auto t0 = std::chrono::steady_clock::now();
  // listing the ids (and, mixed, planning the epoch) is part of the work
  std::unique_ptr<data::Documents> docs;
  std::unique_ptr<data::Mixture> mix;
  std::unique_ptr<data::ShardReader> shard;
  std::unique_ptr<data::EvalSplit> eval;
  const data::ShardSpec spec{world, rank, 42, 0, d.shuffle};
  if (r.data.sources.empty()) {
    docs = std::make_unique<data::Documents>(d, data::Holdout::training(eval_fraction));
    if (eval_fraction > 0) eval = std::make_unique<data::EvalSplit>(r, docs.get());
    shard = std::make_unique<data::ShardReader>(*docs, builder, spec);
  } else {
    mix = std::make_unique<data::Mixture>(r, tok, data::PairTokens::Dpo, data::Holdout{});
    shard = std::make_unique<data::ShardReader>(*mix, spec);
  }
  data::ShardReader& reader = *shard;
  int64_t n = 0, examples = 0, tokens = 0;
  double startup = -1;
  Resident started;
  for (auto batch = reader.next(64); !batch.empty() && n < max; batch = reader.next(64))
    for (const auto& b : batch) {
      if (startup < 0) {
        startup = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        started = resident();
      }
      ++n;
      if (const auto* e = std::get_if<data::Example>(&b)) {
        ++examples;
        tokens += static_cast<int64_t>(e->ids.size());
      }
    }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print(
      "{{\"documents\": {}, \"examples\": {}, \"tokens\": {}, \"seconds\": {}, \"wait_seconds\": {}, "
      "\"startup_seconds\": {}, \"order_anon_mib\": {:.1f}, \"order_file_mib\": {:.1f}, \"peak_rss_mib\": {:.1f}}}\n",
      n, examples, tokens, s, reader.wait_seconds(), startup, (started.anon - before.anon) / 1024.0,
      (started.file - before.file) / 1024.0, resident().peak / 1024.0);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "data_bench: error: %s\n", e.what());
  return 1;
}
