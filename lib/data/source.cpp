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

}  // namespace lorarun::data
