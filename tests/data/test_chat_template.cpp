// The chat template engine (lib/chat): what transformers' Jinja environment provides, on small
// templates. Parity with transformers on whole conversations is chat_template_check.py's.
#include <atomic>
#include <catch2/catch.hpp>
#include <chrono>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>

#include "chat/chat_template.hpp"

using lorarun::chat::render;
using lorarun::chat::Rendered;
using nlohmann::ordered_json;

namespace {

std::string text(const std::string& tmpl, const ordered_json& ctx = ordered_json::object()) {
  const auto r = render(tmpl, ctx);
  if (const auto* e = std::get_if<std::string>(&r)) FAIL("render failed: " << *e);
  return std::get<Rendered>(r).text;
}

std::string error(const std::string& tmpl, const ordered_json& ctx = ordered_json::object()) {
  const auto r = render(tmpl, ctx);
  if (std::holds_alternative<Rendered>(r)) FAIL("rendered: " << std::get<Rendered>(r).text);
  return std::get<std::string>(r);
}

}  // namespace

TEST_CASE("chat templates: trim_blocks, lstrip_blocks and no trailing newline, as transformers sets them") {
  CHECK(text("{% if true %}\n  x\n  {% endif %}\ny\n") == "  x\ny");
  CHECK(text("a\n{%+ if true %}b{% endif %}") == "a\nb");
}

TEST_CASE("chat templates: raise_exception and syntax errors give one line with the template line") {
  CHECK(error("a\nb\n{{ raise_exception('roles must alternate') }}") == "line 3: roles must alternate");
  const std::string e = error("ok\n{% if %}");
  CHECK_THAT(e, Catch::StartsWith("line 2: "));
  CHECK(e.find('\n') == std::string::npos);
}

TEST_CASE("chat templates: generation tags with each whitespace control become spans") {
  const auto r = render("A{%- generation -%} B {%- endgeneration -%} C{% generation %}D{% endgeneration %}",
                        ordered_json::object());
  REQUIRE(std::holds_alternative<Rendered>(r));
  const Rendered& g = std::get<Rendered>(r);
  CHECK(g.text == "ABCD");
  CHECK(g.generation == std::vector<std::pair<size_t, size_t>>{{1, 2}, {3, 4}});
  CHECK(lorarun::chat::has_generation_tags("x{%- generation %}y{% endgeneration %}"));
  CHECK_FALSE(lorarun::chat::has_generation_tags("{{ generation }}"));
}

TEST_CASE("chat templates: tojson writes what Python's json.dumps writes (keys in order, no ASCII escapes)") {
  const ordered_json ctx = {{"d", {{"b", 1}, {"a", {1, 2.5, "é\n\"<>"}}, {"c", nullptr}, {"e", true}}}};
  CHECK(text("{{ d | tojson }}", ctx) == R"({"b": 1, "a": [1, 2.5, "é\n\"<>"], "c": null, "e": true})");
  CHECK(text("{{ d.a | tojson(indent=2) }}", ctx) == "[\n  1,\n  2.5,\n  \"é\\n\\\"<>\"\n]");
  CHECK(text("{{ {} | tojson }}{{ [] | tojson(indent=4) }}") == "{}[]");
}

TEST_CASE("chat templates: Python string and dict methods, namespace, loop controls, strftime_now") {
  const ordered_json ctx = {{"d", {{"k", "v"}, {"j", "w"}}}};
  // Jinja2 prints Python's True.
  CHECK(text("{{ ' x '.strip() }}|{{ 'a</think>b'.split('</think>')[-1] }}|{{ 'abc'.startswith('ab') }}", ctx) ==
        "x|b|True");
  CHECK(text("{% for k, v in d.items() %}{{ k }}={{ v }};{% endfor %}{{ d.get('z', 'none') }}", ctx) == "k=v;j=w;none");
  CHECK(text("{% set ns = namespace(n=0) %}{% for i in range(10) %}{% if i == 2 %}{% continue %}{% endif %}"
             "{% if i > 4 %}{% break %}{% endif %}{% set ns.n = ns.n + i %}{% endfor %}{{ ns.n }}") == "8");
  CHECK(text("{{ strftime_now('%Y') | length }}") == "4");
}

TEST_CASE("chat templates: a render spends at most its fuel, and stops in well under a second when it runs out") {
  using Clock = std::chrono::steady_clock;
  const auto spent = [](const std::string& tmpl) {
    const auto t0 = Clock::now();
    const auto r = render(tmpl, ordered_json::object());
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    CHECK(s < 1.0);
    return std::holds_alternative<std::string>(r) && std::get<std::string>(r) == lorarun::chat::kFuelSpent;
  };
  CHECK(spent("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"));
  CHECK(spent("{{ 'x' * 1000000000 }}"));                                       // memory, not time
  CHECK(spent("{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}") == false);  // recursion: its own limit
  CHECK_FALSE(spent("{% for i in range(1000) %}{{ i }}{% endfor %}"));
}

TEST_CASE(
    "chat templates: with a stop flag, a render past the quick try's fuel finishes as without one, and one "
    "that would run for ever is given up within 50 ms of the stop") {
  using Clock = std::chrono::steady_clock;
  const std::string heavy = "{% for i in range(3000) %}{% for j in range(1000) %}{% endfor %}{% endfor %}done";
  auto t = lorarun::chat::Template::compile(heavy, 0);
  REQUIRE(std::holds_alternative<lorarun::chat::Template>(t));
  std::atomic<bool> stop{false};
  const auto r = std::get<lorarun::chat::Template>(t).render(ordered_json::object(), &stop);
  REQUIRE(std::holds_alternative<lorarun::chat::Rendered>(r));
  CHECK(std::get<lorarun::chat::Rendered>(r).text == "done");
  auto endless = lorarun::chat::Template::compile(
      "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", 0);
  REQUIRE(std::holds_alternative<lorarun::chat::Template>(endless));
  std::thread stopper([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(300));
    stop = true;
  });
  const auto t0 = Clock::now();
  const auto given_up = std::get<lorarun::chat::Template>(endless).render(ordered_json::object(), &stop);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  stopper.join();
  REQUIRE(std::holds_alternative<std::string>(given_up));
  CHECK(std::get<std::string>(given_up) == lorarun::chat::kRenderStopped);
  CHECK(s < 0.3 + 0.2);
}

TEST_CASE("chat templates: a real template on a long conversation with tools needs under 1% of the default fuel") {
  const std::string tok = std::string(LORARUN_TOKENIZER_FIXTURES) + "/qwen3/tokenizer_config.json";
  std::ifstream in(tok);
  REQUIRE(in);
  const std::string tmpl = nlohmann::json::parse(in)["chat_template"].get<std::string>();
  ordered_json messages = ordered_json::array();
  messages.push_back({{"role", "system"}, {"content", std::string(2000, 's')}});
  for (int i = 0; i < 20; ++i) {
    messages.push_back({{"role", "user"}, {"content", "question " + std::string(400, 'q')}});
    messages.push_back({{"role", "assistant"}, {"content", "<think>x</think>answer " + std::string(400, 'a')}});
  }
  const ordered_json tools = ordered_json::array(
      {{{"type", "function"},
        {"function", {{"name", "lookup"}, {"description", "find a record"}, {"parameters", {{"type", "object"}}}}}}});
  const ordered_json ctx = {{"messages", messages}, {"tools", tools}, {"add_generation_prompt", false}};
  const auto t = lorarun::chat::Template::compile(tmpl, lorarun::chat::kDefaultFuel / 100);
  REQUIRE(std::holds_alternative<lorarun::chat::Template>(t));
  const auto r = std::get<lorarun::chat::Template>(t).render(ctx);
  if (const auto* e = std::get_if<std::string>(&r)) FAIL(*e);
  CHECK(std::get<Rendered>(r).text.size() > 18000);
}
