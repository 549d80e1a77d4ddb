#include "util/log.hpp"

#include <cstdio>

#include "util/secrets.hpp"

namespace lorarun {

void warn(const std::string& message) {
  std::fprintf(stderr, "warning: %s\n", scrub(message).c_str());
  std::fflush(stderr);
}

}  // namespace lorarun
