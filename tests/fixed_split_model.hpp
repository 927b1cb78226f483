// A host model of the deterministic plan (plan_fixed_kernel in decode_schedule.cu), written as
// the plain sequential walk the kernel parallelises, from the same arithmetic
// (cuda/decode/fixed_split.hpp). The CPU tests check its invariants; the GPU schedule test checks
// that the kernel writes exactly this plan.
#pragma once

#include <cstdint>
#include <vector>

#include "cuda/decode/fixed_split.hpp"

namespace mla::test {

struct ModelItem {
  int request, row_tile, kv_begin, kv_end, slot, part;
  long long start, end;  // its place on the cost line
};
struct ModelSplitUnit {
  int request, row_tile, slot_begin, num_pieces;
};
struct FixedPlanModel {
  std::vector<ModelItem> items;
  std::vector<int> part_begin;       // [parts + 1]
  std::vector<int> part_begin_sets;  // how many items set each part_begin entry
  std::vector<ModelSplitUnit> split_units;
  int num_slots = 0;
  int max_pieces = 1;  // most pieces of a split unit
  long long total_cost = 0;
};

// Rows of 64 a request of q_len queries and `heads` heads fills.
inline int model_row_tiles(int q_len, int heads) { return (q_len * heads + 63) / 64; }

// The plan of requests (q_lens[b], kv_lens[b]; kv_lens already clamped to the schedule's
// max_kv_len) on `parts` parts (num_parts / lanes) with `lanes` lanes.
inline FixedPlanModel model_fixed_plan(const std::vector<int>& q_lens, const std::vector<int>& kv_lens,
                                       int heads, int lanes, int parts, int split_keys) {
  namespace fs = cuda::decode::fixed_split;
  FixedPlanModel m;
  for (size_t b = 0; b < kv_lens.size(); ++b) {
    const int tiles = model_row_tiles(q_lens[b], heads);
    const int units = tiles == 0 ? 0 : lanes > 1 ? 1 : tiles;
    m.total_cost += units * fs::unit_cost(kv_lens[b], split_keys);
  }
  long long position = 0;
  for (size_t b = 0; b < kv_lens.size(); ++b) {
    const int tiles = model_row_tiles(q_lens[b], heads);
    const int units = tiles == 0 ? 0 : lanes > 1 ? 1 : tiles;
    const int n = fs::pieces(kv_lens[b], split_keys);
    for (int u = 0; u < units; ++u) {
      if (n > 1) {
        m.split_units.push_back({int(b), u, m.num_slots, n});
        if (n > m.max_pieces) m.max_pieces = n;
      }
      for (int k = 0; k < n; ++k) {
        const fs::KeyRange keys = fs::piece_keys(k, kv_lens[b], split_keys);
        const long long cost = fs::blocks(keys.end - keys.begin) + fs::kOverhead;
        ModelItem it{int(b), u, keys.begin, keys.end, n > 1 ? m.num_slots + k : -1,
                     fs::part_of(position, m.total_cost, parts), position, position + cost};
        m.items.push_back(it);
        position += cost;
      }
      if (n > 1) m.num_slots += n;
    }
  }
  m.part_begin.assign(size_t(parts) + 1, 0);
  m.part_begin_sets.assign(size_t(parts) + 1, 0);
  m.part_begin_sets[0] = 1;
  for (size_t i = 0; i < m.items.size(); ++i) {
    const fs::PartRange r = fs::parts_after(m.items[i].start, m.items[i].end, m.total_cost, parts);
    for (int p = r.first; p <= r.last; ++p) {
      m.part_begin[size_t(p)] = int(i) + 1;
      ++m.part_begin_sets[size_t(p)];
    }
  }
  if (m.items.empty())
    for (int& sets : m.part_begin_sets) sets = 1;
  return m;
}

}  // namespace mla::test
