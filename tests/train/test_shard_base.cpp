// dist.shard_base: each rank holds 1/world of every frozen base linear and gathers it per use.
// On 1, 2 and 3 Gloo ranks (world sizes the fixture's sizes do not divide) a sharded run ends with
// the adapter and the eval losses of the same run unsharded, for LoRA and QLoRA, with activation
// checkpointing and packing, and with the next block's gather not started ahead; ranks with
// nothing to compute (a rejected document, fewer eval batches) still join every gather.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "support/runs.hpp"

using namespace lorarun::test;

namespace {

// eval_loss of each evaluation in `dir`/metrics.jsonl.
std::vector<double> eval_losses(const std::string& dir) {
  std::vector<double> out;
  std::ifstream in(dir + "/metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json row = nlohmann::json::parse(line);
    if (row.contains("eval_loss")) out.push_back(row["eval_loss"].get<double>());
  }
  return out;
}

}  // namespace

TEST_CASE("dist.shard_base on 2 and 3 ranks ends with the unsharded run's adapter and eval losses", "[e2e]") {
  const std::string dir = temp_dir("shard-base");
  write_data(dir + "/data.jsonl", 36);
  {  // two documents every rank rejects: a micro-batch of one of them is empty on its rank
    std::ofstream out(dir + "/data.jsonl", std::ios::app);
    out << "{\"instruction\": 7}\n{\"output\": \"no instruction\"}\n";
  }
  const std::string recipe =
      write_recipe(dir, "run", "epochs: 2, lr: 1.0e-3", "", ", batch_size: 1, max_skipped_share: 0.1",
                   "eval: {fraction: 0.25, batch_size: 1, every_n_steps: 3}\n");
  const std::vector<std::string> variants = {"", "lora.quantize_base=true", "train.activation_checkpointing=true",
                                             "data.packing=true data.batch_size=3", "dist.shard_base_prefetch=false"};
  for (const int world : {1, 2, 3})
    for (size_t vi = 0; vi < variants.size(); ++vi) {
      if (world == 1 && vi > 0) continue;  // one rank: the same path, gathers of one slice
      const std::string& v = variants[vi];
      INFO(fmt::format("{} ranks, {}", world, v.empty() ? "LoRA" : v));
      std::vector<std::string> outs;
      for (const char* shard : {"false", "true"}) {
        const std::string out = fmt::format("{}/w{}-v{}-{}", dir, world, vi, shard);
        const Result r = sh(fmt::format("{} --nproc-per-node {} {} dist.shard_base={} checkpoint.output_dir={} {}",
                                        bin("lorarun"), world, recipe, shard, out, v));
        INFO(r.output);
        REQUIRE(r.status == 0);
        if (std::string(shard) == "true")
          CHECK_THAT(r.output, Catch::Contains("dist.shard_base: base weights on this rank"));
        outs.push_back(out);
      }
      for (const char* epoch : {"epoch_0", "epoch_1"}) {
        const double diff = adapter_diff(fmt::format("{}/{}/adapter_model.safetensors", outs[0], epoch),
                                         fmt::format("{}/{}/adapter_model.safetensors", outs[1], epoch));
        CHECK(diff <= 1e-6);
        if (std::string(epoch) == "epoch_1") WARN(fmt::format("{} ranks {}: adapter max |diff| {:g}", world, v, diff));
      }
      const std::vector<double> whole = eval_losses(outs[0]), sharded = eval_losses(outs[1]);
      REQUIRE(whole.size() >= 2);
      REQUIRE(whole.size() == sharded.size());
      for (size_t i = 0; i < whole.size(); ++i) CHECK(std::abs(whole[i] - sharded[i]) <= 1e-6 * std::abs(whole[i]));
    }
}

TEST_CASE("dist.shard_base: SIGTERM mid-epoch, and the same command resumes to the unsharded run's adapter",
          "[e2e][resume]") {
  const std::string dir = temp_dir("shard-base-resume");
  write_data(dir + "/data.jsonl", 80);
  const std::string train = "epochs: 2, lr: 1.0e-3, activation_checkpointing: true";
  const std::string whole = write_recipe(dir, "whole", train, "", ", batch_size: 1");
  const std::string cut = write_recipe(dir, "cut", train, "", ", batch_size: 1");
  const Result a = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), whole));
  INFO(a.output);
  REQUIRE(a.status == 0);

  const Result c = stop_and_resume(fmt::format("{} --nproc-per-node 2 {} dist.shard_base=true", bin("lorarun"), cut),
                                   dir + "/cut", "epoch 0/2 step 20/40");
  CHECK_THAT(c.output, Catch::Contains("resuming at epoch 0"));
  for (const char* epoch : {"epoch_0", "epoch_1"})
    CHECK(adapter_diff(fmt::format("{}/whole/{}/adapter_model.safetensors", dir, epoch),
                       fmt::format("{}/cut/{}/adapter_model.safetensors", dir, epoch)) == 0.0);
}
