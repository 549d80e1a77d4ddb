#include "train/agreement.hpp"

#include <ATen/ATen.h>
#include <fmt/format.h>

#include "dist/process_group.hpp"
#include "util/error.hpp"

namespace lorarun::train {

Agreement::Agreement(dist::ProcessGroup& pg, int rank, int world, at::Device device)
    : pg_(pg), rank_(rank), world_(world), device_(device) {}

void Agreement::sum(at::Tensor& t) const {
  if (world_ > 1) pg_.all_reduce_sum(t);
}

void Agreement::rank0_ok(bool ok, const std::string& why, const std::string& what, std::exception_ptr cause) const {
  at::Tensor failed = at::full({1}, ok ? 0.0 : 1.0, at::TensorOptions().dtype(at::kFloat).device(device_));
  sum(failed);
  if (failed.item<double>() == 0) return;
  if (lead() && cause) std::rethrow_exception(cause);
  if (lead()) throw Error(fmt::format("{} failed: {}", what, why));
  // A consequence of rank 0's error, which the launcher's summary then names (blamed rank -1: a peer).
  throw PeerError(-1, fmt::format("{} failed on rank 0; stopping", what));
}

bool Agreement::same(double value) const {
  at::Tensor slots = at::zeros({world_}, at::TensorOptions().dtype(at::kDouble).device(device_));
  slots[rank_].fill_(value);
  sum(slots);
  return (slots.cpu() == value).all().item<bool>();
}

bool Agreement::any(bool flag) const {
  if (world_ == 1) return flag;
  at::Tensor t = at::full({1}, flag ? 1.0f : 0.0f, at::TensorOptions().dtype(at::kFloat).device(device_));
  sum(t);
  return t.item<float>() > 0;
}

at::Tensor Agreement::rows(const at::Tensor& mine) const {
  at::Tensor all = at::zeros({world_, mine.numel()}, at::TensorOptions().dtype(at::kFloat).device(device_));
  all[rank_].copy_(mine.reshape(-1).to(at::kFloat));
  sum(all);
  return all;
}

std::vector<std::vector<double>> Agreement::gather(const std::vector<double>& mine) const {
  if (world_ == 1) return {mine};
  const auto f64 = at::TensorOptions().dtype(at::kDouble).device(device_);
  at::Tensor sizes = at::zeros({world_}, f64);
  sizes[rank_].fill_(static_cast<double>(mine.size()));
  sum(sizes);
  sizes = sizes.cpu();
  at::Tensor all = at::zeros({world_, sizes.max().item<int64_t>()}, f64);
  all[rank_].narrow(0, 0, static_cast<int64_t>(mine.size())).copy_(at::tensor(mine, at::kDouble));
  sum(all);
  all = all.cpu().contiguous();
  std::vector<std::vector<double>> out;
  for (int r = 0; r < world_; ++r) {
    const double* row = all[r].data_ptr<double>();
    out.emplace_back(row, row + sizes[r].item<int64_t>());
  }
  return out;
}

}  // namespace lorarun::train
