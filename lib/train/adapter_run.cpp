#include "train/adapter_run.hpp"

#include <ATen/ATen.h>
#include <ATen/record_function.h>
#include <fmt/format.h>
#include <torch/optim/adamw.h>
#include <cmath>
#include <cstdio>

#include "train/agreement.hpp"
#include "train/objective.hpp"
#include "train/optimizer.hpp"
#include "train/runtime.hpp"
#include "util/error.hpp"
#include "util/log.hpp"

namespace lorarun::train {

AdapterRun::AdapterRun(std::string name_, recipe::Recipe r_, std::vector<at::Tensor> params_,
                       std::unique_ptr<torch::optim::AdamW> opt_)
    : name(std::move(name_)),
      r(std::move(r_)),
      params(std::move(params_)),
      opt(std::move(opt_)),
      schedule(schedule_of(r.train.lr_scheduler)),
      epochs(r.train.epochs) {}

AdapterRun::~AdapterRun() = default;

void AdapterRun::plan(int world) {
  const int64_t per_rank = data.per_rank(world);
  steps_per_epoch = train::steps_per_epoch(r, per_rank);
  total_steps = steps_per_epoch * r.train.epochs;
  epoch_documents = train::epoch_documents(r, per_rank, world);
  source_step.assign(2 * (data.mix ? data.mix->sources().size() : 0), 0.0);
}

std::string AdapterRun::who() const { return name.empty() ? "" : fmt::format("adapter '{}': ", name); }

double AdapterRun::lr() const { return r.train.lr * lr_factor(schedule, p.step, r.train.warmup_steps, total_steps); }

std::vector<data::Example> AdapterRun::examples(int rank, int& warned, std::string& data_error) {
  std::vector<data::Example> out;
  if (!data_error.empty() || !batches) return out;
  std::vector<data::Built> next;
  try {
    next = batches->next();
  } catch (const data::DataUnavailable& e) {
    data_error = who() + e.what();
    log_error(fmt::format("rank {}: {}", rank, data_error));
    return out;
  }
  const size_t sources = source_step.size() / 2;
  for (data::Built& built : next) {
    if (auto* e = std::get_if<data::Example>(&built)) {
      if (sources > 0) {
        source_step[static_cast<size_t>(e->source)] += 1;
        source_step[sources + static_cast<size_t>(e->source)] += static_cast<double>(data::trained_tokens(*e));
      }
      out.push_back(std::move(*e));
      continue;
    }
    const auto& why = std::get<data::Rejection>(built);
    if (r.data.bad_documents == recipe::BadDocuments::Fail && why.kind == data::Rejection::BadDocument)
      throw ConfigError(
          fmt::format("rank {}: {}bad document {}({}) and data.bad_documents is fail: fix the document or set "
                      "data.bad_documents=skip",
                      rank, who(), why.document.empty() ? "" : why.document + " ", why.reason));
    skips.count(why);
    if (warned++ < 3)
      warn(fmt::format("rank {}: {}skipping {}: {}", rank, who(),
                       why.document.empty() ? "a document" : "document " + why.document, why.reason));
  }
  return out;
}

void AdapterRun::check_finite(double loss, double grad_norm) const {
  if (std::isfinite(loss) && std::isfinite(grad_norm)) return;
  throw Error(
      fmt::format("{}training diverged at step {}: the loss is {} and the gradient norm {}; nothing of this step was "
                  "applied or saved. Lower {} (now {:g}), set train.max_grad_norm, or check the data, then start over "
                  "(checkpoint.resume=never)",
                  who(), p.step + 1, loss, grad_norm, name.empty() ? "train.lr" : "its lr", r.train.lr));
}

void AdapterRun::apply(std::vector<at::Tensor>& grads, const at::Tensor& norm, double lr) {
  RECORD_USER_SCOPE("optimizer");               // (train.profile_steps: the clipping and AdamW's step, as one)
  if (r.train.max_grad_norm && !grads.empty())  // torch's clip_grad_norm_
    at::_foreach_mul_(grads, (*r.train.max_grad_norm / (norm + 1e-6)).clamp_max(1.0));
  set_lr(*opt, lr, r.lora.plus_lr_ratio);
  opt->step();
}

void AdapterRun::evaluated(const nlohmann::json& row, bool steers, bool lead, bool tty) {
  const double loss = row["eval_loss"].get<double>();
  last_eval_loss = loss;
  const bool rewarded = row.contains("eval_reward");  // (grpo: eval_loss is minus the mean reward)
  if (lead) {
    if (tty) std::fputs("\n", stdout);
    const std::string what =
        rewarded ? fmt::format("eval_reward {:.6f} of {} greedy completions", -loss, row["eval_tokens"].get<int64_t>())
                 : fmt::format("eval_loss {:.6f} eval_ppl {:.4f} over {} tokens of {} documents", loss, std::exp(loss),
                               row["eval_tokens"].get<int64_t>(), row["eval_documents"].get<int64_t>());
    info(fmt::format("{}eval at epoch {} step {}: {} ({:.1f} s)", who(), p.epoch, p.step, what,
                     row["eval_seconds"].get<double>()));
  }
  if (!steers) return;
  Steering& s = p.steering;
  const std::optional<double> before = s.best_loss;
  s.evals_since_best = !before || loss < *before - r.train.early_stopping_min_delta ? 0 : s.evals_since_best + 1;
  if (!before || loss < *before) {
    s.best_loss = loss;
    s.best_step = p.step;
    if (r.checkpoint.keep_best) ckpt->save_best(row, p.step);
  }
  const std::optional<int> patience = r.train.early_stopping_patience;
  if (!patience || s.evals_since_best < *patience || p.step >= total_steps) return;  // (the end anyway)
  stopping_early = true;
  epochs = p.epoch + 1;
  if (lead)
    info(
        fmt::format("{}early stopping after step {} (epoch {}): {} evaluations without {} the best {} {:.6f} (step {}) "
                    "by more than {:g}",
                    who(), p.step, p.epoch, s.evals_since_best, rewarded ? "raising" : "lowering",
                    rewarded ? "eval_reward" : "eval_loss", rewarded ? -*s.best_loss : *s.best_loss, s.best_step,
                    r.train.early_stopping_min_delta));
}

void check_replicas(const Agreement& agree, const std::vector<const AdapterRun*>& runs, int64_t step) {
  double mine = 0, i = 0;
  for (const AdapterRun* a : runs)
    for (const at::Tensor& p : a->params) mine += p.to(at::kDouble).sum().item<double>() * ++i;
  if (!agree.same(mine))
    throw Error(
        fmt::format("rank {}'s LoRA parameters differ from another rank's at step {} (checksum {}): the "
                    "replicas diverged",
                    agree.rank(), step, mine));
}

}  // namespace lorarun::train
