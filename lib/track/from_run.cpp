#include "track/from_run.hpp"

#include <fmt/format.h>
#include <algorithm>

#include "track/record.hpp"
#include "util/error.hpp"
#include "util/secrets.hpp"
#include "util/untrusted.hpp"

namespace lorarun::track {
namespace {

// "h1:27017,h2" of "mongodb://user:pw@h1:27017,h2/db?opts". Read from the redacted form, whose
// password holds none of "/?#@" whatever the real one holds.
std::string hosts_of(const std::string& given) {
  const std::string uri = redact_uri(given);
  const size_t scheme = uri.find("://");
  if (scheme == std::string::npos) return uri;
  const size_t start = scheme + 3;
  size_t stop = uri.find_first_of("/?#", start);
  if (stop == std::string::npos) stop = uri.size();
  const size_t at = uri.rfind('@', stop - 1);
  const size_t from = at != std::string::npos && at >= start ? at + 1 : start;
  return uri.substr(from, stop - from);
}

bool overridden(const std::vector<std::string>& overrides, const std::string& key) {
  return std::any_of(overrides.begin(), overrides.end(),
                     [&](const std::string& o) { return o.starts_with(key + "="); });
}

}  // namespace

RunRef parse_run_ref(const std::string& text, const std::string& runs_db) {
  const size_t slash = text.rfind('/');
  if (slash != std::string::npos && slash > 0) return {text.substr(0, slash), text.substr(slash + 1)};
  if (slash == std::string::npos && !runs_db.empty()) return {runs_db, text};
  throw Error(
      fmt::format("run '{}' names no database: give it as DATABASE/ID, as lora-train printed it, or add "
                  "--runs-db DATABASE",
                  redact_uri(text)));
}

recipe::Recipe recipe_from_run(const std::string& ref, const std::string& runs_db, const std::string& uri,
                               const std::vector<std::string>& overrides, std::chrono::milliseconds timeout) {
  if (uri.empty()) throw Error("--from-run reads the run record from MongoDB: give --uri or set LORARUN_MONGODB_URI");
  const RunRef run = parse_run_ref(ref, runs_db);
  check_database_name(run.database, "--from-run names the database");  // before the server sees it
  nlohmann::json j = load_run_recipe(uri, run.database, run.id, timeout);
  std::vector<std::string> notes;
  nlohmann::json& data = j["data"];
  const std::string stored = data.value("uri", "");
  // A redacted password cannot connect: the URI we were given (which has one) replaces it.
  if (stored.empty() || stored.find(":****@") != std::string::npos) {
    if (!stored.empty() && hosts_of(stored) != hosts_of(uri) && !overridden(overrides, "data.uri"))
      notes.push_back(fmt::format("run {}/{} read its data from {}; this run reads it from {} (the URI given)",
                                  run.database, run.id, hosts_of(stored), hosts_of(uri)));
    data["uri"] = uri;
  }
  recipe::Recipe r = recipe::recipe_from_json(j, overrides, fmt::format("run {}/{}", run.database, run.id));
  // A record anyone with write access to the database could have changed does not start programs:
  // a command reward (grpo.rewards' run) comes from a recipe file or an override, never from it.
  const bool given = overridden(overrides, "grpo.rewards");
  for (const auto& reward : r.grpo.rewards)
    if (!given && reward.is_object() && reward.contains("run"))
      throw Error(fmt::format(
          "run {}/{}: its grpo.rewards start a program (a command reward's run:), which a run record may not: give "
          "the recipe file (lora-train RECIPE.yaml), or the rewards as an override",
          run.database, run.id));
  r.warnings.insert(r.warnings.begin(), notes.begin(), notes.end());
  return r;
}

}  // namespace lorarun::track
