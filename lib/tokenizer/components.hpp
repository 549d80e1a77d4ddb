// The pipeline stages of a tokenizer.json (normalizer, pre_tokenizer, post_processor,
// decoder), each built from its JSON object and behaving as the HF tokenizers type of that name.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace lorarun::tok {

// A part of the input on its way to the model. id >= 0: an added token, already final.
// at_start: the part begins at offset 0 of the original text (Metaspace's "first" scheme).
struct Piece {
  std::string text;
  bool at_start = false;
  int32_t id = -1;
};

struct Normalizer {
  virtual ~Normalizer() = default;
  virtual void normalize(std::string& s) const = 0;
};

struct PreTokenizer {
  virtual ~PreTokenizer() = default;
  // Splits or rewrites every piece that is not an added token; empty pieces are dropped.
  virtual void pre_tokenize(std::vector<Piece>& pieces) const = 0;
};

struct PostProcessor {
  virtual ~PostProcessor() = default;
  virtual void process(std::vector<int32_t>& ids, bool add_special_tokens) const = 0;
  // How many ids process() adds to one sequence (truncation leaves room for them).
  virtual size_t added_tokens() const = 0;
};

struct Decoder {
  virtual ~Decoder() = default;
  // HF's decode_chain: token strings in, token strings out (joined by the caller).
  virtual void decode_chain(std::vector<std::string>& tokens) const = 0;
};

// Each returns nullptr for a JSON null and throws lorarun::Error for an unsupported type.
// depth: how many Sequences enclose j (nesting is capped, as serde_json caps it for HF).
std::unique_ptr<Normalizer> make_normalizer(const nlohmann::json& j, int depth = 0);
std::unique_ptr<PreTokenizer> make_pre_tokenizer(const nlohmann::json& j, int depth = 0);
std::unique_ptr<PostProcessor> make_post_processor(const nlohmann::json& j, int depth = 0);
std::unique_ptr<Decoder> make_decoder(const nlohmann::json& j, int depth = 0);

// An integer of tokenizer.json in [lo, hi], or lorarun::Error naming `what`. (nlohmann's
// get<int>() turns 2^32 + 1 into 1 and 1e30 or -1.5 into undefined behaviour.)
int64_t json_int(const nlohmann::json& j, std::string_view what, int64_t lo, int64_t hi);

// GPT-2's byte-to-character table: byte b is the character byte_char(b) (UTF-8).
const std::string& byte_char(unsigned char b);

}  // namespace lorarun::tok
