// A reward command: the user's program, kept running, answering one number a line; and every way it
// can fail, each one line naming the reward and what happened.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "train/reward_command.hpp"
#include "util/error.hpp"

using namespace lorarun;
using namespace lorarun::train;

namespace {

std::vector<nlohmann::json> items(size_t n, size_t length = 5) {
  std::vector<nlohmann::json> out;
  for (size_t i = 0; i < n; ++i)
    out.push_back({{"prompt", "p"}, {"completion", std::string(length + i, 'x')}, {"answer", "42"}});
  return out;
}

// The message `f` throws (Error), or "".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

std::vector<std::string> sh(const std::string& script) { return {"sh", "-c", script}; }

// What scoring 3 completions with `script` (as reward "rewards[1] (c)") ends in.
std::string failure(const std::string& script, double timeout_s = 30) {
  return error_of([&] { RewardCommand(sh(script), timeout_s, "rewards[1] (c)").score(items(3)); });
}

const std::string kStderr = " (its stderr is in this rank's log)";

}  // namespace

TEST_CASE("reward command: one process answers every batch, in order, from the JSON it is given") {
  // Each answer: the completion's length plus how many completions it has scored before (so a second
  // batch shows the same process still running).
  RewardCommand r({LORARUN_PYTHON, "-c",
                   "import sys, json\nseen = 0\nfor line in sys.stdin:\n    d = json.loads(line)\n"
                   "    print(len(d['completion']) + seen, flush=True)\n    seen += 1\n"},
                  30, "rewards[0] (length)");
  CHECK(r.score(items(3)) == std::vector<double>{5, 7, 9});
  CHECK(r.score(items(2)) == std::vector<double>{8, 10});
  // 4,000 completions of ~2 KB: written while answers are read, so neither side's buffer stalls the other
  const auto many = r.score(items(4000, 2000));
  REQUIRE(many.size() == 4000);
  CHECK(many[3999] == (2000 + 3999) + (5 + 3999));  // its length, and the 5 + 3999 scored before it
}

TEST_CASE("reward command: null or nan is an unscorable completion") {
  RewardCommand r(sh("i=0; while read l; do case $i in 0) echo null;; 1) echo ' 0.5 ';; *) echo nan;; esac; "
                     "i=$((i+1)); done"),
                  30, "rewards[0] (x)");
  const auto v = r.score(items(3));
  CHECK(std::isnan(v[0]));
  CHECK(v[1] == 0.5);
  CHECK(std::isnan(v[2]));
}

TEST_CASE("reward command: a program that hangs, dies, or answers wrong is an error naming it, never a hang") {
  const auto start = std::chrono::steady_clock::now();
  CHECK(failure("exec sleep 100", 1) ==
        "rewards[1] (c): reward command 'sh' did not answer within 1 s (timeout_s) after 0 of 3 answers; killed");
  CHECK(std::chrono::steady_clock::now() - start < std::chrono::seconds(10));
  CHECK(failure("read x; exit 3") ==
        "rewards[1] (c): reward command 'sh' exited with status 3 after 0 of 3 answers" + kStderr);
  CHECK(failure("read x; echo 1") ==
        "rewards[1] (c): reward command 'sh' exited with status 0 after 1 of 3 answers" + kStderr);
  CHECK(failure("read x; kill -9 $$") ==
        "rewards[1] (c): reward command 'sh' was killed by signal 9 after 0 of 3 answers" + kStderr);
  // an answer that never ends its line is not read into memory without bound
  CHECK(failure("read x; exec cat /dev/zero") ==
        "rewards[1] (c): reward command 'sh' wrote more than 1048576 bytes without ending a line after 0 of 3 answers");
  CHECK(failure("while read l; do echo abc; done") ==
        "rewards[1] (c): reward command 'sh' answered 'abc' for completion 1: not a number; print one number a line "
        "(null: unscorable)");
  CHECK(error_of([] {
          RewardCommand r(sh("read a; echo 1; echo 2; while read b; do echo 3; done"), 30, "rewards[1] (c)");
          r.score(items(1));
          std::this_thread::sleep_for(std::chrono::milliseconds(300));  // its extra line arrives
          r.score(items(1));
        }) == "rewards[1] (c): reward command 'sh' answered more lines than the completions it was given (1 too many)");
  CHECK(error_of([] { RewardCommand({"/nonexistent/reward"}, 30, "rewards[1] (c)"); }) ==
        "rewards[1] (c): cannot start '/nonexistent/reward': No such file or directory");
  CHECK(error_of([] { RewardCommand({}, 30, "rewards[1] (c)"); }) ==
        "rewards[1] (c): give the program to run: run: [program, args…]");
}
