// Collation: examples -> token rows, mask, and the flat positions that predict a trained token
// (labels shifted by one, never across a document boundary), padded or packed.
#include <ATen/ATen.h>
#include <catch2/catch.hpp>
#include <vector>

#include "data/collate.hpp"

using namespace lorarun;
using data::Example;
using data::kIgnoreIndex;

namespace {

// An example of `ids` whose first `prompt` tokens are not trained.
Example example(std::vector<int32_t> ids, size_t prompt) {
  Example e;
  e.labels = ids;
  std::fill(e.labels.begin(), e.labels.begin() + static_cast<std::ptrdiff_t>(prompt), kIgnoreIndex);
  e.ids = std::move(ids);
  return e;
}

std::vector<int64_t> values(const at::Tensor& t) {
  const at::Tensor c = t.contiguous();
  return {c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel()};
}

const c10::Device cpu(at::kCPU);

}  // namespace

TEST_CASE("position k predicts labels[k + 1]: the prompt is not trained, the last token predicts nothing",
          "[collate]") {
  const data::Batch b = data::collate({example({11, 12, 13, 14}, 2)}, false, 0, cpu);
  CHECK(b.ids.sizes() == at::IntArrayRef{1, 4});
  CHECK(values(b.ids) == std::vector<int64_t>{11, 12, 13, 14});
  CHECK(values(b.mask) == std::vector<int64_t>{1, 1, 1, 1});
  // Positions 1 and 2 predict the trained tokens 13 and 14; position 0 predicts the prompt's 12.
  CHECK(values(b.rows) == std::vector<int64_t>{1, 2});
  CHECK(values(b.targets) == std::vector<int64_t>{13, 14});
  CHECK(b.tokens == 2);
  CHECK(b.real == 4);
  CHECK(b.slots == 4);
}

TEST_CASE("unpacked examples are right-padded to the longest, padding masked and never predicted", "[collate]") {
  const data::Batch b = data::collate({example({1, 2, 3, 4}, 1), example({5, 6}, 0)}, false, 0, cpu);
  CHECK(b.ids.sizes() == at::IntArrayRef{2, 4});
  CHECK(values(b.ids) == std::vector<int64_t>{1, 2, 3, 4, 5, 6, 0, 0});
  CHECK(values(b.mask) == std::vector<int64_t>{1, 1, 1, 1, 1, 1, 0, 0});
  CHECK(values(b.rows) == std::vector<int64_t>{0, 1, 2, 4});
  CHECK(values(b.targets) == std::vector<int64_t>{2, 3, 4, 6});
  CHECK(b.real == 6);
  CHECK(b.slots == 8);
}

TEST_CASE(
    "packed examples share rows first-fit decreasing, numbered in the mask, and never predict across a "
    "boundary",
    "[collate][packing]") {
  // Lengths 3, 2, 2 in rows of 4: [ex0] and [ex1 ex2].
  const data::Batch b = data::collate({example({1, 2, 3}, 0), example({4, 5}, 0), example({6, 7}, 0)}, true, 4, cpu);
  CHECK(b.ids.sizes() == at::IntArrayRef{2, 4});
  CHECK(values(b.ids) == std::vector<int64_t>{1, 2, 3, 0, 4, 5, 6, 7});
  CHECK(values(b.mask) == std::vector<int64_t>{1, 1, 1, 0, 1, 1, 2, 2});
  // ex1's last token (flat position 5) would predict ex2's first, 6: it predicts nothing.
  CHECK(values(b.rows) == std::vector<int64_t>{0, 1, 4, 6});
  CHECK(values(b.targets) == std::vector<int64_t>{2, 3, 5, 7});
  CHECK(b.tokens == 4);
  CHECK(b.real == 7);
  CHECK(b.slots == 8);
}

TEST_CASE("a packed example longer than the row capacity gets a row of its own", "[collate][packing]") {
  const data::Batch b = data::collate({example({1, 2, 3, 4, 5}, 0), example({6, 7}, 0)}, true, 3, cpu);
  CHECK(b.ids.sizes() == at::IntArrayRef{2, 5});
  CHECK(values(b.ids) == std::vector<int64_t>{1, 2, 3, 4, 5, 6, 7, 0, 0, 0});
  CHECK(values(b.mask) == std::vector<int64_t>{1, 1, 1, 1, 1, 1, 1, 0, 0, 0});
  CHECK(values(b.rows) == std::vector<int64_t>{0, 1, 2, 3, 5});
}

TEST_CASE("no example, no batch: nothing to predict", "[collate]") {
  const data::Batch b = data::collate({}, true, 8, cpu);
  CHECK(b.tokens == 0);
  CHECK(b.slots == 0);
  CHECK_FALSE(b.ids.defined());
}
