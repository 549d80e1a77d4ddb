// UTF-8 and Unicode normalization helpers that behave like the Rust code HF tokenizers uses.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace lorarun::tok::unicode {

// Decodes the code point starting at s[i] of valid UTF-8 and moves i past it.
inline char32_t next_cp(std::string_view s, size_t& i) {
  auto b = [&](size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[k])); };
  char32_t c = b(i);
  if (c < 0x80) {
    i += 1;
    return c;
  }
  if (c < 0xE0) {
    c = ((c & 0x1F) << 6) | (b(i + 1) & 0x3F);
    i += 2;
    return c;
  }
  if (c < 0xF0) {
    c = ((c & 0x0F) << 12) | ((b(i + 1) & 0x3F) << 6) | (b(i + 2) & 0x3F);
    i += 3;
    return c;
  }
  c = ((c & 0x07) << 18) | ((b(i + 1) & 0x3F) << 12) | ((b(i + 2) & 0x3F) << 6) | (b(i + 3) & 0x3F);
  i += 4;
  return c;
}

// Byte length of the UTF-8 sequence that starts with lead byte c.
inline size_t utf8_len(unsigned char c) {
  if (c < 0x80) return 1;
  if (c < 0xE0) return 2;
  if (c < 0xF0) return 3;
  return 4;
}

void append_utf8(std::string& out, char32_t cp);

// True when s is well-formed UTF-8 (no surrogates, no overlongs), as Rust's str requires.
bool is_valid_utf8(std::string_view s);

// Rust's String::from_utf8_lossy: each maximal invalid subsequence becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes);

// Unicode White_Space, which is what Rust's char::is_whitespace and Oniguruma's \s test.
bool is_white_space(char32_t c);

// Canonical composition/decomposition with the Unicode tables of HF tokenizers' NFC/NFD.
std::string nfc(std::string_view s);
std::string nfd(std::string_view s);

}  // namespace lorarun::tok::unicode
