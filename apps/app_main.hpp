// The one place each app turns exceptions into a one-line error and an exit status.
#pragma once
#include <c10/util/Exception.h>
#include <exception>
#include <fmt/format.h>
#include <string>

#include "util/error.hpp"
#include "util/secrets.hpp"

namespace lorarun {

// Runs `body`; a lorarun::Error (bad input) or a torch error prints "NAME: error: …" with
// secrets scrubbed and exits 1. Anything else is a bug and says so, still on one line.
template <class Body>
int app_main(const char* name, int argc, char** argv, Body body) {
  try {
    return body(argc, argv);
  } catch (const Error& e) {
    fmt::print(stderr, "{}: error: {}\n", name, scrub(e.what()));
  } catch (const c10::Error& e) {
    const std::string m = e.what_without_backtrace();
    fmt::print(stderr, "{}: error: {}\n", name, scrub(m.substr(0, m.find('\n'))));
  } catch (const std::exception& e) {
    fmt::print(stderr, "{}: internal error: {}\n", name, scrub(e.what()));
  }
  return 1;
}

}  // namespace lorarun
