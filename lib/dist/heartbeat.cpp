#include "dist/heartbeat.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cstdio>
#include <memory>
#include <vector>

namespace lorarun::dist {
namespace {

using namespace std::chrono_literals;

struct Beat {
  long long unix_ms = 0, beat = 0, started = 0, completed = 0;
};

long long unix_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::vector<uint8_t> encode(const Beat& b) {
  const std::string s = fmt::format("{} {} {} {}", b.unix_ms, b.beat, b.started, b.completed);
  return {s.begin(), s.end()};
}

std::optional<Beat> decode(const std::vector<uint8_t>& v) {
  const std::string s(v.begin(), v.end());
  Beat b;
  if (std::sscanf(s.c_str(), "%lld %lld %lld %lld", &b.unix_ms, &b.beat, &b.started, &b.completed) != 4) return {};
  return b;
}

// Every rank's last heartbeat; empty for a rank that has written none.
std::vector<std::optional<Beat>> read_all(c10d::Store& store, int world_size) {
  std::vector<std::optional<Beat>> out(world_size);
  for (int r = 0; r < world_size; ++r) {
    const std::string key = std::to_string(r);
    if (store.check({key})) out[r] = decode(store.get(key));
  }
  return out;
}

// Whom two readings `gap` apart blame, seen from `rank` which has started `mine` collectives.
std::optional<Blame> judge(const std::vector<std::optional<Beat>>& first,
                           const std::vector<std::optional<Beat>>& second, int rank, long mine,
                           std::chrono::milliseconds gap) {
  const long long now = unix_ms();
  for (size_t r = 0; r < second.size(); ++r) {
    if (static_cast<int>(r) == rank) continue;
    if (!second[r])
      return Blame{static_cast<int>(r), true, "it never sent a heartbeat; the process is stopped or hung"};
    if (first[r] && first[r]->beat == second[r]->beat) {
      // Clocks of other nodes may differ a little: never claim less than what was watched here.
      const long long silent_ms = std::max<long long>(now - second[r]->unix_ms, gap.count());
      return Blame{static_cast<int>(r), true,
                   fmt::format("no heartbeat for {} s; the process is stopped or hung", (silent_ms + 500) / 1000)};
    }
  }
  int behind = -1;
  for (size_t r = 0; r < second.size(); ++r)
    if (static_cast<int>(r) != rank && second[r]->started < mine &&
        (behind < 0 || second[r]->started < second[behind]->started))
      behind = static_cast<int>(r);
  if (behind < 0) return {};
  return Blame{
      behind, false,
      fmt::format("its heartbeat goes on, but it started {} collective(s) to rank {}'s {}: it is stuck outside "
                  "communication",
                  second[behind]->started, rank, mine)};
}

}  // namespace

Heartbeat::Heartbeat(Connect connect, int rank, int world_size, std::chrono::milliseconds interval)
    : connect_(std::move(connect)), rank_(rank), world_size_(world_size), interval_(interval) {
  thread_ = std::thread(&Heartbeat::loop, this, connect_());
}

Heartbeat::~Heartbeat() {
  {
    std::lock_guard lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  thread_.join();
}

void Heartbeat::loop(c10::intrusive_ptr<c10d::Store> store) {
  const std::string key = std::to_string(rank_);
  std::unique_lock lock(mutex_);
  for (long long beat = 1; !stop_; ++beat) {
    lock.unlock();
    try {
      store->set(key, encode({unix_ms(), beat, started_.load(), completed_.load()}));
    } catch (const std::exception&) {
      return;  // the store has gone (rank 0 ended): this rank's collectives will say so
    }
    lock.lock();
    wake_.wait_for(lock, interval_, [&] { return stop_; });
  }
}

std::optional<Blame> Heartbeat::find_stopped_rank() const {
  // The readings run on a thread of their own that may outlive this call: a store whose host is
  // stopped can keep a read waiting, and this rank must still get to report the failure.
  struct Shared {
    std::mutex mutex;
    std::condition_variable done_cv;
    bool done = false, answered = false;
    std::optional<Blame> blame;
  };
  auto shared = std::make_shared<Shared>();
  const auto gap = 3 * interval_;
  std::thread([shared, connect = connect_, world = world_size_, rank = rank_, mine = started_.load(), gap] {
    std::optional<Blame> blame;
    bool answered = false;
    try {
      const auto store = connect();
      const auto first = read_all(*store, world);
      std::this_thread::sleep_for(gap);
      blame = judge(first, read_all(*store, world), rank, mine, gap);
      answered = true;
    } catch (const std::exception&) {
    }
    std::lock_guard lock(shared->mutex);
    shared->done = true;
    shared->answered = answered;
    shared->blame = blame;
    shared->done_cv.notify_all();
  }).detach();
  std::unique_lock lock(shared->mutex);
  shared->done_cv.wait_for(lock, gap + 4s, [&] { return shared->done; });
  if (shared->answered) return shared->blame;
  if (rank_ == 0) return {};
  return Blame{0, true, "the rendezvous store it hosts does not answer; the process is stopped, hung or gone"};
}

}  // namespace lorarun::dist
