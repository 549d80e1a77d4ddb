#include "track/mlflow.hpp"

#include <curl/curl.h>
#include <fmt/format.h>
#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <thread>

#include "io/files.hpp"
#include "util/log.hpp"
#include "util/secrets.hpp"

namespace lorarun::track {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// MLflow's limits (mlflow/utils/validation.py): entries per runs/log-batch request, and the
// longest param value.
constexpr size_t kMetricsPerBatch = 1000;
constexpr size_t kParamsPerBatch = 100;
constexpr size_t kMaxParamValue = 6000;
// Metrics waiting for a slow server beyond this many are dropped (a run never grows without bound).
constexpr size_t kMaxQueuedMetrics = 200000;
// A connection that is not made within this long fails (an unreachable host costs no more).
constexpr long kConnectTimeoutMs = 3000;

// A request that failed: an HTTP status >= 400 with MLflow's error_code, or no answer (status 0).
struct Failure : std::runtime_error {
  long status = 0;
  std::string code;
  Failure(const std::string& what, long status_, std::string code_)
      : std::runtime_error(what), status(status_), code(std::move(code_)) {}
};

int64_t now_ms() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// `text` on one line, at most `n` characters: server messages become part of a warning line.
std::string one_line(std::string text, size_t n = 300) {
  std::replace_if(text.begin(), text.end(), [](char c) { return c == '\n' || c == '\r'; }, ' ');
  if (text.size() > n) text = text.substr(0, n) + "…";
  return text;
}

// `s` cut to at most `n` bytes without splitting a UTF-8 character.
std::string cut_utf8(const std::string& s, size_t n) {
  if (s.size() <= n) return s;
  while (n > 0 && (static_cast<unsigned char>(s[n]) & 0xC0) == 0x80) --n;
  return s.substr(0, n);
}

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

// libcurl's global state, once per process, before any thread uses it.
void init_curl() {
  static std::once_flag once;
  std::call_once(once, [] { curl_global_init(CURL_GLOBAL_DEFAULT); });
}

size_t append_body(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

// One libcurl handle for one server (its connection is reused): JSON requests and file uploads,
// each bounded in time. Used by one thread only.
class Http {
 public:
  Http(std::string base, std::chrono::milliseconds timeout) : base_(std::move(base)), timeout_(timeout) {
    init_curl();
    curl_ = curl_easy_init();
    if (!curl_) throw std::runtime_error("libcurl could not make a handle");
    if (const std::string token = env("MLFLOW_TRACKING_TOKEN"); !token.empty()) {
      register_secret(token);
      headers_ = curl_slist_append(headers_, ("Authorization: Bearer " + token).c_str());
    }
    headers_ = curl_slist_append(headers_, "Expect:");  // no 100-continue round trip before uploads
    user_ = env("MLFLOW_TRACKING_USERNAME");
    password_ = env("MLFLOW_TRACKING_PASSWORD");
    register_secret(password_);
  }
  ~Http() {
    curl_slist_free_all(headers_);
    curl_easy_cleanup(curl_);
  }
  Http(const Http&) = delete;
  Http& operator=(const Http&) = delete;

  // GET (body null) or POST of JSON to base + path; the answer's JSON. Throws Failure.
  json call(const std::string& path, const json& body = nullptr) {
    prepare(path);
    curl_slist* headers = curl_slist_append(copy_headers(), "Content-Type: application/json");
    const std::string text = body.is_null() ? "" : body.dump(-1, ' ', false, json::error_handler_t::replace);
    if (!body.is_null()) {
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDS, text.c_str());
      curl_easy_setopt(curl_, CURLOPT_POSTFIELDSIZE_LARGE, static_cast<curl_off_t>(text.size()));
    }
    curl_easy_setopt(curl_, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(curl_, CURLOPT_TIMEOUT_MS, static_cast<long>(timeout_.count()));
    return perform(headers);
  }

  // PUT of `file`'s bytes to base + path; gives up when no byte moves for the timeout.
  void put_file(const std::string& path, const fs::path& file) {
    std::FILE* f = std::fopen(file.c_str(), "rb");
    if (!f) throw Failure(fmt::format("cannot read {}", file.string()), 0, "");
    prepare(path);
    curl_slist* headers = curl_slist_append(copy_headers(), "Content-Type: application/octet-stream");
    curl_easy_setopt(curl_, CURLOPT_UPLOAD, 1L);
    curl_easy_setopt(curl_, CURLOPT_READDATA, f);
    curl_easy_setopt(curl_, CURLOPT_INFILESIZE_LARGE, static_cast<curl_off_t>(fs::file_size(file)));
    curl_easy_setopt(curl_, CURLOPT_HTTPHEADER, headers);
    curl_easy_setopt(curl_, CURLOPT_LOW_SPEED_LIMIT, 1L);
    curl_easy_setopt(curl_, CURLOPT_LOW_SPEED_TIME, std::max(1L, static_cast<long>(timeout_.count() / 1000)));
    try {
      perform(headers);
    } catch (...) {
      std::fclose(f);
      throw;
    }
    std::fclose(f);
  }

  // "literal segment/with spaces" -> "literal%20segment/with%20spaces" (each '/'-separated part escaped).
  std::string escape_path(const std::string& path) {
    std::string out;
    size_t from = 0;
    while (from <= path.size()) {
      const size_t slash = std::min(path.find('/', from), path.size());
      char* e = curl_easy_escape(curl_, path.data() + from, static_cast<int>(slash - from));
      out += e ? e : "";
      curl_free(e);
      if (slash < path.size()) out += '/';
      from = slash + 1;
    }
    return out;
  }

 private:
  // Options every request shares; the handle keeps its connection across resets.
  void prepare(const std::string& path) {
    curl_easy_reset(curl_);
    url_ = base_ + path;
    body_.clear();
    error_[0] = '\0';
    curl_easy_setopt(curl_, CURLOPT_URL, url_.c_str());
    curl_easy_setopt(curl_, CURLOPT_NOSIGNAL, 1L);
    curl_easy_setopt(curl_, CURLOPT_CONNECTTIMEOUT_MS, std::min<long>(kConnectTimeoutMs, timeout_.count()));
    curl_easy_setopt(curl_, CURLOPT_WRITEFUNCTION, append_body);
    curl_easy_setopt(curl_, CURLOPT_WRITEDATA, &body_);
    curl_easy_setopt(curl_, CURLOPT_ERRORBUFFER, error_);
    if (!user_.empty()) {
      curl_easy_setopt(curl_, CURLOPT_USERNAME, user_.c_str());
      curl_easy_setopt(curl_, CURLOPT_PASSWORD, password_.c_str());
    }
    if (env("MLFLOW_TRACKING_INSECURE_TLS") == "true") {
      curl_easy_setopt(curl_, CURLOPT_SSL_VERIFYPEER, 0L);
      curl_easy_setopt(curl_, CURLOPT_SSL_VERIFYHOST, 0L);
    }
  }

  curl_slist* copy_headers() const {
    curl_slist* out = nullptr;
    for (const curl_slist* h = headers_; h; h = h->next) out = curl_slist_append(out, h->data);
    return out;
  }

  // Sends the prepared request (and frees `headers`); the answer's JSON ({} when empty), or Failure
  // naming the transport error or MLflow's error_code and message.
  json perform(curl_slist* headers) {
    const CURLcode rc = curl_easy_perform(curl_);
    curl_slist_free_all(headers);
    long status = 0;
    curl_easy_getinfo(curl_, CURLINFO_RESPONSE_CODE, &status);
    if (rc != CURLE_OK) throw Failure(one_line(error_[0] ? error_ : curl_easy_strerror(rc)), 0, "");
    const json answer = body_.empty() ? json::object() : json::parse(body_, nullptr, false);
    if (status >= 400) {
      const std::string code = answer.is_object() ? answer.value("error_code", "") : "";
      const std::string message = answer.is_object() ? answer.value("message", "") : body_;
      throw Failure(one_line(fmt::format("HTTP {}{}{}", status, code.empty() ? "" : " " + code,
                                         message.empty() ? "" : ": " + message)),
                    status, code);
    }
    if (answer.is_discarded())
      throw Failure(fmt::format("HTTP {} with an answer that is not JSON ({}): is this an MLflow server?", status,
                                one_line(body_, 80)),
                    status, "");
    return answer;
  }

  std::string base_;
  std::chrono::milliseconds timeout_;
  CURL* curl_ = nullptr;
  curl_slist* headers_ = nullptr;
  std::string user_, password_, url_, body_;
  char error_[CURL_ERROR_SIZE] = {};
};

// What the training thread hands the sender: metrics to log, a directory to upload, or the end.
struct Job {
  enum class Kind { Metrics, Artifacts, End } kind = Kind::Metrics;
  json metrics = json::array();
  std::string dir, path, status;
  static Job artifacts(std::string dir, std::string path) {
    Job j;
    j.kind = Kind::Artifacts;
    j.dir = std::move(dir);
    j.path = std::move(path);
    return j;
  }
  static Job end(std::string status) {
    Job j;
    j.kind = Kind::End;
    j.status = std::move(status);
    return j;
  }
};

// The server path behind a run's artifact_uri when the server proxies artifacts
// ("mlflow-artifacts:/1/<run>/artifacts", also with "//host:port" after the colon), else "".
std::string proxied_artifact_path(const std::string& artifact_uri) {
  constexpr std::string_view scheme = "mlflow-artifacts:";
  if (!artifact_uri.starts_with(scheme)) return "";
  std::string rest = artifact_uri.substr(scheme.size());
  if (rest.starts_with("//")) {
    const size_t slash = rest.find('/', 2);
    rest = slash == std::string::npos ? "" : rest.substr(slash);
  }
  while (rest.starts_with("/")) rest.erase(0, 1);
  while (rest.ends_with("/")) rest.pop_back();
  return rest;
}

// The regular files under `dir`, sorted by their relative names.
std::vector<fs::path> files_under(const fs::path& dir) {
  std::vector<fs::path> files;
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(dir))
    if (e.is_regular_file()) files.push_back(e.path().lexically_relative(dir));
  std::sort(files.begin(), files.end());
  return files;
}

}  // namespace

std::vector<std::pair<std::string, std::string>> flat_params(const json& nested) {
  std::vector<std::pair<std::string, std::string>> out;
  const auto add = [&](const std::string& key, const json& v) {
    const std::string text =
        v.is_string() ? v.get<std::string>() : v.dump(-1, ' ', false, json::error_handler_t::replace);
    out.emplace_back(key, cut_utf8(scrub(redact_uri(text)), kMaxParamValue));
  };
  for (const auto& [section, keys] : nested.items()) {
    if (!keys.is_object()) {
      add(section, keys);
      continue;
    }
    for (const auto& [key, v] : keys.items()) add(section + "." + key, v);
  }
  return out;
}

struct MlflowRun::Impl {
  MlflowOptions o;
  std::string shown;  // the URI with its password hidden, for messages
  std::mutex mutex;
  std::condition_variable wake;
  std::deque<Job> jobs;
  size_t queued_metrics = 0;
  bool closing = false, finished = false;
  std::thread sender;
  // The sender's own: the run, and whether the server failed (then nothing more is sent).
  std::unique_ptr<Http> http;
  std::string run_id, experiment_id, artifact_uri;
  std::map<std::string, int64_t> logged;  // resumed: the highest step each metric already has
  bool dead = false, warned = false;

  explicit Impl(MlflowOptions options) : o(std::move(options)) {
    while (o.uri.ends_with("/")) o.uri.pop_back();
    shown = redact_uri(o.uri);
    register_uri_secret(o.uri);
    sender = std::thread([this] { send_all(); });
  }

  // The sender thread: the run first, then each job in order until closed. Never throws.
  void send_all() {
    attempt("creating the run", [&] {
      http = std::make_unique<Http>(o.uri, o.timeout);
      start();
    });
    for (;;) {
      Job job;
      {
        std::unique_lock lock(mutex);
        wake.wait(lock, [&] { return closing || !jobs.empty(); });
        if (jobs.empty()) return;
        job = std::move(jobs.front());
        jobs.pop_front();
        if (job.kind == Job::Kind::Metrics) queued_metrics -= job.metrics.size();
      }
      send(job);
    }
  }

  // One job to the server, unless it already failed.
  void send(const Job& job) {
    switch (job.kind) {
      case Job::Kind::Metrics: {
        json fresh = json::array();  // a resumed run logs again the steps after its last state: once is enough
        for (const json& m : job.metrics)
          if (const auto it = logged.find(m["key"].get<std::string>()); it == logged.end() || m["step"] > it->second)
            fresh.push_back(m);
        if (fresh.empty()) break;
        attempt("logging metrics",
                [&] { http->call("/api/2.0/mlflow/runs/log-batch", {{"run_id", run_id}, {"metrics", fresh}}); });
        break;
      }
      case Job::Kind::Artifacts:
        attempt("uploading the adapter", [&] { upload(job.dir, job.path); });
        break;
      case Job::Kind::End:
        attempt("ending the run", [&] {
          http->call("/api/2.0/mlflow/runs/update",
                     {{"run_id", run_id}, {"status", job.status}, {"end_time", now_ms()}});
        });
        break;
    }
  }

  // Runs `request` unless the server failed before; its first failure is the one warning.
  template <class Request>
  void attempt(const char* what, Request request) {
    if (dead) return;
    try {
      request();
    } catch (const std::exception& e) {
      dead = true;
      warn_once(
          fmt::format("MLflow at {}: {} failed: {}; training goes on without MLflow (is `mlflow server` "
                      "running there? track.mlflow_uri: \"\" turns it off)",
                      shown, what, e.what()));
    }
  }

  void warn_once(const std::string& line) {
    if (warned) return;
    warned = true;
    warn(one_line(line, 1000));
  }

  // A run continued (resume, same server, run still there) or created, with params and tags.
  void start() {
    if (o.resume && continue_run()) return;
    experiment_id = experiment();
    json tags = json::array();
    json all = o.tags;
    all["mlflow.source.name"] = "lora-train";
    all["mlflow.source.type"] = "LOCAL";
    if (const std::string user = env("USER"); !user.empty()) all["mlflow.user"] = user;
    for (const auto& [k, v] : all.items())
      tags.push_back({{"key", k}, {"value", v.is_string() ? v.get<std::string>() : v.dump()}});
    const json answer = http->call(
        "/api/2.0/mlflow/runs/create",
        {{"experiment_id", experiment_id}, {"run_name", o.run_name}, {"start_time", now_ms()}, {"tags", tags}});
    const json& run_info = answer.at("run").at("info");
    run_id = run_info.at("run_id").get<std::string>();
    artifact_uri = run_info.value("artifact_uri", "");
    remember();
    log_params();
    info(fmt::format("MLflow run {} in experiment '{}': {}/#/experiments/{}/runs/{}", run_id, o.experiment, shown,
                     experiment_id, run_id));
  }

  // The experiment's id by name, created when there is none.
  std::string experiment() {
    const std::string name = o.experiment.empty() ? "Default" : o.experiment;
    const auto by_name = [&]() -> std::optional<json> {
      try {
        return http->call("/api/2.0/mlflow/experiments/get-by-name?experiment_name=" + http->escape_path(name))
            .at("experiment");
      } catch (const Failure& f) {
        if (f.code == "RESOURCE_DOES_NOT_EXIST") return std::nullopt;
        throw;
      }
    };
    std::optional<json> e = by_name();
    if (!e) {
      try {
        return http->call("/api/2.0/mlflow/experiments/create", {{"name", name}})
            .at("experiment_id")
            .get<std::string>();
      } catch (const Failure& f) {
        if (f.code != "RESOURCE_ALREADY_EXISTS") throw;  // made meanwhile by another run
        e = by_name();
        if (!e) throw;
      }
    }
    if (e->value("lifecycle_stage", "active") == "deleted")
      throw std::runtime_error(
          fmt::format("experiment '{}' is deleted: restore it (mlflow experiments restore) or set "
                      "track.mlflow_experiment to another name",
                      name));
    return e->at("experiment_id").get<std::string>();
  }

  // Resuming: the run of o.id_file on this server, RUNNING again; false when there is none to continue.
  bool continue_run() {
    std::ifstream in(o.id_file);
    const json kept = in ? json::parse(in, nullptr, false) : json();
    if (!kept.is_object() || kept.value("tracking_uri", "") != shown || !kept.contains("run_id")) return false;
    json run;
    try {
      run = http->call("/api/2.0/mlflow/runs/get?run_id=" + http->escape_path(kept["run_id"].get<std::string>()))
                .at("run");
    } catch (const Failure& f) {
      if (f.code == "RESOURCE_DOES_NOT_EXIST") return false;
      throw;
    }
    if (run.at("info").value("lifecycle_stage", "active") == "deleted") return false;
    run_id = run["info"].at("run_id").get<std::string>();
    experiment_id = run["info"].value("experiment_id", "");
    // The last step each metric reached (a run's latest metrics are its highest step's): a run
    // resumed after a crash repeats the steps since its last saved state, which MLflow has.
    if (run.contains("data") && run["data"].contains("metrics") && run["data"]["metrics"].is_array())
      for (const json& m : run["data"]["metrics"]) {
        if (!m.contains("key") || !m["key"].is_string() || !m.contains("step")) continue;
        const json& step = m["step"];  // an int64: a number, or a string as protobuf's JSON writes it
        if (step.is_number_integer()) logged[m["key"].get<std::string>()] = step.get<int64_t>();
        if (step.is_string())
          logged[m["key"].get<std::string>()] = std::strtoll(step.get<std::string>().c_str(), nullptr, 10);
      }
    artifact_uri = run["info"].value("artifact_uri", "");
    http->call("/api/2.0/mlflow/runs/update", {{"run_id", run_id}, {"status", "RUNNING"}});
    info(fmt::format("MLflow run {} continued: {}/#/experiments/{}/runs/{}", run_id, shown, experiment_id, run_id));
    return true;
  }

  // o.id_file: which run a resumed training continues.
  void remember() {
    if (o.id_file.empty()) return;
    io::write_file_atomic(o.id_file,
                          json{{"tracking_uri", shown}, {"experiment_id", experiment_id}, {"run_id", run_id}}.dump(1));
  }

  // The recipe's keys as params, 100 a request.
  void log_params() {
    json batch = json::array();
    const auto flush = [&] {
      if (batch.empty()) return;
      http->call("/api/2.0/mlflow/runs/log-batch", {{"run_id", run_id}, {"params", batch}});
      batch = json::array();
    };
    for (const auto& [k, v] : flat_params(o.params)) {
      batch.push_back({{"key", k}, {"value", v}});
      if (batch.size() == kParamsPerBatch) flush();
    }
    flush();
  }

  // Each file under `dir` to <artifact_path>/<its name> through the server's artifact proxy.
  void upload(const std::string& dir, const std::string& artifact_path) {
    const std::string root = proxied_artifact_path(artifact_uri);
    if (root.empty()) {
      warn_once(
          fmt::format("MLflow at {} keeps this run's artifacts at {}, which only a client with access there "
                      "can write: the adapter was not uploaded (start `mlflow server` with --serve-artifacts, "
                      "its default)",
                      shown, artifact_uri));
      return;
    }
    for (const fs::path& rel : files_under(dir))
      http->put_file("/api/2.0/mlflow-artifacts/artifacts/" +
                         http->escape_path(root + "/" + artifact_path + "/" + rel.generic_string()),
                     fs::path(dir) / rel);
  }

  // Queues `job`, or adds its metrics to the last queued one while it holds fewer than a batch.
  void push(Job job) {
    {
      std::lock_guard lock(mutex);
      if (closing) return;
      if (job.kind == Job::Kind::Metrics) {
        if (queued_metrics + job.metrics.size() > kMaxQueuedMetrics) return;
        queued_metrics += job.metrics.size();
        if (!jobs.empty() && jobs.back().kind == Job::Kind::Metrics &&
            jobs.back().metrics.size() + job.metrics.size() <= kMetricsPerBatch) {
          for (json& m : job.metrics) jobs.back().metrics.push_back(std::move(m));
          return;
        }
      }
      jobs.push_back(std::move(job));
    }
    wake.notify_one();
  }

  // The end queued, then the sender drained and joined.
  void close(const std::string& status) {
    if (finished) return;
    finished = true;
    push(Job::end(status));
    {
      std::lock_guard lock(mutex);
      closing = true;
    }
    wake.notify_one();
    if (sender.joinable()) sender.join();
  }
};

MlflowRun::MlflowRun(MlflowOptions options) : impl_(std::make_unique<Impl>(std::move(options))) {}

MlflowRun::~MlflowRun() { impl_->close("FAILED"); }

void MlflowRun::metrics(int64_t step, const json& row, const std::vector<std::string>& keys) {
  Job job;
  const int64_t time = now_ms();
  for (const std::string& key : keys) {
    if (!row.contains(key) || !row[key].is_number()) continue;
    const double value = row[key].get<double>();
    if (!std::isfinite(value)) continue;
    job.metrics.push_back({{"key", key}, {"value", value}, {"timestamp", time}, {"step", step}});
  }
  if (!job.metrics.empty()) impl_->push(std::move(job));
}

void MlflowRun::artifacts(const std::string& dir, const std::string& artifact_path) {
  impl_->push(Job::artifacts(dir, artifact_path));
}

void MlflowRun::finish(const std::string& status) { impl_->close(status); }

}  // namespace lorarun::track
