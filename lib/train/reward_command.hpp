// A reward computed by the user's own program, in any language: started once and kept running;
// each batch of completions goes to its stdin as JSON lines, and it answers one number a line.
#pragma once
#include <sys/types.h>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace lorarun::train {

class RewardCommand {
 public:
  // Starts `argv` (argv[0] found on PATH) with a socket for its stdin and stdout and this process's
  // stderr; `where` names the reward in messages ("rewards[2] (tests)"). Throws ConfigError when it
  // cannot be started.
  RewardCommand(std::vector<std::string> argv, double timeout_s, std::string where);
  // Closes its input (a well-behaved program then exits), waits a moment, then kills it.
  ~RewardCommand();
  RewardCommand(const RewardCommand&) = delete;
  RewardCommand& operator=(const RewardCommand&) = delete;

  // Writes each item as one JSON line and reads one answer a line, in order: a number, or `nan` /
  // `null` for a completion it cannot score (NaN: left out of its group's mean, advantaged 0). Throws
  // Error, after killing it, when it does not answer them all within timeout_s, exits, closes its
  // output, answers something else, or answered more lines for the batch before (seen when they
  // have arrived by the time this batch starts).
  std::vector<double> score(const std::vector<nlohmann::json>& items);

 private:
  [[noreturn]] void fail(const std::string& what);  // kills it, throws Error naming it and `what`
  void stop();

  std::vector<std::string> argv_;
  double timeout_s_;
  std::string where_;
  pid_t pid_ = -1;
  int fd_ = -1;         // our end of the socket: its stdin and stdout
  std::string buffer_;  // what it wrote past the last answer read
};

}  // namespace lorarun::train
