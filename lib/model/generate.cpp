#include "model/generate.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <filesystem>
#include <limits>
#include <nlohmann/json.hpp>

#include "io/files.hpp"
#include "model/transformer.hpp"
#include "util/error.hpp"
#include "util/mix.hpp"

namespace lorarun::model {

at::Tensor sampling_probs(const at::Tensor& logits, const Sampling& s) {
  if (s.greedy()) throw Error("sampling_probs: greedy decoding draws nothing (temperature 0)");
  constexpr double kFiltered = -std::numeric_limits<double>::infinity();
  at::Tensor scores = logits.to(at::kFloat);
  if (s.temperature != 1.0) scores = scores / s.temperature;
  if (s.top_k > 0 && s.top_k < scores.size(-1)) {  // ties with the k-th are kept
    const at::Tensor kth = std::get<0>(at::topk(scores, s.top_k)).narrow(-1, s.top_k - 1, 1);
    scores = scores.masked_fill(scores < kth, kFiltered);
  }
  if (s.top_p < 1.0) {  // drops the least likely tokens whose mass stays within 1 - top_p; keeps the most likely
    const auto [sorted, order] = at::sort(scores, -1, /*descending=*/false);
    at::Tensor drop = at::softmax(sorted, -1).cumsum(-1) <= (1.0 - s.top_p);
    drop.narrow(-1, drop.size(-1) - 1, 1).fill_(false);
    scores = scores.masked_fill(drop.scatter(-1, order, drop), kFiltered);
  }
  return at::softmax(scores, -1);
}

uint64_t completion_seed(uint64_t seed, uint64_t step, uint64_t prompt, uint64_t generation) {
  uint64_t h = mix64(seed + kGolden64);
  for (const uint64_t part : {step, prompt, generation}) h = mix64(h ^ mix64(part + kGolden64));
  return h;
}

double completion_uniform(uint64_t seed, uint64_t token) {
  return static_cast<double>(mix64(seed ^ mix64(token * kGolden64 + 1)) >> 11) * 0x1.0p-53;
}

at::Tensor draw(const at::Tensor& probs, const at::Tensor& u) {
  const at::Tensor cdf = probs.to(at::kDouble).cumsum(-1);
  const at::Tensor target = (u.to(cdf.device(), at::kDouble) * cdf.select(-1, -1)).unsqueeze(-1);
  return at::searchsorted(cdf, target, /*out_int32=*/false, /*right=*/true).squeeze(-1).clamp_max(cdf.size(-1) - 1);
}

at::Tensor KVCache::append(size_t layer, int which, const at::Tensor& kv) {
  std::vector<at::Tensor>& all = which == 0 ? k : v;
  if (all.size() <= layer) all.resize(layer + 1);
  at::Tensor& buffer = all[layer];
  const int64_t need = filled + kv.size(2);
  if (!buffer.defined() || buffer.size(2) < need) {  // grown to the next multiple of 256 positions
    at::Tensor grown = at::empty({kv.size(0), kv.size(1), (need + 255) / 256 * 256, kv.size(3)}, kv.options());
    if (filled > 0) grown.narrow(2, 0, filled).copy_(buffer.narrow(2, 0, filled));
    buffer = grown;
  }
  buffer.narrow(2, filled, kv.size(2)).copy_(kv);
  return buffer.narrow(2, 0, need);
}

void KVCache::keep_rows(const at::Tensor& rows) {
  for (auto* layers : {&k, &v})
    for (at::Tensor& kv : *layers) kv = kv.narrow(2, 0, filled).index_select(0, rows.to(kv.device()));
}

namespace {

// prompts -> ids [B, L] left-padded with 0 and their mask (1 = token).
std::pair<at::Tensor, at::Tensor> left_padded(const std::vector<std::vector<int64_t>>& prompts) {
  size_t longest = 0;
  for (const auto& p : prompts) {
    if (p.empty()) throw Error("a prompt to continue has no tokens");
    longest = std::max(longest, p.size());
  }
  const auto rows = static_cast<int64_t>(prompts.size()), length = static_cast<int64_t>(longest);
  at::Tensor ids = at::zeros({rows, length}, at::kLong), mask = at::zeros({rows, length}, at::kLong);
  for (int64_t r = 0; r < rows; ++r) {
    const auto& p = prompts[static_cast<size_t>(r)];
    const auto n = static_cast<int64_t>(p.size());
    ids[r].narrow(0, length - n, n).copy_(at::tensor(p, at::kLong));
    mask[r].narrow(0, length - n, n).fill_(1);
  }
  return {ids, mask};
}

}  // namespace

std::vector<std::vector<int64_t>> generate(const CausalLM& model, const std::vector<std::vector<int64_t>>& prompts,
                                           const std::vector<uint64_t>& seeds, const GenerateOptions& opt) {
  const Sampling& s = opt.sampling;
  if (!s.greedy() && seeds.size() != prompts.size())
    throw Error(fmt::format("generate: {} seeds for {} prompts", seeds.size(), prompts.size()));
  std::vector<std::vector<int64_t>> out(prompts.size());
  c10::NoGradGuard no_grad;
  at::Tensor ids, mask;
  const at::Device device = model.device();
  if (!prompts.empty()) {
    std::tie(ids, mask) = left_padded(prompts);
    mask = mask.to(device);
  }
  std::vector<int64_t> live(prompts.size());  // the rows still generating, in batch order
  for (size_t r = 0; r < live.size(); ++r) live[r] = static_cast<int64_t>(r);
  KVCache cache;
  bool mine = !prompts.empty() && opt.max_new_tokens > 0;  // this rank has rows to run
  for (int64_t t = 0; mine || opt.any_running; ++t) {
    if (!mine) {  // the other ranks' pass, joined with one of none; then, as they do, whether any goes on
      model.skip_pass(false, false);
      if (!opt.any_running(false)) break;
      continue;
    }
    const at::Tensor last = model.logits(model.hidden_states(ids, mask, &cache).select(1, -1)).to(at::kFloat);
    at::Tensor next;
    if (s.greedy()) {
      next = last.argmax(-1);
    } else {
      std::vector<double> u;
      for (const int64_t r : live) u.push_back(completion_uniform(seeds[static_cast<size_t>(r)], t));
      next = draw(sampling_probs(last, s), at::tensor(u, at::kDouble));
    }
    next = next.cpu().contiguous();
    std::vector<int64_t> keep;  // positions in the batch of rows that go on
    for (size_t i = 0; i < live.size(); ++i) {
      const int64_t id = next.data_ptr<int64_t>()[i];
      out[static_cast<size_t>(live[i])].push_back(id);
      if (!(opt.eos_id && id == *opt.eos_id)) keep.push_back(static_cast<int64_t>(i));
    }
    mine = !keep.empty() && t + 1 < opt.max_new_tokens;
    if (opt.any_running && !opt.any_running(mine)) break;
    if (!mine) continue;
    if (keep.size() < live.size()) {  // drop the ended rows from the batch and the cache
      const at::Tensor rows = at::tensor(keep, at::kLong);
      cache.keep_rows(rows);
      mask = mask.index_select(0, rows.to(device));
      next = next.index_select(0, rows);
      std::vector<int64_t> still;
      for (const int64_t i : keep) still.push_back(live[static_cast<size_t>(i)]);
      live = std::move(still);
    }
    ids = next.unsqueeze(1);
    mask = at::cat({mask, at::ones({mask.size(0), 1}, mask.options())}, 1);
  }
  return out;
}

std::optional<int64_t> default_eos_id(const CausalLM& model) {
  for (const char* file : {"generation_config.json", "config.json"}) {
    const auto path = std::filesystem::path(model.dir()) / file;
    if (!std::filesystem::exists(path)) continue;
    const auto j = nlohmann::json::parse(io::read_file(path.string()), nullptr, false);
    if (j.is_object() && j.contains("eos_token_id")) {
      const auto& e = j["eos_token_id"];
      if (e.is_number_integer()) return e.get<int64_t>();
      if (e.is_array() && !e.empty() && e[0].is_number_integer()) return e[0].get<int64_t>();
    }
  }
  return model.config().eos_token_id;  // a .gguf model: from its metadata
}

}  // namespace lorarun::model
