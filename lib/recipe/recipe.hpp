// The training recipe: the YAML of docs/recipe.md as a typed, validated, resolved object.
//
// Each section struct maps one-to-one onto its YAML keys, in docs/recipe.md's order, with the
// default of every key written next to it; schema.hpp declares each key's bound, example and
// meaning next to its member. Loading = parse YAML → apply command-line overrides to the tree
// → reject unknown keys ("did you mean …") → type every key → resolve defaults that depend on
// other keys or the environment → validate(). Every problem is one lorarun::Error line that
// names the file, the dotted key, what is wrong and how to fix it.
#pragma once
#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

namespace lorarun::recipe {

enum class Dtype { BF16, FP16, FP32, Auto };
enum class Device { Auto, Cuda, Cpu };
enum class Source { MongoDB, Jsonl };
enum class Format { Instruction, Text, Chat, Preference, Unpaired, Prompt };
enum class ChatFormat { ChatML, Llama3, Mistral, Template };
enum class Overlong { Truncate, Skip };
enum class BadDocuments { Skip, Fail };
enum class Shuffle { Global, Stream, None };
enum class Scheduler { Cosine, Linear, Constant };
enum class Resume { Auto, Never };
enum class DistBackend { Auto, Nccl, Gloo };
enum class Store { None, MongoDB };
enum class Objective { Sft, Dpo, Orpo, Cpo, Simpo, Kto, Grpo };
enum class GrpoLoss { Dapo, Grpo, DrGrpo, Bnpo };
enum class ImportanceLevel { Token, Sequence };
enum class RewardScale { Group, Batch, None };
enum class PreferenceLoss { Sigmoid, Ipo, Hinge, Simpo, Kto, ApoZeroUnpaired };
enum class MixBy { Examples, Tokens };

// The YAML spelling of each enum value; the first entry is the key's default.
template <class E>
struct EnumNames;
template <>
struct EnumNames<Dtype> {
  static constexpr std::array<std::pair<std::string_view, Dtype>, 4> values{
      {{"bf16", Dtype::BF16}, {"fp16", Dtype::FP16}, {"fp32", Dtype::FP32}, {"auto", Dtype::Auto}}};
};
template <>
struct EnumNames<Device> {
  static constexpr std::array<std::pair<std::string_view, Device>, 3> values{
      {{"auto", Device::Auto}, {"cuda", Device::Cuda}, {"cpu", Device::Cpu}}};
};
template <>
struct EnumNames<Source> {
  static constexpr std::array<std::pair<std::string_view, Source>, 2> values{
      {{"mongodb", Source::MongoDB}, {"jsonl", Source::Jsonl}}};
};
template <>
struct EnumNames<Format> {
  static constexpr std::array<std::pair<std::string_view, Format>, 6> values{{{"instruction", Format::Instruction},
                                                                              {"text", Format::Text},
                                                                              {"chat", Format::Chat},
                                                                              {"preference", Format::Preference},
                                                                              {"unpaired", Format::Unpaired},
                                                                              {"prompt", Format::Prompt}}};
};
template <>
struct EnumNames<ChatFormat> {
  static constexpr std::array<std::pair<std::string_view, ChatFormat>, 4> values{{{"chatml", ChatFormat::ChatML},
                                                                                  {"llama3", ChatFormat::Llama3},
                                                                                  {"mistral", ChatFormat::Mistral},
                                                                                  {"template", ChatFormat::Template}}};
};
template <>
struct EnumNames<Overlong> {
  static constexpr std::array<std::pair<std::string_view, Overlong>, 2> values{
      {{"truncate", Overlong::Truncate}, {"skip", Overlong::Skip}}};
};
template <>
struct EnumNames<BadDocuments> {
  static constexpr std::array<std::pair<std::string_view, BadDocuments>, 2> values{
      {{"skip", BadDocuments::Skip}, {"fail", BadDocuments::Fail}}};
};
template <>
struct EnumNames<Shuffle> {
  static constexpr std::array<std::pair<std::string_view, Shuffle>, 3> values{
      {{"global", Shuffle::Global}, {"stream", Shuffle::Stream}, {"none", Shuffle::None}}};
};
template <>
struct EnumNames<Scheduler> {
  static constexpr std::array<std::pair<std::string_view, Scheduler>, 3> values{
      {{"cosine", Scheduler::Cosine}, {"linear", Scheduler::Linear}, {"constant", Scheduler::Constant}}};
};
template <>
struct EnumNames<Resume> {
  static constexpr std::array<std::pair<std::string_view, Resume>, 2> values{
      {{"auto", Resume::Auto}, {"never", Resume::Never}}};
};
template <>
struct EnumNames<DistBackend> {
  static constexpr std::array<std::pair<std::string_view, DistBackend>, 3> values{
      {{"auto", DistBackend::Auto}, {"nccl", DistBackend::Nccl}, {"gloo", DistBackend::Gloo}}};
};
template <>
struct EnumNames<Store> {
  static constexpr std::array<std::pair<std::string_view, Store>, 2> values{
      {{"none", Store::None}, {"mongodb", Store::MongoDB}}};
};

template <>
struct EnumNames<Objective> {
  static constexpr std::array<std::pair<std::string_view, Objective>, 7> values{{{"sft", Objective::Sft},
                                                                                 {"dpo", Objective::Dpo},
                                                                                 {"orpo", Objective::Orpo},
                                                                                 {"cpo", Objective::Cpo},
                                                                                 {"simpo", Objective::Simpo},
                                                                                 {"kto", Objective::Kto},
                                                                                 {"grpo", Objective::Grpo}}};
};
template <>
struct EnumNames<GrpoLoss> {
  static constexpr std::array<std::pair<std::string_view, GrpoLoss>, 4> values{
      {{"dapo", GrpoLoss::Dapo}, {"grpo", GrpoLoss::Grpo}, {"dr_grpo", GrpoLoss::DrGrpo}, {"bnpo", GrpoLoss::Bnpo}}};
};
template <>
struct EnumNames<ImportanceLevel> {
  static constexpr std::array<std::pair<std::string_view, ImportanceLevel>, 2> values{
      {{"token", ImportanceLevel::Token}, {"sequence", ImportanceLevel::Sequence}}};
};
template <>
struct EnumNames<RewardScale> {
  static constexpr std::array<std::pair<std::string_view, RewardScale>, 3> values{
      {{"group", RewardScale::Group}, {"batch", RewardScale::Batch}, {"none", RewardScale::None}}};
};
template <>
struct EnumNames<PreferenceLoss> {
  static constexpr std::array<std::pair<std::string_view, PreferenceLoss>, 6> values{
      {{"sigmoid", PreferenceLoss::Sigmoid},
       {"ipo", PreferenceLoss::Ipo},
       {"hinge", PreferenceLoss::Hinge},
       {"simpo", PreferenceLoss::Simpo},
       {"kto", PreferenceLoss::Kto},
       {"apo_zero_unpaired", PreferenceLoss::ApoZeroUnpaired}}};
};

template <>
struct EnumNames<MixBy> {
  static constexpr std::array<std::pair<std::string_view, MixBy>, 2> values{
      {{"examples", MixBy::Examples}, {"tokens", MixBy::Tokens}}};
};

// "bf16" for Dtype::BF16, and so on.
template <class E>
constexpr std::string_view name(E value) {
  for (const auto& [text, v] : EnumNames<E>::values)
    if (v == value) return text;
  return "?";
}

// The sections: each key's type and default. Its bound, example and meaning are declared once,
// in schema.hpp's for_each_key, which docs/recipe.md's tables are made from.

struct ModelSection {
  std::string path;
  Dtype dtype = Dtype::BF16;
  Device device = Device::Auto;
  bool keep_quantized = false;  // a .gguf model: its linears held as the file's blocks, dequantised per use
  bool operator==(const ModelSection&) const = default;
};

struct LoraSection {
  int r = 8;
  double alpha = 16;
  double dropout = 0.0;
  // {"all-linear"} for all-linear.
  std::vector<std::string> target_modules = {"q_proj", "v_proj"};
  // PEFT's target_parameters: mixture-of-experts tensors adapted per expert (mlp.experts.gate_up_proj)
  std::vector<std::string> target_parameters;
  bool use_rslora = false;
  bool use_dora = false;
  std::optional<double> plus_lr_ratio;           // LoRA+: B's learning rate is lr × this
  std::vector<std::string> modules_to_save;      // embed_tokens, lm_head: trained whole (PEFT's)
  std::vector<int64_t> trainable_token_indices;  // embedding rows trained alone (PEFT's TrainableTokens)
  bool quantize_base = false;
  bool double_quant = true;
  std::string init = "default";  // PEFT's init_lora_weights: default | gaussian | pissa | pissa_niter_N | olora
  std::string init_from;
  bool all_linear() const { return target_modules == std::vector<std::string>{"all-linear"}; }
  bool operator==(const LoraSection&) const = default;
};

// One entry of data.sources: where a source's documents are, its weight in the mixture, and the
// keys of how a document becomes an example that it may set for itself (unset: data's).
struct DataSource {
  std::string name;
  std::string collection;                            // source: mongodb (of data.database)
  nlohmann::json filter = nlohmann::json::object();  // source: mongodb; with data.filter's conditions too
  std::string path;                                  // source: jsonl
  double weight = 1.0;
  std::optional<Format> format;
  std::optional<std::string> prompt_template, response_field, text_field, messages_field;
  std::optional<ChatFormat> chat_format;
  bool operator==(const DataSource&) const = default;
};

struct DataSection {
  Source source = Source::MongoDB;
  std::string uri;  // empty in the file: LORARUN_MONGODB_URI at load time
  std::string database;
  std::string collection;
  std::string path;
  // nlohmann::json orders keys by name, so an exact match on a whole sub-document should use
  // dotted paths ({"meta.lang": en}).
  nlohmann::json filter = nlohmann::json::object();
  std::optional<int64_t> limit;
  std::vector<DataSource> sources;  // empty: one source, the keys above
  MixBy mix_by = MixBy::Examples;
  std::optional<int64_t> epoch_documents;  // with sources: documents per epoch; null: all the sources hold
  Format format = Format::Instruction;
  std::string prompt_template;
  std::string response_field = "output";
  std::string text_field = "text";
  std::string messages_field = "messages";
  std::string prompt_field = "prompt";  // format: preference
  std::string chosen_field = "chosen";
  std::string rejected_field = "rejected";
  std::string completion_field = "completion";  // format: unpaired
  std::string label_field = "label";
  ChatFormat chat_format = ChatFormat::ChatML;
  std::string chat_template;  // a .jinja file; empty: the model's own template
  nlohmann::json chat_template_kwargs = nlohmann::json::object();
  int64_t chat_template_fuel = 10'000'000;  // what one render may spend (minijinja's fuel)
  bool train_on_input = false;
  int max_length = 1024;
  Overlong overlong = Overlong::Truncate;
  BadDocuments bad_documents = BadDocuments::Skip;
  double max_skipped_share = 0.05;  // of an epoch's documents; more skipped stops the run
  Shuffle shuffle = Shuffle::Global;
  bool packing = false;
  int batch_size = 4;
  bool group_by_length = false;
  int group_window = 64;
  int prefetch = 4;
  int shuffle_buffer = 4096;
  int retries = 5;
  double retry_backoff_s = 1.0;
  int timeout_s = 20;

  // The keys of source `s` of `sources`: its selection (data.filter's conditions and its own) and
  // format keys, the others data's; `sources` itself empty.
  DataSection of_source(const DataSource& s) const;
  // The distinct {placeholders} of prompt_template, in order of first use.
  std::vector<std::string> template_fields() const;
  bool operator==(const DataSection&) const = default;
};

struct TrainSection {
  int epochs = 3;
  int gradient_accumulation_steps = 1;
  double lr = 2.0e-4;
  double weight_decay = 0.0;
  Scheduler lr_scheduler = Scheduler::Cosine;
  int warmup_steps = 0;
  std::optional<double> max_grad_norm = 1.0;
  std::optional<int> max_steps_per_epoch;
  int64_t seed = 42;
  bool activation_checkpointing = false;
  std::optional<int> profile_steps;            // steps traced by LibTorch's profiler; null: none
  std::optional<int> early_stopping_patience;  // evaluations without improvement; null: never
  double early_stopping_min_delta = 0.0;       // an improvement lowers the best eval loss by more
  Objective objective = Objective::Sft;
  bool operator==(const TrainSection&) const = default;
};

// checkpoint.epochs_to_save: `all`, `none` or a list of 0-based epoch indices.
struct EpochsToSave {
  enum class Mode { All, None, List };
  Mode mode = Mode::All;
  std::vector<int> epochs;  // Mode::List: as written (validated: distinct, in [0, train.epochs))
  bool operator==(const EpochsToSave&) const = default;
};

// train.objective: dpo, orpo, cpo, simpo, kto: the preference losses, TRL's trainers' formulas.
struct PreferenceSection {
  double beta = 0.1;
  PreferenceLoss loss_type = PreferenceLoss::Sigmoid;
  double label_smoothing = 0.0;       // sigmoid: conservative DPO
  std::optional<double> rpo_alpha;    // the chosen answers' NLL, this much of it, added (RPO); null: off
  std::optional<double> cpo_alpha;    // cpo, simpo: the chosen answers' NLL weight; null: 1 (cpo), 0 (simpo)
  double simpo_gamma = 0.5;           // loss simpo: the target reward margin
  double desirable_weight = 1.0;      // kto: of the desirable completions' losses
  double undesirable_weight = 1.0;    // ... and of the undesirable ones'
  bool precompute_reference = false;  // dpo, kto: the reference's log-probs computed once, before training
  bool operator==(const PreferenceSection&) const = default;
};

// train.objective: grpo: TRL 1.16's GRPOTrainer (GRPOConfig's names and defaults): G completions of each
// prompt sampled from the model being trained, scored by `rewards`, advantaged within their group.
struct GrpoSection {
  int num_generations = 8;  // G
  int max_completion_length = 512;
  double temperature = 1.0;
  double top_p = 1.0;
  int top_k = 0;      // 0: off
  double beta = 0.0;  // KL to the reference; 0: no reference pass
  int num_iterations = 1;
  double epsilon = 0.2;
  std::optional<double> epsilon_high;  // null: epsilon
  GrpoLoss loss_type = GrpoLoss::Dapo;
  ImportanceLevel importance_sampling_level = ImportanceLevel::Token;
  RewardScale scale_rewards = RewardScale::Group;
  bool mask_truncated_completions = false;
  bool log_completions = false;
  nlohmann::json rewards = nlohmann::json::array();  // [{name, kind, weight, field, …}]
  bool operator==(const GrpoSection&) const = default;
};

struct CheckpointSection {
  std::string output_dir;  // empty in the file: runs/<recipe file name> at load time
  EpochsToSave epochs_to_save;
  bool save_last_epoch_only = false;
  std::optional<int> state_every_n_steps;
  Resume resume = Resume::Auto;
  bool keep_resume_state = false;
  bool overwrite = false;
  bool keep_best = false;     // best/: the adapter of the lowest eval loss so far
  Store store = Store::None;  // mongodb: the kept adapters and state also go to GridFS
  bool operator==(const CheckpointSection&) const = default;
};

struct DistSection {
  DistBackend backend = DistBackend::Auto;
  int timeout_s = 600;
  std::optional<int> debug_checksum_every_n_steps;
  double bucket_mb = 25;
  bool shard_base = false;          // each rank holds 1/world of the frozen base linears, gathered per use
  bool shard_base_prefetch = true;  // with shard_base: the next block gathered while this one computes
  bool operator==(const DistSection&) const = default;
};

struct TrackSection {
  bool mongodb = true;
  std::string database;  // empty in the file: data.database at load time
  int log_every_n_steps = 1;
  bool tensorboard = false;       // rank 0 writes TensorBoard event files under <output_dir>/tensorboard/
  std::string mlflow_uri;         // empty: no MLflow
  std::string mlflow_experiment;  // empty in the file: $MLFLOW_EXPERIMENT_NAME, else "Default", when mlflow_uri is set
  bool operator==(const TrackSection&) const = default;
};

// Evaluation while training: a held-out set, its loss logged at each epoch end (and every N steps).
struct EvalSection {
  nlohmann::json filter = nlohmann::json::object();  // empty: none
  std::string collection;                            // empty: data.collection
  std::string path;
  double fraction = 0.0;
  std::optional<int> every_n_steps;
  bool on_start = false;  // evaluate once before the first step (transformers' eval_on_start)
  std::optional<int64_t> max_documents;
  std::optional<int> batch_size;
  // Whether the run evaluates: a filter or a collection (mongodb), a path (jsonl) or a fraction
  // is given; the other source's keys are ignored, as data's are.
  bool enabled(Source source) const {
    return fraction > 0 || (source == Source::MongoDB ? !filter.empty() || !collection.empty() : !path.empty());
  }
  bool operator==(const EvalSection&) const = default;
};

// One adapter of a job of many (adapters.list): its share of data's selection and what it may set
// for itself; unset: the recipe's. With adapters.per an entry only sets an adapter's own keys.
struct AdapterSpec {
  std::string name;
  nlohmann::json filter = nlohmann::json::object();       // mongodb: with data.filter's conditions too
  std::string collection;                                 // mongodb: of data.database, instead of data.collection
  std::string path;                                       // jsonl: its own file
  nlohmann::json eval_filter = nlohmann::json::object();  // its evaluation documents (a query on its collection)
  std::optional<int> r;
  std::optional<double> alpha;
  std::optional<std::vector<std::string>> target_modules;
  std::optional<double> lr;
  std::optional<int> epochs;
  bool selects() const { return !filter.empty() || !collection.empty() || !path.empty(); }
  bool operator==(const AdapterSpec&) const = default;
};

// Many adapters on one base in one job: one per distinct value of a document field, or listed.
// Each trains exactly as its own run would (adapter_recipe), into <output_dir>/<name>/.
struct AdaptersSection {
  std::string per;  // a document field of data's selection; empty: the adapters are listed
  int max = 64;     // with per: at most this many adapters
  std::vector<AdapterSpec> list;
  // How many adapters' micro-batches go through the base in one forward and backward pass (the
  // rest in further passes of the same step); unset: all of them on a GPU, one on the CPU.
  std::optional<int> per_pass;
  bool enabled() const { return !per.empty() || !list.empty(); }
  bool operator==(const AdaptersSection&) const = default;
};

// Mixture-of-experts models (qwen3_moe, mixtral).
struct MoeSection {
  // The router's load-balancing loss, times this, added to the training loss; unset: as transformers
  // trains the model (config.json's router_aux_loss_coef when it says output_router_logits, else 0).
  std::optional<double> router_aux_loss_coef;
  bool operator==(const MoeSection&) const = default;
};

struct Recipe {
  ModelSection model;
  LoraSection lora;
  MoeSection moe;
  DataSection data;
  TrainSection train;
  PreferenceSection preference;
  GrpoSection grpo;
  CheckpointSection checkpoint;
  DistSection dist;
  TrackSection track;
  EvalSection eval;
  AdaptersSection adapters;
  std::vector<std::string> warnings;  // one line each, for the caller to print

  // Same settings (warnings, which name where a recipe came from, are not compared).
  bool operator==(const Recipe& o) const {
    return model == o.model && lora == o.lora && moe == o.moe && data == o.data && train == o.train &&
           preference == o.preference && grpo == o.grpo && checkpoint == o.checkpoint && dist == o.dist &&
           track == o.track && eval == o.eval && adapters == o.adapters;
  }
};

// Where a recipe's text came from, so that messages point at the file or the override.
struct RecipeOrigin {
  std::string file = "recipe.yaml";
  std::map<std::string, std::string, std::less<>> overrides;  // dotted key -> "key=value" as given
  // "recipe.yaml", or "recipe.yaml (override 'train.lr=fast')" when `key` came from one.
  std::string at(std::string_view key) const;
};

// Reads the YAML file at `path`, applies `overrides` ("train.lr=1e-4", values in YAML flow
// syntax) and returns the validated, resolved recipe. Throws lorarun::Error.
Recipe load_recipe(const std::string& path, const std::vector<std::string>& overrides = {});
// The same from a parsed tree (not modified); `file` names it in messages.
Recipe recipe_from_yaml(const YAML::Node& root, const std::vector<std::string>& overrides = {},
                        const std::string& file = "recipe.yaml");
// The same from to_json()'s output (a run record), e.g. for --from-run.
Recipe recipe_from_json(const nlohmann::json& j, const std::vector<std::string>& overrides = {},
                        const std::string& file = "run record");

// Walks the keys in order and, at each, checks the rules that span several keys and name it
// (validate.cpp), then what its declaration implies (required, bound); throws lorarun::Error for
// the first problem and returns the warnings (e.g. save_last_epoch_only with epochs_to_save).
std::vector<std::string> validate(const Recipe& r, const RecipeOrigin& origin = {});

// The fully resolved recipe, every key in docs/recipe.md's order; loads back to an equal Recipe.
// With redact_secrets the password in data.uri becomes "****".
std::string to_yaml(const Recipe& r, bool redact_secrets = true);
// The same as JSON (for run records): {"model": {"path": …}, …}.
nlohmann::json to_json(const Recipe& r, bool redact_secrets = true);

// Adapter `a` of the job `job` as a run of its own: data's selection narrowed to a's (its filter
// with data.filter's conditions, or its collection or file), eval: narrowed alike (or its
// eval_filter), its own r, alpha, target_modules, lr and epochs, output_dir <job's>/<name>, no
// adapters: section. A job trains each adapter exactly as lora-train trains this recipe. Throws
// lorarun::Error, naming the adapter, when that recipe is not valid.
Recipe adapter_recipe(const Recipe& job, const AdapterSpec& a);

// Every dotted key ("model.path", …) in docs/recipe.md's order.
std::vector<std::string> known_keys();

// docs/recipe.md's key tables (Markdown), made from the key declarations: per section, each
// key's type, default, allowed values and meaning. tests/recipe keeps the file equal to it.
std::string reference_tables();

// A prompt template split into literal text and {field} placeholders; "{{" and "}}" are
// literal braces. Throws lorarun::Error (without a file name) for unbalanced or empty braces.
struct TemplatePart {
  bool is_field = false;
  std::string text;  // literal text, or the field name
  bool operator==(const TemplatePart&) const = default;
};
std::vector<TemplatePart> parse_template(std::string_view tmpl);

}  // namespace lorarun::recipe
