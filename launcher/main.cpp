// lorarun: a torchrun-style launcher for lora-train (or any command).
#include <unistd.h>
#include <climits>
#include <cstdio>
#include <exception>
#include <string>

#include "launch.hpp"
#include "util/error.hpp"

int main(int argc, char** argv) {
  try {
    char self[PATH_MAX] = {};
    const ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    const auto parsed = lorarun::launch::parse_args(argc, argv, n > 0 ? std::string(self, n) : argv[0]);
    if (parsed.exit_code >= 0) return parsed.exit_code;
    return lorarun::launch::run(parsed.config);
  } catch (const lorarun::Error& e) {
    std::fprintf(stderr, "lorarun: error: %s\n", e.what());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "lorarun: internal error: %s\n", e.what());
  }
  return 1;
}
