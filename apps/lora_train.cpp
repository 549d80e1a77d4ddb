// lora-train: one rank of a LoRA fine-tuning job. Run it under lorarun, or alone as world size 1.
#include <ATen/ATen.h>
#include <c10/util/Logging.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/cuda.h>
#include <torch/version.h>
#include <CLI/CLI.hpp>
#include <cstdlib>

#include "app_main.hpp"
#include "data/mongo.hpp"
#include "data/source.hpp"
#include "dist/env.hpp"
#include "dist/process_group.hpp"
#include "model/lora.hpp"
#include "recipe/recipe.hpp"
#include "track/from_run.hpp"
#include "train/checkpointer.hpp"
#include "train/job.hpp"
#include "train/memory_estimate.hpp"
#include "train/runtime.hpp"
#include "train/trainer.hpp"
#include "util/error.hpp"
#include "util/log.hpp"
#include "util/secrets.hpp"

namespace {

using namespace lorarun;

struct Args {
  bool check_env = false;
  bool dist_check = false;
  bool dry_run = false;
  std::string uri;
  int timeout_ms = 5000;
  std::string backend = "auto";
  int dist_timeout_s = 600;
  std::string recipe;
  std::vector<std::string> overrides;
  std::string from_run;  // DATABASE/ID of a recorded run
  std::string runs_db;
};

int check_env(const Args& a) {
  const bool cuda = torch::cuda::is_available();
  const dist::NcclBuild nccl = dist::nccl_build();
  fmt::print("lorarun    {}\n", LORARUN_VERSION);
  fmt::print("torch      {} ({})\n", TORCH_VERSION, LORARUN_TORCH_CUDA ? "CUDA build" : "CPU-only build");
  fmt::print("cuda       {}\n", cuda ? fmt::format("available, {} GPU(s)", torch::cuda::device_count())
                                     : std::string("not available, 0 GPUs"));
  fmt::print("nccl       {}\n",
             nccl.compiled ? fmt::format("compiled in (NCCL {}, CUDA runtime {})", nccl.nccl_version, nccl.cuda_version)
                           : std::string("not compiled in"));
  fmt::print("gloo       compiled in\n");
  const std::string uri = mongodb_uri(a.uri);
  if (uri.empty()) {
    fmt::print("mongodb    not checked (give --uri or set LORARUN_MONGODB_URI)\n");
    return 0;
  }
  data::Client client(uri, std::chrono::milliseconds(a.timeout_ms));
  const data::ServerInfo info = client.server_info();
  fmt::print("mongodb    {}{} at {}\n", info.version,
             info.ferretdb_version.empty() ? "" : fmt::format(" (FerretDB {})", info.ferretdb_version), info.address);
  return 0;
}

// Joins the process group and checks that an all-reduce of (rank + 1) sums to W(W+1)/2.
void dist_check(const Args& a) {
  const dist::DistEnv env = dist::DistEnv::from_environment();
  const bool cuda = torch::cuda::is_available();
  const dist::Backend backend = dist::resolve_backend(a.backend, cuda);
  dist::ProcessGroup pg(env, backend, std::chrono::seconds(a.dist_timeout_s));
  const auto device = backend == dist::Backend::Nccl ? at::Device(at::kCUDA, env.local_rank) : at::Device(at::kCPU);
  at::Tensor t = at::full({4}, double(env.rank + 1), at::TensorOptions().dtype(at::kDouble).device(device));
  pg.all_reduce_sum(t);
  const double want = env.world_size * (env.world_size + 1) / 2.0;
  const double got_min = t.min().item<double>(), got_max = t.max().item<double>();
  if (got_min != want || got_max != want)
    throw Error(fmt::format("rank {}: all-reduce over {} gave {}..{}, expected {}", env.rank,
                            dist::backend_name(backend), got_min, got_max, want));
  fmt::print("rank {}/{}: all-reduce over {} on {} ok (sum {} = expected {})\n", env.rank, env.world_size,
             dist::backend_name(backend), device.str(), got_max, want);
  std::fflush(stdout);
  pg.barrier();
}

// --from-run: the recipe is the run record's; the first positional argument is then an override.
recipe::Recipe from_run(Args a) {
  if (!a.recipe.empty()) {
    if (a.recipe.find('=') == std::string::npos)
      throw Error(fmt::format("give a recipe ({}) or --from-run {}, not both", a.recipe, a.from_run));
    a.overrides.insert(a.overrides.begin(), a.recipe);
  }
  const std::string uri = mongodb_uri(a.uri);
  return track::recipe_from_run(a.from_run, a.runs_db, uri, a.overrides, std::chrono::milliseconds(a.timeout_ms));
}

// The recipe, from its file or a run record. Its errors are the recipe's (a restart cannot change
// them: ConfigError), except a server that could not be reached for --from-run.
recipe::Recipe read_recipe(const Args& a) {
  try {
    return a.from_run.empty() ? recipe::load_recipe(a.recipe, a.overrides) : from_run(a);
  } catch (const data::ConnectionError&) {
    throw;
  } catch (const ConfigError&) {
    throw;
  } catch (const Error& e) {
    throw ConfigError(e.what());
  }
}

// A job's adapter's documents per epoch, as --dry-run counts them: its selection, or its data.sources'
// (data.epoch_documents when set); 0 for what cannot be counted (a warning says why).
int64_t documents_of(const recipe::Recipe& own, const std::string& name) {
  if (!own.data.sources.empty() && own.data.epoch_documents) return *own.data.epoch_documents;
  const auto count = [&](const recipe::DataSection& d) -> int64_t {
    if (d.source == recipe::Source::MongoDB) {
      const data::Selection s = data::check_selection(d);
      if (!s.warning.empty()) warn(fmt::format("adapter '{}': {}", name, s.warning));
      return s.count;
    }
    try {
      return data::Documents(d).size();
    } catch (const Error& e) {
      warn(fmt::format("adapter '{}': {}", name, e.what()));
      return 0;
    }
  };
  if (own.data.sources.empty()) return count(own.data);
  int64_t n = 0;
  for (const recipe::DataSource& s : own.data.sources) n += count(own.data.of_source(s));
  return n;
}

// --dry-run of a job of many adapters (adapters:): each adapter found, its documents and steps,
// as its own run would have them; none when the recipe has one adapter, or when they cannot be
// found (a warning says why).
std::vector<recipe::AdapterSpec> print_adapters(const recipe::Recipe& r, int world) {
  if (!r.adapters.enabled()) return {};
  std::vector<recipe::AdapterSpec> adapters;
  try {
    adapters = train::job_adapters(r);
  } catch (const Error& e) {
    warn(fmt::format("the adapters were not listed: {}", e.what()));
    return {};
  }
  fmt::print("# {} adapters, each trained as its own run would be, in {}/<name>/:\n", adapters.size(),
             r.checkpoint.output_dir);
  for (const recipe::AdapterSpec& a : adapters) {
    const recipe::Recipe own = recipe::adapter_recipe(r, a);
    const int64_t documents = documents_of(own, a.name);
    const int64_t steps = train::steps_per_epoch(own, data::examples_per_rank(documents, world));
    fmt::print("#   {}: {} documents, {} steps per epoch x {} epochs on {} rank(s); {}, lr {:g}\n", a.name, documents,
               steps, own.train.epochs, world, model::describe_adapter(own.lora), own.train.lr);
  }
  return adapters;
}

int run(int argc, char** argv) {
  CLI::App app{"lora-train: one rank of a LoRA fine-tuning job (run it under lorarun)"};
  Args a;
  app.add_flag("--check-env", a.check_env, "print torch/CUDA/NCCL/MongoDB facts and exit");
  app.add_option("--uri", a.uri, "MongoDB URI for --check-env and --from-run (default: $LORARUN_MONGODB_URI)");
  app.add_option("--timeout-ms", a.timeout_ms, "MongoDB server selection timeout")->check(CLI::Range(1, 600000));
  app.add_flag("--dist-check", a.dist_check, "join the process group, all-reduce, check the sum");
  app.add_option("--backend", a.backend, "auto, nccl or gloo")->check(CLI::IsMember({"auto", "nccl", "gloo"}));
  app.add_option("--dist-timeout-s", a.dist_timeout_s, "rendezvous and collective timeout")
      ->check(CLI::Range(1, 86400));
  app.add_flag("--dry-run", a.dry_run,
               "validate the recipe, print it resolved, the epochs kept and the memory a rank needs, exit");
  app.add_option("--from-run", a.from_run,
                 "repeat a recorded run (DATABASE/ID, as printed at its start) with overrides");
  app.add_option("--runs-db", a.runs_db, "the run records' database, for a --from-run ID without one");
  app.add_option("recipe", a.recipe, "recipe YAML");
  app.add_option("overrides", a.overrides, "key=value overrides of recipe keys");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  if (a.check_env) return check_env(a);
  if (a.dist_check) {
    dist_check(a);
    return 0;
  }
  if (a.recipe.empty() && a.from_run.empty())
    throw Error("no recipe given: lora-train RECIPE.yaml [key=value…] (see configs/) or --from-run DATABASE/ID");
  const recipe::Recipe r = read_recipe(a);
  const dist::DistEnv env = dist::DistEnv::from_environment();
  if (env.rank == 0)  // the same recipe on every rank: one copy of its warnings
    for (const std::string& w : r.warnings) warn(w);
  if (a.dry_run) {
    fmt::print("{}", recipe::to_yaml(r));
    fmt::print("# epoch checkpoints kept at the end: [{}]\n",
               fmt::join(train::epochs_kept(r.checkpoint, r.train.epochs), ", "));
    if (r.data.source == recipe::Source::MongoDB && r.data.sources.empty()) {  // the server's verdict, if one answers
      const data::Selection s = data::check_selection(r.data);
      if (s.warning.empty())
        fmt::print("# documents selected: {}\n", s.count);
      else
        warn(s.warning);
    }
    for (const recipe::DataSource& source : r.data.sources) {
      if (r.data.source != recipe::Source::MongoDB) break;
      const data::Selection s = data::check_selection(r.data.of_source(source));
      if (s.warning.empty())
        fmt::print("# data.sources '{}': {} documents selected (weight {:g})\n", source.name, s.count, source.weight);
      else
        warn(fmt::format("data.sources '{}': {}", source.name, s.warning));
    }
    if (!r.data.sources.empty())
      fmt::print("# the mixture of an epoch: lora-data stats {} (documents, tokens and repeats per source)\n",
                 a.recipe.empty() ? "RECIPE" : a.recipe);
    if (const recipe::EvalSection& e = r.eval; e.enabled(r.data.source))
      fmt::print("# evaluation: {}{}, at each epoch end{}\n",
                 e.fraction > 0 ? fmt::format("eval.fraction {} held out of data's selection", e.fraction)
                 : r.data.source == recipe::Source::MongoDB
                     ? fmt::format("{}.{} {}", r.data.database, e.collection.empty() ? r.data.collection : e.collection,
                                   e.filter.dump())
                     : fmt::format("eval.path {}", e.path),
                 e.max_documents ? fmt::format(" (at most {} documents)", *e.max_documents) : "",
                 e.every_n_steps ? fmt::format(" and every {} steps", *e.every_n_steps) : "");
    const std::vector<recipe::AdapterSpec> adapters = print_adapters(r, env.world_size);
    try {  // from the model's shapes: the weights are not read
      fmt::print("{}", train::memory_report(r, env.world_size, adapters));
    } catch (const c10::Error& e) {  // the plan stands without the estimate
      const std::string m = e.what_without_backtrace();
      warn(fmt::format("memory not estimated: {}", m.substr(0, m.find('\n'))));
    } catch (const std::exception& e) {
      warn(fmt::format("memory not estimated: {}", e.what()));
    }
    return 0;
  }
  return train::run_training(r, env);
}

}  // namespace

int main(int argc, char** argv) {
  // torch's own log lines stay off unless TORCH_CPP_LOG_LEVEL asks for them: c10d logs each failed
  // connection attempt with the exception's C++ stack trace, and our one error line says it all.
  if (const char* level = std::getenv("TORCH_CPP_LOG_LEVEL"); !level || !*level) FLAGS_caffe2_log_level = 3;  // FATAL
  return lorarun::app_main("lora-train", argc, argv, run);
}
