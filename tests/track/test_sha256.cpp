// Our SHA-256 against FIPS 180-4's published vectors and against sha256sum.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <fstream>
#include <random>

#include "io/sha256.hpp"
#include "support/process.hpp"
#include "util/error.hpp"

using lorarun::io::sha256_hex;

TEST_CASE("sha256 of the published test vectors") {
  CHECK(sha256_hex("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(sha256_hex("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(sha256_hex("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(sha256_hex(std::string(1000000, 'a')) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST_CASE("sha256 fed in uneven pieces equals sha256 in one piece") {
  const std::string a(1000000, 'a');
  lorarun::io::Sha256 h;
  for (size_t at = 0, n = 1; at < a.size(); at += n, n = n * 7 % 1000 + 1)
    h.update(a.data() + at, std::min(n, a.size() - at));
  CHECK(h.hex() == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
  // Lengths around the padding boundary (55, 56, 63, 64 bytes) go through the same path.
  for (size_t n : {55, 56, 63, 64, 65}) {
    const std::string s(n, 'x');
    const auto r = lorarun::test::sh(fmt::format("printf '%{}s' '' | tr ' ' x | sha256sum", n));
    CHECK(r.output.substr(0, 64) == sha256_hex(s));
  }
}

TEST_CASE("sha256 of a file equals sha256sum's") {
  const std::string dir = lorarun::test::temp_dir("track-sha256");
  const std::string path = dir + "/blob.bin";
  std::mt19937 rng(7);
  std::string bytes((3 << 20) + 7, '\0');  // crosses the 1 MiB read size
  for (char& c : bytes) c = static_cast<char>(rng());
  std::ofstream(path, std::ios::binary) << bytes;
  const auto r = lorarun::test::sh(fmt::format("sha256sum '{}'", path));
  REQUIRE(r.status == 0);
  CHECK(lorarun::io::sha256_file(path) == r.output.substr(0, 64));
  CHECK(lorarun::io::sha256_file(path) == sha256_hex(bytes));
}

TEST_CASE("sha256 of a missing file is an error naming it") {
  CHECK_THROWS_WITH(lorarun::io::sha256_file("/nonexistent/adapter.safetensors"),
                    Catch::StartsWith("cannot read /nonexistent/adapter.safetensors to hash it"));
}
