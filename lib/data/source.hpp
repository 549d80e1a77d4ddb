// Where training documents come from (MongoDB or JSONL) and how one rank reads its shard of
// them for one epoch, built into examples ahead of the trainer.
#pragma once
#include <chrono>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <variant>
#include <vector>

#include "data/example.hpp"
#include "recipe/recipe.hpp"

namespace lorarun::data {

class Client;

// The selected documents, addressable by position 0..size()-1 in _id order (MongoDB) or file
// order (JSONL). Construction checks that the selection exists and is not empty.
class Documents {
 public:
  Documents(const recipe::DataSection& d, std::chrono::milliseconds timeout);
  ~Documents();
  int64_t size() const;
  // "db.collection {filter}" or the JSONL path, secrets scrubbed (for logs and run records).
  std::string describe() const;
  // The documents at these positions, in order (null where one vanished or is not JSON).
  std::vector<nlohmann::json> fetch(const std::vector<int64_t>& positions) const;

 private:
  const recipe::DataSection& d_;
  std::unique_ptr<Client> client_;
  std::vector<std::string> ids_;    // mongodb: canonical {"_id": …} per position
  std::vector<std::string> lines_;  // jsonl: one document per position
};

// Which shard of which epoch a reader delivers.
struct ShardSpec {
  int world = 1, rank = 0;
  uint64_t seed = 42;
  int64_t epoch = 0;
  recipe::Shuffle shuffle = recipe::Shuffle::Global;
};

// Examples per rank per epoch: equal on every rank (DistributedSampler's padding).
int64_t examples_per_rank(int64_t documents, int world);

using Built = std::variant<Example, Rejection>;

// One rank's documents for one epoch, from position `start` of its order on, fetched in chunks
// through its own cursor and built into examples.
class ShardReader {
 public:
  ShardReader(const Documents& docs, const ExampleBuilder& builder, const ShardSpec& spec, int64_t start = 0);
  // The next n documents' results in order; fewer (or none) at the end of the shard.
  std::vector<Built> next(size_t n);
  int64_t position() const { return delivered_; }  // documents delivered so far (incl. start)
  int64_t size() const { return static_cast<int64_t>(order_.size()); }
  double wait_seconds() const { return wait_s_; }  // time next() spent fetching/building

 private:
  bool fill();
  const Documents& docs_;
  const ExampleBuilder& builder_;
  std::vector<int64_t> order_;
  std::vector<Built> buffer_;
  size_t fetched_ = 0, next_ = 0;
  int64_t delivered_ = 0;
  double wait_s_ = 0;
};

}  // namespace lorarun::data
