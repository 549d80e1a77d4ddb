// Files that are either complete or absent: write to a temporary name, fsync, rename.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

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

// A file this process writes, appended to or started empty, in a directory others may write to
// before the run (an output directory): opened without following a symbolic link, and refused
// (ConfigError naming it) when it is a link, not a regular file, or has other hard links, so a
// planted name cannot make the run write to a file elsewhere.
class OutFile {
 public:
  enum class Mode { Append, Truncate };
  OutFile() = default;
  OutFile(const std::string& path, Mode mode);
  ~OutFile();
  OutFile(OutFile&& o) noexcept;
  OutFile& operator=(OutFile&& o) noexcept;
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;
  bool is_open() const { return fd_ >= 0; }
  // All of `data`, or lorarun::Error naming the file.
  void write(const void* data, size_t n);
  void write(const std::string& data) { write(data.data(), data.size()); }
  // The descriptor, now the caller's (to hand to fdopen).
  int release();

 private:
  std::string path_;
  int fd_ = -1;
};

// Throws ConfigError naming the first symbolic link found in `dir` or below it (not following
// links), as `what` ("checkpoint.output_dir") says where `dir` came from: a run refuses to write
// into a directory where a planted link could redirect what it writes.
void refuse_links(const std::string& dir, std::string_view what);

// The whole file, or ConfigError naming it (util/input_file.hpp's checks).
std::string read_file(const std::string& path, std::string_view what = "");

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
