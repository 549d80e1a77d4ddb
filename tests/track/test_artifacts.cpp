// lib/track/artifacts against the test FerretDB: an artifact re-uploaded replaces its files only
// once the new ones are complete, read back byte for byte; removal; a damaged file is refused.
#include <fmt/format.h>
#include <unistd.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>

#include "data/mongo.hpp"
#include "io/sha256.hpp"
#include "support/process.hpp"
#include "support/servers.hpp"
#include "track/artifacts.hpp"
#include "util/error.hpp"

using namespace lorarun;
using lorarun::test::test_uri;
namespace fs = std::filesystem;

namespace {

// `text` written to `path` (its directory created).
void put(const fs::path& path, const std::string& text) {
  fs::create_directories(path.parent_path());
  std::ofstream(path, std::ios::binary) << text;
}

}  // namespace

TEST_CASE("artifacts: a re-upload replaces the old files, a pull gives them back, remove clears them", "[db]") {
  const std::string db = fmt::format("artifacts_test_{}", getpid());
  const std::string run = "0123456789abcdef01234567";
  const fs::path dir = test::temp_dir("artifacts");
  track::ArtifactStore store(test_uri(), db, std::chrono::seconds(5));

  // Several chunks (1 MiB each) and a file in a subdirectory.
  const std::string big(3 * (1 << 20) + 17, 'x');
  put(dir / "best/adapter_model.safetensors", big);
  put(dir / "best/sub/adapter_config.json", "{\"r\": 4}");
  const auto first = store.upload(run, "best", (dir / "best").string());
  REQUIRE(first.size() == 2);
  CHECK(first[0].name == "adapter_model.safetensors");
  CHECK(first[0].bytes == static_cast<int64_t>(big.size()));
  CHECK(first[0].sha256 == io::sha256_hex(big));
  CHECK(first[1].name == "sub/adapter_config.json");

  // best/ rewritten: the new files, with new ids; the old ones stay readable (a run record may
  // still list them) until retired, then only the new files remain.
  put(dir / "best/adapter_model.safetensors", "new weights");
  fs::remove_all(dir / "best/sub");
  const auto second = store.upload(run, "best", (dir / "best").string());
  REQUIRE(second.size() == 1);
  CHECK(second[0].sha256 == io::sha256_hex("new weights"));
  CHECK(second[0].file_id != first[0].file_id);
  data::Client c(test_uri(), std::chrono::seconds(5));
  CHECK(c.count(db, "lorarun.chunks", {{"files_id", {{"$oid", first[0].file_id}}}}) == 4);
  store.download(run, "best", first, (dir / "before_retire").string());
  CHECK(test::read_file((dir / "before_retire/adapter_model.safetensors").string()) == big);
  store.retire(run, "best", second);
  CHECK(store.list(run).size() == 1);
  CHECK(c.count(db, "lorarun.chunks", {{"files_id", {{"$oid", first[0].file_id}}}}) == 0);

  // Pulled back byte for byte; another artifact is independent of it.
  put(dir / "epoch_0/adapter_model.safetensors", big);
  store.upload(run, "epoch_0", (dir / "epoch_0").string());
  store.download(run, "epoch_0", store.list(run, "epoch_0"), (dir / "pulled").string());
  CHECK(test::read_file((dir / "pulled/adapter_model.safetensors").string()) == big);
  CHECK(store.list(run, "best").size() == 1);

  // A chunk changed on the server: the pull refuses it and keeps nothing.
  const auto stored = store.list(run, "epoch_0");
  c.update_one(db, "lorarun.chunks", {{"files_id", {{"$oid", stored[0].file_id}}}, {"n", 1}},
               {{"$set", {{"data", {{"$binary", {{"base64", "AAAA"}, {"subType", "00"}}}}}}}});
  try {
    store.download(run, "epoch_0", stored, (dir / "damaged").string());
    FAIL("a damaged file was accepted");
  } catch (const Error& e) {
    CHECK_THAT(e.what(), Catch::Contains("is damaged"));
  }
  // Nothing of it is kept: no directory, no temporary sibling (a pull, a restore and --adapter
  // mongodb-run: write through download()).
  CHECK(!fs::exists(dir / "damaged"));
  for (const auto& e : fs::directory_iterator(dir))
    CHECK(e.path().filename().string().find(".part.") == std::string::npos);
  // Into a directory that holds files already: refused before anything is read.
  CHECK_THROWS_WITH(store.download(run, "epoch_0", stored, (dir / "best").string()),
                    Catch::Contains("exists and is not empty"));
  // What the record lists is what a reader gets: a newer GridFS file of the same name that the record
  // does not list (a writer that is not lora-train's) is not taken.
  put(dir / "other/adapter_model.safetensors", "not the recorded weights");
  const auto listed = store.list(run, "best");
  store.upload("ffffffffffffffffffffffff", "best", (dir / "other").string());
  c.update_one(db, "lorarun.files", {{"metadata.run_id", "ffffffffffffffffffffffff"}},
               {{"$set", {{"metadata.run_id", run}}}});
  CHECK(store.list(run, "best").front().sha256 == io::sha256_hex("not the recorded weights"));  // GridFS's newest
  store.download(run, "best", listed, (dir / "recorded").string());
  CHECK(test::read_file((dir / "recorded/adapter_model.safetensors").string()) == "new weights");
  c.update_one(db, "lorarun.files", {{"metadata.run_id", run}, {"_id", {{"$oid", store.list(run, "best")[0].file_id}}}},
               {{"$set", {{"metadata.run_id", "ffffffffffffffffffffffff"}}}});
  CHECK(store.remove("ffffffffffffffffffffffff") == 1);

  // remove: one artifact, then the rest; no chunk left.
  CHECK(store.remove(run, "epoch_0") == 1);
  CHECK(store.list(run, "epoch_0").empty());
  CHECK(store.remove(run) == 1);
  CHECK(c.count(db, "lorarun.files", nlohmann::json::object()) == 0);
  CHECK(c.count(db, "lorarun.chunks", nlohmann::json::object()) == 0);
}
