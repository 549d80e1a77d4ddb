// Where training documents come from (MongoDB or JSONL) and how one rank reads its shard of
// them for one epoch, built into examples ahead of the trainer.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <thread>
#include <variant>
#include <vector>

#include "data/example.hpp"
#include "recipe/recipe.hpp"
#include "util/error.hpp"

namespace lorarun::data {

class Client;
struct Found;
class Mixture;

// The data went away while training read it and did not come back: the reader's retries
// (data.retries, data.retry_backoff_s) ran out, or ShardSpec::stop was set while it waited to
// retry. Bad input (a bad filter, a missing collection, data.bad_documents: fail) stays a plain
// Error. Reaches the training thread through ShardReader::next() / MicroBatches::next(), after
// every chunk read before the failure.
struct DataUnavailable : Error {
  using Error::Error;
};

// eval.fraction's split of a selection left one side empty: it holds out none of the selected
// documents, or all of them. A recipe error for one run; a job of many adapters trains such an
// adapter on all its documents, unevaluated.
struct EmptySplit : Error {
  using Error::Error;
};

// The selected documents, addressable by position 0..size()-1 in _id order (MongoDB) or file
// order (JSONL). Construction checks that the selection exists and is not empty, connecting
// within data.timeout_s (unless data.uri sets serverSelectionTimeoutMS / connectTimeoutMS: the
// URI wins); an unreachable server is a ConnectionError "cannot reach MongoDB at …", a filter
// the server rejects an Error naming data.filter. With data.shuffle: stream a MongoDB selection
// is only counted, never listed: memory does not grow with the collection (fetch() by position
// lists the ids on first use). Thread-safe.
// Which side of eval.fraction's split a Documents holds: a document is held out when
// held_out(key, fraction), its key being its canonical {"_id": …} (MongoDB) or its line (JSONL).
struct Holdout {
  double fraction = 0;         // 0: no split, every selected document
  bool eval = false;           // the held-out documents (else the others)
  std::optional<int64_t> max;  // at most this many of them (the first, in order)
  // The documents training reads: those `fraction` does not hold out.
  static Holdout training(double fraction) { return {fraction, false, std::nullopt}; }
};
// FNV-1a 64 of `key`, its top 53 bits as a number in [0, 1), below `fraction`: stable across runs,
// ranks and machines (tests/reference/train_reference.py computes the same).
bool held_out(std::string_view key, double fraction);

// A selection's ids in order, given and read back as canonical {"_id": …} texts. While every id is
// an ObjectId each is kept as its 12 bytes, in blocks of kBlock ids (a list that grows by doubling
// leaves its old buffers to the allocator: 2.6x the list's size resident at 1M ids); from the
// first that is not, all are kept as texts in one buffer with one offset each. (A string per id
// took about 110 bytes with the allocator's.)
class IdList {
 public:
  void push_back(std::string_view id);
  size_t size() const { return texts_ ? offsets_.size() : oids_; }
  std::string operator[](size_t i) const;
  void shrink_to_fit();

 private:
  static constexpr size_t kBlock = 65536;
  bool texts_ = false;
  size_t oids_ = 0;                  // ObjectIds held (while !texts_)
  std::vector<std::string> blocks_;  // their 12 bytes each, kBlock ids a block
  std::string text_;                 // the texts back to back (texts_)
  std::vector<uint64_t> offsets_;
};

class Documents {
 public:
  explicit Documents(const recipe::DataSection& d, const Holdout& holdout = {});
  ~Documents();
  int64_t size() const { return size_; }
  const recipe::DataSection& config() const { return d_; }
  // "db.collection {filter}" or the JSONL path, secrets scrubbed (for logs and run records).
  std::string describe() const;
  // "mongodb://host:port/" (password redacted) or the JSONL path: who to blame in errors.
  std::string server() const;
  // What the selection is, to tell later whether it changed: {"documents": N, "digest": FNV-1a 64
  // of the ids (MongoDB) or lines (JSONL) in order, as hex; null when streamed: never listed},
  // with data.shuffle: global also "order": "keyed" (how the epoch's order is made; a resumable
  // state written before the order was a keyed permutation lacks it).
  nlohmann::json identity() const;
  // The documents at these positions, in order (null where one vanished, discarded where one is
  // not JSON or not UTF-8).
  std::vector<Document> fetch(const std::vector<int64_t>& positions) const;
  // The same with ids (and the field that is not UTF-8), fetching only `fields` (all when empty).
  std::vector<Found> fetch_found(const std::vector<int64_t>& positions, const std::vector<std::string>& fields) const;
  // Up to `n` documents from sorted position `pos` on, where `after` is the id of the one
  // before `pos` (empty: seek to `pos`, a server-side skip). Stream mode's cursor step.
  std::vector<Found> run(int64_t pos, const std::string& after, int64_t n,
                         const std::vector<std::string>& fields) const;
  // A document `other` selects that this selection selects too, described ("_id 7", "line 3
  // (line 12 of data.path)"), or nullopt when they share none: JSONL lines compared as text,
  // MongoDB ids when both select from one collection (a count of both filters together when
  // this selection is streamed, so data.limit is not applied there). Other pairs share none.
  std::optional<std::string> shared_with(const Documents& other) const;

 private:
  void list_ids() const;
  bool keep(std::string_view key) const {
    return holdout_.fraction <= 0 || held_out(key, holdout_.fraction) == holdout_.eval;
  }
  const recipe::DataSection& d_;
  const Holdout holdout_;
  std::unique_ptr<Client> client_;
  int64_t size_ = 0;
  mutable std::mutex mu_;  // one request at a time on client_
  mutable IdList ids_;     // mongodb: canonical {"_id": …} per position
  mutable bool listed_ = false;
  std::vector<std::string> lines_;  // jsonl: one document per position
};

// A recipe's evaluation documents (its eval: section), read in position order: data:'s source
// with eval.filter / eval.collection (MongoDB) or eval.path (JSONL), at most eval.max_documents
// of them, or the share eval.fraction holds out of data's selection. When `train` (the training
// selection) is given, a document both select is refused with one line naming it: evaluation
// documents are never trained on. Errors name the eval key they come from.
class EvalSplit {
 public:
  // `data`: the data keys to select by instead of r.data's (a source of data.sources).
  EvalSplit(const recipe::Recipe& r, const Documents* train, const recipe::DataSection* data = nullptr);
  EvalSplit(const EvalSplit&) = delete;  // docs_ refers to data_
  EvalSplit& operator=(const EvalSplit&) = delete;
  const Documents& docs() const { return *docs_; }
  // "eval.filter {…} on db.coll", "eval.path x.jsonl", "eval.fraction 0.05 of …": for logs.
  std::string describe() const;
  // Throws Error naming a document both this split and `train` select (none is ever trained on).
  void refuse_overlap(const Documents& train) const;

 private:
  std::string key_;  // the eval key that selects: "eval.filter", "eval.path", "eval.fraction"
  recipe::DataSection data_;
  double fraction_ = 0;
  std::unique_ptr<Documents> docs_;
};

// What lora-train --dry-run learns of a MongoDB selection: the server runs it as training
// would (a count of data.filter with data.limit, and one document with the fields' projection),
// within data.timeout_s, without listing it. A filter the server rejects throws Error naming
// data.filter; refused credentials throw too. When the check cannot be made (no data.uri, no
// server answering) or selects nothing, `warning` says so and count is 0.
struct Selection {
  int64_t count = 0;
  std::string warning;
};
Selection check_selection(const recipe::DataSection& d);

// adapters.per: what `field` holds across data's selection (MongoDB): its distinct values, and how
// many selected documents have no such field (no adapter trains on those).
struct FieldValues {
  std::vector<nlohmann::json> values;
  int64_t missing = 0;
  int64_t arrays = 0;  // documents whose field holds a list (distinct lists its items one by one)
};
FieldValues field_values(const recipe::DataSection& d, const std::string& field);

// Which shard of which epoch a reader delivers, and when to stop waiting for it.
struct ShardSpec {
  int world = 1, rank = 0;
  uint64_t seed = 42;
  int64_t epoch = 0;
  recipe::Shuffle shuffle = recipe::Shuffle::Global;
  // Set (by a signal handler, another thread): a reader waiting to retry a lost server gives
  // up at once with DataUnavailable ("… stopped while waiting to retry …"); checked every
  // 50 ms of a backoff. Requests themselves are not interrupted. nullptr: never.
  const std::atomic<bool>* stop = nullptr;
};

// Examples per rank per epoch: ceil(documents / world) on every rank, in every shuffle mode.
// The remainder is padded as torch's DistributedSampler (drop_last=False) does: the first
// world*per_rank - documents documents of the epoch's order (of the _id order with stream)
// are read a second time, so at most world-1 documents appear twice in an epoch (data.sources
// with stream: per source, see Mixture::per_rank).
int64_t examples_per_rank(int64_t documents, int world);

using Built = std::variant<Example, Rejection>;

// What training makes of a fetched document: the builder's example, or a rejection naming the
// document (its _id, or "#position" in a JSONL file) and why: a field that is not valid UTF-8,
// not JSON, gone from the collection, or the builder's own reasons.
Built build_found(const ExampleBuilder& builder, const Found& f);

// One rank's documents for one epoch, from position `start` of its order on, in chunks fetched
// through its own cursor and built into examples by a background thread, data.prefetch chunks
// ahead (0: in next() itself). A dropped connection is retried data.retries times with
// exponential backoff, re-reading the same documents; past that (or when spec.stop is set
// during a backoff) next() throws DataUnavailable; other errors pass through as they are.
//   global: the sorted _id list in a keyed permutation of (seed, epoch), computed position by
//           position (ShardOrder); rank r takes r, r+W, r+2W, …
//   none:   sorted by _id; rank r takes r, r+W, r+2W, … (as DistributedSampler(shuffle=False)),
//           so W ranks' step k holds what 1 rank with W times the batch reads in its step k.
//   stream: rank r reads the _id-sorted positions [r*per_rank, (r+1)*per_rank) (wrapping to the
//           start for the padding), split into at most 64 runs read in a (seed, epoch) order,
//           each window of data.shuffle_buffer documents permuted. No id list is held.
class ShardReader {
 public:
  ShardReader(const Documents& docs, const ExampleBuilder& builder, const ShardSpec& spec, int64_t start = 0);
  // data.sources: the mixture's order of the epoch (Mixture::order), sharded as `global` and
  // `none` shard one selection (every W-th from the rank's own, padded alike); each document
  // built by its source's builder. Example::source says which. With `stream`: each source's
  // documents of the epoch (Mixture) split among the ranks as one selection's are (ceil(share /
  // W) per rank, padded from the epoch's first), read in runs as above, interleaved smoothly by
  // share within the rank and shuffled window by window: Mixture::per_rank(W) documents.
  ShardReader(const Mixture& mix, const ShardSpec& spec, int64_t start = 0);
  ~ShardReader();  // stops the thread; waits for at most the request in flight
  ShardReader(const ShardReader&) = delete;
  ShardReader& operator=(const ShardReader&) = delete;

  // The next n documents' results in order; fewer (or none) at the end of the shard.
  std::vector<Built> next(size_t n);
  int64_t position() const { return delivered_; }  // documents delivered so far (incl. start)
  int64_t size() const { return size_; }
  double wait_seconds() const { return wait_s_; }  // time next() spent blocked on data
  // Rejections delivered so far, by kind, and the first few as "id: reason" (for the log).
  int64_t rejected(Rejection::Kind kind) const { return rejected_[kind]; }
  const std::vector<std::string>& first_rejected() const { return first_rejected_; }

  struct Plan;                                           // the order and how to read it (source.cpp)
  enum class Waited { Done, Destroyed, StopRequested };  // how a backoff ended

 private:
  std::vector<Built> produce();  // the next chunk, built; empty at the end
  std::vector<Built> take();     // the next chunk from the queue (or produce())
  void run();                    // the prefetch thread
  Waited pause(double seconds);  // a backoff, cut short by the destructor or spec.stop
  void count(const Built& b);
  void start_thread();

  std::vector<const ExampleBuilder*> builders_;  // by Found::source
  const std::atomic<bool>* stop_requested_;
  std::unique_ptr<Plan> plan_;
  int64_t size_ = 0, delivered_ = 0;
  double wait_s_ = 0;
  int64_t rejected_[2] = {0, 0};
  std::vector<std::string> first_rejected_;
  std::vector<Built> current_;
  size_t next_ = 0;
  bool end_ = false;

  size_t depth_;  // chunks ready ahead
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::vector<Built>> queue_;  // an empty chunk marks the end
  std::exception_ptr error_;
  bool stop_ = false;
  std::thread thread_;
};

// data.sources with data.shuffle: stream: the first n documents rank spec.rank reads (Found::source
// and Found::position set), without building them; what lora-data preview shows.
std::vector<Found> stream_head(const Mixture& mix, const ShardSpec& spec, int64_t n);

}  // namespace lorarun::data
