// The adapters a Trainer trains: a run's one, or a job's many, each with its data.
#include <fmt/format.h>
#include <torch/optim/adamw.h>
#include <unistd.h>
#include <chrono>
#include <functional>

#include "model/lora.hpp"
#include "train/checkpointer.hpp"
#include "train/job.hpp"
#include "train/objective.hpp"
#include "train/optimizer.hpp"
#include "train/trainer_impl.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/untrusted.hpp"

namespace lorarun::train::loop {

// The process group and the runtime first; then the adapters (the recipe's one, or a job's), and
// the gradient buckets over all their parameters.
Trainer::Trainer(const recipe::Recipe& r, const dist::DistEnv& env)
    : r_(r),
      env_(env),
      lead_(env.rank == 0),
      tty_(lead_ && isatty(STDOUT_FILENO)),
      cuda_(uses_cuda(r)),
      pg_(env, dist::backend_of(r.dist.backend, cuda_), std::chrono::seconds(r.dist.timeout_s)),
      rt_(r, env, {.pg = &pg_, .tenants = r.adapters.enabled()}),
      m_(rt_.model),
      agree_(pg_, env.rank, env.world_size, rt_.device),
      streams_(0, 0, rt_.device) {
  if (r.adapters.enabled())
    add_adapters();
  else
    add_alone();
  std::vector<at::Tensor> all;
  for (const auto& t : tenants_) {
    all.insert(all.end(), t->run->params.begin(), t->run->params.end());
    t->source_logged.assign(t->run->source_step.size(), 0.0);
  }
  sync_ = std::make_unique<dist::GradBuckets>(pg_, all, static_cast<int64_t>(r.dist.bucket_mb * (1 << 20) / 4));
}

// A run of one adapter: the model's own LoRA (every variant the runtime built), the runtime's data,
// dropout from the process's generators (seeded per rank by the runtime).
void Trainer::add_alone() {
  auto t = std::make_unique<Tenant>();
  t->rng = RngStream::process(cuda_);
  t->run = std::make_unique<AdapterRun>(
      "", r_, model::lora_parameters(m_),
      make_adamw(model::lora_state(m_), r_.train.lr, r_.train.weight_decay, r_.lora.plus_lr_ratio));
  AdapterRun& a = *t->run;
  a.data = std::move(rt_.data);
  a.objective = make_objective(a.r, m_, model::lora_state(m_), agree_, rt_.device, rt_.tokenizer);
  a.plan(env_.world_size);
  a.ckpt = std::make_unique<Checkpointer>(a.r, agree_, m_, model::lora_config_of(r_.lora, r_.model.path), a.params,
                                          *a.opt, a.data.identity(), cuda_, t->rng);
  keep_objective_in_state(a);
  tenants_.push_back(std::move(t));
}

// What the objective keeps goes with each resumable state and comes back with it: GRPO's rollout;
// preference.precompute_reference's log-probs (those of other data, or none, are computed again, said
// in one line).
void Trainer::keep_objective_in_state(AdapterRun& a) {
  if (!a.objective->keeps_state()) return;
  Objective* o = a.objective.get();
  const nlohmann::json data = a.data.identity();
  const bool lead = lead_;
  a.ckpt->keep_in_state([o, data](const std::string& dir) { o->save_files(dir, data); },
                        [o, data, lead, who = a.who()](const std::string& dir) {
                          const std::string why = o->load_files(dir, data);
                          if (!why.empty() && lead)
                            warn(fmt::format("{}preference.precompute_reference: {}; computing them again", who, why));
                        });
}

// A job's adapters (job_adapters), each in its slot of the model with its own run's recipe, data,
// LoRA (lora.init_from's when set) and dropout stream.
void Trainer::add_adapters() {
  const std::vector<recipe::AdapterSpec> specs = job_adapters(r_);
  // Every rank must train the same adapters in the same slots (a value added between two ranks'
  // queries would shift them).
  std::string names;
  for (const recipe::AdapterSpec& s : specs) names += s.name + "/";
  if (!agree_.same(static_cast<double>(std::hash<std::string>{}(names) % (1LL << 52))))
    throw Error(
        fmt::format("rank {} found the adapters {} but another rank found others: the data changed while "
                    "the job started; start it again",
                    env_.rank, printable(names)));
  streams_ = model::DropoutStreams(specs.size(), dropout_seed(r_.train.seed, env_.rank), rt_.device);
  for (size_t i = 0; i < specs.size(); ++i) {
    auto t = std::make_unique<Tenant>();
    const int slot = static_cast<int>(i);
    t->slot = slot;
    recipe::Recipe own = recipe::adapter_recipe(r_, specs[i]);
    model::LoraConfig cfg = model::lora_config_of(own.lora, r_.model.path);
    cfg.tenant = slot;
    try {
      as_input_error([&] {
        model::attach_tenant(m_, cfg, static_cast<uint64_t>(r_.train.seed), slot, static_cast<int>(specs.size()));
        if (!own.lora.init_from.empty()) model::start_tenant_from(m_, slot, cfg, own.lora.init_from);
      });
    } catch (const Error& e) {
      rethrow_within(e, fmt::format("adapter '{}': ", specs[i].name));
    }
    auto opt = make_adamw(model::tenant_state(m_, slot), own.train.lr, own.train.weight_decay, own.lora.plus_lr_ratio);
    t->run =
        std::make_unique<AdapterRun>(specs[i].name, std::move(own), model::tenant_parameters(m_, slot), std::move(opt));
    AdapterRun& a = *t->run;
    try {  // (an Error or a ConfigError names the adapter; a lost server stays as it is)
      open_data(a);
    } catch (const Error& e) {
      rethrow_within(e, a.who());
    }
    a.plan(env_.world_size);
    model::DropoutStreams* streams = &streams_;
    t->rng = {[streams, slot] { return streams->state(slot); },
              [streams, slot](const at::Tensor& b) { streams->set_state(slot, b); }};
    a.ckpt = std::make_unique<Checkpointer>(a.r, agree_, m_, cfg, a.params, *a.opt, a.data.identity(), cuda_, t->rng);
    a.ckpt->store_as_adapter(a.name);
    a.objective = make_objective(a.r, m_, model::tenant_state(m_, slot), agree_, rt_.device, rt_.tokenizer);
    keep_objective_in_state(a);
    tenants_.push_back(std::move(t));
  }
}

// A job's adapter a's data (its selection or its data.sources mixture) and evaluation. When
// eval.fraction holds out none of its documents, or all of them (a tenant of a few), it trains on
// them all, unevaluated, as its own run with eval.fraction 0 does: one small tenant does not stop
// the job.
void Trainer::open_data(AdapterRun& a) {
  TrainingData& d = a.data;
  try {
    read_training_data(a.r, rt_.tokenizer, rt_.builder.get(), a.r.eval.enabled(a.r.data.source), d);
    return;
  } catch (const data::EmptySplit&) {
  }
  const bool none = d.docs || d.mix;  // training kept every document: none held out
  const double fraction = a.r.eval.fraction;
  a.r.eval.fraction = 0;
  a.r.checkpoint.keep_best = false;
  a.r.train.early_stopping_patience.reset();
  d = TrainingData();
  read_training_data(a.r, rt_.tokenizer, rt_.builder.get(), false, d);
  if (lead_)
    warn(
        fmt::format("adapter '{}': eval.fraction {:g} holds out {} of its {} documents: it trains on them all and "
                    "is not evaluated (no eval_loss, best/ or early stop of its own)",
                    a.name, fraction, none ? "none" : "every one", d.documents()));
}

}  // namespace lorarun::train::loop
