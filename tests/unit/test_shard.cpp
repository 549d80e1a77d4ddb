#include <algorithm>
#include <catch2/catch.hpp>
#include <cmath>
#include <map>
#include <numeric>
#include <set>

#include "data/mixture.hpp"
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
  CHECK(sorted == std::vector<int64_t>{1, 3, 5, 7, 9});  // every other one, as DistributedSampler(shuffle=False)
  CHECK(shard_positions(5, 2, 1, 7, 5, Order::Sorted) == std::vector<int64_t>{1, 3, 0});  // padded by wrapping
  auto p = permutation(1000, 1, 2);
  std::sort(p.begin(), p.end());
  for (int64_t i = 0; i < 1000; ++i) CHECK(p[static_cast<size_t>(i)] == i);
}

TEST_CASE("the keyed permutation is a bijection that shuffles, computed without a list of n") {
  for (int64_t n : {1, 2, 3, 5, 16, 17, 1000, 65537}) {
    INFO("n " << n);
    const KeyedPermutation p(n, 99);
    std::vector<int64_t> seen;
    for (int64_t i = 0; i < n; ++i) seen.push_back(p(i));
    std::sort(seen.begin(), seen.end());
    std::vector<int64_t> all(static_cast<size_t>(n));
    std::iota(all.begin(), all.end(), 0);
    CHECK(seen == all);
  }
  // Far from the identity and from a rotation: few fixed points, no rank correlation.
  const int64_t n = 10007;
  const KeyedPermutation p(n, 7), q(n, 8);
  int fixed = 0, same = 0;
  double cov = 0;
  for (int64_t i = 0; i < n; ++i) {
    fixed += p(i) == i;
    same += p(i) == q(i);
    cov += (static_cast<double>(i) - (n - 1) / 2.0) * (static_cast<double>(p(i)) - (n - 1) / 2.0);
  }
  const double rho = cov / (static_cast<double>(n) * (static_cast<double>(n) * n - 1) / 12.0);
  CHECK(fixed < 10);
  CHECK(same < 10);
  CHECK(std::abs(rho) < 0.05);
  // A trillion documents: a rank's order costs no memory, and its positions stay in range.
  const int64_t huge = int64_t{1} << 40;
  const ShardOrder order(huge + 3, 4, 3, 42, 1, Order::Shuffled);
  CHECK(order.size() == (huge + 3 + 3) / 4);
  for (int64_t k : {int64_t{0}, int64_t{12345}, order.size() - 1}) {
    CHECK(order[k] >= 0);
    CHECK(order[k] < huge + 3);
  }
}

// Step k of W ranks with micro-batch b reads, all ranks together, what step k of 1 rank with
// micro-batch W*b reads (the padding that equalises the ranks aside), so the global batch of a
// step does not depend on how many ranks share it.
TEST_CASE("step k of W ranks together holds step k of 1 rank with W times the batch") {
  for (const Order order : {Order::Sorted, Order::Shuffled})
    for (int world : {2, 3, 4})
      for (int64_t batch : {1, 2, 4})
        for (int64_t n : {24, 25, 37, 96}) {
          INFO("order " << (order == Order::Sorted ? "sorted" : "shuffled") << " world " << world << " batch " << batch
                        << " n " << n);
          const auto one = shard_positions(n, 1, 0, 42, 2, order);
          std::vector<std::vector<int64_t>> ranks;
          for (int r = 0; r < world; ++r) ranks.push_back(shard_positions(n, world, r, 42, 2, order));
          const int64_t per_rank = static_cast<int64_t>(ranks[0].size());
          const int64_t steps = (per_rank + batch - 1) / batch;
          const int64_t padding = per_rank * world - n;
          for (int64_t k = 0; k < steps; ++k) {
            std::multiset<int64_t> together, alone;
            for (const auto& mine : ranks)
              for (int64_t i = k * batch; i < std::min(per_rank, (k + 1) * batch); ++i)
                together.insert(mine[size_t(i)]);
            for (int64_t i = k * batch * world; i < std::min(n, (k + 1) * batch * world); ++i)
              alone.insert(one[size_t(i)]);
            if (k + 1 == steps)  // the last step also re-reads the padding: the order's first documents
              for (int64_t i = 0; i < padding; ++i) alone.insert(one[size_t(i)]);
            CHECK(together == alone);
          }
        }
}

TEST_CASE("apportion: shares by weight that sum to the total, largest remainders first, ties to the earlier") {
  CHECK(apportion(10, {1, 1, 1}) == std::vector<int64_t>{4, 3, 3});
  CHECK(apportion(7, {1, 2}) == std::vector<int64_t>{2, 5});
  CHECK(apportion(400, {1, 3}) == std::vector<int64_t>{100, 300});
  CHECK(apportion(5, {0.001, 1}) == std::vector<int64_t>{0, 5});
  // weights near the largest double: their sum and products overflow unless taken over the largest
  CHECK(apportion(20, {1e308, 1}) == std::vector<int64_t>{20, 0});
  CHECK(apportion(20, {1.5e308, 0.5e308}) == std::vector<int64_t>{15, 5});
  CHECK(apportion(3, {1e308, 1e308, 1e308}) == std::vector<int64_t>{1, 1, 1});
  for (int64_t total : {1, 13, 1000, 999'983}) {
    const std::vector<int64_t> got = apportion(total, {0.3, 1.7, 5, 0.01});
    CHECK(std::accumulate(got.begin(), got.end(), int64_t{0}) == total);
    const double sum = 0.3 + 1.7 + 5 + 0.01;
    for (size_t i = 0; i < got.size(); ++i)
      CHECK(std::abs(double(got[i]) - double(total) * std::vector<double>{0.3, 1.7, 5, 0.01}[i] / sum) < 1.0);
  }
}
