// Files that are either complete or absent: write to a temporary name, fsync, rename.
#pragma once
#include <cstddef>
#include <string>

namespace lorarun::io {

// Streams to "<path>.tmp.<pid>"; commit() fsyncs and renames it over `path`. Destroyed
// without commit() (an error on the way), it removes the temporary file.
class AtomicFile {
 public:
  explicit AtomicFile(std::string path);
  ~AtomicFile();
  AtomicFile(const AtomicFile&) = delete;
  AtomicFile& operator=(const AtomicFile&) = delete;
  void write(const void* data, size_t n);
  void commit();

 private:
  std::string path_, tmp_;
  int fd_ = -1;
};

void write_file_atomic(const std::string& path, const std::string& contents);

// The whole file, or lorarun::Error naming it.
std::string read_file(const std::string& path);

// Removes `path` and everything below it; no error when it does not exist. (Not
// std::filesystem::remove_all: libtorch.so exports its own copy of that symbol, which the
// dynamic linker may bind instead of libstdc++'s, and it crashes on non-empty directories.)
void remove_tree(const std::string& path);

// fsync a directory so a rename inside it is durable.
void sync_dir(const std::string& dir);

// Gives back the memory of the whole pages in [data, data + n) of a read-only mapping (a tensor
// that has been copied out): they are read from the file again if touched.
void drop_pages(const std::byte* data, size_t n);

}  // namespace lorarun::io
