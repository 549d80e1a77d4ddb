// Training against the reference, and resumption: lora-train step by step against transformers
// + PEFT + torch AdamW; SIGTERM and kill -9 mid-epoch, then the same command again, must end
// with the very adapter an uninterrupted run ends with.
#include <fmt/format.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <tuple>
#include <vector>

#include "io/safetensors.hpp"
#include "support/oracle.hpp"
#include "support/runs.hpp"

// Not `using namespace lorarun::test`: this file's write_recipe would be ambiguous with the shared one.
using lorarun::test::adapter_diff;
using lorarun::test::bin;
using lorarun::test::interrupt;
using lorarun::test::Oracle;
using lorarun::test::oracle;
using lorarun::test::read_file;
using lorarun::test::Result;
using lorarun::test::sh;
using lorarun::test::temp_dir;
using lorarun::test::write_data;
namespace fs = std::filesystem;

namespace {

// The shared recipe (support/runs.hpp) with data.shuffle: none and `data_extra` appended to the
// data: section; `extra` is appended YAML (more sections or keys).
std::string write_recipe(const std::string& dir, const std::string& name, const std::string& train,
                         const std::string& data_extra, const std::string& extra = "") {
  return lorarun::test::write_recipe(dir, name, train, "", ", shuffle: none" + data_extra, extra);
}

std::vector<std::string> entries(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

}  // namespace

TEST_CASE("lora-train follows transformers + PEFT + AdamW step by step, on 1 and 2 ranks", "[e2e][reference]") {
  const std::string dir = temp_dir("equiv");
  write_data(dir + "/data.jsonl", 30);
  const Result init = sh(fmt::format("'{}' '{}/reference/train_reference.py' init {}/llama {}/init 4 8 7",
                                     LORARUN_PYTHON, LORARUN_SOURCE_DIR "/tests", LORARUN_MODEL_FIXTURES, dir));
  REQUIRE(init.status == 0);
  // (world, micro-batch, accumulation): the same 8 documents per step cut three ways.
  for (const auto& [world, batch, accum] : {std::tuple{1, 4, 2}, std::tuple{2, 2, 2}, std::tuple{2, 4, 1}}) {
    const std::string name = fmt::format("w{}b{}a{}", world, batch, accum);
    const std::string good = write_recipe(dir, name, "epochs: 5, lr: 5.0e-3, warmup_steps: 3, lr_scheduler: cosine",
                                          fmt::format(", batch_size: {}", batch));
    // lora.init_from: the reference's initial adapter (A and B random), as an override.
    // dist.bucket_mb: 28 gradients in ~12 buckets of 2 KiB, all-reduced while backward goes on.
    const Result t =
        sh(fmt::format("{} --nproc-per-node {} {} lora.init_from={}/init train.gradient_accumulation_steps={} "
                       "dist.bucket_mb=0.002",
                       bin("lorarun"), world, good, dir, accum));
    INFO(t.output);
    REQUIRE(t.status == 0);
    const Oracle ref = oracle(fmt::format(
        "'{}' '{}/tests/reference/train_reference.py' check {}/llama {}/init "
        "{}/data.jsonl {}/{} {} {} {} 5 5e-3 3",
        LORARUN_PYTHON, LORARUN_SOURCE_DIR, LORARUN_MODEL_FIXTURES, dir, dir, dir, name, world, batch, accum));
    INFO(ref.run.output);
    CHECK(ref.run.status == 0);
    CHECK(ref.fields.value("match", false));
  }
}

TEST_CASE("every recent family trains 20 steps as transformers + PEFT + AdamW do", "[e2e][reference]") {
  const std::string dir = temp_dir("families");
  write_data(dir + "/data.jsonl", 80);  // 20 steps of 4
  const std::string recipe = write_recipe(dir, "run", "epochs: 1, lr: 5.0e-3, warmup_steps: 3", ", batch_size: 4");
  for (const std::string family : {"qwen3", "gemma2", "gemma3", "phi3"}) {
    INFO(family);
    const std::string base = fmt::format("{}/{}", LORARUN_MODEL_FIXTURES, family);
    const Result init = sh(fmt::format("'{}' '{}/tests/reference/train_reference.py' init {} {}/{}-init 4 8 7",
                                       LORARUN_PYTHON, LORARUN_SOURCE_DIR, base, dir, family));
    REQUIRE(init.status == 0);
    const Result t =
        sh(fmt::format("{} --nproc-per-node 1 {} model.path={} lora.init_from={}/{}-init "
                       "checkpoint.output_dir={}/{}",
                       bin("lorarun"), recipe, base, dir, family, dir, family));
    INFO(t.output);
    REQUIRE(t.status == 0);
    const Oracle ref = oracle(fmt::format(
        "'{}' '{}/tests/reference/train_reference.py' check {} {}/{}-init {}/data.jsonl {}/{} 1 4 1 1 5e-3 3 1e-5 1e-4",
        LORARUN_PYTHON, LORARUN_SOURCE_DIR, base, dir, family, dir, dir, family));
    INFO(ref.run.output);
    CHECK(ref.run.status == 0);
    CHECK(ref.fields.value("match", false));
    CHECK(ref.fields.value("steps", 0) == 20);
    fmt::print("train: {} 20 steps vs transformers + PEFT + AdamW: worst loss rel diff {:.2g}, adapter {:.2g}\n",
               family, ref.fields.value("worst_relative_loss_diff", -1.0),
               ref.fields.value("worst_relative_weight_diff", -1.0));
  }
}

TEST_CASE("SIGTERM mid-epoch saves the state and the same command resumes to the uninterrupted result",
          "[e2e][resume]") {
  const std::string dir = temp_dir("sigterm");
  write_data(dir + "/data.jsonl", 240);
  const std::string train = "epochs: 3, lr: 1.0e-3, warmup_steps: 5";
  const std::string full = write_recipe(dir, "full", train, ", batch_size: 1");
  const std::string cut = write_recipe(dir, "cut", train, ", batch_size: 1");
  const Result a = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), full));
  INFO(a.output);
  REQUIRE(a.status == 0);

  const std::string cmd = fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), cut);
  const Result b = interrupt(cmd, dir + "/cut.log", "epoch 0/3 step 30/120", "kill -TERM $pid");
  const std::string log = read_file(dir + "/cut.log");
  INFO(log);
  // lorarun itself was asked to stop, and every rank saved its state: 75, so a scheduler may requeue
  CHECK_THAT(b.output, Catch::Contains("exit=75"));
  CHECK_THAT(log, Catch::Contains("every rank saved its resumable state"));
  CHECK_THAT(log, Catch::Contains("the resumable state is in"));
  CHECK_THAT(read_file(dir + "/cut/logs/rank_1.log"), Catch::Contains("rank 1/2"));
  REQUIRE(fs::exists(dir + "/cut/resume_state/state.json"));
  CHECK(fs::exists(dir + "/cut/resume_state/adapter_model.safetensors"));  // a loadable adapter too

  const Result c = sh(cmd);
  INFO(c.output);
  REQUIRE(c.status == 0);
  CHECK_THAT(c.output, Catch::Contains("resuming at epoch"));
  CHECK_THAT(c.output, Catch::Contains("done: 360 steps"));
  // .lock: the run's hold on the directory; run.json: the marker of a finished run.
  CHECK(entries(dir + "/cut") == std::vector<std::string>{".lock", "epoch_0", "epoch_1", "epoch_2", "logs",
                                                          "metrics.jsonl", "recipe.yaml", "run.json"});
  CHECK(entries(dir + "/cut/logs") == std::vector<std::string>{"rank_0.log", "rank_1.log"});
  CHECK(adapter_diff(dir + "/full/epoch_2/adapter_model.safetensors", dir + "/cut/epoch_2/adapter_model.safetensors") ==
        0.0);
  // Every optimizer step appears once in metrics.jsonl across the two processes' lifetimes.
  int lines = 0;
  std::ifstream metrics(dir + "/cut/metrics.jsonl");
  std::set<int> steps;
  for (std::string line; std::getline(metrics, line); ++lines)
    steps.insert(nlohmann::json::parse(line)["step"].get<int>());
  CHECK(steps.size() == 360);
  CHECK(lines >= 360);
}

TEST_CASE("kill -9 of a rank: the run fails and rerunning resumes from the last periodic state", "[e2e][resume]") {
  const std::string dir = temp_dir("kill9");
  write_data(dir + "/data.jsonl", 160);
  const std::string train = "epochs: 2, lr: 1.0e-3";
  const std::string full = write_recipe(dir, "full", train, ", batch_size: 1", "");
  const std::string cut = write_recipe(dir, "cut", train, ", batch_size: 1", "");
  const Result a = sh(fmt::format("{} --nproc-per-node 2 {}", bin("lorarun"), full));
  REQUIRE(a.status == 0);
  const std::string cmd =
      fmt::format("{} --nproc-per-node 2 {} checkpoint.state_every_n_steps=25", bin("lorarun"), cut);
  const Result b = interrupt(cmd, dir + "/cut.log", "epoch 0/2 step 60/80",
                             "kill -9 $(sed -n 's/.*(pids [0-9]* \\([0-9]*\\)).*/\\1/p' \"$log\")");
  const std::string log = read_file(dir + "/cut.log");
  INFO(log);
  CHECK_THAT(b.output, Catch::Contains("exit=1"));
  REQUIRE(fs::exists(dir + "/cut/resume_state/state.json"));
  const Result c = sh(cmd);
  INFO(c.output);
  REQUIRE(c.status == 0);
  CHECK_THAT(c.output, Catch::Contains("resuming at epoch"));
  CHECK(adapter_diff(dir + "/full/epoch_1/adapter_model.safetensors", dir + "/cut/epoch_1/adapter_model.safetensors") ==
        0.0);
  CHECK_FALSE(fs::exists(dir + "/cut/resume_state"));
}

TEST_CASE("a resumable state is not used by a different recipe", "[e2e][resume]") {
  const std::string dir = temp_dir("resume-changed");
  write_data(dir + "/data.jsonl", 24);
  const std::string recipe = write_recipe(dir, "run", "epochs: 2, lr: 1.0e-3", ", batch_size: 2");
  const Result a =
      sh(fmt::format("{} --nproc-per-node 2 {} checkpoint.keep_resume_state=true", bin("lorarun"), recipe));
  INFO(a.output);
  REQUIRE(a.status == 0);
  REQUIRE(fs::exists(dir + "/run/resume_state/state.json"));
  const Result b = sh(fmt::format("{} --nproc-per-node 2 {} train.lr=2e-3", bin("lorarun"), recipe));
  INFO(b.output);
  CHECK(b.status == 78);  // a restart cannot change it: not restarted
  CHECK_THAT(b.output, Catch::Contains("was written with train.lr = 0.001, this run has 0.002"));
  const Result c = sh(fmt::format("{} --nproc-per-node 1 {}", bin("lorarun"), recipe));
  INFO(c.output);
  CHECK(c.status == 78);
  CHECK_THAT(c.output, Catch::Contains("was written by 2 ranks and this run has 1"));
  // checkpoint.resume=never starts over; the finished run's adapters go only with checkpoint.overwrite.
  const Result refused =
      sh(fmt::format("{} --nproc-per-node 2 {} train.lr=2e-3 checkpoint.resume=never", bin("lorarun"), recipe));
  INFO(refused.output);
  CHECK(refused.status == 78);
  CHECK_THAT(refused.output, Catch::Contains("holds the adapters of another run"));
  const Result d =
      sh(fmt::format("{} --nproc-per-node 2 {} train.lr=2e-3 checkpoint.resume=never checkpoint.overwrite=true",
                     bin("lorarun"), recipe));
  INFO(d.output);
  CHECK(d.status == 0);
  CHECK_THAT(d.output, !Catch::Contains("resuming"));
}

TEST_CASE("2 ranks: save_last_epoch_only keeps exactly the last epoch, replicas checked every step", "[e2e]") {
  const std::string dir = temp_dir("last-only");
  write_data(dir + "/data.jsonl", 21);
  const std::string recipe = write_recipe(dir, "run", "epochs: 3, lr: 1.0e-3", ", batch_size: 2");
  fs::create_directories(dir + "/run/epoch_7");  // a leftover of an earlier run: must go
  const Result r =
      sh(fmt::format("{} --nproc-per-node 2 {} checkpoint.save_last_epoch_only=true "
                     "'checkpoint.epochs_to_save=[0]' dist.debug_checksum_every_n_steps=1",
                     bin("lorarun"), recipe));
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("save_last_epoch_only"));  // the warning that it wins
  CHECK(entries(dir + "/run") ==
        std::vector<std::string>{".lock", "epoch_2", "logs", "metrics.jsonl", "recipe.yaml", "run.json"});
  CHECK(fs::exists(dir + "/run/epoch_2/adapter_model.safetensors"));
  CHECK(fs::exists(dir + "/run/epoch_2/adapter_config.json"));
}

TEST_CASE("bf16 base weights train with fp32 adapters (the recipe default dtype)", "[e2e]") {
  const std::string dir = temp_dir("bf16");
  write_data(dir + "/data.jsonl", 16);
  const std::string recipe = write_recipe(dir, "run", "epochs: 1, lr: 1.0e-3", ", batch_size: 4");
  const Result fp32 = sh(fmt::format("{} {} checkpoint.output_dir={}/fp32", bin("lora-train"), recipe, dir));
  INFO(fp32.output);
  REQUIRE(fp32.status == 0);
  const Result bf16 =
      sh(fmt::format("{} {} model.dtype=bf16 checkpoint.output_dir={}/bf16", bin("lora-train"), recipe, dir));
  INFO(bf16.output);
  REQUIRE(bf16.status == 0);
  // The same steps, losses within bf16's precision of the fp32 run's; adapters saved in fp32.
  std::ifstream a(dir + "/fp32/metrics.jsonl"), b(dir + "/bf16/metrics.jsonl");
  int steps = 0;
  for (std::string la, lb; std::getline(a, la) && std::getline(b, lb); ++steps) {
    const double x = nlohmann::json::parse(la)["loss"], y = nlohmann::json::parse(lb)["loss"];
    CHECK(std::abs(x - y) / x < 2e-2);
  }
  CHECK(steps == 4);
  const lorarun::io::SafetensorsFile f(dir + "/bf16/epoch_0/adapter_model.safetensors");
  CHECK(f.tensors().front().dtype == lorarun::io::DType::F32);
}

TEST_CASE("packing and activation checkpointing train the same and packing and length grouping pad less",
          "[e2e][memory]") {
  const std::string dir = temp_dir("packing");
  {
    std::ofstream data(dir + "/data.jsonl");
    for (int i = 0; i < 48; ++i) {
      std::string out;
      for (int w = 0; w < 1 + (i * 7) % 23; ++w) out += fmt::format(" {}", i * w % 97);
      data << nlohmann::json{{"instruction", fmt::format("Count {}", i)}, {"output", out}}.dump() << "\n";
    }
  }
  const std::string recipe = write_recipe(dir, "run", "epochs: 1, lr: 1.0e-3, gradient_accumulation_steps: 2",
                                          ", batch_size: 4, max_length: 256");
  auto train = [&](const std::string& name, const std::string& overrides) {
    const Result r =
        sh(fmt::format("{} {} checkpoint.output_dir={}/{} {}", bin("lora-train"), recipe, dir, name, overrides));
    INFO(r.output);
    REQUIRE(r.status == 0);
    std::vector<nlohmann::json> rows;
    std::ifstream in(dir + "/" + name + "/metrics.jsonl");
    for (std::string line; std::getline(in, line);) rows.push_back(nlohmann::json::parse(line));
    return rows;
  };
  auto mean_padding = [](const std::vector<nlohmann::json>& rows) {
    double sum = 0;
    for (const auto& r : rows) sum += r["padding_share"].get<double>();
    return sum / double(rows.size());
  };
  const auto plain = train("plain", "");
  const auto packed = train("packed", "data.packing=true");
  const auto recomputed = train("recomputed", "train.activation_checkpointing=true");
  const auto grouped = train("grouped", "data.group_by_length=true data.group_window=3");
  REQUIRE(plain.size() == 6);
  REQUIRE(packed.size() == 6);
  REQUIRE(recomputed.size() == 6);
  REQUIRE(grouped.size() == 6);
  // Packing and recomputation change how a step is computed, not what: the same losses.
  for (size_t i = 0; i < plain.size(); ++i) {
    const double want = plain[i]["loss"];
    CHECK(std::abs(packed[i]["loss"].get<double>() - want) <= 1e-5 * want);
    CHECK(std::abs(recomputed[i]["loss"].get<double>() - want) <= 1e-6 * want);
    CHECK(packed[i]["tokens"] == plain[i]["tokens"]);
  }
  CHECK(adapter_diff(dir + "/plain/epoch_0/adapter_model.safetensors",
                     dir + "/packed/epoch_0/adapter_model.safetensors") < 1e-6);
  // Packing: the 4 documents of a micro-batch (at most ~60 tokens each) share one 256-token row.
  WARN(fmt::format("padding share: one document per row {:.3f}, packed {:.3f}, grouped by length {:.3f}",
                   mean_padding(plain), mean_padding(packed), mean_padding(grouped)));
  CHECK(mean_padding(packed) < 0.5 * mean_padding(plain));
  CHECK(mean_padding(grouped) < mean_padding(plain));
}
