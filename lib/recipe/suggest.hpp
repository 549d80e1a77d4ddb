// "Did you mean …": the closest known name to a misspelt or foreign one, and the messages for
// unknown keys and sections.
#pragma once
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace lorarun::recipe::detail {

// Optimal-string-alignment distance: insertions, deletions, substitutions, adjacent swaps.
size_t edit_distance(std::string_view a, std::string_view b);

// True when `word` is close enough to `candidate` to suggest it: a small edit distance; or one
// abbreviates the other by prefixes of its '_'-separated words ("lr" / "learning_rate",
// "grad_accum_steps" / "gradient_accumulation_steps", "train" / "training"); or the words of
// one are words of the other ("batch" / "batch_size").
bool is_close(std::string_view word, std::string_view candidate);

// The candidate closest to `word` among those is_close() accepts (ties: the first).
std::optional<std::string> closest(std::string_view word, const std::vector<std::string>& candidates);

// "unknown key 'train.learning_rate'; did you mean 'train.lr'?": the same name in another section,
// a close name in this one, a name other tools use, or else the section's keys.
std::string unknown_key_message(std::string_view section, std::string_view leaf);
// A top-level name that is not a section: a key without its section, a misspelt or foreign
// section name, or else the list of sections.
std::string unknown_top_message(std::string_view name);

}  // namespace lorarun::recipe::detail
