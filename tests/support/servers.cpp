#include "support/servers.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <cstdlib>

namespace lorarun::test {

std::string test_uri() {
  const char* uri = std::getenv("LORARUN_TEST_MONGODB_URI");
  if (!uri || !*uri)
    FAIL("LORARUN_TEST_MONGODB_URI is not set: run the tests with scripts/test, which starts FerretDB");
  return uri;
}

int free_port() {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof addr;
  bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  close(fd);
  return ntohs(addr.sin_port);
}

SilentPort::SilentPort() : fd(socket(AF_INET, SOCK_STREAM, 0)) {
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t n = sizeof a;
  REQUIRE(bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0);
  REQUIRE(getsockname(fd, reinterpret_cast<sockaddr*>(&a), &n) == 0);
  REQUIRE(listen(fd, 64) == 0);
  port = ntohs(a.sin_port);
}

SilentPort::~SilentPort() { close(fd); }

}  // namespace lorarun::test
