// Chat templates: the Jinja templates of Hugging Face tokenizers (tokenizer_config.json's
// chat_template, chat_template.jinja, a GGUF's tokenizer.chat_template), rendered as
// transformers' apply_chat_template renders them.
//
// The engine is minijinja (Rust, through our crate lib/chat/rust): a maintained, complete
// implementation of Jinja2's syntax that renders chat templates in production; a Jinja subset
// written here would differ from transformers on the templates that use the rest. Around it,
// what transformers' sandbox adds: trim_blocks and lstrip_blocks, loop controls, namespace(),
// raise_exception(message), strftime_now(format), a tojson filter writing what Python's
// json.dumps writes (ensure_ascii=False, keys unsorted, indent=), Python's string and dict
// methods, and the {% generation %} ... {% endgeneration %} tag, whose spans are returned.
#pragma once
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

namespace lorarun::chat {

// What one render may spend (minijinja's fuel: about one template instruction, or 64 bytes of data
// made, each): the default of data.chat_template_fuel. Real chat templates spend far less (the
// docs/data.md gives figures); a template that loops without end stops here in under a second.
inline constexpr uint64_t kDefaultFuel = 10'000'000;

// The message of a render that spent its fuel.
inline constexpr std::string_view kFuelSpent = "the render ran out of fuel";

// The message of a render abandoned because a stop was requested (render's `stop`).
inline constexpr std::string_view kRenderStopped = "the render was stopped: a stop was requested";

struct Rendered {
  std::string text;
  // The byte ranges [begin, end) of text that {% generation %} blocks wrote, in order.
  std::vector<std::pair<size_t, size_t>> generation;
};

// A template compiled once, rendered many times (from several threads at once if need be).
class Template {
 public:
  // The compiled template, or a one-line message ("line N: ...") for a syntax error. Each render
  // may spend `fuel` (0: no bound); one that spends it fails with kFuelSpent.
  static std::variant<Template, std::string> compile(std::string_view source, uint64_t fuel = kDefaultFuel);

  // Renders with the variables of `context` (a JSON object: messages, add_generation_prompt,
  // bos_token, ...). On failure, a one-line message that starts "line N: " when the template
  // line is known (raise_exception's message as given). With `stop`, a render that needs more
  // than a quick try's fuel goes on in a thread of its own while this waits, and is abandoned
  // (kRenderStopped) within 50 ms of *stop being set, however much fuel it may still spend.
  std::variant<Rendered, std::string> render(const nlohmann::ordered_json& context,
                                             const std::atomic<bool>* stop = nullptr) const;

 private:
  struct Handle;
  std::shared_ptr<Handle> handle_;
  uint64_t fuel_ = kDefaultFuel;
};

// Compiles `tmpl` and renders it once (Template::compile, then render).
std::variant<Rendered, std::string> render(std::string_view tmpl, const nlohmann::ordered_json& context);

// True when `tmpl` has a {% generation %} tag (with any whitespace control), as transformers
// checks before it returns assistant masks.
bool has_generation_tags(std::string_view tmpl);

}  // namespace lorarun::chat
