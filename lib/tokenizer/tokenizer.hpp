// Tokenizers read from a Hugging Face tokenizer.json, giving the same ids as HF `tokenizers`.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tokenizer/gguf_vocab.hpp"

namespace lorarun::tok {

// A BPE tokenizer (GPT-2, Llama 2/3, Mistral, Qwen, GPT-4o style) loaded from a model directory.
// Immutable after loading; encode/decode may be called from several threads at once.
class Tokenizer {
 public:
  // Reads DIR/tokenizer.json and, when present, DIR/tokenizer_config.json and
  // DIR/special_tokens_map.json (bos/eos/pad tokens, add_bos_token/add_eos_token).
  // Throws lorarun::Error with a one-line message naming the file and what is wrong.
  static Tokenizer from_dir(const std::string& dir);
  // The same from a tokenizer.json alone (no config: bos/eos/pad are unknown).
  static Tokenizer from_file(const std::string& tokenizer_json);
  // The same from the two files' contents (hf_tokenizer_files of a GGUF vocabulary); `source`
  // names where they came from in messages.
  static Tokenizer from_files(const HfTokenizerFiles& files, const std::string& source);

  Tokenizer(Tokenizer&&) noexcept;
  Tokenizer& operator=(Tokenizer&&) noexcept;
  ~Tokenizer();

  // Text (valid UTF-8) to ids, as HF's Tokenizer.encode(text, add_special_tokens).ids:
  // with add_special_tokens, the tokenizer.json post_processor adds its special tokens.
  std::vector<int32_t> encode(std::string_view text, bool add_special_tokens = true) const;
  // Many texts on `threads` threads (0: hardware concurrency); same results as encode.
  std::vector<std::vector<int32_t>> encode_batch(std::span<const std::string> texts, bool add_special_tokens = true,
                                                 unsigned threads = 0) const;
  // encode(text, false) with where each token came from: the byte range [first, second) of
  // `text` (empty where a token stands for no byte of it, like a prepended "▁"), as HF's
  // Encoding.offsets are the character ranges. Throws lorarun::Error when the tokens do not
  // spell the text (a normalizer that rewrites it, such as NFC on non-NFC input).
  struct Encoding {
    std::vector<int32_t> ids;
    std::vector<std::pair<size_t, size_t>> offsets;
  };
  Encoding encode_with_offsets(std::string_view text) const;
  // Ids to text, as HF's Tokenizer.decode; unknown ids are skipped like HF does.
  std::string decode(std::span<const int32_t> ids, bool skip_special_tokens = false) const;

  std::optional<int32_t> token_to_id(std::string_view token) const;
  // True for the tokens of tokenizer.json's "added_tokens" (special or not).
  bool is_added(int32_t id) const;
  std::optional<std::string> id_to_token(int32_t id) const;
  // Distinct tokens of the model vocabulary and the added tokens (HF's get_vocab_size(True)).
  size_t vocab_size() const;
  // One past the largest id the tokenizer can produce (vocabulary and added tokens): the rows an
  // embedding needs.
  int64_t id_bound() const;

  // From tokenizer_config.json / special_tokens_map.json; nullopt when not configured.
  std::optional<int32_t> bos_id() const;
  std::optional<int32_t> eos_id() const;
  std::optional<int32_t> pad_id() const;
  // transformers' add_bos_token/add_eos_token flags, for information: encode() follows the
  // post_processor of tokenizer.json, which is what HF tokenizers does.
  bool add_bos_token() const;
  bool add_eos_token() const;
  // The chat template (Jinja) transformers would use: DIR/chat_template.jinja, else
  // tokenizer_config.json's chat_template (a string, or the "default" of a list of
  // {name, template}); a GGUF's tokenizer.chat_template. Empty when there is none.
  const std::string& chat_template() const;

  struct Impl;

 private:
  explicit Tokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace lorarun::tok
