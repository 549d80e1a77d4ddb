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
#include <fstream>
#include <sstream>

#include "util/error.hpp"

namespace lorarun::io {

AtomicFile::AtomicFile(std::string path) : path_(std::move(path)) {
  tmp_ = fmt::format("{}.tmp.{}", path_, getpid());
  fd_ = open(tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) throw Error(fmt::format("cannot write {}: {}", path_, std::strerror(errno)));
}

AtomicFile::~AtomicFile() {
  if (fd_ >= 0) {
    close(fd_);
    unlink(tmp_.c_str());
  }
}

void AtomicFile::write(const void* data, size_t n) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t k = ::write(fd_, p, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) throw Error(fmt::format("writing {} failed: {}", path_, std::strerror(errno)));
    p += k;
    n -= static_cast<size_t>(k);
  }
}

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

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error(fmt::format("cannot read {}: {}", path, std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

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
