// model.path: a Hugging Face model directory, a model id found in the local HF cache, or a .gguf
// file; and the tokenizer that goes with it.
#pragma once
#include <string>

#include "tokenizer/tokenizer.hpp"

namespace lorarun::model {

// Returns `path_or_id` if it is a directory; otherwise the snapshot directory of that model id
// in the Hugging Face cache ($HF_HUB_CACHE, $HF_HOME/hub, $XDG_CACHE_HOME/huggingface/hub or
// ~/.cache/huggingface/hub), following refs/main. Nothing is downloaded: a model in neither
// place is a lorarun::Error that says where it looked and how to get the model.
std::string resolve_model_path(const std::string& path_or_id);

// The tokenizer of a model: tokenizer.json (+ tokenizer_config.json) of a model directory or
// cached model id, or the tokenizer a .gguf file's metadata describes (see gguf_vocab.hpp).
tok::Tokenizer load_tokenizer(const std::string& path_or_id);

// A .gguf file's tokenizer as the two Hugging Face files (what load_tokenizer reads, and what an
// export to a model directory writes).
tok::HfTokenizerFiles gguf_tokenizer_files(const std::string& gguf_path);

}  // namespace lorarun::model
