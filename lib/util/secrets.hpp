// Keeps passwords in MongoDB URIs out of logs, records and error messages.
#pragma once
#include <string>
#include <string_view>

namespace lorarun {

// "mongodb://alice:pw@host/db" -> "mongodb://alice:****@host/db"; other text is unchanged.
std::string redact_uri(std::string_view uri);

// Remembers the password of `uri` (raw and percent-decoded) so scrub() removes it later.
void register_uri_secret(std::string_view uri);

// Replaces every registered secret in `text` with "****".
std::string scrub(std::string text);

}  // namespace lorarun
