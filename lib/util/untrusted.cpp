#include "util/untrusted.hpp"

#include <fmt/format.h>
#include <algorithm>
#include <cstdint>

#include "util/error.hpp"

namespace lorarun {
namespace {

// The length of the valid UTF-8 sequence at s[i] and its code point; 0 when it is not one
// (overlong forms, surrogates and code points past U+10FFFF are not).
size_t utf8_at(std::string_view s, size_t i, uint32_t& cp) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  size_t n = 0;
  if (c < 0x80) {
    cp = c;
    return 1;
  }
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
    cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    cp = c & 0x0F;
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (size_t k = 1; k < n; ++k) {
    if ((b(k) & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b(k) & 0x3F);
  }
  if ((n == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) || (n == 4 && (cp < 0x10000 || cp > 0x10FFFF)))
    return 0;
  return n;
}

// Code points a terminal would act on rather than show: C1 controls, line separators, bidi
// overrides and isolates.
bool invisible(uint32_t cp) {
  return (cp >= 0x80 && cp <= 0x9F) || cp == 0x2028 || cp == 0x2029 || (cp >= 0x202A && cp <= 0x202E) ||
         (cp >= 0x2066 && cp <= 0x2069);
}

bool component_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == '-' || c == '+';
}

bool hex(char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || (c >= 'A' && c <= 'F'); }

[[noreturn]] void refuse(std::string_view name, std::string_view what, std::string_view why) {
  throw ConfigError(fmt::format("{} '{}', {}", what, printable(name), why));
}

// printable(), one_line() and terminal_text(): the same escapes, `backslash` doubled or not, line
// breaks and tabs kept or not.
std::string escape(std::string_view text, size_t max, bool backslash, bool keep_lines = false) {
  std::string out;
  size_t i = 0;
  for (; i < text.size() && out.size() < max;) {
    uint32_t cp = 0;
    const size_t n = utf8_at(text, i, cp);
    const char c = text[i];
    if (n == 0) {
      out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
    } else if (n == 1 && c == '\\' && backslash) {
      out += "\\\\";
    } else if (n == 1 && (c == '\n' || c == '\t') && keep_lines) {
      out += c;
    } else if (n == 1 && c == '\n') {
      out += "\\n";
    } else if (n == 1 && c == '\t') {
      out += "\\t";
    } else if (n == 1 && c == '\r') {
      out += "\\r";
    } else if (n == 1 && (cp < 0x20 || cp == 0x7F)) {
      out += fmt::format("\\x{:02x}", cp);
    } else if (invisible(cp)) {
      out += fmt::format("\\u{{{:04x}}}", cp);
    } else {
      out.append(text.substr(i, n));
    }
    i += n == 0 ? 1 : n;
  }
  if (i < text.size()) out += fmt::format("… ({} bytes)", text.size());
  return out;
}

}  // namespace

std::string printable(std::string_view text, size_t max) { return escape(text, max, true); }

std::string one_line(std::string_view text) { return escape(text, 1 << 20, false); }

std::string terminal_text(std::string_view text) { return escape(text, std::string_view::npos, false, true); }

bool is_name_component(std::string_view name) {
  return !name.empty() && name.size() <= 128 && name[0] != '.' && name[0] != '-' &&
         std::all_of(name.begin(), name.end(), component_char);
}

bool is_relative_file_name(std::string_view name) {
  if (name.empty() || name.size() > 512) return false;
  int parts = 0;
  for (std::string_view rest = name;; ++parts) {
    const size_t slash = rest.find('/');
    if (!is_name_component(rest.substr(0, slash)) || parts >= 8) return false;
    if (slash == std::string_view::npos) return true;
    rest.remove_prefix(slash + 1);
  }
}

bool is_adapter_name(std::string_view name) {
  return is_name_component(name) && name.size() <= 64 && name.find('.') == std::string_view::npos && name != "logs" &&
         name != "tensorboard" && name != "profile" && name != "best" && name != "resume_state" &&
         !name.starts_with("epoch_");
}

bool is_artifact_name(std::string_view name) {
  if (const size_t slash = name.find('/'); slash != std::string_view::npos)  // a job's adapter's
    return is_adapter_name(name.substr(0, slash)) && name.substr(slash + 1).find('/') == std::string_view::npos &&
           is_artifact_name(name.substr(slash + 1));
  if (name == "best" || name == "resume_state") return true;
  if (!name.starts_with("epoch_")) return false;
  const std::string_view digits = name.substr(6);
  return !digits.empty() && digits.size() <= 6 && (digits.size() == 1 || digits[0] != '0') &&
         std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; });
}

bool is_run_id(std::string_view id) { return id.size() == 24 && std::all_of(id.begin(), id.end(), hex); }

bool is_database_name(std::string_view name) {
  return !name.empty() && name.size() <= 63 && name[0] != '-' && std::all_of(name.begin(), name.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' || c == '-';
  });
}

void check_name_component(std::string_view name, std::string_view what) {
  if (!is_name_component(name))
    refuse(name, what,
           "which is not a plain name (1-128 of the characters A-Z a-z 0-9 . _ + -, not starting with '.' or '-'): "
           "refusing it");
}

void check_relative_file_name(std::string_view name, std::string_view what) {
  if (!is_relative_file_name(name))
    refuse(name, what,
           "which is not a relative file name (at most 8 plain names of A-Z a-z 0-9 . _ + - joined by '/', none "
           "starting with '.'): refusing it");
}

void check_artifact_name(std::string_view name, std::string_view what) {
  if (!is_artifact_name(name))
    refuse(name, what, "which is not epoch_N, best or resume_state, or an adapter's NAME/epoch_N, …: refusing it");
}

void check_run_id(std::string_view id, std::string_view what) {
  if (!is_run_id(id)) refuse(id, what, "which is not a run id (24 hex digits, as lora-train prints it)");
}

void check_database_name(std::string_view name, std::string_view what) {
  if (!is_database_name(name))
    refuse(name, what, "which is not a database name (1-63 of A-Z a-z 0-9 _ -, not starting with '-')");
}

std::string case_folded(std::string_view name) {
  std::string out(name);
  for (char& c : out)
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  return out;
}

}  // namespace lorarun
