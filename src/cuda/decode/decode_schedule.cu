// plan_decode: the split-KV schedule of mla_decode, computed on the GPU (no host sync, so it can
// be captured in a CUDA graph and replayed with new kv_lens).
//
// Cost model. Each unit (request, row tile) costs its key blocks (64 keys each, only the keys
// its rows may see under the causal rule) plus kOverheadBlocks for loading the queries and
// writing the output. Units are laid end to end on one cost line, in request order; the line is
// cut into num_parts equal segments of `payload`, one per decode CTA. A unit whose key blocks
// straddle cuts is split into pieces, one per segment it touches (work items); each piece writes
// a partial result into its own slot and the combine kernel merges them. So every CTA gets about
// the same number of key blocks whether the batch is one 32k-token request or 256 short ones.
//
// Three refinements keep pieces from being cut for nothing:
//   * payload = ceil(total / num_parts), at least kMinBlocksPerPart; and when the largest unit
//     costs at most 5/4 of that, payload grows to it. A batch of equal units that nearly fills
//     the GPU (64 requests x 2 row tiles on 132 SMs) then runs one unit per CTA, unsplit,
//     instead of splitting almost every unit in two. Likewise when k >= 2 largest units cover
//     the share with less than a quarter unit to spare: payload = k units (128 requests x 2 row
//     tiles on 132 SMs run two whole units per CTA).
//   * a cut that falls within `snap` = max(kOverheadBlocks, payload / 8) blocks of a unit's
//     start or end moves to that edge (the CTA on one side takes a little more), so no piece is
//     smaller than the fixed cost it adds. Moving a cut only ever affects the one unit it falls
//     in, so every thread decides its units' pieces independently and the CTAs' item lists stay
//     in order.
//   * when every unit costs the same (a batch of equal requests) and k pieces a unit fit on the
//     parts, each unit is cut into k equal pieces that start at cuts (k = the pieces a unit
//     would take at the payload): one item a CTA, no piece cut short by where the unit fell.
//
// Capacity (why the workspace sizes are bounds): units <= max_batch * ceil(max_q_len * H / 16);
// each of the num_parts - 1 cuts adds at most one item, so items <= units + num_parts; split
// units <= num_parts - 1; slots = pieces of split units <= 2 (num_parts - 1). With L lanes
// (decode_params.cuh) the line has num_parts / L parts and every slot is used L times:
// slots * L <= 2 (num_parts / L - 1) * L < 2 num_parts.
//
// The kernel is one CTA of up to 512 threads, one warp per 32 requests (plan_threads): each
// thread owns a contiguous range of requests; three passes over them (cost, counts, writes) are
// joined by block-wide exclusive scans. When every unit costs the same (equal mode, or equal
// units laid whole, several a part) the counts follow in closed form from a unit's index, and
// the second pass and its scan are skipped (0.2-0.5 us at B 1-256, bench/results/ab-s16).
// Sizing the CTA to the batch takes 0.3-0.6 us (5-8 %) off the plan at B 1-256 against a fixed
// 512 threads; two requests a thread instead of one costs more than it saves, with loops
// (bench/results/ab-s12) and without (ab-s13). The plan is one thread's chain of dependent
// instructions: the 32-bit line, the kernel without loops for one unit a thread and the
// one-barrier scans took it from 6.0-6.7 to 4.7-5.4 us event-timed on the H200
// (bench/results/ab-s13).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <string>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/trace.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/decode/decode_launch.hpp"
#include "cuda/decode/fixed_split.hpp"
#include "mla/ops.hpp"
#include "mla/schedule.hpp"

namespace mla::cuda::decode {
namespace {

constexpr int kPlanMaxThreads = 512;
constexpr int kPlanMaxWarps = kPlanMaxThreads / 32;
static_assert((kPlanMaxWarps & (kPlanMaxWarps - 1)) == 0, "the scans index warp sums by a mask");

// The plan's CTA size for a batch: one thread a request, whole warps, at most kPlanMaxThreads.
int plan_threads(int batch) { return std::clamp((batch + 31) / 32 * 32, 32, kPlanMaxThreads); }

// A build with -DMLA_PLAN_TRACE=1 stamps thread 0's %globaltimer after each phase of the plan and
// prints the phases (ns) when the plan ends: a timeline of one plan, for docs/perf-notes.md.
#if defined(MLA_PLAN_TRACE) && MLA_PLAN_TRACE
__shared__ unsigned long long trace_ns[9];
#define MLA_PLAN_STAMP(i) (threadIdx.x == 0 ? (void)(trace_ns[i] = globaltimer_ns()) : (void)0)
#else
#define MLA_PLAN_STAMP(i) ((void)0)
#endif

// Shuffles of the scanned values: scalars, and the per-thread counts of pass 2.
template <typename V>
__device__ __forceinline__ V shfl_up(V v, int off) {
  return __shfl_up_sync(0xffffffffu, v, off);
}
template <typename V>
__device__ __forceinline__ V shfl_idx(V v, int lane) {
  return __shfl_sync(0xffffffffu, v, lane);
}

// Pass 2's counts of one thread's units, scanned together (one block scan instead of four):
// sums of items, split units and slots, and the largest part of an item (-1: none).
struct Counts {
  int items, splits, slots, last_part;
};
__device__ __forceinline__ Counts shfl_up(Counts v, int off) {
  return {__shfl_up_sync(0xffffffffu, v.items, off), __shfl_up_sync(0xffffffffu, v.splits, off),
          __shfl_up_sync(0xffffffffu, v.slots, off), __shfl_up_sync(0xffffffffu, v.last_part, off)};
}
__device__ __forceinline__ Counts shfl_idx(Counts v, int lane) {
  return {__shfl_sync(0xffffffffu, v.items, lane), __shfl_sync(0xffffffffu, v.splits, lane),
          __shfl_sync(0xffffffffu, v.slots, lane), __shfl_sync(0xffffffffu, v.last_part, lane)};
}
struct CountsOp {
  __device__ Counts operator()(const Counts& a, const Counts& b) const {
    return {a.items + b.items, a.splits + b.splits, a.slots + b.slots, max(a.last_part, b.last_part)};
  }
};

// Exclusive scan of one value per thread across the CTA (whole warps, at most kPlanMaxWarps)
// under an associative, commutative `op` with `identity`; `total` gets the reduction of all values.
// One barrier: each warp's sum goes to warp_sums, and every warp then scans the (at most
// kPlanMaxWarps) sums itself, instead of one warp scanning them between two more barriers.
// warp_sums is read after the call returns in other warps: each scan of a plan has its own.
template <typename V, typename Op>
__device__ V block_exclusive_scan(V value, V identity, Op op, V* warp_sums /* [kPlanMaxWarps] */,
                                  V& total) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  V inclusive = value;
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const V up = shfl_up(inclusive, off);
    if (lane >= off) inclusive = op(up, inclusive);
  }
  V exclusive = shfl_up(inclusive, 1);
  if (lane == 0) exclusive = identity;
  if (blockDim.x == 32) {  // one warp (a batch of up to 32): no shared memory, no barriers
    // The barrier the callers rely on to order their shared-memory atomics before their reads
    // (max / min unit cost) is, for one warp, this one.
    __syncwarp();
    total = shfl_idx(inclusive, 31);
    return exclusive;
  }
  if (lane == 31) warp_sums[warp] = inclusive;
  const int warps = int(blockDim.x >> 5);
  if (int(threadIdx.x) >= warps && threadIdx.x < kPlanMaxWarps) warp_sums[threadIdx.x] = identity;
  __syncthreads();
  // Lane l holds warp l's sum (absent warps: the identity; lanes past kPlanMaxWarps repeat the
  // first ones and are never read), scanned across the lanes.
  V w_inclusive = warp_sums[lane & (kPlanMaxWarps - 1)];
#pragma unroll
  for (int off = 1; off < kPlanMaxWarps; off <<= 1) {
    const V up = shfl_up(w_inclusive, off);
    if (lane >= off) w_inclusive = op(up, w_inclusive);
  }
  const V before = shfl_idx(w_inclusive, warp > 0 ? warp - 1 : 0);
  total = shfl_idx(w_inclusive, kPlanMaxWarps - 1);
  return warp > 0 ? op(before, exclusive) : exclusive;
}

struct Plus {
  template <typename V>
  __device__ V operator()(V a, V b) const { return a + b; }
};

// Cost-line positions. When the whole line (every unit's cost and the parts' cuts) fits in 31
// bits, as it does for any batch whose cache fits in memory today, the plan works on it in 32-bit
// unsigned arithmetic (LinePos = uint32_t); otherwise in 64 bits (long long), where a division
// is a long subroutine. The plan is one thread's chain of dependent instructions (ncu: ~6 cycles
// an instruction), so the 32-bit line is what a plan mostly waits for less.
__device__ __noinline__ long long div_line_wide(long long a, long long b) { return a / b; }
__device__ __forceinline__ long long div_line(long long a, long long b) {  // a >= 0, b >= 1
  if (((a | b) >> 32) == 0) return (long long)(uint32_t(a) / uint32_t(b));
  return div_line_wide(a, b);  // out of line: it runs only for lines past 32 bits
}
__device__ __forceinline__ uint32_t div_line(uint32_t a, uint32_t b) { return a / b; }

// The part (CTA) of a position on the cost line: payload cost units a part, the rest to the last.
template <typename LinePos>
__device__ __forceinline__ int part_of(LinePos position, LinePos payload, int parts) {
  const LinePos q = div_line(position, payload);
  return q < LinePos(parts - 1) ? int(q) : parts - 1;
}

// The parts a unit spans on the cost line, after snapping cuts near its edges.
struct UnitSpan {
  int part_first, part_last;
};
template <typename LinePos>
__device__ __forceinline__ UnitSpan unit_span(LinePos start, LinePos end, LinePos payload,
                                              LinePos snap, int parts) {
  int first = part_of(start, payload, parts);
  const LinePos next_cut = LinePos(first + 1) * payload;
  if (first + 1 <= parts - 1 && next_cut < end && next_cut - start <= snap) ++first;
  int last = max(part_of(end - 1, payload, parts), first);
  if (last > first && end - LinePos(last) * payload <= snap) --last;
  return {first, last};
}

struct UnitCost {
  int blocks;  // key blocks of the unit
  int kv_end;  // keys its rows may see
};

__device__ __forceinline__ UnitCost unit_cost(const RequestGeometry& g, int tile, int block_m,
                                              int num_heads) {
  const int rows = g.q_len * num_heads;
  const int row_end = min(rows, (tile + 1) * block_m);
  // The last tile's last row is the request's last query, which sees all kv_len keys (what
  // tile_visible_keys gives it, without its division).
  const int visible = row_end == rows ? g.kv_len : tile_visible_keys(g, row_end, num_heads);
  return {key_blocks(visible), visible};
}

// A split unit's piece q: the blocks between the cuts that bound part q (the unit's edges for its
// end parts), as work item `item`.
struct SplitPieces {
  long long first;  // cost-line position of the unit's first key block
  RequestGeometry g;
  int request, row_tile, blocks, kv_end;
  int part_first, part_last, slot, item;
};
template <typename LinePos>
__device__ __forceinline__ void write_piece(const PlanParams& pp, const SplitPieces& u, int q,
                                            LinePos payload) {
  const int pieces = u.part_last - u.part_first + 1;
  const LinePos first = LinePos(u.first);
  const LinePos lo = q == u.part_first ? 0 : LinePos(q) * payload - first;
  const LinePos hi = q == u.part_last ? LinePos(u.blocks) : LinePos(q + 1) * payload - first;
  WorkItem w{};
  w.request = u.request;
  w.row_tile = u.row_tile;
  w.q_start = u.g.q_start;
  w.q_len = u.g.q_len;
  w.kv_len = u.g.kv_len;
  // In 64 bits: a request of INT_MAX keys has 2^25 blocks, and 2^25 * kBlockN is past INT_MAX.
  w.kv_begin = int(min((long long)lo * kBlockN, (long long)u.kv_end));
  w.kv_end = int(min((long long)hi * kBlockN, (long long)u.kv_end));
  w.slot = pieces > 1 ? u.slot + (q - u.part_first) : -1;
  w.part = q;
  const int item = u.item + (q - u.part_first);
  if (item < pp.max_items) pp.items[item] = w;
}

// Units of more than kLongUnitPieces pieces (a long request over many CTAs) are written by the
// whole CTA after pass 3, not by the one thread that owns them: one thread writing 60+ items in
// series is what a batch-1 plan would otherwise wait for. Up to kLongUnitQueue of them a plan.
constexpr int kLongUnitPieces = 8;
constexpr int kLongUnitQueue = 64;

// The plan kernel's argument: its parameters and what the host derives from them once (the
// kernel starts with the first request's loads rather than with divisions).
struct PlanLaunch {
  PlanParams pp;
  // Lanes (decode_params.cuh): with several row tiles per request, plan whole requests over
  // num_parts / lanes virtual parts; each unit is then costed by its last row tile (the one that
  // sees the most keys) and run by `lanes` CTAs side by side.
  int lanes;         // plan_lanes(max_q_len, num_heads, block_m, num_parts)
  int parts;         // num_parts / lanes
  int per_thread;    // requests a thread owns (a contiguous range)
  int block_m_log2;  // block_m is a power of two
  uint32_t parts_magic;  // division_magic(parts): the even share without a division
};

// The 32-bit line is used when the total cost is below 2^31 and the parts below 2^20: every
// position the plan forms (a cut, (q + 1) * payload for q < parts, with payload at most 5/4 of
// the even share plus one) then stays below 2^32.
constexpr long long kNarrowLineCost = 1LL << 31;
constexpr int kNarrowLineParts = 1 << 20;

// The CTA's shared state.
struct PlanShared {
  long long scan64[kPlanMaxWarps];
  Counts scan_counts[kPlanMaxWarps];
  SplitPieces long_units[kLongUnitQueue];
  int max_unit_cost, min_unit_cost, num_long_units, max_pieces;
};

// A thread's requests [b_begin, b_end) and what it keeps of the first from pass to pass: its
// geometry and its first unit's cost.
struct PlanThread {
  const PlanLaunch* launch;
  int tid, threads, b_begin, b_end;
  RequestGeometry first_geometry;
  UnitCost first_cost;

  __device__ RequestGeometry geometry(int b) const {
    return b == b_begin ? first_geometry : request_geometry(launch->pp.layout, b);
  }
  // row_tiles() by a shift; units of a request with `tiles` row tiles, and the row tile that
  // costs unit t.
  __device__ int tiles_of(const RequestGeometry& g) const {
    return (g.q_len * launch->pp.layout.num_heads + launch->pp.block_m - 1) >> launch->block_m_log2;
  }
  __device__ int units_of(int tiles) const { return launch->lanes > 1 ? min(tiles, 1) : tiles; }
  __device__ int cost_tile(int tiles, int t) const { return launch->lanes > 1 ? tiles - 1 : t; }
  __device__ UnitCost cost(const RequestGeometry& g, int tiles, int t) const {
    return unit_cost(g, cost_tile(tiles, t), launch->pp.block_m, launch->pp.layout.num_heads);
  }
  __device__ bool is_first_unit(int b, int t) const { return b == b_begin && t == 0; }
};

// Calls f(b, t, g, tiles, first) for each unit (request b, row tile t) of the thread, in line
// order; `first` marks the thread's first unit, whose cost the thread keeps. kOneUnit: the host
// found that a thread has at most one request and a request at most one unit (lanes, or one row
// tile a request): then the unit is the thread's first request's, if it has queries, with no
// loops around it (a plan is one thread's chain of dependent instructions: loops and the branches
// around them are on it).
template <bool kOneUnit, typename F>
__device__ __forceinline__ void for_each_unit(const PlanThread& th, F&& f) {
  if constexpr (kOneUnit) {
    if (th.b_begin < th.b_end && th.first_geometry.q_len > 0)
      f(th.b_begin, 0, th.first_geometry, th.tiles_of(th.first_geometry), true);
  } else {
#pragma unroll 1
    for (int b = th.b_begin; b < th.b_end; ++b) {
      const RequestGeometry g = th.geometry(b);
      const int tiles = th.tiles_of(g);
      for (int t = 0; t < th.units_of(tiles); ++t) f(b, t, g, tiles, th.is_first_unit(b, t));
    }
  }
}

// Everything after the first scan: the payload, pass 2 (counts), the second scan, pass 3 (the
// writes), the long units and the header, on a line of LinePos positions.
template <bool kOneUnit, typename LinePos>
__device__ __forceinline__ void plan_line(const PlanThread& th, PlanShared& sh, LinePos total_cost,
                                          LinePos cost_base) {
  const PlanParams& pp = th.launch->pp;
  const int parts = th.launch->parts, lanes = th.launch->lanes;
  const int tid = th.tid, threads = th.threads;
  LinePos even;
  if constexpr (sizeof(LinePos) == 4)  // below 2^31 + 2^20: no wrap
    even = div_by_magic(total_cost + LinePos(parts) - 1, uint32_t(parts), th.launch->parts_magic);
  else
    even = div_line(LinePos(total_cost + LinePos(parts) - 1), LinePos(parts));
  LinePos payload = even < LinePos(kMinBlocksPerPart) ? LinePos(kMinBlocksPerPart) : even;
  // Whole units: k = the fewest largest units that cover the even share. When k of them cost at
  // most a quarter of a unit more than the share (one unit: at most 5/4 of the share), the
  // payload grows to k units, so that equal units are never cut: on the line with its snapped
  // cuts some CTA runs k whole units anyway, and no piece pays for its partial result. (Cutting
  // such a line evenly without snapping made 16 h B 128 kv 16k, 128 units of 257 blocks on 132
  // parts, 1-3 % slower: that row is bound by the card's bandwidth, not by its idle SMs.)
  const int max_cost = sh.max_unit_cost;
  int whole_units = 0;  // k, when the payload grew to k units
  if (max_cost > 0) {
    const LinePos k_units = div_line(LinePos(even + LinePos(max_cost) - 1), LinePos(max_cost));
    const LinePos whole = k_units * LinePos(max_cost);
    const bool whole_fits = k_units <= 1 ? 4LL * max_cost <= 5LL * (long long)even
                                         : 4LL * ((long long)whole - (long long)even) <= max_cost;
    if (whole_fits && whole > payload) {
      payload = whole;
      whole_units = int(k_units);
    }
  }
  LinePos snap = payload / 8 > LinePos(kOverheadBlocks) ? payload / 8 : LinePos(kOverheadBlocks);
  // Equal units (every request the same length): each is cut into the same number of pieces,
  // k = ceil(blocks / payload), of ceil(blocks / k) blocks, each piece a CTA of its own. On the
  // line above the cuts fall wherever the units do: units of 17 cost blocks on a payload of 9
  // mostly take three pieces, and a CTA whose share straddles two units runs two items. Here the
  // line is laid out again with each unit padded to k pieces and no fixed cost on it, so that
  // every unit starts at a cut (lead = 0, advance = k * payload, snap = 0). Only when the n * k
  // pieces fit on the parts; else the line stays as it is.
  LinePos lead = kOverheadBlocks;  // line cost before a unit's first key block
  LinePos equal_advance = 0;       // line cost of a unit in equal mode (0: the line above)
  const int unit_total = max_cost;
  int equal_units = 0, equal_pieces = 0;  // equal mode: n, and k parts (pieces) a unit
  if (unit_total == sh.min_unit_cost && unit_total > kOverheadBlocks) {
    const LinePos blocks = LinePos(unit_total - kOverheadBlocks);
    const LinePos n = div_line(total_cost, LinePos(unit_total));
    const LinePos k = div_line(LinePos(blocks + payload - 1), payload);
    if ((long long)n * (long long)k <= parts) {
      payload = div_line(LinePos(blocks + k - 1), k);
      snap = 0;
      lead = 0;
      equal_advance = k * payload;
      // Each unit takes all k of its parts: ceil(blocks / ceil(blocks / k)) = k when k is
      // ceil(blocks / p) for a whole p (here the payload before this one).
      equal_units = int(n);
      equal_pieces = int(k);
    }
  }
  // Whether some unit may take more than kLongUnitPieces pieces, and so be written by the whole
  // CTA behind a barrier after pass 3: in equal mode a unit takes at most k = equal_advance /
  // payload; on the line a unit of cost c spans at most ceil((c - 1) / payload) + 1 parts
  // wherever it starts, at most kLongUnitPieces when c <= (kLongUnitPieces - 1) * payload + 1.
  // Without such units, no barrier: thread 0 writes the header as soon as its own writes are done.
  const bool may_have_long_units =
      equal_advance > 0 ? (long long)equal_advance > (long long)kLongUnitPieces * (long long)payload
                        : (long long)max_cost > (long long)(kLongUnitPieces - 1) * (long long)payload + 1;
  MLA_PLAN_STAMP(3);
  // Equal units laid whole on the line (not in equal mode, a payload of whole_units units: the
  // cuts fall on unit edges, so unit u is one item on part u / whole_units).
  if (equal_advance > 0 || unit_total != sh.min_unit_cost) whole_units = 0;
  const bool closed_form = equal_advance > 0 || whole_units > 0;
  // This thread's first unit's line position (after the units before it), and how far a unit
  // moves the line.
  const LinePos units_before = closed_form ? div_line(cost_base, LinePos(unit_total)) : 0;
  const LinePos line_start = equal_advance > 0 ? units_before * equal_advance : cost_base;
  auto advance = [&](int blocks) {
    return equal_advance > 0 ? equal_advance : LinePos(blocks + kOverheadBlocks);
  };

  // The counts before this thread's units and in all: for equal units in closed form (in equal
  // mode unit u runs on parts [u k, u k + k); laid whole, on part u / whole_units), so no pass
  // over the units and no second scan; else pass 2 and a scan of its counts.
  UnitSpan first_span{0, 0};
  Counts before, all;
  int max_pieces = 1;
  if (equal_advance > 0) {
    const int u0 = int(units_before), n = equal_units, k = equal_pieces;
    const bool split = k > 1;
    before = Counts{u0 * k, split ? u0 : 0, split ? u0 * k : 0, u0 * k - 1};
    all = Counts{n * k, split ? n : 0, split ? n * k : 0, n * k - 1};
    first_span = UnitSpan{u0 * k, u0 * k + k - 1};
    max_pieces = k;
    MLA_PLAN_STAMP(4);
  } else if (whole_units > 0) {
    // Four independent divisions: unit u0 = cost_base / c starts at cost_base, on part
    // cost_base / payload; the unit before it is on the part before when u0 starts its part.
    const int u0 = int(units_before);
    const int part0 = int(div_line(cost_base, payload));
    const int n = int(div_line(total_cost, LinePos(unit_total)));
    const int last = int(div_line(LinePos(total_cost - LinePos(unit_total)), payload));
    before = Counts{u0, 0, 0, u0 == part0 * whole_units ? part0 - 1 : part0};
    all = Counts{n, 0, 0, last};
    first_span = UnitSpan{part0, part0};
    MLA_PLAN_STAMP(4);
  } else {
    // Pass 2: items, split units and slots of this thread's units; the first unit's parts are kept
    // for pass 3.
    int my_items = 0, my_splits = 0, my_slots = 0;
    int my_last_part = -1;  // part of this thread's last item
    int my_max_pieces = 1;
    {
      LinePos pos = line_start;
      for_each_unit<kOneUnit>(th, [&](int, int t, const RequestGeometry& g, int tiles, bool first) {
        const int nb = first ? th.first_cost.blocks : th.cost(g, tiles, t).blocks;
        UnitSpan span;
        if (nb > 0) {
          span = unit_span(pos, LinePos(pos + lead + LinePos(nb)), payload, snap, parts);
        } else {
          span.part_first = span.part_last = part_of(pos, payload, parts);
        }
        if (first) first_span = span;
        const int pieces = span.part_last - span.part_first + 1;
        my_last_part = span.part_last;
        my_items += pieces;
        if (pieces > 1) {
          my_splits += 1;
          my_slots += pieces;
          my_max_pieces = max(my_max_pieces, pieces);
        }
        pos += advance(nb);
      });
    }
    MLA_PLAN_STAMP(4);
    if (my_max_pieces > 1) atomicMax(&sh.max_pieces, my_max_pieces);  // read after the scans' syncs
    before = block_exclusive_scan(Counts{my_items, my_splits, my_slots, my_last_part},
                                  Counts{0, 0, 0, -1}, CountsOp{}, sh.scan_counts, all);
    max_pieces = sh.max_pieces;
  }
  const int num_items = all.items, num_splits = all.splits, num_slots = all.slots;
  const int last_part = all.last_part;
  MLA_PLAN_STAMP(5);
  const int item_base = before.items, split_base = before.splits, slot_base = before.slots;
  // Item parts never decrease along the list, so the part of the last item before this thread's
  // first is the largest last part of the threads before it (-1: none).
  int prev_part = before.last_part;
  const int stored_items = min(num_items, pp.max_items);
  // CTA p runs items [part_begin[p], part_begin[p + 1]): the first item of part >= p. The thread
  // that writes an item whose part q is past the previous item's part sets part_begin for the
  // parts in between; the parts after the last item's begin at the end of the list.
  auto begin_parts = [&](int item_index, int part) {
#pragma unroll 1
    for (int x = prev_part + 1; x <= part; ++x) pp.part_begin[x] = min(item_index, stored_items);
    prev_part = max(prev_part, part);
  };

  // Pass 3: write the items and split units.
  {
    LinePos pos = line_start;
    int item = item_base, split = split_base, slot = slot_base;
    for_each_unit<kOneUnit>(th, [&](int b, int t, const RequestGeometry& g, int tiles, bool first_unit) {
      const UnitCost c = first_unit ? th.first_cost : th.cost(g, tiles, t);
      const LinePos first = pos + lead;
      if (c.blocks == 0) {
        const int part = first_unit ? first_span.part_first : part_of(pos, payload, parts);
        if (item < pp.max_items)
          pp.items[item] = WorkItem{b, t, 0, 0, -1, part, g.q_start, g.q_len, g.kv_len, {0, 0, 0}};
        begin_parts(item, part);
        ++item;
      } else {
        const UnitSpan span =
            first_unit ? first_span
                       : unit_span(pos, LinePos(first + LinePos(c.blocks)), payload, snap, parts);
        const SplitPieces u{(long long)first, g, b, t, c.blocks, c.kv_end, span.part_first,
                            span.part_last, slot, item};
        const int pieces = span.part_last - span.part_first + 1;
        int queued = -1;
        if (may_have_long_units && pieces > kLongUnitPieces) {  // else: written here, whatever the bound
          queued = atomicAdd(&sh.num_long_units, 1);
          if (queued < kLongUnitQueue) sh.long_units[queued] = u;
        }
        if (queued >= 0 && queued < kLongUnitQueue) {
          // Written after pass 3 (items and part_begin of parts part_first + 1 .. part_last).
          begin_parts(item, span.part_first);
          prev_part = span.part_last;
        } else {
#pragma unroll 1
          for (int q = span.part_first; q <= span.part_last; ++q) {
            write_piece(pp, u, q, payload);
            begin_parts(item + (q - span.part_first), q);
          }
        }
        item += pieces;
        if (pieces > 1) {
          if (split < pp.max_split_units)
            pp.split_units[split] = SplitUnit{b, t, slot, pieces, g.q_start, g.q_len, g.kv_len, 0};
          ++split;
          slot += pieces;
        }
      }
      pos += advance(c.blocks);
    });
  }
#pragma unroll 1
  for (int x = last_part + 1 + tid; x <= parts; x += threads) pp.part_begin[x] = stored_items;
  MLA_PLAN_STAMP(6);
  if (may_have_long_units) {  // the same for every thread
    __syncthreads();  // the queue of long units is complete
    const int queued_units = min(sh.num_long_units, kLongUnitQueue);
    for (int i = 0; i < queued_units; ++i) {
      const SplitPieces& u = sh.long_units[i];
#pragma unroll 1
      for (int q = u.part_first + tid; q <= u.part_last; q += threads) {
        write_piece(pp, u, q, payload);
        if (q > u.part_first) pp.part_begin[q] = min(u.item + (q - u.part_first), stored_items);
      }
    }
  }
  MLA_PLAN_STAMP(7);
  if (tid == 0) {
    ScheduleHeader h{};
    h.magic = kScheduleMagic;
    h.num_items = stored_items;
    h.num_split_units = min(num_splits, pp.max_split_units);
    h.block_m = pp.block_m;
    h.batch_size = pp.layout.batch_size;
    h.num_heads = pp.layout.num_heads;
    h.q_shape = schedule_q_shape(pp.layout);
    h.num_parts = pp.num_parts;
    h.lanes = lanes;
    h.num_slots = num_slots;
    h.max_pieces = max_pieces;
    // A plan that does not fit its workspace (impossible by the capacity bounds above) is
    // marked so that the decode kernel traps instead of producing wrong results.
    if (num_items > pp.max_items || num_splits > pp.max_split_units ||
        int64_t(num_slots) * lanes > pp.max_slots)
      h.magic = 0;
    *pp.header = h;
#if defined(MLA_PLAN_TRACE) && MLA_PLAN_TRACE
    MLA_PLAN_STAMP(8);
    printf("plan-trace batch %d threads %d line %d pass1 %llu scan1 %llu payload %llu pass2 %llu "
           "scan2 %llu pass3 %llu long %llu header %llu total %llu\n",
           pp.layout.batch_size, threads, int(sizeof(LinePos) * 8), trace_ns[1] - trace_ns[0],
           trace_ns[2] - trace_ns[1], trace_ns[3] - trace_ns[2], trace_ns[4] - trace_ns[3],
           trace_ns[5] - trace_ns[4], trace_ns[6] - trace_ns[5], trace_ns[7] - trace_ns[6],
           trace_ns[8] - trace_ns[7], trace_ns[8] - trace_ns[0]);
#endif
  }
}

// The 64-bit line, out of line: it runs only for totals past 2^31 and stays out of the way of
// the 32-bit line's code.
template <bool kOneUnit>
__device__ __noinline__ void plan_line_wide(const PlanThread th, PlanShared& sh, long long total_cost,
                                            long long cost_base) {  // th by value: kept in registers
  plan_line<kOneUnit, long long>(th, sh, total_cost, cost_base);
}

template <bool kOneUnit>
__global__ void __launch_bounds__(kPlanMaxThreads) plan_decode_kernel(const __grid_constant__ PlanLaunch launch) {
  const PlanParams& pp = launch.pp;
  __shared__ PlanShared sh;
  allow_dependent_launch();  // the decode kernel's CTAs start and wait for this plan
  MLA_PLAN_STAMP(0);
  PlanThread th;
  th.launch = &launch;
  th.tid = threadIdx.x;
  th.threads = int(blockDim.x);
  const int batch = pp.layout.batch_size;
  th.b_begin = min(batch, th.tid * launch.per_thread);
  th.b_end = min(batch, th.b_begin + launch.per_thread);
  // The thread's first request (its only one up to 512 requests), read first of all and kept for
  // the three passes; later ones are read again in each pass.
  th.first_geometry = RequestGeometry{};
  if (th.b_begin < th.b_end) th.first_geometry = request_geometry(pp.layout, th.b_begin);

  // Pass 1: cost of this thread's units, and the largest unit.
  if (th.tid == 0) {
    sh.max_unit_cost = 0;
    sh.min_unit_cost = INT_MAX;
    sh.num_long_units = 0;
    sh.max_pieces = 1;
  }
  long long my_cost = 0;
  int my_max = 0, my_min = INT_MAX;
  th.first_cost = UnitCost{0, 0};
  for_each_unit<kOneUnit>(th, [&](int, int t, const RequestGeometry& g, int tiles, bool first) {
    UnitCost c;
    if constexpr (kOneUnit) {
      // The unit is costed by the request's last row tile, whose last row sees all its keys.
      c = UnitCost{key_blocks(g.kv_len), g.kv_len};
    } else {
      c = th.cost(g, tiles, t);
    }
    if (first) th.first_cost = c;
    const int cost = c.blocks + kOverheadBlocks;
    my_cost += cost;
    my_max = max(my_max, cost);
    my_min = min(my_min, cost);
  });
  MLA_PLAN_STAMP(1);
  __syncthreads();
  atomicMax(&sh.max_unit_cost, my_max);
  if (my_min != INT_MAX) atomicMin(&sh.min_unit_cost, my_min);
  long long total_cost = 0;
  const long long cost_base = block_exclusive_scan(my_cost, 0LL, Plus{}, sh.scan64, total_cost);
  MLA_PLAN_STAMP(2);
  if (total_cost < kNarrowLineCost && launch.parts < kNarrowLineParts)
    plan_line<kOneUnit, uint32_t>(th, sh, uint32_t(total_cost), uint32_t(cost_base));
  else
    plan_line_wide<kOneUnit>(th, sh, total_cost, cost_base);
}

// ---- The deterministic plan (PlanParams::split_keys > 0; fixed_split.hpp) ------------------
// One CTA, a thread per request up to 512 (a contiguous range of requests a thread past that).
// Each thread counts its requests' items (units x pieces), split units, slots and line cost; one
// scan of the counts and one of the costs give every thread its place. The owner of a request
// writes its split units; the items are written by the whole CTA (item i by thread i mod
// threads, which finds its request through the threads' first items in shared memory), so that
// one long request's pieces do not become one thread's serial stores. Its argument is the
// balanced plan's PlanLaunch (pp, lanes, parts, per_thread; block_m_log2 and parts_magic unused).
struct FixedPlanShared {
  Counts scan_counts[kPlanMaxWarps];
  long long scan64[kPlanMaxWarps];
  // Thread t's first item, slot and line position, and its first request's geometry.
  int items_before[kPlanMaxThreads];
  int slots_before[kPlanMaxThreads];
  long long cost_before[kPlanMaxThreads];
  RequestGeometry geometry[kPlanMaxThreads];
  int max_pieces;
};

// A request's share of the plan: its units (the whole request with lanes, else one a row tile;
// none without queries) and the pieces of each.
struct FixedRequest {
  int units, pieces;
  __device__ int items() const { return units * pieces; }
  __device__ int slots() const { return pieces > 1 ? units * pieces : 0; }
  __device__ int splits() const { return pieces > 1 ? units : 0; }
};
__device__ __forceinline__ FixedRequest fixed_request(const PlanLaunch& launch,
                                                      const RequestGeometry& g) {
  const int tiles = row_tiles(g.q_len, launch.pp.layout.num_heads, launch.pp.block_m);
  return {tiles == 0 ? 0 : launch.lanes > 1 ? 1 : tiles,
          fixed_split::pieces(g.kv_len, launch.pp.split_keys)};
}

__global__ void __launch_bounds__(kPlanMaxThreads) plan_fixed_kernel(const __grid_constant__ PlanLaunch launch) {
  const PlanParams& pp = launch.pp;
  __shared__ FixedPlanShared sh;
  allow_dependent_launch();  // the decode kernel's CTAs start and wait for this plan
  const int tid = int(threadIdx.x), threads = int(blockDim.x);
  const int batch = pp.layout.batch_size, split_keys = pp.split_keys, parts = launch.parts;
  const int b_begin = min(batch, tid * launch.per_thread);
  const int b_end = min(batch, b_begin + launch.per_thread);
  if (tid == 0) sh.max_pieces = 1;

  // Counts and line cost of this thread's requests.
  Counts mine{0, 0, 0, -1};
  long long my_cost = 0;
  int my_max_pieces = 1;
  RequestGeometry first{};
  for (int b = b_begin; b < b_end; ++b) {
    const RequestGeometry g = request_geometry(pp.layout, b);
    if (b == b_begin) first = g;
    const FixedRequest fr = fixed_request(launch, g);
    mine.items += fr.items();
    mine.splits += fr.splits();
    mine.slots += fr.slots();
    my_cost += fr.units * fixed_split::unit_cost(g.kv_len, split_keys);
    if (fr.splits() > 0) my_max_pieces = max(my_max_pieces, fr.pieces);
  }
  __syncthreads();  // sh.max_pieces is set
  if (my_max_pieces > 1) atomicMax(&sh.max_pieces, my_max_pieces);  // read after the scans' syncs
  Counts all;
  const Counts before =
      block_exclusive_scan(mine, Counts{0, 0, 0, -1}, CountsOp{}, sh.scan_counts, all);
  long long total_cost = 0;
  const long long cost_before = block_exclusive_scan(my_cost, 0LL, Plus{}, sh.scan64, total_cost);
  sh.items_before[tid] = before.items;
  sh.slots_before[tid] = before.slots;
  sh.cost_before[tid] = cost_before;
  sh.geometry[tid] = first;

  // This thread's split units (row tiles of a request in key-ordered slots, one after another).
  {
    int split = before.splits, slot = before.slots;
    for (int b = b_begin; b < b_end; ++b) {
      const RequestGeometry g = b == b_begin ? first : request_geometry(pp.layout, b);
      const FixedRequest fr = fixed_request(launch, g);
      if (fr.pieces < 2) continue;
      for (int u = 0; u < fr.units; ++u, ++split, slot += fr.pieces)
        if (split < pp.max_split_units)
          pp.split_units[split] = SplitUnit{b, u, slot, fr.pieces, g.q_start, g.q_len, g.kv_len, 0};
    }
  }
  __syncthreads();  // the threads' places are in shared memory

  // The items, a grid stride over the CTA: item i belongs to the last thread whose first item is
  // at or before it.
  const int num_items = all.items, stored_items = min(num_items, pp.max_items);
  for (int i = tid; i < stored_items; i += threads) {
    int lo = 0, hi = threads - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) >> 1;
      if (sh.items_before[mid] <= i) lo = mid; else hi = mid - 1;
    }
    const int owner = lo;
    int local = i - sh.items_before[owner];
    long long position = sh.cost_before[owner];
    int slot = sh.slots_before[owner];
    const int owner_begin = min(batch, owner * launch.per_thread);
    const int owner_end = min(batch, owner_begin + launch.per_thread);
    for (int b = owner_begin; b < owner_end; ++b) {  // (ends at the item's request)
      const RequestGeometry g = b == owner_begin ? sh.geometry[owner] : request_geometry(pp.layout, b);
      const FixedRequest fr = fixed_request(launch, g);
      const long long unit_cost = fixed_split::unit_cost(g.kv_len, split_keys);
      if (local < fr.items()) {
        const int u = local / fr.pieces, k = local - u * fr.pieces;
        const long long start = position + u * unit_cost + fixed_split::piece_offset(k, split_keys);
        const long long end = start + fixed_split::piece_cost(k, g.kv_len, split_keys);
        const fixed_split::KeyRange keys = fixed_split::piece_keys(k, g.kv_len, split_keys);
        pp.items[i] = WorkItem{b,
                               u,
                               keys.begin,
                               keys.end,
                               fr.pieces > 1 ? slot + u * fr.pieces + k : -1,
                               fixed_split::part_of(start, total_cost, parts),
                               g.q_start,
                               g.q_len,
                               g.kv_len,
                               {0, 0, 0}};
        const fixed_split::PartRange begun = fixed_split::parts_after(start, end, total_cost, parts);
        for (int q = begun.first; q <= begun.last; ++q) pp.part_begin[q] = i + 1;
        break;
      }
      local -= fr.items();
      position += fr.units * unit_cost;
      slot += fr.slots();
    }
  }
  // Part 0 begins at item 0; with no items at all, every part is empty.
  if (num_items == 0) {
    for (int q = tid; q <= parts; q += threads) pp.part_begin[q] = 0;
  } else if (tid == 0) {
    pp.part_begin[0] = 0;
  }
  if (tid == 0) {
    ScheduleHeader h{};
    h.magic = kScheduleMagic;
    h.num_items = stored_items;
    h.num_split_units = min(all.splits, pp.max_split_units);
    h.block_m = pp.block_m;
    h.batch_size = batch;
    h.num_heads = pp.layout.num_heads;
    h.q_shape = schedule_q_shape(pp.layout);
    h.num_parts = pp.num_parts;
    h.lanes = launch.lanes;
    h.num_slots = all.slots;
    h.max_pieces = sh.max_pieces;
    h.split_keys = split_keys;
    // A plan that does not fit its workspace (impossible by the capacity bounds of
    // layout_fixed_schedule and the clamp of kv_len to max_kv_len) traps the decode kernel.
    if (num_items > pp.max_items || all.splits > pp.max_split_units ||
        int64_t(all.slots) * launch.lanes > pp.max_slots)
      h.magic = 0;
    *pp.header = h;
  }
}

size_t align_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// The batch shape every schedule's capacity starts from, checked (num_parts 0: the SM count).
DecodeSchedule batch_capacity(const char* op, int max_batch, int max_q_len, int num_heads,
                              int num_parts) {
  MLA_CHECK(max_batch >= 1, op, ": max_batch must be >= 1, got ", max_batch);
  MLA_CHECK(max_q_len >= 1, op, ": max_q_len must be >= 1, got ", max_q_len);
  MLA_CHECK(num_heads >= 1 && num_heads <= kMaxHeads, op, ": num_heads must be in [1, ", kMaxHeads,
            "], got ", num_heads);
  MLA_CHECK(num_parts >= 0, op, ": num_parts must be >= 0 (0 = the SM count), got ", num_parts);
  DecodeSchedule s;
  s.max_batch = max_batch;
  s.max_q_len = max_q_len;
  s.num_heads = num_heads;
  s.num_parts = num_parts == 0 ? current_device_info().sm_count : num_parts;
  return s;
}

// The array offsets of a schedule whose capacity (max_items, max_split_units, max_slots,
// num_parts) is set; no workspace pointer yet.
DecodeSchedule lay_out(DecodeSchedule s) {
  size_t offset = 0;
  s.header_offset = offset;
  offset = align_up(offset + sizeof(ScheduleHeader), 256);
  s.items_offset = offset;
  offset = align_up(offset + sizeof(WorkItem) * size_t(s.max_items), 256);
  s.part_begin_offset = offset;
  offset = align_up(offset + sizeof(int) * size_t(s.num_parts + 1), 256);
  s.split_units_offset = offset;
  offset = align_up(offset + sizeof(SplitUnit) * size_t(s.max_split_units), 256);
  s.partial_lse_offset = offset;
  offset = align_up(offset + sizeof(float) * size_t(s.max_slots) * kMaxBlockM, 256);
  s.partial_out_offset = offset;
  offset = align_up(offset + sizeof(float) * size_t(s.max_slots) * kMaxBlockM * kValueDim, 256);
  s.workspace_bytes = offset;
  return s;
}

// The balanced plan's capacity and array offsets.
DecodeSchedule layout_schedule(const char* op, int max_batch, int max_q_len, int num_heads,
                               int num_parts) {
  DecodeSchedule s = batch_capacity(op, max_batch, max_q_len, num_heads, num_parts);
  num_parts = s.num_parts;
  const int64_t tiles_per_request = (int64_t(max_q_len) * num_heads + 15) / 16;
  // (the bound in floating point first: the product of the largest ints would not fit in 64 bits)
  MLA_CHECK(double(max_batch) * double(tiles_per_request) + num_parts <= INT_MAX / 64, op,
            ": capacity too large: max_batch ", max_batch, " x max_q_len ", max_q_len,
            " x num_heads ", num_heads, " gives ", double(max_batch) * double(tiles_per_request),
            " row tiles");
  const int64_t max_units = int64_t(max_batch) * tiles_per_request;
  s.max_items = int(max_units) + num_parts;
  s.max_split_units = num_parts;
  s.max_slots = 2 * num_parts;
  return lay_out(s);
}

// The deterministic plan's (fixed_split.hpp): row tiles of the device's widest (64 rows on
// Hopper and A100; device_row_tile_cap), every unit in up to
// pieces(max_kv_len, split_keys) pieces, each a slot of its own when there are several. At
// least num_parts items, as the balanced plan has: a decode CTA asks L2 for item blockIdx.x /
// lanes before it has read the plan (cta_work).
DecodeSchedule layout_fixed_schedule(const char* op, int max_batch, int max_q_len, int num_heads,
                                     int max_kv_len, int split_keys, int num_parts) {
  DecodeSchedule s = batch_capacity(op, max_batch, max_q_len, num_heads, num_parts);
  num_parts = s.num_parts;
  MLA_CHECK(split_keys >= kBlockN && split_keys % kBlockN == 0, op,
            ": split_keys must be a positive multiple of ", kBlockN, " (the key tile), got ",
            split_keys);
  MLA_CHECK(max_kv_len >= 1, op, ": max_kv_len must be >= 1, got ", max_kv_len);
  const int64_t pieces = fixed_split::pieces(max_kv_len, split_keys);
  const int block_m = device_row_tile_cap();  // the deterministic mode's tiles on this device
  const int64_t tiles_per_request = (int64_t(max_q_len) * num_heads + block_m - 1) / block_m;
  const double bound = double(max_batch) * double(tiles_per_request) * double(pieces);
  MLA_CHECK(bound + num_parts <= INT_MAX / 64, op, ": capacity too large: max_batch ", max_batch,
            " x ", tiles_per_request, " row tiles x ", pieces, " pieces (max_kv_len ", max_kv_len,
            " / split_keys ", split_keys, ") gives ", bound, " pieces");
  const int64_t max_units = int64_t(max_batch) * tiles_per_request;
  const int64_t max_pieces = max_units * pieces;
  s.split_keys = split_keys;
  s.max_kv_len = max_kv_len;
  s.max_items = int(std::max<int64_t>(max_pieces, num_parts));
  s.max_split_units = pieces > 1 ? int(max_units) : 0;
  s.max_slots = pieces > 1 ? int(max_pieces) : 0;
  return lay_out(s);
}

}  // namespace

void launch_plan_kernel(const PlanParams& params, cudaStream_t stream) {
  const int block_m = params.block_m, num_heads = params.layout.num_heads;
  MLA_CHECK(block_m >= 1 && (block_m & (block_m - 1)) == 0, "plan_decode: row tiles of ", block_m,
            " rows (expected a power of two)");
  PlanLaunch launch{};
  launch.pp = params;
  launch.lanes = plan_lanes(params.layout.max_q_len, num_heads, block_m, params.num_parts);
  launch.parts = params.num_parts / launch.lanes;
  const int threads = plan_threads(params.layout.batch_size);
  launch.per_thread = (params.layout.batch_size + threads - 1) / threads;
  MLA_CHECK(launch.parts >= 1, "plan_decode: ", params.num_parts, " parts for ", launch.lanes,
            " lanes (the schedule needs at least one part a lane)");
  if (params.split_keys > 0) {
    plan_fixed_kernel<<<1, threads, 0, stream>>>(launch);
    MLA_CUDA_CHECK_LAUNCH();
    return;
  }
  while ((1 << launch.block_m_log2) < block_m) ++launch.block_m_log2;
  launch.parts_magic = division_magic(uint32_t(launch.parts));
  // One unit a thread (a request a thread, and one unit a request: lanes, or one row tile a
  // request): the plan without loops.
  const bool one_unit = launch.per_thread == 1 &&
                        (launch.lanes > 1 || row_tiles(params.layout.max_q_len, num_heads, block_m) <= 1);
  if (one_unit)
    plan_decode_kernel<true><<<1, threads, 0, stream>>>(launch);
  else
    plan_decode_kernel<false><<<1, threads, 0, stream>>>(launch);
  MLA_CUDA_CHECK_LAUNCH();
}

}  // namespace mla::cuda::decode

namespace mla {

size_t decode_workspace_bytes(int max_batch, int max_q_len, int num_heads, int num_parts) {
  return cuda::decode::layout_schedule("decode_workspace_bytes", max_batch, max_q_len, num_heads,
                                       num_parts)
      .workspace_bytes;
}

size_t decode_workspace_bytes_deterministic(int max_batch, int max_q_len, int num_heads,
                                            int max_kv_len, int split_keys, int num_parts) {
  return cuda::decode::layout_fixed_schedule("decode_workspace_bytes_deterministic", max_batch,
                                             max_q_len, num_heads, max_kv_len, split_keys, num_parts)
      .workspace_bytes;
}

namespace {

// `s` (laid out) on `workspace`, after checking that it is device memory of the current device,
// aligned and large enough; `sizes` names the function that gives the bytes.
DecodeSchedule attach_workspace(const char* op, const char* sizes, DecodeSchedule s, void* workspace,
                                size_t bytes) {
  MLA_CHECK(workspace != nullptr, op, ": workspace is null");
  MLA_CHECK(reinterpret_cast<uintptr_t>(workspace) % 256 == 0, op,
            ": workspace must be 256-byte aligned (as cudaMalloc returns), got address ", workspace);
  MLA_CHECK(bytes >= s.workspace_bytes, op, ": workspace of ", bytes, " bytes is too small; ",
            s.workspace_bytes, " bytes are needed for max_batch ", s.max_batch, ", max_q_len ",
            s.max_q_len, ", num_heads ", s.num_heads,
            s.split_keys > 0 ? ", max_kv_len " + std::to_string(s.max_kv_len) + ", split_keys " +
                                   std::to_string(s.split_keys)
                             : std::string(),
            ", ", s.num_parts, " parts (see ", sizes, ")");
  cudaPointerAttributes attr{};
  MLA_CUDA_CHECK(cudaPointerGetAttributes(&attr, workspace));
  MLA_CHECK(attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged, op,
            ": workspace must be CUDA device memory (cudaMalloc), got ",
            attr.type == cudaMemoryTypeHost ? "pinned host memory" : "host memory");
  int current = 0;
  MLA_CUDA_CHECK(cudaGetDevice(&current));
  MLA_CHECK(attr.device == current, op, ": workspace is on cuda:", attr.device,
            " but the current device is cuda:", current);
  s.workspace = workspace;
  s.workspace_bytes = bytes;
  s.device = attr.device;
  return s;
}

}  // namespace

DecodeSchedule make_decode_schedule(void* workspace, size_t bytes, int max_batch, int max_q_len,
                                    int num_heads, int num_parts) {
  constexpr const char* op = "make_decode_schedule";
  return attach_workspace(op, "decode_workspace_bytes",
                          cuda::decode::layout_schedule(op, max_batch, max_q_len, num_heads, num_parts),
                          workspace, bytes);
}

DecodeSchedule make_deterministic_decode_schedule(void* workspace, size_t bytes, int max_batch,
                                                  int max_q_len, int num_heads, int max_kv_len,
                                                  int split_keys, int num_parts) {
  constexpr const char* op = "make_deterministic_decode_schedule";
  return attach_workspace(op, "decode_workspace_bytes_deterministic",
                          cuda::decode::layout_fixed_schedule(op, max_batch, max_q_len, num_heads,
                                                              max_kv_len, split_keys, num_parts),
                          workspace, bytes);
}

void plan_decode(const DecodeSchedule& schedule, const TensorView& kv_lens,
                 const TensorView& cu_q_lens, int q_len, int max_q_len, Stream stream) {
  using namespace cuda::decode;
  constexpr const char* op = "plan_decode";
  MLA_CHECK(schedule.workspace != nullptr, op,
            ": schedule has no workspace (create it with make_decode_schedule)");
  check::not_empty(op, "kv_lens", kv_lens);
  check::ndim(op, "kv_lens", kv_lens, 1);
  check::dtype(op, "kv_lens", kv_lens, DType::kInt32);
  MLA_CHECK(kv_lens.device.type == DeviceType::kCUDA, op, ": kv_lens is on ",
            device_name(kv_lens.device),
            " but the decode schedule is planned on the GPU: kv_lens must be a CUDA tensor");
  MLA_CHECK(kv_lens.device.index == schedule.device, op, ": kv_lens is on ",
            device_name(kv_lens.device), " but the schedule's workspace is on cuda:", schedule.device);
  const cuda::DeviceGuard guard(kv_lens.device);
  const int64_t batch = kv_lens.shape[0];
  MLA_CHECK(batch <= schedule.max_batch, op, ": kv_lens has ", batch,
            " requests but the schedule holds at most max_batch = ", schedule.max_batch);
  BatchLayout layout{};
  layout.kv_lens = static_cast<const int32_t*>(kv_lens.data);
  layout.kv_lens_stride = kv_lens.stride[0];
  if (!cu_q_lens.empty()) {
    check::ndim(op, "cu_q_lens", cu_q_lens, 1);
    check::dtype(op, "cu_q_lens", cu_q_lens, DType::kInt32);
    check::dim(op, "cu_q_lens", cu_q_lens, 0, batch + 1, "B + 1, with B = kv_lens.shape[0]");
    MLA_CHECK(cu_q_lens.device == kv_lens.device, op, ": cu_q_lens is on ",
              device_name(cu_q_lens.device), " but kv_lens is on ", device_name(kv_lens.device));
    MLA_CHECK(max_q_len >= 1 && max_q_len <= schedule.max_q_len, op, ": max_q_len must be in [1, ",
              schedule.max_q_len, "] (the schedule's max_q_len) with cu_q_lens, got ", max_q_len);
    layout.cu_q_lens = static_cast<const int32_t*>(cu_q_lens.data);
    layout.cu_q_lens_stride = cu_q_lens.stride[0];
    layout.max_q_len = max_q_len;
  } else {
    MLA_CHECK(q_len >= 1 && q_len <= schedule.max_q_len, op, ": q_len must be in [1, ",
              schedule.max_q_len, "] (the schedule's max_q_len) without cu_q_lens, got ", q_len);
    layout.q_len = q_len;
    layout.max_q_len = q_len;
  }
  layout.num_tokens = -1;
  layout.max_kv_len = INT_MAX;
  layout.batch_size = int(batch);
  layout.num_heads = schedule.num_heads;
  int current = 0;
  MLA_CUDA_CHECK(cudaGetDevice(&current));
  MLA_CHECK(current == schedule.device, op, ": the schedule's workspace is on cuda:",
            schedule.device, " but the current device is cuda:", current);

  PlanParams pp{};
  if (schedule.split_keys > 0) layout.max_kv_len = schedule.max_kv_len;  // its pieces' bound
  pp.layout = layout;
  pp.split_keys = schedule.split_keys;
  const int cap = device_row_tile_cap();  // (the deterministic mode's tiles: that width)
  pp.block_m = schedule.split_keys > 0
                   ? cap
                   : block_m_for_rows(int64_t(layout.max_q_len) * schedule.num_heads, cap);
  pp.num_parts = schedule.num_parts;
  pp.max_items = schedule.max_items;
  pp.max_split_units = schedule.max_split_units;
  pp.max_slots = schedule.max_slots;
  char* ws = static_cast<char*>(schedule.workspace);
  pp.header = reinterpret_cast<ScheduleHeader*>(ws + schedule.header_offset);
  pp.items = reinterpret_cast<WorkItem*>(ws + schedule.items_offset);
  pp.part_begin = reinterpret_cast<int*>(ws + schedule.part_begin_offset);
  pp.split_units = reinterpret_cast<SplitUnit*>(ws + schedule.split_units_offset);
  launch_plan_kernel(pp, cuda::to_cuda(stream));
}

}  // namespace mla
