#include "model/weights.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <cstring>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "util/error.hpp"

namespace lorarun::model {

GgufBlocks WeightSource::blocks(const std::string& name, at::ScalarType, at::Device,
                                const std::vector<int64_t>&) const {
  throw Error(
      fmt::format("model.keep_quantized keeps a GGUF file's own blocks, and {} does not come from a .gguf "
                  "file: set model.keep_quantized: false, or model.path to a .gguf file",
                  name));
}

namespace fs = std::filesystem;

at::ScalarType to_scalar_type(io::DType d) {
  switch (d) {
    case io::DType::F64:
      return at::kDouble;
    case io::DType::F32:
      return at::kFloat;
    case io::DType::F16:
      return at::kHalf;
    case io::DType::BF16:
      return at::kBFloat16;
    case io::DType::I64:
      return at::kLong;
    case io::DType::I32:
      return at::kInt;
    case io::DType::I16:
      return at::kShort;
    case io::DType::I8:
      return at::kChar;
    case io::DType::U8:
      return at::kByte;
    case io::DType::Bool:
      return at::kBool;
  }
  return at::kFloat;
}

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "fp32" || name == "float32") return at::kFloat;
  if (name == "bf16" || name == "bfloat16") return at::kBFloat16;
  if (name == "fp16" || name == "float16") return at::kHalf;
  throw Error(fmt::format("dtype '{}' is not one of fp32, bf16, fp16", name));
}

std::string hf_dtype_name(at::ScalarType t) {
  if (t == at::kBFloat16) return "bfloat16";
  if (t == at::kHalf) return "float16";
  return "float32";
}

io::DType to_dtype(at::ScalarType t) {
  for (io::DType d : {io::DType::F64, io::DType::F32, io::DType::F16, io::DType::BF16, io::DType::I64, io::DType::I32,
                      io::DType::I16, io::DType::I8, io::DType::U8, io::DType::Bool})
    if (to_scalar_type(d) == t) return d;
  throw Error(fmt::format("dtype {} cannot be stored in safetensors", c10::toString(t)));
}

WeightFiles WeightFiles::open_file(const std::string& path) {
  WeightFiles w;
  auto f = std::make_shared<io::SafetensorsFile>(path);
  for (const auto& t : f->tensors()) w.where_[t.name] = 0;
  w.files_.push_back(std::move(f));
  return w;
}

WeightFiles WeightFiles::open_dir(const std::string& dir) {
  const fs::path single = fs::path(dir) / "model.safetensors";
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(single)) return open_file(single.string());
  if (!fs::exists(index))
    throw Error(
        fmt::format("{} has neither model.safetensors nor model.safetensors.index.json: "
                    "convert the weights to safetensors (PyTorch .bin files are not read)",
                    dir));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(io::read_file(index.string()));
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{} is not valid JSON: {}", index.string(), e.what()));
  }
  if (!j.contains("weight_map") || !j["weight_map"].is_object())
    throw Error(fmt::format("{} has no weight_map", index.string()));
  WeightFiles w;
  std::map<std::string, size_t> shard_index;
  for (auto& [name, shard] : j["weight_map"].items()) {
    if (!shard.is_string()) throw Error(fmt::format("{}: weight_map['{}'] is not a file name", index.string(), name));
    const std::string file = shard.get<std::string>();
    if (file.find('/') != std::string::npos)
      throw Error(fmt::format("{}: shard '{}' is not a plain file name", index.string(), file));
    auto [it, fresh] = shard_index.emplace(file, w.files_.size());
    if (fresh) w.files_.push_back(std::make_shared<io::SafetensorsFile>((fs::path(dir) / file).string()));
    if (!w.files_[it->second]->find(name))
      throw Error(
          fmt::format("{}: '{}' is listed in {} but that shard does not contain it", index.string(), name, file));
    w.where_[name] = it->second;
  }
  return w;
}

std::vector<std::string> WeightFiles::names() const {
  std::vector<std::string> out;
  for (const auto& [n, _] : where_) out.push_back(n);
  return out;
}

const io::TensorInfo& WeightFiles::info(const std::string& name) const {
  const auto it = where_.find(name);
  if (it == where_.end()) throw Error(fmt::format("weight '{}' is missing from the model files", name));
  return *files_[it->second]->find(name);
}

at::Tensor WeightFiles::load(const std::string& name, at::ScalarType dtype, at::Device device,
                             const std::vector<int64_t>& shape) const {
  const io::TensorInfo& t = info(name);
  const auto& file = *files_[where_.at(name)];
  if (!shape.empty() && shape != t.shape)
    throw Error(
        fmt::format("{}: '{}' has shape [{}] but config.json implies [{}]: the weights do not "
                    "match this config",
                    file.path(), name, fmt::join(t.shape, ", "), fmt::join(shape, ", ")));
  used_.insert(name);
  auto bytes = file.bytes(t);
  const auto opts = at::TensorOptions().dtype(to_scalar_type(t.dtype));
  const bool aligned = reinterpret_cast<uintptr_t>(bytes.data()) % io::dtype_size(t.dtype) == 0;
  void* data = const_cast<std::byte*>(bytes.data());
  if (aligned && device.is_cpu() && opts.dtype() == dtype) {
    // Zero copy: the tensor views the mapping and keeps the file mapped while it lives.
    std::shared_ptr<io::SafetensorsFile> keep = files_[where_.at(name)];
    return at::from_blob(data, t.shape, [keep](void*) {}, opts);
  }
  at::Tensor view;
  if (aligned) {
    view = at::from_blob(data, t.shape, opts);
  } else {  // legal in the format, rare in practice
    view = at::empty(t.shape, opts);
    std::memcpy(view.data_ptr(), bytes.data(), t.nbytes);
  }
  at::Tensor out = view.to(device, dtype, /*non_blocking=*/false, /*copy=*/true);
  file.release(t);
  return out;
}

void save_tensors(const std::string& path, const std::vector<std::pair<std::string, at::Tensor>>& tensors,
                  const std::map<std::string, std::string>& metadata) {
  std::vector<at::Tensor> host;  // keeps the contiguous CPU copies alive while writing
  std::vector<io::TensorBytes> out;
  for (const auto& [name, t] : tensors) {
    host.push_back(t.detach().to(at::kCPU).contiguous());
    const at::Tensor& h = host.back();
    out.push_back({name, to_dtype(h.scalar_type()), h.sizes().vec(), h.data_ptr(), static_cast<size_t>(h.nbytes())});
  }
  io::write_safetensors(path, out, metadata);
}

}  // namespace lorarun::model
