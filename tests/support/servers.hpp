// What the tests connect to: the test FerretDB that scripts/test starts, and loopback ports that
// nothing listens on or nothing answers (an unreachable server without leaving the machine).
#pragma once
#include <string>

namespace lorarun::test {

// LORARUN_TEST_MONGODB_URI; fails the test when it is not set.
std::string test_uri();

// A loopback port nobody listens on now.
int free_port();

// A port on 127.0.0.1 whose connections the kernel accepts and nobody ever answers: a wrong or
// firewalled host, without leaving the loopback interface. Closed on destruction.
struct SilentPort {
  int fd = -1, port = 0;
  SilentPort();
  ~SilentPort();
  SilentPort(const SilentPort&) = delete;
  SilentPort& operator=(const SilentPort&) = delete;
};

}  // namespace lorarun::test
