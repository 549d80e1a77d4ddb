#include "train/trainer.hpp"

#include <ATen/ATen.h>
#include <chrono>
#include <filesystem>
#include <fmt/format.h>
#include <fstream>
#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include "data/example.hpp"
#include "data/mongo.hpp"
#include "data/source.hpp"
#include "dist/process_group.hpp"
#include "io/files.hpp"
#include "model/lora.hpp"
#include "model/loss.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "tokenizer/tokenizer.hpp"
#include "train/schedule.hpp"
#include "util/error.hpp"
#include "util/log.hpp"

namespace lorarun::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// A right-padded micro-batch: ids [B, T], labels [B, T] (-100 on padding), attention mask.
struct Batch {
  at::Tensor ids, labels, mask;
  int64_t tokens = 0;  // trained tokens in it
};

Batch collate(const std::vector<data::Example>& examples, at::Device device) {
  Batch b;
  if (examples.empty()) return b;
  int64_t T = 0;
  for (const auto& e : examples) T = std::max<int64_t>(T, static_cast<int64_t>(e.ids.size()));
  const int64_t B = static_cast<int64_t>(examples.size());
  at::Tensor ids = at::zeros({B, T}, at::kLong), labels = at::full({B, T}, -100, at::kLong), mask = at::zeros({B, T}, at::kLong);
  for (int64_t i = 0; i < B; ++i) {
    const auto& e = examples[static_cast<size_t>(i)];
    const auto n = static_cast<int64_t>(e.ids.size());
    ids[i].narrow(0, 0, n).copy_(at::tensor(std::vector<int64_t>(e.ids.begin(), e.ids.end())));
    labels[i].narrow(0, 0, n).copy_(at::tensor(std::vector<int64_t>(e.labels.begin(), e.labels.end())));
    mask[i].narrow(0, 0, n).fill_(1);
  }
  b.tokens = (labels.narrow(1, 1, T - 1) != -100).sum().item<int64_t>();
  b.ids = ids.to(device), b.labels = labels.to(device), b.mask = mask.to(device);
  return b;
}

at::ScalarType dtype_of(recipe::Dtype d) {
  return d == recipe::Dtype::BF16 ? at::kBFloat16 : d == recipe::Dtype::FP16 ? at::kHalf : at::kFloat;
}

// Writes the adapter to <dir>.tmp.<pid>, then renames it: a reader never sees half of it.
void save_epoch(const model::CausalLM& m, const model::LoraConfig& cfg, const fs::path& dir) {
  const fs::path tmp = dir.string() + fmt::format(".tmp.{}", getpid());
  fs::remove_all(tmp);
  model::save_adapter(m, cfg, tmp.string());
  fs::remove_all(dir);
  fs::rename(tmp, dir);
  io::sync_dir(dir.parent_path().string());
}

}  // namespace

void run_training(const recipe::Recipe& r, const dist::DistEnv& env) {
  const bool cuda = r.model.device != recipe::Device::Cpu && torch::cuda::is_available();
  if (r.model.device == recipe::Device::Cuda && !cuda) throw Error("model.device is cuda but no GPU is visible");
  const at::Device device = cuda ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank)) : at::Device(at::kCPU);
  const auto backend_name = r.dist.backend == recipe::DistBackend::Nccl ? "nccl"
                            : r.dist.backend == recipe::DistBackend::Gloo ? "gloo" : "auto";
  dist::ProcessGroup pg(env, dist::resolve_backend(backend_name, cuda), std::chrono::seconds(r.dist.timeout_s));
  const bool lead = env.rank == 0;
  const fs::path out = r.checkpoint.output_dir;

  model::CausalLM m = model::CausalLM::load(r.model.path, dtype_of(r.model.dtype), device);
  model::LoraConfig lcfg;
  lcfg.r = r.lora.r, lcfg.alpha = r.lora.alpha, lcfg.dropout = r.lora.dropout, lcfg.use_rslora = r.lora.use_rslora;
  lcfg.target_modules = r.lora.target_modules;
  lcfg.base_model_name_or_path = r.model.path;
  model::attach_lora(m, lcfg, static_cast<uint64_t>(r.train.seed));  // same seed: identical replicas
  const tok::Tokenizer tokenizer = tok::Tokenizer::from_dir(m.dir());
  const data::ExampleBuilder builder(r.data, tokenizer);
  const data::Documents docs(r.data, std::chrono::seconds(r.dist.timeout_s));
  if (lead) {
    fmt::print("{}; {} documents, {} rank(s)\n", model::trainable_summary(m), docs.size(), env.world_size);
    fs::create_directories(out);
    io::write_file_atomic((out / "recipe.yaml").string(), recipe::to_yaml(r));
  }

  std::vector<at::Tensor> params = model::lora_parameters(m);
  torch::optim::AdamW opt(params, torch::optim::AdamWOptions(r.train.lr).weight_decay(r.train.weight_decay));
  const int64_t per_rank = data::examples_per_rank(docs.size(), env.world_size);
  const int64_t micro = r.data.batch_size, accum = r.train.gradient_accumulation_steps;
  int64_t steps_per_epoch = (per_rank + micro * accum - 1) / (micro * accum);
  if (r.train.max_steps_per_epoch) steps_per_epoch = std::min<int64_t>(steps_per_epoch, *r.train.max_steps_per_epoch);
  const int64_t total_steps = steps_per_epoch * r.train.epochs;
  const Schedule schedule = parse_schedule(r.train.lr_scheduler == recipe::Scheduler::Cosine   ? "cosine"
                                           : r.train.lr_scheduler == recipe::Scheduler::Linear ? "linear" : "constant");
  std::ofstream metrics;
  if (lead) metrics.open(out / "metrics.jsonl", std::ios::app);
  int64_t step = 0, rejected = 0;
  m.training = true;

  for (int epoch = 0; epoch < r.train.epochs; ++epoch) {
    data::ShardReader reader(docs, builder, {env.world_size, env.rank, static_cast<uint64_t>(r.train.seed), epoch,
                                             r.data.shuffle});
    for (int64_t s = 0; s < steps_per_epoch; ++s, ++step) {
      const auto t0 = Clock::now();
      at::Tensor loss_sum = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device));
      int64_t tokens = 0;
      for (int64_t a = 0; a < accum; ++a) {
        std::vector<data::Example> examples;
        for (data::Built& built : reader.next(static_cast<size_t>(micro))) {
          if (auto* e = std::get_if<data::Example>(&built)) {
            examples.push_back(std::move(*e));
          } else if (r.data.bad_documents == recipe::BadDocuments::Fail &&
                     std::get<data::Rejection>(built).kind == data::Rejection::BadDocument) {
            throw Error(fmt::format("rank {}: bad document ({}) and data.bad_documents is fail", env.rank,
                                    std::get<data::Rejection>(built).reason));
          } else {
            ++rejected;
          }
        }
        const Batch b = collate(examples, device);
        if (b.tokens == 0) continue;  // an empty micro-batch still joins the all-reduce below
        const model::LossSum l = model::causal_lm_loss(m.forward(b.ids, b.mask), b.labels);
        l.sum.backward();
        loss_sum += l.sum.detach();
        tokens += b.tokens;
      }
      // One all-reduce: every LoRA gradient, the loss sum and the token count, so the loss is
      // normalised by the global number of trained tokens of this step.
      std::vector<at::Tensor> flat;
      for (at::Tensor& p : params) flat.push_back(p.grad().defined() ? p.grad().reshape(-1) : at::zeros({p.numel()}, p.options()));
      flat.push_back(loss_sum.reshape(1).to(params[0].scalar_type()));
      flat.push_back(at::full({1}, static_cast<double>(tokens), params[0].options()));
      at::Tensor all = at::cat(flat);
      if (env.world_size > 1) pg.all_reduce_sum(all);
      const double global_tokens = all[-1].item<double>();
      const double mean_loss = global_tokens > 0 ? all[-2].item<double>() / global_tokens : 0.0;
      int64_t offset = 0;
      for (at::Tensor& p : params) {
        const at::Tensor g = all.narrow(0, offset, p.numel()).view_as(p) / std::max(1.0, global_tokens);
        if (p.grad().defined()) p.mutable_grad().copy_(g); else p.mutable_grad() = g.clone();
        offset += p.numel();
      }
      const double grad_norm = r.train.max_grad_norm ? torch::nn::utils::clip_grad_norm_(params, *r.train.max_grad_norm)
                                                     : 0.0;
      const double lr = r.train.lr * lr_factor(schedule, step, r.train.warmup_steps, total_steps);
      for (auto& group : opt.param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(lr);
      opt.step();
      opt.zero_grad();
      const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
      if (lead && (step + 1) % r.track.log_every_n_steps == 0) {
        fmt::print("epoch {} step {}/{} loss {:.4f} lr {:.3g} grad_norm {:.3f} tokens/s {:.0f}\n", epoch, s + 1,
                   steps_per_epoch, mean_loss, lr, grad_norm, global_tokens / seconds);
        std::fflush(stdout);
        metrics << nlohmann::json{{"epoch", epoch}, {"step", step + 1}, {"loss", mean_loss}, {"lr", lr},
                                  {"grad_norm", grad_norm}, {"tokens", global_tokens},
                                  {"tokens_per_s", global_tokens / seconds}}.dump() << "\n" << std::flush;
      }
    }
    // Rank 0 writes; every rank learns whether it worked, so a failed save stops all, never hangs.
    int failed = 0;
    std::string why;
    if (lead && recipe::save_after_epoch(r.checkpoint, epoch, r.train.epochs)) {
      try {
        save_epoch(m, lcfg, out / fmt::format("epoch_{}", epoch));
      } catch (const std::exception& e) {
        failed = 1, why = e.what();
      }
    }
    at::Tensor status = at::full({1}, failed, at::TensorOptions().dtype(at::kFloat).device(device));
    if (env.world_size > 1) pg.all_reduce_sum(status);
    if (status.item<double>() > 0)
      throw Error(lead ? fmt::format("saving epoch_{} failed: {}", epoch, why)
                       : fmt::format("rank 0 could not save epoch_{}; stopping", epoch));
  }
  if (lead) {  // exactly the epochs the recipe keeps, also after an interrupted earlier run
    const std::vector<int> kept = recipe::epochs_kept(r.checkpoint, r.train.epochs);
    for (const auto& e : fs::directory_iterator(out)) {
      const std::string name = e.path().filename().string();
      if (!e.is_directory() || name.rfind("epoch_", 0) != 0) continue;
      const std::string digits = name.substr(6);
      if (digits.empty() || digits.find_first_not_of("0123456789") != std::string::npos) continue;
      if (std::find(kept.begin(), kept.end(), std::stoi(digits)) == kept.end()) fs::remove_all(e.path());
    }
    if (rejected) warn(fmt::format("{} documents were skipped on rank 0 (bad or overlong)", rejected));
    fmt::print("done: {} steps; adapters in {}\n", step, out.string());
  }
  pg.barrier();
}

}  // namespace lorarun::train
