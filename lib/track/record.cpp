#include "track/record.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>

#include "data/mongo.hpp"
#include "io/sha256.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/secrets.hpp"

namespace lorarun::track {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

constexpr const char* kRuns = "runs";
constexpr const char* kMetrics = "metrics";
// After a failed metrics write, skip metrics for this long: a server that went away then costs
// one timeout per pause instead of one per step.
constexpr auto kPauseAfterFailure = std::chrono::seconds(30);

json now_date() {
  const auto ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
          .count();
  return {{"$date", {{"$numberLong", std::to_string(ms)}}}};
}

std::string clean(const std::string& s) { return scrub(redact_uri(s)); }

// MongoDB and FerretDB refuse field names that start with '$' or contain '.'.
bool storable_key(const std::string& k) { return !k.empty() && k[0] != '$' && k.find('.') == std::string::npos; }

// `j` as it may be stored: strings scrubbed of passwords, objects MongoDB would refuse as text.
json storable(const json& j) {
  if (j.is_string()) return clean(j.get<std::string>());
  if (j.is_array()) {
    json out = json::array();
    for (const json& v : j) out.push_back(storable(v));
    return out;
  }
  if (!j.is_object()) return j;
  for (const auto& [k, v] : j.items())
    if (!storable_key(k)) return clean(j.dump());
  json out = json::object();
  for (const auto& [k, v] : j.items()) out[clean(k)] = storable(v);
  return out;
}

// data.filter and eval.filter are MongoDB queries ({"$gt": …}, "meta.lang"): always stored as their
// JSON text.
constexpr const char* kFilterSections[] = {"data", "eval"};

json stored_recipe(json r) {
  for (const char* section : kFilterSections)
    if (r.contains(section) && r[section].contains("filter") && !r[section]["filter"].is_string())
      r[section]["filter"] = r[section]["filter"].dump();
  return storable(r);
}

void check_id(const std::string& id) {
  const bool hex = id.size() == 24 && std::all_of(id.begin(), id.end(),
                                                  [](char c) { return std::isxdigit(static_cast<unsigned char>(c)); });
  if (!hex)
    throw Error(
        fmt::format("'{}' is not a run id: expected 24 hex digits, as lora-train prints it (DATABASE/ID)", clean(id)));
}

json oid(const std::string& id) { return {{"$oid", id}}; }

// The run document `id`, or lorarun::Error naming it.
json find_run(data::Client& client, const std::string& database, const std::string& id) {
  check_id(id);
  const std::vector<json> runs = client.find(database, kRuns, {{"_id", oid(id)}}, 1);
  if (runs.empty())
    throw Error(fmt::format("no run {} in {}.{} at {}: check the id (lora-train prints it as DATABASE/ID) and the URI",
                            id, database, kRuns, client.redacted_uri()));
  return runs.front();
}

std::string hostname() {
  char name[256] = {};
  return gethostname(name, sizeof name - 1) == 0 ? name : "";
}

int64_t restart_count(const json& info) {
  if (info.contains("restart") && info["restart"].is_number_integer()) return info["restart"].get<int64_t>();
  const char* env = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return env && *env ? std::strtoll(env, nullptr, 10) : 0;
}

// [{name, bytes, sha256}] of the regular files under `dir`, by relative name.
json hash_files(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files.push_back(e.path());
  std::sort(files.begin(), files.end());
  json out = json::array();
  for (const fs::path& f : files)
    out.push_back({{"name", clean(f.lexically_relative(dir).string())},
                   {"bytes", static_cast<int64_t>(fs::file_size(f))},
                   {"sha256", io::sha256_file(f.string())}});
  return out;
}

}  // namespace

RunRecorder::RunRecorder(const std::string& uri, const std::string& database, std::chrono::milliseconds timeout)
    : client_(std::make_unique<data::Client>(uri, timeout)), database_(database) {
  if (database.empty())
    throw Error("run records need a database: set track.database (or data.database), or track.mongodb=false");
  client_->server_info();  // unreachable: the one-line error now, not at the first write
}

RunRecorder::~RunRecorder() {
  if (id_.empty() || finished_) return;
  try {
    finish("failed", nullptr, "lora-train stopped without recording how the run ended");
  } catch (...) {  // a destructor must not throw; finish() already warned
  }
}

const std::string& RunRecorder::id() const { return id_; }

std::string RunRecorder::ref() const { return database_ + "/" + id_; }

std::string RunRecorder::begin(const json& recipe_redacted, const json& info,
                               const std::optional<std::string>& resume_id) {
  if (resume_id) return resume(*resume_id, info);
  json doc = {{"lorarun_version", LORARUN_VERSION}, {"hostname", hostname()}};
  const json extra = storable(info);  // a named json: items() of a temporary would dangle
  for (const auto& [k, v] : extra.items()) doc[k] = v;
  doc.erase("restart");  // belongs to resumes entries
  doc.update(json{{"recipe", stored_recipe(recipe_redacted)},
                  {"status", "running"},
                  {"started_at", now_date()},
                  {"ended_at", nullptr},
                  {"checkpoints", json::array()},
                  {"final_metrics", nullptr},
                  {"error", nullptr},
                  {"resumes", json::array()}});
  doc.erase("_id");
  id_ = client_->insert_one(database_, kRuns, doc);
  finished_ = false;
  return id_;
}

std::string RunRecorder::resume(const std::string& id, const json& info) {
  const json run = find_run(*client_, database_, id);
  const json entry = {
      {"resumed_at", now_date()}, {"restart", restart_count(info)}, {"previous_status", run.value("status", "")}};
  client_->update_one(
      database_, kRuns, {{"_id", oid(id)}},
      {{"$set", {{"status", "running"}, {"ended_at", nullptr}, {"error", nullptr}}}, {"$push", {{"resumes", entry}}}});
  id_ = id;
  finished_ = false;
  return id_;
}

// After begin() the database never stops training: a failed write warns (metrics: once, then
// counted in metrics_dropped) and is otherwise ignored.
template <class Write>
void RunRecorder::attempt(const char* what, bool skippable, Write write) {
  if (id_.empty()) throw Error(fmt::format("run record: {} before begin() (a lorarun bug)", what));
  if (skippable && std::chrono::steady_clock::now() < paused_until_) {
    ++dropped_;
    return;
  }
  try {
    write();
  } catch (const std::exception& e) {
    if (skippable) {
      ++dropped_;
      paused_until_ = std::chrono::steady_clock::now() + kPauseAfterFailure;
      if (warned_) return;
      warned_ = true;
    }
    warn(fmt::format("run record {}: {} not recorded: {}; training goes on{}", ref(), what, e.what(),
                     skippable ? " (further metrics failures are only counted)" : ""));
  }
}

void RunRecorder::metrics(const json& row) {
  attempt("metrics", true, [&] {
    json doc = storable(row);
    doc.erase("_id");
    doc["run_id"] = oid(id_);
    doc["time"] = now_date();
    client_->insert_one(database_, kMetrics, doc);
  });
}

void RunRecorder::checkpoint(int epoch, const std::string& dir) {
  attempt("checkpoint", false, [&] {
    const fs::path path = fs::absolute(dir);
    const json entry = {
        {"epoch", epoch}, {"path", clean(path.string())}, {"saved_at", now_date()}, {"files", hash_files(path)}};
    client_->update_one(database_, kRuns, {{"_id", oid(id_)}}, {{"$push", {{"checkpoints", entry}}}});
  });
}

// The run's "artifacts" array with the entries named in `drop` left out.
static json artifacts_without(const json& run, const std::vector<std::string>& drop) {
  json kept = json::array();
  for (const json& a : run.value("artifacts", json::array()))
    if (std::find(drop.begin(), drop.end(), a.value("artifact", "")) == drop.end()) kept.push_back(a);
  return kept;
}

void RunRecorder::artifact(const std::string& artifact, const std::vector<ArtifactFile>& files) {
  json list = artifacts_without(find_run(*client_, database_, id_), {artifact});
  json entry = {{"artifact", artifact}, {"saved_at", now_date()}, {"files", json::array()}};
  for (const ArtifactFile& f : files)
    entry["files"].push_back(
        {{"name", clean(f.name)}, {"bytes", f.bytes}, {"sha256", f.sha256}, {"file_id", f.file_id}});
  list.push_back(entry);
  client_->update_one(database_, kRuns, {{"_id", oid(id_)}}, {{"$set", {{"artifacts", list}}}});
}

void RunRecorder::drop_artifacts(const std::vector<std::string>& artifacts) {
  const json list = artifacts_without(find_run(*client_, database_, id_), artifacts);
  client_->update_one(database_, kRuns, {{"_id", oid(id_)}}, {{"$set", {{"artifacts", list}}}});
}

void RunRecorder::finish(const std::string& status, const json& final_metrics, const std::string& error) {
  if (status != "completed" && status != "failed" && status != "interrupted")
    throw Error(fmt::format("run record: status '{}' is not completed, failed or interrupted (a lorarun bug)", status));
  finished_ = true;
  attempt("the end of the run", false, [&] {
    json set = {{"status", status},
                {"ended_at", now_date()},
                {"final_metrics", storable(final_metrics)},
                {"error", error.empty() ? json(nullptr) : json(clean(error))}};
    if (dropped_ > 0) set["metrics_dropped"] = dropped_;
    client_->update_one(database_, kRuns, {{"_id", oid(id_)}}, {{"$set", set}});
  });
}

json load_run_recipe(const std::string& uri, const std::string& database, const std::string& id,
                     std::chrono::milliseconds timeout) {
  check_id(id);
  data::Client client(uri, timeout);
  client.server_info();
  json recipe = find_run(client, database, id).value("recipe", json());
  if (!recipe.is_object())
    throw Error(fmt::format("run {}/{} has no stored recipe: it was not recorded by lora-train", database, id));
  for (const char* section : kFilterSections) {
    if (!recipe.contains(section) || !recipe[section].contains("filter")) continue;
    json& filter = recipe[section]["filter"];
    if (filter.is_string()) filter = json::parse(filter.get<std::string>(), nullptr, false);
    if (filter.is_discarded())
      throw Error(fmt::format("run {}/{}: its stored {}.filter is not JSON; the record was edited by hand", database,
                              id, section));
  }
  return recipe;
}

std::optional<std::string> find_resumable_run(const std::string& uri, const std::string& database, const json& recipe,
                                              std::chrono::milliseconds timeout) {
  data::Client client(uri, timeout);
  const json mine = stored_recipe(recipe);
  json filter = {{"status", {{"$ne", "completed"}}}};
  if (mine.contains("checkpoint") && mine["checkpoint"].contains("output_dir"))
    filter["recipe.checkpoint.output_dir"] = mine["checkpoint"]["output_dir"];
  std::optional<std::string> found;
  for (const json& run : client.find(database, kRuns, filter)) {  // in _id order: the newest last
    const json artifacts = run.value("artifacts", json::array());
    const bool has_state = std::any_of(artifacts.begin(), artifacts.end(),
                                       [](const json& a) { return a.value("artifact", "") == "resume_state"; });
    if (has_state && run.value("recipe", json()) == mine) found = run["_id"].value("$oid", "");
  }
  return found;
}

}  // namespace lorarun::track
