#include "train/state.hpp"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <filesystem>
#include <fmt/format.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include "io/files.hpp"
#include "io/safetensors.hpp"
#include "model/lora.hpp"
#include "util/error.hpp"

namespace lorarun::train {
namespace {

namespace fs = std::filesystem;

// Recipe keys that may change between a run and its resumption: where and how it runs, not
// what it computes.
bool may_change(const std::string& key) {
  for (const char* p : {"checkpoint.", "track.", "dist.", "data.uri", "data.prefetch", "data.retr"})
    if (key.rfind(p, 0) == 0) return true;
  return false;
}

void flatten(const nlohmann::json& j, const std::string& prefix, std::map<std::string, nlohmann::json>& out) {
  if (!j.is_object() || (prefix == "data.filter")) {
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
    const std::string was = it == a.end() ? "(absent)" : it->second.dump();
    if (was != value.dump())
      throw Error(fmt::format("the resumable state in {} was written with {} = {}, this run has {}: resume with the "
                              "same recipe, or set checkpoint.resume=never to start over (the state is then replaced)",
                              where, key, was, value.dump()));
  }
}

at::Tensor load_tensor(const io::SafetensorsFile& f, const std::string& name, at::ScalarType dtype) {
  const io::TensorInfo* t = f.find(name);
  if (!t) throw Error(fmt::format("{}: '{}' is missing: the resumable state is damaged; move it away to start over",
                                  f.path(), name));
  const auto bytes = f.bytes(*t);
  return at::from_blob(const_cast<std::byte*>(bytes.data()), t->shape, at::TensorOptions().dtype(dtype)).clone();
}

}  // namespace

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
                const at::Tensor& rngs, const nlohmann::json& recipe) {
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
    out.push_back({name, h.scalar_type() == at::kByte ? io::DType::U8 : io::DType::F32, h.sizes().vec(),
                   h.data_ptr(), h.nbytes()});
  }
  io::write_safetensors((tmp / "state.safetensors").string(), out);
  const nlohmann::json meta = {{"epoch", p.epoch}, {"step_in_epoch", p.step_in_epoch}, {"step", p.step},
                               {"run_id", p.run_id}, {"world_size", rngs.size(0)}, {"adam_steps", steps},
                               {"recipe", recipe}};
  io::write_file_atomic((tmp / "state.json").string(), meta.dump(1));
  io::sync_dir(tmp.string());
  io::remove_tree(old.string());
  if (fs::exists(dir)) fs::rename(dir, old);
  fs::rename(tmp, dir);
  io::remove_tree(old.string());
  io::sync_dir(output_dir);
}

std::optional<Progress> load_state(const std::string& output_dir, torch::optim::AdamW& opt,
                                   const std::vector<at::Tensor>& params, int rank, int world, bool cuda,
                                   const nlohmann::json& recipe) {
  fs::path dir = state_dir(output_dir);
  if (!fs::exists(dir / "state.json")) dir = dir.string() + ".old";  // a swap cut short by a crash
  if (!fs::exists(dir / "state.json")) return std::nullopt;
  nlohmann::json meta = nlohmann::json::parse(io::read_file((dir / "state.json").string()), nullptr, false);
  if (meta.is_discarded() || !meta.contains("recipe"))
    throw Error(fmt::format("{}/state.json is damaged: move {} away to start over", dir.string(), dir.string()));
  if (meta["world_size"].get<int>() != world)
    throw Error(fmt::format("the resumable state in {} was written by {} ranks and this run has {}: run with {} ranks, "
                            "or set checkpoint.resume=never to start over", dir.string(),
                            meta["world_size"].get<int>(), world, meta["world_size"].get<int>()));
  check_same_recipe(meta["recipe"], recipe, dir.string());
  const io::SafetensorsFile f((dir / "state.safetensors").string());
  const auto steps = meta["adam_steps"].get<std::vector<int64_t>>();
  if (steps.size() != params.size())
    throw Error(fmt::format("{} holds {} LoRA tensors, this model has {}: set checkpoint.resume=never to start over",
                            dir.string(), steps.size(), params.size()));
  c10::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    at::Tensor& p = const_cast<at::Tensor&>(params[i]);
    p.copy_(load_tensor(f, fmt::format("{}.param", i), at::kFloat).view_as(p));
    if (steps[i] == 0) continue;
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(steps[i]);
    s->exp_avg(load_tensor(f, fmt::format("{}.exp_avg", i), at::kFloat).to(p.options()).view_as(p));
    s->exp_avg_sq(load_tensor(f, fmt::format("{}.exp_avg_sq", i), at::kFloat).to(p.options()).view_as(p));
    opt.state()[p.unsafeGetTensorImpl()] = std::move(s);
  }
  set_rng_state(load_tensor(f, "rng", at::kByte)[rank], cuda);
  return Progress{meta["epoch"].get<int>(), meta["step_in_epoch"].get<int64_t>(), meta["step"].get<int64_t>(),
                  meta["run_id"].get<std::string>()};
}

void remove_state(const std::string& output_dir) {
  io::remove_tree(state_dir(output_dir));
  io::remove_tree(state_dir(output_dir) + ".old");
}

}  // namespace lorarun::train
