// plan_decode's schedule, read back from the workspace: every CTA's item range holds exactly the
// items planned for it, and every unit's keys are covered once, in order, by its pieces. (The
// decode tests check the results; a schedule that ran an item twice or not at all could still
// give correct-looking outputs in some cases, so the structure is checked here directly.)
#include <gtest/gtest.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <map>
#include <random>
#include <utility>
#include <vector>

#include "cuda/decode/decode_params.cuh"
#include "fixed_split_model.hpp"
#include "gpu_util.hpp"
#include "mla/schedule.hpp"

namespace mla::test {
namespace {

using cuda::decode::kScheduleMagic;
using cuda::decode::ScheduleHeader;
using cuda::decode::SplitUnit;
using cuda::decode::WorkItem;

// `count` values of T at byte `offset` of a downloaded buffer.
template <typename T>
std::vector<T> read_at(const HostTensor& h, size_t offset, size_t count) {
  std::vector<T> v(count);
  if (count > 0) std::memcpy(v.data(), h.bytes.data() + offset, count * sizeof(T));
  return v;
}

// Plans kv_lens (q_len queries per request) and checks the schedule's structure. With q_len 1
// every row tile sees all kv_len keys, so the pieces of each unit must tile [0, kv_len) exactly.
// With `pieces_each` > 0 (a batch of equal requests) every unit must be cut into that many
// pieces, and no CTA may run more than one item.
void check_plan(const std::vector<int>& kv_lens, int heads, int q_len, int num_parts,
                int pieces_each = 0) {
  SCOPED_TRACE("batch " + std::to_string(kv_lens.size()) + ", heads " + std::to_string(heads) +
               ", q_len " + std::to_string(q_len) + ", num_parts " + std::to_string(num_parts));
  const int batch = int(kv_lens.size());
  const size_t bytes = decode_workspace_bytes(batch, q_len, heads, num_parts);
  ASSERT_EQ(bytes % 4, 0u);
  // The workspace, poisoned: every array must be written by the plan.
  HostTensor ws_host(DType::kInt32, {int64_t(bytes / 4)});
  std::memset(ws_host.data(), 0xff, bytes);
  DeviceTensor ws(ws_host);
  HostTensor lens_host = int32_tensor(kv_lens);
  DeviceTensor lens(lens_host);
  const DecodeSchedule s = make_decode_schedule(ws.ptr, bytes, batch, q_len, heads, num_parts);
  plan_decode(s, lens.view(), TensorView{}, q_len, q_len);
  MLA_TEST_CUDA(cudaDeviceSynchronize());
  ws.download();

  const std::vector<ScheduleHeader> header = read_at<ScheduleHeader>(ws_host, s.header_offset, 1);
  ASSERT_EQ(header.size(), 1u);
  const ScheduleHeader h = header[0];
  ASSERT_EQ(h.magic, kScheduleMagic);
  ASSERT_GE(h.lanes, 1);
  ASSERT_GT(h.num_items, 0);
  ASSERT_LE(h.num_items, s.max_items);
  const int parts = s.num_parts / h.lanes;
  const std::vector<WorkItem> items = read_at<WorkItem>(ws_host, s.items_offset, size_t(h.num_items));
  const std::vector<int> begin = read_at<int>(ws_host, s.part_begin_offset, size_t(parts) + 1);
  ASSERT_EQ(begin.size(), size_t(parts) + 1);

  // part_begin: 0, non-decreasing, num_items; the items of part p are exactly [begin[p], begin[p+1]).
  EXPECT_EQ(begin[0], 0);
  EXPECT_EQ(begin[size_t(parts)], h.num_items);
  for (int p = 0; p < parts; ++p) {
    ASSERT_LE(begin[size_t(p)], begin[size_t(p) + 1]) << "part " << p;
    for (int i = begin[size_t(p)]; i < begin[size_t(p) + 1]; ++i)
      ASSERT_EQ(items[size_t(i)].part, p) << "item " << i << " listed under part " << p;
  }

  // Pieces of each unit (request, row tile): contiguous key ranges from 0, in list order; a slot
  // exactly when the unit has several pieces.
  std::map<std::pair<int, int>, std::vector<WorkItem>> units;
  for (const WorkItem& w : items) {
    ASSERT_GE(w.request, 0);
    ASSERT_LT(w.request, batch);
    units[{w.request, w.row_tile}].push_back(w);
  }
  const int tiles_per_request = int(units.size()) / std::max(batch, 1);
  EXPECT_EQ(units.size(), size_t(batch) * size_t(tiles_per_request)) << "every request, every row tile";
  for (const auto& [key, pieces] : units) {
    SCOPED_TRACE("request " + std::to_string(key.first) + ", row tile " + std::to_string(key.second));
    EXPECT_EQ(pieces.front().kv_begin, 0);
    for (size_t i = 1; i < pieces.size(); ++i) {
      EXPECT_EQ(pieces[i].kv_begin, pieces[i - 1].kv_end) << "piece " << i;
      EXPECT_LT(pieces[i - 1].part, pieces[i].part) << "a unit's pieces run on distinct CTAs";
    }
    for (const WorkItem& w : pieces) {
      EXPECT_LE(w.kv_begin, w.kv_end);
      // The request's geometry, as the decode kernels take it from the item.
      EXPECT_EQ(w.q_start, w.request * q_len);
      EXPECT_EQ(w.q_len, q_len);
      EXPECT_EQ(w.kv_len, kv_lens[size_t(w.request)]);
      EXPECT_EQ(w.slot < 0, pieces.size() == 1);
    }
    if (q_len == 1) EXPECT_EQ(pieces.back().kv_end, kv_lens[size_t(key.first)]);
    if (pieces_each > 0) EXPECT_EQ(pieces.size(), size_t(pieces_each));
  }
  if (pieces_each > 0)
    for (int p = 0; p < parts; ++p) EXPECT_LE(begin[size_t(p) + 1] - begin[size_t(p)], 1) << "part " << p;

  // Split units: one for each unit of several pieces, whose pieces hold consecutive slots from
  // its slot_begin; the slots of all split units are distinct and number num_slots; the combine
  // reads the same geometry as the items.
  const std::vector<SplitUnit> splits =
      read_at<SplitUnit>(ws_host, s.split_units_offset, size_t(std::max(h.num_split_units, 0)));
  std::map<std::pair<int, int>, SplitUnit> split_of;
  for (const SplitUnit& u : splits) {
    ASSERT_TRUE(split_of.emplace(std::make_pair(u.request, u.row_tile), u).second)
        << "request " << u.request << " row tile " << u.row_tile << " split twice";
  }
  std::vector<int> slot_used(size_t(std::max(h.num_slots, 0)), 0);
  int split_units = 0;
  for (const auto& [key, pieces] : units) {
    if (pieces.size() == 1) {
      EXPECT_EQ(split_of.count(key), 0u) << "request " << key.first << ": one piece, no split unit";
      continue;
    }
    ++split_units;
    const auto found = split_of.find(key);
    ASSERT_NE(found, split_of.end()) << "request " << key.first << ": " << pieces.size()
                                     << " pieces but no split unit";
    const SplitUnit& u = found->second;
    EXPECT_EQ(u.num_pieces, int(pieces.size()));
    EXPECT_LE(u.num_pieces, h.max_pieces);
    EXPECT_EQ(u.q_start, pieces.front().q_start);
    EXPECT_EQ(u.q_len, pieces.front().q_len);
    EXPECT_EQ(u.kv_len, pieces.front().kv_len);
    for (size_t i = 0; i < pieces.size(); ++i) {
      const int slot = pieces[i].slot;
      EXPECT_EQ(slot, u.slot_begin + int(i)) << "request " << key.first << " piece " << i;
      ASSERT_GE(slot, 0);
      ASSERT_LT(slot, h.num_slots);
      EXPECT_EQ(slot_used[size_t(slot)]++, 0) << "slot " << slot << " used twice";
    }
  }
  EXPECT_EQ(h.num_split_units, split_units);
  // The header's max_pieces (the combine kernel's shape): the most pieces of one unit, 1 if none
  // is split.
  size_t most_pieces = 1;
  for (const auto& entry : units) most_pieces = std::max(most_pieces, entry.second.size());
  EXPECT_EQ(h.max_pieces, int(most_pieces));
  for (size_t i = 0; i < slot_used.size(); ++i) EXPECT_EQ(slot_used[i], 1) << "slot " << i << " unused";
}

TEST(GpuDecodeSchedule, EveryPartRunsItsItemsAndEveryKeyOnce) {
  MLA_REQUIRE_GPU();
  std::mt19937 rng(7);
  auto lengths = [&](int batch, int max_len, int min_len = 0) {
    std::vector<int> v(static_cast<size_t>(batch));
    for (int& x : v) x = min_len + int(rng() % uint32_t(max_len - min_len + 1));
    return v;
  };
  for (int heads : {16, 128}) {
    for (int num_parts : {0, 1, 7, 132, 300}) {
      check_plan({16384}, heads, 1, num_parts);           // one long request: split everywhere
      check_plan({1}, heads, 1, num_parts);
      check_plan({0, 5, 0}, heads, 1, num_parts);         // empty requests still get an item
      check_plan(lengths(256, 5000), heads, 1, num_parts);
      check_plan(lengths(1100, 3000), heads, 1, num_parts);  // more requests than plan threads
      // The plan's CTA has a warp per 32 requests: one warp full, one request past whole warps
      // and past the largest CTA.
      check_plan(lengths(32, 9000), heads, 1, num_parts);
      check_plan(lengths(97, 4000), heads, 1, num_parts);
      check_plan(lengths(513, 2000), heads, 1, num_parts);
      // Several requests a thread with lanes (128 heads, q_len 2: four row tiles), and threads
      // whose first request is empty (every other one, three a thread).
      check_plan(lengths(600, 3000, 2), heads, 2, num_parts);
      std::vector<int> gaps(1030);
      for (size_t i = 0; i < gaps.size(); ++i) gaps[i] = i % 2 ? 0 : 1 + int(i % 700);
      check_plan(gaps, heads, 1, num_parts);
      check_plan(std::vector<int>(64, 4096), heads, 1, num_parts);
      // Equal units laid whole, several a part (B 256 kv 1k: a payload of two units); units of no
      // keys only (a line of fixed costs, counted by the scan).
      check_plan(std::vector<int>(256, 1024), heads, 1, num_parts);
      check_plan(std::vector<int>(300, 0), heads, 1, num_parts);
      // Equal units laid whole, with loops (on 132 parts: three requests a thread, payload 8
      // units of 48; and 128 heads, q_len 2: four lanes, two requests a thread, payload 18 units).
      check_plan(std::vector<int>(1050, 3000), heads, 1, num_parts);
      check_plan(std::vector<int>(590, 3000), heads, 2, num_parts);
      check_plan(lengths(33, 20000, 2), heads, 2, num_parts);
      check_plan(lengths(5, 70000, 3), heads, 3, num_parts);
      // Requests of INT_MAX keys (2^25 blocks each): a line just below 2^31 (63 of them, 32-bit
      // positions) and just past it (64, 64-bit positions); the last piece ends at INT_MAX.
      if (heads == 16) {
        check_plan(std::vector<int>(63, INT_MAX), heads, 1, num_parts);
        check_plan(std::vector<int>(64, INT_MAX), heads, 1, num_parts);
        // The kernel with loops (two row tiles a request and one lane when the parts are fewer
        // than the tiles): a row tile before the last one of an INT_MAX request.
        if (num_parts == 1) check_plan({INT_MAX, INT_MAX - 1, 5}, heads, 5, num_parts);
        // The closed forms on the 64-bit line: equal mode (64 requests on 128 parts, two pieces
        // each) and units laid whole (127 on 64 parts, two a part).
        if (num_parts == 132) {
          check_plan(std::vector<int>(64, INT_MAX), heads, 1, 128, 2);
          check_plan(std::vector<int>(127, INT_MAX), heads, 1, 64);
        }
      }
    }
  }
}

// A batch of equal requests: each is cut into the same number of pieces, one CTA each, where a
// cost line cut at multiples of the payload would let some units fall across three CTAs and some
// CTAs run the tail of one unit and the head of the next. Pieces a unit = ceil(blocks / payload),
// payload = ceil(units x (blocks + 1) / parts), 1 being the fixed cost of a unit in key blocks.
TEST(GpuDecodeSchedule, EqualRequestsGetEqualPieces) {
  MLA_REQUIRE_GPU();
  check_plan(std::vector<int>(16, 4096), 16, 1, 132, 8);    // payload 8: 8 pieces of 8 blocks
  check_plan(std::vector<int>(16, 1024), 16, 1, 132, 6);    // payload 3: 6 pieces of 3 (the last 1)
  check_plan(std::vector<int>(64, 4096), 16, 1, 132, 2);    // payload 32: halves
  check_plan(std::vector<int>(32, 2048), 16, 1, 132, 4);    // payload 8
  check_plan(std::vector<int>(1, 16384), 128, 1, 132, 64);  // 66 parts a lane: 64 pieces of 4
  check_plan(std::vector<int>(16, 1024), 128, 2, 132, 2);   // four lanes, 33 parts: payload 9
  check_plan(std::vector<int>(16, 1000), 16, 1, 132, 6);    // a partial last block
  check_plan(std::vector<int>(7, 333), 16, 1, 7, 1);        // one unit a CTA, unsplit
  // Two requests a plan thread (more than 512): payload 33 -> 2 pieces of 32 blocks; with 128
  // heads two lanes of 600 parts, one whole unit each.
  check_plan(std::vector<int>(600, 4096), 16, 1, 1200, 2);
  check_plan(std::vector<int>(600, 4096), 128, 1, 1200, 1);
  // Structure only (the pieces per unit follow from the cost line or the rule): lanes that do
  // not divide the parts, and causal row tiles of one request as separate units (no lanes).
  check_plan(std::vector<int>(9, 700), 128, 1, 7);
  check_plan(std::vector<int>(6, 1000), 16, 5, 13);  // 80 rows: two row tiles, two lanes
  check_plan(std::vector<int>(5, 1000), 16, 5, 1);   // one part: the tiles are units
  check_plan(std::vector<int>(5, 1000), 16, 5, 3);   // three parts, two tiles: lanes 2 of 1 part
}

// The deterministic plan (make_deterministic_decode_schedule): the kernel writes exactly the
// sequential model's plan (fixed_split_model.hpp, whose invariants the CPU tests check): the same
// items in the same order with their parts, slots and the requests' geometry, the same part_begin
// and split units, and a header for 64-row tiles whose split_keys makes the combine add a row's
// pieces in key order. q_lens given: variable query counts through cu_q_lens (0 among them).
void check_fixed_plan(const std::vector<int>& kv_lens, const std::vector<int>& q_lens, int heads,
                      int num_parts, int split_keys, int max_kv_len) {
  const int batch = int(kv_lens.size());
  const int max_q = std::max(1, *std::max_element(q_lens.begin(), q_lens.end()));
  SCOPED_TRACE("fixed plan: batch " + std::to_string(batch) + ", heads " + std::to_string(heads) +
               ", max_q_len " + std::to_string(max_q) + ", parts " + std::to_string(num_parts) +
               ", split_keys " + std::to_string(split_keys) + ", max_kv_len " + std::to_string(max_kv_len));
  const size_t bytes =
      decode_workspace_bytes_deterministic(batch, max_q, heads, max_kv_len, split_keys, num_parts);
  DeviceBuffer ws(bytes);
  std::vector<int> cu(1, 0);
  for (int q : q_lens) cu.push_back(cu.back() + q);
  HostTensor lens_host = int32_tensor(kv_lens), cu_host = int32_tensor(cu);
  DeviceTensor lens(lens_host), cu_dev(cu_host);
  const DecodeSchedule s = make_deterministic_decode_schedule(ws.ptr, bytes, batch, max_q, heads,
                                                              max_kv_len, split_keys, num_parts);
  EXPECT_EQ(s.split_keys, split_keys);
  EXPECT_EQ(s.max_kv_len, max_kv_len);
  // The plan's arrays (the workspace before the partial results, which are most of its bytes),
  // poisoned: the plan must write every entry that is read back.
  HostTensor ws_host(DType::kInt32, {int64_t(s.partial_lse_offset / 4)});
  std::memset(ws_host.data(), 0xff, ws_host.bytes.size());
  ws.upload(ws_host);
  plan_decode(s, lens.view(), cu_dev.view(), 0, max_q);
  MLA_TEST_CUDA(cudaDeviceSynchronize());
  ws.download(ws_host);

  const int tiles_max = model_row_tiles(max_q, heads);
  const int lanes = tiles_max >= 2 && tiles_max <= s.num_parts ? tiles_max : 1;
  const int parts = s.num_parts / lanes;
  std::vector<int> clamped;
  for (int kv : kv_lens) clamped.push_back(std::clamp(kv, 0, max_kv_len));
  const FixedPlanModel m = model_fixed_plan(q_lens, clamped, heads, lanes, parts, split_keys);

  const ScheduleHeader h = read_at<ScheduleHeader>(ws_host, s.header_offset, 1)[0];
  ASSERT_EQ(h.magic, kScheduleMagic);
  EXPECT_EQ(h.block_m, 64);
  EXPECT_EQ(h.batch_size, batch);
  EXPECT_EQ(h.num_heads, heads);
  EXPECT_EQ(h.num_parts, s.num_parts);
  EXPECT_EQ(h.lanes, lanes);
  EXPECT_EQ(h.split_keys, split_keys);
  EXPECT_EQ(h.num_slots, m.num_slots);
  EXPECT_EQ(h.max_pieces, m.max_pieces);
  ASSERT_EQ(h.num_items, int(m.items.size()));
  ASSERT_EQ(h.num_split_units, int(m.split_units.size()));
  EXPECT_LE(int64_t(h.num_slots) * lanes, s.max_slots);

  const std::vector<WorkItem> items = read_at<WorkItem>(ws_host, s.items_offset, size_t(h.num_items));
  for (size_t i = 0; i < items.size(); ++i) {
    const WorkItem& w = items[i];
    const ModelItem& e = m.items[i];
    SCOPED_TRACE("item " + std::to_string(i));
    ASSERT_EQ(w.request, e.request);
    EXPECT_EQ(w.row_tile, e.row_tile);
    EXPECT_EQ(w.kv_begin, e.kv_begin);
    EXPECT_EQ(w.kv_end, e.kv_end);
    EXPECT_EQ(w.slot, e.slot);
    EXPECT_EQ(w.part, e.part);
    EXPECT_EQ(w.q_start, cu[size_t(e.request)]);
    EXPECT_EQ(w.q_len, q_lens[size_t(e.request)]);
    EXPECT_EQ(w.kv_len, clamped[size_t(e.request)]);
  }
  EXPECT_EQ(read_at<int>(ws_host, s.part_begin_offset, size_t(parts) + 1), m.part_begin);
  const std::vector<SplitUnit> splits =
      read_at<SplitUnit>(ws_host, s.split_units_offset, size_t(h.num_split_units));
  for (size_t i = 0; i < splits.size(); ++i) {
    SCOPED_TRACE("split unit " + std::to_string(i));
    EXPECT_EQ(splits[i].request, m.split_units[i].request);
    EXPECT_EQ(splits[i].row_tile, m.split_units[i].row_tile);
    EXPECT_EQ(splits[i].slot_begin, m.split_units[i].slot_begin);
    EXPECT_EQ(splits[i].num_pieces, m.split_units[i].num_pieces);
    EXPECT_EQ(splits[i].q_start, cu[size_t(splits[i].request)]);
    EXPECT_EQ(splits[i].q_len, q_lens[size_t(splits[i].request)]);
    EXPECT_EQ(splits[i].kv_len, clamped[size_t(splits[i].request)]);
  }
}

TEST(GpuDecodeSchedule, DeterministicPlanIsTheModelsPlan) {
  MLA_REQUIRE_GPU();
  std::mt19937 rng(11);
  auto lengths = [&](int batch, int max_len) {
    std::vector<int> v(static_cast<size_t>(batch));
    for (int& x : v) x = int(rng() % uint32_t(max_len + 1));
    return v;
  };
  for (int heads : {16, 128}) {
    for (int num_parts : {0, 1, 7, 132}) {
      check_fixed_plan({16384}, {1}, heads, num_parts, 1024, 16384);  // one long request
      check_fixed_plan({0, 1, 64, 65}, {1, 1, 1, 1}, heads, num_parts, 64, 4096);
      check_fixed_plan({20000}, {1}, heads, num_parts, 128, 32768);    // 157 pieces
      check_fixed_plan(lengths(40, 5000), lengths(40, 4), heads, num_parts, 512, 5000);
      check_fixed_plan(lengths(600, 3000), std::vector<int>(600, 2), heads, num_parts, 1024, 3000);
      // Keys past max_kv_len are cut off (mla_decode refuses block tables that hold more).
      check_fixed_plan({9000, 100}, {1, 3}, heads, num_parts, 2048, 4096);
      // Requests without queries only: no items, every part empty.
      check_fixed_plan({500, 700}, {0, 0}, heads, num_parts, 256, 1024);
    }
  }
}

// A request's geometry by the rules written out once more: queries from a start >= 0 clamped to
// [0, max_q_len] and to the T tokens, keys clamped to [0, max_kv_len].
cuda::decode::RequestGeometry expected_geometry(const cuda::decode::BatchLayout& l, int b) {
  cuda::decode::RequestGeometry g{};
  if (l.cu_q_lens != nullptr) {
    g.q_start = std::max(l.cu_q_lens[b], 0);
    g.q_len = l.cu_q_lens[b + 1] - g.q_start;
  } else {
    g.q_start = b * l.q_len;
    g.q_len = l.q_len;
  }
  g.q_len = std::clamp(g.q_len, 0, l.max_q_len);
  if (l.num_tokens >= 0) {
    g.q_start = std::min(g.q_start, l.num_tokens);
    g.q_len = std::min(g.q_len, l.num_tokens - g.q_start);
  }
  g.kv_len = std::clamp(l.kv_lens[b], 0, l.max_kv_len);
  return g;
}

// div_by_magic against the division, host-only: the host branch forms umulhi with a 64-bit
// multiply, the device branch with __umulhi; the arithmetic (the estimate and its one correction)
// is the same.
TEST(DecodeGeometry, DivisionByMagicIsExact) {
  using cuda::decode::div_by_magic;
  using cuda::decode::division_magic;
  std::mt19937 rng(5);
  auto check = [&](uint32_t n, uint32_t d) {
    ASSERT_EQ(div_by_magic(n, d, division_magic(d)), n / d) << n << " / " << d;
  };
  const uint32_t edges[] = {0u, 1u, 2u, 63u, 64u, 65u, 0x7fffffffu, 0x80000000u, 0x80000001u,
                            0xfffffffeu, 0xffffffffu};
  for (uint32_t d = 1; d <= 3000; ++d) {
    for (uint32_t n : edges) check(n, d);
    for (uint32_t k = 0; k < 40; ++k) {  // multiples of d and their neighbours, and random n
      const uint32_t m = d * uint32_t(uint64_t(rng()) % (uint64_t(0xffffffffu / d) + 1));
      check(m, d);
      if (m > 0) check(m - 1, d);
      if (m < 0xffffffffu) check(m + 1, d);
      check(rng(), d);
    }
  }
  for (int trial = 0; trial < 200000; ++trial) {
    const uint32_t d = 1 + rng() % 0xffffffffu;
    check(rng(), d);
    check(d, d);
    check(d - 1, d);
    for (uint32_t n : edges) check(n, d);
  }
  for (uint32_t shift = 0; shift < 32; ++shift)  // powers of two, where the magic is one short
    for (uint32_t n : edges) check(n, 1u << shift);
}

// The geometry a work item carries (read by the plan with no token or key limit) with the decode
// call's clamps applied again, and what the call reads from the layout itself, both follow the
// rules, for every kind of bad metadata the clamps exist for. A host-only test: it runs without
// a GPU.
TEST(DecodeGeometry, ItemGeometryMatchesTheLayout) {
  using cuda::decode::BatchLayout;
  using cuda::decode::RequestGeometry;
  std::mt19937 rng(11);
  auto pick = [&](int lo, int hi) { return lo + int(rng() % uint32_t(hi - lo + 1)); };
  for (int trial = 0; trial < 2000; ++trial) {
    const int batch = pick(1, 6);
    std::vector<int32_t> kv(static_cast<size_t>(batch)), cu(static_cast<size_t>(batch) + 1);
    for (int32_t& x : kv) x = pick(-5, 300);
    cu[0] = pick(-3, 2);
    for (int b = 0; b < batch; ++b) cu[size_t(b) + 1] = cu[size_t(b)] + pick(-2, 6);  // may go down
    const bool ragged = trial % 2 == 0;
    BatchLayout call{};
    call.kv_lens = kv.data();
    call.kv_lens_stride = 1;
    call.cu_q_lens = ragged ? cu.data() : nullptr;
    call.cu_q_lens_stride = 1;
    call.q_len = ragged ? 0 : pick(1, 4);
    call.max_q_len = ragged ? pick(1, 6) : call.q_len;
    call.num_tokens = pick(0, 20);
    call.max_kv_len = pick(0, 320);
    call.batch_size = batch;
    call.num_heads = 16;
    BatchLayout plan = call;  // what plan_decode sees: no token count, no key limit
    plan.num_tokens = -1;
    plan.max_kv_len = INT_MAX;
    for (int b = 0; b < batch; ++b) {
      const RequestGeometry want = expected_geometry(call, b);
      for (const RequestGeometry& got :
           {request_geometry(call, b), clamp_geometry(call, request_geometry(plan, b))}) {
        ASSERT_EQ(got.q_start, want.q_start) << "trial " << trial << ", request " << b;
        ASSERT_EQ(got.q_len, want.q_len) << "trial " << trial << ", request " << b;
        ASSERT_EQ(got.kv_len, want.kv_len) << "trial " << trial << ", request " << b;
      }
    }
  }
}

// item_range's key range from any item, a workspace's garbage included: inside [0, visible] of
// the tile, its tile count what the producer's and the converter's loops (a key stepped by
// kBlockN up to kv_end) walk, and an item the plan could write left as it is. Host-only.
TEST(DecodeGeometry, ItemRangeStaysInsideTheTilesVisibleKeys) {
  using cuda::decode::BatchLayout;
  using cuda::decode::ItemRange;
  using cuda::decode::kBlockN;
  std::mt19937 rng(23);
  auto pick = [&](int lo, int hi) { return lo + int(uint64_t(rng()) % (uint64_t(hi) - lo + 1)); };
  const int wild[] = {INT_MIN, INT_MIN + 1, -65, -64, -1, 0, 1, 63, 64, 65, INT_MAX - 64, INT_MAX};
  for (int trial = 0; trial < 20000; ++trial) {
    const int kv_len = pick(0, 700);
    const int q_len = pick(1, 3);
    BatchLayout layout{};
    layout.q_len = q_len;
    layout.max_q_len = q_len;
    layout.num_tokens = -1;
    layout.max_kv_len = INT_MAX;
    layout.batch_size = 1;
    layout.num_heads = trial % 2 == 0 ? 16 : 128;
    const int block_m = 16 << (trial % 3);
    WorkItem item{};
    item.row_tile = pick(0, (q_len * layout.num_heads - 1) / block_m);
    item.q_start = 0;
    item.q_len = q_len;
    item.kv_len = kv_len;
    const bool sane = trial % 3 != 0;
    if (sane) {  // what the plan writes: whole blocks from 0, the end at most kv_len
      item.kv_begin = kBlockN * pick(0, kv_len / kBlockN);
      item.kv_end = pick(item.kv_begin, kv_len);
    } else {
      item.kv_begin = trial % 2 ? wild[rng() % 12] : pick(-200, 900);
      item.kv_end = trial % 5 ? wild[rng() % 12] : pick(-200, 900);
    }
    const ItemRange r = item_range(layout, item, block_m);
    ASSERT_GT(r.valid_rows, 0);
    const int visible = tile_visible_keys(r.g, r.row0 + r.valid_rows, layout.num_heads);
    SCOPED_TRACE(::testing::Message() << "trial " << trial << ": item [" << item.kv_begin << ", "
                                      << item.kv_end << "), visible " << visible);
    ASSERT_LE(0, r.kv_begin);
    ASSERT_LE(r.kv_begin, r.kv_end);
    ASSERT_LE(r.kv_end, visible);
    int walked = 0;
    for (uint32_t key = uint32_t(r.kv_begin); key < uint32_t(r.kv_end); key += kBlockN) ++walked;
    ASSERT_EQ(r.num_tiles, walked);
    if (sane) {
      ASSERT_EQ(r.kv_begin, std::min(item.kv_begin, r.kv_end));
      ASSERT_EQ(r.kv_end, std::min(item.kv_end, visible));
    }
  }
}

}  // namespace
}  // namespace mla::test
