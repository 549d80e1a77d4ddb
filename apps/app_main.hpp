// The one place each app turns exceptions into a one-line error and an exit status.
#pragma once
#include <c10/util/Exception.h>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <exception>
#include <fmt/format.h>
#include <string>

#include "util/error.hpp"
#include "util/secrets.hpp"

namespace lorarun {
namespace detail {

// Under lorarun or torchrun, also writes `line` to TORCHELASTIC_ERROR_FILE in torchrun's format,
// so the launcher's summary can name this rank's error.
inline void write_error_file(const std::string& line) {
  const char* path = std::getenv("TORCHELASTIC_ERROR_FILE");
  if (!path || !*path) return;
  std::string json;
  for (const unsigned char ch : line) {
    if (ch == '"' || ch == '\\') json += {'\\', static_cast<char>(ch)};
    else if (ch < 0x20) json += fmt::format("\\u{:04x}", ch);
    else json += static_cast<char>(ch);
  }
  if (FILE* f = std::fopen(path, "w")) {
    fmt::print(f, R"({{"message": {{"message": "{}", "extraInfo": {{"timestamp": "{}"}}}}}})", json,
               static_cast<long long>(std::time(nullptr)));
    std::fclose(f);
  }
}

// Prints "NAME: KIND: MESSAGE" (secrets scrubbed) and records it; returns the exit status 1.
inline int fail(const char* name, const char* kind, const std::string& message) {
  const std::string line = fmt::format("{}: {}: {}", name, kind, scrub(message));
  fmt::print(stderr, "{}\n", line);
  write_error_file(line);
  return 1;
}

}  // namespace detail

// Runs `body`; a lorarun::Error (bad input) or a torch error prints "NAME: error: …" with
// secrets scrubbed and exits 1. Anything else is a bug and says so, still on one line.
template <class Body>
int app_main(const char* name, int argc, char** argv, Body body) {
  try {
    return body(argc, argv);
  } catch (const Error& e) {
    return detail::fail(name, "error", e.what());
  } catch (const c10::Error& e) {
    const std::string m = e.what_without_backtrace();
    return detail::fail(name, "error", m.substr(0, m.find('\n')));
  } catch (const std::exception& e) {
    return detail::fail(name, "internal error", e.what());
  }
}

}  // namespace lorarun
