#include "train/trainer.hpp"

#include <ATen/ATen.h>
#include <atomic>
#include <cmath>
#include <chrono>
#include <csignal>
#include <ctime>
#include <filesystem>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <fstream>
#include <sys/resource.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>
#include <unistd.h>

#include "data/batches.hpp"
#include "data/source.hpp"
#include "dist/grad_buckets.hpp"
#include "dist/process_group.hpp"
#include "io/files.hpp"
#include "model/lora.hpp"
#include "model/loss.hpp"
#include "model/transformer.hpp"
#include "tokenizer/tokenizer.hpp"
#include "track/record.hpp"
#include "train/output_dir.hpp"
#include "train/schedule.hpp"
#include "train/state.hpp"
#include "util/error.hpp"
#include "util/log.hpp"

namespace lorarun::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// SIGTERM / SIGINT (preemption, Ctrl-C, the launcher tearing down): finish the step, save the
// resumable state on every rank's agreement, exit kExitPreempted.
std::atomic<bool> g_stop_requested{false};
void request_stop(int) { g_stop_requested = true; }

void install_stop_handlers() {
  struct sigaction sa {};
  sa.sa_handler = request_stop;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

// A micro-batch on the device: rows of token ids [R, T] with their mask (1 = token, 0 = padding;
// packed: the document's number within its row), and the N flat positions of [R*T] that predict
// a trained token, with those tokens. Documents never predict across a boundary.
struct Batch {
  at::Tensor ids, mask, rows, targets;
  int64_t tokens = 0;           // trained tokens (N)
  int64_t real = 0, slots = 0;  // document tokens and row slots (R*T): the padding share
};

// Host vector -> device tensor of `shape`; through pinned memory, without blocking, on CUDA.
at::Tensor upload(const std::vector<int64_t>& v, at::IntArrayRef shape, at::Device device) {
  const auto opts = at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda());
  at::Tensor host = at::empty(shape, opts);
  std::copy(v.begin(), v.end(), host.data_ptr<int64_t>());
  return device.is_cuda() ? host.to(device, /*non_blocking=*/true) : host;
}

// Examples -> rows: one per example, right-padded to the longest; or, packed, the examples
// share rows of `capacity` tokens (first-fit decreasing), padded to the fullest row.
Batch collate(const std::vector<data::Example>& examples, bool packed, size_t capacity, at::Device device) {
  Batch b;
  if (examples.empty()) return b;
  std::vector<std::vector<size_t>> layout;
  if (packed) {
    std::vector<size_t> lengths;
    for (const auto& e : examples) lengths.push_back(e.ids.size());
    layout = data::pack_rows(lengths, std::max(capacity, *std::max_element(lengths.begin(), lengths.end())));
  } else {
    for (size_t i = 0; i < examples.size(); ++i) layout.push_back({i});
  }
  size_t T = 0;
  for (const auto& row : layout) {
    size_t n = 0;
    for (size_t i : row) n += examples[i].ids.size();
    T = std::max(T, n);
  }
  const size_t R = layout.size();
  std::vector<int64_t> ids(R * T, 0), mask(R * T, 0), rows, targets;
  for (size_t r = 0; r < R; ++r) {
    size_t at = r * T;
    int64_t doc = 1;
    for (size_t i : layout[r]) {
      const data::Example& e = examples[i];
      for (size_t k = 0; k < e.ids.size(); ++k, ++at) {
        ids[at] = e.ids[k], mask[at] = packed ? doc : 1;
        if (k + 1 < e.ids.size() && e.labels[k + 1] != -100) rows.push_back(int64_t(at)), targets.push_back(e.labels[k + 1]);
      }
      b.real += int64_t(e.ids.size()), ++doc;
    }
  }
  const auto shape = std::vector<int64_t>{int64_t(R), int64_t(T)};
  b.ids = upload(ids, shape, device), b.mask = upload(mask, shape, device);
  b.tokens = int64_t(rows.size()), b.slots = int64_t(R * T);
  b.rows = upload(rows, {b.tokens}, device), b.targets = upload(targets, {b.tokens}, device);
  return b;
}

at::ScalarType dtype_of(recipe::Dtype d) {
  return d == recipe::Dtype::BF16 ? at::kBFloat16 : d == recipe::Dtype::FP16 ? at::kHalf : at::kFloat;
}

// Writes the adapter to <dir>.tmp.<pid>, then renames it: a reader never sees half of it.
void save_epoch(const model::CausalLM& m, const model::LoraConfig& cfg, const fs::path& dir) {
  const fs::path tmp = dir.string() + fmt::format(".tmp.{}", getpid());
  io::remove_tree(tmp.string());
  model::save_adapter(m, cfg, tmp.string());
  io::remove_tree(dir.string());
  fs::rename(tmp, dir);
  io::sync_dir(dir.parent_path().string());
}

// Removes every epoch_<i>/ not in `kept`, also those and the temporary directories a crashed
// earlier run left behind.
void remove_unkept_epochs(const fs::path& out, const std::vector<int>& kept) {
  for (const auto& e : fs::directory_iterator(out)) {
    const std::string name = e.path().filename().string();
    if (name.find(".tmp.") != std::string::npos) {
      io::remove_tree(e.path().string());
      continue;
    }
    if (!e.is_directory() || name.rfind("epoch_", 0) != 0) continue;
    const std::string digits = name.substr(6);
    if (digits.empty() || digits.size() > 6 || digits.find_first_not_of("0123456789") != std::string::npos) continue;
    if (std::find(kept.begin(), kept.end(), std::stoi(digits)) == kept.end()) io::remove_tree(e.path().string());
  }
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

// "base linears in NF4: 6815744 parameters in 3.4 MiB (0.5159 bytes each)"
std::string nf4_summary(const model::CausalLM& m) {
  int64_t params = 0, bytes = 0;
  for (const model::Linear* l : m.linears())
    if (l->nf4) params += l->nf4->numel(), bytes += l->nf4->bytes();
  return fmt::format("base linears in NF4: {} parameters in {:.1f} MiB ({:.4f} bytes each)", params,
                     static_cast<double>(bytes) / (1 << 20), static_cast<double>(bytes) / static_cast<double>(params));
}

std::string clock_text(double seconds) {
  const auto s = static_cast<int64_t>(seconds);
  return s >= 3600 ? fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60) : fmt::format("{}:{:02}", s / 60, s % 60);
}

// What one optimizer step did, summed over ranks where it says so.
struct StepResult {
  double loss = 0, lr = 0, grad_norm = 0, seconds = 0;
  double tokens = 0;        // trained tokens, all ranks
  double rank_tokens = 0;   // trained tokens, this rank
  double data_wait = 0;     // mean share of the step the ranks spent waiting for data
  double padding = 0;       // share of the row slots that held padding, all ranks
  double rejected = 0;      // documents skipped in this step, all ranks
  bool stop = false;        // some rank was asked to stop
  bool data_failed = false; // some rank lost its data source: nothing of this step was applied
};

class Trainer {
 public:
  Trainer(const recipe::Recipe& r, const dist::DistEnv& env);
  int run();
  void record_failure(const std::string& error);

 private:
  void begin(Progress& p, bool resumed);
  std::optional<int> run_epoch(int epoch, int64_t first, const std::string& run_id);
  StepResult step(data::MicroBatches* batches);
  std::vector<data::Example> examples(data::MicroBatches* batches);
  void lose_data(const std::string& why);
  void log_step(const StepResult& s, int epoch, int64_t s_in_epoch);
  void save_checkpoint(int epoch);
  void save_state(const Progress& p);
  void check_finite_adapter(const std::string& what);
  void start_from_adapter();
  void open_metrics(const std::optional<Progress>& resumed);
  int data_lost(const Progress& p);
  void all_agree(bool ok, const std::string& why, const std::string& what);
  void check_replicas();
  bool ranks_agree(double value);
  void start_record(Progress& p, bool resumed);
  int stopped();
  int finish();

  const recipe::Recipe& r_;
  const dist::DistEnv env_;
  const bool lead_, cuda_, tty_;
  const at::Device device_;
  const fs::path out_;
  dist::ProcessGroup pg_;
  model::CausalLM m_;
  model::LoraConfig lcfg_;
  tok::Tokenizer tokenizer_;
  std::unique_ptr<data::ExampleBuilder> builder_;
  std::unique_ptr<data::Documents> docs_;
  std::vector<at::Tensor> params_;
  std::unique_ptr<torch::optim::AdamW> opt_;
  std::unique_ptr<dist::GradBuckets> sync_;
  Schedule schedule_ = Schedule::Cosine;
  const int64_t examples_per_step_ = int64_t{r_.data.batch_size} * r_.train.gradient_accumulation_steps;
  int64_t steps_per_epoch_ = 0, total_steps_ = 0, step_ = 0;
  int64_t rejected_here_ = 0;    // documents this rank skipped in the current step
  double rejected_total_ = 0;    // documents all ranks skipped, this process's steps
  int warned_ = 0;               // skipped documents this rank has warned about
  at::Tensor rng_at_step_start_;  // this rank's generators before the current step
  std::string data_error_;       // why this rank's data source gave up (empty: it did not)
  std::ofstream metrics_;
  Clock::time_point started_ = Clock::now();
  int64_t steps_this_process_ = 0;
  std::unique_ptr<track::RunRecorder> record_;  // rank 0, when the run is recorded in MongoDB
  nlohmann::json last_row_ = nlohmann::json::object();
};

// cuda:LOCAL_RANK. More ranks than GPUs share them round-robin, which Gloo allows (NCCL refuses
// two ranks on one GPU, so that is an error there).
at::Device pick_device(const recipe::Recipe& r, const dist::DistEnv& env, bool cuda) {
  if (r.model.device == recipe::Device::Cuda && !cuda)
    throw Error("model.device is cuda but no GPU is visible: set model.device=cpu or run on a GPU machine");
  if (!cuda) return at::Device(at::kCPU);
  const int gpus = static_cast<int>(torch::cuda::device_count());
  if (env.local_rank >= gpus && r.dist.backend != recipe::DistBackend::Gloo)
    throw Error(fmt::format("local rank {} has no GPU of its own ({} visible): start at most {} ranks per node, or set "
                            "dist.backend=gloo to share GPUs", env.local_rank, gpus, gpus));
  return at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(env.local_rank % gpus));
}

dist::Backend backend_of(recipe::DistBackend b, bool cuda) {
  if (b == recipe::DistBackend::Auto) return cuda ? dist::Backend::Nccl : dist::Backend::Gloo;
  return b == recipe::DistBackend::Nccl ? dist::Backend::Nccl : dist::Backend::Gloo;
}

Schedule schedule_of(recipe::Scheduler s) {
  return s == recipe::Scheduler::Cosine ? Schedule::Cosine : s == recipe::Scheduler::Linear ? Schedule::Linear
                                                                                             : Schedule::Constant;
}

bool want_cuda(const recipe::Recipe& r) { return r.model.device != recipe::Device::Cpu && torch::cuda::is_available(); }

Trainer::Trainer(const recipe::Recipe& r, const dist::DistEnv& env)
    : r_(r), env_(env), lead_(env.rank == 0), cuda_(want_cuda(r)), tty_(lead_ && isatty(STDOUT_FILENO)),
      device_(pick_device(r, env, cuda_)), out_(r.checkpoint.output_dir),
      pg_(env, backend_of(r.dist.backend, cuda_), std::chrono::seconds(r.dist.timeout_s)),
      m_(model::CausalLM::load(r.model.path, dtype_of(r.model.dtype), device_,
                               {.quantize = r.lora.quantize_base, .double_quant = r.lora.double_quant})),
      tokenizer_(tok::Tokenizer::from_dir(m_.dir())) {
  // Dropout draws from the default generators: one stream per rank, derived from train.seed,
  // so the same recipe on the same world size gives the same adapter bit for bit.
  at::manual_seed(static_cast<uint64_t>(r.train.seed) * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(env.rank) + 1);
  lcfg_.r = r.lora.r, lcfg_.alpha = r.lora.alpha, lcfg_.dropout = r.lora.dropout, lcfg_.use_rslora = r.lora.use_rslora;
  lcfg_.target_modules = r.lora.target_modules;
  lcfg_.base_model_name_or_path = r.model.path;
  if (r.lora.init_from.empty())
    model::attach_lora(m_, lcfg_, static_cast<uint64_t>(r.train.seed));  // same seed: identical replicas
  else
    start_from_adapter();
  m_.checkpoint_activations = r.train.activation_checkpointing;
  builder_ = std::make_unique<data::ExampleBuilder>(r.data, tokenizer_);
  docs_ = std::make_unique<data::Documents>(r.data);  // connects within data.timeout_s
  params_ = model::lora_parameters(m_);
  sync_ = std::make_unique<dist::GradBuckets>(pg_, params_, static_cast<int64_t>(r.dist.bucket_mb * (1 << 20) / 4));
  opt_ = std::make_unique<torch::optim::AdamW>(
      params_, torch::optim::AdamWOptions(r.train.lr).weight_decay(r.train.weight_decay));
  const int64_t per_rank = data::examples_per_rank(docs_->size(), env.world_size);
  steps_per_epoch_ = (per_rank + examples_per_step_ - 1) / examples_per_step_;
  if (r.train.max_steps_per_epoch) steps_per_epoch_ = std::min<int64_t>(steps_per_epoch_, *r.train.max_steps_per_epoch);
  total_steps_ = steps_per_epoch_ * r.train.epochs;
  schedule_ = schedule_of(r.train.lr_scheduler);
}

// lora.init_from: the adapter's weights, under the recipe's LoRA keys. Keys that change what the
// weights compute (r, alpha, use_rslora, the adapted layers) must agree, or the saved
// adapter_config.json would describe other weights; dropout is the recipe's to choose.
void Trainer::start_from_adapter() {
  const std::string& from_dir = r_.lora.init_from;
  const model::LoraConfig from = model::load_adapter(m_, from_dir);
  auto differ = [&](const std::string& key, const std::string& adapter, const std::string& recipe) {
    throw Error(fmt::format("lora.init_from {} was trained with {} but the recipe says {}={}: make them equal",
                            from_dir, adapter, key, recipe));
  };
  if (from.r != lcfg_.r) differ("lora.r", fmt::format("r={}", from.r), std::to_string(lcfg_.r));
  if (from.alpha != lcfg_.alpha) differ("lora.alpha", fmt::format("lora_alpha={}", from.alpha), fmt::format("{}", lcfg_.alpha));
  if (from.use_rslora != lcfg_.use_rslora)
    differ("lora.use_rslora", fmt::format("use_rslora={}", from.use_rslora), lcfg_.use_rslora ? "true" : "false");
  std::vector<std::string> adapted, wanted;
  for (model::Linear* l : m_.linears()) {
    if (l->adapted()) adapted.push_back(l->name);
    if (model::matches_target(l->name, lcfg_)) wanted.push_back(l->name);
    l->dropout = lcfg_.dropout;
  }
  if (adapted != wanted)
    differ("lora.target_modules", fmt::format("{} adapted layers (target_modules {})", adapted.size(),
                                              fmt::join(from.target_modules, ", ")),
           fmt::format("[{}] ({} layers)", fmt::join(lcfg_.target_modules, ", "), wanted.size()));
  if (from.dropout != lcfg_.dropout && lead_)
    info(fmt::format("lora.init_from {} was trained with lora_dropout={}; this run uses lora.dropout={}", from_dir,
                     from.dropout, lcfg_.dropout));
}

// The run, as the recipe describes it: resume if there is a state, then epochs of steps, each
// epoch ending with its checkpoint (per the policy) and a resumable state.
int Trainer::run() {
  std::optional<Progress> resumed;
  if (r_.checkpoint.resume == recipe::Resume::Auto)
    resumed = load_state(out_.string(), *opt_, params_, env_.rank, env_.world_size, cuda_, recipe::to_json(r_),
                         {r_.train.epochs, steps_per_epoch_});
  Progress p = resumed.value_or(Progress{});
  // Ranks must agree on where they stand (a state visible to only some ranks is an error).
  if (!ranks_agree(static_cast<double>(p.step)))
    throw Error(fmt::format("rank {} resumes at step {} but the ranks disagree: checkpoint.output_dir {} must be the same "
                            "directory (a shared filesystem) for every rank", env_.rank, p.step, out_.string()));
  step_ = p.step;
  if (lead_) begin(p, resumed.has_value());
  m_.training = true;
  for (int epoch = p.epoch; epoch < r_.train.epochs; ++epoch)
    if (const auto ended = run_epoch(epoch, epoch == p.epoch ? p.step_in_epoch : 0, p.run_id)) return *ended;
  return finish();
}

// Rank 0, before the first step: the resolved recipe, metrics.jsonl, what is about to run, the record.
void Trainer::begin(Progress& p, bool resumed) {
  fs::create_directories(out_);
  io::write_file_atomic((out_ / "recipe.yaml").string(), recipe::to_yaml(r_));
  open_metrics(resumed ? std::optional(p) : std::nullopt);
  info(fmt::format("{}; {} documents from {}, {} rank(s), {} steps per epoch, gradients all-reduced in {} "
                   "bucket(s)", model::trainable_summary(m_), docs_->size(), docs_->describe(), env_.world_size,
                   steps_per_epoch_, std::max<size_t>(1, sync_->buckets())));
  if (r_.lora.quantize_base) info(nf4_summary(m_));
  if (resumed) info(fmt::format("resuming at epoch {} step {} (step {} of {})", p.epoch, p.step_in_epoch, p.step, total_steps_));
  start_record(p, resumed);
}

// This rank's data source gave up: its steps go on empty, and at the step's end all ranks learn
// it and stop together (data_lost).
void Trainer::lose_data(const std::string& why) {
  data_error_ = why;
  log_error(fmt::format("rank {}: {}", env_.rank, why));
}

// One epoch from step `first`: its steps, then its checkpoint and the state the next one starts
// from. Returns the exit status when the run ends inside it (stopped, data lost).
std::optional<int> Trainer::run_epoch(int epoch, int64_t first, const std::string& run_id) {
  if (!ranks_agree(static_cast<double>(steps_per_epoch_ - first)))  // a mismatch would hang a collective
    throw Error(fmt::format("rank {} plans {} steps in epoch {} but the ranks disagree: every rank must see the same "
                            "documents and recipe", env_.rank, steps_per_epoch_ - first, epoch));
  std::optional<data::MicroBatches> batches;
  try {  // reads the first window: the data may already be gone
    batches.emplace(*docs_, *builder_,
                    data::ShardSpec{env_.world_size, env_.rank, static_cast<uint64_t>(r_.train.seed), epoch,
                                    r_.data.shuffle, &g_stop_requested},
                    data::BatchPlan{r_.data.batch_size, r_.train.gradient_accumulation_steps,
                                    r_.data.group_by_length ? r_.data.group_window : 1,
                                    static_cast<uint64_t>(r_.train.seed), epoch},
                    first);
  } catch (const data::DataUnavailable& e) {
    lose_data(e.what());
  }
  double epoch_tokens = 0;
  bool stop = false;
  for (int64_t s = first; s < steps_per_epoch_; ++s) {
    const StepResult res = step(batches ? &*batches : nullptr);
    if (res.data_failed) return data_lost({epoch, s, step_, run_id});
    stop = res.stop, epoch_tokens += res.tokens;
    ++step_, ++steps_this_process_;
    log_step(res, epoch, s);
    if (r_.dist.debug_checksum_every_n_steps && step_ % *r_.dist.debug_checksum_every_n_steps == 0) check_replicas();
    const bool last = s + 1 == steps_per_epoch_;
    const auto every = r_.checkpoint.state_every_n_steps;
    if (!last && (res.stop || (every && step_ % *every == 0))) save_state({epoch, s + 1, step_, run_id});
    if (!last && stop) return stopped();
  }
  if (tty_) std::fputs("\n", stdout);
  if (first == 0 && epoch_tokens == 0)
    throw Error(fmt::format("epoch {} trained on no token: every document of the selection was rejected ({} skipped: "
                            "bad, longer than data.max_length with data.overlong=skip, or with no trained token); fix "
                            "the data or the data.* keys (see the warnings above)", epoch, rejected_total_));
  save_checkpoint(epoch);
  if (epoch + 1 < r_.train.epochs) save_state({epoch + 1, 0, step_, run_id});
  if (stop && epoch + 1 < r_.train.epochs) return stopped();
  return std::nullopt;
}

// One optimizer step: `accum` micro-batches forward and backward; during the last backward the
// gradients are summed over ranks in buckets; then one small all-reduce of the step's figures
// (loss sum, token count, stop and data-failure flags, data wait, padding, skipped documents), so
// the gradient is normalised by the global number of trained tokens of the step. The host reads
// the device once, before the optimizer step: a non-finite loss or gradient norm, or a rank that
// lost its data, leaves the adapter as it was, on every rank alike.
StepResult Trainer::step(data::MicroBatches* batches) {
  const auto t0 = Clock::now();
  const auto waited = [&] { return batches ? batches->reader().wait_seconds() : 0.0; };
  const double wait0 = waited();
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(device_);
  at::Tensor loss_sum = at::zeros({}, f64.dtype(at::kFloat));
  int64_t tokens = 0, real = 0, slots = 0;
  rejected_here_ = 0;
  rng_at_step_start_ = rng_state(cuda_);  // a step given up for lost data must not move the streams
  for (int a = 0; a < r_.train.gradient_accumulation_steps; ++a) {
    if (a + 1 == r_.train.gradient_accumulation_steps) sync_->arm();
    const Batch b = collate(examples(batches), r_.data.packing, static_cast<size_t>(r_.data.max_length), device_);
    real += b.real, slots += b.slots;
    if (b.tokens == 0) continue;  // an empty micro-batch: GradBuckets::finish() still joins in
    const at::Tensor hidden = m_.hidden_states(b.ids, b.mask, nullptr, r_.data.packing);
    const model::LossSum l = model::lm_head_loss(hidden, m_.lm_head(), b.rows, b.targets);
    l.sum.backward();
    loss_sum += l.sum.detach();
    tokens += b.tokens;
  }
  const double busy = std::chrono::duration<double>(Clock::now() - t0).count();
  const double wait = busy > 0 ? (waited() - wait0) / busy : 0.0;
  sync_->finish();
  const at::Tensor host = at::tensor({0.0, double(tokens), g_stop_requested ? 1.0 : 0.0, wait, double(real),
                                      double(slots), double(rejected_here_), data_error_.empty() ? 0.0 : 1.0},
                                     at::kDouble);
  at::Tensor stats = host.to(device_, /*non_blocking=*/false);
  stats[0].add_(loss_sum);
  if (env_.world_size > 1) pg_.all_reduce_sum(stats);
  std::vector<at::Tensor> grads;
  for (at::Tensor& p : params_)
    if (p.grad().defined()) grads.push_back(p.mutable_grad());
  if (!grads.empty()) at::_foreach_div_(grads, stats[1].clamp_min(1.0));
  const at::Tensor grad_norm = grads.empty() ? at::zeros({}, f64)
                                             : at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2)), 2);
  const at::Tensor done = at::cat({stats, grad_norm.to(at::kDouble).view({1})}).cpu();
  const double* t = done.data_ptr<double>();
  StepResult res;
  res.tokens = t[1], res.rank_tokens = double(tokens), res.stop = t[2] > 0, res.data_wait = t[3] / env_.world_size;
  res.loss = res.tokens > 0 ? t[0] / res.tokens : 0.0;
  res.padding = t[5] > 0 ? 1.0 - t[4] / t[5] : 0.0;
  res.rejected = t[6], res.data_failed = t[7] > 0, res.grad_norm = t[8];
  rejected_total_ += res.rejected;
  res.lr = r_.train.lr * lr_factor(schedule_, step_, r_.train.warmup_steps, total_steps_);
  if (res.data_failed) {
    opt_->zero_grad();
    return res;
  }
  if (!std::isfinite(t[0]) || !std::isfinite(res.grad_norm))
    throw Error(fmt::format("training diverged at step {}: the loss is {} and the gradient norm {}; nothing of this "
                            "step was applied or saved. Lower train.lr (now {:g}), set train.max_grad_norm, or check "
                            "the data, then start over (checkpoint.resume=never)",
                            step_ + 1, res.loss, res.grad_norm, r_.train.lr));
  if (r_.train.max_grad_norm && !grads.empty())  // torch's clip_grad_norm_
    at::_foreach_mul_(grads, (*r_.train.max_grad_norm / (grad_norm + 1e-6)).clamp_max(1.0));
  for (auto& group : opt_->param_groups()) static_cast<torch::optim::AdamWOptions&>(group.options()).lr(res.lr);
  opt_->step();
  opt_->zero_grad();
  res.seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  return res;
}

// The next micro-batch's examples; rejected documents are counted (or fatal, per the recipe).
std::vector<data::Example> Trainer::examples(data::MicroBatches* batches) {
  std::vector<data::Example> out;
  if (!data_error_.empty() || !batches) return out;
  std::vector<data::Built> next;
  try {
    next = batches->next();
  } catch (const data::DataUnavailable& e) {
    lose_data(e.what());
    return out;
  }
  for (data::Built& built : next) {
    if (auto* e = std::get_if<data::Example>(&built)) {
      out.push_back(std::move(*e));
      continue;
    }
    const auto& why = std::get<data::Rejection>(built);
    if (r_.data.bad_documents == recipe::BadDocuments::Fail && why.kind == data::Rejection::BadDocument)
      throw Error(fmt::format("rank {}: bad document ({}) and data.bad_documents is fail: fix the document or set "
                              "data.bad_documents=skip", env_.rank, why.reason));
    ++rejected_here_;
    if (warned_++ < 3) warn(fmt::format("rank {}: skipping a document: {}", env_.rank, why.reason));
  }
  return out;
}

// Rank 0: a progress line on a TTY every step; every log_every_n_steps a line (log file, and the
// console when not a TTY) and a metrics.jsonl row. Other ranks: their own log file.
void Trainer::log_step(const StepResult& s, int epoch, int64_t s_in_epoch) {
  const double elapsed = std::chrono::duration<double>(Clock::now() - started_).count();
  const double eta = elapsed / static_cast<double>(steps_this_process_) * static_cast<double>(total_steps_ - step_);
  const std::string line =
      fmt::format("epoch {}/{} step {}/{} loss {:.4f} lr {:.3g} grad_norm {:.3f} tokens/s {:.0f} data_wait {:.0f}% "
                  "eta {}", epoch, r_.train.epochs, s_in_epoch + 1, steps_per_epoch_, s.loss, s.lr, s.grad_norm,
                  s.tokens / s.seconds, 100 * s.data_wait, clock_text(eta));
  if (tty_) {
    std::fputs(("\r\033[K" + line).c_str(), stdout);
    std::fflush(stdout);
  }
  if (step_ % r_.track.log_every_n_steps != 0) return;
  info(line, lead_ && !tty_);
  if (!lead_) return;
  const nlohmann::json row = {{"epoch", epoch}, {"step", step_}, {"loss", s.loss}, {"lr", s.lr},
                              {"grad_norm", s.grad_norm}, {"tokens", s.tokens}, {"tokens_per_s", s.tokens / s.seconds},
                              {"tokens_per_s_rank0", s.rank_tokens / s.seconds}, {"data_wait_share", s.data_wait},
                              {"padding_share", s.padding},
                              {"peak_rss_mb", peak_rss_mb()}, {"seconds", s.seconds}};
  metrics_ << row.dump() << "\n" << std::flush;
  if (record_) record_->metrics(row);
  last_row_ = row;
}

// track.mongodb: the run document in <track.database>.runs (continued when resuming).
void Trainer::start_record(Progress& p, bool resumed) {
  if (!r_.track.mongodb || r_.data.uri.empty() || r_.track.database.empty()) return;
  record_ = std::make_unique<track::RunRecorder>(r_.data.uri, r_.track.database, std::chrono::seconds(r_.data.timeout_s));
  const nlohmann::json run_info = {{"torch_version", TORCH_VERSION}, {"world_size", env_.world_size},
                                   {"device", cuda_ ? "cuda" : "cpu"}, {"data", docs_->describe()},
                                   {"documents", docs_->size()}, {"steps_per_epoch", steps_per_epoch_},
                                   {"output_dir", fs::absolute(out_).string()}};
  const std::optional<std::string> again = resumed && !p.run_id.empty() ? std::optional(p.run_id) : std::nullopt;
  p.run_id = record_->begin(recipe::to_json(r_), run_info, again);
  info(fmt::format("run recorded as {} (lora-train --from-run {} repeats it)", record_->ref(), record_->ref()));
}

void Trainer::record_failure(const std::string& error) {
  if (record_) record_->finish("failed", last_row_, error);
}

// Every rank learns whether rank 0's write worked, so a failed save stops all, never hangs.
void Trainer::all_agree(bool ok, const std::string& why, const std::string& what) {
  at::Tensor failed = at::full({1}, ok ? 0.0 : 1.0, at::TensorOptions().dtype(at::kFloat).device(device_));
  if (env_.world_size > 1) pg_.all_reduce_sum(failed);
  if (failed.item<double>() > 0)
    throw Error(lead_ ? fmt::format("writing {} failed: {}", what, why) : fmt::format("rank 0 could not write {}; stopping", what));
}

// No adapter with a NaN or an infinity is ever written (every rank checks its replica).
void Trainer::check_finite_adapter(const std::string& what) {
  std::vector<at::Tensor> each;
  for (const at::Tensor& p : params_) each.push_back(at::isfinite(p).all());
  const bool finite = each.empty() || at::stack(each).all().item<bool>();
  if (!ranks_agree(finite ? 1.0 : 0.0) || !finite)
    throw Error(fmt::format("the LoRA weights hold non-finite values at step {}: {} was not written. Lower train.lr "
                            "(now {:g}) or set train.max_grad_norm, then start over (checkpoint.resume=never)",
                            step_, what, r_.train.lr));
}

void Trainer::save_checkpoint(int epoch) {
  check_finite_adapter(fmt::format("epoch_{}", epoch));
  std::string why;
  if (lead_ && recipe::save_after_epoch(r_.checkpoint, epoch, r_.train.epochs)) {
    try {
      save_epoch(m_, lcfg_, out_ / fmt::format("epoch_{}", epoch));
      info(fmt::format("saved {}", (out_ / fmt::format("epoch_{}", epoch)).string()));
      if (record_) record_->checkpoint(epoch, (out_ / fmt::format("epoch_{}", epoch)).string());
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  all_agree(why.empty(), why, fmt::format("epoch_{}", epoch));
}

// Every rank's RNG goes to rank 0 (each in its own row of a sum), which writes the state.
void Trainer::save_state(const Progress& p) {
  check_finite_adapter("the resumable state");
  const at::Tensor mine = rng_state(cuda_);
  at::Tensor rngs = at::zeros({env_.world_size, mine.numel()}, at::TensorOptions().dtype(at::kFloat).device(device_));
  rngs[env_.rank].copy_(mine.to(at::kFloat));
  if (env_.world_size > 1) pg_.all_reduce_sum(rngs);
  std::string why;
  if (lead_) {
    try {
      train::save_state(out_.string(), m_, lcfg_, *opt_, params_, p, rngs.to(at::kCPU, at::kByte), recipe::to_json(r_));
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  all_agree(why.empty(), why, state_dir(out_.string()));
}

// Whether every rank holds the same `value`: each puts it in its own slot of a sum.
bool Trainer::ranks_agree(double value) {
  at::Tensor slots = at::zeros({env_.world_size}, at::TensorOptions().dtype(at::kDouble).device(device_));
  slots[env_.rank].fill_(value);
  if (env_.world_size > 1) pg_.all_reduce_sum(slots);
  return (slots.cpu() == value).all().item<bool>();
}

// Replicas must stay identical: every rank puts its parameter checksum in its own slot.
void Trainer::check_replicas() {
  double mine = 0;
  for (size_t i = 0; i < params_.size(); ++i) mine += params_[i].to(at::kDouble).sum().item<double>() * double(i + 1);
  if (!ranks_agree(mine))
    throw Error(fmt::format("rank {}'s LoRA parameters differ from another rank's at step {} (checksum {}): the "
                            "replicas diverged", env_.rank, step_, mine));
}

int Trainer::stopped() {
  if (lead_) info(fmt::format("stopped at step {} on request; the resumable state is in {}: run the same command to "
                              "resume", step_, state_dir(out_.string())));
  if (record_) record_->finish("interrupted", last_row_);
  pg_.barrier();
  return kExitStopped;
}

// Some rank's data source gave up (retries spent, or stopped while waiting to retry): every rank
// saves the state of the last completed step and stops as on SIGTERM, so a rerun continues.
int Trainer::data_lost(const Progress& p) {
  set_rng_state(rng_at_step_start_, cuda_);
  save_state(p);
  const std::string why = data_error_.empty() ? "another rank lost its data source (its log says why)" : data_error_;
  if (lead_ || !data_error_.empty())
    warn(fmt::format("rank {}: {}; the resumable state of step {} is in {}: run the same command to continue",
                     env_.rank, why, step_, state_dir(out_.string())));
  if (record_) record_->finish("interrupted", last_row_, why);
  pg_.barrier();
  return kExitStopped;
}

// metrics.jsonl: a resumed run keeps the rows of the steps it resumes after, so no step appears
// twice; a new run starts it afresh.
void Trainer::open_metrics(const std::optional<Progress>& resumed) {
  const fs::path path = out_ / "metrics.jsonl";
  if (resumed && fs::exists(path)) {
    std::string kept, line;
    std::ifstream in(path);
    while (std::getline(in, line)) {
      const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
      if (row.is_object() && row.value("step", int64_t{0}) <= resumed->step) kept += line + "\n";
    }
    io::write_file_atomic(path.string(), kept);
  }
  metrics_.open(path, resumed ? std::ios::app : std::ios::trunc);
}

int Trainer::finish() {
  if (lead_) {
    remove_unkept_epochs(out_, recipe::epochs_kept(r_.checkpoint, r_.train.epochs));
    if (!r_.checkpoint.keep_resume_state) remove_state(out_.string());
    if (rejected_total_ > 0)
      warn(fmt::format("{} documents were skipped on all ranks together (bad or overlong)", rejected_total_));
    char stamp[32];
    const std::time_t now = std::time(nullptr);
    std::strftime(stamp, sizeof stamp, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
    io::write_file_atomic(finished_marker(out_.string()),
                          nlohmann::json{{"status", "completed"}, {"run_id", record_ ? record_->ref() : ""},
                                         {"steps", step_}, {"finished", stamp},
                                         {"epochs_kept", recipe::epochs_kept(r_.checkpoint, r_.train.epochs)}}
                                  .dump(1));
    info(fmt::format("done: {} steps; adapters in {}", step_, out_.string()));
    if (record_) record_->finish("completed", last_row_);
  }
  pg_.barrier();
  return 0;
}

}  // namespace

int run_training(const recipe::Recipe& r, const dist::DistEnv& env) {
  install_stop_handlers();
  // Rank 0 holds the output directory for the run's life, before anything is written there.
  std::optional<OutputDirLock> lock;
  if (env.rank == 0) {
    lock.emplace(r.checkpoint.output_dir);
    claim_output_dir(r.checkpoint.output_dir, r.checkpoint.overwrite, r.checkpoint.resume == recipe::Resume::Auto);
  }
  log_to_file((fs::path(r.checkpoint.output_dir) / "logs" / fmt::format("rank_{}.log", env.rank)).string());
  info(fmt::format("rank {}/{} (local {}) on {}; lorarun {}, torch {}", env.rank, env.world_size, env.local_rank,
                   want_cuda(r) ? "cuda" : "cpu", LORARUN_VERSION, TORCH_VERSION), false);
  std::unique_ptr<Trainer> t;
  try {
    t = std::make_unique<Trainer>(r, env);
    return t->run();
  } catch (const std::exception& e) {
    log_error(e.what());
    if (t) t->record_failure(e.what());
    // Gloo reports a peer that died as an I/O error; the peer's own error is the one that matters.
    const std::string what = e.what();
    if (!dynamic_cast<const Error*>(&e) && what.find("gloo") != std::string::npos)
      throw PeerError(-1, fmt::format("rank {} lost its connection to another rank ({}): that rank stopped first, and "
                                      "its error says why", env.rank, what.substr(what.find(']') + 2)));
    throw;
  }
}

}  // namespace lorarun::train
