// Training runs of the real binaries on the tiny llama fixture (LORARUN_MODEL_FIXTURES): the
// documents, the recipe, and a run interrupted part way.
#pragma once
#include <map>
#include <string>

#include "support/process.hpp"

namespace lorarun::test {

// `n` instruction documents "Add i and 3i+1" -> "4i+1", i from `from`, one JSON object a line.
void write_data(const std::string& path, int n, int from = 0);

// `dir`/`name`.yaml: LoRA r 4 on every linear of the llama fixture, fp32 on the CPU, reading
// `dir`/data.jsonl, writing `dir`/`name`, no MongoDB records. `train` is the train: section's
// keys; `lora` and `data` are appended to those sections (", dropout: 0.1"); `extra` is appended
// YAML. Returns the path.
std::string write_recipe(const std::string& dir, const std::string& name, const std::string& train,
                         const std::string& lora = "", const std::string& data = "", const std::string& extra = "");

// Largest absolute difference between two float32 adapter files, tensor by tensor (inf if their
// keys or sizes differ).
double adapter_diff(const std::string& a, const std::string& b);
// The same over the largest absolute value in `a`.
double adapter_relative_diff(const std::string& a, const std::string& b);

// The regular files under `dir` as {relative name: sha256}.
std::map<std::string, std::string> hashes(const std::string& dir);

// `key` of the first row of `output_dir`/metrics.jsonl (a number, e.g. base_mb).
double first_metric(const std::string& output_dir, const std::string& key);

// The run id lora-train printed ("run recorded as DB/ID" in `output`).
std::string run_id_in(const std::string& output, const std::string& db);

// Runs `cmd` in the background until its output shows `marker`, then `act`, a shell snippet
// ($pid: the command, $log: its output); waits for the command and prints exit=<status>.
Result interrupt(const std::string& cmd, const std::string& log, const std::string& marker, const std::string& act);

// `cmd` sent SIGTERM `pause` seconds after its output (into `log`) shows `marker`: its exit status
// and the milliseconds from the signal to its end (Catch: that it ended and said so).
struct Stopped {
  int status = -1;
  int ms = -1;
};
Stopped sigterm_after(const std::string& cmd, const std::string& log, const std::string& marker, double pause);

// `cmd` (a training run into `output_dir`) stopped by SIGTERM once its output shows `marker`: it
// must exit 75 with its resumable state saved; then `cmd` again, which must resume and finish.
// Checks both (Catch) and returns the second run.
Result stop_and_resume(const std::string& cmd, const std::string& output_dir, const std::string& marker);

}  // namespace lorarun::test
