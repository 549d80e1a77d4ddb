// The key declarations and what documents them: docs/recipe.md (its key tables are made from the
// declarations), the reference recipe configs/opt-125m-alpaca.yaml, README.md and the manual in docs/.
#include <catch2/catch.hpp>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "recipe/recipe.hpp"
#include "recipe/schema.hpp"
#include "util/error.hpp"

namespace fs = std::filesystem;
using namespace lorarun::recipe;

namespace {

const std::string kBegin = "<!-- BEGIN KEY TABLES";
const std::string kEnd = "<!-- END KEY TABLES -->";

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  REQUIRE(in);
  std::ostringstream text;
  text << in.rdbuf();
  return text.str();
}

fs::path source(const std::string& relative) { return fs::path(LORARUN_SOURCE_DIR) / relative; }

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) lines.push_back(line);
  return lines;
}

// The dotted names `section.key` a text mentions, for every section name; a name inside a longer
// word or path (data/train.jsonl, base_model.model) is not one.
std::set<std::string> dotted_names(const std::string& text) {
  static const std::regex name(
      R"((^|[^A-Za-z0-9_./-])(model|lora|data|train|checkpoint|dist|track)\.([A-Za-z_][A-Za-z0-9_]*))");
  std::set<std::string> found;
  for (auto it = std::sregex_iterator(text.begin(), text.end(), name); it != std::sregex_iterator(); ++it)
    found.insert((*it)[2].str() + "." + (*it)[3].str());
  return found;
}

}  // namespace

TEST_CASE("docs/recipe.md: its key tables are the declarations") {
  const fs::path doc = source("docs/recipe.md");
  std::string text = read_text(doc);
  const size_t begin = text.find(kBegin);
  REQUIRE(begin != std::string::npos);
  const size_t body = text.find("-->\n", begin);
  REQUIRE(body != std::string::npos);
  const size_t start = body + 4, end = text.find(kEnd, start);
  REQUIRE(end != std::string::npos);
  const std::string written = text.substr(start, end - start), made = reference_tables();
  if (written != made && std::getenv("LORARUN_UPDATE_RECIPE_DOC")) {
    text.replace(start, end - start, made);
    std::ofstream(doc) << text;
    WARN("rewrote the key tables of " + doc.string());
    return;
  }
  const std::vector<std::string> have = lines_of(written), want = lines_of(made);
  for (size_t i = 0; i < std::max(have.size(), want.size()); ++i) {
    INFO("line " << i + 1
                 << " of the key tables; after changing lib/recipe/schema.hpp run "
                    "LORARUN_UPDATE_RECIPE_DOC=1 build/bin/recipe_tests \"docs/recipe.md*\"");
    REQUIRE((i < have.size() ? have[i] : "(none)") == (i < want.size() ? want[i] : "(none)"));
  }
  CHECK(written == made);
}

TEST_CASE("docs/recipe.md: every key, with its default") {
  const std::vector<std::string> doc = lines_of(read_text(source("docs/recipe.md")));
  const Recipe defaults;
  size_t keys = 0;
  detail::for_each_key(defaults, [&](const detail::Key& k, const auto& value) {
    ++keys;
    const std::string row = "| `" + std::string(k.name) + "` |";
    const std::string default_cell = "| `" + detail::yaml_text(value) + "` |";
    INFO(k.name << " with default " << default_cell);
    size_t rows = 0;
    for (const std::string& line : doc)
      if (line.starts_with(row)) {
        ++rows;
        CHECK(line.find(default_cell) != std::string::npos);
      }
    CHECK(rows == 1);
  });
  CHECK(keys == known_keys().size());
}

TEST_CASE("README.md, docs/ and configs/ name no key that does not exist") {
  const std::vector<std::string> keys = known_keys();
  std::vector<fs::path> files{source("README.md")};
  for (const char* dir : {"docs", "configs"})
    for (const auto& entry : fs::directory_iterator(source(dir))) files.push_back(entry.path());
  CHECK(files.size() > 10);  // the manual's pages and the recipes are all read
  for (const fs::path& file : files) {
    for (const std::string& name : dotted_names(read_text(file))) {
      INFO(file.string() << " names " << name);
      CHECK(std::find(keys.begin(), keys.end(), name) != keys.end());
    }
  }
  // The scan itself: what it finds and what it leaves.
  CHECK(dotted_names("`train.lr`, data.filter.split=x, data/train.jsonl, base_model.model.x, lora.rank") ==
        std::set<std::string>{"train.lr", "data.filter", "lora.rank"});
}

TEST_CASE("every key is declared in full") {
  const std::string base =
      "model: {path: /models/m}\n"
      "data: {database: db, collection: docs, prompt_template: \"Q: {instruction}\\nA: \"}\n";
  const Recipe defaults;
  std::set<std::string> names;
  detail::for_each_key(defaults, [&](const detail::Key& k, const auto& value) {
    using T = std::decay_t<decltype(value)>;
    INFO(k.name);
    CHECK(names.insert(std::string(k.name)).second);
    CHECK(detail::is_section(detail::section_of(k.name)));
    // A meaning of one table cell: one line, no '|', short enough to read in a row.
    CHECK(!k.meaning.empty());
    CHECK(k.meaning.find_first_of("|\n") == std::string_view::npos);
    CHECK(k.meaning.size() <= 130);
    // What null does is said exactly for the nullable keys; bounds are for numbers, "required"
    // for text.
    CHECK(k.null_means.empty() == !detail::IsOptional<T>::value);
    if (k.bound.kind != detail::Bound::Kind::None) {
      if constexpr (detail::IsOptional<T>::value) {
        CHECK((std::is_arithmetic_v<typename T::value_type> && !std::is_same_v<typename T::value_type, bool>));
      } else {
        CHECK((std::is_arithmetic_v<T> && !std::is_same_v<T, bool>));
      }
    }
    if (!k.required.empty()) CHECK(std::is_same_v<T, std::string>);
    // The example a message gives loads.
    const std::string example = detail::example(k.name);
    CHECK(!example.empty());
    std::vector<std::string> overrides{std::string(k.name) + "=" + example};
    if (k.name == "train.early_stopping_patience") overrides.push_back("eval.fraction=0.05");  // steers by one
    if (k.name == "data.sources") overrides.push_back("data.collection=");  // each source names its own
    if (detail::section_of(k.name) == "preference") {  // (keys of the preference objectives: dpo's, simpo's, kto's)
      const bool simpo = k.name == "preference.cpo_alpha" || k.name == "preference.simpo_gamma";
      const bool kto = k.name == "preference.desirable_weight" || k.name == "preference.undesirable_weight";
      overrides.push_back(simpo ? "train.objective=simpo" : kto ? "train.objective=kto" : "train.objective=dpo");
      overrides.push_back(kto ? "data.format=unpaired" : "data.format=preference");
    }
    if (detail::section_of(k.name) == "grpo") {  // (keys of train.objective: grpo, which needs a reward)
      overrides.insert(overrides.end(), {"train.objective=grpo", "data.format=prompt"});
      if (k.name != "grpo.rewards") overrides.push_back("grpo.rewards=[{name: a, kind: exact, field: answer}]");
    }
    CHECK_NOTHROW(recipe_from_yaml(YAML::Load(base), overrides));
    // The default is within the bound (keys that must be set have none to check).
    if (k.required.empty()) CHECK_NOTHROW(detail::check_declared(k, value, RecipeOrigin{}));
  });
  for (const std::string_view key : detail::rule_keys()) {
    INFO("a rule of validate.cpp is attached to " << key);
    CHECK(names.count(std::string(key)) == 1);
  }
}

TEST_CASE("the keys added after the first contract have their defaults") {
  const Recipe r =
      recipe_from_yaml(YAML::Load("model: {path: /m}\ndata: {database: d, collection: c, "
                                  "prompt_template: x}\n"));
  CHECK(r.lora.init_from.empty());
  CHECK_FALSE(r.data.group_by_length);
  CHECK(r.data.group_window == 64);
  CHECK(r.data.timeout_s == 20);
  CHECK_FALSE(r.checkpoint.overwrite);
  CHECK(r.dist.bucket_mb == 25.0);
  CHECK_FALSE(r.dist.debug_checksum_every_n_steps);
  CHECK_FALSE(r.track.tensorboard);
  // data.timeout_s is checked like dist.timeout_s, and apart from it.
  CHECK_THROWS_WITH(recipe_from_yaml(YAML::Load("model: {path: /m}\ndata: {database: d, collection: c, "
                                                "prompt_template: x, timeout_s: 0}\n")),
                    "recipe.yaml: data.timeout_s must be at least 1, got 0 (e.g. data.timeout_s: 20)");
  CHECK(recipe_from_yaml(YAML::Load("model: {path: /m}\ndata: {database: d, collection: c, prompt_template: x}\n"),
                         {"data.timeout_s=5", "checkpoint.overwrite=true"})
            .data.timeout_s == 5);
}

// The reference recipe lists every key. Those a recipe must set (model.path, and for its MongoDB
// instruction documents data.database, data.collection, data.prompt_template) hold example
// values; every other key holds its declared default, which its header comment promises.
TEST_CASE("configs/opt-125m-alpaca.yaml: every key, each with its default") {
  unsetenv("LORARUN_MONGODB_URI");
  const std::string path = source("configs/opt-125m-alpaca.yaml").string();
  const std::vector<std::string> examples{"model.path", "data.database", "data.collection", "data.prompt_template"};
  const YAML::Node tree = YAML::LoadFile(path);
  const Recipe reference = load_recipe(path);

  // The same file with only the example keys: every other key at its default, resolved alike
  // (checkpoint.output_dir from the file name, track.database from data.database).
  YAML::Node minimal(YAML::NodeType::Map);
  for (const std::string& key : examples) {
    const std::string section = detail::section_of(key), leaf = detail::leaf_of(key);
    REQUIRE(tree[section][leaf].IsDefined());
    minimal[section][leaf] = YAML::Clone(tree[section][leaf]);
  }
  const Recipe defaults = recipe_from_yaml(minimal, {}, path);

  size_t listed = 0;
  detail::for_each_key(std::as_const(reference), [&](std::string_view key, const auto& value) {
    INFO(key);
    const std::string section = detail::section_of(key), leaf = detail::leaf_of(key);
    CHECK(tree[section][leaf].IsDefined());
    listed += tree[section][leaf].IsDefined() ? 1 : 0;
    std::string expected;
    detail::for_each_key(defaults, [&](std::string_view k, const auto& v) {
      if (k == key) expected = detail::yaml_text(v);
    });
    CHECK(detail::yaml_text(value) == expected);
  });
  CHECK(listed == known_keys().size());
  CHECK(reference == defaults);
  // Text keys whose default is filled in at load time are written as declared: empty.
  CHECK(tree["checkpoint"]["output_dir"].Scalar().empty());
  CHECK(tree["track"]["database"].Scalar().empty());
  CHECK(tree["data"]["uri"].Scalar().empty());
}
