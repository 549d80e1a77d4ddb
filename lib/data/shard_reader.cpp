// The shard readers: what each rank reads of an epoch (plans over positions, runs and windows,
// mixtures), with retries, a prefetch thread, and the documents built into examples.
#include <fmt/format.h>
#include <algorithm>
#include <functional>
#include <thread>
#include <unordered_map>
#include <unordered_set>

#include "data/mixture.hpp"
#include "data/mongo.hpp"
#include "data/shard.hpp"
#include "data/source.hpp"
#include "util/error.hpp"

namespace lorarun::data {

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
