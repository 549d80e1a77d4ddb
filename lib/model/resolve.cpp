#include "model/resolve.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "io/files.hpp"
#include "io/gguf.hpp"
#include "model/families.hpp"
#include "model/gguf_weights.hpp"
#include "util/error.hpp"

namespace lorarun::model {

namespace fs = std::filesystem;

namespace {

fs::path hub_cache() {
  auto env = [](const char* n) -> std::string {
    const char* v = std::getenv(n);
    return v && *v ? v : "";
  };
  if (const std::string v = env("HF_HUB_CACHE"); !v.empty()) return v;
  if (const std::string v = env("HF_HOME"); !v.empty()) return fs::path(v) / "hub";
  if (const std::string v = env("XDG_CACHE_HOME"); !v.empty()) return fs::path(v) / "huggingface" / "hub";
  return fs::path(env("HOME")) / ".cache" / "huggingface" / "hub";
}

}  // namespace

std::string resolve_model_path(const std::string& path_or_id) {
  if (fs::is_directory(path_or_id)) return path_or_id;
  const fs::path cache = hub_cache();
  std::string folder = "models--" + path_or_id;
  for (size_t p; (p = folder.find('/')) != std::string::npos;) folder.replace(p, 1, "--");
  const fs::path repo = cache / folder;
  const bool id_like = !path_or_id.empty() && path_or_id.front() != '/' && path_or_id.front() != '.' &&
                       std::count(path_or_id.begin(), path_or_id.end(), '/') <= 1;
  if (id_like && fs::is_directory(repo / "snapshots")) {
    if (fs::exists(repo / "refs" / "main")) {
      std::string rev = io::read_file((repo / "refs" / "main").string());
      rev.erase(rev.find_last_not_of(" \n\r\t") + 1);
      if (fs::is_directory(repo / "snapshots" / rev)) return (repo / "snapshots" / rev).string();
    }
    // No refs/main (e.g. a revision pinned by hash): the most recently written snapshot.
    fs::path best;
    for (const auto& e : fs::directory_iterator(repo / "snapshots"))
      if (e.is_directory() && (best.empty() || fs::last_write_time(e) > fs::last_write_time(best))) best = e.path();
    if (!best.empty()) return best.string();
  }
  if (!id_like)
    throw ConfigError(
        fmt::format("model directory '{}' does not exist: model.path must be a Hugging Face model "
                    "directory (config.json, *.safetensors, tokenizer.json) or a model id in the local "
                    "HF cache",
                    path_or_id));
  throw ConfigError(
      fmt::format("model '{}' is neither a directory nor in the local Hugging Face cache ({}): "
                  "lorarun never downloads; fetch it where the hub is reachable (huggingface-cli "
                  "download {}) and copy the directory or cache here",
                  path_or_id, repo.string(), path_or_id));
}

tok::HfTokenizerFiles gguf_tokenizer_files(const std::string& gguf_path) {
  const io::GgufFile f(gguf_path);
  tok::GgufVocab v;
  v.source = gguf_path;
  v.sentencepiece = sentencepiece_kind_of_gguf(f.get_string("general.architecture"));
  if (!f.has("tokenizer.ggml.model"))
    throw Error(
        fmt::format("{}: has no tokenizer (no tokenizer.ggml.model in its metadata); convert the model with "
                    "its tokenizer",
                    gguf_path));
  v.model = f.get_string("tokenizer.ggml.model");
  v.pre = f.get_string("tokenizer.ggml.pre", "");
  v.tokens = f.get_strings("tokenizer.ggml.tokens");
  if (f.has("tokenizer.ggml.token_type")) v.token_types = f.get_ints("tokenizer.ggml.token_type");
  if (f.has("tokenizer.ggml.merges")) v.merges = f.get_strings("tokenizer.ggml.merges");
  if (f.has("tokenizer.ggml.scores")) v.scores = f.get_floats("tokenizer.ggml.scores");
  const std::pair<const char*, std::optional<int64_t>*> ids[] = {{"tokenizer.ggml.bos_token_id", &v.bos},
                                                                 {"tokenizer.ggml.eos_token_id", &v.eos},
                                                                 {"tokenizer.ggml.unknown_token_id", &v.unk},
                                                                 {"tokenizer.ggml.padding_token_id", &v.pad}};
  for (const auto& [key, id] : ids)
    if (f.has(key)) *id = f.get_int(key);
  if (f.has("tokenizer.ggml.add_bos_token")) v.add_bos = f.get_bool("tokenizer.ggml.add_bos_token");
  if (f.has("tokenizer.ggml.add_eos_token")) v.add_eos = f.get_bool("tokenizer.ggml.add_eos_token");
  v.chat_template = f.get_string("tokenizer.chat_template", "");
  return tok::hf_tokenizer_files(v);
}

tok::Tokenizer load_tokenizer(const std::string& path_or_id) {
  if (is_gguf_path(path_or_id)) return tok::Tokenizer::from_files(gguf_tokenizer_files(path_or_id), path_or_id);
  return tok::Tokenizer::from_dir(resolve_model_path(path_or_id));
}

}  // namespace lorarun::model
