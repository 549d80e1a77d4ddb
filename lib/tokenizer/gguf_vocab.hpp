// The tokenizer a GGUF file's metadata describes (llama.cpp's tokenizer.ggml.* keys), turned into
// the tokenizer.json and tokenizer_config.json that transformers builds from the same keys.
#pragma once
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace lorarun::tok {

// Which transformers class builds a SentencePiece vocabulary (lib/model tells, by the file's
// architecture): LlamaTokenizer, GemmaTokenizer, or phi3's LlamaTokenizer with a prepending normalizer.
enum class SentencePieceKind { Llama, Gemma, Phi3 };

// The tokenizer keys of a GGUF file, as read by lib/model (this library does not read GGUF).
struct GgufVocab {
  std::string source;  // the file, for messages
  SentencePieceKind sentencepiece = SentencePieceKind::Llama;
  std::string model;  // tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
  std::string pre;    // tokenizer.ggml.pre: which split pattern the merges were learned on
  std::vector<std::string> tokens;
  std::vector<int64_t> token_types;  // 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte
  std::vector<std::string> merges;   // "a b"; a SentencePiece vocabulary may have none
  std::vector<double> scores;
  std::optional<int64_t> bos, eos, unk, pad;
  std::optional<bool> add_bos, add_eos;
  std::string chat_template;
};

// A Hugging Face tokenizer's two files.
struct HfTokenizerFiles {
  std::string tokenizer_json;
  std::string tokenizer_config_json;
};

// What transformers' GGUF loading (AutoTokenizer.from_pretrained(dir, gguf_file=...)) makes of
// `v`: the same vocabulary, merges (derived from the scores when a SentencePiece file has none),
// added tokens (control tokens special, user-defined ones not), split pattern for the `pre` names
// it knows (GPT-2's otherwise), post-processor and special tokens. Throws lorarun::Error naming
// the file for a tokenizer model other than gpt2 and llama, or inconsistent keys.
HfTokenizerFiles hf_tokenizer_files(const GgufVocab& v);

}  // namespace lorarun::tok
