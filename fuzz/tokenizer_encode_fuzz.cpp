// libFuzzer harness for encode/decode of untrusted text and ids with real tokenizers.
//
// The tokenizers are the fixtures of scripts/fetch-tokenizers ($LORARUN_FUZZ_TOKENIZERS,
// default .fixtures/tokenizers): llama2 (SentencePiece-style: Metaspace normalizer, byte
// fallback, fused unk), gpt2 (byte-level) and llama3 (byte-level, Split regex, 256 added
// tokens), loaded once. Input: byte 0 picks the tokenizer (% 3) and the mode (bit 2):
//   text mode: the rest is text. Invalid UTF-8 must be a lorarun::Error; valid text is encoded
//     with and without special tokens and decoded, and for the byte-level tokenizers
//     decode(encode(x)) must give x back (HF tokenizers does, for any string).
//   ids mode: the rest is little-endian int32 ids (any value), decoded with and without
//     skip_special_tokens; ids below 2^20 are folded into the vocabulary range to hit tokens.
// Anything other than lorarun::Error escaping, a sanitizer report, a hang or a big
// allocation is a finding. Build and run with scripts/fuzz.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common.hpp"
#include "tokenizer/tokenizer.hpp"

using lorarun::tok::Tokenizer;

namespace {

struct Loaded {
  const char* name;
  bool byte_level;  // decode(encode(x)) == x
  std::unique_ptr<Tokenizer> tok;
};

std::vector<Loaded>& tokenizers() {
  static std::vector<Loaded> all = [] {
    const char* env = std::getenv("LORARUN_FUZZ_TOKENIZERS");
    std::string root = env && *env ? env : ".fixtures/tokenizers";
    std::vector<Loaded> v;
    for (auto [name, byte_level] : {std::pair{"llama2", false}, {"gpt2", true}, {"llama3", true}}) {
      try {
        v.push_back({name, byte_level, std::make_unique<Tokenizer>(Tokenizer::from_dir(root + "/" + name))});
      } catch (const std::exception& e) {
        lorarun::fuzz::finding(std::string("cannot load the fixture tokenizer: ") + e.what() +
                               " (set LORARUN_FUZZ_TOKENIZERS or run scripts/fetch-tokenizers)");
      }
    }
    return v;
  }();
  return all;
}

void text_mode(const Loaded& t, std::string_view text) {
  std::vector<int32_t> with, without;
  bool ok = lorarun::fuzz::expect_only_lorarun_errors([&] {
    with = t.tok->encode(text, true);
    without = t.tok->encode(text, false);
  });
  if (!ok) return;  // invalid UTF-8, which encode must (and did) reject with lorarun::Error
  lorarun::fuzz::expect_only_lorarun_errors([&] {
    std::string back = t.tok->decode(without, false);
    (void)t.tok->decode(with, true);
    if (t.byte_level && back != text)
      lorarun::fuzz::finding(std::string(t.name) + ": decode(encode(x)) != x for x = '" + std::string(text) +
                             "', got '" + back + "'");
  });
}

void ids_mode(const Loaded& t, std::string_view bytes) {
  std::vector<int32_t> ids(bytes.size() / 4);
  if (!ids.empty()) std::memcpy(ids.data(), bytes.data(), ids.size() * 4);
  const auto n = static_cast<int64_t>(t.tok->vocab_size()) + 8;
  for (int32_t& id : ids)
    if (id >= 0 && id < (1 << 20)) id = static_cast<int32_t>(id % n);
  lorarun::fuzz::expect_only_lorarun_errors([&] {
    (void)t.tok->decode(ids, false);
    (void)t.tok->decode(ids, true);
  });
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  tokenizers();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const Loaded& t = tokenizers()[data[0] % 3];
  std::string_view rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if (data[0] & 4)
    ids_mode(t, rest);
  else
    text_mode(t, rest);
  return 0;
}
