// Examples -> a micro-batch on the device: token rows, their mask, and the positions that
// predict a trained token (labels shifted by one, never across a document boundary).
#pragma once
#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <cstdint>
#include <vector>

#include "data/example.hpp"

namespace lorarun::data {

// A micro-batch: rows of token ids [R, T] with their mask (1 = token, 0 = padding; packed: the
// document's number within its row, from 1), and the N flat positions of [R*T] whose next token
// is trained (`rows`, int64 [N]) with those tokens (`targets`, int64 [N]).
struct Batch {
  at::Tensor ids, mask, rows, targets;
  int64_t tokens = 0;  // trained tokens (N)
  int64_t real = 0;    // document tokens
  int64_t slots = 0;   // row slots (R*T): slots - real is padding
};

// One row per example, right-padded to the longest; or, `packed`, the examples share rows of
// `capacity` tokens (first-fit decreasing; a longer example gets a row of its own), padded to
// the fullest row. Position k predicts labels[k + 1] of its own example.
Batch collate(const std::vector<Example>& examples, bool packed, size_t capacity, c10::Device device);

// Micro-batches of several adapters (adapters:) as one: their rows stacked in order and
// right-padded to the longest (padding id 0, mask 0); part k keeps rows [row0, row0 + rows) and
// its first `length` positions, and its trained positions renumbered into the stack.
struct Stacked {
  struct Part {
    int64_t row0 = 0, rows = 0, length = 0;
    at::Tensor flat_rows, targets;  // int64 [N]: positions of the stack viewed as [R*T], their targets
  };
  at::Tensor ids, mask;     // [R, T]
  std::vector<Part> parts;  // one per batch given, in order (rows 0 for an empty one)
};
Stacked stack(const std::vector<Batch>& batches);

// Host vector -> int64 tensor of `shape` on `device`; through pinned memory, without blocking,
// on CUDA.
at::Tensor upload(const std::vector<int64_t>& v, at::IntArrayRef shape, c10::Device device);

}  // namespace lorarun::data
