// Errors meant for the user: one line that names the problem and the fix.
#pragma once
#include <stdexcept>
#include <string>

namespace lorarun {

// Thrown for bad input or environment; each main catches it once, prints it, exits non-zero.
struct Error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace lorarun
