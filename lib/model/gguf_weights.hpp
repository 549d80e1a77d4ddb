// Tensors out of a GGUF file: dequantised to float32 in PyTorch's shape (GGUF lists dimensions
// innermost first; PyTorch outermost first).
#pragma once
#include <ATen/core/Tensor.h>
#include <string>

#include "io/gguf.hpp"

namespace lorarun::model {

// `t` of `file` as a new float32 CPU tensor of shape t.torch_shape(); the mapped pages are dropped
// afterwards. lorarun::Error (naming the file, the tensor and the supported types) for a type that
// cannot be dequantised.
at::Tensor dequantize(const io::GgufFile& file, const io::GgufTensorInfo& t);

// The same by name; lorarun::Error naming the file when it has no such tensor.
at::Tensor dequantize(const io::GgufFile& file, const std::string& name);

}  // namespace lorarun::model
