#include "util/input_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>
#include <cstring>

#include "util/error.hpp"

namespace lorarun {
namespace {

std::string named(const std::string& path, std::string_view what) {
  return what.empty() ? path : fmt::format("{} {}", what, path);
}

}  // namespace

const char* file_kind(unsigned mode) {
  return S_ISDIR(mode)                    ? "a directory"
         : S_ISFIFO(mode)                 ? "a FIFO"
         : S_ISCHR(mode) || S_ISBLK(mode) ? "a device"
         : S_ISSOCK(mode)                 ? "a socket"
                                          : "not a regular file";
}

int open_input(const std::string& path, std::string_view what) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  if (fd < 0) throw ConfigError(fmt::format("{} cannot be read: {}", named(path, what), std::strerror(errno)));
  struct stat st{};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    const std::string why = S_ISREG(st.st_mode) ? std::strerror(errno) : fmt::format("it is {}", file_kind(st.st_mode));
    ::close(fd);
    throw ConfigError(fmt::format("{} cannot be read: {}, not a file", named(path, what), why));
  }
  fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
  return fd;
}

std::string read_input(const std::string& path, std::string_view what) {
  const int fd = open_input(path, what);
  std::string out;
  char buf[1 << 16];
  for (;;) {
    const ssize_t k = ::read(fd, buf, sizeof buf);
    if (k < 0 && errno == EINTR) continue;
    if (k < 0) {
      const int e = errno;
      ::close(fd);
      throw ConfigError(fmt::format("{} cannot be read: {}", named(path, what), std::strerror(e)));
    }
    if (k == 0) break;
    out.append(buf, static_cast<size_t>(k));
  }
  ::close(fd);
  return out;
}

}  // namespace lorarun
