// The recipe's keys, each declared once — name, member, bound, example, one-line meaning — and
// what the loader, the emitters, validate() and docs/recipe.md share: how a value is written as
// YAML, examples for messages, the error format, the checks a declaration implies.
#pragma once
#include <array>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include "recipe/recipe.hpp"

namespace lorarun::recipe::detail {

inline constexpr std::array<std::string_view, 12> kSections{
    "model", "lora", "moe", "data", "train", "preference", "grpo", "checkpoint", "dist", "track", "eval", "adapters"};

// How far a number may go. Messages and docs/recipe.md word it the same way (bound_text):
// whole numbers "at least 1", other numbers ">= 0", "> 0", "in [0, 1)", "in [0, 3600] seconds".
struct Bound {
  enum class Kind { None, AtLeast, Above, AboveAtMost, Within };
  Kind kind = Kind::None;
  double lo = 0, hi = 0;
  bool hi_open = false;   // Within: [lo, hi) rather than [lo, hi]
  std::string_view unit;  // Within: named after the interval
};
constexpr Bound at_least(double lo) { return {Bound::Kind::AtLeast, lo, 0, false, {}}; }
constexpr Bound above(double lo) { return {Bound::Kind::Above, lo, 0, false, {}}; }
constexpr Bound above_at_most(double lo, double hi) { return {Bound::Kind::AboveAtMost, lo, hi, false, {}}; }
constexpr Bound within(double lo, double hi, bool hi_open, std::string_view unit = {}) {
  return {Bound::Kind::Within, lo, hi, hi_open, unit};
}

// One recipe key. Its type and default are the member's (the section structs in recipe.hpp);
// enum keys take the values of EnumNames<E>. Rules that span several keys live in validate.cpp,
// names other tools use for a key in suggest.cpp.
struct Key {
  std::string_view name;          // "train.lr"
  Bound bound{};                  // checked by validate(), for a nullable key only when set
  std::string_view example{};     // a value for messages ("e.g. train.lr: 0.0002"); empty: the default
  std::string_view required{};    // non-empty: the key must be set; "must be set <required>"
  std::string_view null_means{};  // nullable keys: what null does, for messages and the docs
  std::string_view meaning{};     // one line, for docs/recipe.md
  bool may_be_empty = false;      // a list key that may be [] (lora.modules_to_save)
  // Visitors may take the name alone: v(std::string_view key, auto& member).
  constexpr operator std::string_view() const { return name; }
};

// Calls v(Key{…}, member) for every key, in the order of docs/recipe.md. R is Recipe or const
// Recipe. This is the one list of keys: parsing, validate(), to_yaml, to_json, known_keys(),
// messages' examples and docs/recipe.md all walk it.
template <class R, class V>
void for_each_key(R& r, V&& v) {
  v(Key{.name = "model.path",
        .example = "/models/opt-125m",
        .required = "to a HF model directory, a model id in the local HF cache or a .gguf file",
        .meaning = "the base model: a HF model directory, a model id already in the local HF cache (nothing is "
                   "downloaded), or a .gguf file"},
    r.model.path);
  v(Key{.name = "model.dtype",
        .meaning = "the base weights' dtype (QLoRA quantises from it); auto: bf16 on CUDA and on CPUs with "
                   "AVX512-BF16 or AMX, else fp32"},
    r.model.dtype);
  v(Key{.name = "model.device",
        .meaning = "where each rank runs; auto: its CUDA device when GPUs are visible, else the CPU"},
    r.model.device);
  v(Key{.name = "model.keep_quantized",
        .meaning = "a .gguf model: keep its linears and embedding as the file's own blocks (Q4_K, Q8_0, …), "
                   "dequantised into model.dtype per use"},
    r.model.keep_quantized);

  v(Key{.name = "lora.r", .bound = at_least(1), .meaning = "rank of every adapter (A is r × in, B is out × r)"},
    r.lora.r);
  v(Key{.name = "lora.alpha",
        .bound = above(0),
        .meaning = "scale numerator: the adapter's output is scaled by alpha / r (alpha / sqrt(r) with use_rslora)"},
    r.lora.alpha);
  v(Key{.name = "lora.dropout",
        .bound = within(0, 1, true),
        .example = "0.05",
        .meaning = "dropout on the adapter's input, as PEFT's `lora_dropout`"},
    r.lora.dropout);
  v(Key{.name = "lora.target_modules",
        .example = "[q_proj, v_proj]",
        .meaning = "the modules that get adapters, matched as PEFT does (name suffix); all-linear: every linear "
                   "layer but the output head"},
    r.lora.target_modules);
  v(Key{.name = "lora.target_parameters",
        .example = "[mlp.experts.gate_up_proj, mlp.experts.down_proj]",
        .meaning = "PEFT's target_parameters: a mixture of experts' stacked expert tensors adapted per expert "
                   "(name suffix, as PEFT matches)",
        .may_be_empty = true},
    r.lora.target_parameters);
  v(Key{.name = "lora.use_rslora", .meaning = "rank-stabilised LoRA: scale by alpha / sqrt(r) instead of alpha / r"},
    r.lora.use_rslora);
  v(Key{.name = "lora.use_dora",
        .meaning = "DoRA (PEFT's use_dora): each adapted weight's rows rescaled to a learnt magnitude, "
                   "saved as lora_magnitude_vector"},
    r.lora.use_dora);
  v(Key{.name = "lora.plus_lr_ratio",
        .bound = within(0.001, 10000, false),
        .null_means = "one learning rate for every adapter tensor",
        .meaning = "LoRA+: B's (and DoRA's magnitudes') learning rate is the schedule's × this, as PEFT's "
                   "create_loraplus_optimizer sets it"},
    r.lora.plus_lr_ratio);
  v(Key{.name = "lora.modules_to_save",
        .example = "[embed_tokens, lm_head]",
        .meaning = "PEFT's modules_to_save: the embedding and/or output head trained whole, as copies saved in the "
                   "adapter",
        .may_be_empty = true},
    r.lora.modules_to_save);
  v(Key{.name = "lora.trainable_token_indices",
        .example = "[128000, 128001]",
        .meaning = "PEFT's TrainableTokens: only these embedding rows train (with a tied output head, its rows too)"},
    r.lora.trainable_token_indices);
  v(Key{.name = "lora.quantize_base",
        .meaning = "QLoRA: hold the base weights of the linear layers LoRA may adapt in NF4, as bitsandbytes does"},
    r.lora.quantize_base);
  v(Key{.name = "lora.double_quant",
        .meaning = "QLoRA: quantise the NF4 block scales to 8 bits too (bitsandbytes' `compress_statistics`)"},
    r.lora.double_quant);
  v(Key{.name = "lora.init",
        .example = "pissa",
        .meaning = "how fresh adapters start (PEFT's init_lora_weights): default, gaussian, pissa, pissa_niter_N "
                   "(randomised SVD) or olora"},
    r.lora.init);
  v(Key{.name = "lora.init_from",
        .meaning = "a PEFT adapter directory to start from; empty: fresh adapters (A Kaiming-uniform, B zero)"},
    r.lora.init_from);
  v(Key{.name = "moe.router_aux_loss_coef",
        .bound = at_least(0),
        .null_means = "as transformers trains the model: config.json's router_aux_loss_coef when it says "
                      "output_router_logits: true, else no router loss",
        .meaning = "a mixture of experts' training loss adds the routers' load-balancing loss times this"},
    r.moe.router_aux_loss_coef);

  v(Key{.name = "data.source", .meaning = "where the documents come from: a MongoDB collection or a JSONL file"},
    r.data.source);
  v(Key{.name = "data.uri",
        .example = "mongodb://user:password@host:27017/",
        .meaning = "MongoDB connection string; empty: `LORARUN_MONGODB_URI` at load time (passwords never appear in "
                   "logs)"},
    r.data.uri);
  v(Key{.name = "data.database", .example = "training", .meaning = "the MongoDB database (source: mongodb)"},
    r.data.database);
  v(Key{.name = "data.collection", .example = "examples", .meaning = "the MongoDB collection (source: mongodb)"},
    r.data.collection);
  v(Key{.name = "data.path",
        .example = "data/train.jsonl",
        .meaning = "a file of one JSON document per line (source: jsonl)"},
    r.data.path);
  v(Key{.name = "data.filter",
        .example = "{split: train}",
        .meaning = "a MongoDB query selecting the documents; extended JSON such as `{$oid: …}` is kept as is"},
    r.data.filter);
  v(Key{.name = "data.limit",
        .bound = at_least(1),
        .example = "1000",
        .null_means = "all",
        .meaning = "use at most this many of the selected documents"},
    r.data.limit);
  v(Key{.name = "data.sources",
        .example = "[{name: tasks, collection: tasks, weight: 3}, {name: chat, collection: chat, weight: 1}]",
        .meaning = "several selections mixed by weight: each {name, collection (+ filter) or path, weight} and its "
                   "own format keys",
        .may_be_empty = true},
    r.data.sources);
  v(Key{.name = "data.mix_by",
        .meaning = "what the weights share with data.sources: the epoch's documents, or its trained tokens"},
    r.data.mix_by);
  v(Key{.name = "data.epoch_documents",
        .bound = at_least(1),
        .example = "100000",
        .null_means = "as many as the sources hold together",
        .meaning = "with data.sources: documents per epoch, shared out by the weights (smaller sources repeat)"},
    r.data.epoch_documents);
  v(Key{.name = "data.format",
        .meaning = "how a document becomes an example: a template and a response, a text field, chat messages, pairs, "
                   "labelled answers, a prompt"},
    r.data.format);
  v(Key{.name = "data.prompt_template",
        .example = R"("### Instruction:\n{instruction}\n\n### Response:\n")",
        .meaning = "format: instruction: the text before the response; `{field}` is that document field, `{{` `}}` "
                   "are braces"},
    r.data.prompt_template);
  v(Key{.name = "data.response_field",
        .example = "output",
        .meaning = "format: instruction: the document field trained on, appended after the prompt"},
    r.data.response_field);
  v(Key{.name = "data.text_field", .example = "text", .meaning = "format: text: the document field holding the text"},
    r.data.text_field);
  v(Key{.name = "data.messages_field",
        .example = "messages",
        .meaning = "format: chat: the document field holding the list of `{role, content}` messages"},
    r.data.messages_field);
  v(Key{.name = "data.prompt_field",
        .example = "prompt",
        .meaning = "format: preference, unpaired and prompt: the field holding the prompt, a string or a list of "
                   "`{role, content}` messages"},
    r.data.prompt_field);
  v(Key{.name = "data.chosen_field",
        .example = "chosen",
        .meaning = "format: preference: the preferred completion, a string or a list of messages (as the prompt)"},
    r.data.chosen_field);
  v(Key{.name = "data.rejected_field",
        .example = "rejected",
        .meaning = "format: preference: the rejected completion, a string or a list of messages (as the prompt)"},
    r.data.rejected_field);
  v(Key{.name = "data.completion_field",
        .example = "completion",
        .meaning = "format: unpaired: the one completion, a string or a list of messages (as the prompt)"},
    r.data.completion_field);
  v(Key{.name = "data.label_field",
        .example = "label",
        .meaning = "format: unpaired: whether the completion is desirable: true/false or 1/0"},
    r.data.label_field);
  v(Key{.name = "data.chat_format",
        .meaning =
            "format: chat: the template the messages are rendered in; `template`: the model's own chat template"},
    r.data.chat_format);
  v(Key{.name = "data.chat_template",
        .example = "templates/chat.jinja",
        .meaning = "chat_format: template: a Jinja file used instead of the model's chat template; empty: the model's"},
    r.data.chat_template);
  v(Key{.name = "data.chat_template_kwargs",
        .example = "{enable_thinking: false}",
        .meaning =
            "chat_format: template: more variables for the template, as apply_chat_template's extra keyword arguments"},
    r.data.chat_template_kwargs);
  v(Key{.name = "data.chat_template_fuel",
        .bound = at_least(1000),
        .meaning = "chat_format: template: the most work one rendering may do (minijinja fuel, ~1 per instruction); "
                   "more makes a bad document"},
    r.data.chat_template_fuel);
  v(Key{.name = "data.train_on_input",
        .meaning = "train on the prompt (instruction) or on every turn (chat) too, not only the response"},
    r.data.train_on_input);
  v(Key{.name = "data.max_length", .bound = at_least(2), .meaning = "tokens per example at most (see overlong)"},
    r.data.max_length);
  v(Key{.name = "data.overlong", .meaning = "an example longer than max_length: truncate it, or skip it (counted)"},
    r.data.overlong);
  v(Key{.name = "data.bad_documents",
        .meaning = "a document missing a field or of the wrong shape: skip it (counted), or fail the run"},
    r.data.bad_documents);
  v(Key{.name = "data.max_skipped_share",
        .bound = within(0, 1, false),
        .meaning = "the share of an epoch's documents that may be skipped (any cause) before the run stops, naming "
                   "the commonest; 1: never"},
    r.data.max_skipped_share);
  v(Key{.name = "data.shuffle",
        .meaning = "order per epoch: one permutation from (train.seed, epoch), windows of shuffle_buffer per rank, "
                   "or `_id` order"},
    r.data.shuffle);
  v(Key{.name = "data.packing",
        .meaning = "a micro-batch's documents share rows of max_length tokens, each attending only within itself"},
    r.data.packing);
  v(Key{.name = "data.batch_size",
        .bound = at_least(1),
        .meaning = "documents per micro-batch, per rank (packed into rows with packing)"},
    r.data.batch_size);
  v(Key{.name = "data.prefetch",
        .bound = at_least(0),
        .meaning = "chunks of 256 documents fetched and built ahead by a background thread (0: none)"},
    r.data.prefetch);
  v(Key{.name = "data.shuffle_buffer",
        .bound = at_least(1),
        .meaning = "shuffle: stream: documents shuffled together (bounds memory)"},
    r.data.shuffle_buffer);
  v(Key{.name = "data.group_by_length",
        .meaning = "sort the documents of each window of group_window steps by length before cutting micro-batches"},
    r.data.group_by_length);
  v(Key{.name = "data.group_window",
        .bound = at_least(1),
        .meaning = "group_by_length: optimizer steps whose documents are sorted together"},
    r.data.group_window);
  v(Key{.name = "data.retries",
        .bound = at_least(0),
        .meaning = "retries of a fetch after a dropped connection or a server restart (0: fail at once)"},
    r.data.retries);
  v(Key{.name = "data.retry_backoff_s",
        .bound = within(0, 3600, false, "seconds"),
        .meaning = "first wait before a retry; it doubles each time, up to 30 s"},
    r.data.retry_backoff_s);
  v(Key{.name = "data.timeout_s",
        .bound = at_least(1),
        .meaning = "seconds to connect to and select the MongoDB server, per attempt (not dist.timeout_s)"},
    r.data.timeout_s);

  v(Key{.name = "train.epochs", .bound = at_least(1), .meaning = "passes over the selected documents"}, r.train.epochs);
  v(Key{.name = "train.gradient_accumulation_steps",
        .bound = at_least(1),
        .meaning = "micro-batches per optimizer step"},
    r.train.gradient_accumulation_steps);
  v(Key{.name = "train.lr",
        .bound = above_at_most(0, 1e30),
        .meaning = "AdamW's peak learning rate, reached after warmup_steps"},
    r.train.lr);
  v(Key{.name = "train.weight_decay", .bound = at_least(0), .meaning = "AdamW's decoupled weight decay"},
    r.train.weight_decay);
  v(Key{.name = "train.lr_scheduler",
        .meaning = "the learning rate after warmup: cosine or linear decay to 0 at the last step, or constant"},
    r.train.lr_scheduler);
  v(Key{.name = "train.warmup_steps",
        .bound = at_least(0),
        .meaning = "optimizer steps over which the learning rate rises linearly from 0 to lr"},
    r.train.warmup_steps);
  v(Key{.name = "train.max_grad_norm",
        .bound = above(0),
        .null_means = "no clipping",
        .meaning = "clip the global gradient norm (all ranks, all LoRA parameters) to this"},
    r.train.max_grad_norm);
  v(Key{.name = "train.max_steps_per_epoch",
        .bound = at_least(1),
        .example = "100",
        .null_means = "the whole epoch",
        .meaning = "at most this many optimizer steps per epoch"},
    r.train.max_steps_per_epoch);
  v(Key{.name = "train.seed",
        .bound = at_least(0),
        .meaning = "the seed every random stream derives from: data order, adapter init, dropout"},
    r.train.seed);
  v(Key{.name = "train.activation_checkpointing",
        .meaning = "keep only each decoder block's input and run the block again in backward (same gradients)"},
    r.train.activation_checkpointing);
  v(Key{.name = "train.profile_steps",
        .bound = at_least(1),
        .example = "3",
        .null_means = "no profile",
        .meaning = "trace this many steps (after the first two) with LibTorch's profiler into "
                   "<output_dir>/profile/rank_<R>.json (Perfetto opens it)"},
    r.train.profile_steps);
  v(Key{.name = "train.early_stopping_patience",
        .bound = at_least(1),
        .example = "3",
        .null_means = "never stop early",
        .meaning = "stop after this many evaluations in a row without improvement (needs an eval: split); the "
                   "running epoch is the last"},
    r.train.early_stopping_patience);
  v(Key{.name = "train.early_stopping_min_delta",
        .bound = at_least(0),
        .meaning = "an evaluation improves when it lowers the best eval loss so far by more than this"},
    r.train.early_stopping_min_delta);
  v(Key{.name = "train.objective",
        .meaning = "sft: the trained tokens' loss; dpo, orpo, cpo, simpo: pairs (format preference); kto: labelled "
                   "answers; grpo: rewarded samples"},
    r.train.objective);

  v(Key{.name = "preference.beta",
        .bound = within(0.0001, 1000, false),
        .meaning = "rewards are beta × log-ratio to the reference (dpo) or × log-probability (cpo, simpo); orpo: "
                   "its lambda"},
    r.preference.beta);
  v(Key{.name = "preference.loss_type",
        .meaning = "TRL's losses: sigmoid (DPO), ipo (IPO), hinge (SLiC); simpo (cpo only); kto: kto (sigmoid's "
                   "place), apo_zero_unpaired"},
    r.preference.loss_type);
  v(Key{.name = "preference.label_smoothing",
        .bound = within(0, 0.5, true),
        .meaning = "loss_type sigmoid (and simpo): the assumed share of flipped labels (conservative DPO); 0: plain "
                   "DPO"},
    r.preference.label_smoothing);
  v(Key{.name = "preference.rpo_alpha",
        .bound = above(0),
        .example = "1.0",
        .null_means = "off",
        .meaning = "RPO: add this weight times the NLL of the chosen completions (mean over their tokens)"},
    r.preference.rpo_alpha);
  v(Key{.name = "preference.cpo_alpha",
        .bound = at_least(0),
        .example = "1.0",
        .null_means = "1 with train.objective cpo, 0 with simpo (TRL's and the SimPO paper's)",
        .meaning = "cpo, simpo: add this weight times the NLL of the chosen completions (mean over their tokens)"},
    r.preference.cpo_alpha);
  v(Key{.name = "preference.simpo_gamma",
        .bound = at_least(0),
        .meaning = "SimPO's target reward margin (train.objective simpo, or cpo with loss_type simpo)"},
    r.preference.simpo_gamma);
  v(Key{.name = "preference.desirable_weight",
        .bound = above(0),
        .meaning = "kto: the weight of the desirable completions' losses (raise it when they are fewer)"},
    r.preference.desirable_weight);
  v(Key{.name = "preference.undesirable_weight",
        .bound = above(0),
        .meaning = "kto: the weight of the undesirable completions' losses (raise it when they are fewer)"},
    r.preference.undesirable_weight);
  v(Key{.name = "preference.precompute_reference",
        .meaning = "dpo, kto: compute the reference's log-probs of the data once, before training, and keep them with "
                   "the resumable state"},
    r.preference.precompute_reference);

  v(Key{.name = "grpo.num_generations",
        .bound = at_least(2),
        .meaning = "completions sampled for each prompt (G): a group, whose rewards each completion's advantage is "
                   "measured against"},
    r.grpo.num_generations);
  v(Key{.name = "grpo.max_completion_length",
        .bound = at_least(1),
        .meaning = "a completion stops after this many tokens (or at the model's end-of-sequence token)"},
    r.grpo.max_completion_length);
  v(Key{.name = "grpo.temperature",
        .bound = above(0),
        .meaning = "sampling temperature; the trained log-probs are the logits divided by it too"},
    r.grpo.temperature);
  v(Key{.name = "grpo.top_p",
        .bound = above_at_most(0, 1),
        .meaning = "sample from the fewest most likely tokens whose probabilities reach this; 1: every token"},
    r.grpo.top_p);
  v(Key{.name = "grpo.top_k",
        .bound = at_least(0),
        .meaning = "sample from this many most likely tokens; 0: every token"},
    r.grpo.top_k);
  v(Key{.name = "grpo.beta",
        .bound = at_least(0),
        .meaning = "weight of the KL to the reference (the adapters off, or lora.init_from); 0: no reference pass"},
    r.grpo.beta);
  v(Key{.name = "grpo.num_iterations",
        .bound = at_least(1),
        .meaning =
            "optimizer steps on each batch of generations (μ): an epoch has μ times the steps; its old log-probs clip"},
    r.grpo.num_iterations);
  v(Key{.name = "grpo.epsilon",
        .bound = within(0, 1, true),
        .meaning = "the importance ratio is clipped to [1 - epsilon, 1 + epsilon_high]"},
    r.grpo.epsilon);
  v(Key{.name = "grpo.epsilon_high",
        .bound = at_least(0),
        .example = "0.28",
        .null_means = "epsilon",
        .meaning = "the upper clip (DAPO's clip-higher)"},
    r.grpo.epsilon_high);
  v(Key{.name = "grpo.loss_type",
        .meaning = "normalised over the step's tokens (dapo, bnpo), per completion (grpo), or by completions × "
                   "max_completion_length (dr_grpo)"},
    r.grpo.loss_type);
  v(Key{.name = "grpo.importance_sampling_level",
        .meaning = "token: a ratio per token; sequence: one per completion, its tokens' mean log-ratio (GSPO)"},
    r.grpo.importance_sampling_level);
  v(Key{.name = "grpo.scale_rewards",
        .meaning = "advantages divided by the standard deviation of the group's rewards, of the batch's, or none "
                   "(Dr. GRPO)"},
    r.grpo.scale_rewards);
  v(Key{.name = "grpo.mask_truncated_completions",
        .meaning = "completions cut at max_completion_length do not count in the loss (DAPO)"},
    r.grpo.mask_truncated_completions);
  v(Key{.name = "grpo.log_completions",
        .meaning =
            "write each step's prompts, completions, rewards and advantages to `<output_dir>/completions.jsonl`"},
    r.grpo.log_completions);
  v(Key{.name = "grpo.rewards",
        .example = "[{name: answer, kind: number, field: answer}, {name: form, kind: format, pattern: '<think>.*'}]",
        .meaning = "the rewards, summed by weight: each {name, kind, weight, field, …} (kinds: see Reinforcement "
                   "learning below)"},
    r.grpo.rewards);

  v(Key{.name = "checkpoint.output_dir",
        .example = "runs/my-run",
        .required = "to the directory for the epoch_<i>/ checkpoints",
        .meaning = "the run's directory: `epoch_<i>/` adapters, `resume_state/`, `recipe.yaml`, metrics, logs; "
                   "empty: `runs/<recipe file name>`"},
    r.checkpoint.output_dir);
  v(Key{.name = "checkpoint.epochs_to_save",
        .example = "[0, 2]",
        .meaning = "the epochs whose `epoch_<i>/` adapter is kept: all, none, or a list of 0-based epoch indices"},
    r.checkpoint.epochs_to_save);
  v(Key{.name = "checkpoint.save_last_epoch_only",
        .meaning = "keep only the last epoch's adapter; wins over epochs_to_save (a warning when both are set)"},
    r.checkpoint.save_last_epoch_only);
  v(Key{.name = "checkpoint.state_every_n_steps",
        .bound = at_least(1),
        .example = "500",
        .null_means = "at the end of each epoch only",
        .meaning = "also write the resumable state every N optimizer steps"},
    r.checkpoint.state_every_n_steps);
  v(Key{.name = "checkpoint.resume",
        .meaning = "auto: continue from output_dir's resumable state when there is one; never: start over"},
    r.checkpoint.resume);
  v(Key{.name = "checkpoint.keep_resume_state",
        .meaning = "keep `resume_state/` after the run finishes (it is removed otherwise)"},
    r.checkpoint.keep_resume_state);
  v(Key{.name = "checkpoint.overwrite",
        .meaning = "a new run may replace another run's finished adapters in output_dir (otherwise it refuses the "
                   "directory)"},
    r.checkpoint.overwrite);
  v(Key{.name = "checkpoint.keep_best",
        .meaning = "keep `best/`, the adapter of the lowest eval loss so far (needs an eval: split), with its step "
                   "and loss in `best/best.json`"},
    r.checkpoint.keep_best);
  v(Key{.name = "checkpoint.store",
        .meaning = "mongodb: kept `epoch_<i>/`, `best/` and each resumable state also go to GridFS of track.database; "
                   "a lost output_dir is restored"},
    r.checkpoint.store);

  v(Key{.name = "dist.backend", .meaning = "the collectives' backend; auto: nccl on CUDA, gloo on CPU"},
    r.dist.backend);
  v(Key{.name = "dist.timeout_s",
        .bound = at_least(1),
        .meaning = "seconds a collective may wait before the run fails (and the rendezvous, unless lorarun "
                   "--rdzv-timeout sets it)"},
    r.dist.timeout_s);
  v(Key{.name = "dist.debug_checksum_every_n_steps",
        .bound = at_least(1),
        .example = "100",
        .null_means = "never",
        .meaning = "compare a checksum of the parameters across ranks every N optimizer steps"},
    r.dist.debug_checksum_every_n_steps);
  v(Key{.name = "dist.bucket_mb",
        .bound = above(0),
        .meaning = "MiB per gradient all-reduce bucket; buckets are reduced while backward goes on"},
    r.dist.bucket_mb);
  v(Key{.name = "dist.shard_base",
        .meaning = "each rank holds 1/world of every frozen base linear (NF4, GGUF blocks too), gathered a decoder "
                   "block at a time: bigger models"},
    r.dist.shard_base);
  v(Key{.name = "dist.shard_base_prefetch",
        .meaning = "with shard_base: gather the next block's weights while this block computes (one block more "
                   "memory)"},
    r.dist.shard_base_prefetch);

  v(Key{.name = "track.mongodb",
        .meaning = "record the run and its metrics in MongoDB (`metrics.jsonl` is written either way)"},
    r.track.mongodb);
  v(Key{.name = "track.database",
        .example = "lorarun",
        .meaning = "the MongoDB database of the run records; empty: data.database"},
    r.track.database);
  v(Key{.name = "track.log_every_n_steps", .bound = at_least(1), .meaning = "a metrics line every N optimizer steps"},
    r.track.log_every_n_steps);
  v(Key{.name = "track.tensorboard",
        .meaning = "TensorBoard event files in `<output_dir>/tensorboard/` (rank 0): train loss, lr, grad norm, "
                   "tokens/s; eval loss and ppl"},
    r.track.tensorboard);
  v(Key{.name = "track.mlflow_uri",
        .example = "http://127.0.0.1:5000",
        .meaning = "an MLflow tracking server (http(s)://host:port) rank 0 logs params, metrics and the adapter to; "
                   "empty: none"},
    r.track.mlflow_uri);
  v(Key{.name = "track.mlflow_experiment",
        .example = "lorarun",
        .meaning = "the MLflow experiment of the run (made if missing); empty: $MLFLOW_EXPERIMENT_NAME, else Default"},
    r.track.mlflow_experiment);

  v(Key{.name = "eval.filter",
        .example = "{split: eval}",
        .meaning = "source: mongodb: a query on data's collection selecting the evaluation documents; empty: none"},
    r.eval.filter);
  v(Key{.name = "eval.collection",
        .example = "alpaca_eval",
        .meaning = "source: mongodb: evaluate on this collection of data.database (with eval.filter if set); empty: "
                   "data.collection"},
    r.eval.collection);
  v(Key{.name = "eval.path",
        .example = "data/eval.jsonl",
        .meaning = "source: jsonl: a separate file of evaluation documents, one JSON document per line"},
    r.eval.path);
  v(Key{.name = "eval.fraction",
        .bound = within(0, 1, true),
        .example = "0.05",
        .meaning =
            "hold out this share of data's selection (a stable hash of each `_id` or JSONL line), never trained"},
    r.eval.fraction);
  v(Key{.name = "eval.every_n_steps",
        .bound = at_least(1),
        .example = "500",
        .null_means = "at the end of each epoch only",
        .meaning = "also evaluate every N optimizer steps (always at each epoch end when eval is set)"},
    r.eval.every_n_steps);
  v(Key{.name = "eval.on_start",
        .meaning = "also evaluate before a new run's first step (transformers' eval_on_start): step 0, not steering "
                   "best/"},
    r.eval.on_start);
  v(Key{.name = "eval.max_documents",
        .bound = at_least(1),
        .example = "1000",
        .null_means = "all",
        .meaning = "evaluate on at most this many of the evaluation documents (the first, in `_id` or file order)"},
    r.eval.max_documents);
  v(Key{.name = "eval.batch_size",
        .bound = at_least(1),
        .example = "8",
        .null_means = "data.batch_size",
        .meaning = "evaluation documents per forward pass, per rank"},
    r.eval.batch_size);

  v(Key{.name = "adapters.per",
        .example = "tenant",
        .meaning = "one adapter per distinct value of this field in data's selection, each trained as its own run "
                   "would be (`<output_dir>/<value>/`)"},
    r.adapters.per);
  v(Key{.name = "adapters.max",
        .bound = at_least(1),
        .meaning = "with adapters.per: the most adapters a job trains (more distinct values are refused)"},
    r.adapters.max);
  v(Key{.name = "adapters.list",
        .example = "[{name: acme, filter: {tenant: acme}}, {name: globex, collection: globex, r: 16}]",
        .meaning = "or listed: each {name, filter and/or collection (path: jsonl), eval_filter} with its own r, "
                   "alpha, target_modules, lr, epochs",
        .may_be_empty = true},
    r.adapters.list);
  v(Key{.name = "adapters.per_pass",
        .bound = at_least(1),
        .example = "1",
        .null_means = "all on a GPU, 1 on the CPU",
        .meaning = "adapters whose micro-batches share one forward and backward pass through the base; fewer "
                   "hold fewer activations"},
    r.adapters.per_pass);
}

// The key names: "model.path" → section "model", leaf "path".
std::string section_of(std::string_view key);
std::string leaf_of(std::string_view key);
bool is_section(std::string_view name);
bool is_key(std::string_view dotted);
// The leaf names of `section`'s keys, in order.
std::vector<std::string> leaves(std::string_view section);

template <class T>
struct IsOptional : std::false_type {};
template <class T>
struct IsOptional<std::optional<T>> : std::true_type {};

// "runs/x" -> "\"runs/x\"": a double-quoted YAML (and JSON) string, escapes included.
std::string quote_string(std::string_view s);
// Shortest text that reads back as the same double, always with a '.' or an exponent.
std::string format_double(double v);

// data.sources as JSON: per source the keys it sets ([{"name": …, "collection": …, "weight": 3.0}]).
nlohmann::json sources_json(const std::vector<DataSource>& sources);
// The keys a data.sources entry may have ("name", "collection", …, "chat_format").
const std::vector<std::string>& source_keys();
// adapters.list as JSON: per adapter the keys it sets ([{"name": …, "filter": …, "r": 16}]).
nlohmann::json adapters_json(const std::vector<AdapterSpec>& list);
// The keys an adapters.list entry may have: where its documents are, then what it may set itself.
const std::vector<std::string>& adapter_keys();

// A key's value as YAML text (flow style), the form to_yaml writes.
template <class T>
std::string yaml_text(const T& v) {
  if constexpr (std::is_same_v<T, std::string>) {
    return quote_string(v);
  } else if constexpr (std::is_same_v<T, bool>) {
    return v ? "true" : "false";
  } else if constexpr (std::is_enum_v<T>) {
    return std::string(name(v));
  } else if constexpr (std::is_integral_v<T>) {
    return std::to_string(v);
  } else if constexpr (std::is_floating_point_v<T>) {
    return format_double(v);
  } else if constexpr (IsOptional<T>::value) {
    return v ? yaml_text(*v) : std::string("null");
  } else if constexpr (std::is_same_v<T, nlohmann::json>) {
    return v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {  // lora.target_modules
    if (v == std::vector<std::string>{"all-linear"}) return "all-linear";
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + quote_string(v[i]);
    return out + "]";
  } else if constexpr (std::is_same_v<T, std::vector<DataSource>>) {  // data.sources
    return sources_json(v).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } else if constexpr (std::is_same_v<T, std::vector<AdapterSpec>>) {  // adapters.list
    return adapters_json(v).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {  // lora.trainable_token_indices
    std::string out = "[";
    for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
    return out + "]";
  } else {
    static_assert(std::is_same_v<T, EpochsToSave>);
    if (v.mode == EpochsToSave::Mode::All) return "all";
    if (v.mode == EpochsToSave::Mode::None) return "none";
    std::string out = "[";
    for (size_t i = 0; i < v.epochs.size(); ++i) out += (i ? ", " : "") + std::to_string(v.epochs[i]);
    return out + "]";
  }
}

// A value users can copy for `key`, e.g. "0.0002" for train.lr.
std::string example(std::string_view key);
// " (e.g. train.lr: 0.0002)"
std::string hint(std::string_view key);
// A value from the user, shown in a message: 'fast', [a, b]; one line, at most ~60 characters.
std::string show(std::string_view text);

// Throws lorarun::Error("<origin.at(key)>: <key> <problem>").
[[noreturn]] void fail(const RecipeOrigin& origin, std::string_view key, std::string_view problem);
// Throws "<key> must be set <why> (e.g. …)" when `value` is empty.
void require(const RecipeOrigin& origin, std::string_view key, const std::string& value, std::string_view why);

// A bound in words, as messages and docs/recipe.md give it: "at least 1" (whole numbers),
// ">= 0", "> 0", "in [0, 1)", "in [0, 3600] seconds".
std::string bound_text(const Bound& b, bool whole_numbers);
// Throw "<key> must be <bound_text>[ or null], got <value> (e.g. …)" when `value` is out of the
// key's bound. A nullable key's message says "or null"; for a strict bound (> 0) it also says
// what null does, since 0 is what people try for "off".
void check_bound(const Key& k, int64_t value, bool nullable, const RecipeOrigin& origin);
void check_bound(const Key& k, double value, bool nullable, const RecipeOrigin& origin);
// A list of names: at least one, none empty, each once, all-linear alone.
void check_names(const Key& k, const std::vector<std::string>& names, const RecipeOrigin& origin);

// What a key's declaration implies, checked by validate(): a required key is set, a number is
// within its bound (a nullable one when set), a list of module names is well formed.
template <class T>
void check_declared(const Key& k, const T& value, const RecipeOrigin& origin, bool nullable = false) {
  if constexpr (IsOptional<T>::value) {
    if (value) check_declared(k, *value, origin, true);
  } else if constexpr (std::is_same_v<T, std::string>) {
    if (!k.required.empty()) require(origin, k.name, value, k.required);
  } else if constexpr (std::is_same_v<T, bool> || std::is_enum_v<T>) {
    // the loader already took only true/false or one of EnumNames<T>
  } else if constexpr (std::is_integral_v<T>) {
    check_bound(k, static_cast<int64_t>(value), nullable, origin);
  } else if constexpr (std::is_floating_point_v<T>) {
    check_bound(k, static_cast<double>(value), nullable, origin);
  } else if constexpr (std::is_same_v<T, std::vector<std::string>>) {
    check_names(k, value, origin);
  }
}

// The keys that validate.cpp's rules spanning several keys are attached to (each must be a key).
std::vector<std::string_view> rule_keys();

// prompt-template parsing with `subject` naming the template in messages.
std::vector<TemplatePart> parse_template(std::string_view tmpl, std::string_view subject);

}  // namespace lorarun::recipe::detail
