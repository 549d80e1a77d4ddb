// lora-data: dataset tools. Subcommands: tokenize, detokenize (more can be added beside them).
//
// Line protocol (one record per line, so any text survives, newlines and CR included):
//   tokenize   in: a JSON string literal per line ("Hello\nworld"), or with --raw each line
//              itself as plain text (without its \n)
//              out: a JSON array of token ids per line ([9906,198,14957])
//   detokenize in: a JSON array of ids per line; out: a JSON string literal per line
#include <CLI/CLI.hpp>
#include <fmt/format.h>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "tokenizer/tokenizer.hpp"
#include "util/error.hpp"

namespace {

using lorarun::Error;
using nlohmann::json;

struct TokenizeArgs {
  std::string model;
  bool no_special = false;
  bool raw = false;
};

struct DetokenizeArgs {
  std::string model;
  bool skip_special = false;
};

std::string ids_json(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) fmt::format_to(std::back_inserter(out), "{}{}", i ? "," : "", ids[i]);
  out += "]\n";
  return out;
}

void tokenize(const TokenizeArgs& a) {
  auto tok = lorarun::tok::Tokenizer::from_dir(a.model);
  std::string line;
  for (size_t n = 1; std::getline(std::cin, line); ++n) {
    std::string text;
    if (a.raw) {
      text = std::move(line);
    } else {
      json j = json::parse(line, nullptr, false);
      if (!j.is_string())
        throw Error(fmt::format("stdin line {}: not a JSON string literal (quote it, or pass --raw "
                                "for plain text lines)", n));
      text = j.get<std::string>();
    }
    std::string out = ids_json(tok.encode(text, !a.no_special));
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
}

void detokenize(const DetokenizeArgs& a) {
  auto tok = lorarun::tok::Tokenizer::from_dir(a.model);
  std::string line;
  for (size_t n = 1; std::getline(std::cin, line); ++n) {
    json j = json::parse(line, nullptr, false);
    std::vector<int32_t> ids;
    bool ok = j.is_array();
    for (const json& v : ok ? j : json::array()) {
      ok = ok && v.is_number_integer();
      if (ok) ids.push_back(v.get<int32_t>());
    }
    if (!ok) throw Error(fmt::format("stdin line {}: not a JSON array of integer ids", n));
    std::string out = json(tok.decode(ids, a.skip_special)).dump() + "\n";
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
}

int run(int argc, char** argv) {
  CLI::App app{"lora-data: dataset tools"};
  app.require_subcommand(1);

  TokenizeArgs t;
  auto* tok = app.add_subcommand("tokenize", "JSON string lines (or --raw text lines) on stdin to JSON id arrays on stdout");
  tok->add_option("--model", t.model, "model directory with tokenizer.json")->required();
  tok->add_flag("--no-special", t.no_special, "do not add the post-processor's special tokens");
  tok->add_flag("--raw", t.raw, "input lines are plain text, not JSON string literals");
  tok->callback([&] { tokenize(t); });

  DetokenizeArgs d;
  auto* detok = app.add_subcommand("detokenize", "JSON id arrays on stdin to JSON string lines on stdout");
  detok->add_option("--model", d.model, "model directory with tokenizer.json")->required();
  detok->add_flag("--skip-special", d.skip_special, "leave special tokens out of the text");
  detok->callback([&] { detokenize(d); });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::ios::sync_with_stdio(false);
  try {
    return run(argc, argv);
  } catch (const lorarun::Error& e) {
    fmt::print(stderr, "lora-data: error: {}\n", e.what());
  } catch (const std::exception& e) {
    fmt::print(stderr, "lora-data: internal error: {}\n", e.what());
  }
  return 1;
}
