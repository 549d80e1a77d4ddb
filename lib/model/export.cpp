#include "model/export.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <unistd.h>
#include <cctype>
#include <cmath>
#include <filesystem>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "model/families.hpp"
#include "model/gguf_weights.hpp"
#include "model/resolve.hpp"
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

namespace {

const std::pair<const char*, const std::optional<int64_t> ModelConfig::*> kTokenIds[] = {
    {"bos_token_id", &ModelConfig::bos_token_id},
    {"eos_token_id", &ModelConfig::eos_token_id},
    {"pad_token_id", &ModelConfig::pad_token_id}};

// config.json of a GPT-2 read from a GGUF file.
nlohmann::ordered_json gpt2_config(const ModelConfig& c, const FamilyTraits& family) {
  return {{"architectures", {family.hf_class}},
          {"model_type", family.model_type},
          {"vocab_size", c.vocab_size},
          {"n_embd", c.hidden_size},
          {"n_inner", c.intermediate_size},
          {"n_layer", c.num_layers},
          {"n_head", c.num_heads},
          {"n_positions", c.max_positions},
          {"n_ctx", c.max_positions},
          {"layer_norm_epsilon", c.norm_eps},
          {"activation_function", c.activation},
          {"tie_word_embeddings", c.tie_word_embeddings}};
}

// config.json of a llama-like model read from a GGUF file (transformers 5's rope_parameters).
nlohmann::ordered_json llama_config(const ModelConfig& c, const FamilyTraits& family) {
  nlohmann::ordered_json rope = {{"rope_type", c.rope.type}, {"rope_theta", c.rope_theta}};
  if (c.rope.type == "linear") rope["factor"] = c.rope.factor;
  if (c.rope.type == "longrope") {  // phi3's, or llama 3.x's rope_freqs as one set that never switches
    rope["short_factor"] = c.rope.short_factor;
    rope["long_factor"] = c.rope.long_factor;
    rope["original_max_position_embeddings"] = c.rope.original_max_position;
    rope["attention_factor"] = c.rope.attention_factor;
  }
  if (c.partial_rotary != 1.0) rope["partial_rotary_factor"] = c.partial_rotary;
  if (c.local_rope_theta > 0)  // gemma3: one set per layer type
    rope = {{"full_attention", rope},
            {"sliding_attention", {{"rope_type", "default"}, {"rope_theta", c.local_rope_theta}}}};
  nlohmann::ordered_json j = {{"architectures", {family.hf_class}},
                              {"model_type", c.model_type},
                              {"vocab_size", c.vocab_size},
                              {"hidden_size", c.hidden_size},
                              {"intermediate_size", c.intermediate_size},
                              {"num_hidden_layers", c.num_layers},
                              {"num_attention_heads", c.num_heads},
                              {"num_key_value_heads", c.num_kv_heads},
                              {"head_dim", c.head_dim},
                              {"max_position_embeddings", c.max_positions},
                              {"rms_norm_eps", c.norm_eps},
                              {"rope_parameters", rope},
                              {"hidden_act", c.activation},
                              {"tie_word_embeddings", c.tie_word_embeddings}};
  if (!family.qkv_bias) {  // (a family with its own q/k/v biases has no such keys)
    j["attention_bias"] = c.attention_bias;
    j["mlp_bias"] = c.mlp_bias;
  }
  if (family.always_windowed || c.sliding_window)
    j["sliding_window"] = c.sliding_window ? nlohmann::ordered_json(*c.sliding_window) : nlohmann::ordered_json();
  // (Phi3's attention reads the length its longrope switches at from the top level)
  if (c.rope.type == "longrope") j["original_max_position_embeddings"] = c.rope.original_max_position;
  if (!c.sliding_layers.empty()) {
    nlohmann::ordered_json types = nlohmann::ordered_json::array();
    for (const bool s : c.sliding_layers) types.push_back(s ? "sliding_attention" : "full_attention");
    j["layer_types"] = types;
  }
  if (c.moe.experts > 0) {  // qwen3moe: every layer's experts, top k renormalised (llama.cpp's reading)
    j["num_experts"] = c.moe.experts;
    j["num_experts_per_tok"] = c.moe.top_k;
    j["moe_intermediate_size"] = c.moe.intermediate;
    j["norm_topk_prob"] = c.moe.normalize_top_k;
    j["decoder_sparse_step"] = 1;
    j["mlp_only_layers"] = nlohmann::ordered_json::array();
  }
  if (c.gemma) {
    j.erase("hidden_act");
    j["hidden_activation"] = c.activation;
    const double scalar = c.query_pre_attn_scalar.value_or(256.0);  // an int in transformers' config class
    j["query_pre_attn_scalar"] = scalar == std::floor(scalar) ? nlohmann::ordered_json(static_cast<int64_t>(scalar))
                                                              : nlohmann::ordered_json(scalar);
    j["attn_logit_softcapping"] = c.attn_softcap ? nlohmann::ordered_json(*c.attn_softcap) : nlohmann::ordered_json();
    j["final_logit_softcapping"] =
        c.logit_softcap ? nlohmann::ordered_json(*c.logit_softcap) : nlohmann::ordered_json();
  }
  return j;
}

// config.json of a model read from a GGUF file, as transformers' GGUF loading configures it.
nlohmann::ordered_json hf_config(const ModelConfig& c, const std::string& file) {
  const FamilyTraits& family = family_of_model_type(c.model_type, file);
  nlohmann::ordered_json j = c.family == Family::Gpt2 ? gpt2_config(c, family) : llama_config(c, family);
  for (const auto& [key, id] : kTokenIds)
    if (c.*id) j[key] = *(c.*id);
  return j;
}

// The base's config.json, and its tokenizer and generation files, into `tmp` (config dtype `dtype`).
// A .gguf base has neither: they are made from its metadata (no tokenizer files when it has none).
void write_model_files(const CausalLM& model, const fs::path& tmp, at::ScalarType dtype) {
  const bool gguf = is_gguf_path(model.dir());
  nlohmann::ordered_json config =
      gguf ? hf_config(model.config(), model.dir())
           : nlohmann::ordered_json::parse(io::read_file((fs::path(model.dir()) / "config.json").string()));
  config["dtype"] = hf_dtype_name(dtype);
  if (config.contains("torch_dtype")) config["torch_dtype"] = hf_dtype_name(dtype);
  io::write_file_atomic((tmp / "config.json").string(), config.dump(2) + "\n");
  if (gguf) {
    if (!io::GgufFile(model.dir()).has("tokenizer.ggml.model")) return;
    const tok::HfTokenizerFiles files = gguf_tokenizer_files(model.dir());
    io::write_file_atomic((tmp / "tokenizer.json").string(), files.tokenizer_json);
    io::write_file_atomic((tmp / "tokenizer_config.json").string(), files.tokenizer_config_json);
    return;
  }
  for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                        "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja"})
    if (fs::exists(fs::path(model.dir()) / f)) fs::copy_file(fs::path(model.dir()) / f, tmp / f);
}

}  // namespace

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
    write_model_files(model, tmp, dtype);
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
