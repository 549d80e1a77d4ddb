// data.sources: several selections mixed by weight into one order per epoch, the same for any
// number of ranks, which the ranks shard as they shard one selection.
#pragma once
#include <atomic>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "data/example.hpp"
#include "data/source.hpp"
#include "recipe/recipe.hpp"
#include "tokenizer/tokenizer.hpp"

namespace lorarun::data {

// One document of a mixed epoch: which source, and its position in that source's selection.
struct Pick {
  int32_t source = 0;
  int64_t position = 0;
};

// One source of a mixture: its keys (data's, with its own selection and format keys), its
// documents (the training side of eval.fraction's split of them) and how they become examples.
struct MixSource {
  recipe::DataSource spec;
  std::unique_ptr<recipe::DataSection> config;  // (Documents and the builder refer to it)
  std::unique_ptr<Documents> docs;
  std::unique_ptr<ExampleBuilder> builder;
  int64_t per_epoch = 0;           // its documents in every epoch (repeats included)
  double tokens_per_document = 0;  // mean trained tokens of a sample of it (data.mix_by: tokens)
  int64_t sampled = 0;             // the documents that mean is over (0: not measured)
};

// The epoch of a mixture: E documents (data.epoch_documents, or all the sources hold), shared by
// the weights — of documents (mix_by: examples), or of trained tokens (mix_by: tokens: each
// source's documents in proportion to weight / its mean trained tokens per document, measured on
// up to 1,024 documents spread evenly over it: with stream, 32 runs of 32). A source's documents of epoch e:
//   fewer than it holds (n < N): n consecutive documents of one fixed order of it, from e·n on,
//     cyclically: none twice in an epoch, and every one within ceil(N / n) epochs;
//   more (n > N): passes over it, each pass a fresh order, so every document comes once before
//     any comes again.
// The order (shuffle: global) is a permutation per source drawn from (train.seed, its name); with
// shuffle: none, _id (or file) order; with shuffle: stream, sorted order from a position drawn
// from the seed, and no id list (ShardReader reads it in runs). The sources are interleaved smoothly: the j-th of n
// documents of a source takes the place (j + u) / n of the epoch, u drawn in [0, 1) (none: 1/2), so any stretch of the
// epoch holds each source near its share.
class Mixture {
 public:
  Mixture(const recipe::Recipe& r, const tok::Tokenizer& tokenizer, PairTokens pairs, const Holdout& holdout,
          const std::atomic<bool>* stop = nullptr);
  ~Mixture();
  const std::vector<MixSource>& sources() const { return sources_; }
  int64_t size() const { return size_; }  // documents per epoch
  // The documents a rank reads per epoch: ceil(size() / world); with data.shuffle: stream each
  // source's ceil(per_epoch / world), summed (ShardReader splits every source among the ranks).
  int64_t per_rank(int world) const;
  // The epoch's documents in order: size() picks, from (seed, epoch) alone (not with stream).
  std::vector<Pick> order(uint64_t seed, int64_t epoch) const;
  // The documents of `picks`, in order, each fetched with its source's fields (Found::source and
  // Found::position set).
  std::vector<Found> fetch(const std::vector<Pick>& picks) const;
  // What the mixture is, to tell later whether it changed: {"documents": E, "digest": …} of every
  // source's identity, name, weight and share.
  nlohmann::json identity() const;
  // "3 sources: tasks (db.tasks {…}) 1200 of 400 documents, …": for logs and run records.
  std::string describe() const;
  std::string server() const { return sources_.front().docs->server(); }
  // Per source: {name, documents (selected), per_epoch, repeats (per_epoch beyond the documents,
  // 0 when fewer), weight, tokens_per_document (mix_by: tokens)}: the planned epoch.
  nlohmann::json plan() const;
  // Measures tokens_per_document of the sources not measured yet (mix_by: examples leaves them).
  void measure_tokens();

 private:
  std::vector<int64_t> sequence(size_t s, uint64_t seed, int64_t epoch) const;
  std::vector<MixSource> sources_;
  recipe::Shuffle shuffle_;
  int64_t size_ = 0;
};

// `total` shared in proportion to `weights` (largest remainders; ties to the earlier), summing to
// `total` exactly.
std::vector<int64_t> apportion(int64_t total, const std::vector<double>& weights);

}  // namespace lorarun::data
