// Models out of a GGUF file: the config from its metadata, and its tensors under the Hugging Face
// names, dequantised to float32 in PyTorch's shape (GGUF lists dimensions innermost first; PyTorch
// outermost first).
#pragma once
#include <ATen/core/Tensor.h>
#include <memory>
#include <set>
#include <string>

#include "io/gguf.hpp"
#include "model/config.hpp"
#include "model/families.hpp"
#include "model/weights.hpp"

namespace lorarun::model {

// `t` of `file` as a new float32 CPU tensor of shape t.torch_shape(); the mapped pages are dropped
// afterwards. lorarun::Error (naming the file, the tensor and the supported types) for a type that
// cannot be dequantised.
at::Tensor dequantize(const io::GgufFile& file, const io::GgufTensorInfo& t);

// The same by name; lorarun::Error naming the file when it has no such tensor.
at::Tensor dequantize(const io::GgufFile& file, const std::string& name);

// Whether model.path names a GGUF file rather than a model directory: it ends in ".gguf".
bool is_gguf_path(const std::string& path);

// The config of a GGUF model from its metadata (<arch>.block_count, .embedding_length, ...), as
// llama.cpp reads it: architectures llama (mistral is llama in GGUF; rope_freqs as llama 3.x
// writes it), qwen2, qwen3, gemma2, gemma3, phi3 and gpt2; the vocabulary is token_embd's rows, the embeddings are tied
// when there is no output.weight. lorarun::Error naming the architecture and the supported ones, or the missing key.
ModelConfig gguf_config(const io::GgufFile& file);

// A GGUF model's tensors under the names CausalLM asks for (token_embd.weight is
// model.embed_tokens.weight, blk.N.attn_q.weight model.layers.N.self_attn.q_proj.weight, ...).
// Each load() dequantises one tensor and converts it to the dtype and device asked for, so no
// more than one float32 copy exists beyond the model's own tensors. Llama's Q and K rows are put
// back in Hugging Face's order: llama.cpp's converter interleaves the rotary halves of each head;
// GPT-2's Conv1D weights, which the converter stores [out, in], come back [in, out].
class GgufWeights : public WeightSource {
 public:
  GgufWeights(std::shared_ptr<const io::GgufFile> file, const ModelConfig& config);

  bool contains(const std::string& name) const override;
  at::Tensor load(const std::string& name, at::ScalarType dtype, at::Device device,
                  const std::vector<int64_t>& shape = {}) const override;
  GgufBlocks blocks(const std::string& name, at::ScalarType dtype, at::Device device,
                    const std::vector<int64_t>& shape = {}) const override;
  void release(const std::string&) const override {}  // load() has released the pages already
  // lorarun::Error naming the first tensor of the file that no load() asked for: a weight the
  // model would silently ignore (a bias or a rope_freqs table this architecture does not have).
  void check_all_used() const;

 private:
  // The file's tensor for HF `name` (its GGUF name into `g`), marked used; Error when missing.
  const io::GgufTensorInfo& tensor(const std::string& name, std::string& g) const;
  void check_shape(const std::string& g, const std::vector<int64_t>& got, const std::vector<int64_t>& want) const;
  int64_t permuted_heads(const std::string& g) const;  // llama's Q and K: their heads; else 0
  std::shared_ptr<const io::GgufFile> file_;
  ModelConfig config_;
  mutable std::set<std::string> used_;  // GGUF names
};

// What llama.cpp assumes of a gemma2/gemma3 file, which does not store it: queries scaled by
// head_dim's -1/2 power, or hidden/heads' for the family's large variant (told by its layer count).
double gemma_query_scalar(const ModelConfig& c, const FamilyTraits& family);
// llama.cpp's window pattern N: of each N layers, the first N - 1 are windowed and the last global.
std::vector<bool> windowed_every(int64_t layers, int64_t every);

// The GGUF name of a HF weight name ("model.layers.3.mlp.up_proj.weight" -> "blk.3.ffn_up.weight"),
// or "" when GGUF has no such tensor; `gemma`: Gemma's layer norms (gemma2, gemma3).
std::string gguf_tensor_name(const std::string& hf_name, bool gemma = false);

}  // namespace lorarun::model
