#include "data/source.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <unordered_map>
#include <unordered_set>

#include "data/mixture.hpp"
#include "data/mongo.hpp"
#include "data/shard.hpp"
#include "util/error.hpp"
#include "util/input_file.hpp"

namespace lorarun::data {

// ---------------------------------------------------------------------------------- Documents

namespace {

// The selection's query refused by the server: the message names data.filter (a permission the
// user lacks passes through as the server put it).
template <class F>
auto selecting(const recipe::DataSection& d, const Client& c, F request) {
  try {
    return request();
  } catch (const ServerError& e) {
    if (e.code == 13) throw;
    std::string_view reason = e.reason;
    while (!reason.empty() && (reason.back() == '.' || reason.back() == ' ')) reason.remove_suffix(1);
    throw Error(fmt::format("data.filter {} was rejected by MongoDB at {}: {}: fix data.filter", d.filter.dump(),
                            c.redacted_uri(), reason));
  }
}

void check_collection(const recipe::DataSection& d, Client& c) {
  const auto names = c.collections(d.database);
  if (std::find(names.begin(), names.end(), d.collection) == names.end())
    throw Error(
        fmt::format("collection '{}' does not exist in database '{}' at {}: check data.database and "
                    "data.collection",
                    d.collection, d.database, c.redacted_uri()));
}

void check_not_empty(const recipe::DataSection& d, const Client& c, int64_t n) {
  if (n == 0)
    throw Error(fmt::format("data.filter {} selects no document of {}.{} at {}: fix data.filter", d.filter.dump(),
                            d.database, d.collection, c.redacted_uri()));
}

std::unique_ptr<Client> connect(const recipe::DataSection& d) {
  if (d.uri.empty()) throw Error("data.uri is empty: set it in the recipe or export LORARUN_MONGODB_URI");
  return std::make_unique<Client>(d.uri, std::chrono::seconds(d.timeout_s), Origin{"data.uri", "data.timeout_s"});
}

// A JSONL line as one canonical text: parsed and written back (keys sorted, no spaces), or as it
// is, trailing whitespace cut, when it is not JSON.
std::string canonical_line(const std::string& line) {
  const nlohmann::json j = nlohmann::json::parse(line, nullptr, false);
  if (!j.is_discarded()) return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return line.substr(0, line.find_last_not_of(" \t\r") + 1);
}

}  // namespace

bool held_out(std::string_view key, double fraction) {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (const char c : key) {
    h ^= static_cast<unsigned char>(c);
    h *= 0x100000001b3ULL;
  }
  return static_cast<double>(h >> 11) * 0x1.0p-53 < fraction;
}

Documents::Documents(const recipe::DataSection& d, const Holdout& holdout) : d_(d), holdout_(holdout) {
  if (d.source == recipe::Source::Jsonl) {
    // the key that named the file: eval.path for an eval split of its own
    const char* key = holdout_.eval && holdout_.fraction <= 0 ? "eval.path" : "data.path";
    std::unique_ptr<std::FILE, int (*)(std::FILE*)> in(fdopen(open_input(d.path, key), "r"), &std::fclose);
    if (!in) throw ConfigError(fmt::format("{} {} cannot be read: {}", key, d.path, std::strerror(errno)));
    char* buf = nullptr;
    size_t cap = 0;
    for (ssize_t n; (n = getline(&buf, &cap, in.get())) >= 0;) {
      std::string line(buf, static_cast<size_t>(n));
      if (!line.empty() && line.back() == '\n') line.pop_back();
      if (line.find_first_not_of(" \t\r") != std::string::npos) lines_.push_back(std::move(line));
    }
    std::free(buf);
    if (std::ferror(in.get()))
      throw ConfigError(fmt::format("{} {} cannot be read: {}", key, d.path, std::strerror(errno)));
    if (d.limit && static_cast<int64_t>(lines_.size()) > *d.limit) lines_.resize(static_cast<size_t>(*d.limit));
    std::erase_if(lines_, [&](const std::string& line) { return !keep(line); });
    if (holdout_.max && static_cast<int64_t>(lines_.size()) > *holdout_.max)
      lines_.resize(static_cast<size_t>(*holdout_.max));
    if (lines_.empty() && holdout_.fraction <= 0)
      throw ConfigError(fmt::format("{} {} holds no documents", key, d.path));
    if (lines_.empty())
      throw EmptySplit(
          holdout_.eval ? fmt::format("eval.fraction {} holds out no document of data.path {}: raise eval.fraction",
                                      holdout_.fraction, d.path)
                        : fmt::format("eval.fraction {} holds out every document of data.path {}: lower eval.fraction",
                                      holdout_.fraction, d.path));
    size_ = static_cast<int64_t>(lines_.size());
    return;
  }
  client_ = connect(d);
  check_collection(d, *client_);
  if (d.shuffle == recipe::Shuffle::Stream) {  // never the whole id list
    size_ = selecting(d, *client_, [&] { return client_->count(d.database, d.collection, d.filter, d.limit); });
  } else {
    selecting(d, *client_, [&] { list_ids(); });
    size_ = static_cast<int64_t>(ids_.size());
  }
  if (size_ == 0 && holdout_.fraction > 0)
    throw EmptySplit(fmt::format("eval.fraction {} {} of data.filter {}'s documents: {} eval.fraction",
                                 holdout_.fraction, holdout_.eval ? "holds out none" : "holds out every one",
                                 d.filter.dump(), holdout_.eval ? "raise" : "lower"));
  check_not_empty(d, *client_, size_);
}

Selection check_selection(const recipe::DataSection& d) {
  Selection s;
  if (d.uri.empty()) {
    s.warning = "could not check data.filter: data.uri is empty (set it in the recipe or export LORARUN_MONGODB_URI)";
    return s;
  }
  try {
    const std::unique_ptr<Client> c = connect(d);
    s.count = selecting(d, *c, [&] { return c->count(d.database, d.collection, d.filter, d.limit); });
    selecting(d, *c,
              [&] { c->find_sorted(d.database, d.collection, d.filter, "", 0, 1, ExampleBuilder::fields_of(d)); });
    if (s.count == 0)
      s.warning = fmt::format(
          "data.filter {} selects no document of {}.{} at {} (or the collection does not exist yet): "
          "training would stop there",
          d.filter.dump(), d.database, d.collection, c->redacted_uri());
  } catch (const ConnectionError& e) {
    s.warning = fmt::format("could not check data.filter: {}", e.what());
  }
  return s;
}

FieldValues field_values(const recipe::DataSection& d, const std::string& field) {
  const std::unique_ptr<Client> c = connect(d);
  check_collection(d, *c);
  FieldValues out;
  out.values = selecting(d, *c, [&] { return c->distinct(d.database, d.collection, field, d.filter); });
  const auto where = [&](const nlohmann::json& q) {
    return c->count(d.database, d.collection, d.filter.empty() ? q : nlohmann::json{{"$and", {d.filter, q}}});
  };
  out.missing = where({{field, {{"$exists", false}}}});
  // ($type 4 is "array"; written as {"$numberInt": "4"}: libbson reads a bare "$type" as a legacy binary's)
  out.arrays = where({{field, {{"$type", {{"$numberInt", "4"}}}}}});
  return out;
}

namespace {
// How libbson writes an ObjectId _id as canonical extended JSON, around its 24 hex digits.
constexpr std::string_view kOidHead = R"({ "_id" : { "$oid" : ")", kOidTail = R"(" } })";
constexpr std::string_view kHex = "0123456789abcdef";
}  // namespace

void IdList::push_back(std::string_view id) {
  const std::string_view hex = id.substr(std::min(id.size(), kOidHead.size()), 24);
  const bool oid = !texts_ && id.size() == kOidHead.size() + 24 + kOidTail.size() && id.starts_with(kOidHead) &&
                   id.ends_with(kOidTail) && hex.find_first_not_of(kHex) == std::string_view::npos;
  if (oid) {
    if (oids_ % kBlock == 0) blocks_.emplace_back().reserve(12 * kBlock);
    for (size_t k = 0; k < 24; k += 2)
      blocks_.back().push_back(static_cast<char>(kHex.find(hex[k]) * 16 + kHex.find(hex[k + 1])));
    ++oids_;
    return;
  }
  if (!texts_) {  // the first id that is not an ObjectId: every id becomes a text
    for (size_t i = 0; i < oids_; ++i) {
      const std::string text = (*this)[i];
      offsets_.push_back(text_.size());
      text_ += text;
    }
    texts_ = true;
    std::vector<std::string>().swap(blocks_);
  }
  offsets_.push_back(text_.size());
  text_.append(id);
}

std::string IdList::operator[](size_t i) const {
  if (texts_) {
    const size_t end = i + 1 < offsets_.size() ? offsets_[i + 1] : text_.size();
    return text_.substr(offsets_[i], end - offsets_[i]);
  }
  std::string out(kOidHead);
  for (size_t k = 0; k < 12; ++k) {
    const auto b = static_cast<unsigned char>(blocks_[i / kBlock][i % kBlock * 12 + k]);
    out += kHex[b >> 4];
    out += kHex[b & 15];
  }
  return out += kOidTail;
}

void IdList::shrink_to_fit() {
  if (!blocks_.empty()) blocks_.back().shrink_to_fit();
  text_.shrink_to_fit();
  offsets_.shrink_to_fit();
}

Documents::~Documents() = default;

// Called with mu_ held (or from the constructor).
void Documents::list_ids() const {
  if (listed_) return;
  // with eval.fraction, the first eval.max_documents ids this side keeps
  const bool capped = holdout_.fraction > 0 && holdout_.max;
  IdList ids;  // ids_ only once whole: a listing cut short by a lost server is retried from scratch
  client_->sorted_ids(d_.database, d_.collection, d_.filter, d_.limit, [&](const std::string& id) {
    if (keep(id) && !(capped && static_cast<int64_t>(ids.size()) >= *holdout_.max)) ids.push_back(id);
  });
  ids.shrink_to_fit();
  ids_ = std::move(ids);
  listed_ = true;
  if (size_ && static_cast<int64_t>(ids_.size()) != size_)
    throw Error(fmt::format("{}.{} changed while training ({} documents, then {}): keep the selection fixed",
                            d_.database, d_.collection, size_, ids_.size()));
}

std::string Documents::describe() const {
  if (!client_) return d_.path;
  return fmt::format("{}.{} {}", d_.database, d_.collection, d_.filter.dump());
}

nlohmann::json Documents::identity() const {
  // (a streamed selection's ids may get listed later, by fetch(): its identity is its count alone)
  const auto digest = [](const auto& keys) {
    uint64_t h = 0xcbf29ce484222325ULL;
    const auto add = [&h](unsigned char c) { h = (h ^ c) * 0x100000001b3ULL; };
    for (size_t i = 0; i < keys.size(); ++i) {
      for (const char c : keys[i]) add(static_cast<unsigned char>(c));
      add('\n');
    }
    return fmt::format("{:016x}", h);
  };
  const nlohmann::json d = !client_                                ? nlohmann::json(digest(lines_))
                           : d_.shuffle == recipe::Shuffle::Stream ? nlohmann::json(nullptr)
                                                                   : nlohmann::json(digest(ids_));
  nlohmann::json out = {{"documents", size_}, {"digest", d}};
  if (d_.shuffle == recipe::Shuffle::Global) out["order"] = "keyed";
  return out;
}

std::string Documents::server() const { return client_ ? "MongoDB at " + client_->redacted_uri() : d_.path; }

std::vector<Document> Documents::fetch(const std::vector<int64_t>& positions) const {
  std::vector<Document> out;
  for (Found& f : fetch_found(positions, {})) out.push_back(std::move(f.doc));
  return out;
}

std::vector<Found> Documents::fetch_found(const std::vector<int64_t>& positions,
                                          const std::vector<std::string>& fields) const {
  std::vector<Found> out;
  if (!client_) {
    for (int64_t p : positions) {
      Found& f = out.emplace_back();
      f.id = fmt::format("#{}", p);
      f.doc = Document::parse(lines_[static_cast<size_t>(p)], nullptr, false);
    }
    return out;
  }
  std::lock_guard lock(mu_);
  list_ids();
  std::vector<std::string> ids;
  for (int64_t p : positions) ids.emplace_back(ids_[static_cast<size_t>(p)]);
  return client_->find_by_ids(d_.database, d_.collection, ids, fields);
}

std::vector<Found> Documents::run(int64_t pos, const std::string& after, int64_t n,
                                  const std::vector<std::string>& fields) const {
  if (!client_) {
    std::vector<int64_t> positions;
    for (int64_t p = pos; p < std::min(pos + n, size_); ++p) positions.push_back(p);
    return fetch_found(positions, fields);
  }
  std::lock_guard lock(mu_);
  return client_->find_sorted(d_.database, d_.collection, d_.filter, after, pos, n, fields);
}

std::optional<std::string> Documents::shared_with(const Documents& other) const {
  if (!client_ && !other.client_) {  // the same document, however it was written (spacing, key order, CRLF)
    std::unordered_map<std::string, size_t> mine;
    for (size_t i = 0; i < lines_.size(); ++i) mine.emplace(canonical_line(lines_[i]), i);
    for (size_t i = 0; i < other.lines_.size(); ++i)
      if (const auto it = mine.find(canonical_line(other.lines_[i])); it != mine.end())
        return fmt::format("document #{} (document #{} of {})", i, it->second, d_.path);
    return std::nullopt;
  }
  if (!client_ || !other.client_ || d_.database != other.d_.database || d_.collection != other.d_.collection)
    return std::nullopt;
  if (d_.shuffle == recipe::Shuffle::Stream) {  // never listed: ask the server for one in both
    const nlohmann::json both = {{"$and", {d_.filter, other.d_.filter}}};
    std::lock_guard lock(mu_);
    const std::vector<Found> one = client_->find_sorted(d_.database, d_.collection, both, "", 0, 1, {"_id"});
    if (one.empty()) return std::nullopt;
    return "_id " + relaxed_id(one[0].id);
  }
  std::scoped_lock lock(mu_, other.mu_);
  list_ids();
  other.list_ids();
  // a set of the smaller list's ids, the other one walked (eval splits are usually the smaller)
  const IdList& small = ids_.size() <= other.ids_.size() ? ids_ : other.ids_;
  const IdList& large = &small == &ids_ ? other.ids_ : ids_;
  std::unordered_set<std::string> in_small;
  for (size_t i = 0; i < small.size(); ++i) in_small.insert(small[i]);
  for (size_t i = 0; i < large.size(); ++i)
    if (std::string id = large[i]; in_small.count(id)) return "_id " + relaxed_id(id);
  return std::nullopt;
}

namespace {

// The eval key a recipe selects its evaluation documents with.
std::string eval_key(const recipe::Recipe& r) {
  if (r.eval.fraction > 0) return "eval.fraction";
  if (r.data.source == recipe::Source::Jsonl) return "eval.path";
  return r.eval.filter.empty() ? "eval.collection" : "eval.filter";
}

}  // namespace

EvalSplit::EvalSplit(const recipe::Recipe& r, const Documents* train, const recipe::DataSection* data)
    : key_(eval_key(r)), data_(data ? *data : r.data), fraction_(r.eval.fraction) {
  const recipe::EvalSection& e = r.eval;
  data_.shuffle = recipe::Shuffle::None;  // every id listed, in position order
  if (fraction_ <= 0) {
    if (data_.source == recipe::Source::MongoDB) {
      data_.filter = e.filter;
      if (!e.collection.empty()) data_.collection = e.collection;
    } else {
      data_.path = e.path;
    }
    data_.limit = e.max_documents;
  }
  try {
    docs_ = std::make_unique<Documents>(data_, Holdout{.fraction = fraction_, .eval = true, .max = e.max_documents});
  } catch (const Error& err) {
    if (std::string_view(err.what()).starts_with("eval.")) throw;
    throw Error(fmt::format("the evaluation documents ({}): {}", key_, err.what()));
  }
  if (train) refuse_overlap(*train);
}

void EvalSplit::refuse_overlap(const Documents& train) const {
  if (const std::optional<std::string> both = train.shared_with(*docs_))
    throw Error(fmt::format(
        "{} selects {}, which training reads too ({}): evaluation documents are never trained on; make the "
        "selections disjoint (e.g. data.filter {{split: train}}, eval.filter {{split: eval}}) or use eval.fraction",
        describe(), *both, train.describe()));
}

std::string EvalSplit::describe() const {
  if (fraction_ > 0) return fmt::format("eval.fraction {} of {}", fraction_, docs_->describe());
  return fmt::format("{} {}", key_, docs_->describe());
}

int64_t examples_per_rank(int64_t documents, int world) { return (documents + world - 1) / world; }

// ------------------------------------------------------------------------- plans and retries

namespace {

constexpr int64_t kChunk = 256;       // documents per round trip and per queued chunk
constexpr double kMaxBackoff = 30.0;  // seconds
constexpr int64_t kMaxRuns = 64;      // stream: runs per rank (each one skip on the server)

struct Stopping {};  // the reader is being destroyed: unwind the prefetch thread

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t z = a * 0x9e3779b97f4a7c15ULL + b + 0x632be59bd9b4e019ULL;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Runs a server request; a ConnectionError is retried after backoff, backoff*2, … (capped),
// up to `retries` times. Each attempt repeats the same request, so no document is skipped or
// read twice. Past the budget, or when a stop is requested during a backoff: DataUnavailable,
// one line naming the server, the attempts and the fix.
struct Retry {
  using Waited = ShardReader::Waited;
  std::string server;
  int retries;
  double backoff;
  std::function<Waited(double)> pause;

  std::vector<Found> operator()(const std::function<std::vector<Found>()>& request) const {
    double wait = backoff, waited = 0;
    for (int attempt = 1;; ++attempt) {
      try {
        return request();
      } catch (const ConnectionError& e) {
        if (attempt > retries)
          throw DataUnavailable(
              fmt::format("lost {}: {} attempt(s) over {:.1f} s failed (last: {}); restart the server "
                          "or fix the network, or raise data.retries ({}) / data.retry_backoff_s ({})",
                          server, attempt, waited, e.what(), retries, backoff));
        switch (pause(wait)) {
          case Waited::Done:
            break;
          case Waited::Destroyed:
            throw Stopping{};
          case Waited::StopRequested:
            throw DataUnavailable(
                fmt::format("lost {}: stopped while waiting to retry, after {} failed attempt(s) "
                            "(last: {})",
                            server, attempt, e.what()));
        }
        waited += wait;
        wait = std::min(wait * 2, kMaxBackoff);
      }
    }
  }
};

}  // namespace

// A rank's order for one epoch and how to read it: next_chunk() gives the next documents of it
// in order (empty at the end).
struct ShardReader::Plan {
  virtual ~Plan() = default;
  virtual std::vector<Found> next_chunk() = 0;
};

namespace {

// The next kChunk of a plan's `size` items from `next` on (`item(k)` is the k-th), fetched by
// `fetch` through `retry`; `next` moves only after success, so a retry re-reads the same
// documents. Empty at the end.
template <class I, class F>
std::vector<Found> next_chunk_of(int64_t size, int64_t& next, const Retry& retry, I item, F fetch) {
  std::vector<decltype(item(next))> chunk;
  for (int64_t k = next; k < std::min(size, next + kChunk); ++k) chunk.push_back(item(k));
  if (chunk.empty()) return {};
  std::vector<Found> out = retry([&] { return fetch(chunk); });
  next += static_cast<int64_t>(chunk.size());
  return out;
}

// global and none: this rank's positions (ShardOrder, computed as read), fetched by id, kChunk at a time.
class PositionPlan : public ShardReader::Plan {
 public:
  PositionPlan(const Documents& docs, std::vector<std::string> fields, const ShardSpec& s, int64_t start, Retry retry)
      : docs_(docs),
        fields_(std::move(fields)),
        retry_(std::move(retry)),
        order_(docs.size(), s.world, s.rank, s.seed, s.epoch,
               s.shuffle == recipe::Shuffle::None ? Order::Sorted : Order::Shuffled),
        next_(start) {}
  std::vector<Found> next_chunk() override {
    return next_chunk_of(
        order_.size(), next_, retry_, [&](int64_t k) { return order_[k]; },
        [&](const std::vector<int64_t>& positions) { return docs_.fetch_found(positions, fields_); });
  }

 private:
  const Documents& docs_;
  const std::vector<std::string> fields_;
  const Retry retry_;
  const ShardOrder order_;
  int64_t next_;
};

// stream: sorted positions [pos, pos + n) of one selection.
struct Run {
  int64_t pos, n;
};

// Slots [a, b) of an epoch that reads `count` documents of a selection of n, from sorted position
// `base` on (cyclically: count > n passes over it in order), slots past `count` padding from the
// epoch's first: as runs of at most max(window, (b - a) / kMaxRuns) documents, split where the
// positions wrap, in the order `key` permutes them for `epoch`.
std::vector<Run> stream_runs(int64_t base, int64_t count, int64_t n, int64_t a, int64_t b, int64_t window, uint64_t key,
                             int64_t epoch) {
  const int64_t piece = std::max<int64_t>(window, (b - a + kMaxRuns - 1) / kMaxRuns);
  std::vector<Run> runs;
  for (int64_t g = a; g < b;) {  // g: the epoch's slot; its position base + g mod count, mod n
    const int64_t slot = g % count, len = std::min(b - g, count - slot);
    for (int64_t k = 0; k < len;) {
      const int64_t from = (base + slot + k) % n, m = std::min(len - k, n - from);
      for (int64_t o = 0; o < m; o += piece) runs.push_back({from + o, std::min(piece, m - o)});
      k += m;
    }
    g += len;
  }
  std::vector<Run> ordered;
  for (int64_t i : permutation(static_cast<int64_t>(runs.size()), key, epoch))
    ordered.push_back(runs[static_cast<size_t>(i)]);
  return ordered;
}

// One selection's documents along `runs`, in their order, each run through a cursor that resumes
// after the last id read: one round trip per kChunk of a run, at most kChunk read ahead.
class RunCursor {
 public:
  RunCursor(const Documents& docs, std::vector<std::string> fields, Retry retry, std::vector<Run> runs, int32_t source)
      : docs_(docs), fields_(std::move(fields)), retry_(std::move(retry)), runs_(std::move(runs)), source_(source) {}

  // Passes over the first k documents without reading them (a resume).
  void skip(int64_t k) {
    for (; k > 0; ++run_) {
      if (k < runs_[run_].n) {
        offset_ = k;
        return;
      }
      k -= runs_[run_].n;
    }
  }

  Found next() {
    if (ahead_next_ == ahead_.size()) fill();
    return std::move(ahead_[ahead_next_++]);
  }

 private:
  void fill() {
    if (offset_ == runs_[run_].n) {
      ++run_;
      offset_ = 0;
      last_.clear();
    }
    const Run& r = runs_[run_];
    const int64_t want = std::min(r.n - offset_, kChunk);
    ahead_ = retry_([&] { return docs_.run(r.pos + offset_, last_, want, fields_); });
    ahead_.resize(static_cast<size_t>(want));  // short: documents deleted since counting stay null
    for (size_t i = 0; i < ahead_.size(); ++i) {
      if (!ahead_[i].id.empty()) last_ = ahead_[i].id;
      ahead_[i].source = source_;
      ahead_[i].position = r.pos + offset_ + static_cast<int64_t>(i);
    }
    ahead_next_ = 0;
    offset_ += want;
  }

  const Documents& docs_;
  const std::vector<std::string> fields_;
  const Retry retry_;
  const std::vector<Run> runs_;
  const int32_t source_;
  size_t run_ = 0;
  int64_t offset_ = 0;        // within runs_[run_]
  std::string last_;          // id of the last document read in runs_[run_] (empty: seek by skip)
  std::vector<Found> ahead_;  // read from runs_[run_], not yet taken
  size_t ahead_next_ = 0;
};

// A rank's stream of `size` documents for one epoch, shuffled window by window: each window of
// data.shuffle_buffer documents permuted by (seed, window, epoch). Memory: one window.
class WindowedPlan : public ShardReader::Plan {
 public:
  std::vector<Found> next_chunk() override {
    if (ready_next_ == ready_.size() && !load_window()) return {};
    const size_t end = std::min(ready_.size(), ready_next_ + static_cast<size_t>(kChunk));
    std::vector<Found> out(std::make_move_iterator(ready_.begin() + static_cast<std::ptrdiff_t>(ready_next_)),
                           std::make_move_iterator(ready_.begin() + static_cast<std::ptrdiff_t>(end)));
    ready_next_ = end;
    return out;
  }

 protected:
  // Resumes at `start`: reopens at its window and drops what was delivered of it.
  WindowedPlan(int64_t size, int64_t window, uint64_t seed, int64_t epoch, int64_t start)
      : size_(size), window_size_(window), seed_(seed), epoch_(epoch) {
    window_ = start / window_size_;
    skip_ = start - window_ * window_size_;
  }
  // The documents of the stream before the first one to read (the subclass skips them).
  int64_t resume_at() const { return window_ * window_size_; }
  virtual Found next_document() = 0;  // the stream's next, unshuffled

 private:
  bool load_window() {
    const int64_t begin = window_ * window_size_;
    if (begin >= size_) return false;
    const int64_t n = std::min(window_size_, size_ - begin);
    std::vector<Found> w;
    w.reserve(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) w.push_back(next_document());
    ready_.clear();
    for (int64_t i : permutation(n, mix(seed_, static_cast<uint64_t>(window_)), epoch_))
      if (skip_ > 0)
        --skip_;
      else
        ready_.push_back(std::move(w[static_cast<size_t>(i)]));
    ready_next_ = 0;
    ++window_;
    return !ready_.empty() || load_window();
  }

  const int64_t size_, window_size_;
  const uint64_t seed_;
  const int64_t epoch_;
  int64_t window_ = 0, skip_ = 0;
  std::vector<Found> ready_;
  size_t ready_next_ = 0;
};

// stream: this rank's _id-sorted positions [rank*per, (rank+1)*per) modulo n, read along
// stream_runs in a (seed, rank, epoch) order.
class StreamPlan : public WindowedPlan {
 public:
  StreamPlan(const Documents& docs, std::vector<std::string> fields, const ShardSpec& s, int64_t start, Retry retry)
      : WindowedPlan(examples_per_rank(docs.size(), s.world), docs.config().shuffle_buffer,
                     mix(s.seed, static_cast<uint64_t>(s.rank)), s.epoch, start),
        cursor_(docs, std::move(fields), std::move(retry),
                stream_runs(0, docs.size(), docs.size(), s.rank * examples_per_rank(docs.size(), s.world),
                            (s.rank + 1) * examples_per_rank(docs.size(), s.world), docs.config().shuffle_buffer,
                            mix(s.seed, static_cast<uint64_t>(s.rank)), s.epoch),
                0) {
    cursor_.skip(resume_at());
  }

 private:
  Found next_document() override { return cursor_.next(); }
  RunCursor cursor_;
};

// data.sources with stream: each source's per_epoch documents of epoch e are its sorted positions
// from o + e·per_epoch on (cyclically; o drawn from the seed), split among the ranks as one
// selection's are; a rank reads each source's share along its own runs and interleaves the
// sources smoothly (the j-th of a source's m documents at (j + u) / m, u drawn in [0, 1)), then
// shuffles window by window.
class MixStreamPlan : public WindowedPlan {
 public:
  MixStreamPlan(const Mixture& m, const ShardSpec& s, int64_t start, const Retry& retry)
      : WindowedPlan(m.per_rank(s.world), m.sources().front().config->shuffle_buffer,
                     mix(s.seed, static_cast<uint64_t>(s.rank)), s.epoch, start) {
    const uint64_t rank_key = mix(s.seed, static_cast<uint64_t>(s.rank));
    lanes_.reserve(m.sources().size());
    for (size_t k = 0; k < m.sources().size(); ++k) {
      const MixSource& src = m.sources()[k];
      const int64_t n = src.docs->size(), count = src.per_epoch, per = examples_per_rank(count, s.world);
      const auto first = static_cast<int64_t>(mix(s.seed ^ 0x6a09e667f3bcc909ULL, k) % static_cast<uint64_t>(n));
      const int64_t base = (first + s.epoch % n * (count % n)) % n;
      lanes_.push_back({RunCursor(*src.docs, src.builder->fields(), retry,
                                  stream_runs(base, count, n, s.rank * per, (s.rank + 1) * per,
                                              src.config->shuffle_buffer, mix(rank_key, k + 1), s.epoch),
                                  static_cast<int32_t>(k)),
                        per, mix(mix(rank_key, k + 1), static_cast<uint64_t>(s.epoch) ^ 0x5bd1e995)});
    }
    // a resume: how many of each source the stream held before resume_at()
    for (int64_t i = 0; i < resume_at(); ++i) ++lanes_[pick()].taken;
    for (Lane& lane : lanes_) lane.cursor.skip(lane.taken);
  }

 private:
  struct Lane {
    RunCursor cursor;
    int64_t count;  // its documents in this rank's epoch
    uint64_t key;
    int64_t taken = 0;
    double at() const {
      const double u = static_cast<double>(mix(key, static_cast<uint64_t>(taken)) >> 11) * 0x1.0p-53;
      return (static_cast<double>(taken) + u) / static_cast<double>(count);
    }
  };

  // The source whose next document comes next (the earliest place; ties to the earlier source).
  size_t pick() const {
    size_t best = lanes_.size();
    for (size_t k = 0; k < lanes_.size(); ++k)
      if (lanes_[k].taken < lanes_[k].count && (best == lanes_.size() || lanes_[k].at() < lanes_[best].at())) best = k;
    return best;
  }
  Found next_document() override {
    Lane& lane = lanes_[pick()];
    ++lane.taken;
    return lane.cursor.next();
  }
  std::vector<Lane> lanes_;
};

// data.sources: this rank's share of the mixture's epoch order (every W-th pick, padded as
// shard_positions pads), fetched kChunk at a time.
class MixPlan : public ShardReader::Plan {
 public:
  MixPlan(const Mixture& mix, const ShardSpec& s, int64_t start, Retry retry) : mix_(mix), retry_(std::move(retry)) {
    const std::vector<Pick> all = mix.order(s.seed, s.epoch);
    for (int64_t i : shard_positions(static_cast<int64_t>(all.size()), s.world, s.rank, 0, 0, Order::Sorted))
      picks_.push_back(all[static_cast<size_t>(i)]);
    next_ = start;
  }
  std::vector<Found> next_chunk() override {
    return next_chunk_of(
        static_cast<int64_t>(picks_.size()), next_, retry_, [&](int64_t k) { return picks_[static_cast<size_t>(k)]; },
        [&](const std::vector<Pick>& chunk) { return mix_.fetch(chunk); });
  }

 private:
  const Mixture& mix_;
  const Retry retry_;
  std::vector<Pick> picks_;
  int64_t next_ = 0;
};

// {"_id": {"$oid": "65f…"}} → {"$oid":"65f…"}, {"_id": {"$numberInt": "7"}} → 7; "#12" stays.
std::string shown_id(const std::string& id) { return id.empty() || id[0] == '#' ? id : relaxed_id(id); }

}  // namespace

Built build_found(const ExampleBuilder& builder, const Found& f) {
  const auto bad = [](std::string why, Rejection::Cause cause) {
    return Rejection{Rejection::BadDocument, std::move(why), {}, cause};
  };
  Built b = !f.invalid_utf8.empty() ? bad(invalid_utf8_reason(f.invalid_utf8), Rejection::kUnreadable)
            : f.doc.is_discarded()  ? bad("not valid JSON or not valid UTF-8", Rejection::kUnreadable)
            : f.doc.is_null()       ? bad("no longer in the collection", Rejection::kDeleted)
                                    : builder.build(f.doc);
  if (auto* r = std::get_if<Rejection>(&b)) r->document = shown_id(f.id);
  if (auto* e = std::get_if<Example>(&b)) e->source = f.source;
  return b;
}

// ---------------------------------------------------------------------------------- ShardReader

ShardReader::ShardReader(const Documents& docs, const ExampleBuilder& builder, const ShardSpec& s, int64_t start)
    : builders_{&builder}, stop_requested_(s.stop), depth_(static_cast<size_t>(std::max(0, docs.config().prefetch))) {
  if (s.world < 1 || s.rank < 0 || s.rank >= s.world)
    throw Error(fmt::format("rank {} of world size {} is not a valid shard", s.rank, s.world));
  const recipe::DataSection& d = docs.config();
  size_ = examples_per_rank(docs.size(), s.world);
  delivered_ = std::clamp<int64_t>(start, 0, size_);
  Retry retry{docs.server(), d.retries, d.retry_backoff_s, [this](double t) { return pause(t); }};
  if (s.shuffle == recipe::Shuffle::Stream)
    plan_ = std::make_unique<StreamPlan>(docs, builder.fields(), s, delivered_, std::move(retry));
  else
    plan_ = std::make_unique<PositionPlan>(docs, builder.fields(), s, delivered_, std::move(retry));
  start_thread();
}

ShardReader::ShardReader(const Mixture& mix, const ShardSpec& s, int64_t start)
    : stop_requested_(s.stop), depth_(static_cast<size_t>(std::max(0, mix.sources().front().config->prefetch))) {
  if (s.world < 1 || s.rank < 0 || s.rank >= s.world)
    throw Error(fmt::format("rank {} of world size {} is not a valid shard", s.rank, s.world));
  for (const MixSource& source : mix.sources()) builders_.push_back(source.builder.get());
  const recipe::DataSection& d = *mix.sources().front().config;
  size_ = mix.per_rank(s.world);
  delivered_ = std::clamp<int64_t>(start, 0, size_);
  Retry retry{mix.server(), d.retries, d.retry_backoff_s, [this](double t) { return pause(t); }};
  if (s.shuffle == recipe::Shuffle::Stream)
    plan_ = std::make_unique<MixStreamPlan>(mix, s, delivered_, retry);
  else
    plan_ = std::make_unique<MixPlan>(mix, s, delivered_, std::move(retry));
  start_thread();
}

std::vector<Found> stream_head(const Mixture& mix, const ShardSpec& spec, int64_t n) {
  const recipe::DataSection& d = *mix.sources().front().config;
  const Retry retry{mix.server(), d.retries, d.retry_backoff_s, [](double t) {
                      std::this_thread::sleep_for(std::chrono::duration<double>(t));
                      return ShardReader::Waited::Done;
                    }};
  MixStreamPlan plan(mix, spec, 0, retry);
  std::vector<Found> out;
  while (static_cast<int64_t>(out.size()) < n) {
    std::vector<Found> chunk = plan.next_chunk();
    if (chunk.empty()) break;
    for (Found& f : chunk) out.push_back(std::move(f));
  }
  out.resize(static_cast<size_t>(std::min<int64_t>(n, static_cast<int64_t>(out.size()))));
  return out;
}

void ShardReader::start_thread() {
  if (depth_ > 0) thread_ = std::thread([this] { run(); });
}

ShardReader::~ShardReader() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

std::vector<Built> ShardReader::next(size_t n) {
  std::vector<Built> out;
  while (out.size() < n) {
    if (next_ < current_.size()) {
      count(current_[next_]);
      out.push_back(std::move(current_[next_++]));
      continue;
    }
    if (end_) break;
    const auto t0 = std::chrono::steady_clock::now();
    current_ = take();
    wait_s_ += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    next_ = 0;
    end_ = current_.empty();
  }
  delivered_ += static_cast<int64_t>(out.size());
  return out;
}

void ShardReader::count(const Built& b) {
  const auto* r = std::get_if<Rejection>(&b);
  if (!r) return;
  ++rejected_[r->kind];
  if (first_rejected_.size() < 5) first_rejected_.push_back(fmt::format("{}: {}", r->document, r->reason));
}

// The next chunk of documents, built into examples (or rejections naming the document).
std::vector<Built> ShardReader::produce() {
  std::vector<Found> docs = plan_->next_chunk();
  std::vector<Built> out;
  out.reserve(docs.size());
  for (const Found& f : docs) out.push_back(build_found(*builders_[static_cast<size_t>(f.source)], f));
  return out;
}

std::vector<Built> ShardReader::take() {
  if (depth_ == 0) return produce();
  std::unique_lock lock(mu_);
  cv_.wait(lock, [&] { return !queue_.empty() || error_; });
  if (queue_.empty()) std::rethrow_exception(error_);  // after every chunk read before it
  std::vector<Built> chunk = std::move(queue_.front());
  queue_.pop_front();
  cv_.notify_all();
  return chunk;
}

void ShardReader::run() {
  try {
    for (;;) {
      std::vector<Built> chunk = produce();
      const bool end = chunk.empty();
      std::unique_lock lock(mu_);
      cv_.wait(lock, [&] { return stop_ || queue_.size() < depth_; });
      if (stop_) return;
      queue_.push_back(std::move(chunk));
      cv_.notify_all();
      if (end) return;
    }
  } catch (const Stopping&) {
  } catch (...) {
    std::lock_guard lock(mu_);
    error_ = std::current_exception();
    cv_.notify_all();
  }
}

// Waits in slices of at most 50 ms, so that a stop request set by a signal handler (which
// cannot notify cv_) is seen within 50 ms.
ShardReader::Waited ShardReader::pause(double seconds) {
  constexpr auto kSlice = std::chrono::milliseconds(50);
  const auto until = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                            std::chrono::duration<double>(seconds));
  std::unique_lock lock(mu_);
  for (;;) {
    if (stop_) return Waited::Destroyed;
    if (stop_requested_ && stop_requested_->load()) return Waited::StopRequested;
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) return Waited::Done;
    cv_.wait_for(lock, std::min<std::chrono::steady_clock::duration>(until - now, kSlice));
  }
}

}  // namespace lorarun::data
