#include "model/resolve.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cstdlib>
#include <filesystem>

#include "io/files.hpp"
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
    throw Error(
        fmt::format("model directory '{}' does not exist: model.path must be a Hugging Face model "
                    "directory (config.json, *.safetensors, tokenizer.json) or a model id in the local "
                    "HF cache",
                    path_or_id));
  throw Error(
      fmt::format("model '{}' is neither a directory nor in the local Hugging Face cache ({}): "
                  "lorarun never downloads; fetch it where the hub is reachable (huggingface-cli "
                  "download {}) and copy the directory or cache here",
                  path_or_id, repo.string(), path_or_id));
}

}  // namespace lorarun::model
