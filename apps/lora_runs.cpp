// lora-runs: the runs recorded in MongoDB (track.mongodb) and the artifacts they stored in GridFS
// (checkpoint.store: mongodb): list, show, pull an adapter, remove a run.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <nlohmann/json.hpp>

#include "app_main.hpp"
#include "data/mongo.hpp"
#include "track/artifacts.hpp"
#include "track/record.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/secrets.hpp"
#include "util/untrusted.hpp"

namespace lorarun {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr auto kTimeout = std::chrono::seconds(20);
constexpr const char* kOrigin = "--uri or LORARUN_MONGODB_URI";

struct Common {
  std::string uri;
  std::string db = "lorarun";
};

// A run named on the command line: "[DB/]ID[/epoch_N|/best|/resume_state]".
struct RunArg {
  std::string db, id, artifact;
};

// Splits "[DB/]ID[/ARTIFACT]": the part of 24 hex digits is the id; --db when no DB is given.
RunArg parse_run(const std::string& text, const std::string& db) {
  std::vector<std::string> parts;
  size_t start = 0;
  for (size_t slash; (slash = text.find('/', start)) != std::string::npos; start = slash + 1)
    parts.push_back(text.substr(start, slash - start));
  parts.push_back(text.substr(start));
  for (size_t i = 0; i < parts.size() && i < 2; ++i) {
    if (!is_run_id(parts[i]) || parts.size() - i > 3) continue;  // ID, ID/ARTIFACT, ID/NAME/ARTIFACT
    std::string artifact;
    for (size_t k = i + 1; k < parts.size(); ++k) artifact += (artifact.empty() ? "" : "/") + parts[k];
    RunArg run{i == 1 ? parts[0] : db, parts[i], artifact};
    check_database_name(run.db, "the run's database is named");
    return run;
  }
  throw Error(
      fmt::format("'{}' names no run: expected [DATABASE/]ID[/epoch_N|/best] (a job's adapter: "
                  "[DATABASE/]ID/NAME[/epoch_N|/best]), the id as lora-train prints it",
                  scrub(redact_uri(text))));
}

// The URI: --uri, else $LORARUN_MONGODB_URI.
std::string uri_of(const Common& c) {
  const std::string uri = mongodb_uri(c.uri);
  if (uri.empty()) throw Error("no MongoDB URI: give --uri or set LORARUN_MONGODB_URI");
  return uri;
}

// The run document `run`, or one line naming it.
json find_run(data::Client& client, const RunArg& run) {
  const std::vector<json> found = client.find(run.db, "runs", {{"_id", {{"$oid", run.id}}}}, 1);
  if (found.empty())
    throw Error(fmt::format("no run {} in {}.runs at {}: `lora-runs list --db {}` shows the runs there", run.id, run.db,
                            client.redacted_uri(), run.db));
  return found.front();
}

// An extended-JSON date as "2026-12-01T12:00:00Z" ("" when absent).
std::string date_text(const json& d) {
  if (!d.is_object() || !d.contains("$date")) return "";
  const json& v = d["$date"];
  if (v.is_string()) return v.get<std::string>();
  int64_t ms = 0;
  if (v.is_number_integer()) ms = v.get<int64_t>();
  if (v.is_object() && v.contains("$numberLong") && v["$numberLong"].is_string())
    ms = std::strtoll(v["$numberLong"].get<std::string>().c_str(), nullptr, 10);
  return utc_stamp(static_cast<std::time_t>(ms / 1000));
}

// The epochs a run's record says it kept: its stored artifacts' epoch_<i>, else its checkpoints'.
std::vector<int> recorded_epochs(const json& run) {
  std::vector<int> out;
  for (const json& a : run.value("artifacts", json::array())) {
    const std::string name = a.value("artifact", "");
    if (name.rfind("epoch_", 0) == 0) out.push_back(std::atoi(name.c_str() + 6));
  }
  if (out.empty())
    for (const json& c : run.value("checkpoints", json::array())) out.push_back(c.value("epoch", -1));
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

// The run's best eval loss, when it evaluated.
std::string best_loss(const json& run) {
  const json fm = run.value("final_metrics", json());
  if (fm.is_object() && fm.contains("best_eval_loss") && fm["best_eval_loss"].is_number())
    return fmt::format("{:.6f}", fm["best_eval_loss"].get<double>());
  return "-";
}

// The run's name: its recipe's output directory's last part.
std::string run_name(const json& run) {
  const json recipe = run.value("recipe", json::object());
  const std::string out = recipe.value("checkpoint", json::object()).value("output_dir", "");
  return out.empty() ? "-" : fs::path(out).filename().string();
}

// `list`: one line per run, oldest first.
void list(const Common& c, const std::string& status) {
  data::Client client(uri_of(c), kTimeout, {kOrigin});
  const json filter = status.empty() ? json::object() : json{{"status", status}};
  fmt::print("{:<24}  {:<20}  {:<20}  {:<11}  {:<12}  {}\n", "id", "name", "started", "status", "epochs kept",
             "best eval loss");
  for (const json& run : client.find(c.db, "runs", filter)) {
    const std::string id = run["_id"].is_object() ? run["_id"].value("$oid", "") : run["_id"].dump();
    const std::vector<int> kept = recorded_epochs(run);
    const std::string epochs = fmt::format("{}", fmt::join(kept, ","));
    fmt::print("{:<24}  {:<20}  {:<20}  {:<11}  {:<12}  {}\n", id, scrub(run_name(run)),
               date_text(run.value("started_at", json())), run.value("status", ""), epochs.empty() ? "-" : epochs,
               best_loss(run));
  }
}

// `show`: the stored (redacted) recipe, the final metrics and the artifacts, as JSON.
void show(const Common& c, const std::string& ref) {
  const RunArg run = parse_run(ref, c.db);
  data::Client client(uri_of(c), kTimeout, {kOrigin});
  const json doc = find_run(client, run);
  json out = {{"id", run.id},
              {"database", run.db},
              {"status", doc.value("status", "")},
              {"started_at", date_text(doc.value("started_at", json()))},
              {"ended_at", date_text(doc.value("ended_at", json()))},
              {"error", doc.value("error", json())},
              {"recipe", doc.value("recipe", json())},
              {"final_metrics", doc.value("final_metrics", json())},
              {"checkpoints", doc.value("checkpoints", json::array())},
              {"artifacts", doc.value("artifacts", json::array())}};
  if (doc.contains("mixture")) out["mixture"] = doc["mixture"];  // data.sources: the planned epoch
  std::cout << scrub(out.dump(2)) << "\n";
}

// `pull`: an artifact, as the run's record lists it, into the new directory `dir` (written under
// a temporary name, each file checked against its sha256, then renamed: a failure leaves nothing).
void pull(const Common& c, const std::string& ref, const std::string& dir) {
  RunArg run = parse_run(ref, c.db);
  track::ArtifactStore store(uri_of(c), run.db, kTimeout);
  const json doc = store.run_record(run.id);
  run.artifact = track::artifact_named(doc, run.artifact, fmt::format("run {}/{}", run.db, run.id));
  check_artifact_name(run.artifact, fmt::format("'{}' names an artifact", scrub(redact_uri(ref))));
  const std::vector<track::ArtifactFile> files = track::recorded_files(doc, run.artifact);
  store.download(run.id, run.artifact, files, dir);
  int64_t bytes = 0;
  for (const auto& f : files) bytes += f.bytes;
  fmt::print("pulled {}/{}/{} into {}: {} files, {} bytes, sha256 verified\n", run.db, run.id, run.artifact, dir,
             files.size(), bytes);
}

// `rm`: the run record, its metrics and its GridFS files.
void rm(const Common& c, const std::string& ref) {
  const RunArg run = parse_run(ref, c.db);
  const std::string uri = uri_of(c);
  data::Client client(uri, kTimeout, {kOrigin});
  const json doc = find_run(client, run);
  if (const std::optional<std::string> who = track::live_holder(client, run.db, doc))
    throw track::LiveRunError(
        fmt::format("run {}/{} is live ({}): it is removed once it has ended; stop it first", run.db, run.id, *who));
  track::ArtifactStore store(uri, run.db, kTimeout);
  const int64_t files = store.remove(run.id);
  const int64_t metrics = client.delete_many(run.db, "metrics", {{"run_id", {{"$oid", run.id}}}});
  client.delete_many(run.db, "runs", {{"_id", {{"$oid", run.id}}}});
  fmt::print("removed run {}/{}: its record, {} metrics documents and {} GridFS files\n", run.db, run.id, metrics,
             files);
}

// --uri and --db on a subcommand.
void common_args(CLI::App* cmd, Common& c) {
  cmd->add_option("--uri", c.uri, "MongoDB URI (default: $LORARUN_MONGODB_URI)");
  cmd->add_option("--db", c.db, "the run-record database (track.database; default lorarun)");
}

int run(int argc, char** argv) {
  CLI::App app{"lora-runs: runs recorded in MongoDB and their stored adapters"};
  app.require_subcommand(1);
  Common c;
  std::string status, ref, dir;

  auto* ls = app.add_subcommand("list", "one line per run: id, name, started, status, epochs kept, best eval loss");
  common_args(ls, c);
  ls->add_option("--status", status, "only runs with this status (running, completed, failed, interrupted)");
  ls->callback([&] { list(c, status); });

  auto* sh = app.add_subcommand("show", "a run's recipe (secrets redacted), final metrics and artifacts, as JSON");
  common_args(sh, c);
  sh->add_option("run", ref, "[DATABASE/]ID")->required();
  sh->callback([&] { show(c, ref); });

  auto* pl = app.add_subcommand("pull", "a stored adapter into a PEFT adapter directory, sha256 verified");
  common_args(pl, c);
  pl->add_option("run", ref, "[DATABASE/]ID[/epoch_N|/best] (default: the last kept epoch)")->required();
  pl->add_option("dir", dir, "the directory to write")->required();
  pl->callback([&] { pull(c, ref, dir); });

  auto* rmc = app.add_subcommand("rm", "a run's record, metrics documents and GridFS files");
  common_args(rmc, c);
  rmc->add_option("run", ref, "[DATABASE/]ID")->required();
  rmc->callback([&] { rm(c, ref); });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    throw Error(fmt::format("{} (see lora-runs --help)", e.what()));
  }
  return 0;
}

}  // namespace
}  // namespace lorarun

int main(int argc, char** argv) { return lorarun::app_main("lora-runs", argc, argv, lorarun::run); }
