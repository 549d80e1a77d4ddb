// GRPO's loss against TRL 1.16's GRPOTrainer._compute_loss on the same completion log-probs: the
// loss, its gradient with respect to every log-prob, and the figures TRL logs (kl, clip ratios).
#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <catch2/catch.hpp>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "io/safetensors.hpp"
#include "model/weights.hpp"
#include "support/oracle.hpp"
#include "support/process.hpp"
#include "train/grpo.hpp"

using namespace lorarun;
using namespace lorarun::train;

namespace {

io::TensorBytes bytes(const std::string& name, const at::Tensor& t) {
  return {name, io::DType::F32, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.nbytes())};
}

// The largest of |a - b| over the elements both hold finite (NaN where either is NaN counts as
// equal only when both are).
double worst(const at::Tensor& a, const at::Tensor& b) {
  REQUIRE(at::equal(a.isnan(), b.isnan()));
  const at::Tensor both = a.isnan().logical_not();
  return both.any().item<bool>() ? (a.index({both}) - b.index({both})).abs().max().item<double>() : 0.0;
}

}  // namespace

TEST_CASE("grpo: the loss, its gradient and TRL's figures equal GRPOTrainer's for every loss type and level",
          "[reference]") {
  const std::string dir = test::temp_dir("grpo-loss");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(3);
  constexpr int64_t kB = 8, kT = 7;
  const at::Tensor logps = at::log(at::rand({kB, kT}, gen) * 0.95 + 0.05);
  const at::Tensor old_logps = logps + at::randn({kB, kT}, gen) * 0.25;
  const at::Tensor ref_logps = logps + at::randn({kB, kT}, gen) * 0.3;
  const at::Tensor lengths = at::tensor(std::vector<int64_t>{7, 6, 5, 0, 7, 1, 3, 2});
  const at::Tensor mask = (at::arange(kT).unsqueeze(0) < lengths.unsqueeze(1)).to(at::kFloat);
  // two groups of 4: one with a spread of rewards, one where all are equal (no signal: advantages 0)
  const at::Tensor rewards = at::tensor(std::vector<float>{1, 0, 1, 0.5, 2, 2, 2, 2});
  const Advantages adv = group_advantages(rewards, 4, ScaleRewards::Group);
  CHECK(adv.advantages.narrow(0, 4, 4).abs().max().item<double>() == 0.0);
  CHECK(adv.std_zero.to(at::kFloat).mean().item<double>() == 0.5);
  io::write_safetensors(dir + "/in.safetensors",
                        {bytes("logps", logps), bytes("old_logps", old_logps), bytes("ref_logps", ref_logps),
                         bytes("mask", mask), bytes("advantages", adv.advantages)});

  struct Case {
    std::string type;
    bool sequence;
    double beta;
    bool old, correction;
  };
  std::vector<Case> cases;
  for (const char* type : {"grpo", "dr_grpo", "dapo", "bnpo"})
    for (const bool sequence : {false, true})
      for (const double beta : {0.0, 0.04})
        for (const bool old : {true, false}) cases.push_back({type, sequence, beta, old, true});
  cases.push_back({"dapo", false, 0.04, true, false});  // the KL term without the importance weight
  nlohmann::json configs = nlohmann::json::array();
  for (const Case& c : cases)
    configs.push_back({{"loss_type", c.type},
                       {"importance_sampling_level", c.sequence ? "sequence" : "token"},
                       {"beta", c.beta},
                       {"epsilon", 0.2},
                       {"epsilon_high", 0.28},
                       {"max_completion_length", kT},
                       {"use_bias_correction_kl", c.correction},
                       {"old", c.old}});
  std::ofstream(dir + "/configs.json") << configs.dump();
  const test::Oracle ref =
      test::oracle(fmt::format("'{}' '{}/tests/reference/grpo_reference.py' loss '{}/in.safetensors' '{}/configs.json' "
                               "'{}/out.safetensors' 2>&1",
                               LORARUN_PYTHON, LORARUN_SOURCE_DIR, dir, dir, dir));
  INFO(ref.run.output);
  REQUIRE(ref.fields.contains("metrics"));
  const auto expected = model::WeightFiles::open_file(dir + "/out.safetensors");
  const GrpoStepCounts step{static_cast<double>(kB), mask.sum().item<double>()};
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    INFO(c.type << (c.sequence ? ", sequence level" : ", token level") << ", beta " << c.beta
                << (c.old ? ", old log-probs" : ", one iteration") << (c.correction ? "" : ", no KL correction"));
    GrpoLossConfig cfg;
    cfg.type = *grpo_loss_type(c.type);
    cfg.sequence_level = c.sequence;
    cfg.beta = c.beta;
    cfg.kl_bias_correction = c.correction;
    cfg.epsilon_low = 0.2;
    cfg.epsilon_high = 0.28;
    cfg.max_completion_length = kT;
    const at::Tensor leaf = logps.clone().requires_grad_(true);
    const GrpoLoss ours = grpo_loss(leaf, c.old ? old_logps : at::Tensor(), c.beta ? ref_logps : at::Tensor(), mask,
                                    adv.advantages, cfg, step);
    ours.loss.backward();
    const double loss = expected.load(fmt::format("loss_{}", i), at::kFloat, at::kCPU).item<double>();
    const at::Tensor grad = expected.load(fmt::format("grad_{}", i), at::kFloat, at::kCPU);
    CHECK(std::abs(ours.loss.item<double>() - loss) <= 1e-6 * std::max(1.0, std::abs(loss)));
    CHECK(worst(leaf.grad(), grad) <= 1e-6 * std::max(1e-3, grad.abs().max().item<double>()));
    CHECK(grad.abs().max().item<double>() > 0);  // a gradient that matters

    const nlohmann::json& m = ref.fields["metrics"][i];
    const at::Tensor f = ours.figures;
    const double clip_count = f[c.sequence ? kCompletions : kTokens].item<double>();
    if (c.beta != 0) CHECK(std::abs(f[kKl].item<double>() / f[kTokens].item<double>() - m["kl"].get<double>()) <= 1e-6);
    CHECK(std::abs(f[kClipLow].item<double>() / clip_count - m["clip_ratio/low_mean"].get<double>()) <= 1e-6);
    CHECK(std::abs(f[kClipHigh].item<double>() / clip_count - m["clip_ratio/high_mean"].get<double>()) <= 1e-6);
    CHECK(std::abs(f[kClipRegion].item<double>() / clip_count - m["clip_ratio/region_mean"].get<double>()) <= 1e-6);
    const at::Tensor low = ours.clipped.select(1, 0), high = ours.clipped.select(1, 1);
    CHECK(std::abs(low.index({low.isnan().logical_not()}).min().item<double>() -
                   m["clip_ratio/low_min"].get<double>()) <= 1e-6);
    CHECK(std::abs(high.index({high.isnan().logical_not()}).max().item<double>() -
                   m["clip_ratio/high_max"].get<double>()) <= 1e-6);
  }
}
