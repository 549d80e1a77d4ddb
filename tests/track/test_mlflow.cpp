// track.mlflow_uri: a training run logged to a real `mlflow server` (PyPI's mlflow, in its own venv
// LORARUN_MLFLOW_PYTHON), read back through MLflow's own client (mlflow_read.py): every metric as
// metrics.jsonl has it, the recipe as params without the password, the adapter as artifacts, the
// end status, a run stopped and resumed continuing one MLflow run; and a server nobody answers costs
// one warning line and nothing else.
#include <curl/curl.h>
#include <fmt/format.h>
#include <signal.h>
#include <algorithm>
#include <catch2/catch.hpp>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <numeric>

#include "io/sha256.hpp"
#include "support/runs.hpp"
#include "support/servers.hpp"

using namespace lorarun::test;
namespace fs = std::filesystem;

namespace {

// GET `url` within `timeout_ms`: the HTTP status (0 without an answer) and the body.
std::pair<long, std::string> get(const std::string& url, long timeout_ms = 1000) {
  std::string body;
  CURL* curl = curl_easy_init();
  curl_easy_setopt(curl, CURLOPT_URL, url.c_str());
  curl_easy_setopt(curl, CURLOPT_TIMEOUT_MS, timeout_ms);
  curl_easy_setopt(curl, CURLOPT_NOSIGNAL, 1L);
  curl_easy_setopt(curl, CURLOPT_WRITEDATA, &body);
  curl_easy_setopt(
      curl, CURLOPT_WRITEFUNCTION, +[](char* data, size_t size, size_t n, void* out) {
        static_cast<std::string*>(out)->append(data, size * n);
        return size * n;
      });
  long status = 0;
  if (curl_easy_perform(curl) == CURLE_OK) curl_easy_getinfo(curl, CURLINFO_RESPONSE_CODE, &status);
  curl_easy_cleanup(curl);
  return {status, body};
}

// Whether GET `url` answers 200 within a second.
bool answers(const std::string& url) { return get(url).first == 200; }

// The JSON that MLflow's REST API answers to GET `path` (10 s at most); null when it fails.
nlohmann::json rest(const std::string& uri, const std::string& path) {
  const auto [status, body] = get(uri + path, 10000);
  return status == 200 ? nlohmann::json::parse(body, nullptr, false) : nlohmann::json();
}

// A real `mlflow server` on a free loopback port: a SQLite backend store and proxied artifacts
// under `dir`, in a process group of its own that the destructor ends, whether the test passed
// or failed.
struct MlflowServer {
  int port = free_port();
  std::string uri = fmt::format("http://127.0.0.1:{}", port);
  std::string log;
  pid_t group = -1;

  explicit MlflowServer(const std::string& dir) : log(dir + "/mlflow-server.log") {
    const Result r = sh(fmt::format(
        "cd '{}' && setsid '{}' -m mlflow server --host 127.0.0.1 --port {} --workers 1 "
        "--backend-store-uri 'sqlite:///{}/mlflow.db' --serve-artifacts --artifacts-destination '{}/artifacts' "
        "> '{}' 2>&1 < /dev/null & echo $!",
        dir, LORARUN_MLFLOW_PYTHON, port, dir, dir, log));
    group = std::stoi(r.output);
  }
  ~MlflowServer() {
    if (group <= 0) return;
    ::kill(-group, SIGTERM);
    if (!wait_for([&] { return !group_alive(group); }, 10)) ::kill(-group, SIGKILL);
  }
  MlflowServer(const MlflowServer&) = delete;
  MlflowServer& operator=(const MlflowServer&) = delete;

  // Waits up to `seconds` for /health (MLflow's start-up takes several seconds).
  bool ready(double seconds) const {
    return wait_for([&] { return answers(uri + "/health"); }, seconds);
  }
};

// metrics.jsonl's rows: the training steps' and the evaluations'.
struct Rows {
  std::vector<nlohmann::json> train, eval;
};

Rows rows(const std::string& path) {
  Rows m;
  std::ifstream in(path);
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json row = nlohmann::json::parse(line);
    (row.contains("eval_loss") ? m.eval : m.train).push_back(row);
  }
  return m;
}

// The largest |MLflow's value - metrics.jsonl's| of `key` over `want`'s rows, requiring the same
// steps in the same order; infinity when they differ.
double max_difference(const nlohmann::json& history, const std::vector<nlohmann::json>& want, const std::string& key) {
  if (!history.is_array() || history.size() != want.size()) return INFINITY;
  double worst = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (history[i][0].get<int64_t>() != want[i].at("step").get<int64_t>()) return INFINITY;
    worst = std::max(worst, std::abs(history[i][1].get<double>() - want[i].at(key).get<double>()));
  }
  return worst;
}

}  // namespace

TEST_CASE(
    "mlflow: a run on a real mlflow server: metrics as metrics.jsonl, params, adapter artifacts, FINISHED, "
    "and stopped then resumed as one run",
    "[e2e][mlflow]") {
  const auto t0 = std::chrono::steady_clock::now();
  const std::string dir = temp_dir("mlflow");
  const MlflowServer server(dir);  // starts while the data and recipe are written
  write_data(dir + "/data.jsonl", 24);
  write_data(dir + "/eval.jsonl", 6, 100);
  const std::string password = "s3cret-pw";
  const std::string recipe =
      write_recipe(dir, "a", "epochs: 2, lr: 1.0e-3", "",
                   fmt::format(", batch_size: 4, uri: 'mongodb://alice:{}@127.0.0.1:1/'", password),
                   fmt::format("eval: {{path: {}/eval.jsonl, every_n_steps: 2}}\n", dir));
  REQUIRE(server.ready(45));
  const double startup = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();

  // Two ranks: rank 0 alone logs. The experiment comes from the environment, as in MLflow.
  const Result run = sh(fmt::format("MLFLOW_EXPERIMENT_NAME=lorarun-tests {} --nproc-per-node 2 {} track.mlflow_uri={}",
                                    bin("lorarun"), recipe, server.uri));
  INFO(run.output);
  REQUIRE(run.status == 0);
  CHECK(lines_with(run.output, "warning").empty());
  CHECK(lines_with(run.output, "MLflow run ").size() == 1);
  CHECK(run.output.find(password) == std::string::npos);
  const nlohmann::json kept = nlohmann::json::parse(read_file(dir + "/a/mlflow_run.json"));
  CHECK(kept.at("tracking_uri") == server.uri);
  const std::string run_id = kept.at("run_id");
  CHECK_THAT(read_file(dir + "/a/recipe.yaml"), Catch::Contains("mlflow_experiment: \"lorarun-tests\""));

  // MLflow's client reads the run back.
  const Result read = sh(fmt::format("'{}' '{}/tests/track/mlflow_read.py' {} {} '{}/download' 2> '{}/read.err'",
                                     LORARUN_MLFLOW_PYTHON, LORARUN_SOURCE_DIR, server.uri, run_id, dir, dir));
  INFO(read.output);
  INFO(read_file(dir + "/read.err"));
  REQUIRE(read.status == 0);
  const nlohmann::json got = nlohmann::json::parse(read.output);
  CHECK(got.at("status") == "FINISHED");
  CHECK(got.at("run_name") == "a");
  CHECK(got.at("experiment") == "lorarun-tests");

  // Every metrics line's loss, lr, grad_norm and tokens/s at its step, each evaluation's
  // eval_loss and eval_ppl: the same doubles as metrics.jsonl.
  const Rows want = rows(dir + "/a/metrics.jsonl");
  REQUIRE(want.train.size() == 6);  // 24 documents, 2 ranks, batches of 4: 3 steps an epoch
  REQUIRE(want.eval.size() == 4);   // steps 2 and 4, and each epoch's end (3, 6)
  const nlohmann::json& metrics = got.at("metrics");
  double worst = 0;
  size_t points = 0;
  for (const auto& [key, of] :
       std::vector<std::pair<std::string, const std::vector<nlohmann::json>*>>{{"loss", &want.train},
                                                                               {"lr", &want.train},
                                                                               {"grad_norm", &want.train},
                                                                               {"tokens_per_s", &want.train},
                                                                               {"eval_loss", &want.eval},
                                                                               {"eval_ppl", &want.eval}}) {
    INFO(key);
    REQUIRE(metrics.contains(key));
    const double d = max_difference(metrics.at(key), *of, key);
    CHECK(d == 0);
    worst = std::max(worst, d);
    points += metrics.at(key).size();
  }
  CHECK(metrics.size() == 6);

  // The recipe as dotted params; the MongoDB password nowhere.
  const nlohmann::json& params = got.at("params");
  CHECK(params.at("lora.r") == "4");
  CHECK(params.at("train.lr") == "0.001");
  CHECK(params.at("train.epochs") == "2");
  CHECK(params.at("data.source") == "jsonl");
  CHECK(params.at("data.uri") == "mongodb://alice:****@127.0.0.1:1/");
  CHECK(params.at("track.mlflow_uri") == server.uri);
  CHECK(params.dump().find(password) == std::string::npos);
  CHECK(got.at("tags").at("lorarun.version") == LORARUN_VERSION);
  CHECK(got.at("tags").at("lorarun.world_size") == "2");
  CHECK(got.dump().find(password) == std::string::npos);

  // The last epoch's adapter, file by file: the sizes MLflow lists and the bytes it serves.
  const fs::path adapter = fs::path(dir) / "a" / "epoch_1";
  std::map<std::string, nlohmann::json> artifacts;
  for (const nlohmann::json& f : got.at("artifacts")) artifacts[f.at("path")] = f;
  size_t files = 0;
  std::string sizes;
  for (const fs::directory_entry& e : fs::directory_iterator(adapter)) {
    const std::string name = "adapter/" + e.path().filename().string();
    INFO(name);
    REQUIRE(artifacts.count(name) == 1);
    CHECK(artifacts[name].at("size").get<int64_t>() == static_cast<int64_t>(e.file_size()));
    CHECK(artifacts[name].at("sha256") == lorarun::io::sha256_file(e.path().string()));
    sizes += fmt::format(" {} {} bytes;", name, e.file_size());
    ++files;
  }
  CHECK(files == artifacts.size());
  CHECK(files >= 2);

  // A run stopped part way (SIGTERM: the resumable state, exit 75) is KILLED; run again, it resumes
  // and continues the same MLflow run to FINISHED, every step logged once.
  const std::string cdir = dir + "/c";
  fs::create_directories(cdir);
  write_data(cdir + "/data.jsonl", 120);
  const std::string c = write_recipe(cdir, "c", "epochs: 1, lr: 1.0e-3", "", ", batch_size: 1");
  const std::string cmd = fmt::format("{} {} track.mlflow_uri={}", bin("lora-train"), c, server.uri);
  const Result cut = interrupt(cmd, cdir + "/cut.log", "epoch 0/1 step 5/120", "kill -TERM $pid");
  INFO(read_file(cdir + "/cut.log"));
  REQUIRE_THAT(cut.output, Catch::Contains("exit=75"));
  const std::string c_id = nlohmann::json::parse(read_file(cdir + "/c/mlflow_run.json")).at("run_id");
  const std::string run_path = "/api/2.0/mlflow/runs/get?run_id=" + c_id;
  CHECK(rest(server.uri, run_path)["run"]["info"]["status"] == "KILLED");
  const Result resumed = sh(cmd);
  INFO(resumed.output);
  REQUIRE(resumed.status == 0);
  CHECK_THAT(resumed.output, Catch::Contains(fmt::format("MLflow run {} continued", c_id)));
  CHECK(rest(server.uri, run_path)["run"]["info"]["status"] == "FINISHED");
  const nlohmann::json history =
      rest(server.uri, fmt::format("/api/2.0/mlflow/metrics/get-history?run_id={}&metric_key=loss", c_id));
  std::vector<std::pair<int64_t, double>> logged, written;
  for (const nlohmann::json& m : history.value("metrics", nlohmann::json::array()))
    logged.emplace_back(m.at("step").get<int64_t>(), m.at("value").get<double>());
  std::sort(logged.begin(), logged.end());
  for (const nlohmann::json& row : rows(cdir + "/c/metrics.jsonl").train)
    written.emplace_back(row.at("step").get<int64_t>(), row.at("loss").get<double>());
  CHECK(written.size() == 120);
  CHECK(logged == written);

  // Killed (-9) after its state at step 300 and the steps after it logged: the rerun repeats steps
  // 301 on, which MLflow then already has: each step is in the run once, as in metrics.jsonl. (300
  // steps between states: the kill lands before the next one however far MLflow's sender lags.)
  const std::string kdir = dir + "/k";
  fs::create_directories(kdir);
  write_data(kdir + "/data.jsonl", 600);
  const std::string k = write_recipe(kdir, "k", "epochs: 1, lr: 1.0e-3", "", ", batch_size: 1");
  const std::string kcmd =
      fmt::format("{} {} track.mlflow_uri={} checkpoint.state_every_n_steps=300", bin("lora-train"), k, server.uri);
  // (killed once MLflow holds more than the 300 steps of the state: the rerun must not log those again)
  const Result killed = interrupt(
      kcmd, kdir + "/k.log", "epoch 0/1 step 301/600",
      fmt::format("'{}' -c \"import json, sys, time, urllib.request\n"
                  "run = json.load(open(sys.argv[1]))['run_id']\n"
                  "for _ in range(1500):\n"
                  "    url = sys.argv[2] + '/api/2.0/mlflow/metrics/get-history?metric_key=loss&run_id=' + run\n"
                  "    if len(json.load(urllib.request.urlopen(url)).get('metrics', [])) > 302: break\n"
                  "    time.sleep(0.02)\" '{}/k/mlflow_run.json' '{}'; kill -9 $pid",
                  LORARUN_MLFLOW_PYTHON, kdir, server.uri));
  INFO(read_file(kdir + "/k.log"));
  const std::string k_id = nlohmann::json::parse(read_file(kdir + "/k/mlflow_run.json")).at("run_id");
  const auto steps_logged = [&] {
    std::vector<int64_t> steps;
    for (const nlohmann::json& m :
         rest(server.uri, fmt::format("/api/2.0/mlflow/metrics/get-history?run_id={}&metric_key=loss", k_id))
             .value("metrics", nlohmann::json::array()))
      steps.push_back(m.at("step").get<int64_t>());
    std::sort(steps.begin(), steps.end());
    return steps;
  };
  const std::vector<int64_t> before = steps_logged();
  CHECK(before.size() > 302);  // steps past the last state reached MLflow before the kill
  CHECK(before.size() < 600);
  const Result again = sh(kcmd);
  INFO(again.output);
  REQUIRE(again.status == 0);
  CHECK_THAT(again.output, Catch::Contains("resuming at epoch 0 step 300"));
  std::vector<int64_t> each(600);
  std::iota(each.begin(), each.end(), 1);
  CHECK(steps_logged() == each);

  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  WARN(
      fmt::format("MLflow: {} metric values in {} keys, max difference to metrics.jsonl {:g};{} server up after "
                  "{:.1f} s, training {:.1f} s, read back {:.1f} s, stopped and resumed {:.1f} s, {:.1f} s in all",
                  points, metrics.size(), worst, sizes, startup, run.seconds, read.seconds,
                  cut.seconds + resumed.seconds, seconds));
  CHECK(seconds < 90);
}

TEST_CASE("mlflow: an unreachable server is one warning line, and training completes", "[e2e][mlflow]") {
  const std::string dir = temp_dir("mlflow-unreachable");
  write_data(dir + "/data.jsonl", 16);
  const std::string recipe = write_recipe(dir, "b", "epochs: 2, lr: 1.0e-3", "", ", batch_size: 4");
  const std::string password = "hunter2-pw";
  const int port = free_port();  // nothing listens there
  const Result run = sh(
      fmt::format("{} {} 'track.mlflow_uri=http://bob:{}@127.0.0.1:{}/'", bin("lora-train"), recipe, password, port));
  INFO(run.output);
  REQUIRE(run.status == 0);
  const std::vector<std::string> lines = lines_with(run.output, "MLflow");
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::StartsWith("warning: MLflow at http://bob:****@127.0.0.1:"));
  CHECK_THAT(lines[0], Catch::Contains("training goes on without MLflow"));
  CHECK(lines_with(run.output, "warning").size() == 1);
  CHECK(run.output.find(password) == std::string::npos);
  CHECK(read_file(dir + "/b/recipe.yaml").find(password) == std::string::npos);
  CHECK(fs::exists(dir + "/b/epoch_1/adapter_model.safetensors"));
  CHECK(rows(dir + "/b/metrics.jsonl").train.size() == 8);
}
