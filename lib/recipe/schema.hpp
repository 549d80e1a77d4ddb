// The recipe's keys in one list (§4's order), and what the loader, the emitters and validate()
// share: how a value is written as YAML, examples for messages, the error format.
#pragma once
#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "recipe/recipe.hpp"

namespace lorarun::recipe::detail {

inline constexpr std::array<std::string_view, 7> kSections{"model", "lora",       "data", "train",
                                                           "checkpoint", "dist", "track"};

// Calls v("section.key", member) for every key, in §4's order. R is Recipe or const Recipe.
// This is the one list of keys: parsing, to_yaml, to_json and known_keys() all walk it.
template <class R, class V> void for_each_key(R& r, V&& v) {
  v("model.path", r.model.path);
  v("model.dtype", r.model.dtype);
  v("model.device", r.model.device);

  v("lora.r", r.lora.r);
  v("lora.alpha", r.lora.alpha);
  v("lora.dropout", r.lora.dropout);
  v("lora.target_modules", r.lora.target_modules);
  v("lora.use_rslora", r.lora.use_rslora);
  v("lora.quantize_base", r.lora.quantize_base);
  v("lora.double_quant", r.lora.double_quant);
  v("lora.init_from", r.lora.init_from);

  v("data.source", r.data.source);
  v("data.uri", r.data.uri);
  v("data.database", r.data.database);
  v("data.collection", r.data.collection);
  v("data.path", r.data.path);
  v("data.filter", r.data.filter);
  v("data.limit", r.data.limit);
  v("data.format", r.data.format);
  v("data.prompt_template", r.data.prompt_template);
  v("data.response_field", r.data.response_field);
  v("data.text_field", r.data.text_field);
  v("data.messages_field", r.data.messages_field);
  v("data.chat_format", r.data.chat_format);
  v("data.train_on_input", r.data.train_on_input);
  v("data.max_length", r.data.max_length);
  v("data.overlong", r.data.overlong);
  v("data.bad_documents", r.data.bad_documents);
  v("data.shuffle", r.data.shuffle);
  v("data.packing", r.data.packing);
  v("data.batch_size", r.data.batch_size);
  v("data.prefetch", r.data.prefetch);
  v("data.shuffle_buffer", r.data.shuffle_buffer);
  v("data.group_by_length", r.data.group_by_length);
  v("data.group_window", r.data.group_window);
  v("data.retries", r.data.retries);
  v("data.retry_backoff_s", r.data.retry_backoff_s);
  v("data.timeout_s", r.data.timeout_s);

  v("train.epochs", r.train.epochs);
  v("train.gradient_accumulation_steps", r.train.gradient_accumulation_steps);
  v("train.lr", r.train.lr);
  v("train.weight_decay", r.train.weight_decay);
  v("train.lr_scheduler", r.train.lr_scheduler);
  v("train.warmup_steps", r.train.warmup_steps);
  v("train.max_grad_norm", r.train.max_grad_norm);
  v("train.max_steps_per_epoch", r.train.max_steps_per_epoch);
  v("train.seed", r.train.seed);
  v("train.activation_checkpointing", r.train.activation_checkpointing);

  v("checkpoint.output_dir", r.checkpoint.output_dir);
  v("checkpoint.epochs_to_save", r.checkpoint.epochs_to_save);
  v("checkpoint.save_last_epoch_only", r.checkpoint.save_last_epoch_only);
  v("checkpoint.state_every_n_steps", r.checkpoint.state_every_n_steps);
  v("checkpoint.resume", r.checkpoint.resume);
  v("checkpoint.keep_resume_state", r.checkpoint.keep_resume_state);
  v("checkpoint.overwrite", r.checkpoint.overwrite);

  v("dist.backend", r.dist.backend);
  v("dist.timeout_s", r.dist.timeout_s);
  v("dist.debug_checksum_every_n_steps", r.dist.debug_checksum_every_n_steps);
  v("dist.bucket_mb", r.dist.bucket_mb);

  v("track.mongodb", r.track.mongodb);
  v("track.database", r.track.database);
  v("track.log_every_n_steps", r.track.log_every_n_steps);
}

template <class T> struct IsOptional : std::false_type {};
template <class T> struct IsOptional<std::optional<T>> : std::true_type {};

// "runs/x" -> "\"runs/x\"": a double-quoted YAML (and JSON) string, escapes included.
std::string quote_string(std::string_view s);
// Shortest text that reads back as the same double, always with a '.' or an exponent.
std::string format_double(double v);

// A key's value as YAML text (flow style), the form to_yaml writes.
template <class T> std::string yaml_text(const T& v) {
  if constexpr (std::is_same_v<T, std::string>) {
    return quote_string(v);
  } else if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_enum_v<T>) {
    return std::string(name(v));
  } else if constexpr (std::is_integral_v<T>) {
    return std::to_string(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    return format_double(v);
  } else if constexpr (IsOptional<T>::value) {
    return v ? yaml_text(*v) : std::string("null");
  } else if constexpr (std::is_same_v<T, nlohmann::json>) {
    return v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {  // lora.target_modules
    if (v == std::vector<std::string>{"all-linear"}) return "all-linear";
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + quote_string(v[i]);
    return out + "]";
  } else {
    static_assert(std::is_same_v<T, EpochsToSave>);
    if (v.mode == EpochsToSave::Mode::All) return "all";
    if (v.mode == EpochsToSave::Mode::None) return "none";
    std::string out = "[";
    for (size_t i = 0; i < v.epochs.size(); ++i) out += (i ? ", " : "") + std::to_string(v.epochs[i]);
    return out + "]";
  }
}

// A value users can copy for `key`, e.g. "0.0002" for train.lr.
std::string example(std::string_view key);
// " (e.g. train.lr: 0.0002)"
std::string hint(std::string_view key);
// A value from the user, shown in a message: 'fast', [a, b]; one line, at most ~60 characters.
std::string show(std::string_view text);

// Throws lorarun::Error("<origin.at(key)>: <key> <problem>").
[[noreturn]] void fail(const RecipeOrigin& origin, std::string_view key, std::string_view problem);

// prompt-template parsing with `subject` naming the template in messages.
std::vector<TemplatePart> parse_template(std::string_view tmpl, std::string_view subject);

}  // namespace lorarun::recipe::detail
