// lora-train --from-run against the FerretDB that scripts/test starts (part of integration_tests).
#include <fmt/format.h>
#include <unistd.h>
#include <catch2/catch.hpp>

#include "recipe/recipe.hpp"
#include "support/process.hpp"
#include "support/servers.hpp"
#include "track/record.hpp"

using namespace lorarun;

TEST_CASE("lora-train --from-run DB/ID --dry-run prints the stored recipe with the overrides", "[e2e][db]") {
  // The quickstart recipe, recorded with a password in its URI as a real run would be.
  std::string uri = test::test_uri();
  uri.insert(uri.find("://") + 3, "alice:s3cr3t-pw@");
  uri += "?authMechanism=PLAIN";
  const recipe::Recipe r =
      recipe::load_recipe(std::string(LORARUN_SOURCE_DIR) + "/configs/quickstart.yaml", {"data.uri=" + uri});
  const std::string db = fmt::format("from_run_test_{}", getpid());
  track::RunRecorder rec(uri, db, std::chrono::milliseconds(5000));
  rec.begin(recipe::to_json(r), {{"world_size", 2}});
  rec.finish("completed", {{"loss", 1.0}});

  recipe::Recipe want = r;
  want.train.lr = 1e-3;
  const test::Result ok = test::sh(fmt::format("LORARUN_MONGODB_URI='{}' {} --from-run {} --dry-run train.lr=1e-3", uri,
                                               test::bin("lora-train"), rec.ref()));
  INFO(ok.output);
  CHECK(ok.status == 0);
  CHECK_THAT(ok.output, Catch::Contains(recipe::to_yaml(want)));
  CHECK_THAT(ok.output, Catch::Contains("  lr: 0.001\n"));
  CHECK_THAT(ok.output, !Catch::Contains("s3cr3t-pw"));

  // A bare id with --runs-db and --uri instead of the environment.
  const test::Result bare =
      test::sh(fmt::format("env -u LORARUN_MONGODB_URI {} --from-run {} --runs-db {} --uri '{}' --dry-run",
                           test::bin("lora-train"), rec.id(), db, uri));
  INFO(bare.output);
  CHECK(bare.status == 0);
  CHECK_THAT(bare.output, Catch::Contains(recipe::to_yaml(r)));

  const test::Result unknown = test::sh(
      fmt::format("{} --from-run {}/66aa00000000000000000000 --uri '{}' --dry-run", test::bin("lora-train"), db, uri));
  CHECK(unknown.status == 78);
  CHECK_THAT(unknown.output,
             Catch::StartsWith(fmt::format("lora-train: error: no run 66aa00000000000000000000 in {}.runs", db)));
}
