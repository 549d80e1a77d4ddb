// What a recipe runs on, built from it in one place for lora-train, lora-eval --recipe and the
// dry run's memory estimate: the rank's device, the base model (NF4, dist.shard_base's slices)
// with its adapters, its tokenizer checked against it, the example builder, the training
// documents and the eval split.
#pragma once
#include <c10/core/Device.h>
#include <memory>
#include <string>
#include <vector>

#include "data/example.hpp"
#include "data/mixture.hpp"
#include "data/source.hpp"
#include "dist/env.hpp"
#include "model/transformer.hpp"
#include "recipe/recipe.hpp"
#include "tokenizer/tokenizer.hpp"
#include "train/training_data.hpp"

namespace lorarun::dist {
class ProcessGroup;
}

namespace lorarun::train {

// Whether the recipe runs on CUDA here (model.device auto or cuda, and a GPU visible).
bool uses_cuda(const recipe::Recipe& r);

// How many of a job's `adapters` go through the base in one pass: adapters.per_pass, or when unset
// all of them on a GPU (one pass keeps it busy) and one on the CPU, where a pass of several is no
// faster than one after another and holds all their activations at once.
int adapters_per_pass(const recipe::Recipe& r, int adapters);

// cuda:LOCAL_RANK, or the CPU. More ranks than GPUs share them round-robin, which Gloo allows (NCCL
// refuses two ranks on one GPU, so that is an error there).
at::Device rank_device(const recipe::Recipe& r, const dist::DistEnv& env);

// dist.shard_base: the slices of rank `rank` of `world`, gathered over `pg` (none: shapes only,
// for an estimate).
std::shared_ptr<model::BaseShards> base_shards(const recipe::Recipe& r, int rank, int world, dist::ProcessGroup* pg);
// ... with the next block gathered while one computes when `prefetch` (dist.shard_base_prefetch).
std::shared_ptr<model::BaseShards> base_shards(bool prefetch, int rank, int world, dist::ProcessGroup* pg);

// How the recipe holds the base weights (lora.quantize_base, lora.double_quant, `shards`).
model::LoadOptions load_options(const recipe::Recipe& r, std::shared_ptr<model::BaseShards> shards,
                                bool shapes_only = false);

// Optimizer steps each step's worth of data is trained for: grpo.num_iterations (μ) with grpo, else 1.
int64_t steps_per_batch(const recipe::Recipe& r);
// Optimizer steps per epoch of a rank reading `per_rank` documents (Runtime::per_rank): every
// rank the same (shards are equalised), at most train.max_steps_per_epoch.
int64_t steps_per_epoch(const recipe::Recipe& r, int64_t per_rank);
// The steps' worth of data an epoch's first `step_in_epoch` optimizer steps have read.
int64_t batches_read(const recipe::Recipe& r, int64_t step_in_epoch);
// The documents those steps read on all `world` ranks together (data.max_skipped_share's whole).
int64_t epoch_documents(const recipe::Recipe& r, int64_t per_rank, int world);

// The seed of rank `rank`'s dropout stream in a run of train.seed `seed`.
uint64_t dropout_seed(int64_t seed, int rank);

// What `r` trains on into `d` (filled as it is read: what a throw leaves was read): data's selection
// (the training side of eval.fraction) or data.sources' mixture, and with `evaluating` its eval
// split or each source's held-out documents, each checked to hold a token to score (`builder`:
// data's keys, for an eval: split read by them). Throws data::EmptySplit when eval.fraction holds
// out none or all of the documents.
void read_training_data(const recipe::Recipe& r, const tok::Tokenizer& tokenizer, const data::ExampleBuilder* builder,
                        bool evaluating, TrainingData& d);

struct RuntimeOptions {
  dist::ProcessGroup* pg = nullptr;  // the ranks' group: dist.shard_base gathers over it (training)
  // a job of many adapters (adapters:): the base, tokenizer and example builder only; the job adds
  // its adapters and reads each one's documents itself
  bool tenants = false;
  bool train = true;         // fresh adapters (or lora.init_from's), seeded dropout, activation checkpointing
  std::string adapter = {};  // without train: a PEFT adapter to load ("" none)
  bool eval_split = true;    // the eval: section's documents too, when the recipe has one
};

class Runtime {
 public:
  // Throws lorarun::Error (ConfigError for what a rerun cannot change) naming the key at fault.
  Runtime(const recipe::Recipe& r, const dist::DistEnv& env, const RuntimeOptions& o);

  at::Device device;
  std::shared_ptr<model::BaseShards> shards;  // with dist.shard_base
  model::CausalLM model;
  tok::Tokenizer tokenizer;
  // data's keys (null with data.sources unless eval: reads by them)
  std::unique_ptr<data::ExampleBuilder> builder;
  TrainingData data;  // what it trains and evaluates on (none for a job's: each adapter reads its own)

  // What is about to train, for the log: the adapters and `d`, NF4, dist.shard_base, the evaluation.
  std::vector<std::string> summary(const recipe::Recipe& r, const TrainingData& d, int world, int64_t steps_per_epoch,
                                   size_t buckets) const;

 private:
  model::CausalLM load_model(const recipe::Recipe& r, const dist::DistEnv& env, const RuntimeOptions& o);
};

}  // namespace lorarun::train
