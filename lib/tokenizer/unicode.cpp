#include "tokenizer/unicode.hpp"

#include <algorithm>
#include <bitset>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace lorarun::tok::unicode {
namespace {

struct CccEntry {
  char32_t cp;
  uint8_t ccc;
};
struct DecompEntry {
  char32_t cp, first, second;
};  // second == 0: a singleton mapping
struct ComposeEntry {
  char32_t first, second, composite;
};
#include "tokenizer/unicode_data.inc"

// Hangul syllables compose and decompose algorithmically (Unicode 3.12).
constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
constexpr char32_t kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount, kSCount = kLCount * kNCount;

uint8_t ccc(char32_t c) {
  if (c < 0x300) return 0;
  auto it =
      std::lower_bound(std::begin(kCcc), std::end(kCcc), c, [](const CccEntry& e, char32_t v) { return e.cp < v; });
  return it != std::end(kCcc) && it->cp == c ? it->ccc : 0;
}

const DecompEntry* decomposition(char32_t c) {
  auto it = std::lower_bound(std::begin(kDecomp), std::end(kDecomp), c,
                             [](const DecompEntry& e, char32_t v) { return e.cp < v; });
  return it != std::end(kDecomp) && it->cp == c ? &*it : nullptr;
}

void decompose(char32_t c, std::u32string& out) {
  if (c >= kSBase && c < kSBase + kSCount) {
    char32_t s = c - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (const DecompEntry* d = c >= 0xC0 ? decomposition(c) : nullptr) {
    decompose(d->first, out);
    if (d->second) decompose(d->second, out);
    return;
  }
  out.push_back(c);
}

std::optional<char32_t> compose_pair(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + kSCount && (a - kSBase) % kTCount == 0 && b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  auto it = std::lower_bound(
      std::begin(kCompose), std::end(kCompose), std::pair{a, b},
      [](const ComposeEntry& e, std::pair<char32_t, char32_t> v) { return std::pair{e.first, e.second} < v; });
  if (it != std::end(kCompose) && it->first == a && it->second == b) return it->composite;
  return std::nullopt;
}

// Code points below 0x10000 that normalization may change or combine (the quick check).
const std::bitset<0x10000>& bmp_unsafe() {
  static const auto table = [] {
    auto t = std::make_unique<std::bitset<0x10000>>();
    for (const auto& e : kCcc)
      if (e.cp < 0x10000) t->set(e.cp);
    for (const auto& e : kDecomp)
      if (e.cp < 0x10000) t->set(e.cp);
    for (const auto& e : kCompose)
      if (e.second < 0x10000) t->set(e.second);
    for (char32_t c = kVBase; c < kVBase + kVCount; ++c) t->set(c);
    for (char32_t c = kTBase + 1; c < kTBase + kTCount; ++c) t->set(c);
    return t;
  }();
  return *table;
}

bool maybe_changes(std::string_view s) {
  const auto& unsafe = bmp_unsafe();
  for (size_t i = 0; i < s.size();) {
    if (static_cast<unsigned char>(s[i]) < 0xCC) {
      i += utf8_len(s[i]);
      continue;
    }  // < U+0300
    char32_t c = next_cp(s, i);
    if (c >= 0x10000 || unsafe.test(c)) return true;
  }
  return false;
}

// Full canonical decomposition followed by canonical ordering of each run of marks.
std::u32string decompose_all(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) decompose(next_cp(s, i), out);
  for (size_t i = 0; i < out.size();) {
    if (ccc(out[i]) == 0) {
      ++i;
      continue;
    }
    size_t j = i;
    while (j < out.size() && ccc(out[j]) != 0) ++j;
    std::stable_sort(out.begin() + i, out.begin() + j, [](char32_t a, char32_t b) { return ccc(a) < ccc(b); });
    i = j;
  }
  return out;
}

std::string to_utf8(const std::u32string& cps) {
  std::string out;
  out.reserve(cps.size() * 3);
  for (char32_t c : cps) append_utf8(out, c);
  return out;
}

}  // namespace

void append_utf8(std::string& out, char32_t c) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xC0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xE0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out.push_back(static_cast<char>(0xF0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

namespace {
// Length of the valid UTF-8 sequence at s[i], or 0 with *bad set to the length of the
// maximal invalid prefix (Unicode's "maximal subpart", as Rust's Utf8Chunks reports it).
size_t valid_sequence(std::string_view s, size_t i, size_t* bad) {
  auto at = [&](size_t k) { return static_cast<unsigned char>(s[k]); };
  unsigned char c = at(i);
  if (c < 0x80) return 1;
  size_t need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (c >= 0xC2 && c <= 0xDF)
    need = 1;
  else if (c >= 0xE0 && c <= 0xEF) {
    need = 2;
    if (c == 0xE0) lo = 0xA0;
    if (c == 0xED) hi = 0x9F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    need = 3;
    if (c == 0xF0) lo = 0x90;
    if (c == 0xF4) hi = 0x8F;
  } else {
    *bad = 1;
    return 0;
  }
  for (size_t k = 1; k <= need; ++k) {
    if (i + k >= s.size()) {
      *bad = k;
      return 0;
    }
    unsigned char b = at(i + k);
    bool ok = k == 1 ? (b >= lo && b <= hi) : (b >= 0x80 && b <= 0xBF);
    if (!ok) {
      *bad = k;
      return 0;
    }
  }
  return need + 1;
}
}  // namespace

bool is_valid_utf8(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    size_t bad = 0, n = valid_sequence(s, i, &bad);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    size_t bad = 0, n = valid_sequence(s, i, &bad);
    if (n) {
      out.append(s.substr(i, n));
      i += n;
    } else {
      out.append("\xEF\xBF\xBD");
      i += bad;
    }
  }
  return out;
}

bool is_white_space(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

std::string nfd(std::string_view s) {
  // Precomposed letters from U+00C0 and Hangul syllables decompose: only below that is safe.
  if (std::all_of(s.begin(), s.end(), [](char c) { return static_cast<unsigned char>(c) < 0xC3; }))
    return std::string(s);
  return to_utf8(decompose_all(s));
}

std::string nfc(std::string_view s) {
  if (!maybe_changes(s)) return std::string(s);
  std::u32string out;
  size_t starter = std::u32string::npos;
  int last = -1;  // class of the newest mark after the starter; -1: none since the starter
  for (char32_t c : decompose_all(s)) {
    int cc = ccc(c);
    if (starter != std::u32string::npos && (last < 0 || (last > 0 && last < cc))) {
      if (auto comp = compose_pair(out[starter], c)) {
        out[starter] = *comp;
        continue;
      }
    }
    if (cc == 0) {
      starter = out.size();
      last = -1;
    } else
      last = cc;
    out.push_back(c);
  }
  return to_utf8(out);
}

}  // namespace lorarun::tok::unicode
