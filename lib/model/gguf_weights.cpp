#include "model/gguf_weights.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "util/error.hpp"

namespace lorarun::model {

at::Tensor dequantize(const io::GgufFile& file, const io::GgufTensorInfo& t) {
  at::Tensor out = at::empty(t.torch_shape(), at::kFloat);
  io::dequantize(file, t, {out.data_ptr<float>(), static_cast<size_t>(t.numel())});
  file.release(t);
  return out;
}

at::Tensor dequantize(const io::GgufFile& file, const std::string& name) {
  const io::GgufTensorInfo* t = file.find(name);
  if (!t) throw Error(fmt::format("{} has no tensor '{}'", file.path(), name));
  return dequantize(file, *t);
}

}  // namespace lorarun::model
