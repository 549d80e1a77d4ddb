// Every rank's liveness, kept in the rendezvous store: a thread per rank writes a heartbeat each
// second, so a rank whose collective times out can name the rank that stopped, not itself.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

#include <torch/csrc/distributed/c10d/Store.hpp>

namespace lorarun::dist {

// A rank found to have stopped, and how it was found ("no heartbeat for 12 s; …").
struct Blame {
  int rank = 0;
  bool silent = true;  // no heartbeat at all (stopped or hung process); false: beats, but no progress
  std::string why;
};

class Heartbeat {
 public:
  // Opens a new connection to the store, under this attempt's prefix.
  using Connect = std::function<c10::intrusive_ptr<c10d::Store>()>;

  // Connects (once, here) and starts the thread that writes "<unix ms> <beat> <started>
  // <completed>" under key "<rank>" every `interval`.
  Heartbeat(Connect connect, int rank, int world_size, std::chrono::milliseconds interval);
  ~Heartbeat();  // stops and joins the thread
  Heartbeat(const Heartbeat&) = delete;
  Heartbeat& operator=(const Heartbeat&) = delete;

  void collective_started() { ++started_; }
  void collective_completed() { ++completed_; }

  // Reads every rank's heartbeat twice, three beats apart, on a connection of its own and within
  // a few seconds whatever the store does. Names the lowest rank whose beat did not move, else
  // the rank that started the fewest collectives if that is fewer than this rank did. When the
  // store itself does not answer, that is rank 0 (which hosts it) unless this is rank 0.
  std::optional<Blame> find_stopped_rank() const;

 private:
  void loop(c10::intrusive_ptr<c10d::Store> store);

  Connect connect_;
  int rank_, world_size_;
  std::chrono::milliseconds interval_;
  std::atomic<long> started_{0}, completed_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace lorarun::dist
