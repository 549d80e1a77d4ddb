#include "track/pulled.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <system_error>

#include "track/artifacts.hpp"
#include "util/error.hpp"
#include "util/secrets.hpp"
#include "util/untrusted.hpp"

namespace lorarun::track {
namespace {

namespace fs = std::filesystem;

constexpr auto kTimeout = std::chrono::seconds(20);

}  // namespace

AdapterSource::AdapterSource(const std::string& spec) {
  const std::string prefix = kRunAdapterPrefix;
  if (spec.rfind(prefix, 0) != 0) {
    dir_ = spec;
    return;
  }
  const std::string ref = spec.substr(prefix.size());
  const size_t slash = ref.find('/');
  if (slash == std::string::npos || slash == 0)
    throw Error(
        fmt::format("--adapter {}: expected mongodb-run:DATABASE/ID[/epoch_N|/best] (a job's adapter: "
                    "DATABASE/ID/NAME[/epoch_N|/best])",
                    scrub(spec)));
  const std::string db = ref.substr(0, slash);
  auto [id, artifact] = split_run_ref(ref.substr(slash + 1));
  check_database_name(db, "--adapter mongodb-run: names the database");
  check_run_id(id, "--adapter mongodb-run: names the run");
  if (!artifact.empty() && !is_adapter_name(artifact))
    check_artifact_name(artifact, "--adapter mongodb-run: names the artifact");
  const std::string uri = mongodb_uri("");
  if (uri.empty()) throw Error(fmt::format("--adapter {} needs LORARUN_MONGODB_URI: set it to the run's server", spec));
  ArtifactStore store(uri, db, kTimeout);
  const nlohmann::json run = store.run_record(id);
  artifact = artifact_named(run, artifact, "--adapter " + scrub(spec));
  temp_ = (fs::temp_directory_path() / fmt::format("lorarun-adapter-{}-{}", ::getpid(), id)).string();
  fs::remove_all(temp_);
  store.download(id, artifact, recorded_files(run, artifact), temp_);  // leaves nothing when it fails
  dir_ = temp_;
}

AdapterSource::~AdapterSource() {
  if (temp_.empty()) return;
  std::error_code ec;
  fs::remove_all(temp_, ec);
}

}  // namespace lorarun::track
