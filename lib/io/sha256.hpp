// SHA-256 (FIPS 180-4) of strings and files, for checkpoint hashes in run records.
#pragma once
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace lorarun::io {

// Incremental hashing: update() any number of times, then hex() once.
class Sha256 {
 public:
  Sha256();
  void update(const void* data, size_t n);
  // The digest as 64 lowercase hex digits (as sha256sum prints it); ends the hashing.
  std::string hex();

 private:
  void block(const uint8_t* p);  // one 64-byte block into state_
  std::array<uint32_t, 8> state_;
  std::array<uint8_t, 64> buffer_{};
  size_t buffered_ = 0;
  uint64_t length_ = 0;  // bytes hashed so far
};

std::string sha256_hex(std::string_view data);

// Hash of a file's contents, read in 1 MiB pieces; lorarun::Error naming the file if unreadable.
std::string sha256_file(const std::string& path);

}  // namespace lorarun::io
