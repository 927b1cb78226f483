// The deterministic split-KV plan's arithmetic (cuda/decode/fixed_split.hpp), which the plan
// kernel runs on the GPU: pieces that tile each request's keys at the multiples of split_keys,
// parts that take the pieces starting in their share of the cost line, and part_begin entries
// that each item sets for the parts after it. Checked here through the sequential model of the
// plan (fixed_split_model.hpp) on many random batches; the GPU schedule test checks that the
// kernel writes exactly the model's plan.
#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "fixed_split_model.hpp"
#include "mla/schedule.hpp"
#include "test_util.hpp"

namespace mla::test {
namespace {

namespace fs = cuda::decode::fixed_split;

TEST(FixedSplit, PiecesTileTheKeysAtMultiplesOfSplitKeys) {
  EXPECT_EQ(fs::pieces(0, 64), 1);
  EXPECT_EQ(fs::pieces(1, 64), 1);
  EXPECT_EQ(fs::pieces(64, 64), 1);
  EXPECT_EQ(fs::pieces(65, 64), 2);
  EXPECT_EQ(fs::pieces(1024, 512), 2);
  EXPECT_EQ(fs::pieces(1025, 512), 3);
  EXPECT_EQ(fs::pieces(2147483647, 1 << 30), 2);
  EXPECT_EQ(fs::pieces(2147483647, 64), 33554432);
  for (int split : {64, 128, 192, 1024, 4096}) {
    for (int kv : {0, 1, 63, 64, 65, split - 1, split, split + 1, 3 * split, 3 * split + 7, 100000}) {
      SCOPED_TRACE("split " + std::to_string(split) + " kv " + std::to_string(kv));
      const int n = fs::pieces(kv, split);
      int next = 0;
      long long offset = 0;
      for (int k = 0; k < n; ++k) {
        const fs::KeyRange r = fs::piece_keys(k, kv, split);
        EXPECT_EQ(r.begin, next);
        EXPECT_LE(r.end - r.begin, split);
        EXPECT_EQ(r.begin % 64, 0) << "pieces start on a key tile";
        if (k + 1 < n) EXPECT_EQ(r.end - r.begin, split) << "only the last piece is short";
        if (kv > 0) EXPECT_GT(r.end, r.begin) << "no empty piece while keys remain";
        EXPECT_EQ(fs::piece_offset(k, split), offset) << "the kernel's closed form of the line";
        EXPECT_EQ(fs::piece_cost(k, kv, split), fs::blocks(r.end - r.begin) + fs::kOverhead);
        offset += fs::piece_cost(k, kv, split);
        next = r.end;
      }
      EXPECT_EQ(next, kv);
      EXPECT_EQ(offset, fs::unit_cost(kv, split));
    }
  }
}

// Every structural property the decode and combine kernels rely on, for one plan.
void check_model(const FixedPlanModel& m, const std::vector<int>& q_lens, const std::vector<int>& kv_lens,
                 int heads, int lanes, int parts, int split) {
  const int n_items = int(m.items.size());
  ASSERT_EQ(m.part_begin.size(), size_t(parts) + 1);
  // part_begin: each entry set once, 0 first, the item count last, and part p's range holds
  // exactly the items of part p.
  for (int p = 0; p <= parts; ++p) EXPECT_EQ(m.part_begin_sets[size_t(p)], 1) << "part_begin[" << p << "]";
  EXPECT_EQ(m.part_begin[0], 0);
  EXPECT_EQ(m.part_begin[size_t(parts)], n_items);
  for (int p = 0; p < parts; ++p) {
    ASSERT_LE(m.part_begin[size_t(p)], m.part_begin[size_t(p) + 1]);
    for (int i = m.part_begin[size_t(p)]; i < m.part_begin[size_t(p) + 1]; ++i)
      ASSERT_EQ(m.items[size_t(i)].part, p) << "item " << i;
  }
  // Balance: a part's pieces start in [p T / P, (p + 1) T / P), so it holds at most a share plus
  // one piece.
  std::vector<long long> load(size_t(parts), 0);
  long long largest = 0;
  for (const ModelItem& it : m.items) {
    load[size_t(it.part)] += it.end - it.start;
    largest = std::max(largest, it.end - it.start);
  }
  const long long share = (m.total_cost + parts - 1) / parts;
  for (int p = 0; p < parts; ++p) EXPECT_LE(load[size_t(p)], share + largest) << "part " << p;
  // Units: each request's row tiles (one unit with lanes) in order, each cut into its pieces in
  // key order; a slot exactly when a unit has several pieces, consecutive from its split unit's
  // first; every slot used once.
  std::map<std::pair<int, int>, std::vector<const ModelItem*>> units;
  for (const ModelItem& it : m.items) units[{it.request, it.row_tile}].push_back(&it);
  std::vector<int> slot_uses(size_t(m.num_slots), 0);
  size_t expected_units = 0;
  for (size_t b = 0; b < kv_lens.size(); ++b) {
    const int tiles = model_row_tiles(q_lens[b], heads);
    const int n_units = tiles == 0 ? 0 : lanes > 1 ? 1 : tiles;
    expected_units += size_t(n_units);
    for (int u = 0; u < n_units; ++u) {
      const auto found = units.find({int(b), u});
      ASSERT_NE(found, units.end()) << "request " << b << " unit " << u << " has no item";
      const std::vector<const ModelItem*>& pieces = found->second;
      ASSERT_EQ(int(pieces.size()), fs::pieces(kv_lens[b], split));
      int next = 0;
      for (size_t k = 0; k < pieces.size(); ++k) {
        EXPECT_EQ(pieces[k]->kv_begin, next);
        next = pieces[k]->kv_end;
        if (pieces.size() == 1) {
          EXPECT_EQ(pieces[k]->slot, -1);
        } else {
          ASSERT_GE(pieces[k]->slot, 0);
          ASSERT_LT(pieces[k]->slot, m.num_slots);
          EXPECT_EQ(pieces[k]->slot, pieces[0]->slot + int(k));
          ++slot_uses[size_t(pieces[k]->slot)];
        }
      }
      EXPECT_EQ(next, kv_lens[b]);
    }
  }
  EXPECT_EQ(units.size(), expected_units);
  for (int s = 0; s < m.num_slots; ++s) EXPECT_EQ(slot_uses[size_t(s)], 1) << "slot " << s;
  for (const ModelSplitUnit& su : m.split_units) {
    const std::vector<const ModelItem*>& pieces = units[{su.request, su.row_tile}];
    ASSERT_EQ(su.num_pieces, int(pieces.size()));
    EXPECT_EQ(su.slot_begin, pieces[0]->slot);
    EXPECT_LE(su.num_pieces, m.max_pieces);
  }
}

TEST(FixedSplit, PlansCoverEveryKeyOnceAndBalanceTheParts) {
  std::mt19937 rng(4711);
  for (int round = 0; round < 400; ++round) {
    const int heads = std::vector<int>{1, 12, 16, 64, 96, 128}[rng() % 6];
    const int batch = 1 + int(rng() % (round % 4 == 0 ? 300 : 20));
    const int split = 64 * (1 + int(rng() % 32));
    const int num_parts = 1 + int(rng() % 140);
    const int max_q = 1 + int(rng() % 8);
    const int tiles_max = model_row_tiles(max_q, heads);
    const int lanes = tiles_max >= 2 && tiles_max <= num_parts ? tiles_max : 1;
    const int parts = num_parts / lanes;
    std::vector<int> q_lens, kv_lens;
    for (int b = 0; b < batch; ++b) {
      q_lens.push_back(int(rng() % (max_q + 1)));  // requests without queries among them
      const int kind = int(rng() % 5);
      kv_lens.push_back(kind == 0 ? 0 : kind == 1 ? split * int(1 + rng() % 4) + int(rng() % 2)
                                                  : int(rng() % 20000));
    }
    SCOPED_TRACE("round " + std::to_string(round) + ": batch " + std::to_string(batch) + " heads " +
                 std::to_string(heads) + " split " + std::to_string(split) + " parts " +
                 std::to_string(parts) + " lanes " + std::to_string(lanes));
    const FixedPlanModel m = model_fixed_plan(q_lens, kv_lens, heads, lanes, parts, split);
    check_model(m, q_lens, kv_lens, heads, lanes, parts, split);
    if (testing::Test::HasFatalFailure()) return;
  }
}

TEST(FixedSplit, EmptyBatchLeavesEveryPartEmpty) {
  const FixedPlanModel m = model_fixed_plan({0, 0}, {100, 5000}, 16, 1, 7, 1024);
  EXPECT_TRUE(m.items.empty());
  EXPECT_EQ(m.part_begin, std::vector<int>(8, 0));
}

// What makes the plan deterministic: a request's pieces (key ranges, their count, and so its
// slots' order) are the same whatever the batch around it, the parts it lands on aside.
TEST(FixedSplit, RequestPiecesDoNotDependOnTheBatch) {
  const int split = 512, heads = 128, parts = 66, lanes = 2;
  const std::vector<std::vector<int>> batches = {{3000}, {3000, 1, 70000}, {0, 12000, 3000, 511, 512, 513}};
  std::vector<std::pair<int, int>> first;
  for (const std::vector<int>& kv : batches) {
    const std::vector<int> q(kv.size(), 1);
    const FixedPlanModel m = model_fixed_plan(q, kv, heads, lanes, parts, split);
    check_model(m, q, kv, heads, lanes, parts, split);
    const int b = int(std::find(kv.begin(), kv.end(), 3000) - kv.begin());
    std::vector<std::pair<int, int>> ranges;
    for (const ModelItem& it : m.items)
      if (it.request == b) ranges.emplace_back(it.kv_begin, it.kv_end);
    if (first.empty()) first = ranges;
    EXPECT_EQ(ranges, first);
  }
  EXPECT_EQ(first.size(), 6u);
}

// One long request fills the parts: batch 1, 128 heads in two lanes, 16k keys in pieces of 1024:
// 16 pieces on 66 parts, one a part, spread evenly.
TEST(FixedSplit, OneLongRequestSpreadsOverTheParts) {
  const FixedPlanModel m = model_fixed_plan({1}, {16384}, 128, 2, 66, 1024);
  ASSERT_EQ(m.items.size(), 16u);
  for (size_t i = 0; i < m.items.size(); ++i) {
    EXPECT_EQ(m.items[i].part, int(i) * 66 / 16) << "item " << i;
    EXPECT_EQ(m.items[i].slot, int(i));
  }
  ASSERT_EQ(m.split_units.size(), 1u);
  EXPECT_EQ(m.split_units[0].num_pieces, 16);
}

// The deterministic schedule's capacity arguments are checked before anything asks the device
// (num_parts given), so a build with CUDA reports them here too; a build without CUDA says it
// has none.
TEST(FixedSplit, DeterministicScheduleArgumentsNameTheArgument) {
#if defined(MLA_WITH_CUDA)
  EXPECT_TRUE(throws_error([] { decode_workspace_bytes_deterministic(8, 2, 16, 4096, 100, 132); },
                           {"decode_workspace_bytes_deterministic", "split_keys", "multiple of 64", "100"}));
  EXPECT_TRUE(throws_error([] { decode_workspace_bytes_deterministic(8, 2, 16, 4096, 0, 132); },
                           {"split_keys"}));
  EXPECT_TRUE(throws_error([] { decode_workspace_bytes_deterministic(8, 2, 16, 0, 1024, 132); },
                           {"max_kv_len must be >= 1"}));
  EXPECT_TRUE(throws_error([] { decode_workspace_bytes_deterministic(0, 2, 16, 4096, 1024, 132); },
                           {"max_batch"}));
  EXPECT_TRUE(throws_error([] { decode_workspace_bytes_deterministic(8, 2, 129, 4096, 1024, 132); },
                           {"num_heads"}));
  EXPECT_TRUE(throws_error(
      [] { make_deterministic_decode_schedule(nullptr, 0, 8, 2, 16, 4096, 96, 132); },
      {"make_deterministic_decode_schedule", "split_keys must be a positive multiple of 64"}));
#else
  EXPECT_TRUE(throws_error([] { decode_workspace_bytes_deterministic(8, 2, 16, 4096, 1024); },
                           {"decode_workspace_bytes_deterministic", "no CUDA support"}));
  EXPECT_TRUE(throws_error([] { make_deterministic_decode_schedule(nullptr, 0, 8, 2, 16, 4096, 1024); },
                           {"make_deterministic_decode_schedule", "no CUDA support"}));
#endif
}

}  // namespace
}  // namespace mla::test
