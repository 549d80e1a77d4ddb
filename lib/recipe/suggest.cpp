// "Did you mean …": names close to a misspelt one, names other tools use for our keys, and the
// messages for unknown keys and sections.
#include "recipe/suggest.hpp"

#include <algorithm>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "recipe/schema.hpp"

namespace lorarun::recipe::detail {
namespace {

std::vector<std::string_view> split_words(std::string_view s) {
  std::vector<std::string_view> words;
  size_t start = 0;
  for (size_t i = 0; i <= s.size(); ++i) {
    if (i == s.size() || s[i] == '_' || s[i] == '-') {
      if (i > start) words.push_back(s.substr(start, i - start));
      start = i + 1;
    }
  }
  return words;
}

// Whether `abbrev` (separators ignored) is a concatenation of non-empty prefixes of each word,
// in order: "lr" of {learning, rate}, "gas" of {gradient, accumulation, steps}.
bool prefixes_of(std::string_view abbrev, const std::vector<std::string_view>& words, size_t w) {
  if (w == words.size()) return abbrev.empty();
  for (size_t k = 1; k <= std::min(abbrev.size(), words[w].size()) && abbrev[k - 1] == words[w][k - 1]; ++k)
    if (prefixes_of(abbrev.substr(k), words, w + 1)) return true;
  return false;
}

bool abbreviates(std::string_view shorter, std::string_view longer) {
  std::string compact;
  for (char c : shorter)
    if (c != '_' && c != '-') compact += c;
  return !compact.empty() && prefixes_of(compact, split_words(longer), 0);
}

// Whether every word of `shorter` is a whole word of `longer`: "batch" / "batch_size".
bool words_within(std::string_view shorter, std::string_view longer) {
  const std::vector<std::string_view> inner = split_words(shorter), outer = split_words(longer);
  if (inner.empty() || shorter.size() < 3 || inner.size() >= outer.size()) return false;
  return std::all_of(inner.begin(), inner.end(),
                     [&](std::string_view w) { return std::find(outer.begin(), outer.end(), w) != outer.end(); });
}

}  // namespace

size_t edit_distance(std::string_view a, std::string_view b) {
  // d[i][j]: distance between a[:i] and b[:j], three rows kept for the swap case.
  std::vector<std::vector<size_t>> d(a.size() + 1, std::vector<size_t>(b.size() + 1));
  for (size_t i = 0; i <= a.size(); ++i) d[i][0] = i;
  for (size_t j = 0; j <= b.size(); ++j) d[0][j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  }
  return d[a.size()][b.size()];
}

bool is_close(std::string_view word, std::string_view candidate) {
  const size_t shortest = std::min(word.size(), candidate.size());
  if (edit_distance(word, candidate) <= std::max<size_t>(1, shortest / 3)) return true;
  return abbreviates(word, candidate) || abbreviates(candidate, word) || words_within(word, candidate) ||
         words_within(candidate, word);
}

std::optional<std::string> closest(std::string_view word, const std::vector<std::string>& candidates) {
  std::optional<std::string> best;
  size_t best_distance = 0;
  for (const std::string& c : candidates) {
    if (!is_close(word, c)) continue;
    const size_t d = edit_distance(word, c);
    if (best && d >= best_distance) continue;
    best = c;
    best_distance = d;
  }
  return best;
}

// ---- unknown keys and sections ---------------------------------------------------------------

namespace {

template <class T>
std::string join(const std::vector<T>& items, std::string_view sep) {
  return fmt::format("{}", fmt::join(items, sep));
}

const std::vector<std::string>& all_keys() {
  static const std::vector<std::string> keys = known_keys();
  return keys;
}

// Names other tools (HF Trainer, PEFT, torchtune, axolotl) use for our keys, suggested when no
// known name is close. Section "" = any section, or none.
struct Alias {
  std::string_view section, name, key;
};
constexpr Alias kAliases[] = {
    {"", "learning_rate", "train.lr"},
    {"", "num_epochs", "train.epochs"},
    {"", "num_train_epochs", "train.epochs"},
    {"", "max_epochs", "train.epochs"},
    {"", "n_epochs", "train.epochs"},
    {"", "lora_r", "lora.r"},
    {"", "rank", "lora.r"},
    {"", "lora_rank", "lora.r"},
    {"", "lora_alpha", "lora.alpha"},
    {"", "lora_dropout", "lora.dropout"},
    {"", "rslora", "lora.use_rslora"},
    {"", "lora_target_modules", "lora.target_modules"},
    {"", "load_in_4bit", "lora.quantize_base"},
    {"", "qlora", "lora.quantize_base"},
    {"", "quantize", "lora.quantize_base"},
    {"", "bnb_4bit_use_double_quant", "lora.double_quant"},
    {"", "per_device_train_batch_size", "data.batch_size"},
    {"", "micro_batch_size", "data.batch_size"},
    {"", "train_batch_size", "data.batch_size"},
    {"", "max_seq_len", "data.max_length"},
    {"", "max_seq_length", "data.max_length"},
    {"", "seq_len", "data.max_length"},
    {"", "sequence_len", "data.max_length"},
    {"", "cutoff_len", "data.max_length"},
    {"", "sample_packing", "data.packing"},
    {"", "gradient_accumulation", "train.gradient_accumulation_steps"},
    {"", "accumulate_grad_batches", "train.gradient_accumulation_steps"},
    {"", "lr_scheduler_type", "train.lr_scheduler"},
    {"", "scheduler", "train.lr_scheduler"},
    {"", "warmup", "train.warmup_steps"},
    {"", "num_warmup_steps", "train.warmup_steps"},
    {"", "clip_grad_norm", "train.max_grad_norm"},
    {"", "grad_clip", "train.max_grad_norm"},
    {"", "gradient_clipping", "train.max_grad_norm"},
    {"", "gradient_checkpointing", "train.activation_checkpointing"},
    {"", "enable_activation_checkpointing", "train.activation_checkpointing"},
    {"", "max_steps", "train.max_steps_per_epoch"},
    {"", "profiler_steps", "train.profile_steps"},
    {"", "model_name_or_path", "model.path"},
    {"", "pretrained_model_name_or_path", "model.path"},
    {"", "base_model", "model.path"},
    {"", "model_id", "model.path"},
    {"model", "name", "model.path"},
    {"model", "id", "model.path"},
    {"", "torch_dtype", "model.dtype"},
    {"", "precision", "model.dtype"},
    {"", "connection_string", "data.uri"},
    {"", "mongodb_uri", "data.uri"},
    {"data", "url", "data.uri"},
    {"data", "db", "data.database"},
    {"data", "coll", "data.collection"},
    {"data", "query", "data.filter"},
    {"", "template", "data.prompt_template"},
    {"", "prompt", "data.prompt_template"},
    {"", "output_field", "data.response_field"},
    {"", "num_workers", "data.prefetch"},
    {"checkpoint", "path", "checkpoint.output_dir"},
    {"checkpoint", "dir", "checkpoint.output_dir"},
    {"", "save_dir", "checkpoint.output_dir"},
    {"", "checkpoint_dir", "checkpoint.output_dir"},
    {"", "resume_from_checkpoint", "checkpoint.resume"},
    {"", "save_steps", "checkpoint.state_every_n_steps"},
    {"dist", "timeout", "dist.timeout_s"},
    {"", "logging_steps", "track.log_every_n_steps"},
    {"", "eval_steps", "eval.every_n_steps"},
    {"", "per_device_eval_batch_size", "eval.batch_size"},
    {"", "eval_batch_size", "eval.batch_size"},
    {"", "val_set_size", "eval.fraction"},
    {"", "validation_split", "eval.fraction"},
};
constexpr std::pair<std::string_view, std::string_view> kSectionAliases[] = {
    {"trainer", "train"},   {"optim", "train"},     {"optimizer", "train"}, {"peft", "lora"},
    {"adapter", "lora"},    {"ckpt", "checkpoint"}, {"save", "checkpoint"}, {"logging", "track"},
    {"wandb", "track"},     {"tracking", "track"},  {"dataset", "data"},    {"distributed", "dist"},
    {"evaluation", "eval"}, {"validation", "eval"},
};

std::optional<std::string> alias(std::string_view section, std::string_view name) {
  for (const Alias& a : kAliases)
    if (a.name == name && a.section == section) return std::string(a.key);
  for (const Alias& a : kAliases)
    if (a.name == name && a.section.empty()) return std::string(a.key);
  return std::nullopt;
}

// The dotted key whose leaf is exactly `leaf`, when only one section has it.
std::optional<std::string> unique_leaf(std::string_view leaf, std::string_view except_section = {}) {
  std::optional<std::string> found;
  for (const std::string& k : all_keys()) {
    if (leaf_of(k) != leaf || section_of(k) == except_section) continue;
    if (found) return std::nullopt;
    found = k;
  }
  return found;
}

// The closest known key for `section.leaf`: the same name in another section, a near name in
// this section, a name other tools use, a near leaf name in another section, a near dotted name.
std::optional<std::string> suggest_key(std::string_view section, std::string_view leaf) {
  if (auto k = unique_leaf(leaf, section)) return k;
  if (auto l = closest(leaf, leaves(section))) return fmt::format("{}.{}", section, *l);
  if (auto k = alias(section, leaf)) return k;
  std::vector<std::string> others;
  for (const std::string& k : all_keys())
    if (section_of(k) != section) others.push_back(leaf_of(k));
  if (auto l = closest(leaf, others)) return unique_leaf(*l, section).value_or("");
  return closest(fmt::format("{}.{}", section, leaf), all_keys());
}

}  // namespace

std::string unknown_key_message(std::string_view section, std::string_view leaf) {
  if (auto k = suggest_key(section, leaf); k && !k->empty())
    return fmt::format("unknown key '{}.{}'; did you mean '{}'?", section, show(leaf), *k);
  return fmt::format("unknown key '{}.{}'; the keys of '{}' are {}", section, show(leaf), section,
                     join(leaves(section), ", "));
}

// A top-level name that is not a section: a misspelt section, or a key missing its section.
std::string unknown_top_message(std::string_view name) {
  if (auto k = unique_leaf(name)) return fmt::format("unknown key '{}'; did you mean '{}'?", name, *k);
  for (const auto& [other, section] : kSectionAliases)
    if (other == name) return fmt::format("unknown section '{}'; did you mean '{}'?", name, section);
  const std::vector<std::string> sections(kSections.begin(), kSections.end());
  if (auto s = closest(name, sections)) return fmt::format("unknown section '{}'; did you mean '{}'?", name, *s);
  if (auto k = alias("", name)) return fmt::format("unknown key '{}'; did you mean '{}'?", name, *k);
  return fmt::format("unknown section '{}'; the sections are {}", show(name), join(sections, ", "));
}

}  // namespace lorarun::recipe::detail
