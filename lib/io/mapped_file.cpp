#include "io/mapped_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#include <cerrno>
#include <cstring>

#include "util/error.hpp"
#include "util/input_file.hpp"

namespace lorarun::io {

MappedFile::MappedFile(const std::string& path, Access access) {
  const int fd = open_input(path);
  struct stat st{};
  if (fstat(fd, &st) != 0) {
    const int e = errno;
    close(fd);
    throw Error(fmt::format("cannot read {}: {}", path, std::strerror(e)));
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ == 0) {
    close(fd);
    return;
  }
  const int prot = access == Access::CopyOnWrite ? PROT_READ | PROT_WRITE : PROT_READ;
  void* m = mmap(nullptr, size_, prot, MAP_PRIVATE, fd, 0);
  const int e = errno;
  close(fd);  // the mapping keeps the file
  if (m == MAP_FAILED) throw Error(fmt::format("cannot map {}: {}", path, std::strerror(e)));
  data_ = static_cast<const std::byte*>(m);
}

MappedFile::~MappedFile() {
  if (data_) munmap(const_cast<std::byte*>(data_), size_);
}

}  // namespace lorarun::io
