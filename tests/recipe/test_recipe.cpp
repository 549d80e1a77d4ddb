// The recipe contract (docs/recipe.md): defaults, overrides, one-line messages, the
// checkpoint policy, secrets, round trips and every recipe in configs/.
#include <catch2/catch.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "recipe/recipe.hpp"
#include "util/error.hpp"

namespace fs = std::filesystem;
using namespace lorarun::recipe;
using Strings = std::vector<std::string>;

namespace {

// The least a recipe needs: a model, and where the instruction documents are.
const std::string kBase =
    "model: {path: /models/m}\n"
    "data: {database: db, collection: docs, prompt_template: \"Q: {instruction}\\nA: \"}\n";

Recipe load(const std::string& yaml, const Strings& overrides = {}) {
  unsetenv("LORARUN_MONGODB_URI");
  return recipe_from_yaml(YAML::Load(yaml), overrides);
}

// The message of the lorarun::Error that loading throws.
std::string error_of(const std::string& yaml, const Strings& overrides = {}) {
  try {
    load(yaml, overrides);
  } catch (const lorarun::Error& e) {
    return e.what();
  }
  return "(no error)";
}

std::string override_error(const Strings& overrides) { return error_of(kBase, overrides); }

// A file under a fresh temporary directory, removed with it.
struct TempDir {
  fs::path dir;
  TempDir() {
    dir = fs::temp_directory_path() /
          ("lorarun-recipe-" + std::to_string(::getpid()) + "-" + std::to_string(reinterpret_cast<uintptr_t>(this)));
    fs::create_directories(dir);
  }
  ~TempDir() { fs::remove_all(dir); }
  std::string write(const std::string& name, const std::string& text) const {
    std::ofstream(dir / name) << text;
    return (dir / name).string();
  }
};

}  // namespace

TEST_CASE("every key has its documented default") {
  const Recipe r = load(kBase);
  CHECK(r.model.path == "/models/m");
  CHECK(r.model.dtype == Dtype::BF16);
  CHECK(r.model.device == Device::Auto);

  CHECK(r.lora.r == 8);
  CHECK(r.lora.alpha == 16.0);
  CHECK(r.lora.dropout == 0.0);
  CHECK(r.lora.target_modules == Strings{"q_proj", "v_proj"});
  CHECK_FALSE(r.lora.all_linear());
  CHECK_FALSE(r.lora.use_rslora);
  CHECK_FALSE(r.lora.quantize_base);
  CHECK(r.lora.double_quant);

  CHECK(r.data.source == Source::MongoDB);
  CHECK(r.data.uri.empty());
  CHECK(r.data.database == "db");
  CHECK(r.data.collection == "docs");
  CHECK(r.data.path.empty());
  CHECK(r.data.filter == nlohmann::json::object());
  CHECK_FALSE(r.data.limit);
  CHECK(r.data.format == Format::Instruction);
  CHECK(r.data.prompt_template == "Q: {instruction}\nA: ");
  CHECK(r.data.response_field == "output");
  CHECK(r.data.text_field == "text");
  CHECK(r.data.messages_field == "messages");
  CHECK(r.data.chat_format == ChatFormat::ChatML);
  CHECK_FALSE(r.data.train_on_input);
  CHECK(r.data.max_length == 1024);
  CHECK(r.data.overlong == Overlong::Truncate);
  CHECK(r.data.bad_documents == BadDocuments::Skip);
  CHECK(r.data.shuffle == Shuffle::Global);
  CHECK_FALSE(r.data.packing);
  CHECK(r.data.batch_size == 4);
  CHECK(r.data.prefetch == 4);
  CHECK(r.data.shuffle_buffer == 4096);
  CHECK(r.data.retries == 5);
  CHECK(r.data.retry_backoff_s == 1.0);

  CHECK(r.train.epochs == 3);
  CHECK(r.train.gradient_accumulation_steps == 1);
  CHECK(r.train.lr == 2.0e-4);
  CHECK(r.train.weight_decay == 0.0);
  CHECK(r.train.lr_scheduler == Scheduler::Cosine);
  CHECK(r.train.warmup_steps == 0);
  CHECK(r.train.max_grad_norm == 1.0);
  CHECK_FALSE(r.train.max_steps_per_epoch);
  CHECK(r.train.seed == 42);
  CHECK_FALSE(r.train.activation_checkpointing);

  CHECK(r.checkpoint.output_dir == "runs/recipe");  // runs/<recipe name>
  CHECK(r.checkpoint.epochs_to_save.mode == EpochsToSave::Mode::All);
  CHECK_FALSE(r.checkpoint.save_last_epoch_only);
  CHECK_FALSE(r.checkpoint.state_every_n_steps);
  CHECK(r.checkpoint.resume == Resume::Auto);
  CHECK_FALSE(r.checkpoint.keep_resume_state);

  CHECK(r.dist.backend == DistBackend::Auto);
  CHECK(r.dist.timeout_s == 600);
  CHECK_FALSE(r.dist.debug_checksum_every_n_steps);

  CHECK(r.track.mongodb);
  CHECK(r.track.database == "db");  // data.database
  CHECK(r.track.log_every_n_steps == 1);
  CHECK(r.track.mlflow_uri.empty());
  CHECK(r.track.mlflow_experiment.empty());  // resolved only for a run logged to MLflow

  CHECK(r.warnings.empty());
}

TEST_CASE("the keys, in docs/recipe.md's order") {
  CHECK(known_keys() == Strings{"model.path",
                                "model.dtype",
                                "model.device",
                                "model.keep_quantized",
                                "lora.r",
                                "lora.alpha",
                                "lora.dropout",
                                "lora.target_modules",
                                "lora.target_parameters",
                                "lora.use_rslora",
                                "lora.use_dora",
                                "lora.plus_lr_ratio",
                                "lora.modules_to_save",
                                "lora.trainable_token_indices",
                                "lora.quantize_base",
                                "lora.double_quant",
                                "lora.init",
                                "lora.init_from",
                                "moe.router_aux_loss_coef",
                                "data.source",
                                "data.uri",
                                "data.database",
                                "data.collection",
                                "data.path",
                                "data.filter",
                                "data.limit",
                                "data.sources",
                                "data.mix_by",
                                "data.epoch_documents",
                                "data.format",
                                "data.prompt_template",
                                "data.response_field",
                                "data.text_field",
                                "data.messages_field",
                                "data.prompt_field",
                                "data.chosen_field",
                                "data.rejected_field",
                                "data.completion_field",
                                "data.label_field",
                                "data.chat_format",
                                "data.chat_template",
                                "data.chat_template_kwargs",
                                "data.chat_template_fuel",
                                "data.train_on_input",
                                "data.max_length",
                                "data.overlong",
                                "data.bad_documents",
                                "data.max_skipped_share",
                                "data.shuffle",
                                "data.packing",
                                "data.batch_size",
                                "data.prefetch",
                                "data.shuffle_buffer",
                                "data.group_by_length",
                                "data.group_window",
                                "data.retries",
                                "data.retry_backoff_s",
                                "data.timeout_s",
                                "train.epochs",
                                "train.gradient_accumulation_steps",
                                "train.lr",
                                "train.weight_decay",
                                "train.lr_scheduler",
                                "train.warmup_steps",
                                "train.max_grad_norm",
                                "train.max_steps_per_epoch",
                                "train.seed",
                                "train.activation_checkpointing",
                                "train.profile_steps",
                                "train.early_stopping_patience",
                                "train.early_stopping_min_delta",
                                "train.objective",
                                "preference.beta",
                                "preference.loss_type",
                                "preference.label_smoothing",
                                "preference.rpo_alpha",
                                "preference.cpo_alpha",
                                "preference.simpo_gamma",
                                "preference.desirable_weight",
                                "preference.undesirable_weight",
                                "preference.precompute_reference",
                                "grpo.num_generations",
                                "grpo.max_completion_length",
                                "grpo.temperature",
                                "grpo.top_p",
                                "grpo.top_k",
                                "grpo.beta",
                                "grpo.num_iterations",
                                "grpo.epsilon",
                                "grpo.epsilon_high",
                                "grpo.loss_type",
                                "grpo.importance_sampling_level",
                                "grpo.scale_rewards",
                                "grpo.mask_truncated_completions",
                                "grpo.log_completions",
                                "grpo.rewards",
                                "checkpoint.output_dir",
                                "checkpoint.epochs_to_save",
                                "checkpoint.save_last_epoch_only",
                                "checkpoint.state_every_n_steps",
                                "checkpoint.resume",
                                "checkpoint.keep_resume_state",
                                "checkpoint.overwrite",
                                "checkpoint.keep_best",
                                "checkpoint.store",
                                "dist.backend",
                                "dist.timeout_s",
                                "dist.debug_checksum_every_n_steps",
                                "dist.bucket_mb",
                                "dist.shard_base",
                                "dist.shard_base_prefetch",
                                "track.mongodb",
                                "track.database",
                                "track.log_every_n_steps",
                                "track.tensorboard",
                                "track.mlflow_uri",
                                "track.mlflow_experiment",
                                "eval.filter",
                                "eval.collection",
                                "eval.path",
                                "eval.fraction",
                                "eval.every_n_steps",
                                "eval.on_start",
                                "eval.max_documents",
                                "eval.batch_size",
                                "adapters.per",
                                "adapters.max",
                                "adapters.list",
                                "adapters.per_pass"});
}

TEST_CASE("eval: off by default, and an evaluation selection that would overlap the training documents is refused") {
  const Recipe r = load(kBase);
  CHECK_FALSE(r.eval.enabled(r.data.source));
  CHECK(r.eval.filter == nlohmann::json::object());
  CHECK(r.eval.fraction == 0.0);
  CHECK_FALSE(r.eval.every_n_steps);
  CHECK_FALSE(r.eval.max_documents);
  CHECK_FALSE(r.eval.batch_size);
  CHECK(load(kBase, {"eval.filter={split: eval}"}).eval.enabled(Source::MongoDB));
  CHECK(load(kBase, {"eval.filter.split=eval"}).eval.filter == nlohmann::json{{"split", "eval"}});
  CHECK(load(kBase, {"eval.fraction=0.1", "eval.every_n_steps=50"}).eval.enabled(Source::MongoDB));
  // eval.path is for JSONL sources; with mongodb it is ignored, as data.path is.
  CHECK_FALSE(load(kBase, {"eval.path=e.jsonl"}).eval.enabled(Source::MongoDB));
  const std::string jsonl = "model: {path: /models/m}\ndata: {source: jsonl, path: d.jsonl, prompt_template: x}\n";
  CHECK(recipe_from_yaml(YAML::Load(jsonl), {"eval.path=e.jsonl"}).eval.enabled(Source::Jsonl));

  CHECK(override_error({"data.filter={split: a}", "eval.filter={split: a}"}) ==
        "recipe.yaml (override 'eval.filter={split: a}'): eval.filter is data.filter ({\"split\":\"a\"}), so the "
        "evaluation documents would be trained on: give data.filter and eval.filter disjoint queries (e.g. {split: "
        "train} and {split: eval}) or use eval.fraction");
  CHECK(override_error({"eval.fraction=0.1", "eval.filter={split: eval}"}) ==
        "recipe.yaml (override 'eval.fraction=0.1'): eval.fraction holds out part of data's selection, and "
        "eval.filter is set too, which would overlap it or train on it: set only one of eval.fraction, "
        "eval.filter/eval.collection, eval.path");
  CHECK(override_error({"eval.fraction=0.1", "data.shuffle=stream"}) ==
        "recipe.yaml (override 'eval.fraction=0.1'): eval.fraction needs the selection's ids, which data.shuffle: "
        "stream never lists: use data.shuffle: global or none, or eval.filter");
  const auto jsonl_error = [&](const Strings& o) {
    try {
      recipe_from_yaml(YAML::Load(jsonl), o);
    } catch (const lorarun::Error& e) {
      return std::string(e.what());
    }
    return std::string("(no error)");
  };
  CHECK(jsonl_error({"eval.path=d.jsonl"}) ==
        "recipe.yaml (override 'eval.path=d.jsonl'): eval.path is data.path, so the evaluation documents would be "
        "trained on: give a separate file or use eval.fraction");
  CHECK(jsonl_error({"eval.fraction=0.1", "eval.path=e.jsonl"}) ==
        "recipe.yaml (override 'eval.fraction=0.1'): eval.fraction holds out part of data's selection, and "
        "eval.path is set too, which would overlap it or train on it: set only one of eval.fraction, "
        "eval.filter/eval.collection, eval.path");
  CHECK(jsonl_error({"eval.filter={split: eval}"}) ==
        "recipe.yaml (override 'eval.filter={split: eval}'): eval.filter needs data.source: mongodb (JSONL "
        "documents are not filtered); use eval.path or eval.fraction");
  CHECK(override_error({"eval.fraction=1"}) ==
        "recipe.yaml (override 'eval.fraction=1'): eval.fraction must be in [0, 1), got 1.0 (e.g. eval.fraction: "
        "0.05)");
}

TEST_CASE("every enum value is accepted") {
  const Recipe r = load(kBase, {"model.dtype=fp16", "model.device=cpu", "data.chat_format=llama3", "data.overlong=skip",
                                "data.bad_documents=fail", "data.shuffle=none", "train.lr_scheduler=linear",
                                "checkpoint.resume=never", "dist.backend=gloo"});
  CHECK(r.model.dtype == Dtype::FP16);
  CHECK(r.model.device == Device::Cpu);
  CHECK(r.data.chat_format == ChatFormat::Llama3);
  CHECK(r.data.overlong == Overlong::Skip);
  CHECK(r.data.bad_documents == BadDocuments::Fail);
  CHECK(r.data.shuffle == Shuffle::None);
  CHECK(r.train.lr_scheduler == Scheduler::Linear);
  CHECK(r.checkpoint.resume == Resume::Never);
  CHECK(r.dist.backend == DistBackend::Gloo);
  CHECK(load(kBase, {"model.dtype=fp32", "data.shuffle=stream", "train.lr_scheduler=constant"}).data.shuffle ==
        Shuffle::Stream);
  CHECK(load(kBase, {"data.format=text"}).data.format == Format::Text);
  CHECK(load(kBase, {"data.format=chat", "data.chat_format=mistral"}).data.chat_format == ChatFormat::Mistral);
}

TEST_CASE("numbers: decimal and exponent forms are floats, integers are exact") {
  CHECK(load(kBase + "train: {lr: 2.0e-4}\n").train.lr == 2.0e-4);
  CHECK(load(kBase + "train: {lr: 1e-4}\n").train.lr == 1e-4);
  CHECK(load(kBase + "train: {lr: 1E-4}\n").train.lr == 1e-4);
  CHECK(load(kBase + "train: {lr: .001}\n").train.lr == 0.001);
  CHECK(load(kBase + "train: {lr: +3e-5}\n").train.lr == 3e-5);
  CHECK(load(kBase + "train: {lr: 1}\n").train.lr == 1.0);
  CHECK(load(kBase + "lora: {alpha: 32, dropout: 0.1}\n").lora.alpha == 32.0);
  CHECK(load(kBase + "train: {seed: 1234567890123}\n").train.seed == 1234567890123);
  CHECK(load(kBase + "lora: {use_rslora: yes}\n").lora.use_rslora);
  CHECK(error_of(kBase + "lora: {r: 8.5}\n") ==
        "recipe.yaml: lora.r must be a whole number, got '8.5' (e.g. lora.r: 8)");
  CHECK(error_of(kBase + "train: {lr: .inf}\n") ==
        "recipe.yaml: train.lr must be a number, got '.inf' (e.g. train.lr: 0.0002)");
  CHECK(error_of(kBase + "train: {epochs: 99999999999}\n") ==
        "recipe.yaml: train.epochs must be a whole number from -2147483648 to 2147483647, got '99999999999' (e.g. "
        "train.epochs: 3)");
  CHECK(error_of(kBase + "train: {epochs: 1e12}\n") ==
        "recipe.yaml: train.epochs must be a whole number from -2147483648 to 2147483647, got '1e12' (e.g. "
        "train.epochs: 3)");
  CHECK(load(kBase, {"data.limit=1e6"}).data.limit == 1000000);  // a whole number written as a float
  CHECK(load(kBase + "train: {epochs: 2.0}\n").train.epochs == 2);
}

TEST_CASE("overrides: every form") {
  SECTION("a float") { CHECK(load(kBase, {"train.lr=1e-4"}).train.lr == 1e-4); }
  SECTION("a list of modules, or all-linear") {
    CHECK(load(kBase, {"lora.target_modules=[q_proj,k_proj]"}).lora.target_modules == Strings{"q_proj", "k_proj"});
    const Recipe r = load(kBase, {"lora.target_modules=all-linear"});
    CHECK(r.lora.target_modules == Strings{"all-linear"});
    CHECK(r.lora.all_linear());
  }
  SECTION("epochs to save") {
    const Recipe r = load(kBase, {"train.epochs=4", "checkpoint.epochs_to_save=[1,3]"});
    CHECK(r.checkpoint.epochs_to_save.mode == EpochsToSave::Mode::List);
    CHECK(r.checkpoint.epochs_to_save.epochs == std::vector<int>{1, 3});
  }
  SECTION("a filter in YAML flow syntax, or one filter key") {
    CHECK(load(kBase, {"data.filter={split: train}"}).data.filter == nlohmann::json{{"split", "train"}});
    CHECK(load(kBase, {"data.filter.split=train", "data.filter.meta.lang=en"}).data.filter ==
          nlohmann::json{{"split", "train"}, {"meta", {{"lang", "en"}}}});
  }
  SECTION("text keys take the text as written, or a quoted YAML string") {
    CHECK(load(kBase, {"model.path=/x"}).model.path == "/x");
    CHECK(load(kBase, {"model.path=/a dir/with: colon #1"}).model.path == "/a dir/with: colon #1");
    CHECK(load(kBase, {"data.prompt_template=### Instruction: {instruction} ### Response:"}).data.prompt_template ==
          "### Instruction: {instruction} ### Response:");
    CHECK(load(kBase, {R"(data.prompt_template="Q: {instruction}\nA: ")"}).data.prompt_template ==
          "Q: {instruction}\nA: ");
  }
  SECTION("null, and an empty value, unset a nullable key") {
    const Recipe r =
        load(kBase + "train: {max_steps_per_epoch: 10}\n", {"train.max_grad_norm=null", "train.max_steps_per_epoch="});
    CHECK_FALSE(r.train.max_grad_norm);
    CHECK_FALSE(r.train.max_steps_per_epoch);
  }
  SECTION("overrides win over the file, the last one wins, missing sections are made") {
    const Recipe r = load(kBase + "train: {lr: 0.5}\n", {"train.lr=0.1", "train.lr=0.2", "dist.timeout_s=30"});
    CHECK(r.train.lr == 0.2);
    CHECK(r.dist.timeout_s == 30);
  }
  SECTION("the same checks apply to overridden values") {
    CHECK(override_error({"train.lr=fast"}) ==
          "recipe.yaml (override 'train.lr=fast'): train.lr must be a number, got 'fast' (e.g. train.lr: 0.0002)");
    CHECK(override_error({"train.epochs=0"}) ==
          "recipe.yaml (override 'train.epochs=0'): train.epochs must be at least 1, got 0 (e.g. train.epochs: 3)");
  }
  SECTION("the caller's tree is left alone") {
    const YAML::Node root = YAML::Load(kBase);
    recipe_from_yaml(root, {"model.path=/other", "train.lr=0.1"});
    CHECK(root["model"]["path"].Scalar() == "/models/m");
    CHECK_FALSE(root["train"]);
  }
}

TEST_CASE("malformed overrides are one-line errors") {
  CHECK(override_error({"train.lr"}) == "recipe.yaml: override 'train.lr' is not key=value; write e.g. train.lr=1e-4");
  CHECK(override_error({"=3"}) == "recipe.yaml: override '=3' is not key=value; write e.g. train.lr=1e-4");
  CHECK(override_error({"train=3"}) ==
        "recipe.yaml (override 'train=3'): 'train' is a section; override one key such as train.epochs=…");
  CHECK(override_error({"train.lr.x=3"}) ==
        "recipe.yaml (override 'train.lr.x=3'): train.lr has no sub-keys; write train.lr=VALUE");
  CHECK(override_error({"data.filter={split: train"}) ==
        "recipe.yaml (override 'data.filter={split: train'): malformed YAML value at column 1: end of map flow not "
        "found; use YAML flow syntax such as [a, b] or {k: v}, or quote the value");
  CHECK(override_error({"train.learning_rate=1e-4"}) ==
        "recipe.yaml (override 'train.learning_rate=1e-4'): unknown key 'train.learning_rate'; did you mean "
        "'train.lr'?");
  CHECK(override_error({"lr=1e-4"}) == "recipe.yaml (override 'lr=1e-4'): unknown key 'lr'; did you mean 'train.lr'?");
  CHECK(override_error({"trian.lr=1e-4"}) ==
        "recipe.yaml (override 'trian.lr=1e-4'): unknown section 'trian'; did you mean 'train'?");
}

TEST_CASE("unknown keys name the closest known key") {
  const auto in_file = [](const std::string& yaml) { return error_of(kBase + yaml); };
  CHECK(in_file("train:\n  learning_rate: 1e-4\n") ==
        "recipe.yaml: unknown key 'train.learning_rate'; did you mean 'train.lr'?");
  CHECK(in_file("train: {epoch: 3}\n") == "recipe.yaml: unknown key 'train.epoch'; did you mean 'train.epochs'?");
  CHECK(in_file("train: {lr_schedular: cosine}\n") ==
        "recipe.yaml: unknown key 'train.lr_schedular'; did you mean 'train.lr_scheduler'?");
  CHECK(in_file("train: {grad_accum_steps: 2}\n") ==
        "recipe.yaml: unknown key 'train.grad_accum_steps'; did you mean 'train.gradient_accumulation_steps'?");
  CHECK(in_file("train: {dropout: 0.1}\n") == "recipe.yaml: unknown key 'train.dropout'; did you mean 'lora.dropout'?");
  CHECK(in_file("lora: {rank: 4}\n") == "recipe.yaml: unknown key 'lora.rank'; did you mean 'lora.r'?");
  CHECK(in_file("lora: {lora_alpha: 32}\n") ==
        "recipe.yaml: unknown key 'lora.lora_alpha'; did you mean 'lora.alpha'?");
  CHECK(in_file("checkpoint: {epoch_to_save: all}\n") ==
        "recipe.yaml: unknown key 'checkpoint.epoch_to_save'; did you mean 'checkpoint.epochs_to_save'?");
  CHECK(in_file("checkpoint: {path: out}\n") ==
        "recipe.yaml: unknown key 'checkpoint.path'; did you mean 'checkpoint.output_dir'?");
  CHECK(error_of("model: {path: /m, name: x}\n") ==
        "recipe.yaml: unknown key 'model.name'; did you mean 'model.path'?");
  CHECK(in_file("track: {log_every: 10}\n") ==
        "recipe.yaml: unknown key 'track.log_every'; did you mean 'track.log_every_n_steps'?");
  CHECK(in_file("dist: {zzz: 1}\n") ==
        "recipe.yaml: unknown key 'dist.zzz'; the keys of 'dist' are backend, timeout_s, debug_checksum_every_n_steps, "
        "bucket_mb, shard_base, shard_base_prefetch");
}

TEST_CASE("unknown sections name the closest section, or the key they hold") {
  CHECK(error_of(kBase + "trian: {lr: 1}\n") == "recipe.yaml: unknown section 'trian'; did you mean 'train'?");
  CHECK(error_of(kBase + "training: {lr: 1}\n") == "recipe.yaml: unknown section 'training'; did you mean 'train'?");
  CHECK(error_of(kBase + "checkpoints: {}\n") ==
        "recipe.yaml: unknown section 'checkpoints'; did you mean 'checkpoint'?");
  CHECK(error_of(kBase + "optimizer: {}\n") == "recipe.yaml: unknown section 'optimizer'; did you mean 'train'?");
  CHECK(error_of(kBase + "lr: 1e-4\n") == "recipe.yaml: unknown key 'lr'; did you mean 'train.lr'?");
  CHECK(error_of(kBase + "learning_rate: 1e-4\n") ==
        "recipe.yaml: unknown key 'learning_rate'; did you mean 'train.lr'?");
  CHECK(error_of(kBase + "zzz: 1\n") ==
        "recipe.yaml: unknown section 'zzz'; the sections are model, lora, moe, data, train, preference, grpo, "
        "checkpoint, "
        "dist, track, "
        "eval, adapters");
}

TEST_CASE("the shape of the file is checked before its values") {
  CHECK(error_of("- a\n- b\n") ==
        "recipe.yaml: a recipe is a mapping of sections (model:, lora:, data:, train:, checkpoint:, dist:, track:), "
        "got [a, b]");
  CHECK(error_of(kBase + "train: 5\n") ==
        "recipe.yaml: section 'train' must be a mapping of keys, got '5'; write its keys indented below 'train:' "
        "(e.g. train: {epochs: …})");
  CHECK(error_of(kBase + "model: {dtype: fp32}\n") ==
        "recipe.yaml: section 'model' appears twice; merge its keys under one 'model:'");
  CHECK(error_of("model:\n  path: a\n  path: b\n") == "recipe.yaml: model.path appears twice; keep one");
  CHECK(error_of("") ==
        "recipe.yaml: model.path must be set to a HF model directory, a model id in the local HF cache or a .gguf file "
        "(e.g. model.path: /models/opt-125m)");
  // An empty section is allowed: every key keeps its default.
  CHECK(load(kBase + "lora:\ntrain:\n").lora.r == 8);
}

TEST_CASE("wrong types name the key, the value and an example") {
  const auto in_file = [](const std::string& yaml) { return error_of(kBase + yaml); };
  CHECK(in_file("train: {lr: fast}\n") == "recipe.yaml: train.lr must be a number, got 'fast' (e.g. train.lr: 0.0002)");
  CHECK(in_file("train: {epochs: three}\n") ==
        "recipe.yaml: train.epochs must be a whole number, got 'three' (e.g. train.epochs: 3)");
  CHECK(in_file("train: {max_steps_per_epoch: [1]}\n") ==
        "recipe.yaml: train.max_steps_per_epoch must be a whole number or null, got [1] "
        "(e.g. train.max_steps_per_epoch: 100)");
  CHECK(in_file("lora: {use_rslora: maybe}\n") == "recipe.yaml: lora.use_rslora must be true or false, got 'maybe'");
  CHECK(in_file("lora: {target_modules: q_proj}\n") ==
        "recipe.yaml: lora.target_modules must be a list of module names or all-linear, got 'q_proj' "
        "(e.g. lora.target_modules: [q_proj, v_proj])");
  CHECK(in_file("lora: {target_modules: [q_proj, [v_proj]]}\n") ==
        "recipe.yaml: lora.target_modules must be a list of module names or all-linear, got [q_proj, [v_proj]] "
        "(e.g. lora.target_modules: [q_proj, v_proj])");
  CHECK(error_of("model: {path: [a, b]}\n") ==
        "recipe.yaml: model.path must be a string, got [a, b] (e.g. model.path: /models/opt-125m)");
  CHECK(error_of("model: {path: /m}\ndata: {database: d, collection: c, prompt_template: x, filter: [1]}\n") ==
        "recipe.yaml: data.filter must be a mapping (a MongoDB query such as {split: train}), got [1]");
  CHECK(in_file("checkpoint: {epochs_to_save: some}\n") ==
        "recipe.yaml: checkpoint.epochs_to_save must be all, none or a list of 0-based epoch indices, got 'some' "
        "(e.g. checkpoint.epochs_to_save: [0, 2])");
}

TEST_CASE("enum keys list their values") {
  const std::vector<std::pair<std::string, std::string>> cases{
      {"train.lr_scheduler=exponential", "train.lr_scheduler must be one of cosine|linear|constant, got 'exponential'"},
      {"model.dtype=float32", "model.dtype must be one of bf16|fp16|fp32|auto, got 'float32'"},
      {"model.device=gpu", "model.device must be one of auto|cuda|cpu, got 'gpu'"},
      {"data.source=postgres", "data.source must be one of mongodb|jsonl, got 'postgres'"},
      {"data.format=alpaca",
       "data.format must be one of instruction|text|chat|preference|unpaired|prompt, got 'alpaca'"},
      {"data.chat_format=vicuna", "data.chat_format must be one of chatml|llama3|mistral|template, got 'vicuna'"},
      {"data.overlong=wrap", "data.overlong must be one of truncate|skip, got 'wrap'"},
      {"data.bad_documents=ignore", "data.bad_documents must be one of skip|fail, got 'ignore'"},
      {"data.shuffle=random", "data.shuffle must be one of global|stream|none, got 'random'"},
      {"dist.backend=mpi", "dist.backend must be one of auto|nccl|gloo, got 'mpi'"},
      {"checkpoint.resume=yes", "checkpoint.resume must be one of auto|never, got 'yes'"},
  };
  for (const auto& [o, message] : cases) {
    INFO(o);
    CHECK(override_error({o}) == "recipe.yaml (override '" + o + "'): " + message);
  }
  CHECK(error_of(kBase + "train: {lr_scheduler: exponential}\n") ==
        "recipe.yaml: train.lr_scheduler must be one of cosine|linear|constant, got 'exponential'");
}

TEST_CASE("out-of-range values name the bound and an example") {
  const std::vector<std::pair<std::string, std::string>> cases{
      {"train.lr=0", "train.lr must be in (0, 1e+30], got 0.0 (e.g. train.lr: 0.0002)"},
      {"train.lr=-1e-4", "train.lr must be in (0, 1e+30], got -0.0001 (e.g. train.lr: 0.0002)"},
      {"train.lr=1e300", "train.lr must be in (0, 1e+30], got 1e+300 (e.g. train.lr: 0.0002)"},
      {"train.epochs=0", "train.epochs must be at least 1, got 0 (e.g. train.epochs: 3)"},
      {"lora.r=0", "lora.r must be at least 1, got 0 (e.g. lora.r: 8)"},
      {"lora.alpha=0", "lora.alpha must be > 0, got 0.0 (e.g. lora.alpha: 16.0)"},
      {"lora.dropout=1", "lora.dropout must be in [0, 1), got 1.0 (e.g. lora.dropout: 0.05)"},
      {"lora.dropout=-0.1", "lora.dropout must be in [0, 1), got -0.1 (e.g. lora.dropout: 0.05)"},
      {"data.batch_size=0", "data.batch_size must be at least 1, got 0 (e.g. data.batch_size: 4)"},
      {"data.max_length=1", "data.max_length must be at least 2, got 1 (e.g. data.max_length: 1024)"},
      {"data.prefetch=-1", "data.prefetch must be at least 0, got -1 (e.g. data.prefetch: 4)"},
      {"data.group_window=0", "data.group_window must be at least 1, got 0 (e.g. data.group_window: 64)"},
      {"data.limit=0", "data.limit must be at least 1 or null, got 0 (e.g. data.limit: 1000)"},
      {"data.shuffle_buffer=0", "data.shuffle_buffer must be at least 1, got 0 (e.g. data.shuffle_buffer: 4096)"},
      {"data.retries=-1", "data.retries must be at least 0, got -1 (e.g. data.retries: 5)"},
      {"data.retry_backoff_s=-1",
       "data.retry_backoff_s must be in [0, 3600] seconds, got -1.0 (e.g. data.retry_backoff_s: 1.0)"},
      {"train.gradient_accumulation_steps=0",
       "train.gradient_accumulation_steps must be at least 1, got 0 (e.g. train.gradient_accumulation_steps: 1)"},
      {"train.warmup_steps=-1", "train.warmup_steps must be at least 0, got -1 (e.g. train.warmup_steps: 0)"},
      {"train.weight_decay=-0.1", "train.weight_decay must be >= 0, got -0.1 (e.g. train.weight_decay: 0.0)"},
      {"train.max_grad_norm=0",
       "train.max_grad_norm must be > 0 or null (no clipping), got 0.0 (e.g. train.max_grad_norm: 1.0)"},
      {"train.max_steps_per_epoch=0",
       "train.max_steps_per_epoch must be at least 1 or null, got 0 (e.g. train.max_steps_per_epoch: 100)"},
      {"train.seed=-1", "train.seed must be at least 0, got -1 (e.g. train.seed: 42)"},
      {"checkpoint.state_every_n_steps=0",
       "checkpoint.state_every_n_steps must be at least 1 or null, got 0 (e.g. checkpoint.state_every_n_steps: 500)"},
      {"dist.timeout_s=0", "dist.timeout_s must be at least 1, got 0 (e.g. dist.timeout_s: 600)"},
      {"dist.debug_checksum_every_n_steps=0",
       "dist.debug_checksum_every_n_steps must be at least 1 or null, got 0 "
       "(e.g. dist.debug_checksum_every_n_steps: 100)"},
      {"track.log_every_n_steps=0",
       "track.log_every_n_steps must be at least 1, got 0 (e.g. track.log_every_n_steps: 1)"},
      {"eval.every_n_steps=0", "eval.every_n_steps must be at least 1 or null, got 0 (e.g. eval.every_n_steps: 500)"},
      {"eval.max_documents=0", "eval.max_documents must be at least 1 or null, got 0 (e.g. eval.max_documents: 1000)"},
      {"eval.batch_size=0", "eval.batch_size must be at least 1 or null, got 0 (e.g. eval.batch_size: 8)"},
  };
  for (const auto& [o, message] : cases) {
    INFO(o);
    CHECK(override_error({o}) == "recipe.yaml (override '" + o + "'): " + message);
  }
  // Boundaries that are allowed.
  const Recipe r = load(kBase, {"lora.dropout=0.0", "data.max_length=2", "data.prefetch=0", "train.warmup_steps=0",
                                "data.retries=0", "data.retry_backoff_s=0"});
  CHECK(r.data.max_length == 2);
  CHECK(r.data.retries == 0);
}

TEST_CASE("lora.target_modules: names, once each, and all-linear alone") {
  CHECK(override_error({"lora.target_modules=[]"}) ==
        "recipe.yaml (override 'lora.target_modules=[]'): lora.target_modules must name at least one module or be "
        "all-linear (e.g. lora.target_modules: [q_proj, v_proj])");
  CHECK(override_error({"lora.target_modules=[q_proj, q_proj]"}) ==
        "recipe.yaml (override 'lora.target_modules=[q_proj, q_proj]'): lora.target_modules lists 'q_proj' twice; "
        "list each module once");
  CHECK(override_error({"lora.target_modules=[all-linear, q_proj]"}) ==
        "recipe.yaml (override 'lora.target_modules=[all-linear, q_proj]'): lora.target_modules lists all-linear "
        "among other names; write lora.target_modules: all-linear alone");
  CHECK(override_error({"lora.target_modules=[q_proj, '']"}) ==
        "recipe.yaml (override 'lora.target_modules=[q_proj, '']'): lora.target_modules has an empty module name; "
        "remove it");
  CHECK(load(kBase, {"lora.target_modules=[all-linear]"}).lora.all_linear());
}

TEST_CASE("checkpoint.epochs_to_save: what the checkpoint policy refuses, and the warning when two keys disagree") {
  CHECK(override_error({"train.epochs=4", "checkpoint.epochs_to_save=[4]"}) ==
        "recipe.yaml (override 'checkpoint.epochs_to_save=[4]'): checkpoint.epochs_to_save lists epoch 4, but epochs "
        "are 0-based and train.epochs is 4, so the valid epochs are 0..3");
  CHECK(error_of(kBase + "train: {epochs: 4}\ncheckpoint: {epochs_to_save: [4]}\n") ==
        "recipe.yaml: checkpoint.epochs_to_save lists epoch 4, but epochs are 0-based and train.epochs is 4, so the "
        "valid epochs are 0..3");
  CHECK(override_error({"checkpoint.epochs_to_save=[-1]"}) ==
        "recipe.yaml (override 'checkpoint.epochs_to_save=[-1]'): checkpoint.epochs_to_save lists epoch -1, but "
        "epochs are 0-based and train.epochs is 3, so the valid epochs are 0..2");
  CHECK(override_error({"checkpoint.epochs_to_save=[a]"}) ==
        "recipe.yaml (override 'checkpoint.epochs_to_save=[a]'): checkpoint.epochs_to_save must be all, none or a "
        "list of 0-based epoch indices, got [a] (e.g. checkpoint.epochs_to_save: [0, 2])");
  CHECK(override_error({"checkpoint.epochs_to_save=[1, 1]"}) ==
        "recipe.yaml (override 'checkpoint.epochs_to_save=[1, 1]'): checkpoint.epochs_to_save lists epoch 1 twice; "
        "list each epoch once");
  CHECK(override_error({"checkpoint.epochs_to_save=[1.5]"}) ==
        "recipe.yaml (override 'checkpoint.epochs_to_save=[1.5]'): checkpoint.epochs_to_save must be all, none or a "
        "list of 0-based epoch indices, got [1.5] (e.g. checkpoint.epochs_to_save: [0, 2])");
  const Recipe r =
      load(kBase + "train: {epochs: 4}\ncheckpoint: {epochs_to_save: [1, 3], save_last_epoch_only: true}\n");
  REQUIRE(r.warnings.size() == 1);
  CHECK(r.warnings[0] ==
        "recipe.yaml: checkpoint.save_last_epoch_only: true takes precedence over checkpoint.epochs_to_save: "
        "[1, 3]; only epoch_3/ is kept (remove one of the two keys)");
  CHECK(load(kBase, {"checkpoint.epochs_to_save=none", "checkpoint.save_last_epoch_only=true"}).warnings.size() == 1);
  CHECK(load(kBase, {"checkpoint.save_last_epoch_only=true"}).warnings.empty());
}

TEST_CASE("requirements that depend on the source and the format") {
  const std::string model = "model: {path: /m}\n";
  CHECK(error_of(model + "data: {collection: c, prompt_template: x}\n") ==
        "recipe.yaml: data.database must be set for data.source: mongodb (e.g. data.database: training)");
  CHECK(error_of(model + "data: {database: d, prompt_template: x}\n") ==
        "recipe.yaml: data.collection must be set for data.source: mongodb (e.g. data.collection: examples)");
  CHECK(error_of(model + "data: {source: jsonl, prompt_template: x}\n") ==
        "recipe.yaml: data.path must be set for data.source: jsonl (e.g. data.path: data/train.jsonl)");
  CHECK(load(model + "data: {source: jsonl, path: train.jsonl, prompt_template: x}\n").data.path == "train.jsonl");
  CHECK(error_of(model + "data: {database: d, collection: c}\n") ==
        "recipe.yaml: data.prompt_template must be set for data.format: instruction (e.g. data.prompt_template: "
        "\"### Instruction:\\n{instruction}\\n\\n### Response:\\n\")");
  CHECK(override_error({"data.response_field="}) ==
        "recipe.yaml (override 'data.response_field='): data.response_field must be set for data.format: "
        "instruction (e.g. data.response_field: output)");
  CHECK(override_error({"data.format=text", "data.text_field="}) ==
        "recipe.yaml (override 'data.text_field='): data.text_field must be set for data.format: text "
        "(e.g. data.text_field: text)");
  CHECK(override_error({"data.format=chat", "data.messages_field="}) ==
        "recipe.yaml (override 'data.messages_field='): data.messages_field must be set for data.format: chat "
        "(e.g. data.messages_field: messages)");
  // Text and chat recipes need no template.
  CHECK(load(model + "data: {database: d, collection: c, format: text}\n").data.format == Format::Text);
  CHECK(error_of(kBase, {"model.path="}) ==
        "recipe.yaml (override 'model.path='): model.path must be set to a HF model directory, a model id in the "
        "local HF cache or a .gguf file (e.g. model.path: /models/opt-125m)");
  CHECK(override_error({"model.device=cpu", "dist.backend=nccl"}) ==
        "recipe.yaml (override 'dist.backend=nccl'): dist.backend is nccl, which needs CUDA, but model.device is "
        "cpu; use dist.backend: gloo (or auto)");
}

TEST_CASE("data.uri comes from LORARUN_MONGODB_URI when the recipe has none") {
  setenv("LORARUN_MONGODB_URI", "mongodb://env-user:env-pw@envhost:27017/", 1);
  const Recipe from_env = recipe_from_yaml(YAML::Load(kBase), {});
  const Recipe explicit_uri = recipe_from_yaml(YAML::Load(kBase), {"data.uri=mongodb://h2/"});
  unsetenv("LORARUN_MONGODB_URI");
  CHECK(from_env.data.uri == "mongodb://env-user:env-pw@envhost:27017/");
  CHECK(explicit_uri.data.uri == "mongodb://h2/");
  CHECK(load(kBase).data.uri.empty());
}

TEST_CASE("data.filter keeps MongoDB's extended JSON and YAML's types") {
  const Recipe r = load(R"(
model: {path: /m}
data:
  database: d
  collection: c
  prompt_template: "{instruction}"
  filter:
    _id: {"$oid": "64b7f0c2a1b2c3d4e5f60718"}
    created: {$gte: {"$date": "2024-01-01T00:00:00Z"}}
    split: train
    quoted: "42"
    n: 3
    score: {$gt: 0.5}
    flag: true
    none: null
    tags: {$in: [a, b]}
)");
  const nlohmann::json expected = nlohmann::json::parse(R"({
    "_id": {"$oid": "64b7f0c2a1b2c3d4e5f60718"},
    "created": {"$gte": {"$date": "2024-01-01T00:00:00Z"}},
    "split": "train", "quoted": "42", "n": 3, "score": {"$gt": 0.5}, "flag": true, "none": null,
    "tags": {"$in": ["a", "b"]}})");
  CHECK(r.data.filter == expected);
  CHECK(r.data.filter["n"].is_number_integer());
  CHECK(r.data.filter["quoted"].is_string());
  CHECK(error_of("model: {path: /m}\ndata: {database: d, collection: c, prompt_template: x, filter: {a: 1, a: 2}}\n") ==
        "recipe.yaml: data.filter has the key 'a' twice; keep one");
}

TEST_CASE("prompt templates: placeholders, escaped braces, unbalanced braces") {
  const Recipe r = load(kBase, {"data.prompt_template={instruction} {{literal}} {input} {instruction}"});
  CHECK(r.data.template_fields() == Strings{"instruction", "input"});
  CHECK(parse_template("a {x} {{b}} c") == std::vector<TemplatePart>{{false, "a "}, {true, "x"}, {false, " {b} c"}});
  CHECK(parse_template("{{{x}}}") == std::vector<TemplatePart>{{false, "{"}, {true, "x"}, {false, "}"}});
  CHECK(parse_template("").empty());

  CHECK(override_error({"data.prompt_template=### {instruction"}) ==
        "recipe.yaml (override 'data.prompt_template=### {instruction'): data.prompt_template has an unmatched '{' "
        "at character 5; close the placeholder with } or write {{ for a literal brace");
  CHECK(override_error({"data.prompt_template=a } b"}) ==
        "recipe.yaml (override 'data.prompt_template=a } b'): data.prompt_template has an unmatched '}' at "
        "character 3; write }} for a literal brace");
  CHECK(override_error({"data.prompt_template=é {a{b}"}) ==
        "recipe.yaml (override 'data.prompt_template=é {a{b}'): data.prompt_template has an unmatched '{' at "
        "character 3; close the placeholder with } or write {{ for a literal brace");
  CHECK(override_error({"data.prompt_template=x {}"}) ==
        "recipe.yaml (override 'data.prompt_template=x {}'): data.prompt_template has an empty placeholder {} at "
        "character 3; name a document field such as {instruction}");
  CHECK_THROWS_WITH(parse_template("{"),
                    "the prompt template has an unmatched '{' at character 1; close the "
                    "placeholder with } or write {{ for a literal brace");
}

TEST_CASE("files: a missing file, a directory, malformed YAML, the output_dir default") {
  TempDir tmp;
  CHECK_THROWS_WITH(load_recipe((tmp.dir / "nope.yaml").string()),
                    "the recipe " + (tmp.dir / "nope.yaml").string() + " cannot be read: No such file or directory");
  const std::string fifo = (tmp.dir / "fifo.yaml").string();
  REQUIRE(mkfifo(fifo.c_str(), 0600) == 0);  // no writer: reading it would wait for ever
  CHECK_THROWS_WITH(load_recipe(fifo), "the recipe " + fifo + " cannot be read: it is a FIFO, not a file");
  CHECK_THROWS_WITH(load_recipe(tmp.dir.string()),
                    tmp.dir.string() + ": is a directory, not a recipe; give a .yaml file (see configs/)");

  const std::string bad = tmp.write("bad.yaml", "model:\n  path: m\n  dtype: bf16\n train:\n  lr: 1\n");
  CHECK_THROWS_WITH(load_recipe(bad), bad +
                                          ": malformed YAML at line 4, column 2: end of map not found (check the "
                                          "indentation, colons and quotes there)");
  const std::string flow = tmp.write("flow.yaml", "model: {path: m\n");
  CHECK_THROWS_WITH(load_recipe(flow), flow +
                                           ": malformed YAML at line 2, column 1: end of map flow not found "
                                           "(check the indentation, colons and quotes there)");

  const std::string unknown = tmp.write("my-run.yaml", kBase + "train:\n  learning_rate: 1e-4\n");
  CHECK_THROWS_WITH(load_recipe(unknown), unknown + ": unknown key 'train.learning_rate'; did you mean 'train.lr'?");

  const std::string good = tmp.write("llama-run.yaml", kBase);
  unsetenv("LORARUN_MONGODB_URI");
  CHECK(load_recipe(good).checkpoint.output_dir == "runs/llama-run");
  CHECK(load_recipe(good, {"checkpoint.output_dir=/out"}).checkpoint.output_dir == "/out");
}

TEST_CASE("secrets: the password of data.uri never appears in to_yaml, to_json or messages") {
  const std::string uri = "mongodb://alice:s3cr3t-pw@db.example:27017/?authSource=admin";
  const Recipe r = load(kBase, {"data.uri=" + uri});
  CHECK(r.data.uri == uri);  // the loaded recipe keeps it, to connect with

  const std::string yaml = to_yaml(r);
  CHECK(yaml.find("s3cr3t-pw") == std::string::npos);
  CHECK(yaml.find("uri: \"mongodb://alice:****@db.example:27017/?authSource=admin\"") != std::string::npos);
  const std::string json = to_json(r).dump();
  CHECK(json.find("s3cr3t-pw") == std::string::npos);
  CHECK(to_json(r)["data"]["uri"] == "mongodb://alice:****@db.example:27017/?authSource=admin");
  CHECK(to_yaml(r, false).find("s3cr3t-pw") != std::string::npos);  // only when asked

  const std::string message = override_error({"data.uri=" + uri, "data.database="});
  CHECK(message.find("s3cr3t-pw") == std::string::npos);
  CHECK(override_error({"data.uri=" + uri, "train.lr=x"}).find("s3cr3t-pw") == std::string::npos);
  CHECK(override_error({"data.uri=" + uri, "data.uri.x=1"}) ==
        "recipe.yaml (override 'data.uri.x=1'): data.uri has no sub-keys; write data.uri=VALUE");
  CHECK(override_error({"data.uri=[" + uri + "]"}).find("s3cr3t-pw") == std::string::npos);
}

TEST_CASE("track.mlflow_uri: http(s) only, its password hidden, the experiment as MLflow's client picks it") {
  unsetenv("MLFLOW_EXPERIMENT_NAME");
  const Recipe r = load(kBase, {"track.mlflow_uri=http://bob:hunter2@mlflow.example:5000"});
  CHECK(r.track.mlflow_uri == "http://bob:hunter2@mlflow.example:5000");  // kept, to connect with
  CHECK(r.track.mlflow_experiment == "Default");                          // MLflow's own default experiment
  CHECK(to_yaml(r).find("hunter2") == std::string::npos);
  CHECK(to_json(r)["track"]["mlflow_uri"] == "http://bob:****@mlflow.example:5000");
  CHECK(to_json(r)["track"]["mlflow_experiment"] == "Default");
  setenv("MLFLOW_EXPERIMENT_NAME", "from-env", 1);
  CHECK(load(kBase, {"track.mlflow_uri=http://h:5000"}).track.mlflow_experiment == "from-env");
  CHECK(load(kBase, {"track.mlflow_uri=http://h:5000", "track.mlflow_experiment=mine"}).track.mlflow_experiment ==
        "mine");
  CHECK(load(kBase).track.mlflow_experiment.empty());  // no MLflow, nothing resolved
  unsetenv("MLFLOW_EXPERIMENT_NAME");
  CHECK(override_error({"track.mlflow_uri=file:./mlruns"}) ==
        "recipe.yaml (override 'track.mlflow_uri=file:./mlruns'): track.mlflow_uri is 'file:./mlruns', not an "
        "http(s):// URI: give the address of a tracking server (`mlflow server --host 0.0.0.0 --port 5000` serves "
        "one at http://HOST:5000), or \"\" for no MLflow");
  const std::string message = override_error({"track.mlflow_uri=postgresql://u:pg-secret@db/mlflow"});
  CHECK(message.find("pg-secret") == std::string::npos);
  CHECK(message.find("postgresql://u:****@db/mlflow") != std::string::npos);
}

TEST_CASE("round trip: to_yaml and to_json load back to an equal recipe") {
  const Recipe r = load(R"(
model: {path: "/models/with \"quotes\" and: colons", dtype: fp16, device: cuda}
lora: {r: 32, alpha: 64, dropout: 0.1, target_modules: all-linear, use_rslora: true, quantize_base: true,
       double_quant: false}
data:
  source: mongodb
  uri: "mongodb://u:p%40ss@h:27017/?replicaSet=rs0"
  database: d
  collection: c
  filter: {_id: {"$oid": "64b7f0c2a1b2c3d4e5f60718"}, n: {$gte: 3}, s: "007", f: 2.5, "key with space": [1, x]}
  limit: 1000
  prompt_template: "Tab\there, unicode ü → ✓, {{literal}}, {instruction}\n\n"
  response_field: answer
  train_on_input: true
  max_length: 77
  overlong: skip
  bad_documents: fail
  shuffle: stream
  packing: true
  batch_size: 3
  prefetch: 0
train: {epochs: 5, gradient_accumulation_steps: 7, lr: 3.0e-5, weight_decay: 0.01, lr_scheduler: linear,
        warmup_steps: 11, max_grad_norm: null, max_steps_per_epoch: 13, seed: 7, activation_checkpointing: true}
checkpoint: {output_dir: out/x, epochs_to_save: [4, 0], state_every_n_steps: 17, resume: never,
             keep_resume_state: true}
dist: {backend: gloo, timeout_s: 19, debug_checksum_every_n_steps: 23}
track: {mongodb: false, database: runs_db, log_every_n_steps: 29, mlflow_uri: "https://u:pw@mlflow.example/x",
        mlflow_experiment: "exp \"1\""}
)");
  CHECK(r.train.lr == 3.0e-5);
  const Recipe from_yaml = load(to_yaml(r, false));
  CHECK(from_yaml == r);
  const Recipe from_json = recipe_from_json(to_json(r, false));
  CHECK(from_json == r);
  CHECK(to_yaml(from_yaml, false) == to_yaml(r, false));
  // Redacted output loads too (with the password replaced).
  CHECK(load(to_yaml(r)).data.uri == "mongodb://u:****@h:27017/?replicaSet=rs0");
  // A default recipe and its text.
  const Recipe defaults = load(kBase);
  CHECK(load(to_yaml(defaults)) == defaults);
  CHECK(
      to_yaml(defaults).starts_with("model:\n  path: \"/models/m\"\n  dtype: bf16\n  device: auto\n"
                                    "  keep_quantized: false\nlora:\n  r: 8\n"
                                    "  alpha: 16.0\n  dropout: 0.0\n  target_modules: [\"q_proj\", \"v_proj\"]\n"));
  CHECK(to_yaml(defaults).find("\ntrain:\n  epochs: 3\n  gradient_accumulation_steps: 1\n  lr: 0.0002\n") !=
        std::string::npos);
  CHECK(to_json(defaults)["checkpoint"]["epochs_to_save"] == "all");
  CHECK(to_json(r)["checkpoint"]["epochs_to_save"] == nlohmann::json{4, 0});
  CHECK(to_json(r)["lora"]["target_modules"] == "all-linear");
}

TEST_CASE("every recipe in configs/ loads and round-trips") {
  unsetenv("LORARUN_MONGODB_URI");
  std::vector<fs::path> files;
  for (const auto& entry : fs::directory_iterator(LORARUN_CONFIGS_DIR))
    if (entry.path().extension() == ".yaml" || entry.path().extension() == ".yml") files.push_back(entry.path());
  std::sort(files.begin(), files.end());
  REQUIRE(files.size() >= 5);
  for (const fs::path& f : files) {
    INFO(f.string());
    Recipe r;
    REQUIRE_NOTHROW(r = load_recipe(f.string()));
    CHECK(r.warnings.empty());
    CHECK(recipe_from_yaml(YAML::Load(to_yaml(r, false)), {}, f.string()) == r);
  }
  const auto config = [](const std::string& name) {
    return load_recipe(std::string(LORARUN_CONFIGS_DIR) + "/" + name);
  };
  const Recipe alpaca = config("opt-125m-alpaca.yaml");
  CHECK(alpaca.model.path == "facebook/opt-125m");
  CHECK(alpaca.data.template_fields() == Strings{"instruction", "input"});
  CHECK(alpaca.data.response_field == "output");
  CHECK(config("llama3-8b-qlora-1gpu.yaml").lora.quantize_base);
  CHECK(config("qwen2.5-chat.yaml").data.format == Format::Chat);
  CHECK(config("qwen2.5-chat.yaml").data.chat_format == ChatFormat::ChatML);
  CHECK(config("qwen3-chat-template.yaml").data.chat_format == ChatFormat::Template);
  CHECK(config("qwen3-chat-template.yaml").data.chat_template_kwargs.value("enable_thinking", true) == false);
  CHECK(config("quickstart.yaml").checkpoint.output_dir == "runs/quickstart");
  // The annotated reference recipe spells out every key.
  const YAML::Node all = YAML::LoadFile(std::string(LORARUN_CONFIGS_DIR) + "/opt-125m-alpaca.yaml");
  for (const std::string& key : known_keys()) {
    INFO(key);
    const size_t dot = key.find('.');
    CHECK(all[key.substr(0, dot)][key.substr(dot + 1)].IsDefined());
  }
}

TEST_CASE("validate() checks a recipe built in code, naming the given file") {
  Recipe r;
  r.model.path = "/m";
  r.data.database = "d";
  r.data.collection = "c";
  r.data.prompt_template = "{instruction}";
  CHECK_THROWS_WITH(validate(r),
                    "recipe.yaml: checkpoint.output_dir must be set to the directory for the epoch_<i>/ checkpoints "
                    "(e.g. checkpoint.output_dir: runs/my-run)");
  r.checkpoint.output_dir = "runs/x";
  CHECK(validate(r).empty());
  r.train.epochs = 2;
  r.checkpoint.epochs_to_save = {EpochsToSave::Mode::List, {2}};
  CHECK_THROWS_WITH(validate(r, RecipeOrigin{"mine.yaml", {}}),
                    "mine.yaml: checkpoint.epochs_to_save lists epoch 2, but epochs are 0-based and train.epochs is "
                    "2, so the valid epochs are 0..1");
  // A run record's JSON, with overrides on top (lora-train --from-run ID key=value…).
  r.checkpoint.epochs_to_save = {EpochsToSave::Mode::List, {1}};
  const Recipe again = recipe_from_json(to_json(r), {"train.lr=1e-3"});
  CHECK(again.train.lr == 1e-3);
  CHECK(again.checkpoint.epochs_to_save.epochs == std::vector<int>{1});
  CHECK_THROWS_WITH(recipe_from_json(to_json(r), {"train.epochs=1"}),
                    "run record: checkpoint.epochs_to_save lists epoch 1, but epochs are 0-based and train.epochs is "
                    "1, so the valid epochs are 0..0");
}

TEST_CASE("checkpoint.store: mongodb needs track.mongodb and a MongoDB URI") {
  CHECK(load(kBase).checkpoint.store == Store::None);
  CHECK(load(kBase, {"data.uri=mongodb://h/", "checkpoint.store=mongodb"}).checkpoint.store == Store::MongoDB);
  CHECK(override_error({"data.uri=mongodb://h/", "checkpoint.store=mongodb", "track.mongodb=false"}) ==
        "recipe.yaml (override 'checkpoint.store=mongodb'): checkpoint.store is mongodb, which stores the adapters "
        "next to the run record, but track.mongodb is false: set track.mongodb: true or checkpoint.store: none");
  CHECK(override_error({"checkpoint.store=mongodb"}) ==
        "recipe.yaml (override 'checkpoint.store=mongodb'): checkpoint.store is mongodb but no MongoDB URI is set: set "
        "data.uri or LORARUN_MONGODB_URI (and track.database or data.database), or checkpoint.store: none");
  CHECK_THAT(override_error({"checkpoint.store=gridfs"}), Catch::Contains("none") && Catch::Contains("mongodb"));
}

TEST_CASE("train.objective: grpo needs prompts and rewards, with GRPOConfig's names and defaults") {
  const std::string prompts =
      "model: {path: /m}\ndata: {database: d, collection: c, format: prompt}\ntrain: {objective: grpo}\n"
      "grpo: {rewards: [{name: answer, kind: number, field: answer}]}\n";
  const Recipe r = load(prompts);
  CHECK(r.train.objective == Objective::Grpo);
  CHECK(r.grpo.num_generations == 8);
  CHECK(r.grpo.max_completion_length == 512);
  CHECK(r.grpo.temperature == 1.0);
  CHECK(r.grpo.top_p == 1.0);
  CHECK(r.grpo.top_k == 0);
  CHECK(r.grpo.beta == 0.0);
  CHECK(r.grpo.epsilon == 0.2);
  CHECK(!r.grpo.epsilon_high);
  CHECK(r.grpo.loss_type == GrpoLoss::Dapo);
  CHECK(r.grpo.importance_sampling_level == ImportanceLevel::Token);
  CHECK(r.grpo.scale_rewards == RewardScale::Group);
  CHECK(r.grpo.rewards.size() == 1);
  CHECK(r.grpo.rewards[0]["kind"] == "number");
  // the rewards survive a run record's JSON, and an override replaces the list
  CHECK(recipe_from_json(to_json(r), {}).grpo == r.grpo);
  CHECK(load(prompts, {"grpo.rewards=[{name: a, kind: exact, field: x}, {name: b, kind: json}]"}).grpo.rewards.size() ==
        2);
  CHECK_THAT(error_of(prompts, {"grpo.rewards=answer"}), Catch::Contains("grpo.rewards must be a list of rewards"));
  CHECK_THAT(error_of(prompts, {"grpo.rewards=[answer]"}), Catch::Contains("a list of mappings, one per reward"));
  CHECK_THAT(error_of(prompts, {"grpo.rewards=[]"}), Catch::Contains("grpo.rewards must list at least one reward"));
  CHECK_THAT(error_of(prompts, {"data.format=instruction", "data.prompt_template=x"}),
             Catch::Contains("train.objective is grpo, which samples its own completions of prompts, but data.format "
                             "is instruction"));
  CHECK_THAT(error_of(prompts, {"train.objective=sft"}),
             Catch::Contains("train.objective is sft, but grpo: keys are set"));
  CHECK_THAT(error_of("model: {path: /m}\ndata: {database: d, collection: c, format: prompt}\n"),
             Catch::Contains("data.format: prompt gives prompts without completions: set train.objective: grpo"));
  CHECK_THAT(error_of(prompts, {"grpo.num_generations=1"}), Catch::Contains("grpo.num_generations must be at least 2"));
  CHECK_THAT(error_of(prompts, {"grpo.num_iterations=0"}), Catch::Contains("grpo.num_iterations must be at least 1"));
  CHECK_THAT(error_of(prompts, {"grpo.loss_type=ppo"}), Catch::Contains("grpo.loss_type"));
  CHECK_THAT(error_of(prompts, {"grpo.top_p=0"}), Catch::Contains("grpo.top_p must be"));
  CHECK_THAT(error_of(prompts, {"preference.beta=0.2"}), Catch::Contains("grpo's own are under grpo:"));
  CHECK_THAT(error_of(prompts, {"data.packing=true"}), Catch::Contains("grpo does not pack its completions"));
}

TEST_CASE("train.objective: dpo, orpo, cpo and simpo need pairs, and the preference: keys belong to them") {
  const std::string pairs = "model: {path: /m}\ndata: {database: d, collection: c, format: preference}\n";
  const Recipe r = load(pairs, {"train.objective=dpo", "preference.loss_type=hinge", "preference.rpo_alpha=0.5"});
  CHECK(r.train.objective == Objective::Dpo);
  CHECK(r.preference.loss_type == PreferenceLoss::Hinge);
  CHECK(r.preference.rpo_alpha == 0.5);
  CHECK(r.preference.beta == 0.1);
  CHECK(r.data.chosen_field == "chosen");
  CHECK(load(kBase).train.objective == Objective::Sft);
  CHECK_THAT(error_of(pairs), Catch::Contains("train.objective is sft, but data.format: preference"));
  CHECK_THAT(override_error({"train.objective=dpo"}),
             Catch::Contains("train.objective dpo trains on pairs of a chosen and a rejected completion, but "
                             "data.format is instruction"));
  CHECK_THAT(override_error({"preference.beta=0.2"}),
             Catch::Contains("train.objective is sft, but preference: keys are set"));
  CHECK_THAT(error_of(pairs, {"train.objective=dpo", "preference.loss_type=ipo", "preference.label_smoothing=0.1"}),
             Catch::Contains("preference.label_smoothing applies to preference.loss_type sigmoid and simpo only"));
  CHECK_THAT(error_of(pairs, {"train.objective=dpo", "data.packing=true"}), Catch::Contains("does not pack pairs"));
  CHECK_THAT(error_of(pairs, {"train.objective=dpo", "data.rejected_field=chosen"}),
             Catch::Contains("data.chosen_field and data.rejected_field are both 'chosen'"));
  for (const char* beta : {"preference.beta=0", "preference.beta=1e-300", "preference.beta=1e300"})
    CHECK_THAT(error_of(pairs, {"train.objective=dpo", beta}),
               Catch::Contains("preference.beta must be in [0.0001, 1000], got"));
  CHECK(load(pairs, {"train.objective=orpo", "preference.beta=0.2"}).train.objective == Objective::Orpo);
  CHECK_THAT(error_of(pairs, {"train.objective=orpo", "preference.loss_type=ipo"}),
             Catch::Contains("train.objective is orpo, which has no reference and its own loss"));
  CHECK_THAT(error_of(pairs, {"train.objective=ppo"}), Catch::Contains("sft|dpo|orpo|cpo|simpo|kto"));
  // CPO and SimPO: TRL's CPOTrainer's keys, and what belongs to DPO alone
  const Recipe cpo = load(pairs, {"train.objective=cpo", "preference.loss_type=simpo", "preference.cpo_alpha=0.5",
                                  "preference.simpo_gamma=1.0", "preference.label_smoothing=0.1"});
  CHECK(cpo.train.objective == Objective::Cpo);
  CHECK(cpo.preference.loss_type == PreferenceLoss::Simpo);
  CHECK(cpo.preference.cpo_alpha == 0.5);
  CHECK(cpo.preference.simpo_gamma == 1.0);
  CHECK(load(pairs, {"train.objective=simpo", "preference.beta=2.0"}).preference.cpo_alpha == std::nullopt);
  CHECK_THAT(error_of(pairs, {"train.objective=dpo", "preference.loss_type=simpo"}),
             Catch::Contains("preference.loss_type simpo is a loss without a reference (TRL's CPOTrainer): set "
                             "train.objective: simpo"));
  CHECK_THAT(error_of(pairs, {"train.objective=dpo", "preference.cpo_alpha=1"}),
             Catch::Contains("preference.cpo_alpha applies to train.objective cpo and simpo"));
  CHECK_THAT(error_of(pairs, {"train.objective=cpo", "preference.rpo_alpha=1"}),
             Catch::Contains("preference.rpo_alpha is DPO's NLL weight"));
  CHECK_THAT(error_of(pairs, {"train.objective=simpo", "preference.loss_type=hinge"}),
             Catch::Contains("train.objective simpo is the simpo loss: set train.objective: cpo for CPO's hinge"));
  CHECK_THAT(error_of(pairs, {"train.objective=cpo", "preference.simpo_gamma=1"}),
             Catch::Contains("preference.simpo_gamma is SimPO's margin"));
  CHECK_THAT(error_of(pairs, {"train.objective=orpo", "preference.cpo_alpha=1"}),
             Catch::Contains("train.objective is orpo"));
  CHECK_THAT(error_of(kBase, {"train.objective=simpo"}), Catch::Contains("train.objective simpo trains on pairs"));
}

TEST_CASE("train.objective: kto needs labelled completions, and its keys belong to it") {
  const std::string unpaired = "model: {path: /m}\ndata: {database: d, collection: c, format: unpaired}\n";
  const Recipe r = load(
      unpaired, {"train.objective=kto", "preference.desirable_weight=1.33", "preference.loss_type=apo_zero_unpaired"});
  CHECK(r.train.objective == Objective::Kto);
  CHECK(r.data.completion_field == "completion");
  CHECK(r.data.label_field == "label");
  CHECK(r.preference.desirable_weight == 1.33);
  CHECK(r.preference.undesirable_weight == 1.0);
  CHECK(r.preference.loss_type == PreferenceLoss::ApoZeroUnpaired);
  CHECK_THAT(error_of(unpaired), Catch::Contains("train.objective is sft, but data.format: unpaired gives labelled "
                                                 "completions: set train.objective: kto"));
  CHECK_THAT(error_of(unpaired, {"train.objective=dpo"}),
             Catch::Contains("train.objective is dpo, which trains on pairs, but data.format: unpaired"));
  CHECK_THAT(override_error({"train.objective=kto"}),
             Catch::Contains("train.objective is kto, which trains on single completions marked desirable or not, "
                             "but data.format is instruction: set data.format: unpaired"));
  CHECK_THAT(error_of(unpaired, {"train.objective=kto", "preference.loss_type=hinge"}),
             Catch::Contains("preference.loss_type is hinge, a loss of pairs"));
  CHECK_THAT(error_of(unpaired, {"train.objective=kto", "preference.rpo_alpha=1"}),
             Catch::Contains("remove label_smoothing, rpo_alpha, cpo_alpha and simpo_gamma"));
  CHECK_THAT(error_of(unpaired, {"train.objective=kto", "data.batch_size=1"}),
             Catch::Contains("needs 2 examples a step at least"));
  CHECK(load(unpaired, {"train.objective=kto", "data.batch_size=1", "train.gradient_accumulation_steps=2"})
            .data.batch_size == 1);
  CHECK_THAT(error_of(unpaired, {"train.objective=kto", "data.label_field=completion"}),
             Catch::Contains("data.label_field is 'completion', a field that holds text here"));
  CHECK_THAT(error_of(unpaired, {"train.objective=kto", "preference.desirable_weight=0"}),
             Catch::Contains("preference.desirable_weight must be"));
  const std::string pairs = "model: {path: /m}\ndata: {database: d, collection: c, format: preference}\n";
  CHECK_THAT(error_of(pairs, {"train.objective=dpo", "preference.undesirable_weight=2"}),
             Catch::Contains("preference.undesirable_weight applies to train.objective kto only, not dpo"));
  CHECK_THAT(error_of(pairs, {"train.objective=simpo", "preference.precompute_reference=true"}),
             Catch::Contains("preference.precompute_reference applies to train.objective dpo and kto, whose losses "
                             "compare with a reference; simpo has none"));
  CHECK(
      load(unpaired, {"train.objective=kto", "preference.precompute_reference=true"}).preference.precompute_reference);
  CHECK_THAT(error_of(pairs, {"train.objective=dpo", "preference.loss_type=kto"}),
             Catch::Contains("preference.loss_type kto is a loss of labelled single completions"));
  CHECK_THAT(error_of(pairs, {"train.objective=kto"}), Catch::Contains("but data.format is preference"));
}

TEST_CASE("lora.use_dora and lora.plus_lr_ratio: their defaults, and what they refuse in one line") {
  const Recipe plain = load(kBase);
  CHECK_FALSE(plain.lora.use_dora);
  CHECK_FALSE(plain.lora.plus_lr_ratio);
  const Recipe r = load(kBase, {"lora.use_dora=true", "lora.plus_lr_ratio=16"});
  CHECK(r.lora.use_dora);
  CHECK(r.lora.plus_lr_ratio == 16.0);
  for (const char* bad : {"lora.plus_lr_ratio=0", "lora.plus_lr_ratio=-2", "lora.plus_lr_ratio=1e300"})
    CHECK_THAT(override_error({bad}), Catch::Contains("lora.plus_lr_ratio must be in [0.001, 10000] or null, got"));
  CHECK(load(kBase, {"lora.use_dora=true", "dist.shard_base=true"}).dist.shard_base);  // each W gathered whole
}

TEST_CASE("lora.init: PEFT's names, and what each refuses in one line") {
  CHECK(load(kBase).lora.init == "default");
  for (const char* ok : {"gaussian", "pissa", "pissa_niter_4", "pissa_niter_16", "olora"})
    CHECK(load(kBase, {std::string("lora.init=") + ok}).lora.init == ok);
  const auto refused = [](std::vector<std::string> overrides, const std::string& says) {
    const std::string e = override_error(overrides);
    INFO(e);
    CHECK_THAT(e, Catch::Contains(says));
    CHECK(e.find('\n') == std::string::npos);
  };
  refused({"lora.init=pissa_niter_0"}, "lora.init is pissa_niter_0, but N counts");
  for (const char* bad : {"loftq", "pissa_niter_", "pissa_niter_x", "pissa_niter_-1", "pissa_niter_1001"})
    refused({std::string("lora.init=") + bad},
            "is not one of default, gaussian, pissa, pissa_niter_N (N from 1 to 1000)");
  refused({"lora.init=pissa", "lora.use_dora=true"}, "set lora.use_dora: false or lora.init: default");
  refused({"lora.init=olora", "dist.shard_base=true"}, "set dist.shard_base: false");
  refused({"lora.init=pissa", "lora.quantize_base=true"}, "(PEFT refuses this too): drop quantize_base");
  CHECK(load(kBase, {"lora.init=olora", "lora.quantize_base=true"}).lora.quantize_base);  // PEFT re-quantises
  refused({"lora.init=gaussian", "lora.init_from=/tmp/adapter"}, "but lora.init_from starts the adapters");
}

TEST_CASE("lora.modules_to_save and lora.trainable_token_indices: PEFT's, and what they refuse in one line") {
  const Recipe plain = load(kBase);
  CHECK(plain.lora.modules_to_save.empty());
  CHECK(plain.lora.trainable_token_indices.empty());
  const Recipe r = load(kBase, {"lora.modules_to_save=[embed_tokens, lm_head]"});
  CHECK(r.lora.modules_to_save == Strings{"embed_tokens", "lm_head"});
  CHECK(load(kBase, {"lora.trainable_token_indices=[5, 9]"}).lora.trainable_token_indices ==
        std::vector<int64_t>{5, 9});
  const auto refused = [](const Strings& overrides, const std::string& says) {
    const std::string e = override_error(overrides);
    INFO(e);
    CHECK_THAT(e, Catch::Contains(says));
    CHECK(e.find('\n') == std::string::npos);
  };
  refused({"lora.modules_to_save=[q_proj]"}, "lora.modules_to_save lists 'q_proj', which lora.target_modules adapts");
  refused({"lora.target_modules=all-linear", "lora.modules_to_save=[down_proj]"}, "which lora.target_modules adapts");
  refused({"lora.modules_to_save=[norm]"}, "lists 'norm': it takes the embedding (embed_tokens");
  refused({"lora.modules_to_save=[lm_head, lm_head]"}, "lists 'lm_head' twice");
  refused({"lora.modules_to_save=[lm_head]", "lora.plus_lr_ratio=16"}, "loraplus_lr_embedding");
  refused({"lora.trainable_token_indices=[3, -1]"}, "has -1: token ids are 0 or more");
  refused({"lora.trainable_token_indices=[3, 3]"}, "lists 3 twice");
  refused({"lora.trainable_token_indices=[3]", "lora.modules_to_save=[embed_tokens]"}, "(PEFT refuses both too)");
  refused({"lora.trainable_token_indices=[a]"}, "must be a list of token ids");
}

TEST_CASE("data.sources: typed, round trips, each source's keys, and one line for each bad mixture") {
  const std::string base =
      "model: {path: /models/m}\n"
      "data: {database: db, prompt_template: \"Q: {instruction}\\nA: \", mix_by: tokens, epoch_documents: 500,\n"
      "       filter: {split: train}, sources: [{name: tasks, collection: tasks, weight: 3},\n"
      "                {name: chat, collection: chat, filter: {lang: en}, format: chat, chat_format: llama3}]}\n";
  const Recipe r = load(base);
  REQUIRE(r.data.sources.size() == 2);
  CHECK(r.data.sources[0].weight == 3.0);
  CHECK(r.data.sources[1].weight == 1.0);  // the default
  CHECK(r.data.mix_by == MixBy::Tokens);
  CHECK(r.data.epoch_documents == 500);
  // a source's keys: its selection with data.filter's conditions, its format keys, data's others
  const DataSection chat = r.data.of_source(r.data.sources[1]);
  CHECK(chat.collection == "chat");
  CHECK(chat.filter == nlohmann::json::parse(R"({"$and": [{"split": "train"}, {"lang": "en"}]})"));
  CHECK(chat.format == Format::Chat);
  CHECK(chat.chat_format == ChatFormat::Llama3);
  CHECK(chat.sources.empty());
  CHECK(r.data.of_source(r.data.sources[0]).format == Format::Instruction);
  CHECK(load(to_yaml(r, false)) == r);
  CHECK(recipe_from_json(to_json(r, false)) == r);

  const std::string head =
      "model: {path: /models/m}\ndata: {database: db, prompt_template: \"Q: {instruction}\\nA: \", ";
  const std::vector<std::pair<std::string, std::string>> cases{
      {"sources: [{name: a, collection: a, weight: 0}]", "data.sources 'a' has weight 0: weights are numbers above 0"},
      {"sources: [{name: a, collection: a, weight: -1}, {name: b, collection: b}]",
       "data.sources 'a' has weight -1: weights are numbers above 0"},
      {"sources: [{name: a, collection: a}, {name: a, collection: b}]",
       "data.sources name 'a' twice: give each source its own name"},
      {"sources: [{name: a, collection: a, max_length: 64}]",
       "data.sources entry 0 sets max_length, which is shared by every source and cannot differ per source"},
      {"sources: [{name: a, collection: a, wieght: 2}]", "data.sources entry 0 has the unknown key wieght"},
      {"collection: docs, sources: [{name: a, collection: a}]",
       "data.sources and data.collection (docs) are both set: each source names its own collection"},
      {"sources: [{name: a, filter: {x: 1}}]", "data.sources 'a' names no collection"},
      {"sources: [{name: 'a/b', collection: a}]", "data.sources entry 0 is named 'a/b'"},
      {"sources: [{name: a, collection: a, format: text, text_field: ''}]",
       "data.text_field must be set for data.format: text"},
      {"sources: {name: a}", "data.sources must be a list of sources"},
  };
  for (const auto& [data, message] : cases) {
    INFO(data);
    CHECK_THAT(error_of(head + data + "}\n"), Catch::Contains(message));
  }
  CHECK_THAT(error_of(head + "sources: [{name: a, collection: a, format: text, text_field: ''}]}\n"),
             Catch::Contains("(for data.sources 'a')"));
}
