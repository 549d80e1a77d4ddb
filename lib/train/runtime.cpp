#include "train/runtime.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <malloc.h>
#include <torch/cuda.h>
#include <algorithm>

#include "dist/process_group.hpp"
#include "model/lora.hpp"
#include "model/resolve.hpp"
#include "train/evaluate.hpp"
#include "train/grpo_objective.hpp"
#include "train/stop.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/process.hpp"
#include "util/untrusted.hpp"

namespace lorarun::train {
namespace {

// lora.init_from: the adapter's weights, under the recipe's LoRA keys. Keys that change what the
// weights compute (r, alpha, use_rslora, use_dora, the trained tables, the adapted layers) must agree, or the saved
// adapter_config.json would describe other weights; dropout is the recipe's to choose.
void start_from_adapter(model::CausalLM& m, const model::LoraConfig& cfg, const std::string& from_dir, bool lead) {
  const model::LoraConfig from = model::load_adapter(m, from_dir);
  auto differ = [&](const std::string& key, const std::string& adapter, const std::string& recipe) {
    throw ConfigError(fmt::format("lora.init_from {} was trained with {} but the recipe says {}={}: make them equal",
                                  from_dir, adapter, key, recipe));
  };
  if (from.r != cfg.r) differ("lora.r", fmt::format("r={}", from.r), std::to_string(cfg.r));
  if (from.alpha != cfg.alpha)
    differ("lora.alpha", fmt::format("lora_alpha={}", from.alpha), fmt::format("{}", cfg.alpha));
  if (from.use_rslora != cfg.use_rslora)
    differ("lora.use_rslora", fmt::format("use_rslora={}", from.use_rslora), cfg.use_rslora ? "true" : "false");
  if (from.use_dora != cfg.use_dora)
    differ("lora.use_dora", fmt::format("use_dora={}", from.use_dora), cfg.use_dora ? "true" : "false");
  const auto sorted = [](std::vector<std::string> v) {
    std::sort(v.begin(), v.end());
    return v;
  };
  if (sorted(from.modules_to_save) != sorted(cfg.modules_to_save))
    differ("lora.modules_to_save",
           fmt::format("modules_to_save [{}]", printable(fmt::format("{}", fmt::join(from.modules_to_save, ", ")))),
           fmt::format("[{}]", fmt::join(cfg.modules_to_save, ", ")));
  if (from.trainable_token_indices != cfg.trainable_token_indices)
    differ("lora.trainable_token_indices",
           fmt::format("trainable_token_indices [{}]",
                       printable(fmt::format("{}", fmt::join(from.trainable_token_indices, ", ")))),
           fmt::format("[{}]", fmt::join(cfg.trainable_token_indices, ", ")));
  std::vector<std::string> adapted;
  std::vector<std::string> wanted;
  const model::LoraConfig read = model::for_model(m, cfg);  // (a mixture of experts': PEFT's reading)
  for (model::Linear* l : m.linears()) {
    if (l->adapted()) adapted.push_back(l->name);
    if (model::adapts(*l, read)) wanted.push_back(l->name);
    l->dropout = l->router ? 0.0 : cfg.dropout;
  }
  if (adapted != wanted)
    differ("lora.target_modules",
           fmt::format("{} adapted layers (target_modules {})", adapted.size(), fmt::join(from.target_modules, ", ")),
           fmt::format("[{}] ({} layers)", fmt::join(cfg.target_modules, ", "), wanted.size()));
  if (from.dropout != cfg.dropout && lead)
    info(fmt::format("lora.init_from {} was trained with lora_dropout={}; this run uses lora.dropout={}", from_dir,
                     from.dropout, cfg.dropout));
}

}  // namespace

bool uses_cuda(const recipe::Recipe& r) { return r.model.device != recipe::Device::Cpu && torch::cuda::is_available(); }

int adapters_per_pass(const recipe::Recipe& r, int adapters) {
  return std::max(1, std::min(adapters, r.adapters.per_pass.value_or(uses_cuda(r) ? adapters : 1)));
}

at::Device rank_device(const recipe::Recipe& r, const dist::DistEnv& env) {
  const bool cuda = uses_cuda(r);
  if (r.model.device == recipe::Device::Cuda && !cuda)
    throw Error("model.device is cuda but no GPU is visible: set model.device=cpu or run on a GPU machine");
  if (!cuda) return at::Device(at::kCPU);
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (env.local_rank >= gpus && r.dist.backend != recipe::DistBackend::Gloo)
    throw Error(
        fmt::format("local rank {} has no GPU of its own ({} visible): start at most {} ranks per node, or set "
                    "dist.backend=gloo to share GPUs",
                    env.local_rank, gpus, gpus));
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank % gpus));
}

std::shared_ptr<model::BaseShards> base_shards(const recipe::Recipe& r, int rank, int world, dist::ProcessGroup* pg) {
  return base_shards(r.dist.shard_base_prefetch, rank, world, pg);
}

std::shared_ptr<model::BaseShards> base_shards(bool prefetch, int rank, int world, dist::ProcessGroup* pg) {
  auto shards = std::make_shared<model::BaseShards>();
  shards->rank = rank;
  shards->world = world;
  shards->prefetch = prefetch;
  if (pg)  // each block gathered from every rank's slices while it runs (one rank: the same path)
    shards->all_gather = [pg](at::Tensor& out, const at::Tensor& in) -> std::function<void()> {
      auto pending = std::make_shared<dist::ProcessGroup::Pending>(pg->all_gather_async(out, in));
      return [pending] { pending->wait(); };
    };
  return shards;
}

model::LoadOptions load_options(const recipe::Recipe& r, std::shared_ptr<model::BaseShards> shards, bool shapes_only) {
  return {.quantize = r.lora.quantize_base,
          .double_quant = r.lora.double_quant,
          .keep_quantized = r.model.keep_quantized,
          .shards = std::move(shards),
          .shapes_only = shapes_only};
}

uint64_t dropout_seed(int64_t seed, int rank) {
  return static_cast<uint64_t>(seed) * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(rank) + 1;
}

int64_t steps_per_batch(const recipe::Recipe& r) {
  return r.train.objective == recipe::Objective::Grpo ? r.grpo.num_iterations : 1;
}

int64_t steps_per_epoch(const recipe::Recipe& r, int64_t per_rank) {
  const int64_t per_step = int64_t{r.data.batch_size} * r.train.gradient_accumulation_steps;
  const int64_t steps = (per_rank + per_step - 1) / per_step * steps_per_batch(r);
  return r.train.max_steps_per_epoch ? std::min<int64_t>(steps, *r.train.max_steps_per_epoch) : steps;
}

int64_t batches_read(const recipe::Recipe& r, int64_t step_in_epoch) {
  return (step_in_epoch + steps_per_batch(r) - 1) / steps_per_batch(r);
}

int64_t epoch_documents(const recipe::Recipe& r, int64_t per_rank, int world) {
  const int64_t read =
      batches_read(r, steps_per_epoch(r, per_rank)) * r.data.batch_size * r.train.gradient_accumulation_steps;
  return std::min(per_rank, read) * world;
}

void read_training_data(const recipe::Recipe& r, const tok::Tokenizer& tokenizer, const data::ExampleBuilder* builder,
                        bool evaluating, TrainingData& d) {
  const data::Holdout training = data::Holdout::training(r.eval.fraction);
  if (r.data.sources.empty())
    d.docs = std::make_unique<data::Documents>(r.data, training);
  else
    d.mix = std::make_unique<data::Mixture>(r, tokenizer, data::pair_tokens(r.train.objective), training, stop_flag());
  if (d.mix && r.train.objective == recipe::Objective::Grpo)  // (each source's prompts, checked as data.path's)
    for (const data::MixSource& s : d.mix->sources()) s.builder->check_documents(train::reward_check(r));
  if (!evaluating) return;
  // Read and built as training data is (the same builder); never a document training reads.
  if (d.mix && r.eval.fraction > 0) {
    for (const data::MixSource& s : d.mix->sources()) {
      d.source_evals.push_back(std::make_unique<data::EvalSplit>(r, nullptr, s.config.get()));
      require_scored_token(d.source_evals.back()->docs(), *s.builder, d.source_evals.back()->describe());
    }
    return;
  }
  d.eval = std::make_unique<data::EvalSplit>(r, d.docs.get());
  if (d.mix)
    for (const data::MixSource& s : d.mix->sources()) d.eval->refuse_overlap(*s.docs);
  require_scored_token(d.eval->docs(), *builder, d.eval->describe());
}

Runtime::Runtime(const recipe::Recipe& r, const dist::DistEnv& env, const RuntimeOptions& o)
    : device(rank_device(r, env)),
      shards(o.train && r.dist.shard_base ? base_shards(r, env.rank, env.world_size, o.pg) : nullptr),
      model(as_input_error([&] { return load_model(r, env, o); })),
      tokenizer(as_input_error([&] { return model::load_tokenizer(model.dir()); })) {
  as_input_error([&] {
    model.check_tokenizer(tokenizer);
    model.check_length(r.data.max_length, fmt::format("data.max_length {}", r.data.max_length));
  });
  const bool evaluating = !o.tenants && o.eval_split && r.eval.enabled(r.data.source);
  // (data.sources build their own; the eval: split of a mixture without eval.fraction reads by data's keys)
  if (o.tenants || r.data.sources.empty() || (evaluating && r.eval.fraction <= 0))
    builder = std::make_unique<data::ExampleBuilder>(r.data, tokenizer, std::nullopt,
                                                     data::pair_tokens(r.train.objective), stop_flag());
  if (builder && r.train.objective == recipe::Objective::Grpo) builder->check_documents(train::reward_check(r));
  if (!o.tenants) read_training_data(r, tokenizer, builder.get(), evaluating, data);
}

// The base model (NF4 with lora.quantize_base, this rank's slices with dist.shard_base) with its
// adapters: for training new (or lora.init_from's), else `o.adapter` when given.
model::CausalLM Runtime::load_model(const recipe::Recipe& r, const dist::DistEnv& env, const RuntimeOptions& o) {
  model::CausalLM m = model::CausalLM::load(r.model.path, model::dtype_of(r.model.dtype, device.is_cuda()), device,
                                            load_options(r, shards));
  if (r.model.dtype == recipe::Dtype::Auto && env.rank == 0)
    info(fmt::format("model.dtype auto: {} ({})",
                     recipe::name(m.dtype() == at::kBFloat16 ? recipe::Dtype::BF16 : recipe::Dtype::FP32),
                     device.is_cuda()        ? "CUDA"
                     : model::cpu_has_bf16() ? "this CPU has bf16 instructions"
                                             : "this CPU has no bf16 instructions: fp32 is faster"));
  if (!o.train) {
    if (!o.adapter.empty()) model::load_adapter(m, o.adapter, m.dtype());
    return m;
  }
  // Dropout draws from the default generators: one stream per rank, derived from train.seed,
  // so the same recipe on the same world size gives the same adapter bit for bit.
  at::manual_seed(dropout_seed(r.train.seed, env.rank));
  const model::LoraConfig cfg = model::lora_config_of(r.lora, r.model.path);
  if (!o.tenants) {  // (a job of many adapters attaches them itself)
    if (r.lora.init_from.empty())
      model::attach_lora(m, cfg, static_cast<uint64_t>(r.train.seed));  // same seed: identical replicas
    else
      start_from_adapter(m, cfg, r.lora.init_from, env.rank == 0);
  }
  m.recompute_activations = r.train.activation_checkpointing;
  // The whole tensors loading went through (dequantised, quantised, sliced) are free now; give
  // their pages back, or the heap they fragmented stays resident for the whole run.
  malloc_trim(0);
  return m;
}

std::vector<std::string> Runtime::summary(const recipe::Recipe& r, const TrainingData& d, int world,
                                          int64_t steps_per_epoch, size_t buckets) const {
  const auto mib = [](int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); };
  std::vector<std::string> out = {
      fmt::format("{}; {} documents from {}, {} rank(s), {} steps per epoch, gradients all-reduced in {} bucket(s)",
                  model::trainable_summary(model), d.documents(), d.describe(), world, steps_per_epoch,
                  std::max<size_t>(1, buckets))};
  if (r.lora.quantize_base) out.push_back(model::nf4_summary(model));
  if (r.model.keep_quantized) out.push_back(model::gguf_blocks_summary(model));
  if (shards)
    out.push_back(fmt::format(
        "dist.shard_base: base weights on this rank {:.1f} MiB of {:.1f} MiB (linears in {} slice(s); embeddings, "
        "norms and the output projection whole), and at most {:.1f} MiB of blocks gathered whole ({}); resident "
        "{:.0f} MiB",
        mib(model.base_bytes()), mib(model.base_bytes(true)), world, mib(shards->block_buffer_bytes()),
        shards->prefetch ? "2 at a time: the next is gathered while one computes" : "1 at a time", resident_mib()));
  if (d.mix)
    for (const data::MixSource& s : d.mix->sources())
      out.push_back(fmt::format(
          "data.sources '{}': {} documents per epoch of the {} selected ({}){}", s.spec.name, s.per_epoch,
          s.docs->size(),
          s.per_epoch > s.docs->size()
              ? fmt::format("{:.2f} passes", double(s.per_epoch) / double(s.docs->size()))
              : fmt::format("{:.1f}% of them", 100.0 * double(s.per_epoch) / double(s.docs->size())),
          s.sampled
              ? fmt::format(", {:.1f} trained tokens per document over {} sampled", s.tokens_per_document, s.sampled)
              : ""));
  for (const auto& e : d.source_evals)
    out.push_back(fmt::format("evaluating on {} documents of {} at each epoch end{}", e->docs().size(), e->describe(),
                              r.eval.every_n_steps ? fmt::format(" and every {} steps", *r.eval.every_n_steps) : ""));
  if (d.eval)
    out.push_back(fmt::format("evaluating on {} documents from {}{} at each epoch end{}", d.eval->docs().size(),
                              d.eval->docs().describe(),
                              r.eval.fraction > 0 ? fmt::format(" (eval.fraction {})", r.eval.fraction) : "",
                              r.eval.every_n_steps ? fmt::format(" and every {} steps", *r.eval.every_n_steps) : ""));
  return out;
}

}  // namespace lorarun::train
