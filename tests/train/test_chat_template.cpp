// data.chat_format: template end to end: lora-train on the llama fixture with a chat template,
// and the one-line errors of a model without a template and of a template that raises.
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "support/process.hpp"
#include "support/runs.hpp"

using namespace lorarun::test;
namespace fs = std::filesystem;

namespace {

// Turns closed by the EOS token (the fixture's only special token), user and assistant in turn,
// or raise_exception naming the message.
const char* kTemplate = R"({%- for m in messages %}
{%- if (m.role == 'user') != (loop.index0 % 2 == 0) %}
{{- raise_exception('message ' ~ loop.index0 ~ ' is out of turn') }}
{%- endif %}
{{- m.role }}: {{ m.content }}{{ eos_token }}
{% endfor %}
{%- if add_generation_prompt %}assistant: {% endif %}
)";

// Before kTemplate: a loop of 10^10 iterations for the conversation whose first message is "Add 5 and …".
const char* kEndlessOnFive =
    "{% if 'Add 5 and' in messages[0].content %}{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
    "{% endfor %}{% endif %}";

// `n` conversations of two exchanges; document #bad (if any) has two user turns in a row.
void write_chats(const std::string& path, int n, int bad = -1) {
  std::ofstream f(path);
  for (int i = 0; i < n; ++i) {
    nlohmann::json messages = nlohmann::json::array();
    messages.push_back({{"role", "user"}, {"content", fmt::format("Add {} and {}", i, i + 1)}});
    if (i != bad) messages.push_back({{"role", "assistant"}, {"content", std::to_string(2 * i + 1)}});
    messages.push_back({{"role", "user"}, {"content", "And double it?"}});
    messages.push_back({{"role", "assistant"}, {"content", std::to_string(4 * i + 2)}});
    f << nlohmann::json{{"messages", messages}}.dump() << "\n";
  }
}

std::string recipe(const std::string& dir, const std::string& data_extra) {
  const std::string path = dir + "/r.yaml";
  std::ofstream(path) << fmt::format(R"(model: {{path: {}/llama, dtype: fp32, device: cpu}}
lora: {{r: 4, alpha: 8, target_modules: all-linear}}
data: {{source: jsonl, path: {}/data.jsonl, format: chat, chat_format: template, batch_size: 4{}}}
train: {{epochs: 1, lr: 1.0e-3, max_steps_per_epoch: 3}}
checkpoint: {{output_dir: {}/out}}
track: {{mongodb: false}}
)",
                                     LORARUN_MODEL_FIXTURES, dir, data_extra, dir);
  return path;
}

}  // namespace

TEST_CASE("lora-train trains on chat conversations rendered by a chat template", "[e2e]") {
  const std::string dir = temp_dir("chat_template_train");
  write_chats(dir + "/data.jsonl", 16);
  std::ofstream(dir + "/chat.jinja") << kTemplate;
  const Result r = sh(fmt::format("{} {}", bin("lora-train"), recipe(dir, ", chat_template: " + dir + "/chat.jinja")));
  INFO(r.output);
  REQUIRE(r.status == 0);
  CHECK_THAT(r.output, Catch::Contains("done: 3 steps"));
  CHECK(fs::file_size(dir + "/out/epoch_0/adapter_model.safetensors") > 0);

  // lora-data shows what was trained: each assistant reply and the EOS after it, nothing else.
  const Result p = sh(fmt::format("NO_COLOR=1 {} preview 1 {}/r.yaml", bin("lora-data"), dir));
  INFO(p.output);
  CHECK(p.status == 0);
  CHECK_THAT(p.output, Catch::Contains("user: Add 0 and 1<|endoftext|>\nassistant: ⟦1<|endoftext|>") &&
                           Catch::Contains("assistant: ⟦2<|endoftext|>"));
}

TEST_CASE("chat_format template: a model without a chat template is a one-line start-up error", "[e2e]") {
  const std::string dir = temp_dir("chat_template_none");
  write_chats(dir + "/data.jsonl", 4);
  const Result r = sh(fmt::format("{} {}", bin("lora-train"), recipe(dir, "")));
  INFO(r.output);
  CHECK(r.status != 0);
  const auto errors = lines_with(r.output, "error");
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("the model has no chat template") && Catch::Contains("data.chat_template"));
}

TEST_CASE("chat_format template: a template that raises names the document and the template line", "[e2e]") {
  const std::string dir = temp_dir("chat_template_raise");
  write_chats(dir + "/data.jsonl", 8, /*bad=*/5);
  std::ofstream(dir + "/chat.jinja") << kTemplate;
  const Result r = sh(fmt::format("{} {}", bin("lora-train"),
                                  recipe(dir, ", bad_documents: fail, chat_template: " + dir + "/chat.jinja")));
  INFO(r.output);
  CHECK(r.status != 0);
  const auto errors = lines_with(r.output, "error");
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("bad document #5") && Catch::Contains("line 3: message 1 is out of turn"));
}

TEST_CASE("chat_format template: a template that does not compile is one line at start-up, naming the line", "[e2e]") {
  const std::string dir = temp_dir("chat_template_syntax");
  write_chats(dir + "/data.jsonl", 8);
  std::ofstream(dir + "/chat.jinja") << "{% for m in messages %}\n{{ m['content'] }\n{% endfor %}\n";
  const Result r = sh(fmt::format("{} {}", bin("lora-train"), recipe(dir, ", chat_template: " + dir + "/chat.jinja")));
  INFO(r.output);
  CHECK(r.status != 0);
  const auto errors = lines_with(r.output, "error");
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("is not a valid Jinja template: line 2:"));
  CHECK_FALSE(fs::exists(dir + "/out/epoch_0"));
}

TEST_CASE(
    "chat_format template: a render that would run for ever (the highest data.chat_template_fuel) is given up on "
    "SIGTERM: the run stops within seconds with its resumable state, exit 75",
    "[e2e][resume]") {
  const std::string dir = temp_dir("chat_template_stop");
  write_chats(dir + "/data.jsonl", 8);
  std::ofstream(dir + "/one.jinja") << kEndlessOnFive << kTemplate;
  const std::string cmd = fmt::format("{} {} data.chat_template_fuel=9223372036854775807", bin("lora-train"),
                                      recipe(dir, ", chat_template: " + dir + "/one.jinja"));
  const Stopped stopped = sigterm_after(cmd, dir + "/run.log", "trainable params", 2);
  const std::string log = read_file(dir + "/run.log");
  INFO(log);
  CHECK(stopped.status == 75);
  CHECK(stopped.ms < 5000);
  fmt::print("chat template: SIGTERM during an endless render: lora-train ended {} ms after the signal\n", stopped.ms);
  CHECK_THAT(log, Catch::Contains("stopped while the chat template rendered a document"));
  CHECK(fs::exists(dir + "/out/resume_state/state.json"));
}

TEST_CASE(
    "chat_format template: a template that loops without end stops at its fuel: at start-up in one line naming "
    "data.chat_template_fuel, and on one document in one line naming the document, deaf to nothing",
    "[e2e]") {
  const std::string dir = temp_dir("chat_template_fuel");
  write_chats(dir + "/data.jsonl", 8);
  // Slow for every conversation (the start-up probe too)...
  std::ofstream(dir + "/always.jinja") << "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}"
                                          "{% endfor %}"
                                       << kTemplate;
  const Result r =
      sh(fmt::format("{} {}", bin("lora-train"), recipe(dir, ", chat_template: " + dir + "/always.jinja")));
  INFO(r.output);
  CHECK(r.status != 0);
  CHECK(r.seconds < 30);
  const auto errors = lines_with(r.output, "error");
  REQUIRE(errors.size() == 1);
  CHECK_THAT(errors[0], Catch::Contains("spent all of data.chat_template_fuel (10000000)"));
  // ...or only for the one conversation whose first message says so.
  std::ofstream(dir + "/one.jinja") << kEndlessOnFive << kTemplate;
  const Result one = sh(fmt::format("{} {}", bin("lora-train"),
                                    recipe(dir, ", bad_documents: fail, chat_template: " + dir + "/one.jinja")));
  INFO(one.output);
  CHECK(one.status != 0);
  CHECK(one.seconds < 30);
  const auto lines = lines_with(one.output, "error");
  REQUIRE(lines.size() == 1);
  CHECK_THAT(lines[0], Catch::Contains("bad document #5") && Catch::Contains("spent all of data.chat_template_fuel"));
  // A lower budget for a template known to be heavy is the recipe's to set; skipped, the document is one warning.
  const Result skipped = sh(fmt::format("{} {} data.chat_template_fuel=2000000 data.max_skipped_share=0.2",
                                        bin("lora-train"), recipe(dir, ", chat_template: " + dir + "/one.jinja")));
  INFO(skipped.output);
  CHECK(skipped.status == 0);
  CHECK(
      lines_with(skipped.output, "warning: rank 0: skipping document #5: rendering it with the chat template").size() ==
      1);
}
