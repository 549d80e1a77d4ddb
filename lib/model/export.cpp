#include "model/export.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>
#include <cctype>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "util/error.hpp"

namespace lorarun::model {

namespace fs = std::filesystem;

int64_t parse_size(const std::string& text) {
  size_t pos = 0;
  double value = 0;
  try {
    value = std::stod(text, &pos);
  } catch (const std::exception&) {
    pos = 0;
  }
  std::string unit = text.substr(pos);
  for (char& ch : unit) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
  const std::pair<const char*, double> units[] = {{"", 1},         {"B", 1},           {"KB", 1e3},
                                                  {"MB", 1e6},     {"GB", 1e9},        {"TB", 1e12},
                                                  {"KIB", 1024.0}, {"MIB", 1048576.0}, {"GIB", 1073741824.0}};
  for (const auto& [name, mult] : units)
    if (pos > 0 && unit == name && value > 0) return static_cast<int64_t>(value * mult);
  throw Error(fmt::format("size '{}' is not a positive size like 5GB, 500MB or 2GiB", text));
}

void export_hf_model(const CausalLM& model, const std::string& out_dir, at::ScalarType dtype, int64_t max_shard_bytes) {
  if (fs::exists(out_dir))
    throw Error(fmt::format("{} already exists: choose another output directory or remove it", out_dir));
  const fs::path tmp = fmt::format("{}.tmp.{}", out_dir, getpid());
  io::remove_tree(tmp.string());
  fs::create_directories(tmp);
  try {
    // Group tensors into shards in state-dict order.
    std::vector<std::vector<std::pair<std::string, at::Tensor>>> shards(1);
    int64_t shard_bytes = 0, total = 0;
    for (auto& [name, t] : model.state_dict()) {
      const int64_t bytes = t.numel() * static_cast<int64_t>(c10::elementSize(dtype));
      if (shard_bytes > 0 && shard_bytes + bytes > max_shard_bytes) {
        shards.emplace_back();
        shard_bytes = 0;
      }
      shards.back().emplace_back(name, t.to(dtype));
      shard_bytes += bytes;
      total += bytes;
    }
    if (shards.size() == 1) {
      save_tensors((tmp / "model.safetensors").string(), shards[0]);
    } else {
      nlohmann::ordered_json index = {{"metadata", {{"total_size", total}}}, {"weight_map", nlohmann::json::object()}};
      for (size_t i = 0; i < shards.size(); ++i) {
        const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", i + 1, shards.size());
        save_tensors((tmp / file).string(), shards[i]);
        for (const auto& [name, _] : shards[i]) index["weight_map"][name] = file;
      }
      io::write_file_atomic((tmp / "model.safetensors.index.json").string(), index.dump(2) + "\n");
    }
    nlohmann::ordered_json config =
        nlohmann::ordered_json::parse(io::read_file((fs::path(model.dir()) / "config.json").string()));
    config["dtype"] = hf_dtype_name(dtype);
    if (config.contains("torch_dtype")) config["torch_dtype"] = hf_dtype_name(dtype);
    io::write_file_atomic((tmp / "config.json").string(), config.dump(2) + "\n");
    for (const char* f :
         {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
          "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja"})
      if (fs::exists(fs::path(model.dir()) / f)) fs::copy_file(fs::path(model.dir()) / f, tmp / f);
    io::sync_dir(tmp.string());
    fs::rename(tmp, out_dir);
    io::sync_dir(fs::path(out_dir).parent_path().string());
  } catch (...) {
    try {
      io::remove_tree(tmp.string());
    } catch (const Error&) {  // the first error is the one to report
    }
    throw;
  }
}

}  // namespace lorarun::model
