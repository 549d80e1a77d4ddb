#include "train/evaluate.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <iterator>
#include <vector>

#include "data/collate.hpp"
#include "data/mongo.hpp"
#include "data/source.hpp"
#include "model/loss.hpp"
#include "model/transformer.hpp"
#include "train/agreement.hpp"
#include "train/evaluation.hpp"
#include "util/error.hpp"

namespace lorarun::train {

void require_scored_token(const data::Documents& docs, const data::ExampleBuilder& builder, const std::string& what) {
  constexpr int64_t kChunk = 64;
  const std::vector<std::string> fields = builder.fields();
  int64_t rejected = 0;
  for (int64_t first = 0; first < docs.size(); first += kChunk) {
    std::vector<int64_t> positions;
    for (int64_t p = first; p < std::min(docs.size(), first + kChunk); ++p) positions.push_back(p);
    for (const data::Found& f : docs.fetch_found(positions, fields)) {
      const data::Built built = data::build_found(builder, f);
      const auto* ex = std::get_if<data::Example>(&built);
      if (!ex) {
        ++rejected;
        continue;
      }
      // scored: a label after the first position (the loss predicts token t from those before it);
      // a prompt, by the rewards of its completion
      if (builder.format() == recipe::Format::Prompt ||
          std::any_of(ex->labels.begin() + std::min<size_t>(1, ex->labels.size()), ex->labels.end(),
                      [](int32_t l) { return l != data::kIgnoreIndex; }))
        return;
    }
  }
  throw ConfigError(
      fmt::format("the evaluation documents ({}) hold no token to score: {} of {} were rejected (bad, or longer than "
                  "data.max_length with data.overlong=skip) and the others have no trained token; fix the eval: "
                  "selection or the data.* keys",
                  what, rejected, docs.size()));
}

EvalSums eval_shard(model::CausalLM& m, const data::Documents& docs, const data::ExampleBuilder& builder,
                    const recipe::Recipe& r, int rank, int world, const c10::Device& device, const PerDocument& per_doc,
                    const StopCheck& stop, const Evaluation* by) {
  const int64_t n = docs.size();
  const int64_t per_batch = per_doc ? 1 : r.eval.batch_size.value_or(r.data.batch_size);
  const std::vector<std::string> fields = builder.fields();
  EvalSums sums;
  if (by) sums.own.assign(static_cast<size_t>(by->stats()), 0.0);
  c10::NoGradGuard no_grad;
  const bool was_training = m.training;
  m.training = false;
  // Sharded base on several ranks: every rank runs as many passes as rank 0, which has the most
  // batches, so that every rank joins every gather; and so that every rank asks `stop` alike.
  const bool join = m.passes_joined();
  const int64_t stride = per_batch * world;
  const int64_t passes = join || stop ? (n + stride - 1) / stride : 0;
  // This rank's documents (positions rank, rank + world, …) fetched ahead, kFetchAhead a round trip
  // rather than one batch's: a fetch by _id on FerretDB's SQLite backend scans the whole collection.
  constexpr size_t kFetchAhead = 256;
  std::vector<data::Found> ahead;
  size_t used = 0;
  int64_t unfetched = rank;
  const auto take = [&](size_t count) {
    if (ahead.size() - used < count) {
      ahead.erase(ahead.begin(), ahead.begin() + static_cast<std::ptrdiff_t>(used));
      used = 0;
      std::vector<int64_t> positions;
      for (; unfetched < n && positions.size() < std::max(kFetchAhead, count); unfetched += world)
        positions.push_back(unfetched);
      for (data::Found& f : docs.fetch_found(positions, fields)) ahead.push_back(std::move(f));
    }
    used += count;
    return std::vector<data::Found>(std::make_move_iterator(ahead.begin() + static_cast<std::ptrdiff_t>(used - count)),
                                    std::make_move_iterator(ahead.begin() + static_cast<std::ptrdiff_t>(used)));
  };
  for (int64_t first = rank, pass = 0; first < n || pass < passes; first += stride, ++pass) {
    if (stop && stop()) {
      sums.stopped = true;
      break;
    }
    if (first >= n) {  // (an objective's own passes, skipped: each it would have run)
      if (by)
        by->evaluate({}, device);
      else
        m.skip_pass(false, r.data.packing);
      continue;
    }
    size_t count = 0;  // the batch's documents: positions first, first + world, …
    for (int64_t p = first; p < n && static_cast<int64_t>(count) < per_batch; p += world) ++count;
    std::vector<data::Example> batch;
    std::string id;
    for (const data::Found& f : take(count)) {
      data::Built built = data::build_found(builder, f);
      if (auto* ex = std::get_if<data::Example>(&built)) {
        batch.push_back(std::move(*ex));
        id = f.id;
      } else {
        ++sums.rejected;
      }
    }
    sums.documents += static_cast<int64_t>(batch.size());
    if (by) {
      const auto [s, tokens] = by->evaluate(batch, device);
      if (!s.defined()) continue;
      for (int64_t k = 0; k < by->stats(); ++k) sums.own[static_cast<size_t>(k)] += s[k].item<double>();
      sums.tokens += tokens;
      continue;
    }
    const data::Batch b = data::collate(batch, r.data.packing, static_cast<size_t>(r.data.max_length), device);
    if (b.tokens == 0) {
      m.skip_pass(false, r.data.packing);
      continue;
    }
    const at::Tensor hidden = m.hidden_states(b.ids, b.mask, nullptr, r.data.packing);
    const model::LossSum l = model::lm_head_loss(hidden, m.lm_head(), b.rows, b.targets, m.config().logit_softcap);
    const double loss = l.sum.to(at::kDouble).item<double>();
    sums.loss += loss;
    sums.tokens += b.tokens;
    if (per_doc) per_doc(id, b.tokens, loss);
  }
  m.training = was_training;
  return sums;
}

std::optional<nlohmann::json> evaluate_split(model::CausalLM& m, const data::EvalSplit& split,
                                             const data::ExampleBuilder& builder, const recipe::Recipe& r,
                                             const Agreement& agree, int epoch, int64_t step, const StopCheck& stop,
                                             const Evaluation* by) {
  const auto t0 = std::chrono::steady_clock::now();
  const EvalSums mine =
      eval_shard(m, split.docs(), builder, r, agree.rank(), agree.world(), agree.device(), {}, stop, by);
  if (mine.stopped) return std::nullopt;
  std::vector<double> mine_all = {mine.loss, double(mine.tokens), double(mine.documents), double(mine.rejected)};
  mine_all.insert(mine_all.end(), mine.own.begin(), mine.own.end());
  at::Tensor sums = at::tensor(mine_all, at::kDouble).to(agree.device());
  agree.sum(sums);
  sums = sums.cpu();
  const double* t = sums.data_ptr<double>();
  const auto tokens = static_cast<int64_t>(t[1]), documents = static_cast<int64_t>(t[2]),
             rejected = static_cast<int64_t>(t[3]);
  if (tokens == 0)
    throw Error(
        fmt::format("the evaluation documents ({}) hold no trained token: {} of {} were rejected (bad, or longer "
                    "than data.max_length with data.overlong=skip); fix the eval: selection",
                    split.describe(), rejected, split.docs().size()));
  const double mean = by ? by->loss_of(t + 4) : t[0] / t[1];
  nlohmann::json row{{"epoch", epoch},
                     {"step", step},
                     {"eval_loss", mean},
                     {"eval_tokens", tokens},
                     {"eval_documents", documents},
                     {"eval_rejected", rejected},
                     {"eval_seconds", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()}};
  if (!by || by->perplexity()) row["eval_ppl"] = std::exp(mean);
  if (by) row.update(by->figures(t + 4, "eval_"));
  return row;
}

std::optional<nlohmann::json> evaluate_sources(model::CausalLM& m, const std::vector<NamedSplit>& splits,
                                               const recipe::Recipe& r, const Agreement& agree, int epoch, int64_t step,
                                               const StopCheck& stop, const Evaluation* by) {
  nlohmann::json row{{"epoch", epoch}, {"step", step}};
  double loss = 0, weight = 0, seconds = 0;
  int64_t tokens = 0, documents = 0, rejected = 0;
  for (const NamedSplit& s : splits) {
    const std::optional<nlohmann::json> one = evaluate_split(m, *s.split, *s.builder, r, agree, epoch, step, stop, by);
    if (!one) return std::nullopt;
    const double mean = (*one)["eval_loss"].get<double>();
    const auto w = static_cast<double>((*one)[by ? "eval_documents" : "eval_tokens"].get<int64_t>());
    row["eval_loss/" + s.name] = mean;
    loss += mean * w;
    weight += w;
    tokens += (*one)["eval_tokens"].get<int64_t>();
    documents += (*one)["eval_documents"].get<int64_t>();
    rejected += (*one)["eval_rejected"].get<int64_t>();
    seconds += (*one)["eval_seconds"].get<double>();
  }
  const double mean = loss / std::max(weight, 1.0);
  row.update({{"eval_loss", mean},
              {"eval_tokens", tokens},
              {"eval_documents", documents},
              {"eval_rejected", rejected},
              {"eval_seconds", seconds}});
  if (!by || by->perplexity())
    row["eval_ppl"] = std::exp(mean);
  else  // (grpo: eval_loss is minus the mean reward, the sources' weighted by their prompts)
    row["eval_reward"] = -mean;
  return row;
}

}  // namespace lorarun::train
