#include "track/record.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <filesystem>
#include <random>

#include "data/mongo.hpp"
#include "io/sha256.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/process.hpp"
#include "util/secrets.hpp"
#include "util/untrusted.hpp"

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

int64_t restart_count(const json& info) {
  return info.contains("restart") && info["restart"].is_number_integer() ? info["restart"].get<int64_t>() : 0;
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

// How often a live run renews its lease: LORARUN_LEASE_RENEW_S seconds (default 10). A lease not
// renewed for three periods is stale.
std::chrono::milliseconds renew_every() {
  const char* env = std::getenv("LORARUN_LEASE_RENEW_S");
  const double s = env && *env ? std::strtod(env, nullptr) : 10.0;
  return std::chrono::milliseconds(static_cast<int64_t>(std::clamp(s, 0.05, 3600.0) * 1000));
}

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

std::string new_token() {
  std::random_device rd;
  return fmt::format("{:08x}{:08x}{:08x}{:08x}", rd(), rd(), rd(), rd());
}

// The lease we write: this process, renewed now.
json lease_of(const std::string& token, std::chrono::milliseconds every) {
  const ProcessIdentity me = this_process();
  return {{"host", me.host},          {"boot_id", me.boot_id},    {"pid", me.pid},
          {"started", me.started},    {"token", token},           {"renewed_ms", now_ms()},
          {"renewed_at", now_date()}, {"every_ms", every.count()}};
}

int64_t number(const json& j, const char* key) {
  return j.contains(key) && j[key].is_number_integer() ? j[key].get<int64_t>() : 0;
}

// The lease of a run document, when it has one.
std::optional<json> lease_in(const json& run) {
  if (!run.contains("lease") || !run["lease"].is_object()) return std::nullopt;
  return run["lease"];
}

// The filter matching `run` only while its lease is the one we read.
json unchanged_lease(const json& run) {
  const std::optional<json> lease = lease_in(run);
  json filter = {{"_id", run.at("_id")}};
  if (lease && (*lease).contains("token"))
    filter["lease.token"] = (*lease)["token"];
  else
    filter["lease"] = nullptr;  // (matches a missing field too)
  return filter;
}

std::string holder_text(const json& lease) {
  return fmt::format("pid {} on {}", number(lease, "pid"), printable(lease.value("host", "?")));
}

}  // namespace

std::optional<std::string> live_holder(data::Client& client, const std::string& database, const json& run) {
  std::optional<json> lease = lease_in(run);
  if (!lease) return std::nullopt;
  const ProcessIdentity holder{(*lease).value("host", ""), (*lease).value("boot_id", ""), number(*lease, "pid"),
                               number(*lease, "started")};
  if (on_this_host(holder)) {
    if (!alive_here(holder)) return std::nullopt;
    return fmt::format("{}, renewed {} s ago", holder_text(*lease), (now_ms() - number(*lease, "renewed_ms")) / 1000);
  }
  // Another host: stale once three renewals were missed by its clock as ours reads it; until then,
  // watch whether it is renewed (which needs no agreement between clocks).
  const int64_t every = std::max<int64_t>(number(*lease, "every_ms"), 50);
  const int64_t renewed = number(*lease, "renewed_ms");
  const int64_t deadline = renewed + 3 * every;
  while (now_ms() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(std::min<int64_t>(every / 4 + 1, deadline - now_ms() + 1)));
    const std::vector<json> again = client.find(database, kRuns, {{"_id", run.at("_id")}}, 1);
    if (again.empty()) return std::nullopt;
    const std::optional<json> now = lease_in(again.front());
    if (!now || (*now).value("token", "") != (*lease).value("token", "")) return std::nullopt;  // ended, or taken
    if (number(*now, "renewed_ms") != renewed)
      return fmt::format("{}, renewed while this process watched", holder_text(*now));
  }
  return std::nullopt;
}

RunRecorder::RunRecorder(const std::string& uri, const std::string& database, std::chrono::milliseconds timeout)
    : client_(std::make_unique<data::Client>(uri, timeout)), database_(database), uri_(uri), timeout_(timeout) {
  if (database.empty())
    throw Error("run records need a database: set track.database (or data.database), or track.mongodb=false");
  client_->server_info();  // unreachable: the one-line error now, not at the first write
}

RunRecorder::~RunRecorder() {
  stop_renewing();
  if (id_.empty() || finished_) return;
  try {
    finish("failed", nullptr, "lora-train stopped without recording how the run ended");
  } catch (...) {  // a destructor must not throw; finish() already warned
  }
}

const std::string& RunRecorder::id() const { return id_; }

std::string RunRecorder::ref() const { return database_ + "/" + id_; }

std::optional<std::string> RunRecorder::lost_lease() const {
  std::lock_guard lock(mu_);
  return lost_;
}

json RunRecorder::mine() const { return {{"_id", oid(id_)}, {"lease.token", token_}}; }

// Renews the lease every period over a connection of its own (the driver's clients are not
// thread-safe) until stop_renewing(); a lease found taken over sets lost_ and ends it. A server
// that does not answer is tried again at the next period (the lease may lapse meanwhile).
void RunRecorder::start_renewing() {
  const std::chrono::milliseconds every = renew_every();
  renewer_ = std::thread([this, every] {
    std::unique_ptr<data::Client> client;
    bool warned = false;
    std::unique_lock lock(mu_);
    while (!wake_.wait_for(lock, every, [&] { return stopping_; })) {
      lock.unlock();
      std::optional<std::string> lost;
      try {
        if (!client) client = std::make_unique<data::Client>(uri_, timeout_);
        const json set = {{"$set", {{"lease.renewed_ms", now_ms()}, {"lease.renewed_at", now_date()}}}};
        if (!client->update_one(database_, kRuns, mine(), set)) {
          const std::vector<json> run = client->find(database_, kRuns, {{"_id", oid(id_)}}, 1);
          const std::optional<json> lease = run.empty() ? std::nullopt : lease_in(run.front());
          lost = lease ? fmt::format("the run record {} was taken over by {}", ref(), holder_text(*lease))
                       : fmt::format("the run record {} was ended or removed by another process", ref());
        }
      } catch (const std::exception& e) {
        if (!warned) warn(fmt::format("run record {}: renewing its lease failed: {}; trying again", ref(), e.what()));
        warned = true;
      }
      lock.lock();
      if (lost) {
        lost_ = lost;
        return;
      }
    }
  });
}

void RunRecorder::stop_renewing() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  wake_.notify_all();
  if (renewer_.joinable()) renewer_.join();
}

// A new run may not write the output directory a live run writes (the directory's lock is gone
// with the directory when it was removed under that run).
void RunRecorder::refuse_live_output_dir(const json& info) {
  if (!info.contains("output_dir") || !info["output_dir"].is_string()) return;
  const json filter = {{"output_dir", clean(info["output_dir"].get<std::string>())}, {"status", "running"}};
  for (const json& run : client_->find(database_, kRuns, filter))
    if (const std::optional<std::string> who = live_holder(*client_, database_, run))
      throw LiveRunError(fmt::format(
          "run {}/{} is live ({}) and writes checkpoint.output_dir {}: a second run never shares it; wait for that "
          "run to end or stop it, or give this run another checkpoint.output_dir",
          database_, run["_id"].value("$oid", "?"), *who, info["output_dir"].get<std::string>()));
}

std::string RunRecorder::begin(const json& recipe_redacted, const json& info,
                               const std::optional<std::string>& resume_id) {
  if (resume_id) return resume(*resume_id, info);
  refuse_live_output_dir(info);
  token_ = new_token();
  json doc = {{"lorarun_version", LORARUN_VERSION}, {"hostname", host_name()}};
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
                  {"resumes", json::array()},
                  {"lease", lease_of(token_, renew_every())}});
  doc.erase("_id");
  id_ = client_->insert_one(database_, kRuns, doc);
  finished_ = false;
  start_renewing();
  return id_;
}

std::string RunRecorder::resume(const std::string& id, const json& info) {
  const json run = find_run(*client_, database_, id);
  const std::string out = info.value("output_dir", run.value("output_dir", ""));
  if (const std::optional<std::string> who = live_holder(*client_, database_, run))
    throw LiveRunError(
        fmt::format("run {}/{} is live ({}), writing checkpoint.output_dir {}: a second command never takes over a "
                    "live run; wait for it to end or stop it",
                    database_, id, *who, printable(out)));
  json entry = {
      {"resumed_at", now_date()}, {"restart", restart_count(info)}, {"previous_status", run.value("status", "")}};
  if (const std::optional<json> stale = lease_in(run))  // its holder is gone: say whose run this was
    entry["took_over"] = {{"host", (*stale).value("host", "")}, {"pid", number(*stale, "pid")}};
  token_ = new_token();
  const json set = {
      {"status", "running"}, {"ended_at", nullptr}, {"error", nullptr}, {"lease", lease_of(token_, renew_every())}};
  if (!client_->update_one(database_, kRuns, unchanged_lease(run), {{"$set", set}, {"$push", {{"resumes", entry}}}}))
    throw LiveRunError(fmt::format(
        "run {}/{} was taken over by another process while this one resumed it: a second command never takes over a "
        "live run",
        database_, id));
  id_ = id;
  finished_ = false;
  start_renewing();
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
  if (lost_lease()) return;
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
    update_mine("the checkpoint", {{"$push", {{"checkpoints", entry}}}});
  });
}

// Applies `update` to our run document while we hold its lease; lorarun::Error when another
// process took it over (nothing is written then).
void RunRecorder::update_mine(const char* what, const json& update) {
  if (!client_->update_one(database_, kRuns, mine(), update))
    throw Error(fmt::format("run record {}: {} not recorded: another process holds the run's lease now", ref(), what));
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
  update_mine(("artifact " + artifact).c_str(), {{"$set", {{"artifacts", list}}}});
}

void RunRecorder::drop_artifacts(const std::vector<std::string>& artifacts) {
  const json list = artifacts_without(find_run(*client_, database_, id_), artifacts);
  update_mine("the artifacts", {{"$set", {{"artifacts", list}}}});
}

void RunRecorder::finish(const std::string& status, const json& final_metrics, const std::string& error) {
  if (status != "completed" && status != "failed" && status != "interrupted")
    throw Error(fmt::format("run record: status '{}' is not completed, failed or interrupted (a lorarun bug)", status));
  finished_ = true;
  stop_renewing();
  if (id_.empty()) return;  // never begun (refused before it was recorded): nothing to end
  attempt("the end of the run", false, [&] {
    json set = {{"lease", nullptr},
                {"status", status},
                {"ended_at", now_date()},
                {"final_metrics", storable(final_metrics)},
                {"error", error.empty() ? json(nullptr) : json(clean(error))}};
    if (dropped_ > 0) set["metrics_dropped"] = dropped_;
    update_mine("the end of the run", {{"$set", set}});
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

std::optional<json> find_resumable_run(const std::string& uri, const std::string& database, const json& recipe,
                                       std::chrono::milliseconds timeout) {
  data::Client client(uri, timeout);
  const json mine = stored_recipe(recipe);
  json filter = {{"status", {{"$ne", "completed"}}}};
  if (mine.contains("checkpoint") && mine["checkpoint"].contains("output_dir"))
    filter["recipe.checkpoint.output_dir"] = mine["checkpoint"]["output_dir"];
  std::optional<json> found;
  for (const json& run : client.find(database, kRuns, filter)) {  // in _id order: the newest last
    const json artifacts = run.value("artifacts", json::array());
    const bool has_state = artifacts.is_array() && std::any_of(artifacts.begin(), artifacts.end(), [](const json& a) {
                             const std::string name = a.is_object() ? a.value("artifact", "") : "";
                             return name == "resume_state" || name.ends_with("/resume_state");  // (a job's adapter's)
                           });
    if (has_state && run.value("recipe", json()) == mine) found = run;
  }
  if (!found) return std::nullopt;
  const std::string id = (*found)["_id"].is_object() ? (*found)["_id"].value("$oid", "") : "";
  check_run_id(id, fmt::format("a run of {}.{} has the id", database, kRuns));
  if (const std::optional<std::string> who = live_holder(client, database, *found))
    throw LiveRunError(fmt::format(
        "run {}/{} of this recipe is live ({}), writing checkpoint.output_dir {}: it is never restored while it "
        "runs; wait for it to end or stop it, or give this run another checkpoint.output_dir",
        database, id, *who, printable((*found).value("output_dir", "?"))));
  return found;
}

}  // namespace lorarun::track
