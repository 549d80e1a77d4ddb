#include "train/state.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <fmt/format.h>
#include <torch/optim/adamw.h>
#include <unistd.h>
#include <algorithm>
#include <filesystem>

#include "io/files.hpp"
#include "io/safetensors.hpp"
#include "io/sha256.hpp"
#include "model/lora.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/untrusted.hpp"

namespace lorarun::train {
namespace {

namespace fs = std::filesystem;

// Recipe keys that may change between a run and its resumption: where and how it runs, not
// what it computes.
bool may_change(const std::string& key) {
  for (const char* p : {"checkpoint.", "track.", "dist.", "data.uri", "data.prefetch", "data.retr"})
    if (key.rfind(p, 0) == 0) return true;
  // What is evaluated may change; eval.fraction decides which documents are trained on.
  return key.rfind("eval.", 0) == 0 && key != "eval.fraction";
}

void flatten(const nlohmann::json& j, const std::string& prefix, std::map<std::string, nlohmann::json>& out) {
  if (!j.is_object() || prefix == "data.filter" || prefix == "eval.filter") {
    out[prefix] = j;
    return;
  }
  for (const auto& [k, v] : j.items()) flatten(v, prefix.empty() ? k : prefix + "." + k, out);
}

void check_same_recipe(const nlohmann::json& saved, const nlohmann::json& now, const std::string& where) {
  std::map<std::string, nlohmann::json> a, b;
  flatten(saved, "", a), flatten(now, "", b);
  for (const auto& [key, value] : b) {
    if (may_change(key)) continue;
    const auto it = a.find(key);
    if (it == a.end() && key == "eval.fraction" && value == 0.0) continue;  // a state from before eval:
    const std::string was = it == a.end() ? "(absent)" : it->second.dump();
    if (was != value.dump())
      throw ConfigError(
          fmt::format("the resumable state in {} was written with {} = {}, this run has {}: resume with the "
                      "same recipe, or set checkpoint.resume=never to start over (the state is then replaced)",
                      where, key, was, value.dump()));
  }
}

at::Tensor load_tensor(const io::SafetensorsFile& f, const std::string& name, at::ScalarType dtype) {
  const io::TensorInfo* t = f.find(name);
  if (!t)
    throw Error(
        fmt::format("{}: '{}' is missing: the resumable state is damaged; move it away to start over", f.path(), name));
  const auto bytes = f.bytes(*t);
  return at::from_blob(const_cast<std::byte*>(bytes.data()), t->shape, at::TensorOptions().dtype(dtype)).clone();
}

// Every state file's sha256 in manifest.json, written last: a state without it, or whose files
// do not match it, was cut short or changed by hand.
void write_manifest(const fs::path& dir) {
  nlohmann::json files = nlohmann::json::object();
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_regular_file()) files[e.path().filename().string()] = io::sha256_file(e.path().string());
  io::write_file_atomic((dir / "manifest.json").string(), nlohmann::json{{"sha256", files}}.dump(1));
}

[[noreturn]] void refuse(const fs::path& dir, const std::string& problem) {
  throw ConfigError(
      fmt::format("the resumable state in {} {}: restore it, or set checkpoint.resume=never to start over (the "
                  "state is then replaced)",
                  dir.string(), problem));
}

void verify_manifest(const fs::path& dir) {
  const fs::path path = dir / "manifest.json";
  if (!fs::exists(path)) refuse(dir, "is incomplete (manifest.json is missing)");
  const nlohmann::json m = nlohmann::json::parse(io::read_file(path.string()), nullptr, false);
  if (!m.is_object() || !m.contains("sha256") || !m["sha256"].is_object()) refuse(dir, "has a damaged manifest.json");
  for (const char* needed : {"state.json", "state.safetensors"})
    if (!m["sha256"].contains(needed)) refuse(dir, fmt::format("has a manifest without {}", needed));
  for (const auto& [name, sum] : m["sha256"].items()) {
    if (!fs::exists(dir / name)) refuse(dir, fmt::format("is incomplete ({} is missing)", name));
    if (!sum.is_string() || io::sha256_file((dir / name).string()) != sum.get<std::string>())
      refuse(dir, fmt::format("was changed after it was written ({} does not match its checksum)", name));
  }
}

// The counters must describe a step of this run: inside its epochs, and step = epoch × steps per
// epoch + step in epoch (which fails when the data selection changed size).
void check_counters(const fs::path& dir, const Progress& p, const RunShape& shape) {
  if (p.epoch < 0 || p.epoch >= shape.epochs)
    refuse(dir, fmt::format("is at epoch {}, outside this run's epochs 0..{}", p.epoch, shape.epochs - 1));
  const int64_t last = shape.steps_per_epoch - (p.pending_eval ? 0 : 1);  // (the epoch's end may be pending)
  if (p.step_in_epoch < 0 || p.step_in_epoch > last)
    refuse(dir, fmt::format("is at step {} of epoch {}, outside 0..{} (steps per epoch of this run)", p.step_in_epoch,
                            p.epoch, last));
  if (p.step != int64_t{p.epoch} * shape.steps_per_epoch + p.step_in_epoch)
    refuse(dir, fmt::format("counts {} steps in all, but epoch {} step {} with {} steps per epoch make {} (did the "
                            "data selection change?)",
                            p.step, p.epoch, p.step_in_epoch, shape.steps_per_epoch,
                            int64_t{p.epoch} * shape.steps_per_epoch + p.step_in_epoch));
}

}  // namespace

// How `now` differs from `saved` (two data::Documents::identity()), in words; "" when it does not
// or cannot be told (a state from before identities were saved). `saved` is read from a file: a count
// of another type is not one, a digest is escaped before it is printed.
std::string data_change(const nlohmann::json& saved, const nlohmann::json& now) {
  if (!saved.is_object() || !now.is_object()) return "";
  const auto documents = [](const nlohmann::json& id) {
    const auto it = id.find("documents");
    return it != id.end() && it->is_number_integer() ? it->get<int64_t>() : int64_t{-1};
  };
  const int64_t was = documents(saved), is = documents(now);
  if (was != is) return fmt::format("the selection held {} documents, and now {}", was, is);
  const nlohmann::json a = saved.value("digest", nlohmann::json()), b = now.value("digest", nlohmann::json());
  if (a.is_string() && b.is_string() && a != b)
    return fmt::format("the selection held {} documents then as now, but other ones (digest {} then, {} now)", is,
                       printable(a.get<std::string>()), printable(b.get<std::string>()));
  // (compared as JSON: an "order" of another type in a hand-edited state is "not keyed", not a throw)
  const auto keyed = [](const nlohmann::json& id) { return id.contains("order") && id["order"] == "keyed"; };
  if (keyed(now) && !keyed(saved))
    return "data.shuffle: global's order is a keyed permutation now, and the lorarun that wrote the state drew "
           "another: the rest of this epoch reads other documents than the interrupted run would have";
  return "";
}

namespace {

at::Tensor finite_tensor(const io::SafetensorsFile& f, const fs::path& dir, const std::string& name) {
  at::Tensor t = load_tensor(f, name, at::kFloat);
  if (!at::isfinite(t).all().item<bool>()) refuse(dir, fmt::format("holds non-finite values in {}", name));
  return t;
}

}  // namespace

namespace {

// The adapter (and `about` as best.json, when given) in <output_dir>/<name>: written to
// <name>.tmp.<pid>, synced, then renamed over the old one.
std::string save_adapter_dir(const std::string& output_dir, const std::string& name, const model::CausalLM& m,
                             const model::LoraConfig& cfg, const nlohmann::json* about) {
  const fs::path dir = fs::path(output_dir) / name;
  const fs::path tmp = dir.string() + fmt::format(".tmp.{}", getpid());
  io::remove_tree(tmp.string());
  model::save_adapter(m, cfg, tmp.string());
  if (about) io::write_file_atomic((tmp / "best.json").string(), about->dump(1));
  io::sync_dir(tmp.string());
  io::remove_tree(dir.string());
  fs::rename(tmp, dir);
  io::sync_dir(output_dir);
  return dir.string();
}

}  // namespace

std::string save_epoch(const std::string& output_dir, int epoch, const model::CausalLM& m,
                       const model::LoraConfig& cfg) {
  return save_adapter_dir(output_dir, fmt::format("epoch_{}", epoch), m, cfg, nullptr);
}

std::string save_best(const std::string& output_dir, const model::CausalLM& m, const model::LoraConfig& cfg,
                      const nlohmann::json& about) {
  return save_adapter_dir(output_dir, "best", m, cfg, &about);
}

void remove_unkept_epochs(const std::string& output_dir, const std::vector<int>& kept) {
  for (const auto& e : fs::directory_iterator(output_dir)) {
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

std::string state_dir(const std::string& output_dir) { return (fs::path(output_dir) / "resume_state").string(); }

at::Tensor rng_state(bool cuda) {
  at::Tensor cpu = at::detail::getDefaultCPUGenerator().get_state();
  if (!cuda) return cpu;
  return at::cat({cpu, at::globalContext().defaultGenerator(at::kCUDA).get_state()});
}

void set_rng_state(const at::Tensor& bytes, bool cuda) {
  at::Generator cpu = at::detail::getDefaultCPUGenerator();  // a handle: setting it sets the default
  const int64_t n = cpu.get_state().numel();
  cpu.set_state(bytes.narrow(0, 0, n).clone());  // own storage: set_state ignores view offsets
  if (!cuda) return;
  at::Generator gpu = at::globalContext().defaultGenerator(at::kCUDA);
  gpu.set_state(bytes.narrow(0, n, bytes.numel() - n).clone());
}

void save_state(const std::string& output_dir, const model::CausalLM& m, const model::LoraConfig& cfg,
                torch::optim::AdamW& opt, const std::vector<at::Tensor>& params, const Progress& p,
                const at::Tensor& rngs, const nlohmann::json& recipe, const nlohmann::json& data,
                const StateFiles& also) {
  const fs::path dir = state_dir(output_dir);
  const fs::path tmp = dir.string() + fmt::format(".tmp.{}", getpid()), old = dir.string() + ".old";
  io::remove_tree(tmp.string());
  model::save_adapter(m, cfg, tmp.string());  // also a loadable PEFT adapter of this very step

  // Tensors by parameter index (the order of lora_parameters()); AdamW's moments beside them.
  std::vector<std::pair<std::string, at::Tensor>> named;
  std::vector<int64_t> steps;
  for (size_t i = 0; i < params.size(); ++i) {
    named.emplace_back(fmt::format("{}.param", i), params[i]);
    const auto it = opt.state().find(params[i].unsafeGetTensorImpl());
    if (it == opt.state().end()) {
      steps.push_back(0);
      continue;
    }
    const auto& s = static_cast<const torch::optim::AdamWParamState&>(*it->second);
    steps.push_back(s.step());
    named.emplace_back(fmt::format("{}.exp_avg", i), s.exp_avg());
    named.emplace_back(fmt::format("{}.exp_avg_sq", i), s.exp_avg_sq());
  }
  named.emplace_back("rng", rngs);
  std::vector<at::Tensor> host;  // keeps the bytes alive while writing
  std::vector<io::TensorBytes> out;
  for (auto& [name, t] : named) {
    host.push_back(t.detach().to(at::kCPU, t.scalar_type() == at::kByte ? at::kByte : at::kFloat).contiguous());
    const at::Tensor& h = host.back();
    out.push_back({name, h.scalar_type() == at::kByte ? io::DType::U8 : io::DType::F32, h.sizes().vec(), h.data_ptr(),
                   h.nbytes()});
  }
  io::write_safetensors((tmp / "state.safetensors").string(), out);
  const Steering& st = p.steering;
  const nlohmann::json steering = {{"best_loss", st.best_loss ? nlohmann::json(*st.best_loss) : nlohmann::json()},
                                   {"best_step", st.best_step},
                                   {"evals_since_best", st.evals_since_best}};
  const nlohmann::json meta = {{"epoch", p.epoch},     {"step_in_epoch", p.step_in_epoch}, {"step", p.step},
                               {"run_id", p.run_id},   {"world_size", rngs.size(0)},       {"adam_steps", steps},
                               {"steering", steering}, {"pending_eval", p.pending_eval},   {"data", data},
                               {"recipe", recipe}};
  io::write_file_atomic((tmp / "state.json").string(), meta.dump(1));
  if (also) also(tmp.string());
  write_manifest(tmp);
  io::sync_dir(tmp.string());
  io::remove_tree(old.string());
  if (fs::exists(dir)) fs::rename(dir, old);
  fs::rename(tmp, dir);
  io::remove_tree(old.string());
  io::sync_dir(output_dir);
}

std::optional<Progress> load_state(const std::string& output_dir, torch::optim::AdamW& opt,
                                   const std::vector<at::Tensor>& params, int rank, int world, const RngStream& rng,
                                   const nlohmann::json& recipe, const RunShape& shape, const StateFiles& also) {
  fs::path dir = state_dir(output_dir);
  if (!fs::exists(dir)) dir = dir.string() + ".old";  // a swap cut short by a crash
  if (!fs::exists(dir)) return std::nullopt;
  verify_manifest(dir);
  nlohmann::json meta = nlohmann::json::parse(io::read_file((dir / "state.json").string()), nullptr, false);
  if (meta.is_discarded() || !meta.is_object() || !meta.contains("recipe")) refuse(dir, "has a damaged state.json");
  Progress p;
  std::vector<int64_t> steps;
  try {
    p = Progress{meta.at("epoch").get<int>(), meta.at("step_in_epoch").get<int64_t>(), meta.at("step").get<int64_t>(),
                 meta.at("run_id").get<std::string>(), Steering{}};
    steps = meta.at("adam_steps").get<std::vector<int64_t>>();
    p.pending_eval = meta.value("pending_eval", false);
    if (const auto it = meta.find("steering"); it != meta.end()) {  // absent in states from before eval:
      if (!it->at("best_loss").is_null()) p.steering.best_loss = it->at("best_loss").get<double>();
      p.steering.best_step = it->at("best_step").get<int64_t>();
      p.steering.evals_since_best = it->at("evals_since_best").get<int>();
    }
    if (meta.at("world_size").get<int>() != world)
      throw ConfigError(
          fmt::format("the resumable state in {} was written by {} ranks and this run has {}: run with {} "
                      "ranks, or set checkpoint.resume=never to start over",
                      dir.string(), meta["world_size"].get<int>(), world, meta["world_size"].get<int>()));
  } catch (const nlohmann::json::exception& e) {
    refuse(dir, fmt::format("has a damaged state.json ({})", e.what()));
  }
  check_same_recipe(meta["recipe"], recipe, dir.string());
  const std::string changed = data_change(meta.value("data", nlohmann::json()), shape.data);
  try {
    check_counters(dir, p, shape);
  } catch (const Error& e) {
    if (changed.empty()) throw;
    refuse(dir, fmt::format("was written when {}, so its position does not fit", changed));
  }
  if (!changed.empty() && rank == 0)
    warn(
        fmt::format("the data changed since the resumable state in {} was written: {}; resuming at its step of the "
                    "new selection (set checkpoint.resume=never to start over)",
                    dir.string(), changed));
  const io::SafetensorsFile f((dir / "state.safetensors").string());
  if (steps.size() != params.size())
    throw ConfigError(
        fmt::format("{} holds {} LoRA tensors, this model has {}: set checkpoint.resume=never to start over",
                    dir.string(), steps.size(), params.size()));
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    if (steps[i] < 0 || steps[i] > p.step) refuse(dir, fmt::format("counts {} AdamW steps for tensor {}", steps[i], i));
    at::Tensor& t = const_cast<at::Tensor&>(params[i]);
    t.copy_(finite_tensor(f, dir, fmt::format("{}.param", i)).view_as(t));
    if (steps[i] == 0) continue;
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(steps[i]);
    s->exp_avg(finite_tensor(f, dir, fmt::format("{}.exp_avg", i)).to(t.options()).view_as(t));
    s->exp_avg_sq(finite_tensor(f, dir, fmt::format("{}.exp_avg_sq", i)).to(t.options()).view_as(t));
    opt.state()[t.unsafeGetTensorImpl()] = std::move(s);
  }
  const at::Tensor rngs = load_tensor(f, "rng", at::kByte);
  if (rngs.dim() != 2 || rngs.size(0) != world) refuse(dir, "holds random-generator states of another world size");
  rng.set(rngs[rank]);
  if (also) also(dir.string());
  return p;
}

void remove_state(const std::string& output_dir) {
  io::remove_tree(state_dir(output_dir));
  io::remove_tree(state_dir(output_dir) + ".old");
}

}  // namespace lorarun::train
