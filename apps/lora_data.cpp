// lora-data: dataset tools. Subcommands: tokenize, detokenize (more can be added beside them).
//
// Line protocol (one record per line, so any text survives, newlines and CR included):
//   tokenize   in: a JSON string literal per line ("Hello\nworld"), or with --raw each line
//              itself as plain text (without its \n)
//              out: a JSON array of token ids per line ([9906,198,14957])
//   detokenize in: a JSON array of ids per line; out: a JSON string literal per line
#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdlib>
#include <fmt/format.h>
#include <fstream>

#include <cstdio>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>

#include "app_main.hpp"
#include "data/mongo.hpp"
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

struct ImportArgs {
  std::string file, uri, db, collection;
  bool drop = false;
};

// JSONL file -> MongoDB collection, in batches.
void import_jsonl(const ImportArgs& a) {
  const char* env = std::getenv("LORARUN_MONGODB_URI");
  const std::string uri = !a.uri.empty() ? a.uri : env ? env : "";
  if (uri.empty()) throw Error("no MongoDB URI: give --uri or set LORARUN_MONGODB_URI");
  std::ifstream in(a.file);
  if (!in) throw Error(fmt::format("cannot read {}", a.file));
  std::vector<json> docs;
  std::string line;
  for (size_t n = 1; std::getline(in, line); ++n) {
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, false);
    if (!j.is_object()) throw Error(fmt::format("{}:{}: not a JSON object", a.file, n));
    docs.push_back(std::move(j));
  }
  const auto t0 = std::chrono::steady_clock::now();
  lorarun::data::Client client(uri, std::chrono::milliseconds(10000));
  if (a.drop) client.drop(a.db, a.collection);
  const int64_t n = client.insert_many(a.db, a.collection, docs);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("imported {} documents into {}.{} in {:.2f} s ({:.0f} docs/s)\n", n, a.db, a.collection, s, n / std::max(s, 1e-9));
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

  ImportArgs im;
  auto* imp = app.add_subcommand("import", "load a JSONL file (one document per line) into a MongoDB collection");
  imp->add_option("file", im.file, "JSONL file")->required();
  imp->add_option("--uri", im.uri, "MongoDB URI (default: $LORARUN_MONGODB_URI)");
  imp->add_option("--db", im.db, "database")->required();
  imp->add_option("--collection", im.collection, "collection")->required();
  imp->add_flag("--drop", im.drop, "drop the collection first");
  imp->callback([&] { import_jsonl(im); });

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
  return lorarun::app_main("lora-data", argc, argv, run);
}
