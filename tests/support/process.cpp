#include "support/process.hpp"

#include <fmt/format.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cerrno>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

namespace lorarun::test {

Result sh(const std::string& cmd, Capture what) {
  const auto t0 = std::chrono::steady_clock::now();
  Result r;
  FILE* p = popen((cmd + (what == Capture::Both ? " 2>&1" : " 2>&1 >/dev/null")).c_str(), "r");
  if (!p) return r;
  char buf[4096];
  for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) r.output.append(buf, n);
  const int st = pclose(p);
  r.status = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return r;
}

std::string bin(const std::string& name) { return fmt::format("'{}/{}'", LORARUN_BIN_DIR, name); }

std::string temp_dir(const std::string& name) {
  const auto dir =
      std::filesystem::path(LORARUN_BIN_DIR).parent_path() / "test-tmp" / fmt::format("{}-{}", name, getpid());
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir);
  return dir.string();
}

namespace {
// State letter and process group of `pid` from /proc/PID/stat; state 0 if it is gone.
std::pair<char, pid_t> proc_stat(const std::string& pid) {
  std::ifstream stat("/proc/" + pid + "/stat");
  std::string line;
  std::getline(stat, line);
  const size_t close = line.rfind(')');
  if (close == std::string::npos) return {0, 0};
  std::istringstream rest(line.substr(close + 2));
  char state = 0;
  pid_t ppid = 0, pgrp = 0;
  rest >> state >> ppid >> pgrp;
  return {state, pgrp};
}
}  // namespace

bool alive(pid_t pid) {
  const char state = proc_stat(std::to_string(pid)).first;
  return state != 0 && state != 'Z';
}

bool group_alive(pid_t pgid) {
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    const auto [state, pgrp] = proc_stat(name);
    if (pgrp == pgid && state != 0 && state != 'Z') return true;
  }
  return false;
}

std::vector<pid_t> launched_pids(const std::string& output) {
  std::smatch m;
  std::vector<pid_t> pids;
  if (std::regex_search(output, m, std::regex(R"(\(pids ([0-9 ]+)\))"))) {
    std::istringstream in(m[1].str());
    for (pid_t p; in >> p;) pids.push_back(p);
  }
  return pids;
}

std::string read_file(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

int count_lines(const std::string& s) {
  std::istringstream in(s);
  int n = 0;
  for (std::string line; std::getline(in, line);) n += !line.empty();
  return n;
}

std::vector<std::string> lines_with(const std::string& s, const std::string& needle) {
  std::istringstream in(s);
  std::vector<std::string> out;
  for (std::string line; std::getline(in, line);)
    if (line.find(needle) != std::string::npos) out.push_back(line);
  return out;
}

size_t occurrences(const std::string& s, const std::string& needle) {
  size_t n = 0;
  for (size_t at = s.find(needle); at != std::string::npos; at = s.find(needle, at + 1)) ++n;
  return n;
}

}  // namespace lorarun::test
