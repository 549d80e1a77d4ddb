// lora-data: dataset tools.
//   tokenize, detokenize      text <-> token ids under a model's tokenizer (line protocol below)
//   stats RECIPE [k=v…]       what training would see: counts, bad documents, token lengths
//   preview N RECIPE [k=v…]   the first N documents as training sees them, trained part marked
//   import FILE.jsonl         a JSONL file into a MongoDB collection, 1,000 documents per insert
//   plot OUTPUT_DIR           a run's train and eval loss (or --metric KEY) by step (metrics.jsonl) as an SVG
//
// Line protocol (one record per line, so any text survives, newlines and CR included):
//   tokenize   in: a JSON string literal per line ("Hello\nworld"), or with --raw each line
//              itself as plain text (without its \n)
//              out: a JSON array of token ids per line ([9906,198,14957])
//   detokenize in: a JSON array of ids per line; out: a JSON string literal per line
//
// Positions (#N) are 0-based: _id order for MongoDB, order of the non-blank lines for JSONL —
// the positions training shards and `preview --json` reports.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <limits>
#include <map>
#include <nlohmann/json.hpp>
#include <span>
#include <string>

#include "app_main.hpp"
#include "data/mixture.hpp"
#include "data/mongo.hpp"
#include "data/source.hpp"
#include "model/lora.hpp"
#include "model/resolve.hpp"
#include "recipe/recipe.hpp"
#include "tokenizer/tokenizer.hpp"
#include "track/plot.hpp"
#include "train/job.hpp"
#include "util/error.hpp"
#include "util/secrets.hpp"
#include "util/untrusted.hpp"

namespace {

namespace data = lorarun::data;
namespace recipe = lorarun::recipe;
namespace tok = lorarun::tok;
using lorarun::Error;
using lorarun::one_line;
using lorarun::printable;
using lorarun::terminal_text;
using nlohmann::json;

// import's server selection / connect timeout (data.timeout_s's default) unless the URI sets its own.
const std::chrono::seconds kImportTimeout{recipe::DataSection{}.timeout_s};

std::string ids_json(const std::vector<int32_t>& ids) {
  std::string out = "[";
  for (size_t i = 0; i < ids.size(); ++i) fmt::format_to(std::back_inserter(out), "{}{}", i ? "," : "", ids[i]);
  out += "]\n";
  return out;
}

// ---- tokenize / detokenize ----------------------------------------------------------------

struct TokenizeArgs {
  std::string model;
  bool no_special = false;
  bool raw = false;
};

struct DetokenizeArgs {
  std::string model;
  bool skip_special = false;
};

void tokenize(const TokenizeArgs& a) {
  auto tok = lorarun::model::load_tokenizer(a.model);
  std::string line;
  for (size_t n = 1; std::getline(std::cin, line); ++n) {
    std::string text;
    if (a.raw) {
      text = std::move(line);
    } else {
      json j = json::parse(line, nullptr, false);
      if (!j.is_string())
        throw Error(
            fmt::format("stdin line {}: not a JSON string literal (quote it, or pass --raw "
                        "for plain text lines)",
                        n));
      text = j.get<std::string>();
    }
    std::string out = ids_json(tok.encode(text, !a.no_special));
    std::fwrite(out.data(), 1, out.size(), stdout);
  }
}

void detokenize(const DetokenizeArgs& a) {
  auto tok = lorarun::model::load_tokenizer(a.model);
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

// ---- a recipe's data, built as training builds it -----------------------------------------

struct RecipeArgs {
  std::string recipe;
  std::vector<std::string> overrides;
  std::string split = "train";  // or "eval": the recipe's eval: section
  bool as_json = false;
  std::string job_adapter;  // a job of many adapters: the one whose documents to look at
};

// The recipe as its data is looked at: a job's narrowed to --job-adapter's documents.
recipe::Recipe read_recipe(const RecipeArgs& a) {
  return lorarun::train::one_adapter(recipe::load_recipe(a.recipe, a.overrides), a.job_adapter, a.recipe);
}

// The split's documents: the recipe's eval split (checked against the training selection, as
// training checks it), or without one an error naming the keys.
std::optional<data::EvalSplit> eval_split(const RecipeArgs& a, const recipe::Recipe& r, const data::Documents& train) {
  if (a.split != "eval") return std::nullopt;
  if (!r.eval.enabled(r.data.source))
    throw Error(fmt::format("{} has no eval: split: set eval.fraction or {} (e.g. as an override)", a.recipe,
                            r.data.source == recipe::Source::MongoDB ? "eval.filter / eval.collection" : "eval.path"));
  return std::optional<data::EvalSplit>(std::in_place, r, &train);
}

// A recipe, its model's tokenizer and the selected documents of the split: those training reads
// (eval.fraction's held-out ones left out) or the eval split. Not movable: docs refer to recipe.
struct Dataset {
  explicit Dataset(const RecipeArgs& a)
      : recipe(read_recipe(a)),
        tokenizer(lorarun::model::load_tokenizer(recipe.model.path)),
        train(recipe.data, data::Holdout::training(recipe.eval.fraction)),
        eval(eval_split(a, recipe, train)),
        docs(eval ? eval->docs() : train) {}
  Dataset(const Dataset&) = delete;
  const recipe::Recipe recipe;
  const tok::Tokenizer tokenizer;
  const data::Documents train;
  const std::optional<data::EvalSplit> eval;
  const data::Documents& docs;
};

// What the trainer's builder makes of `doc`; a line that is not a JSON object says so.
data::Built build(const data::ExampleBuilder& b, const data::Found& found, recipe::Source source) {
  const data::Document& doc = found.doc;
  if (!found.invalid_utf8.empty())
    return data::Rejection{data::Rejection::BadDocument, data::invalid_utf8_reason(found.invalid_utf8)};
  if (doc.is_object()) return b.build(doc);
  const char* why = doc.is_discarded()                                   ? "not valid JSON"
                    : doc.is_null() && source == recipe::Source::MongoDB ? "no longer in the collection"
                                                                         : "not a JSON object";
  return data::Rejection{data::Rejection::BadDocument, why};
}

// Calls f(position, found) for positions [0, n) in order, fetching 1,024 at a time and only the
// fields training fetches (what is not fetched cannot make a document bad).
template <class F>
void for_each_document(const Dataset& d, int64_t n, F f) {
  constexpr int64_t kChunk = 1024;
  const std::vector<std::string> fields = data::ExampleBuilder::fields_of(d.recipe.data);
  for (int64_t start = 0; start < n; start += kChunk) {
    std::vector<int64_t> positions;
    for (int64_t p = start; p < std::min(n, start + kChunk); ++p) positions.push_back(p);
    const std::vector<data::Found> docs = d.docs.fetch_found(positions, fields);
    for (size_t i = 0; i < docs.size(); ++i) f(positions[i], docs[i]);
  }
}

// "#12", or "#12 (_id 65f0…)" when the document has an _id.
std::string where(int64_t position, const data::Found& found) {
  const data::Document& doc = found.doc;
  if (!doc.is_object() || !doc.contains("_id")) {
    if (found.id.empty() || found.id[0] == '#') return fmt::format("#{}", position);
    return fmt::format("#{} (_id {})", position, printable(data::relaxed_id(found.id)));  // not JSON (not UTF-8)
  }
  const json& id = doc["_id"];
  const std::string text = id.is_object() && id.contains("$oid") ? id["$oid"].get<std::string>() : id.dump();
  return fmt::format("#{} (_id {})", position, printable(text));
}

int64_t labelled_tokens(const data::Example& e) {
  return std::count_if(e.labels.begin(), e.labels.end(), [](int32_t l) { return l != data::kIgnoreIndex; });
}

// ---- stats --------------------------------------------------------------------------------

struct Stats {
  struct Bad {
    int64_t count = 0;
    std::vector<std::string> first;  // where the first few are
  };
  int64_t documents = 0, examples = 0, overlong = 0, trained = 0;
  std::vector<int64_t> lengths;    // untruncated example lengths (overlong ones included)
  std::map<std::string, Bad> bad;  // by reason

  void reject(const std::string& reason, int64_t position, const data::Found& doc) {
    Bad& b = bad[reason];
    if (++b.count <= 5) b.first.push_back(where(position, doc));
  }
  int64_t bad_total() const {
    int64_t n = 0;
    for (const auto& [reason, b] : bad) n += b.count;
    return n;
  }
};

// Builds every document twice over at most: untruncated for its length, then as training does
// when it is longer than data.max_length (shorter ones come out the same either way).
Stats collect(const Dataset& d) {
  recipe::DataSection wide = d.recipe.data;
  wide.max_length = std::numeric_limits<int>::max();
  const data::ExampleBuilder untruncated(wide, d.tokenizer), builder(d.recipe.data, d.tokenizer);
  Stats s;
  s.documents = d.docs.size();
  for_each_document(d, s.documents, [&](int64_t position, const data::Found& doc) {
    data::Built built = build(untruncated, doc, d.recipe.data.source);
    if (auto* r = std::get_if<data::Rejection>(&built)) return s.reject(r->reason, position, doc);
    const auto length = static_cast<int64_t>(std::get<data::Example>(built).ids.size());
    s.lengths.push_back(length);
    if (length > d.recipe.data.max_length) {
      ++s.overlong;
      built = build(builder, doc, d.recipe.data.source);
    }
    if (auto* e = std::get_if<data::Example>(&built)) {
      ++s.examples;
      s.trained += labelled_tokens(*e);
    } else if (const auto& r = std::get<data::Rejection>(built); r.kind == data::Rejection::BadDocument) {
      s.reject(r.reason, position, doc);  // e.g. nothing left to train on after truncation
    }
  });
  std::sort(s.lengths.begin(), s.lengths.end());
  return s;
}

// Nearest-rank percentile of sorted values: the smallest value with at least p% at or below it.
int64_t percentile(const std::vector<int64_t>& sorted, int p) {
  const auto n = static_cast<int64_t>(sorted.size());
  return sorted[static_cast<size_t>(std::max<int64_t>((p * n + 99) / 100 - 1, 0))];
}

nlohmann::ordered_json stats_json(const Dataset& d, const Stats& s) {
  nlohmann::ordered_json bad = nlohmann::ordered_json::array();
  for (const auto& [reason, b] : s.bad) bad.push_back({{"reason", reason}, {"count", b.count}, {"first", b.first}});
  nlohmann::ordered_json lengths = nullptr;
  if (!s.lengths.empty())
    lengths = {{"p50", percentile(s.lengths, 50)},
               {"p90", percentile(s.lengths, 90)},
               {"p99", percentile(s.lengths, 99)},
               {"max", s.lengths.back()}};
  return {{"data", d.docs.describe()},
          {"documents", s.documents},
          {"examples", s.examples},
          {"bad_documents", s.bad_total()},
          {"bad_by_reason", bad},
          {"token_length", lengths},
          {"max_length", d.recipe.data.max_length},
          {"overlong", s.overlong},
          {"overlong_policy", recipe::name(d.recipe.data.overlong)},
          {"trained_tokens", s.trained}};
}

void print_stats(const Dataset& d, const Stats& s) {
  const recipe::DataSection& c = d.recipe.data;
  const auto row = [](std::string_view label, const std::string& value) { fmt::print("{:<16}{}\n", label, value); };
  row("data", d.docs.describe());
  row("documents", fmt::format("{} selected", s.documents));
  row("examples", fmt::format("{}", s.examples));
  row("bad documents", fmt::format("{}{}", s.bad_total(),
                                   s.bad.empty() || c.bad_documents == recipe::BadDocuments::Skip
                                       ? ""
                                       : " (data.bad_documents is fail: training stops at the first)"));
  for (const auto& [reason, b] : s.bad)
    fmt::print("  {:>6}  {}: {}{}\n", b.count, reason, fmt::join(b.first, ", "), b.count > 5 ? ", …" : "");
  if (s.lengths.empty()) {
    row("token lengths", "- (no example)");
  } else {
    row("token lengths",
        fmt::format("p50 {}  p90 {}  p99 {}  max {}  (untruncated, {} examples)", percentile(s.lengths, 50),
                    percentile(s.lengths, 90), percentile(s.lengths, 99), s.lengths.back(), s.lengths.size()));
  }
  row("overlong", fmt::format("{} exceed data.max_length {} ({})", s.overlong, c.max_length,
                              c.overlong == recipe::Overlong::Skip ? "skipped" : "truncated"));
  row("trained tokens", fmt::format("{}", s.trained));
}

// ---- data.sources -------------------------------------------------------------------------

void print_preview(const tok::Tokenizer& tokenizer, int max_length, int64_t position, const data::Found& doc,
                   const data::Built& built, bool colour);
nlohmann::ordered_json preview_json(int64_t position, const data::Built& built);

// A recipe with data.sources, its tokenizer and its mixture (the training side of eval.fraction).
struct Mixed {
  explicit Mixed(recipe::Recipe r)
      : recipe(std::move(r)),
        tokenizer(lorarun::model::load_tokenizer(recipe.model.path)),
        mix(recipe, tokenizer, data::pair_tokens(recipe.train.objective),
            data::Holdout::training(recipe.eval.fraction)) {}
  const recipe::Recipe recipe;
  const tok::Tokenizer tokenizer;
  data::Mixture mix;
};

// The planned epoch: per source its selected documents, its documents per epoch (repeats), and its
// share of the epoch's documents and of its trained tokens (each source's mean over a sample).
void mixture_stats(Mixed& m, bool as_json) {
  m.mix.measure_tokens();
  const auto& sources = m.mix.sources();
  double tokens = 0;
  for (const data::MixSource& s : sources) tokens += double(s.per_epoch) * s.tokens_per_document;
  nlohmann::ordered_json out = {{"documents_per_epoch", m.mix.size()},
                                {"mix_by", recipe::name(m.recipe.data.mix_by)},
                                {"sources", nlohmann::ordered_json::array()}};
  if (!as_json)
    fmt::print("{} documents per epoch, mixed by {}\n{:<20}{:>10}{:>11}{:>9}{:>8}{:>10}{:>14}{:>9}\n", m.mix.size(),
               recipe::name(m.recipe.data.mix_by), "source", "selected", "per epoch", "repeats", "weight", "share",
               "tokens/doc", "tokens");
  for (const data::MixSource& s : sources) {
    const double doc_share = double(s.per_epoch) / double(m.mix.size());
    const double token_share = double(s.per_epoch) * s.tokens_per_document / tokens;
    const int64_t repeats = std::max<int64_t>(0, s.per_epoch - s.docs->size());
    out["sources"].push_back({{"name", s.spec.name},
                              {"selection", s.docs->describe()},
                              {"documents", s.docs->size()},
                              {"per_epoch", s.per_epoch},
                              {"repeats", repeats},
                              {"weight", s.spec.weight},
                              {"document_share", doc_share},
                              {"tokens_per_document", s.tokens_per_document},
                              {"sampled", s.sampled},
                              {"token_share", token_share}});
    if (!as_json)
      fmt::print("{:<20}{:>10}{:>11}{:>9}{:>8g}{:>9.1f}%{:>14.1f}{:>8.1f}%\n", lorarun::printable(s.spec.name, 19),
                 s.docs->size(), s.per_epoch, repeats, s.spec.weight, 100 * doc_share, s.tokens_per_document,
                 100 * token_share);
  }
  if (as_json) fmt::print("{}\n", out.dump());
}

// The first n documents of epoch 0's mixed order (with data.shuffle: stream, of one rank's
// stream), each with its source.
void mixture_preview(const Mixed& m, int64_t n, bool as_json) {
  const bool colour = !as_json && isatty(STDOUT_FILENO) && !std::getenv("NO_COLOR");
  const auto seed = static_cast<uint64_t>(m.recipe.train.seed);
  std::vector<data::Found> found;
  if (m.recipe.data.shuffle == recipe::Shuffle::Stream) {
    found = data::stream_head(m.mix, {.seed = seed, .shuffle = recipe::Shuffle::Stream}, n);
  } else {
    std::vector<data::Pick> picks = m.mix.order(seed, 0);
    picks.resize(static_cast<size_t>(std::min<int64_t>(n, static_cast<int64_t>(picks.size()))));
    found = m.mix.fetch(picks);
  }
  if (!as_json) fmt::print("── trains: {}\n\n", lorarun::model::describe_adapter(m.recipe.lora));
  for (const data::Found& f : found) {
    const data::MixSource& s = m.mix.sources()[static_cast<size_t>(f.source)];
    const data::Built built = data::build_found(*s.builder, f);
    if (as_json) {
      nlohmann::ordered_json j = {{"source", s.spec.name}};
      j.update(preview_json(f.position, built));
      fmt::print("{}\n", j.dump());
      continue;
    }
    fmt::print("── source {}:\n", s.spec.name);
    print_preview(m.tokenizer, s.config->max_length, f.position, f, built, colour);
  }
}

// The recipe of `a` when it mixes data.sources (stats and preview then show the mixture).
std::optional<recipe::Recipe> mixing(const RecipeArgs& a) {
  recipe::Recipe r = read_recipe(a);
  if (r.data.sources.empty()) return std::nullopt;
  if (a.split == "eval")
    throw Error(fmt::format(
        "{}: with data.sources, stats and preview show the mixture training reads: drop --split eval", a.recipe));
  return r;
}

void stats(const RecipeArgs& a) {
  if (std::optional<recipe::Recipe> r = mixing(a)) {
    Mixed m(std::move(*r));
    return mixture_stats(m, a.as_json);
  }
  const Dataset d(a);
  const Stats s = collect(d);
  if (a.as_json)
    fmt::print("{}\n", stats_json(d, s).dump());
  else
    print_stats(d, s);
}

// ---- preview ------------------------------------------------------------------------------

// The example's text, trained spans marked: ⟦…⟧, or green on a terminal.
std::string render(const tok::Tokenizer& tokenizer, const data::Example& e, bool colour) {
  std::string out;
  for (size_t i = 0; i < e.ids.size();) {
    const bool trained = e.labels[i] != data::kIgnoreIndex;
    size_t j = i;
    while (j < e.ids.size() && (e.labels[j] != data::kIgnoreIndex) == trained) ++j;
    const std::string text = terminal_text(tokenizer.decode(std::span(e.ids).subspan(i, j - i)));
    if (!trained)
      out += text;
    else if (colour)
      out += "\x1b[32m" + text + "\x1b[0m";
    else
      out += "⟦" + text + "⟧";
    i = j;
  }
  return out;
}

void print_preview(const tok::Tokenizer& tokenizer, int max_length, int64_t position, const data::Found& doc,
                   const data::Built& built, bool colour) {
  if (const auto* r = std::get_if<data::Rejection>(&built)) {
    fmt::print("── {}  rejected: {}\n\n", where(position, doc), one_line(r->reason));
    return;
  }
  const auto& e = std::get<data::Example>(built);
  fmt::print("── {}  {} tokens, {} trained{}{}\n{}\n\n", where(position, doc), e.ids.size(), labelled_tokens(e),
             e.truncated ? fmt::format(" (truncated to data.max_length {})", max_length) : "",
             e.desirable ? (*e.desirable ? ", desirable" : ", undesirable") : "", render(tokenizer, e, colour));
  if (!e.pair()) return;
  data::Example rejected;
  rejected.ids = e.rejected_ids;
  rejected.labels = e.rejected_labels;
  fmt::print("── {}  rejected: {} tokens, {} scored\n{}\n\n", where(position, doc), rejected.ids.size(),
             labelled_tokens(rejected), render(tokenizer, rejected, colour));
}

// {"position", "ids", "labels"} (and a pair's rejected_*, an unpaired example's desirable) or
// {"position", "rejected"}, keys in that order.
nlohmann::ordered_json preview_json(int64_t position, const data::Built& built) {
  if (const auto* r = std::get_if<data::Rejection>(&built)) return {{"position", position}, {"rejected", r->reason}};
  const auto& e = std::get<data::Example>(built);
  nlohmann::ordered_json out = {{"position", position}, {"ids", e.ids}, {"labels", e.labels}};
  if (e.pair()) {  // (a preference pair: ids and labels are prompt + chosen)
    out["rejected_ids"] = e.rejected_ids;
    out["rejected_labels"] = e.rejected_labels;
  }
  if (e.desirable) out["desirable"] = *e.desirable;  // (format: unpaired)
  return out;
}

void preview(int64_t n, const RecipeArgs& a) {
  if (n < 0) throw Error(fmt::format("preview {}: N must be a count of documents, 0 or more", n));
  if (std::optional<recipe::Recipe> r = mixing(a)) return mixture_preview(Mixed(std::move(*r)), n, a.as_json);
  const Dataset d(a);
  const data::ExampleBuilder builder(d.recipe.data, d.tokenizer);
  const bool colour = !a.as_json && isatty(STDOUT_FILENO) && !std::getenv("NO_COLOR");
  if (!a.as_json) fmt::print("── trains: {}\n\n", lorarun::model::describe_adapter(d.recipe.lora));
  for_each_document(d, std::min(n, d.docs.size()), [&](int64_t position, const data::Found& doc) {
    const data::Built built = build(builder, doc, d.recipe.data.source);
    if (a.as_json)
      fmt::print("{}\n", preview_json(position, built).dump());
    else
      print_preview(d.tokenizer, d.recipe.data.max_length, position, doc, built, colour);
  });
}

// ---- import -------------------------------------------------------------------------------

struct ImportArgs {
  std::string file, uri, db, collection;
  bool drop = false;
};

// JSONL file -> MongoDB collection, streamed 1,000 documents per insert. A bad line stops the
// import before its batch: only whole batches before it are in the collection (and --drop
// drops only once the first batch is known good).
void import_jsonl(const ImportArgs& a) {
  const std::string uri = lorarun::mongodb_uri(a.uri);
  if (uri.empty()) throw Error("no MongoDB URI: give --uri or set LORARUN_MONGODB_URI");
  std::ifstream in(a.file);
  if (!in) throw Error(fmt::format("cannot read {}", a.file));
  const auto t0 = std::chrono::steady_clock::now();
  data::Client client(uri, kImportTimeout, {"--uri or LORARUN_MONGODB_URI"});
  std::vector<json> batch;
  int64_t inserted = 0;
  size_t n = 0, batch_start = 1;
  const auto so_far = [&] {
    return fmt::format("{} documents inserted: the whole batches of 1,000 before it, nothing from its batch on",
                       inserted);
  };
  const auto flush = [&] {
    try {
      if (a.drop && inserted == 0) client.drop(a.db, a.collection);
      inserted += client.insert_many(a.db, a.collection, batch);
    } catch (const Error& e) {
      throw Error(fmt::format("{}:{}-{}: {} ({})", a.file, batch_start, n, e.what(), so_far()));
    }
    batch.clear();
  };
  for (std::string line; std::getline(in, line);) {
    ++n;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    json j = json::parse(line, nullptr, false);
    if (!j.is_object())
      throw Error(fmt::format("{}:{}: {} ({}; fix the line and import again with --drop)", a.file, n,
                              j.is_discarded() ? "not valid JSON" : "not a JSON object", so_far()));
    if (batch.empty()) batch_start = n;
    batch.push_back(std::move(j));
    if (batch.size() == 1000) flush();
  }
  if (!batch.empty() || (a.drop && inserted == 0)) flush();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  fmt::print("imported {} documents into {}.{} in {:.2f} s ({:.0f} docs/s)\n", inserted, a.db, a.collection, s,
             static_cast<double>(inserted) / std::max(s, 1e-9));
}

// ---- plot ---------------------------------------------------------------------------------

struct PlotArgs {
  std::string output_dir, out, metric = "loss";
};

// A run's metrics.jsonl -> an SVG of the train figure (line) and its eval_ twin (markers) by step.
void plot(const PlotArgs& a) { fmt::print("{}\n", lorarun::track::plot_loss(a.output_dir, a.out, a.metric)); }

// ---- command line -------------------------------------------------------------------------

void recipe_args(CLI::App* cmd, RecipeArgs& a, const char* json_help) {
  cmd->add_option("recipe", a.recipe, "recipe YAML")->required();
  cmd->add_option("overrides", a.overrides, "key=value overrides of recipe keys (data.max_length=512)");
  cmd->add_flag("--json", a.as_json, json_help);
  cmd->add_option("--split", a.split, "train (the documents training reads, the default) or eval (the eval: split)")
      ->check(CLI::IsMember({"train", "eval"}));
  cmd->add_option("--job-adapter", a.job_adapter, "a recipe of many adapters (adapters:): the one to look at");
}

int run(int argc, char** argv) {
  CLI::App app{"lora-data: dataset tools"};
  app.require_subcommand(1);

  TokenizeArgs t;
  auto* tkn =
      app.add_subcommand("tokenize", "JSON string lines (or --raw text lines) on stdin to JSON id arrays on stdout");
  tkn->add_option("--model", t.model, "model directory with tokenizer.json")->required();
  tkn->add_flag("--no-special", t.no_special, "do not add the post-processor's special tokens");
  tkn->add_flag("--raw", t.raw, "input lines are plain text, not JSON string literals");
  tkn->callback([&] { tokenize(t); });

  DetokenizeArgs d;
  auto* detok = app.add_subcommand("detokenize", "JSON id arrays on stdin to JSON string lines on stdout");
  detok->add_option("--model", d.model, "model directory with tokenizer.json")->required();
  detok->add_flag("--skip-special", d.skip_special, "leave special tokens out of the text");
  detok->callback([&] { detokenize(d); });

  RecipeArgs st;
  auto* sts = app.add_subcommand("stats", "counts, bad documents and token lengths of a recipe's data");
  recipe_args(sts, st, "one JSON object");
  sts->callback([&] { stats(st); });

  RecipeArgs pv;
  int64_t count = 0;
  auto* prev = app.add_subcommand("preview", "the first N documents as training sees them, trained part marked");
  prev->add_option("n", count, "how many documents")->required();
  recipe_args(prev, pv, "one JSON line per document: {position, ids, labels} or {position, rejected}");
  prev->callback([&] { preview(count, pv); });

  ImportArgs im;
  auto* imp = app.add_subcommand("import", "load a JSONL file (one document per line) into a MongoDB collection");
  imp->add_option("file", im.file, "JSONL file")->required();
  imp->add_option("--uri", im.uri, "MongoDB URI (default: $LORARUN_MONGODB_URI)");
  imp->add_option("--db", im.db, "database")->required();
  imp->add_option("--collection", im.collection, "collection")->required();
  imp->add_flag("--drop", im.drop, "drop the collection first");
  imp->callback([&] { import_jsonl(im); });

  PlotArgs pl;
  auto* plt = app.add_subcommand("plot", "a run's train and eval loss by step (its metrics.jsonl) as an SVG");
  plt->add_option("output_dir", pl.output_dir, "the run's checkpoint.output_dir")->required();
  plt->add_option("--out", pl.out, "SVG file to write (default: OUTPUT_DIR/<metric>.svg, '/' as '_')");
  plt->add_option("--metric", pl.metric,
                  "the metrics.jsonl figure to plot, e.g. reward or rewards/answer/mean (grpo); default loss");
  plt->callback([&] { plot(pl); });

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    if (e.get_exit_code() == 0) return app.exit(e);  // --help
    throw Error(fmt::format("{} (see lora-data --help)", e.what()));
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::ios::sync_with_stdio(false);
  return lorarun::app_main("lora-data", argc, argv, run);
}
