#include "chat/chat_template.hpp"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <regex>
#include <thread>
#include <tuple>
#include <utility>

extern "C" {
struct LorarunChatCompiled;
int lorarun_chat_compile(const char* tmpl, size_t tmpl_len, uint64_t fuel, LorarunChatCompiled** handle, char** error,
                         size_t* error_len);
void lorarun_chat_release(LorarunChatCompiled* handle);
int lorarun_chat_render(const LorarunChatCompiled* handle, const char* context, size_t context_len, int quick,
                        char** out, size_t* out_len);
void lorarun_chat_free(char* p, size_t len);
}

namespace lorarun::chat {
namespace {

// U+FDD0 and U+FDD1 in UTF-8: where the crate opens and closes a generation span.
constexpr std::string_view kOpen = "\xEF\xB7\x90", kClose = "\xEF\xB7\x91";

// The fuel of the crate's quick try at a render (its QUICK_FUEL).
constexpr uint64_t kQuickFuel = 1'000'000;

// Takes ownership of a string the crate returned.
std::string take(char* p, size_t len) {
  std::string s(p, len);
  lorarun_chat_free(p, len);
  return s;
}

// The text between the crate's generation marks, and the spans they mark.
Rendered spans_of(const std::string& text) {
  Rendered r;
  r.text.reserve(text.size());
  std::vector<size_t> open;
  for (size_t i = 0; i < text.size();) {
    const std::string_view rest = std::string_view(text).substr(i);
    if (rest.starts_with(kOpen)) {
      open.push_back(r.text.size());
      i += kOpen.size();
    } else if (rest.starts_with(kClose)) {
      // Nested blocks: the outer span covers the inner one, as in transformers (both are kept).
      r.generation.emplace_back(open.back(), r.text.size());
      open.pop_back();
      i += kClose.size();
    } else {
      r.text += text[i++];
    }
  }
  std::sort(r.generation.begin(), r.generation.end());
  return r;
}

}  // namespace

struct Template::Handle {
  LorarunChatCompiled* compiled;
  ~Handle() { lorarun_chat_release(compiled); }

  // The crate's text (status 0) or message.
  std::pair<int, std::string> render(const std::string& ctx, bool quick) const {
    char* out = nullptr;
    size_t len = 0;
    const int status = lorarun_chat_render(compiled, ctx.data(), ctx.size(), quick ? 1 : 0, &out, &len);
    return {status, take(out, len)};
  }
};

std::variant<Template, std::string> Template::compile(std::string_view source, uint64_t fuel) {
  LorarunChatCompiled* compiled = nullptr;
  char* error = nullptr;
  size_t len = 0;
  if (lorarun_chat_compile(source.data(), source.size(), fuel, &compiled, &error, &len) != 0) return take(error, len);
  Template t;
  t.handle_ = std::make_shared<Handle>(compiled);
  t.fuel_ = fuel;
  return t;
}

std::variant<Rendered, std::string> render(std::string_view tmpl, const nlohmann::ordered_json& context) {
  auto t = Template::compile(tmpl);
  if (auto* e = std::get_if<std::string>(&t)) return *e;
  return std::get<Template>(t).render(context);
}

std::variant<Rendered, std::string> Template::render(const nlohmann::ordered_json& context,
                                                     const std::atomic<bool>* stop) const {
  // Invalid UTF-8 in a string is written as U+FFFD rather than thrown (the crate refuses none).
  const std::string ctx = context.dump(-1, ' ', false, nlohmann::ordered_json::error_handler_t::replace);
  auto [status, text] = handle_->render(ctx, true);
  const bool more = status != 0 && text == kFuelSpent && (fuel_ == 0 || fuel_ > kQuickFuel);
  if (more && !stop) std::tie(status, text) = handle_->render(ctx, false);
  if (more && stop) {
    // The whole fuel's render in a thread that owns what it uses (the handle, the context), so that
    // this can stop waiting for it: an abandoned one ends on its own, its result dropped.
    struct Pending {
      std::mutex mu;
      std::condition_variable cv;
      std::optional<std::pair<int, std::string>> result;
    };
    auto pending = std::make_shared<Pending>();
    std::thread([handle = handle_, ctx, pending] {
      auto result = handle->render(ctx, false);
      std::lock_guard lock(pending->mu);
      pending->result = std::move(result);
      pending->cv.notify_all();
    }).detach();
    std::unique_lock lock(pending->mu);
    while (!pending->result) {
      if (stop->load()) return std::string(kRenderStopped);
      pending->cv.wait_for(lock, std::chrono::milliseconds(50));  // (a signal handler cannot notify)
    }
    std::tie(status, text) = std::move(*pending->result);
  }
  if (status != 0) return text;
  return spans_of(text);
}

bool has_generation_tags(std::string_view tmpl) {
  static const std::regex re(R"(\{%-?\s*generation\s*-?%\})");
  return std::regex_search(tmpl.begin(), tmpl.end(), re);
}

}  // namespace lorarun::chat
