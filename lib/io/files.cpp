#include "io/files.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <ftw.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <utility>

#include "util/error.hpp"
#include "util/input_file.hpp"

namespace lorarun::io {

namespace {

void write_all(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::write(fd, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) throw Error(fmt::format("writing {} failed: {}", path, std::strerror(errno)));
    p += k;
    n -= static_cast<size_t>(k);
  }
}

}  // namespace

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  tmp_ = fmt::format("{}.tmp.{}", path_, getpid());
  // A new file of our own: never through a name planted there (a link), never into another's file.
  for (int attempt = 0; attempt < 2 && fd_ < 0; ++attempt) {
    fd_ = open(tmp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd_ < 0 && errno == EEXIST) unlink(tmp_.c_str());  // an earlier process's leftover (unlink: not followed)
  }
  if (fd_ < 0) throw Error(fmt::format("cannot write {}: {}", path_, std::strerror(errno)));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    close(fd_);
    unlink(tmp_.c_str());
  }
}

void AtomicFile::write(const void* data, size_t n) { write_all(fd_, data, n, path_); }

void AtomicFile::commit() {
  if (fsync(fd_) != 0 || close(fd_) != 0) {
    fd_ = -1;
    unlink(tmp_.c_str());
    throw Error(fmt::format("writing {} failed: {}", path_, std::strerror(errno)));
  }
  fd_ = -1;
  if (std::rename(tmp_.c_str(), path_.c_str()) != 0) {
    unlink(tmp_.c_str());
    throw Error(fmt::format("cannot rename {} into place: {}", path_, std::strerror(errno)));
  }
  sync_dir(std::filesystem::path(path_).parent_path().string());
}

void write_file_atomic(const std::string& path, const std::string& contents) {
  AtomicFile f(path);
  f.write(contents.data(), contents.size());
  f.commit();
}

OutFile::OutFile(const std::string& path, Mode mode) : path_(path) {
  // (O_NONBLOCK: a FIFO planted there must not hold the open until something reads it)
  const int flags = O_WRONLY | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC | (mode == Mode::Append ? O_APPEND : 0);
  fd_ = ::open(path.c_str(), flags, 0644);
  if (fd_ < 0 && errno == ELOOP)
    throw ConfigError(
        fmt::format("{} is a symbolic link: lorarun writes its own files only, never through a link; "
                    "remove it",
                    path));
  if (fd_ < 0 && errno == ENXIO)  // a FIFO nothing reads
    throw ConfigError(fmt::format("will not write {}: it is a FIFO; remove it", path));
  if (fd_ < 0) throw Error(fmt::format("cannot write {}: {}", path, std::strerror(errno)));
  struct stat st{};
  std::string refused;
  if (fstat(fd_, &st) != 0)
    refused = std::strerror(errno);
  else if (!S_ISREG(st.st_mode))
    refused = fmt::format("it is {}", file_kind(st.st_mode));
  else if (st.st_nlink > 1)
    refused = fmt::format("it has {} hard links, so writing it would write another file too", st.st_nlink);
  if (!refused.empty()) {
    ::close(std::exchange(fd_, -1));
    throw ConfigError(fmt::format("will not write {}: {}; remove it", path, refused));
  }
  fcntl(fd_, F_SETFL, fcntl(fd_, F_GETFL) & ~O_NONBLOCK);
  if (mode == Mode::Truncate && ftruncate(fd_, 0) != 0) {  // (only once it is known to be ours)
    const int e = errno;
    ::close(std::exchange(fd_, -1));
    throw Error(fmt::format("cannot write {}: {}", path, std::strerror(e)));
  }
}

OutFile::~OutFile() {
  if (fd_ >= 0) ::close(fd_);
}

OutFile::OutFile(OutFile&& o) noexcept : path_(std::move(o.path_)), fd_(std::exchange(o.fd_, -1)) {}

OutFile& OutFile::operator=(OutFile&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    path_ = std::move(o.path_);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

void OutFile::write(const void* data, size_t n) { write_all(fd_, data, n, path_); }

int OutFile::release() { return std::exchange(fd_, -1); }

void refuse_links(const std::string& dir, std::string_view what) {
  std::error_code ec;
  for (auto it = std::filesystem::recursive_directory_iterator(dir, ec);
       !ec && it != std::filesystem::recursive_directory_iterator(); it.increment(ec)) {
    if (!it->is_symlink(ec)) continue;
    std::error_code read_ec;
    const std::filesystem::path target = std::filesystem::read_symlink(it->path(), read_ec);
    throw ConfigError(fmt::format(
        "{} {} holds a symbolic link, {} (to {}): a run writes only its own files there, never through a link; "
        "remove the link, or choose another {}",
        what, dir, it->path().string(), read_ec ? "?" : target.string(), what));
  }
}

std::string read_file(const std::string& path, std::string_view what) { return read_input(path, what); }

void sync_dir(const std::string& dir) {
  const int fd = open(dir.empty() ? "." : dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd >= 0) {
    fsync(fd);
    close(fd);
  }
}

void remove_tree(const std::string& path) {
  struct stat st{};
  if (lstat(path.c_str(), &st) != 0) return;
  auto remove_one = [](const char* p, const struct stat*, int, FTW*) { return std::remove(p) == 0 ? 0 : -1; };
  if (nftw(path.c_str(), remove_one, 16, FTW_DEPTH | FTW_PHYS) != 0)
    throw Error(fmt::format("cannot remove {}: {}", path, std::strerror(errno)));
}

void drop_pages(const std::byte* data, size_t n) {
  static const auto page = static_cast<uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<uintptr_t>(data);
  const uintptr_t first = (begin + page - 1) / page * page;
  const uintptr_t last = (begin + n) / page * page;
  if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_DONTNEED);
}

}  // namespace lorarun::io
