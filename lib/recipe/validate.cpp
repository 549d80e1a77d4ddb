// validate(): the rules that span several keys (what one key alone allows is declared in
// schema.hpp), the checkpoint policy and prompt templates.
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>

#include <fmt/format.h>

#include "recipe/recipe.hpp"
#include "recipe/schema.hpp"
#include "util/error.hpp"
#include "util/secrets.hpp"
#include "util/untrusted.hpp"

namespace lorarun::recipe {
namespace detail {

// Python's str.format placeholders, without format specs: {field}, {{ and }} for braces.
std::vector<TemplatePart> parse_template(std::string_view t, std::string_view subject) {
  // 1-based position in characters (UTF-8 continuation bytes do not count), for messages.
  const auto position = [&](size_t byte) {
    return 1 + std::count_if(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(byte),
                             [](char c) { return (static_cast<unsigned char>(c) & 0xC0) != 0x80; });
  };
  std::vector<TemplatePart> parts;
  std::string literal;
  const auto flush = [&] {
    if (!literal.empty()) parts.push_back({false, std::exchange(literal, {})});
  };
  for (size_t i = 0; i < t.size(); ++i) {
    const char c = t[i];
    const bool doubled = i + 1 < t.size() && t[i + 1] == c;
    if ((c == '{' || c == '}') && doubled) {
      literal += c;
      ++i;
    } else if (c == '}') {
      throw Error(fmt::format("{} has an unmatched '}}' at character {}; write }}}} for a literal brace", subject,
                              position(i)));
    } else if (c != '{') {
      literal += c;
    } else {
      const size_t close = t.find_first_of("{}", i + 1);
      if (close == std::string_view::npos || t[close] == '{')
        throw Error(
            fmt::format("{} has an unmatched '{{' at character {}; close the placeholder with }} or write "
                        "{{{{ for a literal brace",
                        subject, position(i)));
      if (close == i + 1)
        throw Error(
            fmt::format("{} has an empty placeholder {{}} at character {}; name a document field such as "
                        "{{instruction}}",
                        subject, position(i)));
      flush();
      parts.push_back({true, std::string(t.substr(i + 1, close - i - 1))});
      i = close;
    }
  }
  flush();
  return parts;
}

}  // namespace detail

std::vector<TemplatePart> parse_template(std::string_view tmpl) {
  return detail::parse_template(tmpl, "the prompt template");
}

DataSection DataSection::of_source(const DataSource& s) const {
  DataSection d = *this;
  d.sources.clear();
  d.collection = s.collection;
  d.path = s.path;
  d.filter = filter.empty() ? s.filter : s.filter.empty() ? filter : nlohmann::json{{"$and", {filter, s.filter}}};
  if (s.format) d.format = *s.format;
  if (s.prompt_template) d.prompt_template = *s.prompt_template;
  if (s.response_field) d.response_field = *s.response_field;
  if (s.text_field) d.text_field = *s.text_field;
  if (s.messages_field) d.messages_field = *s.messages_field;
  if (s.chat_format) d.chat_format = *s.chat_format;
  return d;
}

std::vector<std::string> DataSection::template_fields() const {
  std::vector<std::string> fields;
  for (const TemplatePart& p : parse_template(prompt_template))
    if (p.is_field && std::find(fields.begin(), fields.end(), p.text) == fields.end()) fields.push_back(p.text);
  return fields;
}

namespace {

using detail::fail;
using detail::require;

using Warnings = std::vector<std::string>;

// A rule that spans several keys, checked when validate() comes to `key` (the key its message
// names), before that key's own declaration. Everything about one key alone is declared in
// schema.hpp.
// Why a key that steers by the eval loss cannot: the recipe has no eval split.
std::string no_eval_split(const Recipe& r) {
  return fmt::format("needs an eval: split to steer by: set {} or eval.fraction",
                     r.data.source == Source::MongoDB ? "eval.filter, eval.collection" : "eval.path");
}

struct Rule {
  std::string_view key;
  void (*check)(const Recipe& r, const RecipeOrigin& o, Warnings& warnings);
};

void check_sources(const Recipe& r, const RecipeOrigin& o, Warnings& w);
void check_adapters(const Recipe& r, const RecipeOrigin& o, Warnings& w);

// adapters.list without adapters.per: whether every entry names its own collection (mongodb) or
// file (jsonl), so that data.collection or data.path may stay empty.
bool adapters_locate_themselves(const Recipe& r) {
  if (!r.adapters.per.empty() || r.adapters.list.empty()) return false;
  return std::all_of(r.adapters.list.begin(), r.adapters.list.end(), [&](const AdapterSpec& a) {
    return r.data.source == Source::MongoDB ? !a.collection.empty() : !a.path.empty();
  });
}

// train.objective: kto (TRL's KTOTrainer): labelled single completions, its own losses and weights;
// its KL estimate pairs each prompt with another example's completion of the same step.
void kto_rules(const Recipe& r, const RecipeOrigin& o) {
  const PreferenceSection& p = r.preference;
  if (r.data.format != Format::Unpaired)
    fail(o, "train.objective",
         fmt::format("is kto, which trains on single completions marked desirable or not, but data.format is {}: "
                     "set data.format: unpaired (with data.prompt_field, completion_field, label_field)",
                     name(r.data.format)));
  if (p.loss_type != PreferenceLoss::Sigmoid && p.loss_type != PreferenceLoss::Kto &&
      p.loss_type != PreferenceLoss::ApoZeroUnpaired)
    fail(o, "preference.loss_type",
         fmt::format("is {}, a loss of pairs: train.objective kto takes kto (the default) or apo_zero_unpaired",
                     name(p.loss_type)));
  if (p.label_smoothing > 0 || p.rpo_alpha || p.cpo_alpha || p.simpo_gamma != PreferenceSection{}.simpo_gamma)
    fail(o, "train.objective",
         "is kto: of the preference: keys beta, loss_type, desirable_weight and undesirable_weight apply; remove "
         "label_smoothing, rpo_alpha, cpo_alpha and simpo_gamma");
  if (p.loss_type != PreferenceLoss::ApoZeroUnpaired &&
      int64_t{r.data.batch_size} * r.train.gradient_accumulation_steps < 2)
    fail(o, "data.batch_size",
         "is 1 with train.gradient_accumulation_steps 1: KTO estimates its KL term from each prompt paired with "
         "another example's completion of the step, which needs 2 examples a step at least: raise either");
}

// train.objective: grpo (TRL's GRPOTrainer): prompts, completions sampled from the model, rewards.
void grpo_rules(const Recipe& r, const RecipeOrigin& o) {
  if (r.data.format != Format::Prompt)
    fail(o, "train.objective",
         fmt::format("is grpo, which samples its own completions of prompts, but data.format is {}: set data.format: "
                     "prompt (with data.prompt_field)",
                     name(r.data.format)));
  if (r.preference != PreferenceSection{})
    fail(o, "train.objective",
         "is grpo, but preference: keys are set; grpo's own are under grpo: (grpo.beta, grpo.loss_type): remove "
         "them");
  if (r.grpo.rewards.empty())
    fail(o, "grpo.rewards",
         "must list at least one reward (e.g. grpo.rewards: [{name: answer, kind: exact, field: "
         "answer}])");
  if (r.data.packing) fail(o, "data.packing", "is true: grpo does not pack its completions: set data.packing: false");
  if (!r.data.sources.empty() && r.data.mix_by == MixBy::Tokens)
    fail(o, "data.mix_by",
         "is tokens, but grpo's prompts have no trained tokens to share out: set data.mix_by: examples");
}

constexpr Rule kRules[] = {
    // The GGUF's own blocks are the frozen base: nothing else may quantise or rewrite it.
    {"model.keep_quantized",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (!r.model.keep_quantized) return;
       if (!r.model.path.ends_with(".gguf"))
         fail(o, "model.keep_quantized",
              fmt::format("keeps a GGUF file's own blocks, and model.path {} is not a .gguf file: set "
                          "model.keep_quantized: false (lora.quantize_base holds other models in NF4)",
                          printable(r.model.path)));
       if (r.lora.quantize_base)
         fail(o, "model.keep_quantized",
              "and lora.quantize_base are both set: the GGUF's blocks are the quantised base already, and NF4 "
              "would round them again; drop one");
       if (r.lora.init == "pissa" || r.lora.init.starts_with("pissa_niter_") || r.lora.init == "olora")
         fail(o, "model.keep_quantized",
              fmt::format("holds the base as the GGUF's blocks, which lora.init {} would rewrite: set lora.init: "
                          "default, or model.keep_quantized: false",
                          r.lora.init));
     }},
    // Where the documents are: data.source decides which keys must be set.
    {"data.database",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.data.source == Source::MongoDB) require(o, "data.database", r.data.database, "for data.source: mongodb");
     }},
    {"data.collection",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.data.source == Source::MongoDB && r.data.sources.empty() && !adapters_locate_themselves(r))
         require(o, "data.collection", r.data.collection, "for data.source: mongodb");
     }},
    {"data.path",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.data.source == Source::Jsonl && r.data.sources.empty() && !adapters_locate_themselves(r) &&
           r.adapters.per.empty())  // (adapters.per is refused for JSONL in so many words)
         require(o, "data.path", r.data.path, "for data.source: jsonl");
     }},
    {"data.sources", check_sources},
    // What a document becomes: data.format decides which fields must be named.
    {"data.prompt_template",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.data.format != Format::Instruction) return;
       require(o, "data.prompt_template", r.data.prompt_template, "for data.format: instruction");
       try {
         detail::parse_template(r.data.prompt_template, "data.prompt_template");
       } catch (const Error& e) {
         throw Error(fmt::format("{}: {}", o.at("data.prompt_template"), e.what()));
       }
     }},
    {"data.response_field",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.data.format == Format::Instruction)
         require(o, "data.response_field", r.data.response_field, "for data.format: instruction");
     }},
    {"data.text_field",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.data.format == Format::Text) require(o, "data.text_field", r.data.text_field, "for data.format: text");
     }},
    {"data.messages_field",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.data.format == Format::Chat)
         require(o, "data.messages_field", r.data.messages_field, "for data.format: chat");
     }},
    {"data.chosen_field",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.data.format == Format::Unpaired) {
         for (const auto& [key, value] : {std::pair{"data.prompt_field", &r.data.prompt_field},
                                          {"data.completion_field", &r.data.completion_field},
                                          {"data.label_field", &r.data.label_field}})
           require(o, key, *value, "for data.format: unpaired");
         if (r.data.label_field == r.data.completion_field || r.data.label_field == r.data.prompt_field)
           fail(o, "data.label_field",
                fmt::format("is '{}', a field that holds text here: name the field holding true/false or 1/0",
                            r.data.label_field));
       }
       if (r.data.format == Format::Prompt)
         require(o, "data.prompt_field", r.data.prompt_field, "for data.format: prompt");
       if (r.data.format != Format::Preference) return;
       for (const auto& [key, value] : {std::pair{"data.prompt_field", &r.data.prompt_field},
                                        {"data.chosen_field", &r.data.chosen_field},
                                        {"data.rejected_field", &r.data.rejected_field}})
         require(o, key, *value, "for data.format: preference");
       if (r.data.chosen_field == r.data.rejected_field)
         fail(o, "data.chosen_field",
              fmt::format("and data.rejected_field are both '{}': name the two completions' fields",
                          r.data.chosen_field));
     }},
    // Trained tables: the embedding and head whole, or some embedding rows.
    {"lora.modules_to_save",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       const auto& targets = r.lora.target_modules;
       for (const std::string& m : r.lora.modules_to_save) {
         if (m == "embed_tokens" || m == "wte" || m == "lm_head") continue;
         const bool adapted = r.lora.all_linear() || std::find(targets.begin(), targets.end(), m) != targets.end();
         fail(o, "lora.modules_to_save",
              fmt::format("lists '{}'{}: it takes the embedding (embed_tokens; wte for gpt2) and the output head "
                          "(lm_head), which it trains whole",
                          printable(m), adapted ? ", which lora.target_modules adapts" : ""));
       }
       const bool tables = !r.lora.modules_to_save.empty() || !r.lora.trainable_token_indices.empty();
       if (tables && r.lora.plus_lr_ratio)
         fail(o, r.lora.modules_to_save.empty() ? "lora.trainable_token_indices" : "lora.modules_to_save",
              "with lora.plus_lr_ratio: PEFT's LoRA+ gives embeddings a learning rate of their own "
              "(loraplus_lr_embedding), which lorarun does not offer yet: drop one of them");
     }},
    {"lora.trainable_token_indices",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       const auto& ids = r.lora.trainable_token_indices;
       if (ids.empty()) return;
       std::set<int64_t> seen;
       for (const int64_t id : ids) {
         if (id < 0) fail(o, "lora.trainable_token_indices", fmt::format("has {}: token ids are 0 or more", id));
         if (!seen.insert(id).second)
           fail(o, "lora.trainable_token_indices", fmt::format("lists {} twice: list each token once", id));
       }
       for (const std::string& m : r.lora.modules_to_save)
         if (m == "embed_tokens" || m == "wte")
           fail(o, "lora.trainable_token_indices",
                fmt::format("trains rows of the embedding, which lora.modules_to_save lists ({}) to train whole: "
                            "use one of them (PEFT refuses both too)",
                            m));
     }},
    {"lora.init",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       const std::string& init = r.lora.init;
       const std::string n = init.starts_with("pissa_niter_") ? init.substr(12) : "";
       const bool count = !n.empty() && n.size() <= 4 &&
                          std::all_of(n.begin(), n.end(), [](char c) { return c >= '0' && c <= '9'; }) &&
                          std::stol(n) <= 1000;
       if (count && std::stol(n) == 0)
         fail(o, "lora.init",
              "is pissa_niter_0, but N counts the randomised SVD's subspace iterations and must be at least 1: "
              "pissa_niter_4, say, or pissa for the exact SVD");
       if (!count && init != "default" && init != "gaussian" && init != "pissa" && init != "olora")
         fail(o, "lora.init",
              fmt::format("'{}' is not one of default, gaussian, pissa, pissa_niter_N (N from 1 to 1000) or olora",
                          printable(init)));
       if (init == "default") return;
       if (!r.lora.init_from.empty())
         fail(o, "lora.init",
              fmt::format("is {} but lora.init_from starts the adapters from a saved one: set one of them", init));
       if (init == "gaussian") return;
       const std::string what = fmt::format(
           "is {}, which starts A and B from the base weights and trains on the "
           "residual W - s·BA,",
           init);
       if (r.lora.use_dora)
         fail(o, "lora.init",
              what +
                  " and with lora.use_dora the adapter could not be saved for the original base (PEFT's "
                  "conversion drops the magnitudes): set lora.use_dora: false or lora.init: default");
       if (r.dist.shard_base)
         fail(o, "lora.init", what + " whole, which dist.shard_base splits across ranks: set dist.shard_base: false");
       if (r.lora.quantize_base && init != "olora")
         fail(o, "lora.init",
              what +
                  " in float, and lora.quantize_base holds them in NF4 (PEFT refuses this too): drop "
                  "quantize_base, or use lora.init: olora");
       if (r.train.objective == Objective::Dpo || r.train.objective == Objective::Kto ||
           (r.train.objective == Objective::Grpo && r.grpo.beta > 0))
         fail(o, "lora.init",
              fmt::format("{} and {}'s reference is the base with the adapter off, which would be that residual: use "
                          "lora.init: default with train.objective: {}",
                          what, name(r.train.objective), name(r.train.objective)));
     }},
    // A preference objective trains on pairs; the supervised one on single documents.
    {"train.objective",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       const bool pairs = r.data.format == Format::Preference, unpaired = r.data.format == Format::Unpaired;
       if (r.train.objective == Objective::Grpo) return grpo_rules(r, o);
       if (r.grpo != GrpoSection{})
         fail(o, "train.objective",
              fmt::format("is {}, but grpo: keys are set; they apply to train.objective: grpo only: remove them",
                          name(r.train.objective)));
       if (r.data.format == Format::Prompt)
         fail(o, "train.objective",
              fmt::format("is {}, but data.format: prompt gives prompts without completions: set train.objective: "
                          "grpo, which samples them",
                          name(r.train.objective)));
       if (r.train.objective == Objective::Sft && (pairs || unpaired))
         fail(o, "train.objective",
              fmt::format("is sft, but data.format: {} gives {}: set train.objective: {}, or a data.format of single "
                          "documents",
                          name(r.data.format), pairs ? "pairs of completions" : "labelled completions",
                          pairs ? "dpo" : "kto"));
       if (r.train.objective == Objective::Sft && r.preference != PreferenceSection{})
         fail(o, "train.objective",
              "is sft, but preference: keys are set; they apply to train.objective: dpo, orpo, cpo, simpo or kto "
              "only: remove them or set train.objective: dpo");
       if (r.train.objective == Objective::Sft) return;
       if (r.train.objective == Objective::Kto) {
         kto_rules(r, o);
       } else if (unpaired) {
         fail(o, "train.objective",
              fmt::format("is {}, which trains on pairs, but data.format: unpaired gives single completions marked "
                          "desirable or not: set train.objective: kto",
                          name(r.train.objective)));
       }
       if (r.train.objective == Objective::Orpo &&
           (r.preference.loss_type != PreferenceLoss::Sigmoid || r.preference.label_smoothing > 0 ||
            r.preference.rpo_alpha || r.preference.cpo_alpha ||
            r.preference.simpo_gamma != PreferenceSection{}.simpo_gamma))
         fail(o, "train.objective",
              "is orpo, which has no reference and its own loss: of the preference: keys only beta (ORPO's lambda) "
              "applies; remove loss_type, label_smoothing, rpo_alpha, cpo_alpha and simpo_gamma");
       if (!pairs && !unpaired)
         fail(o, "train.objective",
              fmt::format("{} trains on pairs of a chosen and a rejected completion, but data.format is {}: set "
                          "data.format: preference (with data.prompt_field, chosen_field, rejected_field)",
                          name(r.train.objective), name(r.data.format)));
       if (r.data.packing)
         fail(o, "train.objective",
              fmt::format("{} does not pack pairs: set data.packing: false", name(r.train.objective)));
       if (r.data.train_on_input)
         fail(o, "train.objective",
              fmt::format("{} scores the completions only: set data.train_on_input: false", name(r.train.objective)));
     }},
    {"preference.label_smoothing",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       const PreferenceLoss loss = r.preference.loss_type;
       if (r.preference.label_smoothing > 0 && loss != PreferenceLoss::Sigmoid && loss != PreferenceLoss::Simpo)
         fail(o, "preference.label_smoothing",
              fmt::format("applies to preference.loss_type sigmoid and simpo only (conservative DPO), not {}: set it "
                          "to 0",
                          name(loss)));
     }},
    // CPO and SimPO (TRL's CPOTrainer): no reference; their own NLL weight and SimPO's margin.
    {"preference.cpo_alpha",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       const PreferenceSection& p = r.preference;
       const Objective objective = r.train.objective;
       const bool cpo = objective == Objective::Cpo || objective == Objective::Simpo;
       if (objective == Objective::Sft || objective == Objective::Orpo || objective == Objective::Kto)
         return;  // (train.objective's rule)
       if (p.loss_type == PreferenceLoss::Kto || p.loss_type == PreferenceLoss::ApoZeroUnpaired)
         fail(o, "preference.loss_type",
              fmt::format("{} is a loss of labelled single completions: set train.objective: kto (with data.format: "
                          "unpaired)",
                          name(p.loss_type)));
       if (p.desirable_weight != 1 || p.undesirable_weight != 1)
         fail(o, p.desirable_weight != 1 ? "preference.desirable_weight" : "preference.undesirable_weight",
              fmt::format("applies to train.objective kto only, not {}: remove it", name(objective)));
       if (cpo && p.rpo_alpha)
         fail(o, "preference.rpo_alpha",
              fmt::format("is DPO's NLL weight; train.objective {} weighs the chosen completions' NLL by "
                          "preference.cpo_alpha: set that instead",
                          name(objective)));
       if (!cpo && p.cpo_alpha)
         fail(o, "preference.cpo_alpha", "applies to train.objective cpo and simpo: with dpo set preference.rpo_alpha");
       if (!cpo && p.loss_type == PreferenceLoss::Simpo)
         fail(o, "preference.loss_type",
              "simpo is a loss without a reference (TRL's CPOTrainer): set train.objective: simpo");
       if (objective == Objective::Simpo && p.loss_type != PreferenceLoss::Sigmoid &&
           p.loss_type != PreferenceLoss::Simpo)
         fail(o, "preference.loss_type",
              fmt::format("is {}, but train.objective simpo is the simpo loss: set train.objective: cpo for CPO's {} "
                          "loss",
                          name(p.loss_type), name(p.loss_type)));
       const bool simpo = objective == Objective::Simpo || p.loss_type == PreferenceLoss::Simpo;
       if (!simpo && p.simpo_gamma != PreferenceSection{}.simpo_gamma)
         fail(o, "preference.simpo_gamma",
              "is SimPO's margin: it applies to train.objective simpo (or cpo with loss_type simpo) only: remove it");
     }},
    // Only DPO and KTO have a reference whose log-probs could be computed ahead.
    {"preference.precompute_reference",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       const Objective objective = r.train.objective;
       if (r.preference.precompute_reference && objective != Objective::Dpo && objective != Objective::Kto)
         fail(o, "preference.precompute_reference",
              fmt::format("applies to train.objective dpo and kto, whose losses compare with a reference; {} has none: "
                          "remove it",
                          name(objective)));
     }},
    // The checkpoint policy: listed epochs exist (0-based, below train.epochs), once each.
    {"checkpoint.epochs_to_save",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       const int epochs = r.train.epochs;
       std::set<int> seen;
       for (int e : r.checkpoint.epochs_to_save.epochs) {
         if (e < 0 || e >= epochs)
           fail(o, "checkpoint.epochs_to_save",
                fmt::format("lists epoch {}, but epochs are 0-based and train.epochs is {}, so the valid epochs "
                            "are 0..{}",
                            e, epochs, epochs - 1));
         if (!seen.insert(e).second)
           fail(o, "checkpoint.epochs_to_save", fmt::format("lists epoch {} twice; list each epoch once", e));
       }
     }},
    // save_last_epoch_only wins over an explicit epochs_to_save, with a warning.
    {"checkpoint.save_last_epoch_only",
     [](const Recipe& r, const RecipeOrigin& o, Warnings& warnings) {
       const CheckpointSection& c = r.checkpoint;
       if (c.save_last_epoch_only && c.epochs_to_save.mode != EpochsToSave::Mode::All)
         warnings.push_back(fmt::format(
             "{}: checkpoint.save_last_epoch_only: true takes precedence over "
             "checkpoint.epochs_to_save: {}; only epoch_{}/ is kept (remove one of the "
             "two keys)",
             o.at("checkpoint.save_last_epoch_only"), detail::yaml_text(c.epochs_to_save), r.train.epochs - 1));
     }},
    // Evaluation documents are never trained on: a selection that would overlap data's is refused.
    {"eval.filter",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.eval.filter.empty()) return;
       if (r.data.source == Source::Jsonl)
         fail(o, "eval.filter",
              "needs data.source: mongodb (JSONL documents are not filtered); use eval.path or eval.fraction");
       if (r.eval.filter == r.data.filter && (r.eval.collection.empty() || r.eval.collection == r.data.collection))
         fail(o, "eval.filter",
              fmt::format("is data.filter ({}), so the evaluation documents would be trained on: give data.filter "
                          "and eval.filter disjoint queries (e.g. {{split: train}} and {{split: eval}}) or use "
                          "eval.fraction",
                          r.data.filter.dump()));
     }},
    {"eval.path",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.eval.path.empty() || r.data.source != Source::Jsonl) return;  // mongodb: ignored, as data.path
       std::error_code ec;
       const auto a = std::filesystem::weakly_canonical(r.eval.path, ec);
       const auto b = std::filesystem::weakly_canonical(r.data.path, ec);
       if (r.eval.path == r.data.path || (!ec && a == b))
         fail(o, "eval.path",
              "is data.path, so the evaluation documents would be trained on: give a separate file or use "
              "eval.fraction");
     }},
    {"eval.fraction",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.eval.fraction <= 0) return;
       const char* other = !r.eval.filter.empty()                                   ? "filter"
                           : !r.eval.collection.empty()                             ? "collection"
                           : r.data.source == Source::Jsonl && !r.eval.path.empty() ? "path"
                                                                                    : nullptr;
       if (other)
         fail(o, "eval.fraction",
              fmt::format("holds out part of data's selection, and eval.{} is set too, which would overlap it or "
                          "train on it: set only one of eval.fraction, eval.filter/eval.collection, eval.path",
                          other));
       if (r.data.source == Source::MongoDB && r.data.shuffle == Shuffle::Stream)
         fail(o, "eval.fraction",
              "needs the selection's ids, which data.shuffle: stream never lists: use data.shuffle: global or none, "
              "or eval.filter");
     }},
    // Steering by the held-out loss needs one.
    {"train.early_stopping_patience",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.train.early_stopping_patience && !r.eval.enabled(r.data.source))
         fail(o, "train.early_stopping_patience", no_eval_split(r));
     }},
    {"checkpoint.keep_best",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.checkpoint.keep_best && !r.eval.enabled(r.data.source)) fail(o, "checkpoint.keep_best", no_eval_split(r));
     }},
    // MLflow is logged to through a tracking server's REST API: a file store or a database URI
    // (what MLflow's Python client also accepts) cannot be written from here.
    {"track.mlflow_uri",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       const std::string& uri = r.track.mlflow_uri;
       if (uri.empty() || uri.starts_with("http://") || uri.starts_with("https://")) return;
       fail(o, "track.mlflow_uri",
            fmt::format("is '{}', not an http(s):// URI: give the address of a tracking server (`mlflow server "
                        "--host 0.0.0.0 --port 5000` serves one at http://HOST:5000), or \"\" for no MLflow",
                        redact_uri(uri)));
     }},
    // The artifacts go where the run record goes.
    {"checkpoint.store",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.checkpoint.store != Store::MongoDB) return;
       if (!r.track.mongodb)
         fail(o, "checkpoint.store",
              "is mongodb, which stores the adapters next to the run record, but track.mongodb is false: set "
              "track.mongodb: true or checkpoint.store: none");
       if (r.data.uri.empty() || r.track.database.empty())
         fail(o, "checkpoint.store",
              "is mongodb but no MongoDB URI is set: set data.uri or LORARUN_MONGODB_URI (and track.database or "
              "data.database), or checkpoint.store: none");
     }},
    {"adapters.list", check_adapters},
    {"dist.backend",
     [](const Recipe& r, const RecipeOrigin& o, Warnings&) {
       if (r.dist.backend == DistBackend::Nccl && r.model.device == Device::Cpu)
         fail(o, "dist.backend",
              "is nccl, which needs CUDA, but model.device is cpu; use dist.backend: gloo (or auto)");
     }},
};

// data.sources: names that can name metrics and directories, once each; weights above 0; each
// source's selection as data.source reads it; each source's format keys as complete as data's
// would have to be (the format rules run on the source's own keys).
void check_sources(const Recipe& r, const RecipeOrigin& o, Warnings& w) {
  const std::vector<DataSource>& sources = r.data.sources;
  if (sources.empty()) return;
  const bool mongo = r.data.source == Source::MongoDB;
  if (mongo && !r.data.collection.empty())
    fail(o, "data.sources",
         fmt::format("and data.collection ({}) are both set: each source names its own collection; remove "
                     "data.collection",
                     printable(r.data.collection)));
  if (!mongo && !r.data.path.empty())
    fail(o, "data.sources",
         fmt::format("and data.path ({}) are both set: each source names its own file; remove data.path",
                     printable(r.data.path)));
  if (mongo && !r.eval.filter.empty() && r.eval.collection.empty())
    fail(o, "data.sources",
         "are set with eval.filter but no eval.collection: name the collection the evaluation documents are in "
         "(eval.collection), or hold out a share of every source with eval.fraction");
  std::set<std::string> names;
  for (size_t i = 0; i < sources.size(); ++i) {
    const DataSource& s = sources[i];
    if (!is_name_component(s.name) || s.name.size() > 64 || s.name.find('.') != std::string::npos)
      fail(o, "data.sources",
           fmt::format("entry {} is named {}: a source needs a name of 1 to 64 letters, digits, '_', '+' or '-', "
                       "not starting with '-' (it names the source's metrics, eval_loss/<name>)",
                       i, s.name.empty() ? std::string("nothing") : fmt::format("'{}'", printable(s.name))));
    if (!names.insert(s.name).second)
      fail(o, "data.sources", fmt::format("name '{}' twice: give each source its own name", s.name));
    if (!(s.weight > 0) || !std::isfinite(s.weight))
      fail(o, "data.sources",
           fmt::format("'{}' has weight {}: weights are numbers above 0 (a source's share is its weight over their "
                       "sum); remove a source to leave it out",
                       s.name, s.weight));
    if (mongo && s.collection.empty())
      fail(o, "data.sources",
           fmt::format("'{}' names no collection: set its collection (of data.database), with a filter to select "
                       "part of it",
                       s.name));
    if (mongo && !s.path.empty())
      fail(o, "data.sources",
           fmt::format("'{}' sets path, which data.source: jsonl reads: set its collection instead", s.name));
    if (!mongo && s.path.empty())
      fail(o, "data.sources", fmt::format("'{}' names no file: set its path (data.source is jsonl)", s.name));
    if (!mongo && (!s.collection.empty() || !s.filter.empty()))
      fail(o, "data.sources",
           fmt::format("'{}' sets {}, which data.source: mongodb reads: set its path instead", s.name,
                       s.collection.empty() ? "filter" : "collection"));
    Recipe one = r;
    one.data = r.data.of_source(s);
    for (const Rule& rule : kRules)
      if ((rule.key.starts_with("data.") && rule.key != "data.sources" && rule.key != "data.database") ||
          rule.key == "train.objective")
        try {
          rule.check(one, o, w);
        } catch (const Error& e) {
          throw Error(fmt::format("{} (for data.sources '{}')", e.what(), s.name));
        }
  }
}

// What one base pass cannot share between adapters, or a job does not offer: one line each.
void refuse_in_jobs(const Recipe& r, const RecipeOrigin& o) {
  const auto refuse = [&](std::string_view what) {
    fail(o, r.adapters.per.empty() ? "adapters.list" : "adapters.per",
         fmt::format("trains many adapters on one base, which {}", what));
  };
  if (r.adapters.per_pass && r.train.objective != Objective::Sft)
    fail(o, "adapters.per_pass",
         fmt::format(
             "stacks SFT adapters into shared passes, but with train.objective {} each adapter's micro-batches go "
             "through passes of their own: drop it",
             name(r.train.objective)));
  if (r.lora.init != "default" && r.lora.init != "gaussian")
    refuse(fmt::format("lora.init {} cannot share: it rewrites the base weights per adapter", r.lora.init));
}

// adapters: a field to split data's selection by, or listed adapters with names that can name
// directories and metrics (once each), each selecting its documents unless adapters.per does; every
// adapter's own recipe valid (adapter_recipe).
void check_adapters(const Recipe& r, const RecipeOrigin& o, Warnings&) {
  const AdaptersSection& a = r.adapters;
  if (!a.enabled()) return;
  refuse_in_jobs(r, o);
  const bool per = !a.per.empty();
  if (per && r.data.source != Source::MongoDB)
    fail(o, "adapters.per",
         "needs data.source: mongodb (a JSONL file is not queried): list each adapter's file under adapters.list "
         "with its path");
  if (per && (a.per.starts_with('$') || a.per.find('\0') != std::string::npos || a.per.front() == '.' ||
              a.per.back() == '.' || a.per.find("..") != std::string::npos))
    fail(o, "adapters.per",
         fmt::format("'{}' is not a document field name (e.g. tenant, meta.customer)", detail::show(a.per)));
  if (!per && r.data.source == Source::Jsonl && !r.data.sources.empty())
    fail(o, "adapters.list",
         "with data.sources from JSONL files has no way to give each adapter its documents (each source names its "
         "own file, and a file is not queried): use data.source: mongodb, or give each adapter its file under "
         "adapters.list without data.sources");
  std::set<std::string> names;
  std::map<std::string, std::string> folded;  // case_folded(name) -> name
  for (size_t i = 0; i < a.list.size(); ++i) {
    const AdapterSpec& s = a.list[i];
    if (!is_adapter_name(s.name))
      fail(o, "adapters.list",
           fmt::format("entry {} is named {}: an adapter needs a name of 1 to 64 letters, digits, '_', '+' or '-', "
                       "not starting with '-' and not logs, tensorboard, best, resume_state or epoch_N (it names its "
                       "directory <output_dir>/<name>/)",
                       i, s.name.empty() ? std::string("nothing") : fmt::format("'{}'", printable(s.name))));
    if (!names.insert(s.name).second)
      fail(o, "adapters.list", fmt::format("name '{}' twice: give each adapter its own name", s.name));
    if (const auto [it, fresh] = folded.emplace(case_folded(s.name), s.name); !fresh)
      fail(o, "adapters.list",
           fmt::format("names '{}' and '{}' differ only in case: they would share a directory on a case-insensitive "
                       "filesystem or store; rename one",
                       it->second, s.name));
    if (per && (s.selects() || !s.eval_filter.empty()))
      fail(o, "adapters.list",
           fmt::format("'{}' sets {} with adapters.per, which selects its documents ({} is its name): with per, an "
                       "entry sets only r, alpha, target_modules, lr, epochs",
                       s.name,
                       !s.filter.empty()       ? "filter"
                       : !s.collection.empty() ? "collection"
                       : !s.path.empty()       ? "path"
                                               : "eval_filter",
                       a.per));
    if (!per && r.data.source == Source::MongoDB && !s.path.empty())
      fail(o, "adapters.list",
           fmt::format("'{}' sets path, which data.source: jsonl reads: give it a filter or a collection", s.name));
    if (!per && r.data.source == Source::Jsonl && (s.path.empty() || !s.filter.empty() || !s.collection.empty()))
      fail(o, "adapters.list",
           fmt::format("'{}' needs its own path (data.source is jsonl, whose files are not queried)", s.name));
    if (!r.data.sources.empty() && (!s.collection.empty() || !s.path.empty()))
      fail(o, "adapters.list",
           fmt::format("'{}' sets {}, which each of data.sources names for itself: give the adapter a filter, which "
                       "narrows every source",
                       s.name, s.collection.empty() ? "path" : "collection"));
    if (!per && r.data.source == Source::MongoDB && !s.selects())
      fail(o, "adapters.list",
           fmt::format("'{}' selects no documents of its own: give it a filter (with data.filter's conditions) "
                       "and/or a collection",
                       s.name));
    try {
      AdapterSpec own = s;
      if (per) own.filter = {{a.per, s.name}};
      (void)adapter_recipe(r, own);
    } catch (const Error& e) {
      throw Error(fmt::format("{}: {}", o.at("adapters.list"), e.what()));
    }
  }
}

}  // namespace

Recipe adapter_recipe(const Recipe& job, const AdapterSpec& a) {
  // Both selections' conditions, as data.sources combines them.
  const auto both = [](const nlohmann::json& x, const nlohmann::json& y) {
    return x.empty() ? y : y.empty() ? x : nlohmann::json{{"$and", {x, y}}};
  };
  Recipe r = job;
  r.adapters = {};
  r.warnings.clear();
  if (!a.collection.empty()) r.data.collection = a.collection;
  if (!a.path.empty()) r.data.path = a.path;
  r.data.filter = both(job.data.filter, a.filter);
  if (!a.eval_filter.empty())
    r.eval.filter = a.eval_filter;
  else if (!job.eval.filter.empty())
    r.eval.filter = both(job.eval.filter, a.filter);
  if (a.r) r.lora.r = *a.r;
  if (a.alpha) r.lora.alpha = *a.alpha;
  if (a.target_modules) r.lora.target_modules = *a.target_modules;
  if (a.lr) r.train.lr = *a.lr;
  if (a.epochs) r.train.epochs = *a.epochs;
  r.checkpoint.output_dir = (std::filesystem::path(job.checkpoint.output_dir) / a.name).string();
  (void)validate(r, RecipeOrigin{fmt::format("adapter '{}'", printable(a.name)), {}});
  return r;
}

std::vector<std::string_view> detail::rule_keys() {
  std::vector<std::string_view> keys;
  for (const Rule& rule : kRules) keys.push_back(rule.key);
  return keys;
}

std::vector<std::string> validate(const Recipe& r, const RecipeOrigin& o) {
  Warnings warnings;
  detail::for_each_key(r, [&](const detail::Key& key, const auto& value) {
    for (const Rule& rule : kRules)
      if (rule.key == key.name) rule.check(r, o, warnings);
    detail::check_declared(key, value, o);
  });
  return warnings;
}

}  // namespace lorarun::recipe
