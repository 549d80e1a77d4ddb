#include <algorithm>
#include <catch2/catch.hpp>
#include <map>
#include <set>

#include "data/shard.hpp"

using namespace lorarun::data;

TEST_CASE("shards cover every document, equal sizes, duplicates only from equalisation") {
  for (const Order order : {Order::Shuffled, Order::Sorted})
    for (int world : {1, 2, 3, 8})
      for (int64_t n : {1, 2, 7, 10, 1000, 1001}) {
        INFO("world " << world << " n " << n);
        std::map<int64_t, int> seen;
        size_t size = 0;
        for (int rank = 0; rank < world; ++rank) {
          const auto mine = shard_positions(n, world, rank, 42, 3, order);
          if (rank == 0) size = mine.size();
          CHECK(mine.size() == size);
          for (int64_t p : mine) ++seen[p];
        }
        CHECK(size == static_cast<size_t>((n + world - 1) / world));
        CHECK(static_cast<int64_t>(seen.size()) == n);  // every position 0..n-1
        int extra = 0;
        for (auto& [p, count] : seen) {
          CHECK(p >= 0);
          CHECK(p < n);
          extra += count - 1;
        }
        CHECK(extra == static_cast<int>(size * world - n));  // the padding, at most world-1
      }
}

TEST_CASE("the order depends on seed and epoch only") {
  const auto a = shard_positions(500, 2, 1, 7, 0, Order::Shuffled);
  CHECK(a == shard_positions(500, 2, 1, 7, 0, Order::Shuffled));
  CHECK(a != shard_positions(500, 2, 1, 7, 1, Order::Shuffled));
  CHECK(a != shard_positions(500, 2, 1, 8, 0, Order::Shuffled));
  const auto sorted = shard_positions(10, 2, 1, 7, 5, Order::Sorted);
  CHECK(sorted == std::vector<int64_t>{5, 6, 7, 8, 9});  // a contiguous slice
  auto p = permutation(1000, 1, 2);
  std::sort(p.begin(), p.end());
  for (int64_t i = 0; i < 1000; ++i) CHECK(p[static_cast<size_t>(i)] == i);
}
