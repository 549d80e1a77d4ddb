// validate(): ranges, requirements that depend on other keys, and the checkpoint policy.
#include <algorithm>
#include <set>

#include <fmt/format.h>

#include "recipe/recipe.hpp"
#include "recipe/schema.hpp"
#include "util/error.hpp"

namespace lorarun::recipe {
namespace detail {

// Python's str.format placeholders, without format specs: {field}, {{ and }} for braces.
std::vector<TemplatePart> parse_template(std::string_view t, std::string_view subject) {
  // 1-based position in characters (UTF-8 continuation bytes do not count), for messages.
  const auto position = [&](size_t byte) {
    return 1 + std::count_if(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(byte),
                             [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
  };
  std::vector<TemplatePart> parts;
  std::string literal;
  const auto flush = [&] {
    if (!literal.empty()) parts.push_back({false, std::exchange(literal, {})});
  };
  for (size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    const bool doubled = i + 1 < t.size() && t[i + 1] == c;
    if ((c == '{' || c == '}') && doubled) {
      literal += c;
      ++i;
    } else if (c == '}') {
      throw Error(fmt::format("{} has an unmatched '}}' at character {}; write }}}} for a literal brace", subject,
                              position(i)));
    } else if (c != '{') {
      literal += c;
    } else {
      const size_t close = t.find_first_of("{}", i + 1);
      if (close == std::string_view::npos || t[close] == '{')
        throw Error(fmt::format("{} has an unmatched '{{' at character {}; close the placeholder with }} or write "
                                "{{{{ for a literal brace",
                                subject, position(i)));
      if (close == i + 1)
        throw Error(fmt::format("{} has an empty placeholder {{}} at character {}; name a document field such as "
                                "{{instruction}}",
                                subject, position(i)));
      flush();
      parts.push_back({true, std::string(t.substr(i + 1, close - i - 1))});
      i = close;
    }
  }
  flush();
  return parts;
}

}  // namespace detail

std::vector<TemplatePart> parse_template(std::string_view tmpl) {
  return detail::parse_template(tmpl, "the prompt template");
}

std::vector<std::string> DataSection::template_fields() const {
  std::vector<std::string> fields;
  for (const TemplatePart& p : parse_template(prompt_template))
    if (p.is_field && std::find(fields.begin(), fields.end(), p.text) == fields.end()) fields.push_back(p.text);
  return fields;
}

std::vector<int> epochs_kept(const CheckpointSection& c, int epochs) {
  if (epochs < 1) return {};
  if (c.save_last_epoch_only) return {epochs - 1};
  std::vector<int> kept;
  switch (c.epochs_to_save.mode) {
    case EpochsToSave::Mode::All:
      for (int i = 0; i < epochs; ++i) kept.push_back(i);
      break;
    case EpochsToSave::Mode::None:
      break;
    case EpochsToSave::Mode::List:
      for (int e : c.epochs_to_save.epochs)
        if (e >= 0 && e < epochs) kept.push_back(e);
      std::sort(kept.begin(), kept.end());
      kept.erase(std::unique(kept.begin(), kept.end()), kept.end());
      break;
  }
  return kept;
}

bool save_after_epoch(const CheckpointSection& c, int epoch, int epochs) {
  const std::vector<int> kept = epochs_kept(c, epochs);
  return std::binary_search(kept.begin(), kept.end(), epoch);
}

namespace {

using detail::fail;
using detail::hint;

void at_least(const RecipeOrigin& o, std::string_view key, int64_t value, int64_t min, bool nullable = false) {
  if (value < min)
    fail(o, key, fmt::format("must be at least {}{}, got {}{}", min, nullable ? " or null" : "", value, hint(key)));
}

void positive(const RecipeOrigin& o, std::string_view key, double value, std::string_view or_else = "") {
  if (!(value > 0))
    fail(o, key, fmt::format("must be > 0{}, got {}{}", or_else, detail::format_double(value), hint(key)));
}

void required(const RecipeOrigin& o, std::string_view key, const std::string& value, std::string_view why) {
  if (value.empty()) fail(o, key, fmt::format("must be set {}{}", why, hint(key)));
}

void validate_lora(const LoraSection& l, const RecipeOrigin& o) {
  at_least(o, "lora.r", l.r, 1);
  positive(o, "lora.alpha", l.alpha);
  if (!(l.dropout >= 0 && l.dropout < 1))
    fail(o, "lora.dropout", fmt::format("must be in [0, 1), got {}{}", detail::format_double(l.dropout),
                                        hint("lora.dropout")));
  const std::string_view key = "lora.target_modules";
  if (l.target_modules.empty())
    fail(o, key, "must name at least one module or be all-linear (e.g. lora.target_modules: [q_proj, v_proj])");
  std::set<std::string> seen;
  for (const std::string& m : l.target_modules) {
    if (m.empty()) fail(o, key, "has an empty module name; remove it");
    if (m == "all-linear" && l.target_modules.size() > 1)
      fail(o, key, "lists all-linear among other names; write lora.target_modules: all-linear alone");
    if (!seen.insert(m).second) fail(o, key, fmt::format("lists '{}' twice; list each module once", m));
  }
}

void validate_data(const DataSection& d, const RecipeOrigin& o) {
  if (d.source == Source::MongoDB) {
    required(o, "data.database", d.database, "for data.source: mongodb");
    required(o, "data.collection", d.collection, "for data.source: mongodb");
  } else {
    required(o, "data.path", d.path, "for data.source: jsonl");
  }
  if (d.limit) at_least(o, "data.limit", *d.limit, 1, true);
  switch (d.format) {
    case Format::Instruction:
      required(o, "data.prompt_template", d.prompt_template, "for data.format: instruction");
      try {
        detail::parse_template(d.prompt_template, "data.prompt_template");
      } catch (const Error& e) {
        throw Error(fmt::format("{}: {}", o.at("data.prompt_template"), e.what()));
      }
      required(o, "data.response_field", d.response_field, "for data.format: instruction");
      break;
    case Format::Text:
      required(o, "data.text_field", d.text_field, "for data.format: text");
      break;
    case Format::Chat:
      required(o, "data.messages_field", d.messages_field, "for data.format: chat");
      break;
  }
  at_least(o, "data.max_length", d.max_length, 2);
  at_least(o, "data.batch_size", d.batch_size, 1);
  at_least(o, "data.prefetch", d.prefetch, 0);
  at_least(o, "data.shuffle_buffer", d.shuffle_buffer, 1);
  at_least(o, "data.group_window", d.group_window, 1);
  at_least(o, "data.retries", d.retries, 0);
  if (!(d.retry_backoff_s >= 0 && d.retry_backoff_s <= 3600))
    fail(o, "data.retry_backoff_s", fmt::format("must be in [0, 3600] seconds, got {}{}",
                                                detail::format_double(d.retry_backoff_s), hint("data.retry_backoff_s")));
}

void validate_train(const TrainSection& t, const RecipeOrigin& o) {
  at_least(o, "train.epochs", t.epochs, 1);
  at_least(o, "train.gradient_accumulation_steps", t.gradient_accumulation_steps, 1);
  positive(o, "train.lr", t.lr);
  if (!(t.weight_decay >= 0))
    fail(o, "train.weight_decay", fmt::format("must be >= 0, got {}{}", detail::format_double(t.weight_decay),
                                              hint("train.weight_decay")));
  at_least(o, "train.warmup_steps", t.warmup_steps, 0);
  if (t.max_grad_norm) positive(o, "train.max_grad_norm", *t.max_grad_norm, " or null (no clipping)");
  if (t.max_steps_per_epoch) at_least(o, "train.max_steps_per_epoch", *t.max_steps_per_epoch, 1, true);
  at_least(o, "train.seed", t.seed, 0);
}

// Returns the warning when save_last_epoch_only overrides an explicit epochs_to_save.
std::optional<std::string> validate_checkpoint(const CheckpointSection& c, int epochs, const RecipeOrigin& o) {
  required(o, "checkpoint.output_dir", c.output_dir, "to the directory for the epoch_<i>/ checkpoints");
  const std::string_view key = "checkpoint.epochs_to_save";
  std::set<int> seen;
  for (int e : c.epochs_to_save.epochs) {
    if (e < 0 || e >= epochs)
      fail(o, key, fmt::format("lists epoch {}, but epochs are 0-based and train.epochs is {}, so the valid "
                               "epochs are 0..{}",
                               e, epochs, epochs - 1));
    if (!seen.insert(e).second) fail(o, key, fmt::format("lists epoch {} twice; list each epoch once", e));
  }
  if (c.state_every_n_steps) at_least(o, "checkpoint.state_every_n_steps", *c.state_every_n_steps, 1, true);
  if (c.save_last_epoch_only && c.epochs_to_save.mode != EpochsToSave::Mode::All)
    return fmt::format("{}: checkpoint.save_last_epoch_only: true takes precedence over {}: {}; only epoch_{}/ "
                       "is kept (remove one of the two keys)",
                       o.at("checkpoint.save_last_epoch_only"), key, detail::yaml_text(c.epochs_to_save),
                       epochs - 1);
  return std::nullopt;
}

}  // namespace

std::vector<std::string> validate(const Recipe& r, const RecipeOrigin& o) {
  std::vector<std::string> warnings;
  required(o, "model.path", r.model.path, "to a HF model directory or a model id in the local HF cache");
  validate_lora(r.lora, o);
  validate_data(r.data, o);
  validate_train(r.train, o);
  if (auto w = validate_checkpoint(r.checkpoint, r.train.epochs, o)) warnings.push_back(*w);
  if (r.dist.backend == DistBackend::Nccl && r.model.device == Device::Cpu)
    fail(o, "dist.backend", "is nccl, which needs CUDA, but model.device is cpu; use dist.backend: gloo (or auto)");
  at_least(o, "dist.timeout_s", r.dist.timeout_s, 1);
  at_least(o, "data.timeout_s", r.data.timeout_s, 1);
  if (r.dist.debug_checksum_every_n_steps)
    at_least(o, "dist.debug_checksum_every_n_steps", *r.dist.debug_checksum_every_n_steps, 1, true);
  positive(o, "dist.bucket_mb", r.dist.bucket_mb);
  at_least(o, "track.log_every_n_steps", r.track.log_every_n_steps, 1);
  return warnings;
}

}  // namespace lorarun::recipe
