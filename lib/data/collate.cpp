#include "data/collate.hpp"

#include <ATen/ATen.h>
#include <algorithm>

#include "data/batches.hpp"

namespace lorarun::data {

at::Tensor upload(const std::vector<int64_t>& v, at::IntArrayRef shape, c10::Device device) {
  const auto opts = at::TensorOptions().dtype(at::kLong).pinned_memory(device.is_cuda());
  at::Tensor host = at::empty(shape, opts);
  std::copy(v.begin(), v.end(), host.data_ptr<int64_t>());
  return device.is_cuda() ? host.to(device, /*non_blocking=*/true) : host;
}

namespace {

// Which examples share each row: one each, or packed first-fit decreasing.
std::vector<std::vector<size_t>> row_layout(const std::vector<Example>& examples, bool packed, size_t capacity) {
  std::vector<std::vector<size_t>> layout;
  if (!packed) {
    for (size_t i = 0; i < examples.size(); ++i) layout.push_back({i});
    return layout;
  }
  std::vector<size_t> lengths;
  for (const Example& e : examples) lengths.push_back(e.ids.size());
  return pack_rows(lengths, std::max(capacity, *std::max_element(lengths.begin(), lengths.end())));
}

}  // namespace

Batch collate(const std::vector<Example>& examples, bool packed, size_t capacity, c10::Device device) {
  Batch b;
  if (examples.empty()) return b;
  const std::vector<std::vector<size_t>> layout = row_layout(examples, packed, capacity);
  size_t T = 0;
  for (const auto& row : layout) {
    size_t n = 0;
    for (size_t i : row) n += examples[i].ids.size();
    T = std::max(T, n);
  }
  const size_t R = layout.size();
  std::vector<int64_t> ids(R * T, 0);
  std::vector<int64_t> mask(R * T, 0);
  std::vector<int64_t> rows;
  std::vector<int64_t> targets;
  for (size_t r = 0; r < R; ++r) {
    size_t at = r * T;
    int64_t doc = 1;
    for (size_t i : layout[r]) {
      const Example& e = examples[i];
      for (size_t k = 0; k < e.ids.size(); ++k) {
        ids[at] = e.ids[k];
        mask[at] = packed ? doc : 1;
        if (k + 1 < e.ids.size() && e.labels[k + 1] != kIgnoreIndex) {
          rows.push_back(static_cast<int64_t>(at));
          targets.push_back(e.labels[k + 1]);
        }
        ++at;
      }
      b.real += static_cast<int64_t>(e.ids.size());
      ++doc;
    }
  }
  const std::vector<int64_t> shape{static_cast<int64_t>(R), static_cast<int64_t>(T)};
  b.ids = upload(ids, shape, device);
  b.mask = upload(mask, shape, device);
  b.tokens = static_cast<int64_t>(rows.size());
  b.slots = static_cast<int64_t>(R * T);
  b.rows = upload(rows, {b.tokens}, device);
  b.targets = upload(targets, {b.tokens}, device);
  return b;
}

Stacked stack(const std::vector<Batch>& batches) {
  Stacked out;
  int64_t T = 0, R = 0;
  for (const Batch& b : batches)
    if (b.ids.defined()) T = std::max(T, b.ids.size(1));
  std::vector<at::Tensor> ids, mask;
  for (const Batch& b : batches) {
    Stacked::Part p;
    p.row0 = R;
    if (b.ids.defined()) {
      const int64_t t = b.ids.size(1);
      p.rows = b.ids.size(0);
      p.length = t;
      ids.push_back(at::constant_pad_nd(b.ids, {0, T - t}, 0));
      mask.push_back(at::constant_pad_nd(b.mask, {0, T - t}, 0));
      p.flat_rows = (at::floor_divide(b.rows, t) + R) * T + b.rows.remainder(t);  // [r, k] of [rows, t] -> [R*T]
      p.targets = b.targets;
      R += p.rows;
    }
    out.parts.push_back(std::move(p));
  }
  if (!ids.empty()) {
    out.ids = at::cat(ids);
    out.mask = at::cat(mask);
  }
  return out;
}

}  // namespace lorarun::data
