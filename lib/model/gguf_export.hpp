// Writing a model (after merge_lora) as one GGUF file laid out as llama.cpp's converter
// (convert_hf_to_gguf.py) writes it, so that llama.cpp and Ollama load it.
#pragma once
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "io/gguf.hpp"

namespace lorarun::model {

class CausalLM;

// "f32", "f16", "bf16", "q8_0" (the converter's --outtype names) -> the type of the 2-D weights;
// lorarun::Error naming the choices for anything else.
io::GgmlType parse_gguf_type(const std::string& name);

// general.file_type: llama.cpp's LlamaFileType for files whose 2-D weights are `type`
// (ALL_F32 0, MOSTLY_F16 1, MOSTLY_Q8_0 7, MOSTLY_BF16 32).
uint32_t llama_file_type(io::GgmlType type);

// The type the converter stores tensor `gguf_name` of `shape` (PyTorch order) in when its outtype
// is `type`: F32 for 1-D tensors, *_norm.weight and anything not a .weight; F16 where a row is not
// whole Q8_0 blocks (gguf-py's QuantError fallback); otherwise `type`.
io::GgmlType gguf_tensor_type(const std::string& gguf_name, const std::vector<int64_t>& shape, io::GgmlType type);

// The tokenizer.* metadata for `model`: copied verbatim from a .gguf base; from a HF directory's
// byte-level BPE tokenizer.json (tokenizer.ggml.model "gpt2") as the converter's _set_vocab_gpt2
// writes it (tokenizer.ggml.pre is "default": the converter names it by hashing what the tokenizer
// makes of a test text, which lorarun does not do). lorarun::Error naming any other kind.
std::vector<std::pair<std::string, io::GgufValue>> gguf_tokenizer_metadata(const CausalLM& model);

// Writes `model` (llama and mistral as GGUF architecture llama, qwen2 as qwen2) to `out_file`,
// which must not exist: the converter's metadata (general.*, <arch>.* hyperparameters,
// tokenizer.*) and tensors under llama.cpp's names, llama's Q and K rows permuted to llama.cpp's
// rotary order, 2-D weights as `type` (see gguf_tensor_type). Written under a temporary name,
// fsync'd and renamed. lorarun::Error for another family, or rope scaling other than linear.
void export_gguf(const CausalLM& model, const std::string& out_file, io::GgmlType type);

}  // namespace lorarun::model
