#include "train/trainer.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <malloc.h>
#include <sys/resource.h>
#include <torch/cuda.h>
#include <torch/optim/adamw.h>
#include <torch/version.h>
#include <unistd.h>
#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <random>

#include "data/batches.hpp"
#include "data/collate.hpp"
#include "data/mongo.hpp"
#include "data/source.hpp"
#include "dist/grad_buckets.hpp"
#include "dist/process_group.hpp"
#include "io/files.hpp"
#include "model/lora.hpp"
#include "model/loss.hpp"
#include "model/resolve.hpp"
#include "model/transformer.hpp"
#include "tokenizer/tokenizer.hpp"
#include "track/artifacts.hpp"
#include "track/mlflow.hpp"
#include "track/record.hpp"
#include "track/tensorboard.hpp"
#include "train/evaluate.hpp"
#include "train/output_dir.hpp"
#include "train/schedule.hpp"
#include "train/state.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/untrusted.hpp"

namespace lorarun::train {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// SIGTERM / SIGINT (preemption, Ctrl-C, the launcher tearing down): finish the step or the
// evaluation batch, save the resumable state on every rank's agreement, exit kExitStopped. Rank 0
// says so at once (write(2): all a signal handler may do), and again at each further signal.
std::atomic<bool> g_stop_requested{false};
bool g_say_stop = false;  // this process is rank 0

void request_stop(int sig) {
  const bool again = g_stop_requested.exchange(true);
  if (!g_say_stop) return;
  const char* first = sig == SIGINT ? "lora-train: SIGINT: stopping after this step or evaluation batch, with the "
                                      "resumable state saved\n"
                                    : "lora-train: SIGTERM: stopping after this step or evaluation batch, with the "
                                      "resumable state saved\n";
  const char* more = "lora-train: still stopping: saving the resumable state (SIGKILL ends it without saving)\n";
  const char* m = again ? more : first;
  (void)!write(STDERR_FILENO, m, std::strlen(m));
}

void install_stop_handlers(bool lead) {
  g_say_stop = lead;
  struct sigaction sa{};
  sa.sa_handler = request_stop;
  sa.sa_flags = SA_RESTART;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
}

double peak_rss_mb() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) / 1024.0;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / (1 << 20); }

// `dir` absolute, normalised, without a trailing '/': one spelling per directory (the record's
// output_dir is compared with other runs').
std::string absolute_dir(const fs::path& dir) {
  std::string s = fs::absolute(dir).lexically_normal().string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();
  return s;
}

std::string random_hex(int bytes) {
  std::random_device rd;
  std::string out;
  for (int i = 0; i < bytes; ++i) out += fmt::format("{:02x}", rd() & 0xFF);
  return out;
}

// Resident memory now (/proc/self/statm), in MiB; 0 where it cannot be read.
double rss_mb() {
  std::ifstream statm("/proc/self/statm");
  int64_t size = 0, resident = 0;
  if (!(statm >> size >> resident)) return 0;
  return mib(resident * static_cast<int64_t>(sysconf(_SC_PAGESIZE)));
}

// "base linears in NF4: 6815744 parameters in 3.4 MiB (0.5159 bytes each)" (whole, before sharding)
std::string nf4_summary(const model::CausalLM& m) {
  int64_t params = 0, bytes = 0;
  for (const model::Linear* l : m.linears()) {
    const std::optional<model::Nf4Weight>& q = l->sharded ? l->sharded->nf4 : l->nf4;
    if (!q) continue;
    params += q->numel();
    bytes += l->sharded ? l->sharded->whole_bytes() : q->bytes();
  }
  return fmt::format("base linears in NF4: {} parameters in {:.1f} MiB ({:.4f} bytes each)", params, mib(bytes),
                     static_cast<double>(bytes) / static_cast<double>(params));
}

std::string clock_text(double seconds) {
  const auto s = static_cast<int64_t>(seconds);
  if (s < 3600) return fmt::format("{}:{:02}", s / 60, s % 60);
  return fmt::format("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60);
}

// What one optimizer step did, summed over ranks where it says so.
struct StepResult {
  double loss = 0, lr = 0, grad_norm = 0, seconds = 0;
  double tokens = 0;         // trained tokens, all ranks
  double rank_tokens = 0;    // trained tokens, this rank
  double data_wait = 0;      // mean share of the step the ranks spent waiting for data
  double padding = 0;        // share of the row slots that held padding, all ranks
  double rejected = 0;       // documents skipped in this step, all ranks
  bool stop = false;         // some rank was asked to stop
  bool data_failed = false;  // some rank lost its data source: nothing of this step was applied
  bool taken_over = false;   // another process holds the run record's lease now: stop, writing nothing
};

// What this rank's micro-batches of one step added up to, before the ranks compare.
struct LocalSums {
  at::Tensor loss;     // float32 scalar on the device: summed token losses
  int64_t tokens = 0;  // trained tokens
  int64_t real = 0;    // document tokens
  int64_t slots = 0;   // row slots (padding included)
};

class Trainer {
 public:
  Trainer(const recipe::Recipe& r, const dist::DistEnv& env);
  int run();
  void record_failure(const std::string& error);

 private:
  model::CausalLM setup_model();
  void start_from_adapter(model::CausalLM& m);
  void setup_data();
  void setup_optimizer();
  void begin(Progress& p, bool resumed);
  std::optional<int> run_epoch(int epoch, int64_t first, const std::string& run_id, bool pending_eval);
  std::optional<data::MicroBatches> open_epoch(int epoch, int64_t first);
  StepResult step(data::MicroBatches* batches);
  LocalSums forward_backward(data::MicroBatches* batches);
  StepResult reduce(const LocalSums& sums, double data_wait, const std::vector<at::Tensor>& grads, at::Tensor& norm);
  std::vector<data::Example> examples(data::MicroBatches* batches);
  void lose_data(const std::string& why);
  void log_step(const StepResult& s, int epoch, int64_t s_in_epoch);
  bool evaluate(int epoch);
  bool any_rank(bool flag);
  void steer(int epoch, const nlohmann::json& eval_row);
  void to_tensorboard(const std::vector<track::Scalar>& values);
  void save_checkpoint(int epoch);
  void save_state(const Progress& p, bool store = true);
  void restore_from_store();
  void restore_run(const nlohmann::json& run);
  void restore_artifacts(const nlohmann::json& run, const std::string& id, Clock::time_point t0);
  void check_finite_adapter(const std::string& what);
  void open_metrics(const std::optional<Progress>& resumed);
  int data_lost(const Progress& p);
  void all_agree(bool ok, const std::string& why, const std::string& what, std::exception_ptr cause = nullptr);
  void check_replicas();
  bool ranks_agree(double value);
  void start_record(Progress& p, bool resumed);
  void store_artifact(const std::string& name, const std::string& dir);
  void store_final();
  int stopped(const std::optional<Progress>& save = std::nullopt);
  int finish();

  const recipe::Recipe& r_;
  const dist::DistEnv env_;
  const bool lead_;
  const bool cuda_;
  const bool tty_;
  const at::Device device_;
  const fs::path out_;
  dist::ProcessGroup pg_;
  const model::LoraConfig lcfg_;
  std::shared_ptr<model::BaseShards> shards_;  // with dist.shard_base (made by setup_model)
  model::CausalLM m_;
  tok::Tokenizer tokenizer_;
  std::unique_ptr<data::ExampleBuilder> builder_;
  std::unique_ptr<data::Documents> docs_;
  std::unique_ptr<data::EvalSplit> eval_;  // the evaluation documents; none when eval: is not set
  std::optional<double> last_eval_loss_;
  Steering steer_;                    // best eval loss so far, evaluations since it improved
  int epochs_ran_ = r_.train.epochs;  // the epochs the run ends with (fewer when it stops early)
  bool stopping_early_ = false;       // patience ran out: the current epoch is the last
  std::vector<at::Tensor> params_;
  std::unique_ptr<torch::optim::AdamW> opt_;
  std::unique_ptr<dist::GradBuckets> sync_;
  Schedule schedule_ = Schedule::Cosine;
  const int64_t examples_per_step_ = int64_t{r_.data.batch_size} * r_.train.gradient_accumulation_steps;
  int64_t steps_per_epoch_ = 0;
  int64_t total_steps_ = 0;
  int64_t step_ = 0;
  int64_t rejected_here_ = 0;     // documents this rank skipped in the current step
  double rejected_total_ = 0;     // documents all ranks skipped, this process's steps
  int warned_ = 0;                // skipped documents this rank has warned about
  at::Tensor rng_at_step_start_;  // this rank's generators before the current step
  std::string data_error_;        // why this rank's data source gave up (empty: it did not)
  std::ofstream metrics_;
  Clock::time_point started_ = Clock::now();
  int64_t steps_this_process_ = 0;
  std::unique_ptr<track::RunRecorder> record_;             // rank 0, when the run is recorded in MongoDB
  std::unique_ptr<track::ArtifactStore> store_;            // rank 0, checkpoint.store: mongodb
  bool store_unreachable_ = false;                         // an upload found the server gone
  std::unique_ptr<track::TensorBoardWriter> tensorboard_;  // rank 0, with track.tensorboard
  std::unique_ptr<track::MlflowRun> mlflow_;               // rank 0, with track.mlflow_uri
  nlohmann::json last_row_ = nlohmann::json::object();
  std::string run_ref_;  // "DB/ID" of the run record, or the untracked run's "local-…" id
};

// track.mlflow_uri: the run on the MLflow server, named after the output directory (by default the
// recipe file's name), its recipe as params; a resumed run continues the MLflow run it began.
std::unique_ptr<track::MlflowRun> start_mlflow(const recipe::Recipe& r, int world_size,
                                               const track::RunRecorder* record, bool resumed) {
  fs::path dir = fs::absolute(r.checkpoint.output_dir).lexically_normal();
  if (dir.filename().empty()) dir = dir.parent_path();  // "runs/a/"
  nlohmann::json tags = {{"lorarun.version", LORARUN_VERSION},
                         {"lorarun.torch_version", TORCH_VERSION},
                         {"lorarun.world_size", std::to_string(world_size)},
                         {"lorarun.output_dir", dir.string()}};
  if (record) tags["lorarun.run_record"] = record->ref();
  return std::make_unique<track::MlflowRun>(track::MlflowOptions{.uri = r.track.mlflow_uri,
                                                                 .experiment = r.track.mlflow_experiment,
                                                                 .run_name = dir.filename().string(),
                                                                 .params = recipe::to_json(r),
                                                                 .tags = tags,
                                                                 .id_file = (dir / "mlflow_run.json").string(),
                                                                 .resume = resumed});
}

// cuda:LOCAL_RANK. More ranks than GPUs share them round-robin, which Gloo allows (NCCL refuses
// two ranks on one GPU, so that is an error there).
at::Device pick_device(const recipe::Recipe& r, const dist::DistEnv& env, bool cuda) {
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

bool want_cuda(const recipe::Recipe& r) { return r.model.device != recipe::Device::Cpu && torch::cuda::is_available(); }

// The model, the tokenizer and the process group first: setup_data and setup_optimizer need them.
Trainer::Trainer(const recipe::Recipe& r, const dist::DistEnv& env)
    : r_(r),
      env_(env),
      lead_(env.rank == 0),
      cuda_(want_cuda(r)),
      tty_(lead_ && isatty(STDOUT_FILENO)),
      device_(pick_device(r, env, cuda_)),
      out_(r.checkpoint.output_dir),
      pg_(env, dist::backend_of(r.dist.backend, cuda_), std::chrono::seconds(r.dist.timeout_s)),
      lcfg_(model::lora_config_of(r.lora, r.model.path)),
      m_(setup_model()),
      tokenizer_(model::load_tokenizer(m_.dir())) {
  m_.check_tokenizer(tokenizer_);
  m_.check_length(r_.data.max_length, fmt::format("data.max_length {}", r_.data.max_length));
  setup_data();
  setup_optimizer();
}

// The base model (NF4 when lora.quantize_base) with its adapters: new, or lora.init_from's.
model::CausalLM Trainer::setup_model() {
  if (r_.dist.shard_base) {  // each block gathered from every rank's slices while it runs (one rank: the same path)
    shards_ = std::make_shared<model::BaseShards>();
    model::BaseShards* shards = shards_.get();
    shards->rank = env_.rank;
    shards->world = env_.world_size;
    shards->all_gather = [pg = &pg_](at::Tensor& out, const at::Tensor& in) -> std::function<void()> {
      auto pending = std::make_shared<dist::ProcessGroup::Pending>(pg->all_gather_async(out, in));
      return [pending] { pending->wait(); };
    };
    shards->prefetch = r_.dist.shard_base_prefetch;
  }
  model::CausalLM m = model::CausalLM::load(
      r_.model.path, model::dtype_of(r_.model.dtype), device_,
      {.quantize = r_.lora.quantize_base, .double_quant = r_.lora.double_quant, .shards = shards_});
  // Dropout draws from the default generators: one stream per rank, derived from train.seed,
  // so the same recipe on the same world size gives the same adapter bit for bit.
  at::manual_seed(static_cast<uint64_t>(r_.train.seed) * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(env_.rank) + 1);
  if (r_.lora.init_from.empty())
    model::attach_lora(m, lcfg_, static_cast<uint64_t>(r_.train.seed));  // same seed: identical replicas
  else
    start_from_adapter(m);
  m.recompute_activations = r_.train.activation_checkpointing;
  // The whole tensors loading went through (dequantised, quantised, sliced) are free now; give
  // their pages back, or the heap they fragmented stays resident for the whole run.
  malloc_trim(0);
  return m;
}

// This rank's documents (connecting within data.timeout_s) and the steps they make.
void Trainer::setup_data() {
  builder_ = std::make_unique<data::ExampleBuilder>(r_.data, tokenizer_);
  docs_ = std::make_unique<data::Documents>(r_.data, data::Holdout::training(r_.eval.fraction));
  // Read and built as training data is (the same builder); never a document training reads.
  if (r_.eval.enabled(r_.data.source)) {
    eval_ = std::make_unique<data::EvalSplit>(r_, docs_.get());
    require_scored_token(eval_->docs(), *builder_, eval_->describe());
  }
  const int64_t per_rank = data::examples_per_rank(docs_->size(), env_.world_size);
  steps_per_epoch_ = (per_rank + examples_per_step_ - 1) / examples_per_step_;
  if (r_.train.max_steps_per_epoch)
    steps_per_epoch_ = std::min<int64_t>(steps_per_epoch_, *r_.train.max_steps_per_epoch);
  total_steps_ = steps_per_epoch_ * r_.train.epochs;
}

// AdamW over the LoRA parameters, their gradient buckets, and the lr schedule.
void Trainer::setup_optimizer() {
  params_ = model::lora_parameters(m_);
  sync_ = std::make_unique<dist::GradBuckets>(pg_, params_, static_cast<int64_t>(r_.dist.bucket_mb * (1 << 20) / 4));
  opt_ = std::make_unique<torch::optim::AdamW>(
      params_, torch::optim::AdamWOptions(r_.train.lr).weight_decay(r_.train.weight_decay));
  schedule_ = schedule_of(r_.train.lr_scheduler);
}

// lora.init_from: the adapter's weights, under the recipe's LoRA keys. Keys that change what the
// weights compute (r, alpha, use_rslora, the adapted layers) must agree, or the saved
// adapter_config.json would describe other weights; dropout is the recipe's to choose.
void Trainer::start_from_adapter(model::CausalLM& m) {
  const std::string& from_dir = r_.lora.init_from;
  const model::LoraConfig from = model::load_adapter(m, from_dir);
  auto differ = [&](const std::string& key, const std::string& adapter, const std::string& recipe) {
    throw Error(fmt::format("lora.init_from {} was trained with {} but the recipe says {}={}: make them equal",
                            from_dir, adapter, key, recipe));
  };
  if (from.r != lcfg_.r) differ("lora.r", fmt::format("r={}", from.r), std::to_string(lcfg_.r));
  if (from.alpha != lcfg_.alpha)
    differ("lora.alpha", fmt::format("lora_alpha={}", from.alpha), fmt::format("{}", lcfg_.alpha));
  if (from.use_rslora != lcfg_.use_rslora)
    differ("lora.use_rslora", fmt::format("use_rslora={}", from.use_rslora), lcfg_.use_rslora ? "true" : "false");
  std::vector<std::string> adapted;
  std::vector<std::string> wanted;
  for (model::Linear* l : m.linears()) {
    if (l->adapted()) adapted.push_back(l->name);
    if (model::matches_target(l->name, lcfg_)) wanted.push_back(l->name);
    l->dropout = lcfg_.dropout;
  }
  if (adapted != wanted)
    differ("lora.target_modules",
           fmt::format("{} adapted layers (target_modules {})", adapted.size(), fmt::join(from.target_modules, ", ")),
           fmt::format("[{}] ({} layers)", fmt::join(lcfg_.target_modules, ", "), wanted.size()));
  if (from.dropout != lcfg_.dropout && lead_)
    info(fmt::format("lora.init_from {} was trained with lora_dropout={}; this run uses lora.dropout={}", from_dir,
                     from.dropout, lcfg_.dropout));
}

// The run, as the recipe describes it: resume if there is a state, then epochs of steps, each
// epoch ending with its checkpoint (per the policy) and a resumable state.
int Trainer::run() {
  std::optional<Progress> resumed;
  restore_from_store();
  if (r_.checkpoint.resume == recipe::Resume::Auto)
    resumed = load_state(out_.string(), *opt_, params_, env_.rank, env_.world_size, cuda_, recipe::to_json(r_),
                         {r_.train.epochs, steps_per_epoch_, docs_->identity()});
  Progress p = resumed.value_or(Progress{});
  steer_ = p.steering;
  // Ranks must agree on where they stand (a state visible to only some ranks is an error).
  if (!ranks_agree(static_cast<double>(p.step)))
    throw Error(
        fmt::format("rank {} resumes at step {} but the ranks disagree: checkpoint.output_dir {} must be the same "
                    "directory (a shared filesystem) for every rank",
                    env_.rank, p.step, out_.string()));
  step_ = p.step;
  if (lead_) begin(p, resumed.has_value());
  m_.training = true;
  for (int epoch = p.epoch; epoch < epochs_ran_; ++epoch) {
    const bool first = epoch == p.epoch;
    if (const auto ended = run_epoch(epoch, first ? p.step_in_epoch : 0, p.run_id, first && p.pending_eval))
      return *ended;
  }
  return finish();
}

// Rank 0, before the first step: the record (first: a live run's record or output directory
// refuses this one before anything is written), the resolved recipe, metrics.jsonl, what is
// about to run.
void Trainer::begin(Progress& p, bool resumed) {
  start_record(p, resumed);
  fs::create_directories(out_);
  io::write_file_atomic((out_ / "recipe.yaml").string(), recipe::to_yaml(r_));
  open_metrics(resumed ? std::optional(p) : std::nullopt);
  if (r_.track.tensorboard) {  // earlier events files go as metrics.jsonl's rows go
    const std::string dir = (out_ / "tensorboard").string();
    tensorboard_ = std::make_unique<track::TensorBoardWriter>(dir, resumed ? std::optional(p.step) : std::nullopt);
    info(fmt::format("TensorBoard events in {} (tensorboard --logdir {})", tensorboard_->path(), dir));
  }
  info(
      fmt::format("{}; {} documents from {}, {} rank(s), {} steps per epoch, gradients all-reduced in {} "
                  "bucket(s)",
                  model::trainable_summary(m_), docs_->size(), docs_->describe(), env_.world_size, steps_per_epoch_,
                  std::max<size_t>(1, sync_->buckets())));
  if (r_.lora.quantize_base) info(nf4_summary(m_));
  if (shards_) {
    info(fmt::format(
        "dist.shard_base: base weights on this rank {:.1f} MiB of {:.1f} MiB (linears in {} slice(s); embeddings, "
        "norms and the output projection whole), and at most {:.1f} MiB of blocks gathered whole ({}); resident "
        "{:.0f} MiB",
        mib(m_.base_bytes()), mib(m_.base_bytes(true)), env_.world_size, mib(shards_->block_buffer_bytes()),
        shards_->prefetch ? "2 at a time: the next is gathered while one computes" : "1 at a time", rss_mb()));
  }
  if (eval_)
    info(fmt::format("evaluating on {} documents from {}{} at each epoch end{}", eval_->docs().size(),
                     eval_->docs().describe(),
                     r_.eval.fraction > 0 ? fmt::format(" (eval.fraction {})", r_.eval.fraction) : "",
                     r_.eval.every_n_steps ? fmt::format(" and every {} steps", *r_.eval.every_n_steps) : ""));
  if (r_.checkpoint.keep_best && !resumed) io::remove_tree((out_ / "best").string());  // an older run's
  if (resumed)
    info(fmt::format("resuming at epoch {} step {} (step {} of {})", p.epoch, p.step_in_epoch, p.step, total_steps_));
  if (record_)
    info(fmt::format("run recorded as {} (lora-train --from-run {} repeats it)", record_->ref(), record_->ref()));
  if (!r_.track.mlflow_uri.empty()) mlflow_ = start_mlflow(r_, env_.world_size, record_.get(), resumed);
}

// This rank's data source gave up: its steps go on empty, and at the step's end all ranks learn
// it and stop together (data_lost).
void Trainer::lose_data(const std::string& why) {
  data_error_ = why;
  log_error(fmt::format("rank {}: {}", env_.rank, why));
}

// One epoch from step `first`: its steps, then its checkpoint and the state the next one starts
// from. Returns the exit status when the run ends inside it (stopped, data lost). `pending_eval`:
// the evaluation due after step `first` was stopped before it ended; it is done first.
std::optional<int> Trainer::run_epoch(int epoch, int64_t first, const std::string& run_id, bool pending_eval) {
  if (!ranks_agree(static_cast<double>(steps_per_epoch_ - first)))  // a mismatch would hang a collective
    throw Error(
        fmt::format("rank {} plans {} steps in epoch {} but the ranks disagree: every rank must see the same "
                    "documents and recipe",
                    env_.rank, steps_per_epoch_ - first, epoch));
  if (pending_eval && first < steps_per_epoch_ && !evaluate(epoch))
    return stopped(Progress{epoch, first, step_, run_id, steer_, true});
  std::optional<data::MicroBatches> batches;
  if (first < steps_per_epoch_) batches = open_epoch(epoch, first);
  double epoch_tokens = 0;
  bool stop = false;
  for (int64_t s = first; s < steps_per_epoch_ && !stopping_early_; ++s) {
    const StepResult res = step(batches ? &*batches : nullptr);
    if (res.data_failed) return data_lost({epoch, s, step_, run_id, steer_});
    stop = res.stop;
    epoch_tokens += res.tokens;
    ++step_;
    ++steps_this_process_;
    log_step(res, epoch, s);
    if (r_.dist.debug_checksum_every_n_steps && step_ % *r_.dist.debug_checksum_every_n_steps == 0) check_replicas();
    const bool last = s + 1 == steps_per_epoch_;
    if (eval_ && !last && r_.eval.every_n_steps && step_ % *r_.eval.every_n_steps == 0) {
      if (!evaluate(epoch)) return stopped(Progress{epoch, s + 1, step_, run_id, steer_, true});
      if (stopping_early_) break;  // this epoch, cut short, is the run's last
    }
    const auto every = r_.checkpoint.state_every_n_steps;
    if (!last && stop) return stopped(Progress{epoch, s + 1, step_, run_id, steer_});
    if (!last && every && step_ % *every == 0) save_state({epoch, s + 1, step_, run_id, steer_});
  }
  if (tty_) std::fputs("\n", stdout);
  if (first == 0 && epoch_tokens == 0)
    throw Error(
        fmt::format("epoch {} trained on no token: every document of the selection was rejected ({} skipped: "
                    "bad, longer than data.max_length with data.overlong=skip, or with no trained token); fix "
                    "the data or the data.* keys (see the warnings above)",
                    epoch, rejected_total_));
  // (a step's evaluation that stopped the run early is the last; one stopped by a signal is redone
  // when the run resumes, at the end of this epoch's steps)
  if (eval_ && !stopping_early_ && !evaluate(epoch))
    return stopped(Progress{epoch, steps_per_epoch_, step_, run_id, steer_, true});
  save_checkpoint(epoch);
  if (epoch + 1 < epochs_ran_) save_state({epoch + 1, 0, step_, run_id, steer_});
  if (stop && epoch + 1 < epochs_ran_) return stopped();
  return std::nullopt;
}

// This rank's batches of `epoch` from step `first`; none when the data is already gone (the
// steps then go on empty and the ranks stop together at the step's end).
std::optional<data::MicroBatches> Trainer::open_epoch(int epoch, int64_t first) {
  const auto seed = static_cast<uint64_t>(r_.train.seed);
  try {  // reads the first window
    return std::optional<data::MicroBatches>(
        std::in_place, *docs_, *builder_,
        data::ShardSpec{env_.world_size, env_.rank, seed, epoch, r_.data.shuffle, &g_stop_requested},
        data::BatchPlan{r_.data.batch_size, r_.train.gradient_accumulation_steps,
                        r_.data.group_by_length ? r_.data.group_window : 1, seed, epoch},
        first);
  } catch (const data::DataUnavailable& e) {
    lose_data(e.what());
    return std::nullopt;
  }
}

// One optimizer step: `accum` micro-batches forward and backward (the last backward sums the
// gradients over ranks in buckets), then one small all-reduce of the step's figures, so the
// gradient is normalised by the global number of trained tokens. The host reads the device once,
// before the optimizer step: a non-finite loss or gradient norm, or a rank that lost its data,
// leaves the adapter as it was, on every rank alike.
StepResult Trainer::step(data::MicroBatches* batches) {
  const auto t0 = Clock::now();
  const auto waited = [&] { return batches ? batches->reader().wait_seconds() : 0.0; };
  const double wait0 = waited();
  rejected_here_ = 0;
  rng_at_step_start_ = rng_state(cuda_);  // a step given up for lost data must not move the streams
  const LocalSums sums = forward_backward(batches);
  const double busy = std::chrono::duration<double>(Clock::now() - t0).count();
  sync_->finish();
  std::vector<at::Tensor> grads;
  for (at::Tensor& p : params_)
    if (p.grad().defined()) grads.push_back(p.mutable_grad());
  at::Tensor grad_norm;
  StepResult res = reduce(sums, busy > 0 ? (waited() - wait0) / busy : 0.0, grads, grad_norm);
  if (res.taken_over) {
    if (!lead_) throw PeerError(0, fmt::format("rank 0 lost the run record to another process; stopping"));
    throw Error(fmt::format("{}: this process stops without writing anything more (a run record has one live run)",
                            *record_->lost_lease()));
  }
  if (res.data_failed) {
    opt_->zero_grad();
    return res;
  }
  if (!std::isfinite(res.loss) || !std::isfinite(res.grad_norm))
    throw Error(
        fmt::format("training diverged at step {}: the loss is {} and the gradient norm {}; nothing of this "
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

// The step's micro-batches through the model and back; the gradients accumulate in .grad.
LocalSums Trainer::forward_backward(data::MicroBatches* batches) {
  LocalSums sums;
  sums.loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
  for (int a = 0; a < r_.train.gradient_accumulation_steps; ++a) {
    if (a + 1 == r_.train.gradient_accumulation_steps) sync_->arm();
    const data::Batch b =
        data::collate(examples(batches), r_.data.packing, static_cast<size_t>(r_.data.max_length), device_);
    sums.real += b.real;
    sums.slots += b.slots;
    if (b.tokens == 0) {                             // an empty micro-batch: GradBuckets::finish() still joins in
      if (m_.base_sharded() && env_.world_size > 1)  // and the other ranks' gathers, with zero gradients
        m_.idle_pass(true, r_.data.packing);
      continue;
    }
    const at::Tensor hidden = m_.hidden_states(b.ids, b.mask, nullptr, r_.data.packing);
    const model::LossSum l = model::lm_head_loss(hidden, m_.lm_head(), b.rows, b.targets, m_.config().logit_softcap);
    l.sum.backward();
    sums.loss += l.sum.detach();
    sums.tokens += b.tokens;
  }
  return sums;
}

// The step's figures summed over ranks (loss, tokens, stop and data-failure flags, data wait,
// padding, skipped documents); the gradients divided by the global token count, and their norm.
StepResult Trainer::reduce(const LocalSums& sums, double data_wait, const std::vector<at::Tensor>& grads,
                           at::Tensor& norm) {
  const bool taken_over = record_ && record_->lost_lease();
  const at::Tensor host =
      at::tensor({0.0, double(sums.tokens), g_stop_requested ? 1.0 : 0.0, data_wait, double(sums.real),
                  double(sums.slots), double(rejected_here_), data_error_.empty() ? 0.0 : 1.0, taken_over ? 1.0 : 0.0},
                 at::kDouble);
  at::Tensor stats = host.to(device_, /*non_blocking=*/false);
  stats[0].add_(sums.loss);
  if (env_.world_size > 1) pg_.all_reduce_sum(stats);
  if (!grads.empty()) at::_foreach_div_(grads, stats[1].clamp_min(1.0));
  norm = grads.empty() ? at::zeros({}, stats.options())
                       : at::linalg_vector_norm(at::stack(at::_foreach_norm(grads, 2)), 2);
  const at::Tensor done = at::cat({stats, norm.to(at::kDouble).view({1})}).cpu();
  const double* t = done.data_ptr<double>();
  StepResult res;
  res.tokens = t[1];
  res.rank_tokens = double(sums.tokens);
  res.stop = t[2] > 0;
  res.data_wait = t[3] / env_.world_size;
  res.loss = t[0] / std::max(res.tokens, 1.0);  // 0 without tokens, unless non-finite
  res.padding = t[5] > 0 ? 1.0 - t[4] / t[5] : 0.0;
  res.rejected = t[6];
  res.data_failed = t[7] > 0;
  res.taken_over = t[8] > 0;
  res.grad_norm = t[9];
  rejected_total_ += res.rejected;
  res.lr = r_.train.lr * lr_factor(schedule_, step_, r_.train.warmup_steps, total_steps_);
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
      throw Error(
          fmt::format("rank {}: bad document {}({}) and data.bad_documents is fail: fix the document or set "
                      "data.bad_documents=skip",
                      env_.rank, why.document.empty() ? "" : why.document + " ", why.reason));
    ++rejected_here_;
    if (warned_++ < 3)
      warn(fmt::format("rank {}: skipping {}: {}", env_.rank,
                       why.document.empty() ? "a document" : "document " + why.document, why.reason));
  }
  return out;
}

// Rank 0: a progress line on a TTY every step; every log_every_n_steps a line (log file, and the
// console when not a TTY) and a metrics.jsonl row. Other ranks: their own log file.
void Trainer::log_step(const StepResult& s, int epoch, int64_t s_in_epoch) {
  const double elapsed = std::chrono::duration<double>(Clock::now() - started_).count();
  const double eta = elapsed / static_cast<double>(steps_this_process_) * static_cast<double>(total_steps_ - step_);
  const std::string line = fmt::format(
      "epoch {}/{} step {}/{} loss {:.4f} lr {:.3g} grad_norm {:.3f} tokens/s {:.0f} data_wait {:.0f}% "
      "eta {}",
      epoch, r_.train.epochs, s_in_epoch + 1, steps_per_epoch_, s.loss, s.lr, s.grad_norm, s.tokens / s.seconds,
      100 * s.data_wait, clock_text(eta));
  const std::string shown = last_eval_loss_ ? fmt::format("{} eval_loss {:.4f}", line, *last_eval_loss_) : line;
  if (tty_) {
    std::fputs(("\r\033[K" + shown).c_str(), stdout);
    std::fflush(stdout);
  }
  if (step_ % r_.track.log_every_n_steps != 0) return;
  info(shown, lead_ && !tty_);
  if (!lead_) return;
  nlohmann::json row = {{"epoch", epoch},
                        {"step", step_},
                        {"loss", s.loss},
                        {"lr", s.lr},
                        {"grad_norm", s.grad_norm},
                        {"tokens", s.tokens},
                        {"tokens_per_s", s.tokens / s.seconds},
                        {"tokens_per_s_rank0", s.rank_tokens / s.seconds},
                        {"data_wait_share", s.data_wait},
                        {"padding_share", s.padding},
                        {"peak_rss_mb", peak_rss_mb()},
                        {"rss_mb", rss_mb()},
                        {"seconds", s.seconds}};
  if (shards_) row["base_mb"] = mib(m_.base_bytes() + shards_->buffer_bytes());  // slices + whole blocks now
  metrics_ << row.dump() << "\n" << std::flush;
  if (record_) record_->metrics(row);
  to_tensorboard({{"train/loss", s.loss},
                  {"train/lr", s.lr},
                  {"train/grad_norm", s.grad_norm},
                  {"train/tokens_per_s", s.tokens / s.seconds}});
  if (mlflow_) mlflow_->metrics(step_, row, {"loss", "lr", "grad_norm", "tokens_per_s"});
  last_row_ = row;
}

// The loss over the evaluation documents, the model as it is now: each rank evaluates its share
// (eval_shard) and the ranks sum (loss, tokens, …) in float64, so every rank holds the same
// token-weighted mean and steers alike. Rank 0 logs it (metrics.jsonl, the run record).
//
// A stop request (SIGTERM/SIGINT) is honoured between two evaluation batches, the ranks agreeing
// before each: the partial evaluation is dropped (nothing logged or steered) and false returned;
// the state then saved says the evaluation is due, and a resumed run does it first.
bool Trainer::evaluate(int epoch) {
  const auto t0 = Clock::now();
  const EvalSums mine = eval_shard(m_, eval_->docs(), *builder_, r_, env_.rank, env_.world_size, device_, {},
                                   [this] { return any_rank(g_stop_requested); });
  if (mine.stopped) {
    if (lead_)
      info(fmt::format("evaluation at step {} stopped on request: it is done again when the run resumes", step_));
    return false;
  }
  at::Tensor sums =
      at::tensor({mine.loss, double(mine.tokens), double(mine.documents), double(mine.rejected)}, at::kDouble)
          .to(device_);
  if (env_.world_size > 1) pg_.all_reduce_sum(sums);
  sums = sums.cpu();
  const double* t = sums.data_ptr<double>();
  const auto tokens = static_cast<int64_t>(t[1]), documents = static_cast<int64_t>(t[2]),
             rejected = static_cast<int64_t>(t[3]);
  if (tokens == 0)
    throw Error(
        fmt::format("the evaluation documents ({}) hold no trained token: {} of {} were rejected (bad, or longer "
                    "than data.max_length with data.overlong=skip); fix the eval: selection",
                    eval_->describe(), rejected, eval_->docs().size()));
  const double mean = t[0] / t[1];
  last_eval_loss_ = mean;
  const double seconds = std::chrono::duration<double>(Clock::now() - t0).count();
  nlohmann::json row = {{"epoch", epoch},
                        {"step", step_},
                        {"eval_loss", mean},
                        {"eval_ppl", std::exp(mean)},
                        {"eval_tokens", tokens},
                        {"eval_documents", documents},
                        {"eval_rejected", rejected},
                        {"eval_seconds", seconds}};
  if (lead_) {
    if (tty_) std::fputs("\n", stdout);
    info(fmt::format(
        "eval at epoch {} step {}: eval_loss {:.6f} eval_ppl {:.4f} over {} tokens of {} documents ({:.1f} s)", epoch,
        step_, mean, std::exp(mean), tokens, documents, seconds));
  }
  steer(epoch, row);
  if (!lead_) return true;
  row["best_eval_loss"] = *steer_.best_loss;
  metrics_ << row.dump() << "\n" << std::flush;
  if (record_) record_->metrics(row);
  to_tensorboard({{"eval/loss", mean}, {"eval/ppl", std::exp(mean)}});
  if (mlflow_) mlflow_->metrics(step_, row, {"eval_loss", "eval_ppl"});
  for (const char* k : {"eval_loss", "eval_ppl", "eval_tokens", "best_eval_loss"}) last_row_[k] = row[k];
  return true;
}

// Whether `flag` is set on any rank (a collective).
bool Trainer::any_rank(bool flag) {
  if (env_.world_size == 1) return flag;
  at::Tensor t = at::full({1}, flag ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat).device(device_));
  pg_.all_reduce_sum(t);
  return t.item<float>() > 0;
}

// After an evaluation (the same figures on every rank): best/ when the loss is the lowest so far
// (checkpoint.keep_best), and the end of the run when train.early_stopping_patience evaluations
// in a row did not lower the best loss by more than train.early_stopping_min_delta.
void Trainer::steer(int epoch, const nlohmann::json& eval_row) {
  const double loss = eval_row["eval_loss"].get<double>();
  const std::optional<double> before = steer_.best_loss;
  steer_.evals_since_best =
      !before || loss < *before - r_.train.early_stopping_min_delta ? 0 : steer_.evals_since_best + 1;
  if (!before || loss < *before) {
    steer_.best_loss = loss;
    steer_.best_step = step_;
    if (r_.checkpoint.keep_best) {
      check_finite_adapter("best/");
      std::string why;
      if (lead_) {
        try {
          nlohmann::json about = eval_row;
          about["best"] = "the lowest eval_loss so far";
          const std::string dir = train::save_best(out_.string(), m_, lcfg_, about);
          info(fmt::format("saved {} (eval_loss {:.6f} at step {})", dir, loss, step_));
          store_artifact("best", dir);
        } catch (const std::exception& e) {
          why = e.what();
        }
      }
      all_agree(why.empty(), why, "writing best/");
    }
  }
  const std::optional<int> patience = r_.train.early_stopping_patience;
  if (!patience || steer_.evals_since_best < *patience || step_ >= total_steps_) return;  // (the end anyway)
  stopping_early_ = true;
  epochs_ran_ = epoch + 1;
  if (lead_)
    info(fmt::format(
        "early stopping after step {} (epoch {}): {} evaluations without lowering the best eval_loss "
        "{:.6f} (step {}) by more than {:g}",
        step_, epoch, steer_.evals_since_best, *steer_.best_loss, steer_.best_step, r_.train.early_stopping_min_delta));
}

// track.tensorboard: `values` at the current step. A failed write warns and ends the events file,
// never the run (as a failed record write).
void Trainer::to_tensorboard(const std::vector<track::Scalar>& values) {
  if (!tensorboard_) return;
  try {
    tensorboard_->scalars(step_, values);
  } catch (const Error& e) {
    warn(fmt::format("{}; TensorBoard events are no longer written for this run", e.what()));
    tensorboard_.reset();
  }
}

// track.mongodb: the run document in <track.database>.runs (continued when resuming).
// Without one, the run still has an id (run.json, the resumable state): "local-" and 24 hex digits.
void Trainer::start_record(Progress& p, bool resumed) {
  if (!r_.track.mongodb || r_.data.uri.empty() || r_.track.database.empty()) {
    if (!p.run_id.starts_with("local-")) p.run_id = fmt::format("local-{}", random_hex(12));
    run_ref_ = p.run_id;
    return;
  }
  record_ =
      std::make_unique<track::RunRecorder>(r_.data.uri, r_.track.database, std::chrono::seconds(r_.data.timeout_s));
  const nlohmann::json run_info = {
      {"torch_version", TORCH_VERSION},      {"world_size", env_.world_size},
      {"device", cuda_ ? "cuda" : "cpu"},    {"data", docs_->describe()},
      {"documents", docs_->size()},          {"eval_documents", eval_ ? eval_->docs().size() : 0},
      {"steps_per_epoch", steps_per_epoch_}, {"output_dir", absolute_dir(out_)}};
  const std::optional<std::string> again = resumed && is_run_id(p.run_id) ? std::optional(p.run_id) : std::nullopt;
  p.run_id = record_->begin(recipe::to_json(r_), run_info, again);
  run_ref_ = record_->ref();
  if (r_.checkpoint.store == recipe::Store::MongoDB) {
    store_ =
        std::make_unique<track::ArtifactStore>(r_.data.uri, r_.track.database, std::chrono::seconds(r_.data.timeout_s));
    store_->prepare();
  }
}

// checkpoint.store: mongodb with checkpoint.resume: auto: an output_dir without a resumable state
// (a new node, a wiped disk) gets back, before any rank looks for one, the state of the newest
// unfinished run of this very recipe that stored one, with that run's stored adapters.
void Trainer::restore_from_store() {
  if (r_.checkpoint.store != recipe::Store::MongoDB || r_.checkpoint.resume != recipe::Resume::Auto) return;
  const std::string state = state_dir(out_.string());
  std::string why;
  std::exception_ptr refused;  // a live run's: the same command cannot change it
  if (lead_ && !fs::exists(state) && !fs::exists(state + ".old")) {
    try {
      const auto timeout = std::chrono::seconds(r_.data.timeout_s);
      const std::optional<nlohmann::json> run =
          track::find_resumable_run(r_.data.uri, r_.track.database, recipe::to_json(r_), timeout);
      if (run) restore_run(*run);
    } catch (const ConfigError& e) {
      why = e.what();
      refused = std::current_exception();
    } catch (const std::exception& e) {
      why = fmt::format(
          "{} (checkpoint.store: mongodb; run again once the server is reachable, or set "
          "checkpoint.resume=never to start over)",
          e.what());
    }
  }
  all_agree(why.empty(), why, "restoring the resumable state from the database", refused);
}

// Rank 0: the artifacts the record of `run` lists (each name checked before it touches a path),
// not whatever GridFS holds; the state last, so a restore cut short leaves no state and is done
// again. Each is written under a temporary name and renamed when whole.
void Trainer::restore_run(const nlohmann::json& run) {
  const auto t0 = Clock::now();
  const std::string id = run["_id"].value("$oid", "");
  try {
    restore_artifacts(run, id, t0);
  } catch (const ConfigError& e) {  // a record lora-train did not write so: the same command refuses it again
    throw ConfigError(
        fmt::format("restoring run {}/{} from the database: {} (lora-runs rm {}/{} removes it; or set "
                    "checkpoint.resume=never to start over)",
                    r_.track.database, id, e.what(), r_.track.database, id));
  }
}

void Trainer::restore_artifacts(const nlohmann::json& run, const std::string& id, Clock::time_point t0) {
  track::ArtifactStore store(r_.data.uri, r_.track.database, std::chrono::seconds(r_.data.timeout_s));
  std::vector<std::string> artifacts;
  for (const std::string& a : track::recorded_artifacts(run))
    if (a != "resume_state") artifacts.push_back(a);
  artifacts.push_back("resume_state");
  std::vector<std::string> restored;
  int64_t bytes = 0;
  for (const std::string& a : artifacts) {
    const fs::path dir = out_ / a;
    if (fs::exists(dir)) continue;  // what the output directory still has is its own
    const std::vector<track::ArtifactFile> files = track::recorded_files(run, a);
    store.download(id, a, files, dir.string());
    for (const track::ArtifactFile& f : files) bytes += f.bytes;
    restored.push_back(a);
  }
  io::sync_dir(out_.string());
  info(fmt::format("restored {} of run {}/{} from GridFS into {} ({:.2f} MB in {:.2f} s)", fmt::join(restored, ", "),
                   r_.track.database, id, out_.string(), static_cast<double>(bytes) / 1e6,
                   std::chrono::duration<double>(Clock::now() - t0).count()));
}

// checkpoint.store: mongodb (rank 0): the directory `dir`, just written, as the run's artifact
// `name` in GridFS and in the run record; until both hold it, the save has not happened.
void Trainer::store_artifact(const std::string& name, const std::string& dir) {
  if (!store_) return;
  try {
    const std::vector<track::ArtifactFile> files = store_->upload(record_->id(), name, dir);
    record_->artifact(name, files);
    const track::UploadStats& s = store_->last_upload();
    info(fmt::format("stored {} in GridFS: {} files, {:.2f} MB in {:.2f} s ({:.1f} MB/s)", name, files.size(),
                     static_cast<double>(s.bytes) / 1e6, s.seconds,
                     s.seconds > 0 ? static_cast<double>(s.bytes) / 1e6 / s.seconds : 0.0));
  } catch (const std::exception& e) {
    // the record's own last write would only wait for a server that is gone again
    if (dynamic_cast<const data::ConnectionError*>(&e)) store_unreachable_ = true;
    throw Error(fmt::format("{} (checkpoint.store: mongodb; {}{} kept: run the same command to resume)", e.what(), dir,
                            name == "resume_state" ? " is" : " and the resumable state are"));
  }
}

// At the end (every rank): out of GridFS, as out of output_dir, go the epochs the policy does not
// keep and the resumable state unless checkpoint.keep_resume_state (each state save stored it).
void Trainer::store_final() {
  std::string why;
  if (lead_ && store_) {
    try {
      const std::vector<int> kept = recipe::epochs_kept(r_.checkpoint, epochs_ran_);
      const auto unkept = [&](const std::string& artifact) {
        if (artifact == "resume_state") return !r_.checkpoint.keep_resume_state;
        if (artifact.rfind("epoch_", 0) != 0) return false;
        return std::find(kept.begin(), kept.end(), std::atoi(artifact.c_str() + 6)) == kept.end();
      };
      std::vector<std::string> gone;
      for (const track::ArtifactFile& f : store_->list(record_->id()))
        if (unkept(f.artifact) && std::find(gone.begin(), gone.end(), f.artifact) == gone.end())
          gone.push_back(f.artifact);
      for (const std::string& a : gone) store_->remove(record_->id(), a);
      if (!gone.empty()) record_->drop_artifacts(gone);
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  all_agree(why.empty(), why, "writing the run's artifacts in GridFS");
}

// (Not when the server already proved unreachable: rank 0 then ends at once, with its own error.)
void Trainer::record_failure(const std::string& error) {
  try {  // (the error being reported is the one that matters)
    if (record_ && !store_unreachable_) record_->finish("failed", last_row_, error);
    if (mlflow_) mlflow_->finish("FAILED");
  } catch (const std::exception& e) {
    warn(fmt::format("the run's end was not recorded: {}", e.what()));
  }
}

// Every rank learns whether rank 0's write (or restore) worked, so a failure stops all, never hangs.
// Rank 0 throws `cause` when given (an error of its own kind), else an Error saying what failed.
void Trainer::all_agree(bool ok, const std::string& why, const std::string& what, std::exception_ptr cause) {
  at::Tensor failed = at::full({1}, ok ? 0.0 : 1.0, at::TensorOptions().dtype(at::kFloat).device(device_));
  if (env_.world_size > 1) pg_.all_reduce_sum(failed);
  if (failed.item<double>() == 0) return;
  if (lead_ && cause) std::rethrow_exception(cause);
  if (lead_) throw Error(fmt::format("{} failed: {}", what, why));
  // A consequence of rank 0's error, which the launcher's summary then names (blamed rank -1: a peer).
  throw PeerError(-1, fmt::format("{} failed on rank 0; stopping", what));
}

// No adapter with a NaN or an infinity is ever written (every rank checks its replica).
void Trainer::check_finite_adapter(const std::string& what) {
  std::vector<at::Tensor> each;
  for (const at::Tensor& p : params_) each.push_back(at::isfinite(p).all());
  const bool finite = each.empty() || at::stack(each).all().item<bool>();
  if (!ranks_agree(finite ? 1.0 : 0.0) || !finite)
    throw Error(
        fmt::format("the LoRA weights hold non-finite values at step {}: {} was not written. Lower train.lr "
                    "(now {:g}) or set train.max_grad_norm, then start over (checkpoint.resume=never)",
                    step_, what, r_.train.lr));
}

void Trainer::save_checkpoint(int epoch) {
  check_finite_adapter(fmt::format("epoch_{}", epoch));
  std::string why;
  if (lead_ && recipe::save_after_epoch(r_.checkpoint, epoch, epochs_ran_)) {
    try {
      const std::string dir = train::save_epoch(out_.string(), epoch, m_, lcfg_);
      info(fmt::format("saved {}", dir));
      if (record_) record_->checkpoint(epoch, dir);
      store_artifact(fmt::format("epoch_{}", epoch), dir);
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  all_agree(why.empty(), why, fmt::format("writing epoch_{}", epoch));
}

// Every rank's RNG goes to rank 0 (each in its own row of a sum), which writes the state.
void Trainer::save_state(const Progress& p, bool store) {
  check_finite_adapter("the resumable state");
  const at::Tensor mine = rng_state(cuda_);
  at::Tensor rngs = at::zeros({env_.world_size, mine.numel()}, at::TensorOptions().dtype(at::kFloat).device(device_));
  rngs[env_.rank].copy_(mine.to(at::kFloat));
  if (env_.world_size > 1) pg_.all_reduce_sum(rngs);
  std::string why;
  if (lead_) {
    try {
      train::save_state(out_.string(), m_, lcfg_, *opt_, params_, p, rngs.to(at::kCPU, at::kByte), recipe::to_json(r_),
                        docs_->identity());
      if (store) store_artifact("resume_state", state_dir(out_.string()));
    } catch (const std::exception& e) {
      why = e.what();
    }
  }
  all_agree(why.empty(), why, "writing " + state_dir(out_.string()));
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
    throw Error(
        fmt::format("rank {}'s LoRA parameters differ from another rank's at step {} (checksum {}): the "
                    "replicas diverged",
                    env_.rank, step_, mine));
}

// Stopped on request (SIGTERM/SIGINT): `save`, when given, is the state to save first.
int Trainer::stopped(const std::optional<Progress>& save) {
  if (save) save_state(*save);
  if (lead_)
    info(
        fmt::format("stopped at step {} on request; the resumable state is in {}: run the same command to "
                    "resume",
                    step_, state_dir(out_.string())));
  if (record_) record_->finish("interrupted", last_row_);
  if (mlflow_) mlflow_->finish("KILLED");
  pg_.barrier();
  return kExitStopped;
}

// Some rank's data source gave up (retries spent, or stopped while waiting to retry): every rank
// saves the state of the last completed step and stops as on SIGTERM, so a rerun continues.
int Trainer::data_lost(const Progress& p) {
  set_rng_state(rng_at_step_start_, cuda_);
  save_state(p, false);  // (not to GridFS: the server is likely the data source that was lost)
  const std::string why = data_error_.empty() ? "another rank lost its data source (its log says why)" : data_error_;
  if (lead_ || !data_error_.empty())
    warn(fmt::format("rank {}: {}; the resumable state of step {} is in {}: run the same command to continue",
                     env_.rank, why, step_, state_dir(out_.string())));
  if (record_) record_->finish("interrupted", last_row_, why);
  if (mlflow_) mlflow_->finish("KILLED");
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
  store_final();
  if (lead_) {
    remove_unkept_epochs(out_.string(), recipe::epochs_kept(r_.checkpoint, epochs_ran_));
    if (!r_.checkpoint.keep_resume_state) remove_state(out_.string());
    if (rejected_total_ > 0)
      warn(fmt::format("{} documents were skipped on all ranks together (bad or overlong)", rejected_total_));
    nlohmann::json done = {{"status", "completed"},
                           {"run_id", run_ref_},
                           {"steps", step_},
                           {"finished", utc_stamp()},
                           {"epochs_kept", recipe::epochs_kept(r_.checkpoint, epochs_ran_)}};
    if (steer_.best_loss) done["best"] = {{"eval_loss", *steer_.best_loss}, {"step", steer_.best_step}};
    if (stopping_early_) done["early_stopped"] = {{"step", step_}, {"epoch", epochs_ran_ - 1}};
    io::write_file_atomic(finished_marker(out_.string()), done.dump(1));
    info(fmt::format("done: {} steps{}; adapters in {}", step_,
                     stopping_early_ ? fmt::format(" (stopped early in epoch {})", epochs_ran_ - 1) : "",
                     out_.string()));
    if (stopping_early_) last_row_["early_stopped"] = true;
    if (record_) record_->finish("completed", last_row_);
  }
  pg_.barrier();
  if (mlflow_) {  // the other ranks need not wait for the upload
    const std::vector<int> kept = recipe::epochs_kept(r_.checkpoint, epochs_ran_);
    if (!kept.empty()) mlflow_->artifacts((out_ / fmt::format("epoch_{}", kept.back())).string(), "adapter");
    if (r_.checkpoint.keep_best && fs::exists(out_ / "best")) mlflow_->artifacts((out_ / "best").string(), "best");
    mlflow_->finish("FINISHED");
  }
  return 0;
}

}  // namespace

int run_training(const recipe::Recipe& r, const dist::DistEnv& env) {
  install_stop_handlers(env.rank == 0);
  // Rank 0 holds the output directory for the run's life, before anything is written there.
  std::optional<OutputDirLock> lock;
  if (env.rank == 0) {
    lock.emplace(r.checkpoint.output_dir);
    claim_output_dir(r.checkpoint.output_dir, r.checkpoint.overwrite, r.checkpoint.resume == recipe::Resume::Auto);
  }
  log_to_file((fs::path(r.checkpoint.output_dir) / "logs" / fmt::format("rank_{}.log", env.rank)).string());
  info(fmt::format("rank {}/{} (local {}) on {}; lorarun {}, torch {}", env.rank, env.world_size, env.local_rank,
                   want_cuda(r) ? "cuda" : "cpu", LORARUN_VERSION, TORCH_VERSION),
       false);
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
                                      "its error says why",
                                      env.rank, what.substr(what.find(']') + 2)));
    throw;
  }
}

}  // namespace lorarun::train
