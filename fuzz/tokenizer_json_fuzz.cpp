// libFuzzer harness for lorarun::tok::Tokenizer::from_file / from_dir on untrusted tokenizer
// files, then the loaded tokenizer on a few texts.
//
// Input: TOKENIZER_JSON [ "\n---\n" TOKENIZER_CONFIG_JSON [ "\n---\n" TEXT ] ] ("\n---\n" never
// occurs in valid JSON). Without a config part the tokenizer.json is read with from_file,
// with one (even empty) the directory is read with from_dir. A tokenizer that loads encodes
// fixed texts and TEXT (with and without special tokens), decodes the ids, decodes a range
// of ids, and answers the vocabulary queries. Accepted: lorarun::Error; anything else
// escaping, a sanitizer report, a hang (-timeout) or a big allocation (-rss_limit_mb) is a
// finding. Build and run with scripts/fuzz; seeds come from fuzz/make_seeds.py.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common.hpp"
#include "tokenizer/tokenizer.hpp"

using lorarun::tok::Tokenizer;

namespace {

constexpr std::string_view kSeparator = "\n---\n";

// Texts that reach the usual code paths: spaces, digits, added-token look-alikes, marks
// (NFC/NFD), CJK, emoji (4-byte UTF-8), byte-fallback bytes, a long run of one character.
const std::vector<std::string>& texts() {
  static const std::vector<std::string> t = {
      "",
      "Hello world! It's 2024, isn't it?  ",
      " leading and  double  spaces\n\ttabs\r\n",
      "<s>a</s><unk><|endoftext|><mask>[MASK] hello world",
      "naïve cafe\xcc\x81 Ω Å ﬁ 東京 한국어 😀👍🏽 \xe2\x80\x8b",
      "12345 3.14159 ١٢٣ ⅷ",
      std::string(300, 'a') + std::string(40, ' ') + "x",
  };
  return t;
}

void exercise(const Tokenizer& tok, std::string_view extra_text) {
  std::vector<std::string_view> all(texts().begin(), texts().end());
  if (!extra_text.empty()) all.push_back(extra_text);
  for (std::string_view text : all) {
    for (bool special : {true, false}) {
      std::vector<int32_t> ids;
      if (!lorarun::fuzz::expect_only_lorarun_errors([&] { ids = tok.encode(text, special); })) continue;
      lorarun::fuzz::expect_only_lorarun_errors([&] {
        (void)tok.decode(ids, false);
        (void)tok.decode(ids, true);
      });
    }
  }
  std::vector<int32_t> range;
  for (int32_t id = -2; id < 300; ++id) range.push_back(id);
  range.push_back(INT32_MAX);
  range.push_back(INT32_MIN);
  lorarun::fuzz::expect_only_lorarun_errors([&] {
    (void)tok.decode(range, false);
    (void)tok.decode(range, true);
    for (int32_t id : range)
      if (auto s = tok.id_to_token(id)) (void)tok.token_to_id(*s);
    (void)tok.vocab_size();
    (void)tok.bos_id();
    (void)tok.eos_id();
    (void)tok.pad_id();
  });
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const std::string json_path = lorarun::fuzz::scratch_path("tokenizer.json");
  static const std::string config_path = lorarun::fuzz::scratch_path("tokenizer_config.json");
  static const std::string dir = json_path.substr(0, json_path.rfind('/'));
  std::string_view in(reinterpret_cast<const char*>(data), size);
  size_t cut = in.find(kSeparator);
  lorarun::fuzz::write_file(json_path, in.substr(0, cut));
  std::string_view text;
  bool with_config = cut != std::string_view::npos;
  if (with_config) {
    std::string_view rest = in.substr(cut + kSeparator.size());
    size_t cut2 = rest.find(kSeparator);
    lorarun::fuzz::write_file(config_path, rest.substr(0, cut2));
    if (cut2 != std::string_view::npos) text = rest.substr(cut2 + kSeparator.size());
  } else {
    std::filesystem::remove(config_path);
  }
  lorarun::fuzz::expect_only_lorarun_errors([&] {
    Tokenizer tok = with_config ? Tokenizer::from_dir(dir) : Tokenizer::from_file(json_path);
    exercise(tok, text);
  });
  return 0;
}
