// What comes from outside (a database, a file's metadata, a network answer): names are checked
// here, in one place, against a strict grammar before they become part of a path, and text is
// escaped before it is printed.
#pragma once
#include <cstddef>
#include <string>
#include <string_view>

namespace lorarun {

// `text` as it may be printed on one line: control characters as \n, \t, \xNN, bytes that are not
// UTF-8 as \xNN, a backslash as \\; cut after `max` bytes with "…" and the full length.
std::string printable(std::string_view text, size_t max = 160);

// The same escapes, backslashes kept and nothing cut: what every log and error line goes through,
// so that one message is one line whatever file or document content it quotes.
std::string one_line(std::string_view text);

// The same escapes, line breaks and tabs kept, nothing cut: a document's text shown on a terminal
// over several lines (no escape sequence, bell or direction override of its own reaches it).
std::string terminal_text(std::string_view text);

// The grammars. A name component: 1–128 bytes of [A-Za-z0-9._+-], not starting with '.' or '-'.
// A relative file name: up to 8 components joined by '/', at most 512 bytes. An adapter of a job
// of many (adapters:): a name component of at most 64 bytes without '.', and none of what the job's
// output directory holds itself (logs, tensorboard, profile, best, resume_state, epoch_*). An artifact:
// epoch_<0-999999>, best or resume_state, or a job's adapter's: <adapter>/<one of those>. A run
// id: 24 hex digits (an ObjectId). A MongoDB database name: 1–63 bytes of [A-Za-z0-9_-], not
// starting with '-'.
bool is_name_component(std::string_view name);
bool is_relative_file_name(std::string_view name);
bool is_adapter_name(std::string_view name);
bool is_artifact_name(std::string_view name);
bool is_run_id(std::string_view id);
bool is_database_name(std::string_view name);

// `name` with A-Z as a-z: two names equal so collide on a case-insensitive filesystem or store.
std::string case_folded(std::string_view name);

// Each throws ConfigError "<what> '<name, printable>', <why it is refused>" when `name` does not
// fit its grammar (the same input refuses it again). `what` says where the name came from ("run
// db/65f… lists a file named").
void check_name_component(std::string_view name, std::string_view what);
void check_relative_file_name(std::string_view name, std::string_view what);
void check_artifact_name(std::string_view name, std::string_view what);
void check_run_id(std::string_view id, std::string_view what);
void check_database_name(std::string_view name, std::string_view what);

}  // namespace lorarun
