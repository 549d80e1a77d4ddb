// Running the real binaries from tests: shell commands, their output, exit status and time.
#pragma once
#include <sys/types.h>
#include <string>
#include <vector>

namespace lorarun::test {

struct Result {
  int status = -1;     // exit code, or 128+signal
  std::string output;  // stdout and stderr together
  double seconds = 0;
};

enum class Capture { Both, StderrOnly };

// Runs `cmd` with sh -c; output is stdout and stderr merged, or stderr alone.
Result sh(const std::string& cmd, Capture what = Capture::Both);

// Path of a built binary (lorarun, lora-train), quoted for the shell.
std::string bin(const std::string& name);

// A directory under the build tree, empty and unique to this test run.
std::string temp_dir(const std::string& name);

// True while `pid` exists and is not a zombie.
bool alive(pid_t pid);

// True while any process is in process group `pgid`.
bool group_alive(pid_t pgid);

// The pids the launcher announced ("started N rank(s) … (pids 1 2 3)").
std::vector<pid_t> launched_pids(const std::string& output);

// Polls `pred` every 50 ms for up to `seconds`; returns its last value.
template <class Pred>
bool wait_for(Pred pred, double seconds);

std::string read_file(const std::string& path);

// Number of lines in `s` that are not empty.
int count_lines(const std::string& s);

// The lines of `s` that contain `needle`.
std::vector<std::string> lines_with(const std::string& s, const std::string& needle);

// How many times `needle` occurs in `s` (overlaps counted).
size_t occurrences(const std::string& s, const std::string& needle);

}  // namespace lorarun::test

#include <chrono>
#include <thread>
template <class Pred>
bool lorarun::test::wait_for(Pred pred, double seconds) {
  const auto end = std::chrono::steady_clock::now() + std::chrono::duration<double>(seconds);
  while (!pred()) {
    if (std::chrono::steady_clock::now() > end) return pred();
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return true;
}
