// Tensors out of safetensors files: one file, or shards listed in model.safetensors.index.json.
#pragma once
#include <ATen/core/Tensor.h>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "io/safetensors.hpp"
#include "model/gguf_blocks.hpp"

namespace lorarun::model {

at::ScalarType to_scalar_type(io::DType d);
// "fp32" | "bf16" | "fp16" (also "float32", "bfloat16", "float16") -> dtype; lorarun::Error otherwise.
at::ScalarType parse_dtype(const std::string& name);
// The name transformers writes in config.json: "float32", "bfloat16", "float16".
std::string hf_dtype_name(at::ScalarType t);
io::DType to_dtype(at::ScalarType t);  // throws for types safetensors lacks

// Where CausalLM::load takes the base weights from, by their HF names (model.layers.0.mlp.up_proj.weight).
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  virtual bool contains(const std::string& name) const = 0;
  // `name` as `dtype` on `device`; `shape` (if given) must equal the stored shape.
  virtual at::Tensor load(const std::string& name, at::ScalarType dtype, at::Device device,
                          const std::vector<int64_t>& shape = {}) const = 0;
  // model.keep_quantized: the linear weight `name` [out, in] as the file's own blocks; only a GGUF
  // file has them (lorarun::Error otherwise).
  virtual GgufBlocks blocks(const std::string& name, at::ScalarType dtype, at::Device device,
                            const std::vector<int64_t>& shape = {}) const;
  // Drops what the source still holds of `name` (its mapped pages) once it has been used.
  virtual void release(const std::string& name) const = 0;
};

// The safetensors file(s) of a model directory (or a single file), memory-mapped.
class WeightFiles : public WeightSource {
 public:
  // `dir` holds model.safetensors or model.safetensors.index.json (+ shards).
  static WeightFiles open_dir(const std::string& dir);
  static WeightFiles open_file(const std::string& path);

  bool contains(const std::string& name) const override { return where_.count(name) > 0; }
  std::vector<std::string> names() const;
  const io::TensorInfo& info(const std::string& name) const;

  // `name` as `dtype` on `device`. On the CPU in the stored dtype the tensor views the mapped
  // file (no copy; pages load on first touch); otherwise it is a converted copy and the mapped
  // pages are dropped after copying. `shape` (if given) must equal the stored shape.
  at::Tensor load(const std::string& name, at::ScalarType dtype, at::Device device,
                  const std::vector<int64_t>& shape = {}) const override;
  // Drops the mapped pages of `name` once no tensor views them (a quantised weight's source).
  void release(const std::string& name) const override { files_[where_.at(name)]->release(info(name)); }
  // The names load() was asked for; the caller can report leftovers.
  const std::set<std::string>& used() const { return used_; }

 private:
  std::vector<std::shared_ptr<io::SafetensorsFile>> files_;
  std::map<std::string, size_t> where_;
  mutable std::set<std::string> used_;
};

// Writes named tensors (any device/dtype) to a safetensors file, atomically.
void save_tensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                  const std::map<std::string, std::string>& metadata = {{"format", "pt"}});

}  // namespace lorarun::model
