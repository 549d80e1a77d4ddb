#include "util/log.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <mutex>

#include "util/error.hpp"
#include "util/secrets.hpp"
#include "util/untrusted.hpp"

namespace lorarun {
namespace {

// The one piece of global mutable state the house rules allow: where log lines go.
std::mutex g_mutex;
std::FILE* g_file = nullptr;

void to_file(const std::string& line) {
  if (!g_file) return;
  std::fprintf(g_file, "%s %s\n", utc_stamp().c_str(), line.c_str());
  std::fflush(g_file);
}

}  // namespace

std::string utc_stamp(std::time_t t) {
  std::tm utc{};
  gmtime_r(&t, &utc);
  char stamp[32];
  std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", &utc);
  return stamp;
}

std::string clock_text(int64_t s) {
  if (s < 3600) return fmt::format("{}:{:02}", s / 60, s % 60);
  return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
}

void log_to_file(int fd) {
  std::FILE* f = fdopen(fd, "a");
  if (!f) {
    const int e = errno;
    close(fd);
    throw Error(fmt::format("cannot use the log file: {}", std::strerror(e)));
  }
  std::lock_guard lock(g_mutex);
  if (g_file) std::fclose(g_file);
  g_file = f;
}

void info(const std::string& message, bool console) {
  const std::string line = one_line(scrub(message));
  std::lock_guard lock(g_mutex);
  if (console) {
    std::fprintf(stdout, "%s\n", line.c_str());
    std::fflush(stdout);
  }
  to_file(line);
}

void warn(const std::string& message) {
  const std::string line = "warning: " + one_line(scrub(message));
  std::lock_guard lock(g_mutex);
  std::fprintf(stderr, "%s\n", line.c_str());
  std::fflush(stderr);
  to_file(line);
}

void log_error(const std::string& message) {
  std::lock_guard lock(g_mutex);
  to_file("error: " + one_line(scrub(message)));
}

}  // namespace lorarun
