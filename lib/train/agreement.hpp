// What the ranks agree on, as collectives every rank calls alike, so that one rank's failure or
// stop request reaches all of them and none waits for ever in the next collective.
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <exception>
#include <string>
#include <vector>

namespace lorarun::dist {
class ProcessGroup;
}

namespace lorarun::train {

class Agreement {
 public:
  Agreement(dist::ProcessGroup& pg, int rank, int world, at::Device device);

  // Rank 0's verdict on something only it did (a write, a restore): every rank learns whether it
  // worked (`ok`); on failure rank 0 throws `cause` when given, else Error "<what> failed: <why>",
  // and the others a PeerError naming rank 0.
  void rank0_ok(bool ok, const std::string& why, const std::string& what, std::exception_ptr cause = nullptr) const;
  // Whether every rank holds this same value (each puts it in its own slot of a sum).
  bool same(double value) const;
  // Whether `flag` is set on any rank.
  bool any(bool flag) const;
  // Sums `t` (on the ranks' device) over the ranks, in place (nothing to do on one rank).
  void sum(at::Tensor& t) const;
  // Every rank's `mine` (the same size on each), as rows [world, n] of float32 in rank order.
  at::Tensor rows(const at::Tensor& mine) const;
  // Every rank's `mine` (of any length on each), exactly (float64: integers below 2^53), in rank order.
  std::vector<std::vector<double>> gather(const std::vector<double>& mine) const;

  int rank() const { return rank_; }
  int world() const { return world_; }
  bool lead() const { return rank_ == 0; }
  const at::Device& device() const { return device_; }

 private:
  dist::ProcessGroup& pg_;
  int rank_, world_;
  at::Device device_;
};

}  // namespace lorarun::train
