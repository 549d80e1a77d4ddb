// Warnings for the user: one line on stderr, secrets scrubbed.
#pragma once
#include <string>

namespace lorarun {

void warn(const std::string& message);

}  // namespace lorarun
