// Files read as input (a recipe, data.path, a model's files): opened so that what is not a plain
// file (a directory, a FIFO, a device) is refused in one line rather than read or waited on.
#pragma once
#include <string>
#include <string_view>

namespace lorarun {

// What `mode` (a stat st_mode) is, for messages: "a directory", "a FIFO", "a device", …
const char* file_kind(unsigned mode);

// Opens `path` to read (O_RDONLY, close-on-exec), or throws ConfigError naming `what` (the key or
// role of the file, "data.path") and the path: when it cannot be opened, and when it is not a
// regular file (opened without blocking, so a FIFO with no writer cannot hang the caller).
int open_input(const std::string& path, std::string_view what = "");

// The whole file, or ConfigError naming it (open_input's checks, then read errors).
std::string read_input(const std::string& path, std::string_view what = "");

}  // namespace lorarun
