// LoRA gradients summed over ranks in buckets, each all-reduced as soon as backward has produced
// every gradient in it, so communication overlaps the rest of backward (DDP's reducer, small).
#pragma once
#include <ATen/core/Tensor.h>
#include <cstdint>
#include <mutex>
#include <optional>
#include <vector>

#include "dist/process_group.hpp"

namespace lorarun::dist {

class GradBuckets {
 public:
  // `params` in model order; buckets of about `bucket_elems` elements, filled from the last
  // parameter backwards (the order backward produces them). World size 1: does nothing.
  GradBuckets(ProcessGroup& pg, std::vector<at::Tensor> params, int64_t bucket_elems);
  ~GradBuckets();
  GradBuckets(const GradBuckets&) = delete;
  GradBuckets& operator=(const GradBuckets&) = delete;

  // Call before the backward of a step's last micro-batch: from then on each gradient goes
  // (added to what earlier micro-batches accumulated) into its bucket.
  void arm();
  // After that backward (or instead of it, when this rank had nothing to compute): starts the
  // buckets not started yet, waits for all, and sets every .grad to the sum over ranks.
  void finish();
  size_t buckets() const { return buckets_.size(); }

 private:
  struct Bucket {
    at::Tensor flat;             // the bucket's gradients, back to back
    std::vector<size_t> params;  // indices into params_
    size_t filled = 0;
    std::optional<ProcessGroup::Pending> pending;
  };
  void on_grad(size_t i, const at::Tensor& g);
  void fill(size_t i, const at::Tensor* g);
  void start_complete_in_order();

  ProcessGroup& pg_;
  std::vector<at::Tensor> params_;
  std::vector<Bucket> buckets_;
  std::vector<size_t> bucket_of_, offset_;
  std::vector<bool> filled_;
  std::vector<unsigned> hooks_;
  size_t next_start_ = 0;
  bool armed_ = false;
  std::mutex mutex_;  // hooks may run on autograd's device threads
};

}  // namespace lorarun::dist
