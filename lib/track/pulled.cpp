#include "track/pulled.hpp"

#include <fmt/format.h>
#include <unistd.h>
#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <system_error>

#include "track/artifacts.hpp"
#include "util/error.hpp"
#include "util/secrets.hpp"

namespace lorarun::track {
namespace {

namespace fs = std::filesystem;

constexpr auto kTimeout = std::chrono::seconds(20);

// The last epoch_<i> the run stored; lorarun::Error naming the run when none.
std::string last_epoch(ArtifactStore& store, const std::string& id, const std::string& spec) {
  int last = -1;
  for (const ArtifactFile& f : store.list(id))
    if (f.artifact.rfind("epoch_", 0) == 0) last = std::max(last, std::atoi(f.artifact.c_str() + 6));
  if (last < 0)
    throw Error(
        fmt::format("--adapter {}: the run stored no epoch adapter in GridFS; name one (…/best, …/epoch_N) or "
                    "use a directory",
                    spec));
  return fmt::format("epoch_{}", last);
}

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
    throw Error(fmt::format("--adapter {}: expected mongodb-run:DATABASE/ID[/epoch_N|/best]", scrub(spec)));
  const std::string db = ref.substr(0, slash);
  auto [id, artifact] = split_run_ref(ref.substr(slash + 1));
  const char* uri = std::getenv("LORARUN_MONGODB_URI");
  if (!uri || !*uri)
    throw Error(fmt::format("--adapter {} needs LORARUN_MONGODB_URI: set it to the run's server", spec));
  register_uri_secret(uri);
  ArtifactStore store(uri, db, kTimeout);
  if (artifact.empty()) artifact = last_epoch(store, id, spec);
  temp_ = (fs::temp_directory_path() / fmt::format("lorarun-adapter-{}-{}", ::getpid(), id)).string();
  fs::remove_all(temp_);
  try {
    store.download(id, artifact, temp_);
  } catch (...) {
    std::error_code ec;
    fs::remove_all(temp_, ec);
    throw;
  }
  dir_ = temp_;
}

AdapterSource::~AdapterSource() {
  if (temp_.empty()) return;
  std::error_code ec;
  fs::remove_all(temp_, ec);
}

}  // namespace lorarun::track
