#include "data/source.hpp"

#include <algorithm>
#include <fmt/format.h>
#include <fstream>

#include "data/mongo.hpp"
#include "data/shard.hpp"
#include "util/error.hpp"

namespace lorarun::data {

Documents::Documents(const recipe::DataSection& d, std::chrono::milliseconds timeout) : d_(d) {
  if (d.source == recipe::Source::Jsonl) {
    std::ifstream in(d.path);
    if (!in) throw Error(fmt::format("data.path {} cannot be read", d.path));
    for (std::string line; std::getline(in, line);)
      if (line.find_first_not_of(" \t\r") != std::string::npos) lines_.push_back(line);
    if (d.limit && static_cast<int64_t>(lines_.size()) > *d.limit) lines_.resize(static_cast<size_t>(*d.limit));
    if (lines_.empty()) throw Error(fmt::format("data.path {} holds no documents", d.path));
    return;
  }
  if (d.uri.empty()) throw Error("data.uri is empty: set it in the recipe or export LORARUN_MONGODB_URI");
  client_ = std::make_unique<Client>(d.uri, timeout);
  const auto names = client_->collections(d.database);
  if (std::find(names.begin(), names.end(), d.collection) == names.end())
    throw Error(fmt::format("collection '{}' does not exist in database '{}' at {}", d.collection, d.database,
                            client_->redacted_uri()));
  ids_ = client_->sorted_ids(d.database, d.collection, d.filter, d.limit);
  if (ids_.empty())
    throw Error(fmt::format("data.filter {} selects no document of {}.{}", d.filter.dump(), d.database, d.collection));
}

Documents::~Documents() = default;

int64_t Documents::size() const {
  return static_cast<int64_t>(client_ ? ids_.size() : lines_.size());
}

std::string Documents::describe() const {
  if (!client_) return d_.path;
  return fmt::format("{}.{} {}", d_.database, d_.collection, d_.filter.dump());
}

std::vector<nlohmann::json> Documents::fetch(const std::vector<int64_t>& positions) const {
  std::vector<nlohmann::json> out;
  if (!client_) {
    for (int64_t p : positions) out.push_back(nlohmann::json::parse(lines_[static_cast<size_t>(p)], nullptr, false));
    return out;
  }
  std::vector<std::string> ids;
  for (int64_t p : positions) ids.push_back(ids_[static_cast<size_t>(p)]);
  return client_->find_by_ids(d_.database, d_.collection, ids, {});
}

int64_t examples_per_rank(int64_t documents, int world) { return (documents + world - 1) / world; }

ShardReader::ShardReader(const Documents& docs, const ExampleBuilder& builder, const ShardSpec& s, int64_t start)
    : docs_(docs), builder_(builder) {
  const Order order = s.shuffle == recipe::Shuffle::None ? Order::Sorted : Order::Shuffled;
  order_ = shard_positions(docs.size(), s.world, s.rank, s.seed, s.epoch, order);
  fetched_ = static_cast<size_t>(std::clamp<int64_t>(start, 0, size()));
  delivered_ = static_cast<int64_t>(fetched_);
}

std::vector<Built> ShardReader::next(size_t n) {
  const auto t0 = std::chrono::steady_clock::now();
  std::vector<Built> out;
  while (out.size() < n && (next_ < buffer_.size() || fill())) out.push_back(std::move(buffer_[next_++]));
  delivered_ += static_cast<int64_t>(out.size());
  wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return out;
}

// Fetches the next chunk of this rank's order: one database round trip per 1,024 documents.
bool ShardReader::fill() {
  constexpr size_t kChunk = 1024;
  if (fetched_ >= order_.size()) return false;
  const size_t end = std::min(order_.size(), fetched_ + kChunk);
  const auto docs = docs_.fetch({order_.begin() + static_cast<std::ptrdiff_t>(fetched_),
                                 order_.begin() + static_cast<std::ptrdiff_t>(end)});
  buffer_.clear();
  for (const auto& d : docs) buffer_.push_back(builder_.build(d));
  fetched_ = end, next_ = 0;
  return !buffer_.empty();
}

}  // namespace lorarun::data
