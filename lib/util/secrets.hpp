// Keeps passwords in MongoDB URIs out of logs, records and error messages.
#pragma once
#include <string>
#include <string_view>

namespace lorarun {

// "mongodb://alice:pw@host/db" -> "mongodb://alice:****@host/db"; other text is unchanged.
// A password holding '@', '/', '?' or '#' is hidden whole.
std::string redact_uri(std::string_view uri);

// The password of scheme://user:password@host… as written (percent-escapes kept), or "".
// Everything between the ':' after the user name and the last '@' counts as the password.
std::string uri_password(std::string_view uri);

// "p%40ss" -> "p@ss" (RFC 3986 percent-decoding; a malformed escape stays as written).
std::string percent_decode(std::string_view s);

// Remembers the password of `uri` (raw and percent-decoded) so scrub() removes it later.
void register_uri_secret(std::string_view uri);

// The MongoDB URI given (a recipe's data.uri, a --uri), else $LORARUN_MONGODB_URI, else "": the one
// place that fallback is made. Its password is registered for scrub().
std::string mongodb_uri(std::string_view given);

// Remembers `secret` (e.g. the password as the MongoDB driver parsed it) for scrub().
void register_secret(std::string_view secret);

// Replaces every registered secret in `text` with "****".
std::string scrub(std::string text);

}  // namespace lorarun
