#include "model/lora.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <utility>

#include "io/files.hpp"
#include "model/dora.hpp"
#include "model/families.hpp"
#include "model/lora_init.hpp"
#include "model/transformer.hpp"
#include "model/weights.hpp"
#include "recipe/recipe.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/untrusted.hpp"

namespace lorarun::model {
namespace {

namespace fs = std::filesystem;
constexpr const char* kPrefix = "base_model.model.";

std::string short_name(const std::string& module) { return module.substr(module.rfind('.') + 1); }

bool is_all_linear(const LoraConfig& cfg) {
  return cfg.target_modules.size() == 1 && cfg.target_modules[0] == "all-linear";
}

std::string with_commas(int64_t n) {
  const std::string digits = std::to_string(n);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && digits[i - 1] != '-' && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return out;
}

// PEFT's rule for modules_to_save: the module's full name, or a suffix after a '.'.
bool names_module(const std::string& module, const std::string& name) {
  return module == name ||
         (module.ends_with(name) && module.size() > name.size() && module[module.size() - name.size() - 1] == '.');
}

// The modules PEFT names the keys of a mixture-of-experts layer's adapted tensors by, as its
// target_parameters nests them: each adapted tensor wraps the experts module once, gate_up_proj
// (registered first) innermost, so with both adapted its keys say "experts.base_layer".
std::vector<std::pair<std::string, Experts*>> expert_modules(MoeMlp& m, bool gate_up, bool down) {
  const std::string module = m.down.name.substr(0, m.down.name.rfind('.'));
  std::vector<std::pair<std::string, Experts*>> out;
  if (gate_up) out.emplace_back(down ? module + ".base_layer" : module, &m.gate_up);
  if (down) out.emplace_back(module, &m.down);
  return out;
}

// The adapted expert tensors of `model` under PEFT's module names, in model order.
std::vector<std::pair<std::string, Experts*>> adapted_experts(const CausalLM& model) {
  std::vector<std::pair<std::string, Experts*>> out;
  for (const MoeMlp* layer : model.moe_layers()) {
    auto& m = const_cast<MoeMlp&>(*layer);
    for (auto& entry : expert_modules(m, m.gate_up.adapted(), m.down.adapted())) out.push_back(std::move(entry));
  }
  return out;
}

// The r and alpha of expert tensor `x`'s adapter: cfg's, twice them for gate_up_proj when PEFT fused
// gate_proj's and up_proj's adapters into it (the same alpha / r; rsLoRA's alpha / sqrt(r) grows).
LoraConfig config_of(const Experts& x, const LoraConfig& cfg) {
  LoraConfig own = cfg;
  if (cfg.fused_gate_up && x.name.ends_with(".gate_up_proj")) {
    own.r *= 2;
    own.alpha *= 2;
  }
  return own;
}

// Starts PEFT's adapter of a stacked expert tensor [E, out, in]: A [r·E, in] as a linear's A of
// `in` inputs (Kaiming-uniform, or gaussian's N(0, 1/r)), B [out, r·E] zeros.
void init_experts(Experts& x, const LoraConfig& cfg, at::Generator& gen, at::ScalarType dtype, at::Device device) {
  c10::NoGradGuard no_grad;
  at::Tensor a = at::empty({cfg.r * x.count(), x.in_features()}, at::kFloat);
  if (cfg.init == "gaussian")
    a.normal_(0.0, 1.0 / static_cast<double>(cfg.r), gen);
  else {
    const double bound = 1.0 / std::sqrt(static_cast<double>(x.in_features()));
    a.uniform_(-bound, bound, gen);
  }
  x.lora_a = a.to(device, dtype).set_requires_grad(true);
  x.lora_b = at::zeros({x.out_features(), cfg.r * x.count()}, at::TensorOptions().dtype(dtype).device(device))
                 .set_requires_grad(true);
  x.scaling = cfg.scaling();
}

// modules_to_save's copies and trainable_token_indices' rows, taken from the frozen tables.
TrainedTables make_tables(const CausalLM& model, const LoraConfig& cfg, at::ScalarType dtype) {
  c10::NoGradGuard no_grad;
  TrainedTables t;
  const auto copy = [&](const at::Tensor& w) { return w.to(dtype).clone().set_requires_grad(true); };
  for (const std::string& name : cfg.modules_to_save) {
    if (names_module(model.embedding_name(), name))
      t.embed = copy(model.frozen_embedding());
    else if (name == "lm_head")
      t.head = copy(model.frozen_lm_head());
    else
      throw Error(
          fmt::format("lora.modules_to_save '{}' is neither this {} model's embedding ({}) nor its output "
                      "head (lm_head), the modules it trains whole",
                      printable(name), model.config().model_type, short_name(model.embedding_name())));
  }
  if (cfg.trainable_token_indices.empty()) return t;
  if (t.embed.defined())
    throw Error(
        fmt::format("lora.trainable_token_indices trains rows of {}, which lora.modules_to_save trains whole: "
                    "use one of them (PEFT refuses both too)",
                    short_name(model.embedding_name())));
  const int64_t vocab = model.frozen_embedding().size(0);
  if (std::set<int64_t>(cfg.trainable_token_indices.begin(), cfg.trainable_token_indices.end()).size() !=
      cfg.trainable_token_indices.size())
    throw Error("lora.trainable_token_indices lists a token twice: list each once");
  for (const int64_t id : cfg.trainable_token_indices)
    if (id < 0 || id >= vocab)
      throw Error(
          fmt::format("lora.trainable_token_indices has {}, but the embedding has rows 0 to {}: add the "
                      "token to the base model first (resize its embedding)",
                      id, vocab - 1));
  const at::Tensor& table = model.frozen_embedding();
  const at::TensorOptions longs = table.options().dtype(at::kLong);
  const int64_t n = static_cast<int64_t>(cfg.trainable_token_indices.size());
  t.token_ids = at::tensor(cfg.trainable_token_indices, at::TensorOptions().dtype(at::kLong)).to(table.device());
  if (table.is_meta()) {  // shapes only (a memory estimate): nothing to gather
    t.token_rows = at::empty({n, table.size(1)}, table.options().dtype(dtype)).set_requires_grad(true);
  } else {
    t.token_rows = copy(table.index_select(0, t.token_ids));
    t.token_slot = at::full({vocab}, -1, longs).index_put_({t.token_ids}, at::arange(n, longs));
  }
  t.head_tokens = model.head_tied();  // PEFT ties the head's rows to the embedding's
  return t;
}

bool has_tables(const LoraConfig& cfg) { return !cfg.modules_to_save.empty() || !cfg.trainable_token_indices.empty(); }

// Tables `t` of `model` under the names PEFT saves them by (T: TrainedTables or const TrainedTables).
template <class T>
auto table_slots(const CausalLM& model, T& t) {
  std::vector<std::pair<std::string, decltype(&t.embed)>> out;
  if (t.embed.defined()) out.emplace_back(kPrefix + model.embedding_name() + ".weight", &t.embed);
  if (t.head.defined()) out.emplace_back(std::string(kPrefix) + "lm_head.weight", &t.head);
  if (t.token_rows.defined())
    out.emplace_back(kPrefix + model.embedding_name() + ".token_adapter.trainable_tokens_delta", &t.token_rows);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> table_state(const CausalLM& model, const TrainedTables& tables) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const auto& [name, t] : table_slots(model, tables)) out.emplace_back(name, *t);
  return out;
}

// adapter_config.json's modules_to_save and trainable_token_indices (a list, or PEFT's per-layer
// mapping where it names the embedding, and a tied head with the same rows).
void read_tables(const nlohmann::json& j, const CausalLM& model, LoraConfig& cfg, const std::string& where) {
  if (const auto m = j.find("modules_to_save"); m != j.end() && !m->is_null())
    cfg.modules_to_save = m->get<std::vector<std::string>>();
  const auto tt = j.find("trainable_token_indices");
  if (tt == j.end() || tt->is_null()) return;
  if (tt->is_array()) {
    cfg.trainable_token_indices = tt->get<std::vector<int64_t>>();
    return;
  }
  for (const auto& [name, ids] : tt->items()) {
    const auto rows = ids.get<std::vector<int64_t>>();
    if (names_module(model.embedding_name(), name))
      cfg.trainable_token_indices = rows;
    else if (!(name == "lm_head" && model.head_tied()))
      throw Error(fmt::format("{}: trainable_token_indices of '{}': lorarun trains tokens of the embedding ({}) only",
                              where, printable(name), short_name(model.embedding_name())));
  }
}

// PEFT's state dict; with `for_original_base`, PiSSA/OLoRA layers made to load on the original
// base (PEFT's subtract_mutated_init: BA - B0A0 = [B | -B0] [A; A0]).
std::vector<std::pair<std::string, at::Tensor>> state_of(const CausalLM& model, bool for_original_base) {
  c10::NoGradGuard no_grad;
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const Linear* l : model.linears()) {
    if (!l->adapted()) continue;
    const bool start = for_original_base && l->lora_a0.defined();
    out.emplace_back(kPrefix + l->name + ".lora_A.weight",
                     start ? at::cat({l->lora_a, l->lora_a0.to(l->lora_a.scalar_type())}, 0) : l->lora_a);
    out.emplace_back(kPrefix + l->name + ".lora_B.weight",
                     start ? at::cat({l->lora_b, -l->lora_b0.to(l->lora_b.scalar_type())}, 1) : l->lora_b);
    if (l->dora()) out.emplace_back(kPrefix + l->name + ".lora_magnitude_vector", l->magnitude);
  }
  for (const auto& [module, x] : adapted_experts(model)) {
    out.emplace_back(kPrefix + module + ".lora_A.weight", x->lora_a);
    out.emplace_back(kPrefix + module + ".lora_B.weight", x->lora_b);
  }
  for (auto& entry : table_state(model, model.tables)) out.push_back(std::move(entry));
  return out;
}

// Throws lorarun::Error for target_parameters on a model without experts, or with what PEFT's
// parameter adapters (experts, routers) do not take; before any adapter is attached.
void check_parameter_targets(const CausalLM& model, const LoraConfig& cfg) {
  if (cfg.target_parameters.empty()) return;
  const std::string listed = printable(fmt::format("{}", fmt::join(cfg.target_parameters, ", ")));
  if (model.moe_layers().empty())
    throw Error(
        fmt::format("lora.target_parameters [{}]: this {} model has no expert tensors (it is not a mixture of "
                    "experts); adapt its linear layers with lora.target_modules instead",
                    listed, model.config().model_type));
  if (cfg.use_dora || cfg.dropout > 0 || (cfg.init != "default" && cfg.init != "gaussian"))
    throw Error(fmt::format(
        "a mixture of experts' experts and router (lora.target_parameters [{}]) take plain LoRA, as PEFT's parameter "
        "adapters do: {}, or adapt the attention alone (lora.target_modules: [q_proj, k_proj, v_proj, o_proj])",
        listed,
        cfg.use_dora      ? "no use_dora"
        : cfg.dropout > 0 ? "no lora.dropout"
                          : "lora.init default or gaussian"));
}

// Adds cfg.target_parameters' adapters to the matching expert tensors (after every linear's, drawing
// from `gen` in model order); `routers`: the routers the linears' pass adapted. Throws lorarun::Error
// when they match nothing.
void attach_experts(CausalLM& model, const LoraConfig& cfg, at::Generator& gen, at::ScalarType dtype, int routers) {
  if (cfg.target_parameters.empty()) return;
  int matched = routers;
  for (MoeMlp* m : model.moe_layers())
    for (Experts* x : {&m->gate_up, &m->down})
      if (matches_parameter(x->name, cfg)) {
        init_experts(*x, config_of(*x, cfg), gen, dtype, model.device());
        ++matched;
      }
  if (matched == 0)
    throw Error(
        fmt::format("lora.target_parameters [{}] match no parameter of this {} model; it has mlp.gate.weight (the "
                    "router), mlp.experts.gate_up_proj and mlp.experts.down_proj in each layer (e.g. {})",
                    printable(fmt::format("{}", fmt::join(cfg.target_parameters, ", "))), model.config().model_type,
                    model.moe_layers()[0]->down.name));
}

// Throws the error of target_modules that match no layer, listing the model's layer names.
[[noreturn]] void matched_nothing(const CausalLM& model, const LoraConfig& cfg) {
  std::set<std::string> names;
  for (const Linear* l : model.linears()) names.insert(short_name(l->name));
  throw Error(
      fmt::format("lora.target_modules [{}] match no layer of this {} model; its linear layers are: {} (or use "
                  "all-linear)",
                  fmt::join(cfg.target_modules, ", "), model.config().model_type, fmt::join(names, ", ")));
}

bool converted_for_original_base(const CausalLM& model) {
  for (const Linear* l : model.linears())
    if (l->lora_a0.defined()) return true;
  return false;
}

}  // namespace

double LoraConfig::scaling() const { return use_rslora ? alpha / std::sqrt(double(r)) : alpha / double(r); }

bool matches_target(const std::string& module_name, const LoraConfig& cfg) {
  if (is_all_linear(cfg)) return true;
  return std::any_of(cfg.target_modules.begin(), cfg.target_modules.end(),
                     [&](const std::string& t) { return names_module(module_name, t); });
}

bool matches_parameter(const std::string& parameter_name, const LoraConfig& cfg) {
  return std::any_of(cfg.target_parameters.begin(), cfg.target_parameters.end(),
                     [&](const std::string& t) { return names_module(parameter_name, t); });
}

bool adapts(const Linear& l, const LoraConfig& cfg) {
  return l.router ? matches_parameter(l.name + ".weight", cfg) : matches_target(l.name, cfg);
}

LoraConfig for_model(const CausalLM& model, LoraConfig cfg) {
  if (model.moe_layers().empty()) return cfg;
  using Renamed = std::array<std::pair<std::string_view, std::string_view>, 4>;  // transformers 4's -> 5's
  static constexpr Renamed kQwen = {{{"gate", "gate.weight"},
                                     {"gate_proj", "gate_up_proj"},
                                     {"up_proj", "gate_up_proj"},
                                     {"down_proj", "down_proj"}}};
  static constexpr Renamed kMixtral = {
      {{"gate", "gate.weight"}, {"w1", "gate_up_proj"}, {"w3", "gate_up_proj"}, {"w2", "down_proj"}}};
  const bool mixtral = family_of_model_type(model.config().model_type, model.dir()).moe == FamilyTraits::Moe::Mixtral;
  const Renamed& renamed = mixtral ? kMixtral : kQwen;
  std::vector<std::string> modules = cfg.target_modules;
  if (is_all_linear(cfg)) {  // the linear layers' names, then every expert and router name
    modules.clear();
    for (const Linear* l : model.linears())
      if (const std::string n = short_name(l->name);
          !l->router && std::find(modules.begin(), modules.end(), n) == modules.end())
        modules.push_back(n);
    for (const auto& [old, now] : renamed) modules.emplace_back(old);
  }
  std::vector<std::string> kept;
  std::set<std::string> parameters(cfg.target_parameters.begin(), cfg.target_parameters.end());
  std::set<std::string_view> fused;  // gate_proj, up_proj (w1, w3) seen
  for (const std::string& t : modules) {
    const auto hit = std::find_if(renamed.begin(), renamed.end(),
                                  [&](const auto& r) { return names_module(t, std::string(r.first)); });
    if (hit == renamed.end()) {
      kept.push_back(t);
      continue;
    }
    parameters.emplace(hit->second);
    if (hit->second == "gate_up_proj") fused.insert(hit->first);
  }
  if (fused.size() == 1) {
    const std::string_view one = *fused.begin(), other = one == renamed[1].first ? renamed[2].first : renamed[1].first;
    throw Error(
        fmt::format("lora.target_modules lists {} but not {}: this {} model holds both experts' projections in "
                    "one tensor (mlp.experts.gate_up_proj); list both, as PEFT requires",
                    one, other, model.config().model_type));
  }
  cfg.fused_gate_up = cfg.fused_gate_up || fused.size() == 2;
  cfg.target_modules = kept;
  cfg.target_parameters.assign(parameters.begin(), parameters.end());
  return cfg;
}

void attach_lora(CausalLM& model, const LoraConfig& given, uint64_t seed, at::ScalarType dtype) {
  const LoraConfig cfg = for_model(model, given);
  if (cfg.r <= 0) throw Error(fmt::format("lora.r must be positive, got {}", cfg.r));
  const std::optional<InitMethod> how = parse_init(cfg.init);
  if (!how)
    throw Error(fmt::format("lora.init '{}' is not one of default, gaussian, pissa, pissa_niter_N, olora",
                            printable(cfg.init)));
  check_parameter_targets(model, cfg);
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  int matched = 0, routers = 0;
  for (Linear* l : model.linears()) {
    if (!adapts(*l, cfg)) continue;
    init_adapter(*l, cfg.r, cfg.scaling(), *how, gen);
    l->lora_a = l->lora_a.to(model.device(), dtype).set_requires_grad(true);
    l->lora_b = l->lora_b.to(model.device(), dtype).set_requires_grad(true);
    l->scaling = cfg.scaling();
    l->dropout = cfg.dropout;  // (0 for a router, and no DoRA: check_parameter_targets)
    if (cfg.use_dora) attach_dora(*l);
    ++(l->router ? routers : matched);
  }
  if (matched == 0 && !cfg.target_modules.empty()) matched_nothing(model, cfg);
  attach_experts(model, cfg, gen, dtype, routers);
  model.tables = make_tables(model, cfg, dtype);
}

void attach_tenant(CausalLM& model, const LoraConfig& cfg, uint64_t seed, int slot, int slots) {
  if (cfg.r <= 0) throw Error(fmt::format("lora.r must be positive, got {}", cfg.r));
  const std::optional<InitMethod> how = parse_init(cfg.init);
  if (!how || how->decomposes())
    throw Error(fmt::format("lora.init '{}' does not start adapters that share a base: use default or gaussian",
                            printable(cfg.init)));
  if (!for_model(model, cfg).target_parameters.empty())
    throw Error(
        "adapters on a mixture of experts' experts or router (lora.target_parameters, or the expert projections in "
        "target_modules) are not supported in a job of many adapters yet: adapt the attention, or train each such "
        "adapter in its own run");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  int matched = 0;
  for (Linear* l : model.linears()) {
    l->tenants.resize(static_cast<size_t>(slots));
    if (l->router || !matches_target(l->name, cfg)) continue;
    init_adapter(*l, cfg.r, cfg.scaling(), *how, gen);  // (default and gaussian set lora_a and lora_b only)
    TenantLora& t = l->tenants[static_cast<size_t>(slot)];
    t.a = std::exchange(l->lora_a, {}).to(model.device()).set_requires_grad(true);
    t.b = std::exchange(l->lora_b, {}).to(model.device()).set_requires_grad(true);
    t.scaling = cfg.scaling();
    l->dropout = cfg.dropout;
    if (cfg.use_dora) {  // (the base rows' norms once, for every adapter: in slot order on every rank)
      if (!l->base_sq.defined()) prepare_dora(*l, t.a);
      t.magnitude = initial_magnitude(*l, t.a, t.b, t.scaling);
    }
    ++matched;
  }
  if (matched == 0) matched_nothing(model, cfg);
  if (has_tables(cfg)) {  // its own copies, as its own run's
    model.tenant_tables.resize(static_cast<size_t>(slots));
    model.tenant_tables[static_cast<size_t>(slot)] = make_tables(model, cfg, at::kFloat);
  }
}

std::vector<std::pair<std::string, at::Tensor>> tenant_state(const CausalLM& model, int slot) {
  std::vector<std::pair<std::string, at::Tensor>> out;
  for (const Linear* l : model.linears()) {
    if (l->tenants.size() <= static_cast<size_t>(slot) || !l->tenants[static_cast<size_t>(slot)].a.defined()) continue;
    const TenantLora& t = l->tenants[static_cast<size_t>(slot)];
    out.emplace_back(kPrefix + l->name + ".lora_A.weight", t.a);
    out.emplace_back(kPrefix + l->name + ".lora_B.weight", t.b);
    if (t.magnitude.defined()) out.emplace_back(kPrefix + l->name + ".lora_magnitude_vector", t.magnitude);
  }
  if (static_cast<size_t>(slot) < model.tenant_tables.size())
    for (auto& entry : table_state(model, model.tenant_tables[static_cast<size_t>(slot)]))
      out.push_back(std::move(entry));
  return out;
}

std::vector<at::Tensor> tenant_parameters(const CausalLM& model, int slot) {
  std::vector<at::Tensor> out;
  for (const auto& [name, t] : tenant_state(model, slot)) out.push_back(t);
  return out;
}

std::vector<at::Tensor> lora_parameters(const CausalLM& model) {
  std::vector<at::Tensor> out;
  for (const Linear* l : model.linears())
    if (l->adapted()) {
      out.insert(out.end(), {l->lora_a, l->lora_b});
      if (l->dora()) out.push_back(l->magnitude);
    }
  for (const auto& [module, x] : adapted_experts(model)) out.insert(out.end(), {x->lora_a, x->lora_b});
  for (const auto& [name, t] : table_state(model, model.tables)) out.push_back(t);
  return out;
}

std::vector<std::pair<std::string, at::Tensor>> lora_state(const CausalLM& model) { return state_of(model, false); }

std::string trainable_summary(const CausalLM& model) {
  int64_t trainable = 0;
  for (const at::Tensor& t : lora_parameters(model)) trainable += t.numel();
  for (const Linear* l : model.linears())  // a job's adapters, all of them
    for (const TenantLora& t : l->tenants)
      if (t.a.defined()) trainable += t.a.numel() + t.b.numel() + (t.magnitude.defined() ? t.magnitude.numel() : 0);
  for (const TrainedTables& tables : model.tenant_tables)
    for (const auto& [name, t] : table_state(model, tables)) trainable += t.numel();
  const int64_t all = trainable + model.base_parameter_count();
  return fmt::format("trainable params: {} || all params: {} || trainable%: {:.4f}", with_commas(trainable),
                     with_commas(all), 100.0 * double(trainable) / double(all));
}

void save_adapter(const CausalLM& model, const LoraConfig& cfg, const std::string& dir) {
  // vLLM serves an adapter when r <= --max-lora-rank, whose largest allowed value is 512.
  if (cfg.r > 512)
    warn(
        fmt::format("lora.r = {} is above 512, the largest rank vLLM serves (--max-lora-rank); PEFT and "
                    "transformers still load it",
                    cfg.r));
  const std::vector<std::pair<std::string, at::Tensor>> state =
      cfg.tenant >= 0 ? tenant_state(model, cfg.tenant) : state_of(model, true);
  std::set<std::string> targets, parameters;
  for (const Linear* l : model.linears())
    if (cfg.tenant >= 0 ? l->tenants.size() > static_cast<size_t>(cfg.tenant) &&
                              l->tenants[static_cast<size_t>(cfg.tenant)].a.defined()
                        : l->adapted())
      (l->router ? parameters : targets).insert(l->router ? "gate.weight" : short_name(l->name));
  // Expert tensors under PEFT's target_parameters; gate_up_proj at twice the rank when PEFT's reading of
  // gate_proj + up_proj made it so (rank_pattern and alpha_pattern say so, as PEFT writes them).
  nlohmann::json rank_pattern = nlohmann::json::object(), alpha_pattern = nlohmann::json::object();
  for (const auto& [module, x] : adapted_experts(model)) {
    parameters.insert(short_name(x->name));
    if (const int64_t r = x->lora_a.size(0) / x->count(); r != cfg.r) {
      rank_pattern[R"(.*\.)" + short_name(x->name)] = r;
      alpha_pattern[R"(.*\.)" + short_name(x->name)] = cfg.alpha * static_cast<double>(r) / static_cast<double>(cfg.r);
    }
  }
  // PiSSA/OLoRA: twice the rank at the same scaling, as PEFT's conversion writes it.
  const bool doubled = cfg.tenant < 0 && converted_for_original_base(model);
  const double alpha = !doubled ? cfg.alpha : cfg.use_rslora ? cfg.alpha * std::sqrt(2.0) : cfg.alpha * 2;
  // The fields PEFT writes, so PEFT, transformers and vLLM read it as their own.
  const nlohmann::ordered_json config = {
      {"alpha_pattern", alpha_pattern},
      {"auto_mapping", nullptr},
      {"base_model_name_or_path",
       cfg.base_model_name_or_path.empty() ? nlohmann::json(nullptr) : nlohmann::json(cfg.base_model_name_or_path)},
      {"bias", "none"},
      {"fan_in_fan_out", model.config().family == Family::Gpt2},
      {"inference_mode", true},
      {"init_lora_weights", cfg.init == "gaussian" ? nlohmann::json("gaussian") : nlohmann::json(true)},
      {"layers_pattern", nullptr},
      {"layers_to_transform", nullptr},
      {"lora_alpha", alpha},
      {"lora_dropout", cfg.dropout},
      {"modules_to_save", cfg.modules_to_save.empty() ? nlohmann::json(nullptr) : nlohmann::json(cfg.modules_to_save)},
      {"peft_type", "LORA"},
      {"r", doubled ? 2 * cfg.r : cfg.r},
      {"rank_pattern", rank_pattern},
      {"revision", nullptr},
      {"target_modules", targets},
      {"target_parameters", parameters.empty() ? nlohmann::json(nullptr) : nlohmann::json(parameters)},
      {"task_type", "CAUSAL_LM"},
      {"trainable_token_indices",
       cfg.trainable_token_indices.empty() ? nlohmann::json(nullptr) : nlohmann::json(cfg.trainable_token_indices)},
      {"use_dora", cfg.use_dora},
      {"use_rslora", cfg.use_rslora},
  };
  fs::create_directories(dir);
  io::write_file_atomic((fs::path(dir) / "adapter_config.json").string(), config.dump(2) + "\n");
  save_tensors((fs::path(dir) / "adapter_model.safetensors").string(), state);
}

namespace {

// An adapter directory's adapter_config.json, checked, and where its weights are.
struct AdapterFiles {
  LoraConfig cfg;
  std::string config;   // adapter_config.json's path, for messages
  std::string weights;  // adapter_model.safetensors's
};

AdapterFiles read_adapter_config(const CausalLM& model, const std::string& dir) {
  const fs::path cfg_path = fs::path(dir) / "adapter_config.json";
  const fs::path weights_path = fs::path(dir) / "adapter_model.safetensors";
  if (!fs::exists(cfg_path))
    throw Error(
        fmt::format("{} not found: an adapter directory holds adapter_config.json and "
                    "adapter_model.safetensors",
                    cfg_path.string()));
  if (!fs::exists(weights_path))
    throw Error(fmt::format("{} not found{}", weights_path.string(),
                            fs::exists(fs::path(dir) / "adapter_model.bin")
                                ? ": convert adapter_model.bin to safetensors (PEFT: safe_serialization=True)"
                                : ""));
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(io::read_file(cfg_path.string()));
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{} is not valid JSON: {}", cfg_path.string(), e.what()));
  }
  const std::string where = cfg_path.string();
  auto field = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key)) throw Error(fmt::format("{}: '{}' is missing", where, key));
    return j[key];
  };
  if (field("peft_type") != "LORA")
    throw Error(fmt::format("{}: peft_type {} is not LORA", where, j["peft_type"].dump()));
  LoraConfig cfg;
  try {
    cfg.r = field("r").get<int64_t>();
    cfg.alpha = field("lora_alpha").get<double>();
    // One r and alpha for all layers, but for PEFT's fused experts: gate_up_proj at 2r and 2·alpha.
    const std::string fused = R"(.*\.gate_up_proj)";
    const auto patterned = [&](const char* key, double twice) {
      if (!j.contains(key) || !j[key].is_object() || j[key].empty()) return false;
      if (j[key].size() == 1 && j[key].contains(fused) && j[key][fused].get<double>() == twice) return true;
      throw Error(
          fmt::format("{}: {} {} is not supported (one r and alpha for all layers; a mixture of experts' "
                      "gate_up_proj may have twice them, as PEFT fuses gate_proj's and up_proj's)",
                      where, key, printable(j[key].dump())));
    };
    const bool ranks = patterned("rank_pattern", 2.0 * static_cast<double>(cfg.r));
    if (patterned("alpha_pattern", 2.0 * cfg.alpha) != ranks)
      throw Error(
          fmt::format("{}: rank_pattern and alpha_pattern disagree (PEFT's fused gate_up_proj doubles both)", where));
    cfg.fused_gate_up = ranks;
    cfg.dropout = j.value("lora_dropout", 0.0);
    cfg.use_rslora = j.value("use_rslora", false);
    cfg.use_dora = j.value("use_dora", false);
    cfg.base_model_name_or_path = j.value("base_model_name_or_path", nlohmann::json("")).is_string()
                                      ? j["base_model_name_or_path"].get<std::string>()
                                      : "";
    const auto& tm = field("target_modules");
    cfg.target_modules =
        tm.is_string() ? std::vector<std::string>{tm.get<std::string>()} : tm.get<std::vector<std::string>>();
    if (j.contains("target_parameters") && !j["target_parameters"].is_null())
      cfg.target_parameters = j["target_parameters"].get<std::vector<std::string>>();
    cfg = for_model(model, cfg);
    read_tables(j, model, cfg, where);
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: a field has the wrong type ({})", where, e.what()));
  }
  if (cfg.r <= 0) throw Error(fmt::format("{}: r must be positive", where));
  // PEFT saves PiSSA/OLoRA adapters unconverted unless asked: they hold the adapter of a residual base.
  if (const auto init = j.find("init_lora_weights"); init != j.end() && init->is_string() && *init != "gaussian")
    warn(
        fmt::format("{}: init_lora_weights is '{}': such an adapter is right only on its residual base (PEFT saves "
                    "one for the original base with save_pretrained(path_initial_model_for_weight_conversion=…))",
                    where, printable(init->get<std::string>())));
  return {cfg, where, weights_path.string()};
}

// `file`'s tensor `key` as `want` shaped, in `dtype` on `device`, owned and trainable; lorarun::Error
// for another shape or a value that is not finite.
at::Tensor adapter_tensor(const WeightFiles& files, const std::string& file, const std::string& key,
                          const std::vector<int64_t>& want, int64_t r, at::ScalarType dtype, at::Device device) {
  at::Tensor t;
  try {
    t = files.load(key, dtype, device, want).clone();
  } catch (const Error&) {
    throw Error(
        fmt::format("{}: '{}' has shape [{}] but this base model and r={} need [{}]: the adapter "
                    "was made for another base model",
                    file, key, fmt::join(files.info(key).shape, ", "), r, fmt::join(want, ", ")));
  }
  if (!at::isfinite(t).all().item<bool>())  // merged, evaluated or trained on, it would only spread
    throw Error(
        fmt::format("{}: '{}' holds non-finite values (NaN or infinity, in {}): the adapter is damaged or its training "
                    "diverged; use an earlier checkpoint",
                    file, key, c10::toString(dtype)));
  return t.set_requires_grad(true);
}

}  // namespace

LoraConfig load_adapter(CausalLM& model, const std::string& dir, at::ScalarType dtype) {
  const AdapterFiles a = read_adapter_config(model, dir);
  const LoraConfig& cfg = a.cfg;
  const std::string& where = a.config;
  const fs::path weights_path = a.weights;
  const WeightFiles files = WeightFiles::open_file(weights_path.string());
  std::map<std::string, Linear*> by_name;
  for (Linear* l : model.linears()) by_name[l->name] = l;
  std::map<std::string, Experts*> experts;  // by the module PEFT's keys name (target_parameters)
  for (MoeMlp* m : model.moe_layers())
    for (const auto& [module, x] :
         expert_modules(*m, matches_parameter(m->gate_up.name, cfg), matches_parameter(m->down.name, cfg)))
      experts[module] = x;
  std::map<Experts*, int> seen_experts;
  const std::regex key_re(R"(base_model\.model\.(.+)\.lora_(A\.weight|B\.weight|magnitude_vector))");
  std::map<Linear*, int> seen;
  // A tensor of the file, checked: its shape, its values; owned and trainable.
  const auto load = [&](const std::string& key, const std::vector<int64_t>& want) {
    return adapter_tensor(files, weights_path.string(), key, want, cfg.r, dtype, model.device());
  };
  model.tables = make_tables(model, cfg, dtype);  // modules_to_save / trainable tokens: filled from the file below
  std::map<std::string, at::Tensor*> tables;
  for (const auto& [name, slot] : table_slots(model, model.tables)) tables[name] = slot;
  for (const std::string& key : files.names()) {
    if (const auto table = tables.find(key); table != tables.end()) {
      *table->second = load(key, table->second->sizes().vec());
      tables.erase(table);
      continue;
    }
    std::smatch m;
    if (!std::regex_match(key, m, key_re))
      throw Error(
          fmt::format("{}: key '{}' is not a LoRA weight of the form "
                      "base_model.model.<module>.lora_A.weight (or lora_B.weight, or DoRA's "
                      "lora_magnitude_vector)",
                      weights_path.string(), key));
    if (const auto x = experts.find(m[1].str()); x != experts.end() && m[2] != "magnitude_vector") {
      Experts& e = *x->second;
      const bool a = m[2] == "A.weight";
      const LoraConfig own = config_of(e, cfg);
      const int64_t rank = own.r * e.count();
      (a ? e.lora_a : e.lora_b) =
          load(key, a ? std::vector<int64_t>{rank, e.in_features()} : std::vector<int64_t>{e.out_features(), rank});
      e.scaling = own.scaling();
      seen_experts[&e] |= a ? 1 : 2;
      continue;
    }
    const auto it = by_name.find(m[1].str());
    if (it == by_name.end())
      throw Error(
          fmt::format("{}: '{}' names no linear layer of this {} model: the adapter was made for "
                      "another base model",
                      weights_path.string(), m[1].str(), model.config().model_type));
    Linear* l = it->second;
    const int part = m[2] == "A.weight" ? 1 : m[2] == "B.weight" ? 2 : 4;
    if (part == 4 && !cfg.use_dora)
      throw Error(fmt::format("{}: '{}' is DoRA's but {} says use_dora: false", weights_path.string(), key, where));
    const std::vector<int64_t> want = part == 1   ? std::vector<int64_t>{cfg.r, l->in_features()}
                                      : part == 2 ? std::vector<int64_t>{l->out_features(), cfg.r}
                                                  : std::vector<int64_t>{l->out_features()};
    const at::Tensor t = load(key, want);
    (part == 1 ? l->lora_a : part == 2 ? l->lora_b : l->magnitude) = t;
    l->scaling = cfg.scaling();
    l->dropout = cfg.dropout;
    seen[l] |= part;
  }
  const int whole = cfg.use_dora ? 7 : 3;
  for (const auto& [l, bits] : seen) {
    if (bits != whole)
      throw Error(fmt::format("{}: '{}' lacks {}", weights_path.string(), l->name,
                              (bits & 1) == 0   ? "lora_A"
                              : (bits & 2) == 0 ? "lora_B"
                                                : "lora_magnitude_vector (DoRA)"));
    if (cfg.use_dora) prepare_dora(*l);
  }
  for (const auto& [x, bits] : seen_experts)
    if (bits != 3)
      throw Error(fmt::format("{}: the adapter of '{}' lacks {}", weights_path.string(), x->name,
                              (bits & 1) == 0 ? "lora_A" : "lora_B"));
  if (seen.empty() && seen_experts.empty()) throw Error(fmt::format("{} holds no LoRA weights", weights_path.string()));
  if (!tables.empty())
    throw Error(fmt::format("{}: '{}' is missing, though {} lists modules_to_save or trainable_token_indices",
                            weights_path.string(), tables.begin()->first, where));
  return cfg;
}

void start_tenant_from(CausalLM& model, int slot, const LoraConfig& cfg, const std::string& dir) {
  const AdapterFiles a = read_adapter_config(model, dir);
  const auto differ = [&](const std::string& what) {
    throw ConfigError(fmt::format("lora.init_from {} {}: make them equal", a.config, what));
  };
  if (a.cfg.r != cfg.r) differ(fmt::format("has r={} but the adapter trains with r={}", a.cfg.r, cfg.r));
  if (a.cfg.alpha != cfg.alpha)
    differ(fmt::format("has lora_alpha={} but the adapter trains with alpha={}", a.cfg.alpha, cfg.alpha));
  if (a.cfg.use_rslora != cfg.use_rslora) differ(fmt::format("has use_rslora={}", a.cfg.use_rslora));
  if (a.cfg.use_dora != cfg.use_dora)
    differ(fmt::format("has use_dora={} but the adapter trains with use_dora={}", a.cfg.use_dora, cfg.use_dora));
  if (std::set<std::string>(a.cfg.modules_to_save.begin(), a.cfg.modules_to_save.end()) !=
      std::set<std::string>(cfg.modules_to_save.begin(), cfg.modules_to_save.end()))
    differ(fmt::format("has modules_to_save [{}] but the adapter trains [{}]",
                       printable(fmt::format("{}", fmt::join(a.cfg.modules_to_save, ", "))),
                       fmt::join(cfg.modules_to_save, ", ")));
  if (a.cfg.trainable_token_indices != cfg.trainable_token_indices)
    differ(fmt::format("has trainable_token_indices [{}] but the adapter trains [{}]",
                       printable(fmt::format("{}", fmt::join(a.cfg.trainable_token_indices, ", "))),
                       fmt::join(cfg.trainable_token_indices, ", ")));  // (the file's list cut to a line)
  const WeightFiles files = WeightFiles::open_file(a.weights);
  const std::vector<std::pair<std::string, at::Tensor>> mine = tenant_state(model, slot);
  std::vector<std::string> names = files.names();
  if (names.size() != mine.size())
    differ(fmt::format("holds {} tensors but the adapter trains {} (its target_modules)", names.size(), mine.size()));
  c10::NoGradGuard no_grad;
  for (const auto& [key, t] : mine) {
    if (std::find(names.begin(), names.end(), key) == names.end())
      differ(fmt::format("lacks '{}', which the adapter trains (its target_modules)", key));
    t.copy_(adapter_tensor(files, a.weights, key, t.sizes().vec(), cfg.r, t.scalar_type(), t.device()));
  }
}

void merge_lora(CausalLM& model) {
  c10::NoGradGuard no_grad;
  for (Linear* l : model.linears()) {
    if (!l->adapted()) continue;
    if (l->nf4)
      throw Error(
          fmt::format("{} holds NF4 weights: merge into a base loaded without quantisation (lora-merge "
                      "--qlora rounds it through NF4 first)",
                      l->name));
    if (l->blocks) {  // merged into the weights training saw
      l->weight = l->blocks->dequantize();
      l->blocks.reset();
    }
    if (l->dora()) {
      l->weight.copy_(dora_merged_weight(*l));
    } else {
      const at::Tensor delta = at::matmul(l->lora_b.to(at::kFloat), l->lora_a.to(at::kFloat)) * l->scaling;
      l->weight.add_(delta.to(l->weight.scalar_type()));
    }
    l->lora_a = at::Tensor();
    l->lora_b = at::Tensor();
    l->magnitude = at::Tensor();
    l->base_sq = at::Tensor();
  }
  for (const auto& [module, x] : adapted_experts(model)) {  // W_e += s · B_e A_e, in float32
    const int64_t E = x->count(), r = x->lora_a.size(0) / E;
    const at::Tensor a = x->lora_a.to(at::kFloat).view({E, r, x->in_features()});
    const at::Tensor b = x->lora_b.to(at::kFloat).view({x->out_features(), r, E}).permute({2, 0, 1});
    x->weight.add_((at::bmm(b, a) * x->scaling).to(x->weight.scalar_type()));
    x->lora_a = at::Tensor();
    x->lora_b = at::Tensor();
  }
  model.fold_tables();
}

LoraConfig lora_config_of(const recipe::LoraSection& lora, const std::string& base_model) {
  LoraConfig cfg;
  cfg.r = lora.r;
  cfg.alpha = lora.alpha;
  cfg.dropout = lora.dropout;
  cfg.use_rslora = lora.use_rslora;
  cfg.use_dora = lora.use_dora;
  cfg.init = lora.init;
  cfg.modules_to_save = lora.modules_to_save;
  cfg.trainable_token_indices = lora.trainable_token_indices;
  cfg.target_modules = lora.target_modules;
  cfg.target_parameters = lora.target_parameters;
  cfg.base_model_name_or_path = base_model;
  return cfg;
}

std::string describe_adapter(const recipe::LoraSection& lora) {
  const LoraConfig cfg = lora_config_of(lora, "");
  std::string out = fmt::format("LoRA r {}, alpha {} (scale {:.4g}{}) on {}", cfg.r, cfg.alpha, cfg.scaling(),
                                cfg.use_rslora ? ", rsLoRA" : "", fmt::join(cfg.target_modules, ", "));
  if (!cfg.target_parameters.empty())
    out += fmt::format(" and per expert on {}", printable(fmt::format("{}", fmt::join(cfg.target_parameters, ", "))));
  if (lora.quantize_base) out += "; QLoRA: base linears in NF4";
  if (cfg.use_dora) out += "; DoRA: a learnt magnitude per output row";
  if (lora.plus_lr_ratio) out += fmt::format("; LoRA+: B learns at lr x {}", *lora.plus_lr_ratio);
  if (cfg.init == "gaussian") out += "; init gaussian: A ~ N(0, 1/r)";
  if (cfg.init.starts_with("pissa") || cfg.init == "olora")
    out += fmt::format(
        "; init {}: A and B from the base weights, trained on the residual, saved as rank {} for the "
        "original base",
        cfg.init, 2 * cfg.r);
  if (!cfg.modules_to_save.empty())
    out += fmt::format("; trained whole: {}", printable(fmt::format("{}", fmt::join(cfg.modules_to_save, ", "))));
  if (!cfg.trainable_token_indices.empty())
    out += fmt::format("; trainable tokens: {} embedding rows", cfg.trainable_token_indices.size());
  if (!lora.init_from.empty()) out += fmt::format("; started from {}", printable(lora.init_from));
  return out;
}

std::string gguf_blocks_summary(const CausalLM& model) {
  std::map<std::string, int> types;
  int64_t params = 0, bytes = 0;
  for (const Linear* l : model.linears()) {  // (as nf4_summary: the whole weights, sliced or not)
    const std::optional<GgufBlocks>& b = l->sharded ? l->sharded->gguf : l->blocks;
    if (!b) continue;
    ++types[io::ggml_type_name(b->type)];
    params += b->shape[0] * b->shape[1];
    bytes += l->sharded ? l->sharded->whole_bytes() : b->bytes();
  }
  std::string listed;
  for (const auto& [name, n] : types) listed += fmt::format("{}{} {}", listed.empty() ? "" : ", ", name, n);
  return fmt::format("base linears kept as the GGUF's blocks ({}): {} parameters in {:.1f} MiB ({:.4f} bytes each)",
                     listed, params, static_cast<double>(bytes) / (1 << 20),
                     static_cast<double>(bytes) / static_cast<double>(std::max<int64_t>(1, params)));
}

std::string nf4_summary(const CausalLM& model) {
  int64_t params = 0, bytes = 0;
  for (const Linear* l : model.linears()) {
    const std::optional<Nf4Weight>& q = l->sharded ? l->sharded->nf4 : l->nf4;
    if (!q) continue;
    params += q->numel();
    bytes += l->sharded ? l->sharded->whole_bytes() : q->bytes();
  }
  return fmt::format("base linears in NF4: {} parameters in {:.1f} MiB ({:.4f} bytes each)", params,
                     static_cast<double>(bytes) / (1 << 20), static_cast<double>(bytes) / static_cast<double>(params));
}

}  // namespace lorarun::model
