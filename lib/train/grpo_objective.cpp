#include "train/grpo_objective.hpp"

#include <ATen/ATen.h>
#include <c10/core/GradMode.h>
#include <fmt/format.h>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>

#include "data/collate.hpp"
#include "io/files.hpp"
#include "io/safetensors.hpp"
#include "model/generate.hpp"
#include "model/loss.hpp"
#include "model/transformer.hpp"
#include "tokenizer/tokenizer.hpp"
#include "train/agreement.hpp"
#include "train/as_reference.hpp"
#include "train/evaluation.hpp"
#include "train/grpo.hpp"
#include "train/reward_command.hpp"
#include "train/rewards.hpp"
#include "util/error.hpp"

namespace lorarun::train {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// The step's figures over every rank's completions, which rank 0 alone adds to the stats (the others
// add 0), after grpo_loss's sums: TRL's names in figures().
enum StepFigure : int64_t {
  kReward = static_cast<int64_t>(kFigures),
  kRewardStd,
  kZeroStd,
  kMeanLength,
  kMinLength,
  kMaxLength,
  kClippedRatio,
  kMeanTerminated,
  kMinTerminated,
  kMaxTerminated,
  kSampled,     // 1: the step sampled its completions (else it trained again on a rollout: no figures of it)
  kStepFigures  // then each reward's mean and std
};

// An evaluation batch's sums over its greedy completions, then each reward's sum and count.
enum EvalSum : int64_t { kEvalCompletions, kEvalScored, kEvalReward, kEvalLength, kEvalTruncated, kEvalSums };

// TRL's nanmean and nanstd (Bessel's correction) of `x`: NaN when nothing (nanstd: one value) is left.
std::pair<double, double> nan_mean_std(const std::vector<double>& x) {
  double sum = 0, n = 0;
  for (double v : x)
    if (!std::isnan(v)) sum += v, ++n;
  if (n == 0) return {kNaN, kNaN};
  const double mean = sum / n;
  double sq = 0;
  for (double v : x)
    if (!std::isnan(v)) sq += (v - mean) * (v - mean);
  return {mean, n < 2 ? kNaN : std::sqrt(sq / (n - 1))};
}

GrpoLossConfig loss_config(const recipe::GrpoSection& g) {
  GrpoLossConfig c;
  switch (g.loss_type) {
    case recipe::GrpoLoss::Dapo:
      c.type = GrpoLossType::Dapo;
      break;
    case recipe::GrpoLoss::Grpo:
      c.type = GrpoLossType::Grpo;
      break;
    case recipe::GrpoLoss::DrGrpo:
      c.type = GrpoLossType::DrGrpo;
      break;
    case recipe::GrpoLoss::Bnpo:
      c.type = GrpoLossType::Bnpo;
      break;
  }
  c.sequence_level = g.importance_sampling_level == recipe::ImportanceLevel::Sequence;
  c.beta = g.beta;
  c.epsilon_low = g.epsilon;
  c.epsilon_high = g.epsilon_high.value_or(g.epsilon);
  c.max_completion_length = g.max_completion_length;
  return c;
}

ScaleRewards scale_of(recipe::RewardScale s) {
  return s == recipe::RewardScale::Group   ? ScaleRewards::Group
         : s == recipe::RewardScale::Batch ? ScaleRewards::Batch
                                           : ScaleRewards::None;
}

std::vector<Reward> rewards_of(const recipe::Recipe& r) {
  std::vector<Reward> out;
  const std::vector<RewardSpec> specs = reward_specs(r.grpo.rewards);
  for (size_t i = 0; i < specs.size(); ++i)
    out.emplace_back(specs[i], fmt::format("grpo.rewards[{}] ({})", i, specs[i].name));
  return out;
}

// While it lives, the model samples: eval mode (no dropout), no gradient.
class Sampling {
 public:
  explicit Sampling(model::CausalLM& m) : m_(m), was_(m.training) { m.training = false; }
  ~Sampling() { m_.training = was_; }
  Sampling(const Sampling&) = delete;
  Sampling& operator=(const Sampling&) = delete;

 private:
  model::CausalLM& m_;
  const bool was_;
  c10::NoGradGuard no_grad_;
};

// One micro-batch's prompts and what became of them: G completions a prompt, row p * G + g.
struct Rollout {
  size_t per_prompt = 1;                    // G: grpo.num_generations in training, 1 in evaluation (greedy)
  std::vector<data::Example> prompts = {};  // (their documents only while the step that sampled them scores)
  std::vector<std::vector<int64_t>> completions = {};
  std::vector<double> scores = {};  // [rows, rewards]: each reward's (NaN: its program could not score it)
  std::vector<double> advantages = {};
  std::vector<char> truncated = {};  // the completion ended without EOS (cut at max_completion_length)
  at::Tensor old = {}, ref = {};     // [rows, longest] log-probs at sampling, with grpo.num_iterations > 1
};

// A micro-batch's prompts and completions as the model reads them: rows [B, prompt + longest], and
// where each completion token stands in [B, longest] (row, col), mask 0 for a masked completion.
struct Rows {
  data::Batch b;
  at::Tensor row, col, mask;
  int64_t B = 0, longest = 1;
};

// A rollout kept in the resumable state as float64 numbers: a reader that checks each before use.
class Unpack {
 public:
  Unpack(const double* v, size_t n) : v_(v), n_(n) {}
  double next() {
    if (at_ == n_) throw Error("it ends early");
    return v_[at_++];
  }
  // A count or a token id: an integer in [0, most].
  int64_t integer(int64_t most) {
    const double x = next();
    if (!(x >= 0 && x <= static_cast<double>(most)) || x != std::floor(x))
      throw Error(fmt::format("{} where an integer in [0, {}] belongs", x, most));
    return static_cast<int64_t>(x);
  }
  double finite() {
    const double x = next();
    if (!std::isfinite(x)) throw Error("a non-finite number");
    return x;
  }
  bool done() const { return at_ == n_; }

 private:
  const double* v_;
  size_t n_, at_ = 0;
};

class Grpo final : public Objective {
 public:
  Grpo(const recipe::Recipe& r, model::CausalLM& m, const std::vector<std::pair<std::string, at::Tensor>>& named,
       const Agreement& agree, c10::Device device, const tok::Tokenizer& tokenizer)
      : r_(r),
        g_(r.grpo),
        m_(m),
        agree_(agree),
        device_(device),
        tok_(tokenizer),
        cfg_(loss_config(r.grpo)),
        rewards_(rewards_of(r)) {
    for (const auto& [name, t] : named) params_.push_back(t);
    if (g_.beta > 0) reference_ = reference_values(r, named);
    for (size_t i = 0; i < rewards_.size(); ++i) {
      const RewardSpec& s = rewards_[i].spec();
      commands_.push_back(s.kind == "command" ? std::make_unique<RewardCommand>(
                                                    s.run, s.timeout_s, fmt::format("grpo.rewards[{}] ({})", i, s.name))
                                              : nullptr);
    }
    eos_ = model::default_eos_id(m);
    if (!eos_ && tokenizer.eos_id()) eos_ = *tokenizer.eos_id();
  }

  // Every grpo.num_iterations-th step of an epoch samples and scores a rollout; each step trains on
  // the last one.
  Sums forward_backward(const Next& next, int accum, const std::function<void()>& arm, StepAt at) override {
    const int64_t again = at.in_epoch % g_.num_iterations;  // steps since the rollout was sampled
    std::vector<double> figures;
    if (again == 0) {
      figures = roll_out(next, accum, at.step);
    } else if (sampled_at_ != at.step - again || held_.size() != static_cast<size_t>(accum)) {
      throw Error(
          fmt::format("step {} trains again on the completions sampled at step {} (grpo.num_iterations {}), which the "
                      "resumable state in {} does not hold: set checkpoint.resume=never to start over",
                      at.step + 1, at.step - again + 1, g_.num_iterations, r_.checkpoint.output_dir));
    }
    Sums sums;
    const auto f64 = at::TensorOptions().dtype(at::kDouble).device(device_);
    sums.loss = at::zeros({}, at::TensorOptions().dtype(at::kFloat).device(device_));
    sums.stats = at::zeros({stats()}, f64);
    if (agree_.lead() && !figures.empty())  // (the step's figures once, not once a rank)
      sums.stats.narrow(0, kFigures, static_cast<int64_t>(figures.size())).copy_(at::tensor(figures, at::kDouble));
    for (size_t a = 0; a < held_.size(); ++a) {
      if (a + 1 == held_.size()) arm();
      train(held_[a], sums);
    }
    return sums;
  }
  bool normalised() const override { return true; }
  int64_t stats() const override { return kStepFigures + 2 * static_cast<int64_t>(rewards_.size()); }
  nlohmann::json figures(const double* s) const override {
    nlohmann::json f = nlohmann::json::object();
    const double tokens = std::max(s[kTokens], 1.0);
    const double clipped_over = cfg_.sequence_level ? std::max(s[kCompletions], 1.0) : tokens;
    if (g_.beta != 0) f["kl"] = s[kKl] / tokens;
    f["clip_ratio/low_mean"] = s[kClipLow] / clipped_over;
    f["clip_ratio/high_mean"] = s[kClipHigh] / clipped_over;
    f["clip_ratio/region_mean"] = s[kClipRegion] / clipped_over;
    if (s[kSampled] > 0) {  // (a step training again on an earlier rollout: its sampling's figures were logged then)
      f["reward"] = s[kReward];
      f["reward_std"] = s[kRewardStd];
      f["frac_reward_zero_std"] = s[kZeroStd];
      f["completions/mean_length"] = s[kMeanLength];
      f["completions/min_length"] = s[kMinLength];
      f["completions/max_length"] = s[kMaxLength];
      f["completions/clipped_ratio"] = s[kClippedRatio];
      f["completions/mean_terminated_length"] = s[kMeanTerminated];
      f["completions/min_terminated_length"] = s[kMinTerminated];
      f["completions/max_terminated_length"] = s[kMaxTerminated];
      for (size_t i = 0; i < rewards_.size(); ++i) {
        const std::string& name = rewards_[i].spec().name;
        f["rewards/" + name + "/mean"] = s[kStepFigures + 2 * static_cast<int64_t>(i)];
        f["rewards/" + name + "/std"] = s[kStepFigures + 2 * static_cast<int64_t>(i) + 1];
      }
    }
    for (auto& [k, v] : f.items())  // NaN (no scored completion): null in every sink
      if (v.is_number_float() && !std::isfinite(v.get<double>())) v = nullptr;
    return f;
  }

  const Evaluation* evaluation() const override { return &evaluator_; }

  bool keeps_state() const override { return g_.num_iterations > 1; }

  // (rank 0) Every rank's rollout, for the steps still to train on it after a resume.
  void save_files(const std::string& dir, const nlohmann::json& /*data*/) const override {
    if (sampled_at_ < 0) return;
    std::vector<io::TensorBytes> tensors;
    for (size_t r = 0; r < packed_.size(); ++r)
      tensors.push_back({fmt::format("rank_{}", r),
                         io::DType::F64,
                         {static_cast<int64_t>(packed_[r].size())},
                         packed_[r].data(),
                         packed_[r].size() * sizeof(double)});
    const nlohmann::json about = {
        {"sampled_at", sampled_at_}, {"completions", counts_.completions}, {"tokens", counts_.tokens}};
    io::write_safetensors((std::filesystem::path(dir) / kRolloutFile).string(), tensors, {{"rollout", about.dump()}});
  }
  // This rank's rollout from the state (rank 0: every rank's, to keep it in the next); none when it
  // holds none. A file that does not hold together stops the run.
  std::string load_files(const std::string& dir, const nlohmann::json& /*data*/) override {
    const std::string path = (std::filesystem::path(dir) / kRolloutFile).string();
    held_.clear();
    packed_.clear();
    sampled_at_ = -1;
    if (!std::filesystem::exists(path)) return "";
    try {
      const io::SafetensorsFile f(path);
      const auto it = f.metadata().find("rollout");
      const nlohmann::json about =
          it == f.metadata().end() ? nlohmann::json() : nlohmann::json::parse(it->second, nullptr, false);
      if (!about.is_object()) throw Error("no rollout metadata");
      for (int r = 0; r < agree_.world(); ++r) {
        if (!agree_.lead() && r != agree_.rank()) continue;
        const io::TensorInfo* t = f.find(fmt::format("rank_{}", r));
        if (!t || t->dtype != io::DType::F64 || t->shape.size() != 1)
          throw Error(fmt::format("no float64 rollout of rank {}", r));
        std::vector<double> v(t->nbytes / sizeof(double));
        std::memcpy(v.data(), f.bytes(*t).data(), v.size() * sizeof(double));
        if (r == agree_.rank()) held_ = unpack(v);
        if (agree_.lead()) packed_.push_back(std::move(v));
      }
      counts_ = {about.at("completions").get<double>(), about.at("tokens").get<double>()};
      sampled_at_ = about.at("sampled_at").get<int64_t>();
    } catch (const std::exception& e) {
      throw Error(fmt::format("{} is damaged ({}): set checkpoint.resume=never to start over", path, e.what()));
    }
    return "";
  }

 private:
  // eval: each held-out prompt's greedy completion, scored by the rewards: eval_reward (their weighted
  // sum's mean over the completions some reward scored), each reward's mean, the completions' mean
  // length and share cut at grpo.max_completion_length; eval_loss is minus eval_reward (best/ and
  // early stopping keep the highest).
  class Evaluator final : public Evaluation {
   public:
    explicit Evaluator(const Grpo& g) : g_(g) {}
    int64_t stats() const override { return kEvalSums + 2 * static_cast<int64_t>(g_.rewards_.size()); }
    std::pair<at::Tensor, int64_t> evaluate(const std::vector<data::Example>& batch,
                                            c10::Device /*device*/) const override {
      Rollout roll{.per_prompt = 1, .prompts = batch};
      std::vector<std::vector<int64_t>> prompts;
      for (const data::Example& e : batch) prompts.emplace_back(e.ids.begin(), e.ids.end());
      g_.complete(roll, prompts, std::vector<uint64_t>(prompts.size(), 0), model::Sampling{});  // (none: joined)
      if (batch.empty()) return {at::Tensor(), 0};
      g_.score(roll);
      const size_t F = g_.rewards_.size();
      std::vector<double> sums(static_cast<size_t>(stats()), 0.0);
      for (size_t i = 0; i < roll.completions.size(); ++i) {
        double total = 0;
        bool any = false;
        for (size_t f = 0; f < F; ++f) {
          const double v = roll.scores[i * F + f];
          if (std::isnan(v)) continue;
          total += g_.rewards_[f].spec().weight * v;
          any = true;
          sums[kEvalSums + 2 * f] += v;
          sums[kEvalSums + 2 * f + 1] += 1;
        }
        sums[kEvalCompletions] += 1;
        sums[kEvalScored] += any ? 1 : 0;
        sums[kEvalReward] += total;
        sums[kEvalLength] += static_cast<double>(roll.completions[i].size());
        sums[kEvalTruncated] += roll.truncated[i] ? 1 : 0;
      }
      return {at::tensor(sums, at::kDouble), static_cast<int64_t>(batch.size())};
    }
    double loss_of(const double* s) const override {
      return s[kEvalScored] > 0 ? -s[kEvalReward] / s[kEvalScored] : std::numeric_limits<double>::infinity();
    }
    nlohmann::json figures(const double* s, const std::string& prefix) const override {
      const auto mean = [](double sum, double n) { return n > 0 ? nlohmann::json(sum / n) : nlohmann::json(); };
      nlohmann::json f = {{prefix + "reward", mean(s[kEvalReward], s[kEvalScored])},
                          {prefix + "completions/mean_length", mean(s[kEvalLength], s[kEvalCompletions])},
                          {prefix + "completions/clipped_ratio", mean(s[kEvalTruncated], s[kEvalCompletions])}};
      for (size_t i = 0; i < g_.rewards_.size(); ++i)
        f[prefix + "rewards/" + g_.rewards_[i].spec().name + "/mean"] =
            mean(s[kEvalSums + 2 * static_cast<int64_t>(i)], s[kEvalSums + 2 * static_cast<int64_t>(i) + 1]);
      return f;
    }
    bool perplexity() const override { return false; }

   private:
    const Grpo& g_;
  };

  struct Step {
    GrpoStepCounts counts;        // over every rank and micro-batch
    std::vector<double> figures;  // kReward … then each reward's mean and std
  };

  static constexpr const char* kRolloutFile = "grpo_rollout.safetensors";

  int64_t generations() const { return g_.num_generations; }

  // The step's prompts read (`accum` micro-batches), their completions sampled and scored, advantaged
  // over every rank's: the rollout held for this step and the grpo.num_iterations - 1 after it (with
  // its log-probs at sampling). Returns the step's figures.
  std::vector<double> roll_out(const Next& next, int accum, int64_t step) {
    held_.assign(static_cast<size_t>(accum), Rollout{.per_prompt = static_cast<size_t>(generations())});
    for (Rollout& roll : held_) roll.prompts = next();
    prompt_indices(held_);
    for (size_t a = 0, k = 0; a < held_.size(); k += held_[a].prompts.size(), ++a) {
      sample(held_[a], index_.data() + k, static_cast<uint64_t>(step));
      score(held_[a]);
    }
    Step s = advantage(held_, step);
    counts_ = s.counts;
    sampled_at_ = step;
    for (Rollout& roll : held_)
      for (data::Example& e : roll.prompts) e.document.reset();
    if (g_.num_iterations > 1) keep_log_probs();
    return std::move(s.figures);
  }

  // The rollout's log-probs under the policy that sampled it (eval mode, as it sampled) and under the
  // reference (with beta), which the steps training on it again read; every rank's rollout packed on
  // rank 0 for the resumable state.
  void keep_log_probs() {
    {
      const Sampling sampling(m_);
      for (Rollout& roll : held_) {
        if (roll.completions.empty()) {  // (the others' passes joined)
          m_.skip_pass(false, false);
          if (g_.beta > 0) m_.skip_pass(false, false);
          continue;
        }
        const Rows x = rows_of(roll);
        roll.old = logps(x);
        if (g_.beta > 0) {
          const AsReference as_reference(m_, params_, reference_);
          roll.ref = logps(x);
        }
      }
    }
    std::vector<std::vector<double>> all = agree_.gather(pack(held_));
    packed_.clear();
    if (agree_.lead()) packed_ = std::move(all);
  }

  // A rollout as numbers: per micro-batch its prompts (length, ids), then its completions (length,
  // ids, truncated, advantage, the log-probs at sampling and, with beta, the reference's).
  std::vector<double> pack(const std::vector<Rollout>& micro) const {
    std::vector<double> v{static_cast<double>(micro.size())};
    for (const Rollout& roll : micro) {
      v.push_back(static_cast<double>(roll.prompts.size()));
      for (const data::Example& e : roll.prompts) {
        v.push_back(static_cast<double>(e.ids.size()));
        v.insert(v.end(), e.ids.begin(), e.ids.end());
      }
      const at::Tensor old = roll.old.defined() ? roll.old.to(at::kCPU, at::kDouble).contiguous() : at::Tensor();
      const at::Tensor ref = roll.ref.defined() ? roll.ref.to(at::kCPU, at::kDouble).contiguous() : at::Tensor();
      for (size_t i = 0; i < roll.completions.size(); ++i) {
        const auto& c = roll.completions[i];
        v.push_back(static_cast<double>(c.size()));
        v.insert(v.end(), c.begin(), c.end());
        v.push_back(roll.truncated[i] ? 1.0 : 0.0);
        v.push_back(roll.advantages[i]);
        for (const at::Tensor& t : {old, ref})
          if (t.defined())
            v.insert(v.end(), t[static_cast<int64_t>(i)].data_ptr<double>(),
                     t[static_cast<int64_t>(i)].data_ptr<double>() + c.size());
      }
    }
    return v;
  }

  std::vector<Rollout> unpack(const std::vector<double>& v) const {
    Unpack in(v.data(), v.size());
    const int64_t vocab = m_.config().vocab_size - 1;
    const auto ids = [&](auto& out) {
      const int64_t n = in.integer(static_cast<int64_t>(v.size()));
      for (int64_t j = 0; j < n; ++j) out.push_back(static_cast<std::decay_t<decltype(out[0])>>(in.integer(vocab)));
    };
    std::vector<Rollout> micro(static_cast<size_t>(in.integer(r_.train.gradient_accumulation_steps)),
                               Rollout{.per_prompt = static_cast<size_t>(generations())});
    for (Rollout& roll : micro) {
      roll.prompts.resize(static_cast<size_t>(in.integer(r_.data.batch_size)));
      for (data::Example& e : roll.prompts) {
        ids(e.ids);
        e.labels.assign(e.ids.size(), data::kIgnoreIndex);
      }
      const size_t rows = roll.prompts.size() * static_cast<size_t>(generations());
      std::vector<std::vector<double>> old(rows), ref(rows);
      for (size_t i = 0; i < rows; ++i) {
        ids(roll.completions.emplace_back());
        if (roll.completions.back().size() > static_cast<size_t>(g_.max_completion_length))
          throw Error("a completion longer than grpo.max_completion_length");
        roll.truncated.push_back(static_cast<char>(in.integer(1)));
        roll.advantages.push_back(in.finite());
        for (auto* lp : {&old[i], g_.beta > 0 ? &ref[i] : nullptr})
          if (lp)
            for (size_t j = 0; j < roll.completions.back().size(); ++j) lp->push_back(in.finite());
      }
      if (rows == 0) continue;
      roll.old = padded(old);
      if (g_.beta > 0) roll.ref = padded(ref);
    }
    if (!in.done()) throw Error("numbers after its end");
    return micro;
  }

  // Rows of log-probs as [rows, longest] on the device, zeros after each row's end (as logps()).
  at::Tensor padded(const std::vector<std::vector<double>>& rows) const {
    size_t longest = 1;
    for (const auto& r : rows) longest = std::max(longest, r.size());
    std::vector<float> flat(rows.size() * longest, 0.0f);
    for (size_t i = 0; i < rows.size(); ++i) std::copy(rows[i].begin(), rows[i].end(), flat.begin() + i * longest);
    return at::tensor(flat, at::kFloat)
        .view({static_cast<int64_t>(rows.size()), static_cast<int64_t>(longest)})
        .to(device_);
  }

  // Where this rank's prompts of the step (micro-batch after micro-batch) stand in the step's global
  // batch: every rank's first, in rank order, then every rank's second, … (the order the epoch's
  // positions were dealt to the ranks in, so the same on 1 rank with accumulation as on N).
  void prompt_indices(const std::vector<Rollout>& micro) {
    size_t n = 0;
    for (const Rollout& roll : micro) n += roll.prompts.size();
    order_ = interleaved(agree_.gather({static_cast<double>(n)}));
    index_.clear();
    for (size_t p = 0; p < order_.size(); ++p)
      if (order_[p].first == agree_.rank()) index_.push_back(p);
  }

  // (rank, its k-th prompt) in the step's global order, from every rank's count of prompts.
  static std::vector<std::pair<int, size_t>> interleaved(const std::vector<std::vector<double>>& counts) {
    std::vector<std::pair<int, size_t>> order;
    for (size_t k = 0;; ++k) {
      const size_t before = order.size();
      for (size_t r = 0; r < counts.size(); ++r)
        if (k < static_cast<size_t>(counts[r][0])) order.emplace_back(static_cast<int>(r), k);
      if (order.size() == before) return order;
    }
  }

  // Samples each prompt's G completions; `index`: the prompts' places in the step's global batch.
  void sample(Rollout& roll, const size_t* index, uint64_t step) {
    std::vector<std::vector<int64_t>> prompts;
    std::vector<uint64_t> seeds;
    for (size_t p = 0; p < roll.prompts.size(); ++p)
      for (int64_t g = 0; g < generations(); ++g) {
        const std::vector<int32_t>& ids = roll.prompts[p].ids;
        prompts.emplace_back(ids.begin(), ids.end());
        seeds.push_back(
            model::completion_seed(static_cast<uint64_t>(r_.train.seed), step, index[p], static_cast<uint64_t>(g)));
      }
    complete(roll, prompts, seeds, {.temperature = g_.temperature, .top_k = g_.top_k, .top_p = g_.top_p});
  }

  // The completions of `prompts` (a rollout's rows) drawn `how` with `seeds`, and which were cut short.
  void complete(Rollout& roll, const std::vector<std::vector<int64_t>>& prompts, const std::vector<uint64_t>& seeds,
                const model::Sampling& how) const {
    model::GenerateOptions opt{.max_new_tokens = g_.max_completion_length, .sampling = how, .eos_id = eos_};
    if (r_.dist.shard_base) opt.any_running = [this](bool mine) { return agree_.any(mine); };
    const Sampling sampling(m_);
    roll.completions = model::generate(m_, prompts, seeds, opt);
    for (const auto& c : roll.completions) roll.truncated.push_back(c.empty() || !eos_ || c.back() != *eos_);
  }

  // Each completion's rewards: decoded without special tokens, as TRL gives them to reward functions.
  void score(Rollout& roll) const {
    const size_t F = rewards_.size(), rows = roll.completions.size();
    roll.scores.assign(rows * F, kNaN);
    std::vector<std::string> texts(rows);
    for (size_t i = 0; i < rows; ++i) {
      const std::vector<int32_t> ids(roll.completions[i].begin(), roll.completions[i].end());
      texts[i] = tok_.decode(ids, /*skip_special_tokens=*/true);
    }
    for (size_t f = 0; f < F; ++f) {
      if (commands_[f]) {
        std::vector<nlohmann::json> items;
        for (size_t i = 0; i < rows; ++i) items.push_back(command_item(rewards_[f].spec(), roll, i, texts[i]));
        const std::vector<double> got = rows ? commands_[f]->score(items) : std::vector<double>{};
        for (size_t i = 0; i < rows; ++i) roll.scores[i * F + f] = got[i];
        continue;
      }
      for (size_t i = 0; i < rows; ++i)
        roll.scores[i * F + f] = rewards_[f].score(texts[i], static_cast<int64_t>(roll.completions[i].size()),
                                                   *roll.prompts[i / roll.per_prompt].document);
    }
  }

  // A command reward's line for completion `i`: the prompt as the document holds it (else as rendered),
  // the completion, and the document's fields the reward names.
  nlohmann::json command_item(const RewardSpec& spec, const Rollout& roll, size_t i, const std::string& text) const {
    const data::Example& e = roll.prompts[i / roll.per_prompt];
    const data::Document& doc = *e.document;
    nlohmann::json item = nlohmann::json::object();
    const auto it = doc.find(r_.data.prompt_field);
    item["prompt"] = it != doc.end() && r_.data.prompt_template.empty() ? nlohmann::json::parse(it->dump())
                                                                        : nlohmann::json(tok_.decode(e.ids, false));
    item["completion"] = text;
    for (const std::string& f : spec.fields) item[f] = nlohmann::json::parse(doc.at(f).dump());
    return item;
  }

  // Every rank's rewards gathered in the step's global order; the advantages of this rank's
  // completions, and the step's counts and figures.
  Step advantage(std::vector<Rollout>& micro, int64_t step) {
    const size_t F = rewards_.size(), G = static_cast<size_t>(generations()), per = F + 2;
    std::vector<double> mine;  // per completion, in this rank's order: its rewards, length, truncated
    for (const Rollout& roll : micro)
      for (size_t i = 0; i < roll.completions.size(); ++i) {
        mine.insert(mine.end(), roll.scores.begin() + static_cast<std::ptrdiff_t>(i * F),
                    roll.scores.begin() + static_cast<std::ptrdiff_t>((i + 1) * F));
        mine.push_back(static_cast<double>(roll.completions[i].size()));
        mine.push_back(roll.truncated[i] ? 1.0 : 0.0);
      }
    const std::vector<std::vector<double>> all = agree_.gather(mine);
    const size_t N = order_.size() * G;
    std::vector<double> per_reward(N * F), total(N), length(N), truncated(N);
    for (size_t p = 0; p < order_.size(); ++p) {
      const auto& [rank, k] = order_[p];
      for (size_t g = 0; g < G; ++g) {
        const double* row = all[static_cast<size_t>(rank)].data() + (k * G + g) * per;
        const size_t i = p * G + g;
        double sum = 0;
        bool any = false;
        for (size_t f = 0; f < F; ++f) {
          per_reward[i * F + f] = row[f];
          if (std::isnan(row[f])) continue;
          sum += rewards_[f].spec().weight * row[f];
          any = true;
        }
        total[i] = any ? sum : kNaN;  // (every reward unscorable: advantaged 0)
        length[i] = row[F];
        truncated[i] = row[F + 1];
      }
    }
    const at::Tensor rewards = at::tensor(std::vector<float>(total.begin(), total.end()), at::kFloat);
    const Advantages adv = group_advantages(rewards, static_cast<int64_t>(G), scale_of(g_.scale_rewards));
    const at::Tensor advantages = adv.advantages.to(at::kDouble).contiguous();
    const double* a = advantages.data_ptr<double>();
    size_t k = 0;
    for (Rollout& roll : micro)
      for (size_t p = 0; p < roll.prompts.size(); ++p, ++k)
        for (size_t g = 0; g < G; ++g) roll.advantages.push_back(a[index_[k] * G + g]);
    Step s;
    s.counts.completions = static_cast<double>(N);
    for (size_t i = 0; i < N; ++i)
      if (!(g_.mask_truncated_completions && truncated[i] > 0)) s.counts.tokens += length[i];
    s.figures = step_figures(total, per_reward, length, truncated, adv.std_zero.to(at::kDouble).mean().item<double>());
    if (g_.log_completions) log(step, micro, per_reward, total, advantages);
    return s;
  }

  std::vector<double> step_figures(const std::vector<double>& total, const std::vector<double>& per_reward,
                                   const std::vector<double>& length, const std::vector<double>& truncated,
                                   double zero_std) const {
    const auto [reward, reward_std] = nan_mean_std(total);
    double len_sum = 0, len_min = kNaN, len_max = kNaN, cut = 0, term_sum = 0, term_n = 0;
    double term_min = kNaN, term_max = kNaN;
    for (size_t i = 0; i < length.size(); ++i) {
      len_sum += length[i];
      len_min = std::isnan(len_min) ? length[i] : std::min(len_min, length[i]);
      len_max = std::isnan(len_max) ? length[i] : std::max(len_max, length[i]);
      if (truncated[i] > 0) {
        ++cut;
        continue;
      }
      term_sum += length[i], ++term_n;
      term_min = std::isnan(term_min) ? length[i] : std::min(term_min, length[i]);
      term_max = std::isnan(term_max) ? length[i] : std::max(term_max, length[i]);
    }
    const double n = std::max<double>(static_cast<double>(length.size()), 1);
    // (none terminated: TRL logs 0s)
    std::vector<double> out = {reward,
                               reward_std,
                               zero_std,
                               len_sum / n,
                               len_min,
                               len_max,
                               cut / n,
                               term_n ? term_sum / term_n : 0.0,
                               term_n ? term_min : 0.0,
                               term_n ? term_max : 0.0,
                               1.0};  // (kSampled)
    const size_t F = rewards_.size();
    for (size_t f = 0; f < F; ++f) {
      std::vector<double> col;
      for (size_t i = 0; i < total.size(); ++i) col.push_back(per_reward[i * F + f]);
      const auto [mean, std] = nan_mean_std(col);
      out.push_back(mean);
      out.push_back(std);
    }
    return out;
  }

  // grpo.log_completions: every rank's prompts and completions (their ids) gathered, and rank 0
  // appends the step's rows in its global order to <output_dir>/completions.jsonl. The first step
  // this process logs keeps the rows of the steps before it (a resume's) and drops any later ones.
  void log(int64_t step, const std::vector<Rollout>& micro, const std::vector<double>& per_reward,
           const std::vector<double>& total, const at::Tensor& advantages) {
    std::vector<double> mine;  // per completion: its prompt's length and ids, its length and ids
    for (const Rollout& roll : micro)
      for (size_t i = 0; i < roll.completions.size(); ++i) {
        const std::vector<int32_t>& prompt = roll.prompts[i / static_cast<size_t>(generations())].ids;
        mine.push_back(static_cast<double>(prompt.size()));
        mine.insert(mine.end(), prompt.begin(), prompt.end());
        mine.push_back(static_cast<double>(roll.completions[i].size()));
        mine.insert(mine.end(), roll.completions[i].begin(), roll.completions[i].end());
      }
    const std::vector<std::vector<double>> all = agree_.gather(mine);
    if (!agree_.lead()) return;
    const size_t G = static_cast<size_t>(generations()), F = rewards_.size();
    std::vector<std::vector<std::pair<std::vector<int32_t>, std::vector<int32_t>>>> rows(all.size());  // by rank
    for (size_t r = 0; r < all.size(); ++r)
      for (size_t at = 0; at < all[r].size();) {
        const auto take = [&] {
          const auto n = static_cast<size_t>(all[r][at]);
          std::vector<int32_t> ids(all[r].begin() + static_cast<std::ptrdiff_t>(at + 1),
                                   all[r].begin() + static_cast<std::ptrdiff_t>(at + 1 + n));
          at += 1 + n;
          return ids;
        };
        auto prompt = take();
        rows[r].emplace_back(std::move(prompt), take());
      }
    if (!log_.is_open()) {
      std::filesystem::create_directories(r_.checkpoint.output_dir);  // (a job's adapter's, before its first save)
      const std::string path = (std::filesystem::path(r_.checkpoint.output_dir) / "completions.jsonl").string();
      std::string kept, line;
      for (std::ifstream in(path); std::getline(in, line);) {
        const nlohmann::json row = nlohmann::json::parse(line, nullptr, false);
        if (row.is_object() && row.value("step", int64_t{0}) < step) kept += line + "\n";
      }
      io::write_file_atomic(path, kept);
      log_ = io::OutFile(path, io::OutFile::Mode::Append);
    }
    const auto number = [](double v) { return std::isnan(v) ? nlohmann::json(nullptr) : nlohmann::json(v); };
    const double* a = advantages.data_ptr<double>();
    std::string out;
    for (size_t p = 0; p < order_.size(); ++p)
      for (size_t g = 0; g < G; ++g) {
        const auto& [prompt, completion] = rows[static_cast<size_t>(order_[p].first)][order_[p].second * G + g];
        const size_t i = p * G + g;
        nlohmann::json rewards = nlohmann::json::object();
        for (size_t f = 0; f < F; ++f) rewards[rewards_[f].spec().name] = number(per_reward[i * F + f]);
        const nlohmann::json row = {{"step", step},
                                    {"index", p},
                                    {"generation", g},
                                    {"prompt", tok_.decode(prompt, false)},
                                    {"completion", tok_.decode(completion, true)},
                                    {"completion_ids", completion},
                                    {"rewards", rewards},
                                    {"reward", number(total[i])},
                                    {"advantage", a[i]}};
        out += row.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
      }
    log_.write(out);
  }

  // The micro-batch's completions through the policy (and the reference, with grpo.beta, unless the
  // rollout holds its log-probs), the loss backward, normalised by the rollout's counts over every rank.
  void train(const Rollout& roll, Sums& sums) {
    const bool reference_pass = g_.beta > 0 && g_.num_iterations == 1;  // (else keep_log_probs' pass)
    if (roll.completions.empty()) {  // the others' passes joined (shard_base, the gradients' all-reduce)
      if (reference_pass) m_.skip_pass(false, false);
      m_.skip_pass(true, false);
      return;
    }
    const Rows x = rows_of(roll);
    at::Tensor ref = roll.ref;
    if (reference_pass) {
      const c10::NoGradGuard no_grad;
      const AsReference as_reference(m_, params_, reference_);
      ref = logps(x);
    }
    const at::Tensor policy = logps(x);
    const at::Tensor adv = at::tensor(roll.advantages, at::kDouble).to(at::kFloat).to(device_);
    const GrpoLoss l = grpo_loss(policy, roll.old, ref, x.mask, adv, cfg_, counts_);
    l.loss.backward();
    sums.loss += l.loss.detach();
    sums.stats.narrow(0, 0, kFigures).add_(l.figures.to(device_));
    sums.tokens += static_cast<int64_t>(l.figures[kTokens].item<double>());
    sums.real += x.b.real;
    sums.slots += x.b.slots;
  }

  Rows rows_of(const Rollout& roll) const {
    std::vector<data::Example> rows;
    std::vector<int64_t> ri, ci;
    std::vector<float> keep;
    Rows x;
    for (size_t i = 0; i < roll.completions.size(); ++i) {
      const data::Example& prompt = roll.prompts[i / roll.per_prompt];
      data::Example e;
      e.ids = prompt.ids;
      e.labels.assign(prompt.ids.size(), data::kIgnoreIndex);
      const auto& c = roll.completions[i];
      for (size_t j = 0; j < c.size(); ++j) {
        e.ids.push_back(static_cast<int32_t>(c[j]));
        e.labels.push_back(static_cast<int32_t>(c[j]));
        ri.push_back(static_cast<int64_t>(i));
        ci.push_back(static_cast<int64_t>(j));
      }
      x.longest = std::max(x.longest, static_cast<int64_t>(c.size()));
      keep.push_back(g_.mask_truncated_completions && roll.truncated[i] ? 0.0f : 1.0f);
      rows.push_back(std::move(e));
    }
    x.b = data::collate(rows, false, 0, device_);
    x.B = static_cast<int64_t>(rows.size());
    x.row = at::tensor(ri, at::kLong).to(device_);
    x.col = at::tensor(ci, at::kLong).to(device_);
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device_);
    x.mask = at::zeros({x.B, x.longest}, f32).index_put_({x.row, x.col}, at::ones({}, f32)) *
             at::tensor(keep, at::kFloat).to(device_).unsqueeze(1);
    return x;
  }

  // [B, longest] each completion token's log-prob, the logits divided by grpo.temperature (TRL's).
  at::Tensor logps(const Rows& x) {
    const at::Tensor hidden = m_.hidden_states(x.b.ids, x.b.mask);
    const at::Tensor tok = model::lm_head_token_losses(hidden, m_.lm_head(), x.b.rows, x.b.targets,
                                                       m_.config().logit_softcap, g_.temperature);
    return at::zeros({x.B, x.longest}, tok.options()).index_put({x.row, x.col}, tok.neg());
  }

  const recipe::Recipe& r_;
  const recipe::GrpoSection& g_;
  model::CausalLM& m_;
  const Agreement& agree_;
  const c10::Device device_;
  const tok::Tokenizer& tok_;
  const GrpoLossConfig cfg_;
  std::vector<Reward> rewards_;
  std::vector<std::unique_ptr<RewardCommand>> commands_;  // by reward: its program (null: a built-in kind)
  std::vector<at::Tensor> params_, reference_;            // the adapter's tensors; the reference's values
  std::optional<int64_t> eos_;
  std::vector<std::pair<int, size_t>> order_;  // the step's prompts: (rank, its k-th) in global order
  std::vector<size_t> index_;                  // ... where this rank's stand in it
  io::OutFile log_;                            // grpo.log_completions' file, once opened
  std::vector<Rollout> held_;                  // the rollout the steps train on: by micro-batch
  int64_t sampled_at_ = -1;                    // ... the step that sampled it (-1: none)
  GrpoStepCounts counts_;                      // ... its counts over every rank
  std::vector<std::vector<double>> packed_;    // (rank 0) every rank's, for the resumable state
  const Evaluator evaluator_{*this};
};

}  // namespace

std::unique_ptr<Objective> make_grpo(const recipe::Recipe& r, model::CausalLM& m,
                                     const std::vector<std::pair<std::string, at::Tensor>>& named,
                                     const Agreement& agree, c10::Device device, const tok::Tokenizer& tokenizer) {
  return std::make_unique<Grpo>(r, m, named, agree, device, tokenizer);
}

std::function<std::string(const data::Document&)> reward_check(const recipe::Recipe& r) {
  auto rewards = std::make_shared<const std::vector<Reward>>(rewards_of(r));
  return [rewards](const data::Document& doc) {
    for (const Reward& reward : *rewards)
      if (std::string why = reward.check(doc); !why.empty()) return why;
    return std::string();
  };
}

}  // namespace lorarun::train
