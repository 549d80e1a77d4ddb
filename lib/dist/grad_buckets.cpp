#include "dist/grad_buckets.hpp"

#include <ATen/ATen.h>

namespace lorarun::dist {

GradBuckets::GradBuckets(ProcessGroup& pg, std::vector<at::Tensor> params, int64_t bucket_elems)
    : pg_(pg), params_(std::move(params)) {
  if (pg.size() == 1 || params_.empty()) return;
  bucket_of_.resize(params_.size()), offset_.resize(params_.size()), filled_.resize(params_.size());
  int64_t size = 0;
  for (size_t k = params_.size(); k-- > 0;) {  // last parameter first: backward's order
    if (buckets_.empty() || size >= bucket_elems) {
      buckets_.emplace_back();
      size = 0;
    }
    bucket_of_[k] = buckets_.size() - 1;
    offset_[k] = static_cast<size_t>(size);
    buckets_.back().params.push_back(k);
    size += params_[k].numel();
    if (k == 0 || size >= bucket_elems) buckets_.back().flat = at::empty({size}, params_[k].options());
  }
  for (size_t k = 0; k < params_.size(); ++k)
    hooks_.push_back(params_[k].register_hook([this, k](const at::Tensor& g) { on_grad(k, g); }));
}

GradBuckets::~GradBuckets() {
  for (size_t k = 0; k < hooks_.size(); ++k) params_[k].remove_hook(hooks_[k]);
}

void GradBuckets::arm() {
  std::lock_guard lock(mutex_);
  armed_ = !buckets_.empty();
}

void GradBuckets::on_grad(size_t i, const at::Tensor& g) {
  std::lock_guard lock(mutex_);
  if (!armed_ || filled_[i]) return;
  fill(i, &g);
  start_complete_in_order();
}

// The bucket slot of parameter i = what earlier micro-batches accumulated + `g` (if any).
void GradBuckets::fill(size_t i, const at::Tensor* g) {
  const at::Tensor& p = params_[i];
  at::Tensor slot = buckets_[bucket_of_[i]].flat.narrow(0, static_cast<int64_t>(offset_[i]), p.numel()).view_as(p);
  const at::Tensor& acc = p.grad();
  if (g && acc.defined())
    at::add_out(slot, acc, *g);
  else if (g)
    slot.copy_(*g);
  else if (acc.defined())
    slot.copy_(acc);
  else
    slot.zero_();
  filled_[i] = true;
  ++buckets_[bucket_of_[i]].filled;
}

// Buckets start strictly in index order, so every rank issues the same sequence of collectives.
void GradBuckets::start_complete_in_order() {
  while (next_start_ < buckets_.size() && buckets_[next_start_].filled == buckets_[next_start_].params.size()) {
    Bucket& b = buckets_[next_start_++];
    b.pending.emplace(pg_.all_reduce_sum_async(b.flat));
  }
}

void GradBuckets::finish() {
  if (buckets_.empty()) return;
  {
    std::lock_guard lock(mutex_);
    for (size_t k = 0; k < params_.size(); ++k)
      if (!filled_[k]) fill(k, nullptr);  // no gradient this time: what is accumulated, or zeros
    start_complete_in_order();
    armed_ = false;
  }
  for (Bucket& b : buckets_) {
    b.pending->wait();
    b.pending.reset();
    b.filled = 0;
    for (size_t k : b.params) {
      at::Tensor& p = params_[k];
      const at::Tensor sum = b.flat.narrow(0, static_cast<int64_t>(offset_[k]), p.numel()).view_as(p);
      if (p.grad().defined())
        p.mutable_grad().copy_(sum);
      else
        p.mutable_grad() = sum.clone();
      filled_[k] = false;
    }
  }
  next_start_ = 0;
}

}  // namespace lorarun::dist
