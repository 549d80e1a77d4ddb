#include "util/secrets.hpp"

#include <cctype>
#include <mutex>
#include <vector>

namespace lorarun {
namespace {

struct Userinfo {
  size_t begin = 0, end = 0;  // password span inside the URI, empty if none
};

// Finds the password in scheme://user:password@host… (the last '@' before the path ends
// the userinfo, as RFC 3986 and the MongoDB driver read it).
Userinfo find_password(std::string_view uri) {
  const size_t scheme = uri.find("://");
  if (scheme == std::string_view::npos) return {};
  const size_t start = scheme + 3;
  size_t stop = uri.find_first_of("/?#", start);
  if (stop == std::string_view::npos) stop = uri.size();
  const size_t at = uri.rfind('@', stop - 1);
  if (at == std::string_view::npos || at < start) return {};
  const size_t colon = uri.find(':', start);
  if (colon == std::string_view::npos || colon > at) return {};
  return {colon + 1, at};
}

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

std::mutex secrets_mutex;
std::vector<std::string>& secrets() {
  static std::vector<std::string> all;
  return all;
}

}  // namespace

std::string redact_uri(std::string_view uri) {
  const Userinfo pw = find_password(uri);
  std::string out(uri);
  if (pw.end > pw.begin) out.replace(pw.begin, pw.end - pw.begin, "****");
  return out;
}

void register_uri_secret(std::string_view uri) {
  const Userinfo pw = find_password(uri);
  if (pw.end <= pw.begin) return;
  const std::string raw(uri.substr(pw.begin, pw.end - pw.begin));
  const std::string decoded = percent_decode(raw);
  std::lock_guard lock(secrets_mutex);
  for (const std::string& s : {raw, decoded})
    if (!s.empty()) secrets().push_back(s);
}

std::string scrub(std::string text) {
  std::lock_guard lock(secrets_mutex);
  for (const std::string& s : secrets()) {
    for (size_t pos = text.find(s); pos != std::string::npos; pos = text.find(s, pos + 4))
      text.replace(pos, s.size(), "****");
  }
  return text;
}

}  // namespace lorarun
