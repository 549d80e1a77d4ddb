#include "util/secrets.hpp"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <mutex>
#include <vector>

namespace lorarun {
namespace {

struct Userinfo {
  size_t begin = 0, end = 0;  // password span inside the URI, empty if none
};

// Finds the password in scheme://user:password@hosts/…. The user name holds none of ":/?#@["
// (the driver refuses them unescaped), but a password may hold anything, '@', '/', '?' and '#'
// included, so the password runs from the ':' after the user name to the LAST '@' of the text.
// When the options themselves hold an '@' this hides more than the password, never less.
Userinfo find_password(std::string_view uri) {
  const size_t scheme = uri.find("://");
  if (scheme == std::string_view::npos) return {};
  const size_t start = scheme + 3;
  const size_t colon = uri.find_first_of(":/?#@[", start);
  if (colon == std::string_view::npos || uri[colon] != ':') return {};
  const size_t at = uri.rfind('@');
  if (at == std::string_view::npos || at < colon) return {};
  return {colon + 1, at};
}

std::mutex secrets_mutex;
std::vector<std::string>& secrets() {
  static std::vector<std::string> all;
  return all;
}

}  // namespace

std::string percent_decode(std::string_view s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '%' && i + 2 < s.size() && std::isxdigit(static_cast<unsigned char>(s[i + 1])) &&
        std::isxdigit(static_cast<unsigned char>(s[i + 2]))) {
      out += static_cast<char>(std::stoi(std::string(s.substr(i + 1, 2)), nullptr, 16));
      i += 2;
    } else {
      out += s[i];
    }
  }
  return out;
}

std::string redact_uri(std::string_view uri) {
  const Userinfo pw = find_password(uri);
  std::string out(uri);
  if (pw.end > pw.begin) out.replace(pw.begin, pw.end - pw.begin, "****");
  return out;
}

std::string uri_password(std::string_view uri) {
  const Userinfo pw = find_password(uri);
  return std::string(uri.substr(pw.begin, pw.end - pw.begin));
}

void register_uri_secret(std::string_view uri) {
  const std::string raw = uri_password(uri);
  register_secret(raw);
  register_secret(percent_decode(raw));
}

void register_secret(std::string_view secret) {
  if (secret.empty()) return;
  std::lock_guard lock(secrets_mutex);
  if (std::find(secrets().begin(), secrets().end(), secret) == secrets().end()) secrets().emplace_back(secret);
}

std::string scrub(std::string text) {
  std::lock_guard lock(secrets_mutex);
  // Longest first, so a secret that contains another is hidden whole.
  std::vector<std::string> all = secrets();
  std::sort(all.begin(), all.end(), [](const auto& a, const auto& b) { return a.size() > b.size(); });
  for (const std::string& s : all) {
    for (size_t pos = text.find(s); pos != std::string::npos; pos = text.find(s, pos + 4))
      text.replace(pos, s.size(), "****");
  }
  return text;
}

std::string mongodb_uri(std::string_view given) {
  std::string uri(given);
  if (const char* env = std::getenv("LORARUN_MONGODB_URI"); uri.empty() && env) uri = env;
  register_uri_secret(uri);
  return uri;
}

}  // namespace lorarun
