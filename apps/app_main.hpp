// The one place each app turns exceptions into a one-line error and an exit status.
#pragma once
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <filesystem>
#include <optional>
#include <string>

#include "util/error.hpp"
#include "util/secrets.hpp"
#include "util/untrusted.hpp"

namespace lorarun {
namespace detail {

// The message without the C++ stack trace a c10 error carries ("Exception raised from … frame #0 …"),
// even when it came wrapped in another error's text.
inline std::string without_backtrace(std::string m) {
  if (const size_t at = m.find("Exception raised from "); at != std::string::npos) m.erase(at);
  while (!m.empty() && (m.back() == '\n' || m.back() == ' ')) m.pop_back();
  return m;
}

inline std::string json_string(const std::string& s) {
  std::string json;
  for (const unsigned char ch : s) {
    if (ch == '"' || ch == '\\')
      json += {'\\', static_cast<char>(ch)};
    else if (ch < 0x20)
      json += fmt::format("\\u{:04x}", ch);
    else
      json += static_cast<char>(ch);
  }
  return json;
}

// Under lorarun or torchrun, also writes `line` to TORCHELASTIC_ERROR_FILE in torchrun's format,
// so the launcher's summary can name this rank's error; `blamed_rank` is the rank that caused it
// when that is another rank. Returns whether the file was written.
inline bool write_error_file(const std::string& line, std::optional<int> blamed_rank) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (!path || !*path) return false;
  FILE* f = std::fopen(path, "w");
  if (!f) return false;
  fmt::print(f, R"({{"message": {{"message": "{}", "extraInfo": {{"timestamp": "{}"{}}}}}}})", json_string(line),
             static_cast<long long>(std::time(nullptr)),
             blamed_rank ? fmt::format(R"(, "blamed_rank": {})", *blamed_rank) : std::string());
  return std::fclose(f) == 0;
}

// Prints "NAME: KIND: MESSAGE" (secrets scrubbed) and records it; returns the exit status 1.
// lorarun (LORARUN_ERROR_SUMMARY=1) prints the error file's line in its summary: the line is then
// printed there alone, once, rather than by every rank as well.
inline int fail(const char* name, const char* kind, const std::string& message,
                std::optional<int> blamed_rank = std::nullopt) {
  // This process is ending: the launcher's SIGTERM (sent once another rank ended first) must not
  // kill it between its error file and its exit, or the launcher sees a signal where this rank's
  // own status (kExitConfig: do not restart) was due. SIGKILL after the grace period still ends it.
  std::signal(SIGTERM, SIG_IGN);
  const std::string line = fmt::format("{}: {}: {}", name, kind, one_line(scrub(without_backtrace(message))));
  const char* summary = std::getenv("LORARUN_ERROR_SUMMARY");
  const bool recorded = write_error_file(line, blamed_rank);
  if (!recorded || !summary || std::string(summary) != "1") fmt::print(stderr, "{}\n", line);
  std::fflush(stderr);
  return 1;
}

inline const char*& app_name() {
  static const char* name = "lorarun";
  return name;
}

// An exception that escaped a thread of torch's (NCCL's watchdog) still ends in one line.
[[noreturn]] inline void on_terminate() {
  std::string m = "terminated without an exception (a bug)";
  if (const std::exception_ptr e = std::current_exception()) {
    try {
      std::rethrow_exception(e);
    } catch (const c10::Error& c) {
      m = c.what_without_backtrace();
    } catch (const std::exception& x) {
      m = x.what();
    } catch (...) {
      m = "an unknown exception escaped a thread (a bug)";
    }
  }
  fail(app_name(), "error", m.substr(0, m.find('\n')));
  std::_Exit(1);
}

}  // namespace detail

// Runs `body`; a lorarun::Error (bad input) or a torch error prints "NAME: error: …" with
// secrets scrubbed and exits 1 (kExitConfig for a ConfigError). Anything else is a bug and says
// so, still on one line.
template <class Body>
int app_main(const char* name, int argc, char** argv, Body body) {
  detail::app_name() = name;
  std::set_terminate(detail::on_terminate);
  try {
    return body(argc, argv);
  } catch (const PeerError& e) {
    return detail::fail(name, "error", e.what(), e.rank);
  } catch (const ConfigError& e) {
    detail::fail(name, "error", e.what());
    return kExitConfig;
  } catch (const Error& e) {
    return detail::fail(name, "error", e.what());
  } catch (const c10::Error& e) {
    const std::string m = e.what_without_backtrace();
    return detail::fail(name, "error", m.substr(0, m.find('\n')));
  } catch (const std::filesystem::filesystem_error& e) {  // a path the user gave that cannot be written or read
    return detail::fail(
        name, "error",
        fmt::format("cannot {} {}: {}: check that the path exists and this user may write there",
                    std::string_view(e.what()).find("create") != std::string_view::npos ? "create" : "use",
                    e.path1().string(), e.code().message()));
  } catch (const std::exception& e) {
    return detail::fail(name, "internal error", e.what());
  }
}

}  // namespace lorarun
