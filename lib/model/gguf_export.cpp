#include "model/gguf_export.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <numbers>
#include <optional>

#include "io/files.hpp"
#include "io/gguf_write.hpp"
#include "model/families.hpp"
#include "model/gguf_weights.hpp"
#include "model/transformer.hpp"
#include "util/error.hpp"

namespace lorarun::model {

namespace fs = std::filesystem;
using json = nlohmann::json;
using Metadata = std::vector<std::pair<std::string, io::GgufValue>>;

io::GgmlType parse_gguf_type(const std::string& name) {
  static const std::pair<const char*, io::GgmlType> kTypes[] = {{"f32", io::GgmlType::F32},
                                                                {"f16", io::GgmlType::F16},
                                                                {"bf16", io::GgmlType::BF16},
                                                                {"q8_0", io::GgmlType::Q8_0}};
  for (const auto& [n, t] : kTypes)
    if (name == n) return t;
  throw Error(fmt::format("GGUF type '{}' is not supported: choose f32, f16, bf16 or q8_0", name));
}

uint32_t llama_file_type(io::GgmlType type) {
  switch (type) {
    case io::GgmlType::F32:
      return 0;
    case io::GgmlType::F16:
      return 1;
    case io::GgmlType::Q8_0:
      return 7;
    case io::GgmlType::BF16:
      return 32;
    default:
      throw Error(fmt::format("no llama.cpp file type for {}", io::ggml_type_name(type)));
  }
}

io::GgmlType gguf_tensor_type(const std::string& name, const std::vector<int64_t>& shape, io::GgmlType type) {
  if (shape.size() <= 1 || name.ends_with("_norm.weight") || !name.ends_with(".weight")) return io::GgmlType::F32;
  if (type == io::GgmlType::Q8_0 && shape.back() % 32 != 0) return io::GgmlType::F16;
  return type;
}

namespace {

// ---- tokenizer.* from a HF tokenizer.json (the converter's get_vocab_base + SpecialVocab) ----

// llama.cpp's token types (gguf.TokenType).
constexpr int64_t kNormal = 1, kControl = 3, kUserDefined = 4, kUnused = 5;

// The converter's does_token_look_special: added tokens some models forget to mark special.
bool looks_special(const std::string& t) {
  const auto wrapped = [&t](const std::string& a, const std::string& b) {
    return t.size() >= a.size() + b.size() && t.starts_with(a) && t.ends_with(b);
  };
  return t == "<pad>" || t == "<mask>" || t == "<2mass>" || t == "[@BOS@]" || wrapped("<|", "|>") ||
         wrapped("<\xef\xbd\x9c", "\xef\xbd\x9c>") || wrapped("<unused", ">");
}

json read_json(const fs::path& p) {
  try {
    return json::parse(io::read_file(p.string()));
  } catch (const json::exception& e) {
    throw Error(fmt::format("{} is not valid JSON ({}): re-save the tokenizer", p.string(), e.what()));
  }
}

// Whether a (possibly Sequence) pre-tokenizer or decoder holds a ByteLevel step.
bool has_byte_level(const json& j) {
  if (!j.is_object()) return false;
  if (j.value("type", "") == "ByteLevel") return true;
  for (const char* list : {"pretokenizers", "decoders"})
    if (j.contains(list))
      for (const json& s : j[list])
        if (has_byte_level(s)) return true;
  return false;
}

void check_byte_level_bpe(const json& tok, const fs::path& file) {
  const std::string kind = tok.contains("model") ? tok["model"].value("type", "unknown") : "unknown";
  const bool byte_level =
      has_byte_level(tok.value("pre_tokenizer", json())) || has_byte_level(tok.value("decoder", json()));
  if (kind != "BPE" || !byte_level)
    throw Error(fmt::format(
        "{}: a {}{} tokenizer cannot be written to GGUF; supported: byte-level BPE (GPT-2, Llama 3, Qwen2 style), "
        "or a .gguf base model whose tokenizer is copied",
        file.string(), kind, kind == "BPE" ? " (not byte-level: SentencePiece style)" : ""));
}

// tokens and token types in id order, vocab_size of them: ids no token has are "[PAD<id>]", unused.
// SentencePiece's "\u2581" (its space) in `text` as a space.
std::string metaspaces_as_spaces(const std::string& text) {
  std::string out;
  for (size_t i = 0; i < text.size();) {
    if (text.compare(i, 3, "\xe2\x96\x81") == 0) {
      out += ' ';
      i += 3;
    } else {
      out += text[i++];
    }
  }
  return out;
}

void add_tokens(Metadata& md, const json& tok, int64_t vocab_size, const fs::path& file) {
  std::vector<std::string> tokens(vocab_size);
  std::vector<int64_t> types(vocab_size, kUnused);
  std::vector<bool> set(vocab_size, false);
  const auto put = [&](int64_t id, const std::string& text, int64_t type) {
    if (id < 0 || id >= vocab_size)
      throw Error(fmt::format("{}: token '{}' has id {}, outside the model's {} embeddings", file.string(), text, id,
                              vocab_size));
    tokens[id] = text;
    types[id] = type;
    set[id] = true;
  };
  for (const auto& [text, id] : tok["model"]["vocab"].items()) put(id.get<int64_t>(), text, kNormal);
  for (const json& a : tok.value("added_tokens", json::array())) {
    std::string text = a.at("content").get<std::string>();
    const bool control = a.value("special", false) || looks_special(text);
    if (!control) text = metaspaces_as_spaces(text);  // user-defined tokens are pre-normalised
    put(a.at("id").get<int64_t>(), text, control ? kControl : kUserDefined);
  }
  for (int64_t i = 0; i < vocab_size; ++i)
    if (!set[i]) tokens[i] = fmt::format("[PAD{}]", i);
  md.emplace_back("tokenizer.ggml.tokens", io::gguf_strings(std::move(tokens)));
  md.emplace_back("tokenizer.ggml.token_type", io::gguf_i32s(std::move(types)));
}

// "a b" strings; pairs (tokenizers >= 0.20) are joined, a space inside a part written as U+0120.
void add_merges(Metadata& md, const json& tok) {
  std::vector<std::string> merges;
  for (const json& m : tok["model"].value("merges", json::array())) {
    if (m.is_string()) {
      merges.push_back(m.get<std::string>());
      continue;
    }
    std::string joined;
    for (size_t i = 0; i < m.size(); ++i) {
      std::string part = m[i].get<std::string>();
      for (size_t at; (at = part.find(' ')) != std::string::npos;) part.replace(at, 1, "\xc4\xa0");
      joined += (i ? " " : "") + part;
    }
    merges.push_back(std::move(joined));
  }
  if (!merges.empty()) md.emplace_back("tokenizer.ggml.merges", io::gguf_strings(std::move(merges)));
}

// The text of tokenizer_config.json's "<typ>_token" (a string or {"content": ...}), if any.
std::optional<std::string> special_text(const json& config, const std::string& typ) {
  const json e = config.value(typ + "_token", json());
  if (e.is_string()) return e.get<std::string>();
  if (e.is_object() && e.contains("content") && e["content"].is_string()) return e["content"].get<std::string>();
  return std::nullopt;
}

// The gguf-py SpecialVocab keys: ids of bos, eos, unk, sep, pad, mask (tokenizer_config.json's
// tokens looked up among the added tokens, then config.json's *_token_id), add_bos/add_eos (a
// TemplateProcessing post-processor's first/last token, overridden by tokenizer_config.json),
// chat_template (tokenizer_config.json, else chat_template.jinja).
void add_special(Metadata& md, const json& tok, const fs::path& dir, int64_t vocab_size) {
  const json config =
      fs::exists(dir / "tokenizer_config.json") ? read_json(dir / "tokenizer_config.json") : json::object();
  const json model_config = fs::exists(dir / "config.json") ? read_json(dir / "config.json") : json::object();
  static const std::pair<const char*, const char*> kTypes[] = {
      {"bos", "bos"},     {"eos", "eos"},  {"unk", "unknown"}, {"sep", "seperator"},  // sic, llama.cpp's key
      {"pad", "padding"}, {"mask", "mask"}};
  std::map<std::string, bool> add;
  const json post = tok.value("post_processor", json());
  for (const json& p : post.is_object() ? post.value("processors", json::array({post})) : json::array()) {
    if (p.value("type", "") != "TemplateProcessing" || p.value("single", json::array()).size() < 2) continue;
    const json& single = p["single"];
    const auto special = [](const json& s) {
      return s.contains("SpecialToken") ? s["SpecialToken"].value("id", "") : "";
    };
    add["bos"] = !special(single.front()).empty() && special(single.front()) == special_text(config, "bos");
    add["eos"] = !special(single.back()).empty() && special(single.back()) == special_text(config, "eos");
  }
  for (const auto& [typ, key] : kTypes) {
    std::optional<int64_t> id;
    if (const auto text = special_text(config, typ))
      for (const json& a : tok.value("added_tokens", json::array()))
        if (a.value("content", "") == *text) {
          id = a.at("id").get<int64_t>();
          break;
        }
    const json from_config = model_config.value(std::string(typ) + "_token_id", json());
    if (!id && from_config.is_number_integer()) id = from_config.get<int64_t>();
    if (id && *id >= 0 && *id < vocab_size)
      md.emplace_back(fmt::format("tokenizer.ggml.{}_token_id", key), io::gguf_u32(static_cast<uint32_t>(*id)));
    const json add_entry = config.value(fmt::format("add_{}_token", typ), json());
    if (add_entry.is_boolean()) add[typ] = add_entry.get<bool>();
  }
  for (const char* typ : {"bos", "eos", "sep"})  // the add_*_token keys llama.cpp has
    if (add.count(typ)) md.emplace_back(fmt::format("tokenizer.ggml.add_{}_token", typ), io::gguf_bool(add[typ]));
  std::optional<std::string> tmpl;
  if (config.contains("chat_template") && config["chat_template"].is_string())
    tmpl = config["chat_template"].get<std::string>();
  else if (fs::exists(dir / "chat_template.jinja"))
    tmpl = io::read_file((dir / "chat_template.jinja").string());
  if (tmpl) md.emplace_back("tokenizer.chat_template", io::gguf_string(*tmpl));
}

Metadata hf_tokenizer_metadata(const fs::path& dir, int64_t vocab_size) {
  const fs::path file = dir / "tokenizer.json";
  if (!fs::exists(file))
    throw Error(fmt::format(
        "{} has no tokenizer.json: only a byte-level BPE tokenizer.json (GPT-2, Llama 3, Qwen2 style) can be "
        "written to GGUF; save the tokenizer with transformers (a fast tokenizer) first",
        dir.string()));
  const json tok = read_json(file);
  check_byte_level_bpe(tok, file);
  Metadata md;
  md.emplace_back("tokenizer.ggml.model", io::gguf_string("gpt2"));
  md.emplace_back("tokenizer.ggml.pre", io::gguf_string("default"));
  add_tokens(md, tok, vocab_size, file);
  add_merges(md, tok);
  add_special(md, tok, dir, vocab_size);
  return md;
}

}  // namespace

Metadata gguf_tokenizer_metadata(const CausalLM& model) {
  if (!is_gguf_path(model.dir())) return hf_tokenizer_metadata(model.dir(), model.config().vocab_size);
  const io::GgufFile base(model.dir());
  Metadata md;
  for (const auto& [key, value] : base.metadata())
    if (key.starts_with("tokenizer.")) md.emplace_back(key, value);
  return md;
}

namespace {

// Whether the base states head_dim itself (config.json's head_dim, a GGUF's key_length): the
// converter then writes attention.key_length and value_length.
bool explicit_head_dim(const CausalLM& model, const std::string& arch) {
  if (is_gguf_path(model.dir())) return io::GgufFile(model.dir()).has(arch + ".attention.key_length");
  const fs::path config = fs::path(model.dir()) / "config.json";
  return fs::exists(config) && read_json(config).contains("head_dim");
}

// general.name: the base GGUF's, else the model directory's (or file's) name.
std::string model_name(const CausalLM& model) {
  if (is_gguf_path(model.dir())) {
    const io::GgufFile base(model.dir());
    if (base.has("general.name")) return base.get_string("general.name");
    return fs::path(model.dir()).stem().string();
  }
  fs::path dir = fs::path(model.dir()).lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();  // "models/base/"
  return dir.filename().string();
}

// Llama 3.x's rope scaling as llama.cpp's rope_freqs: one divisor per rotary frequency, computed
// in float32 as the converter's LlamaModel.generate_extra_tensors computes it.
std::vector<double> llama3_rope_freqs(const ModelConfig& c) {
  const RopeScaling& r = c.rope;
  const auto dim = static_cast<float>(c.head_dim), old = static_cast<float>(r.original_max_position);
  const auto factor = static_cast<float>(r.factor), low = static_cast<float>(r.low_freq_factor),
             high = static_cast<float>(r.high_freq_factor);
  std::vector<double> out;
  for (int64_t i = 0; i < c.head_dim; i += 2) {
    const float freq = 1.0f / std::pow(static_cast<float>(c.rope_theta), static_cast<float>(i) / dim);
    const float wavelen = static_cast<float>(2 * std::numbers::pi) / freq;
    if (wavelen < old / high) {
      out.push_back(1.0);
    } else if (wavelen > old / low) {
      out.push_back(factor);
    } else {
      const float smooth = (old / wavelen - low) / (high - low);
      out.push_back(1.0f / ((1 - smooth) / factor + smooth));
    }
  }
  return out;
}

// The rotary factor tensors of `c` (rope_freqs for llama 3.x, rope_factors_long/short for phi3's
// longrope), or Error for scaling llama.cpp cannot hold.
std::vector<std::pair<std::string, std::vector<double>>> rope_tensors(const ModelConfig& c, const FamilyTraits& f) {
  const RopeScaling& r = c.rope;
  if (r.type == "default" || r.type == "linear") return {};
  if (r.type == "llama3" && f.llama_gguf) return {{"rope_freqs.weight", llama3_rope_freqs(c)}};
  // a llama file's rope_freqs read back: one set that never switches
  if (r.type == "longrope" && f.llama_gguf && r.short_factor == r.long_factor && r.attention_factor == 1.0 &&
      r.original_max_position >= c.max_positions)
    return {{"rope_freqs.weight", r.short_factor}};
  if (r.type == "longrope" && f.fused)
    return {{"rope_factors_long.weight", r.long_factor}, {"rope_factors_short.weight", r.short_factor}};
  throw Error(fmt::format(
      "rope scaling '{}' of a {} model cannot be written to GGUF; supported: none, linear, llama3 (as rope_freqs), "
      "longrope (phi3)",
      r.type, c.model_type));
}

// Gemma's keys, and a refusal for what llama.cpp would compute otherwise than the model does.
void add_gemma(Metadata& md, const ModelConfig& c, const std::string& arch, const FamilyTraits& family) {
  const auto f32 = [](double v) { return io::gguf_f32(static_cast<float>(v)); };
  const double assumed = gemma_query_scalar(c, family);
  if (c.query_pre_attn_scalar.value_or(assumed) != assumed)
    throw Error(fmt::format(
        "query_pre_attn_scalar {} cannot be written to GGUF: llama.cpp scales a {}-layer {} model's queries by {} "
        "(write a HF directory instead: --out without .gguf)",
        *c.query_pre_attn_scalar, c.num_layers, arch, assumed));
  if (family.gguf_attn_softcap > 0) {  // (the keys of a family whose file always has them)
    if (c.attn_softcap) md.emplace_back(arch + ".attn_logit_softcapping", f32(*c.attn_softcap));
    if (c.logit_softcap) md.emplace_back(arch + ".final_logit_softcapping", f32(*c.logit_softcap));
  } else if (c.logit_softcap) {
    md.emplace_back(arch + ".final_logit_softcapping", f32(*c.logit_softcap));
  }
  if (!c.sliding_window) return;
  md.emplace_back(arch + ".attention.sliding_window", io::gguf_u32(static_cast<uint32_t>(*c.sliding_window)));
  const std::vector<bool> windowed =
      c.sliding_layers.empty() ? std::vector<bool>(static_cast<size_t>(c.num_layers), true) : c.sliding_layers;
  if (windowed != windowed_every(c.num_layers, family.global_every))  // llama.cpp's default: no key
    md.emplace_back(arch + ".attention.sliding_window_pattern", io::gguf_bools(windowed));
  if (family.local_rope) md.emplace_back(arch + ".rope.freq_base_swa", f32(c.local_rope_theta));
}

// The converter's keys in its order: general.*, TextModel.set_gguf_parameters, then the family's own.
Metadata model_metadata(const CausalLM& model, const std::string& arch, io::GgmlType type) {
  const ModelConfig& c = model.config();
  const FamilyTraits& family = family_of_model_type(c.model_type, model.dir());
  rope_tensors(c, family);  // (refuses scaling it cannot write before anything is written)
  const auto u32 = [](int64_t v) { return io::gguf_u32(static_cast<uint32_t>(v)); };
  const auto f32 = [](double v) { return io::gguf_f32(static_cast<float>(v)); };
  Metadata md = {{"general.architecture", io::gguf_string(arch)},
                 {"general.type", io::gguf_string("model")},
                 {"general.name", io::gguf_string(model_name(model))},
                 {arch + ".block_count", u32(c.num_layers)},
                 {arch + ".context_length", u32(c.max_positions)},
                 {arch + ".embedding_length", u32(c.hidden_size)},
                 {arch + ".feed_forward_length", u32(c.intermediate_size)},
                 {arch + ".attention.head_count", u32(c.num_heads)},
                 {arch + ".attention.head_count_kv", u32(c.num_kv_heads)},
                 {arch + ".rope.freq_base", f32(c.rope_theta)},
                 {arch + ".attention.layer_norm_rms_epsilon", f32(c.norm_eps)}};
  if (c.gemma || explicit_head_dim(model, arch)) {
    md.emplace_back(arch + ".attention.key_length", u32(c.head_dim));
    md.emplace_back(arch + ".attention.value_length", u32(c.head_dim));
  }
  md.emplace_back("general.file_type", io::gguf_u32(llama_file_type(type)));
  if (family.llama_gguf) {  // LlamaModel.set_gguf_parameters
    md.emplace_back(arch + ".vocab_size", u32(c.vocab_size));
    md.emplace_back(arch + ".rope.dimension_count", u32(c.head_dim));
  }
  if (c.rope.type == "linear") {
    md.emplace_back(arch + ".rope.scaling.type", io::gguf_string("linear"));
    md.emplace_back(arch + ".rope.scaling.factor", f32(c.rope.factor));
  }
  if (c.gemma) add_gemma(md, c, arch, family);
  if (family.fused) {  // Phi3MiniModel.set_gguf_parameters
    md.emplace_back(arch + ".rope.dimension_count", u32(static_cast<int64_t>(c.head_dim * c.partial_rotary)));
    md.emplace_back(arch + ".rope.scaling.original_context_length",
                    u32(c.rope.type == "longrope" ? c.rope.original_max_position : c.max_positions));
    md.emplace_back(arch + ".attention.sliding_window", u32(c.sliding_window.value_or(0)));
    if (c.rope.type == "longrope") md.emplace_back(arch + ".rope.scaling.attn_factor", f32(c.rope.attention_factor));
  }
  return md;
}

// llama.cpp's converter (LlamaModel.permute) reorders each head's rows of Q and K [heads *
// head_dim, ..] from HF's rotate-half layout (first halves, then second halves) to interleaved
// pairs: per head [2, dim/2] -> [dim/2, 2]. gguf_weights.cpp undoes it on load.
at::Tensor permute_rows(const at::Tensor& w, int64_t heads) {
  std::vector<int64_t> shape = {heads, 2, w.size(0) / heads / 2};
  for (int64_t d = 1; d < w.dim(); ++d) shape.push_back(w.size(d));
  return w.reshape(shape).transpose(1, 2).reshape(w.sizes());
}

struct OutTensor {
  std::string name;  // GGUF's
  at::Tensor value;  // float32, PyTorch layout, rows in llama.cpp's order
  io::GgmlType type;
};

std::vector<OutTensor> out_tensors(const CausalLM& model, const std::string& arch, io::GgmlType type) {
  const ModelConfig& c = model.config();
  const FamilyTraits& family = family_of_model_type(c.model_type, model.dir());
  std::vector<OutTensor> out;
  for (const auto& [name, factors] : rope_tensors(c, family))  // generate_extra_tensors come first
    out.push_back({name, at::tensor(factors, at::kFloat), io::GgmlType::F32});
  for (const auto& [hf, t] : model.state_dict()) {
    if (hf == "lm_head.weight" && c.tie_word_embeddings) continue;  // llama.cpp reuses token_embd
    const std::string name = gguf_tensor_name(hf, c.gemma);
    if (name.empty()) throw Error(fmt::format("weight '{}' has no GGUF name in the {} layout", hf, arch));
    at::Tensor w = t.to(at::kFloat);
    const bool q = name.ends_with(".attn_q.weight") || name.ends_with(".attn_q.bias");
    const bool k = name.ends_with(".attn_k.weight") || name.ends_with(".attn_k.bias");
    if (family.llama_gguf && (q || k))
      w = permute_rows(w, q ? c.num_heads : c.num_kv_heads);  // llama.cpp's rotary order
    if (c.gemma && name.ends_with("norm.weight")) w = w + 1;  // llama.cpp's RMSNorm scales by the weight alone
    out.push_back({name, w.contiguous(), gguf_tensor_type(name, w.sizes().vec(), type)});
  }
  return out;
}

}  // namespace

void export_gguf(const CausalLM& model, const std::string& out_file, io::GgmlType type) {
  const std::string arch = gguf_architecture_of(model.config().model_type);
  if (fs::exists(out_file))
    throw Error(fmt::format("{} already exists: choose another output file or remove it", out_file));
  Metadata md = model_metadata(model, arch, type);
  for (auto& kv : gguf_tokenizer_metadata(model)) md.push_back(std::move(kv));
  md.emplace_back("general.quantization_version", io::gguf_u32(2));  // GGML_QNT_VERSION
  const std::vector<OutTensor> tensors = out_tensors(model, arch, type);
  io::GgufWriter w(out_file);
  for (auto& [key, value] : md) w.add(key, std::move(value));
  for (const OutTensor& t : tensors) w.add_tensor(t.name, t.type, t.value.sizes().vec());
  std::vector<std::byte> bytes;
  for (const OutTensor& t : tensors) {
    const size_t n = static_cast<size_t>(t.value.numel());
    bytes.resize(n / io::ggml_block_size(t.type) * io::ggml_block_bytes(t.type));
    io::quantize(t.type, {t.value.data_ptr<float>(), n}, bytes);
    w.write_tensor(bytes);
  }
  w.commit();
}

}  // namespace lorarun::model
