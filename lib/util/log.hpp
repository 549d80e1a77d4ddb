// Messages for the user: one line each, secrets scrubbed, copied to this rank's log file.
#pragma once
#include <ctime>
#include <string>

namespace lorarun {

// `t` as UTC, "2026-12-01T12:00:00Z" (ISO 8601, as logs, records and run.json write time).
std::string utc_stamp(std::time_t t = std::time(nullptr));

// `seconds` as a clock reads: "4:07", "1:02:03" (an ETA on a progress line).
std::string clock_text(int64_t seconds);

// From now on, also append every line to the file open for writing at `fd` (a rank's log:
// <output_dir>/logs/rank_N.log, opened as io::OutFile), which this takes. Throws lorarun::Error
// when it cannot be used.
void log_to_file(int fd);

// An informational line: on stdout when `console`, always in the log file.
void info(const std::string& message, bool console = true);

// "warning: …" on stderr and in the log file.
void warn(const std::string& message);

// "error: …" in the log file only (each main prints the error itself).
void log_error(const std::string& message);

}  // namespace lorarun
