#include "data/mixture.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cmath>
#include <numeric>

#include "data/mongo.hpp"
#include "data/shard.hpp"
#include "util/error.hpp"

namespace lorarun::data {
namespace {

constexpr int64_t kTokenSample = 1024;  // documents per source that mix_by: tokens measures
constexpr int64_t kCheckSample = 32;    // documents per source checked to make examples at all

uint64_t hash(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9e3779b97f4a7c15ULL + b + 0x2545f4914f6cdd1dULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

uint64_t name_hash(const std::string& name) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : name) h = (h ^ static_cast<unsigned char>(c)) * 0x100000001b3ULL;
  return h;
}

// Up to `most` documents of `s` spread evenly over it (the same on every rank): single documents
// by position, or with data.shuffle: stream (no id list) 32 evenly spaced runs.
std::vector<Found> sample(const MixSource& s, int64_t most) {
  const int64_t n = s.docs->size(), k = std::min(n, most);
  std::vector<Found> out;
  if (s.config->shuffle == recipe::Shuffle::Stream) {
    const int64_t runs = std::min<int64_t>(32, k);
    for (int64_t i = 0; i < runs; ++i)
      for (Found& f : s.docs->run(i * n / runs, "", k / runs, s.builder->fields())) out.push_back(std::move(f));
    return out;
  }
  for (int64_t at = 0; at < k; at += 256) {
    std::vector<int64_t> positions;
    for (int64_t i = at; i < std::min(k, at + 256); ++i) positions.push_back(i * n / k);
    for (Found& f : s.docs->fetch_found(positions, s.builder->fields())) out.push_back(std::move(f));
  }
  return out;
}

// Samples `s` (kTokenSample documents to weigh it by tokens, else kCheckSample): a source none of
// whose sampled documents makes an example (a file that is not JSONL, the wrong format keys) is
// refused before training. With `tokens`, the mean trained tokens per document of the sample
// (rejected documents do not count).
void sample_source(MixSource& s, bool tokens) {
  int64_t trained = 0, examples = 0;
  std::string first_reason;
  const std::vector<Found> found = sample(s, tokens ? kTokenSample : kCheckSample);
  for (const Found& f : found) {
    const Built b = build_found(*s.builder, f);
    if (const auto* e = std::get_if<Example>(&b)) {
      trained += trained_tokens(*e);
      ++examples;
    } else if (first_reason.empty()) {
      first_reason = std::get<Rejection>(b).reason;
    }
  }
  // (format: prompt: an example is a prompt, its tokens never trained)
  if ((s.builder->format() == recipe::Format::Prompt ? examples : trained) == 0)
    throw ConfigError(fmt::format(
        "data.sources '{}': none of the {} documents sampled from {} makes an example with a trained token ({}): "
        "fix the source or its format keys",
        s.spec.name, found.size(), s.docs->describe(), first_reason.empty() ? "no response" : first_reason));
  if (!tokens) return;
  s.sampled = examples;
  s.tokens_per_document = static_cast<double>(trained) / static_cast<double>(examples);
}

}  // namespace

std::vector<int64_t> apportion(int64_t total, const std::vector<double>& weights) {
  std::vector<int64_t> out(weights.size());
  if (weights.empty()) return out;
  const double top = *std::max_element(weights.begin(), weights.end());
  if (!(top > 0) || !std::isfinite(top) || total < 0)
    throw Error(fmt::format("cannot share {} documents by the weights given (the largest is {})", total, top));
  // Weights whose sum, or whose product with the total, overflows (1e308) are taken over the largest
  // first: each is then in [0, 1] and their sum at most their count. Others are used as they are, so
  // plans stay what they were.
  double scale = 1, sum = std::accumulate(weights.begin(), weights.end(), 0.0);
  if (!std::isfinite(sum) || !std::isfinite(static_cast<double>(total) * top)) {
    scale = top;
    sum = 0;
    for (const double w : weights) sum += w / scale;
  }
  std::vector<std::pair<double, size_t>> rest;
  int64_t given = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const double exact = std::min(static_cast<double>(total), static_cast<double>(total) * (weights[i] / scale) / sum);
    out[i] = static_cast<int64_t>(std::floor(exact));
    given += out[i];
    rest.emplace_back(exact - std::floor(exact), i);
  }
  std::stable_sort(rest.begin(), rest.end(), [](const auto& a, const auto& b) { return a.first > b.first; });
  for (size_t k = 0; given < total; ++k, ++given) ++out[rest[k % rest.size()].second];
  return out;
}

Mixture::Mixture(const recipe::Recipe& r, const tok::Tokenizer& tokenizer, PairTokens pairs, const Holdout& holdout,
                 const std::atomic<bool>* stop)
    : shuffle_(r.data.shuffle) {
  const recipe::DataSection& d = r.data;
  for (const recipe::DataSource& spec : d.sources) {
    MixSource& s = sources_.emplace_back();
    s.spec = spec;
    s.config = std::make_unique<recipe::DataSection>(d.of_source(spec));
    try {
      s.docs = std::make_unique<Documents>(*s.config, holdout);
      s.builder = std::make_unique<ExampleBuilder>(*s.config, tokenizer, std::nullopt, pairs, stop);
    } catch (const Error& e) {
      rethrow_within(e, fmt::format("data.sources '{}': ", spec.name));
    }
  }
  int64_t held = 0;
  for (const MixSource& s : sources_) held += s.docs->size();
  size_ = d.epoch_documents.value_or(held);
  std::vector<double> shares;
  for (MixSource& s : sources_) {
    sample_source(s, d.mix_by == recipe::MixBy::Tokens);
    shares.push_back(d.mix_by == recipe::MixBy::Tokens ? s.spec.weight / s.tokens_per_document : s.spec.weight);
  }
  const std::vector<int64_t> counts = apportion(size_, shares);
  for (size_t i = 0; i < sources_.size(); ++i) {
    sources_[i].per_epoch = counts[i];
    if (counts[i] == 0)
      throw ConfigError(fmt::format(
          "data.sources '{}' gets no document of an epoch of {}: its weight {:g} is too small a share; raise it or "
          "data.epoch_documents",
          sources_[i].spec.name, size_, sources_[i].spec.weight));
  }
}

Mixture::~Mixture() = default;

int64_t Mixture::per_rank(int world) const {
  if (shuffle_ != recipe::Shuffle::Stream) return examples_per_rank(size_, world);
  int64_t n = 0;
  for (const MixSource& s : sources_) n += examples_per_rank(s.per_epoch, world);
  return n;
}

// Source s's documents of `epoch`, in order (positions into its selection).
std::vector<int64_t> Mixture::sequence(size_t s, uint64_t seed, int64_t epoch) const {
  const int64_t n = sources_[s].docs->size(), want = sources_[s].per_epoch;
  const uint64_t key = hash(seed, name_hash(sources_[s].spec.name));
  const auto order = [&](uint64_t k, int64_t pass) {
    if (shuffle_ == recipe::Shuffle::Global) return permutation(n, k, pass);
    std::vector<int64_t> p(static_cast<size_t>(n));
    std::iota(p.begin(), p.end(), 0);
    return p;
  };
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(want));
  if (want <= n) {  // a window of one fixed order, moving on by `want` each epoch
    const std::vector<int64_t> base = order(key, 0);
    const int64_t start = (epoch % n) * want % n;  // (want <= n)
    for (int64_t j = 0; j < want; ++j) out.push_back(base[static_cast<size_t>((start + j) % n)]);
    return out;
  }
  for (int64_t pass = 0; static_cast<int64_t>(out.size()) < want; ++pass) {
    const std::vector<int64_t> p = order(hash(key, static_cast<uint64_t>(epoch) + 1), pass);
    out.insert(out.end(), p.begin(), p.begin() + std::min<int64_t>(n, want - static_cast<int64_t>(out.size())));
  }
  return out;
}

std::vector<Pick> Mixture::order(uint64_t seed, int64_t epoch) const {
  struct Placed {
    double at;
    Pick pick;
  };
  std::vector<Placed> all;
  all.reserve(static_cast<size_t>(size_));
  for (size_t s = 0; s < sources_.size(); ++s) {
    const std::vector<int64_t> seq = sequence(s, seed, epoch);
    const auto n = static_cast<double>(seq.size());
    const uint64_t key = hash(hash(seed, name_hash(sources_[s].spec.name)), static_cast<uint64_t>(epoch) ^ 0x5bd1e995);
    for (size_t j = 0; j < seq.size(); ++j) {
      const double u = shuffle_ == recipe::Shuffle::Global ? static_cast<double>(hash(key, j) >> 11) * 0x1.0p-53 : 0.5;
      all.push_back({(static_cast<double>(j) + u) / n, {static_cast<int32_t>(s), seq[j]}});
    }
  }
  std::stable_sort(all.begin(), all.end(), [](const Placed& a, const Placed& b) { return a.at < b.at; });
  std::vector<Pick> out;
  out.reserve(all.size());
  for (const Placed& p : all) out.push_back(p.pick);
  return out;
}

std::vector<Found> Mixture::fetch(const std::vector<Pick>& picks) const {
  std::vector<Found> out(picks.size());
  for (size_t s = 0; s < sources_.size(); ++s) {
    std::vector<int64_t> positions;
    std::vector<size_t> slots;
    for (size_t i = 0; i < picks.size(); ++i)
      if (picks[i].source == static_cast<int32_t>(s)) {
        positions.push_back(picks[i].position);
        slots.push_back(i);
      }
    if (positions.empty()) continue;
    std::vector<Found> found = sources_[s].docs->fetch_found(positions, sources_[s].builder->fields());
    for (size_t k = 0; k < found.size(); ++k) {
      found[k].source = static_cast<int32_t>(s);
      found[k].position = positions[k];
      out[slots[k]] = std::move(found[k]);
    }
  }
  return out;
}

nlohmann::json Mixture::identity() const {
  std::string text;
  for (const MixSource& s : sources_) {
    // the source's selection, not how it alone would be ordered: the mixture draws the order
    const nlohmann::json id = s.docs->identity();
    const nlohmann::json selection = {{"documents", id["documents"]}, {"digest", id["digest"]}};
    text += fmt::format("{}\n{}\n{}\n{}\n", s.spec.name, selection.dump(), s.per_epoch, s.spec.weight);
  }
  return {{"documents", size_}, {"digest", fmt::format("{:016x}", name_hash(text))}};
}

std::string Mixture::describe() const {
  std::string out = fmt::format("{} sources:", sources_.size());
  for (size_t i = 0; i < sources_.size(); ++i)
    out += fmt::format("{} {} ({}) {} of {} documents", i ? "," : "", sources_[i].spec.name,
                       sources_[i].docs->describe(), sources_[i].per_epoch, sources_[i].docs->size());
  return out;
}

void Mixture::measure_tokens() {
  for (MixSource& s : sources_)
    if (!s.sampled) sample_source(s, true);
}

nlohmann::json Mixture::plan() const {
  nlohmann::json out = nlohmann::json::array();
  for (const MixSource& s : sources_) {
    nlohmann::json j = {{"name", s.spec.name},
                        {"documents", s.docs->size()},
                        {"per_epoch", s.per_epoch},
                        {"repeats", std::max<int64_t>(0, s.per_epoch - s.docs->size())},
                        {"weight", s.spec.weight}};
    if (s.sampled) j["tokens_per_document"] = s.tokens_per_document;
    out.push_back(std::move(j));
  }
  return out;
}

}  // namespace lorarun::data
