// mla_decode on Hopper (sm_90a): TMA loads of the paged latent cache through an mbarrier
// pipeline, warpgroup MMA (wgmma) for Q K^T and P V, warp-specialised, with the two consumer
// warpgroups alternating key tiles ("seesaw") so that one's softmax overlaps the other's MMAs.
//
// Same work decomposition, schedule, partial-result slots and combine kernel as the portable
// kernel (decode_kernel.cuh): one CTA runs work items of (request, row tile of up to 64 rows,
// key range), persistent over its list when a schedule is given. Rows past the tile's valid rows
// are computed on zeros and never written.
//
// CTA = 3 warpgroups (384 threads). Key tiles of 64 go in pairs: the even tile of a pair to
// stage 0, the odd one to stage 1. A stage holds 9 boxes of 64 keys x 64 dims in three groups,
// each with its own full (TMA bytes) and empty barrier: L = dims 0..255 (boxes 0-3), R = dims
// 256..511 (boxes 4-7), PE = dims 512..575 (box 8).
//   WG0  producers: thread 0 loads the even tiles into stage 0 (groups L, R, PE in that order),
//        thread 32 the odd tiles into stage 1 (R, L, PE): each group as soon as it is released,
//        and, where the request's rows span several row tiles (so that other CTAs read the same
//        keys), the stage's next tile is prefetched to L2 right after (where those row tiles
//        run side by side, by row tile `stage` alone). (An fp8 cache: below.)
//   WG1  owns O[:, 0:256] and the even tiles' scores; WG2 owns O[:, 256:512] and the odd ones'.
//        The order within a pair is at run_left: each warpgroup issues the scores of its next
//        tile before the pair's last waits; the row max goes WG1 -> WG2 (m0), the odd tile's P
//        and max WG2 -> WG1 (P1, m1), and the even tile's P at the pair's final max back to WG2
//        (P0' = exp2(S0 - m1)), all through shared memory (the PE boxes hold the exchanged P once
//        the scores are done, so Q and both stages fit). Row sums are kept per warpgroup (even /
//        odd tiles, each at the current max) and added at the end.
// Released groups: stage 0's L by WG1 after P0 V0_L, R and PE by WG2 after P0 V0_R; stage 1's
// R by WG2 after P1 V1_R, L and PE by WG1 after P1 V1_L.
//
// Tiles of at most 16 rows (16 heads or fewer with one query, 8 with two) take the narrow
// consumers instead (run_narrow_consumer): the keys are M, so a 16-row tile costs a quarter of the
// 64-row tile's tensor work; WG1 runs every tile of the item alone, WG2 idles.
//
// An fp8 cache: the stages hold the converted 16-bit values, in the layout TMA writes for a
// 16-bit cache, so the consumers run unchanged (run_converter; an fp8 query converted as it
// loads, load_q_fp8).
//   Narrow tiles: thread 0 of WG0 loads every tile of an item, as raw fp8 bytes, into one raw
//   stage inside the Q region (the narrow Q uses 16 of each box's 64 rows); WG2 reads each raw
//   group as it lands, releases it, and converts it into the 16-bit stage t % 2 once the
//   consumer has released that group.
//   64-row tiles: Q and two 16-bit stages leave no room for a raw stage, so WG0's 128 threads
//   convert from global memory into the stages (run_converter).
//
// Shared memory (bytes): Q 73,728 | 2 stages x 73,728 | row max / scale / row-sum exchange 2,048 |
// barriers; all 1024-byte aligned boxes in the 128-byte swizzle (src/cuda/common/hopper.cuh).
//
// Numerics match the portable kernel: fp32 scores in the exp2 domain, P rounded to the compute
// dtype before P V, row sums of the rounded values, natural-log LSE; except that the scale goes
// into exp2's FMA (exp2(fma(s, scale, -m)), one rounding fewer) and O[:, 256:512] gets the even
// tile's P rounded at the pair's final max (a difference of at most one rounding of the compute
// dtype against the row sum); and the offset m may lie below the row's true max by up to the
// max slack (next_max). Keys of the last tile past the item's range are
// masked out of S and their V rows zeroed in shared memory before P V, so NaN in unused cache
// slots never reaches the output.
//
// Version history (H200, eager, L2 flushed, 128 h B 128 kv 4k unless noted; docs/perf-notes.md):
//   v1  TMA ring + wgmma, WG1 scores and half of P V, WG2 the other half: 397 µs (0.46 of GEMM).
//   v2  the warpgroups alternate key tiles ("seesaw"), per-group stage barriers: 355 µs (0.52).
//   v3  each stage's next tile prefetched to L2 where other row tiles read it (+3-5 %), plans
//       of whole units for equal batches: 332 µs; then pair orders, exchanges and code size:
//       264 µs (0.68).
//   v4  one item loop and one epilogue for both consumer warpgroups (89 KB of code): 252 µs.
//   v5  narrow consumers for tiles of at most 16 rows: 16 h B 64 kv 4k 97.4 -> 94.0 µs.
//   v6  each item's Q issued as soon as the pairs before it are done (run_consumer): 128 h
//       B 64 / 128 / 256 kv 1k -0.5 to -1.5 %, the rest unchanged.
//   v7  an fp8 cache on the narrow consumers (H100: 16 h B 128 kv 16k 906 µs on the portable
//       kernel -> 552; each raw group released before the wait for its 16-bit stage: 516 µs,
//       0.78 of copy bandwidth in fp8 bytes).
//   v8  an fp8 cache on the 64-row consumers, converted by WG0 from global memory (H100: 128 h
//       B 128 kv 4k 742 µs on the portable kernel -> 422, 0.43 of GEMM; B 1 kv 16k 43.8 -> 32.7).
//   v9  a slack of 8 on the row max (next_max): most tiles skip O's rescale and WG1's P0 at m1
//       (H100: 128 h B 128 kv 4k 267.9 -> 265.8 µs, 128 h B 64 kv 4k q 2 245.7 -> 230.2).
//   v10 the 64-row fp8 converter: row addresses once a group, each word's upper fp8 pair
//       converted in place (H200: 128 h B 128 kv 4k fp8 407.6 -> 386.8 µs; fp16 query 382.4 ->
//       366.1, 360.1 with the row addresses alone, before the spill that cost it was removed).
//   v11 the narrow consumers store a row's staged values a quad of columns a thread (H200: 16 h
//       B 16 kv 4k 39.4 -> 38.8 µs, B 1 kv 4k 16.9 -> 16.6).
//   v12 a CTA's first tile of each stage lands before the stage's next tile is asked of L2 (at
//       most 4 us, where other row tiles read the keys; H100: 128 h B 1 kv 16k 27.8 -> 26.4 µs).
//   v13 the narrow epilogue's row destinations and LSEs computed once a row, by one thread each
//       (one copy of that code instead of eight: -6 KB; H100: 16 h B 1 kv 4k 17.2 -> 16.6 µs).
//   v14 one lane in two asks L2 for a stage's next tiles (the lanes of the stage's parity), not
//       every lane (H100: 268.2 -> 256.9 µs, kv 16k 978.0 -> 943.5; L2 sectors -29 %).
//   v15 only row tile `stage` asks L2 for a stage's tiles, also with four lanes (q 2) and in the
//       unplanned grid (H100: 128 h B 64 kv 4k q 2 232.0 -> 230.7 µs, unplanned 280.4 -> 257.0).
//   Tried and dropped: TMA multicast over a cluster of the two row tiles (1.5-1.7x slower, twice),
//   the lanes over the same keys launched as a cluster without multicast, for one GPC's L2
//   partition to serve both (the fabric as busy, 91 %; -1 %),
//   evict-first loads, the prefetch reaching further ahead, 3-D TMA boxes, pages below 16 tokens
//   loaded by WG0 with cp.async (slower than the portable kernel; decode-kernel.md), an item's first tiles
//   landing before the next ones are prefetched (B 1 -2 %, but the producer's wait needs 8 more
//   registers, taken from the consumers: kv 16k +1 to +2 %), and the same wait in an idle thread
//   of the producer warpgroup (H100: 128 h B 1 -3.5 %, B 128 kv 4k +1.6 %, kv 16k +2.4 %), and
//   the 64-row fp8 converter working in place behind TMA on 2 or 3 warps (H100: +30 %, +5 %),
//   and on 4 warps with thread 0 loading ahead (+43 %), and its loads pipelined in half groups
//   (+18 %, fp16 query +34 %); for requests of at most 16 rows, one cluster of up to 16 CTAs a
//   request merging its shares in distributed shared memory instead of partial slots and the
//   combine (H100: 16 h B 1 kv 4k 18.0 -> 22.9 µs; one CTA streams ~1.5 µs a further tile); dry
//   runs of the once-per-item code before it is needed (the narrow epilogue by the idle WG2, the
//   64-row epilogue before the first item, the combine's first job before its wait), to have it
//   in the instruction cache: no phase moved, 128 h B 1 +6.7 % (H100).
#include "cuda/decode/decode_hopper.hpp"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/hopper.cuh"
#include "cuda/common/trace.cuh"
#include "cuda/common/warp_mma.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/decode/decode_device.cuh"

namespace mla::cuda::decode {
namespace {

using namespace mla::cuda::sm90;

constexpr int kHopperThreads = 384;
constexpr int kStages = 2;
constexpr int kGroups = 3;                         // L, R, PE
constexpr int kGroupL = 0, kGroupR = 1, kGroupPe = 2;
constexpr int kBoxBytes = 64 * 128;                // 64 rows x 64 16-bit values
constexpr int kDimBoxes = kHeadDim / 64;           // 9 boxes per 576-wide tile
constexpr int kTileBytes = kDimBoxes * kBoxBytes;  // 73,728
constexpr int kPeBox = 8;                          // box of dims 512..575; P once the scores are done
constexpr uint64_t kEvictNormal = 0x1000000000000000ull;
// The row max's slack in exp2 units (next_max): 8 (H100, same-call A/B against the exact max:
// 128 heads q 1 -0.7 to -1.5 %, q 2 -6 %; docs/perf-notes.md). A build with MLA_DECODE_MAX_SLACK=N
// in MLA_DECODE_KNOBS takes N instead; 0 keeps every larger max (the scores' exact max).
#if defined(MLA_DECODE_MAX_SLACK)
constexpr float kMaxSlack = float(MLA_DECODE_MAX_SLACK);
#else
constexpr float kMaxSlack = 8.0f;
#endif
// How long the producer of a stage waits at most for the first tile of its CTA's first item to
// land before it asks L2 for the stage's next tile (run_producer; only where other row tiles read
// the same keys, the prefetch's case): at batch 1 with 128 heads every CTA otherwise asks for its
// first two tiles and their two prefetches at once, the whole cache, and the DRAM serves some
// CTAs' first tiles after other CTAs' prefetches. 4 us (H100, same-call A/B against no wait: 128 h
// B 1 kv 16k -4.9 %, graph -4.1 %; 2 us: -4.7 %; B 128 kv 4k and 16k, B 64 q 2 within +-0.5 %;
// docs/perf-notes.md). A build with MLA_DECODE_FIRST_TILE_WAIT_NS=N in MLA_DECODE_KNOBS takes N
// (0: no wait).
#if defined(MLA_DECODE_FIRST_TILE_WAIT_NS)
constexpr int kFirstTileWaitNs = MLA_DECODE_FIRST_TILE_WAIT_NS;
#else
constexpr int kFirstTileWaitNs = 4000;
#endif
constexpr uint32_t kFirstTileTryNs = 500;  // one try_wait's suspend-time hint
constexpr int kFirstTileTries = (kFirstTileWaitNs + int(kFirstTileTryNs) - 1) / int(kFirstTileTryNs);
static_assert(kFirstTileWaitNs >= 0 && kFirstTileWaitNs <= 100000, "MLA_DECODE_FIRST_TILE_WAIT_NS: 0 to 100 us");
static_assert(kMaxSlack >= 0.0f && kMaxSlack <= 12.0f, "MLA_DECODE_MAX_SLACK: P = exp2(s - m) must stay far below "
              "fp16's largest value (65504 = 2^15.999)");

__host__ __device__ constexpr int group_first_box(int g) { return g * 4; }
__host__ __device__ constexpr int group_boxes(int g) { return g == kGroupPe ? 1 : 4; }
// Load (and score) order of a stage's groups: the group released first comes first.
__host__ __device__ constexpr int group_order(int stage, int i) {
  return i == 2 ? kGroupPe : (stage == 0 ? (i == 0 ? kGroupL : kGroupR) : (i == 0 ? kGroupR : kGroupL));
}

// Named barriers (0 is __syncthreads), passed (bar.sync) by both consumer warpgroups or by one.
constexpr int kBarItem = 1;   // item start: Q landed (both consumer warpgroups)
constexpr int kBarLeft = 2;   // WG1 alone
constexpr int kBarRight = 3;  // WG2 alone

// Exchanges between the consumer warpgroups, once per pair: mbarriers that every thread of the
// writer arrives at (release) and the reader waits on (acquire), so the writer never waits. A
// writer cannot complete one twice before the reader's wait: its next arrival depends on the
// reader through another exchange or through a stage the reader releases (see run_left).
constexpr int kXA = 0;   // WG1 -> WG2: m0, c0 (every pair)
constexpr int kXB = 1;   // WG2 -> WG1: P1 (stage 1's PE box), m1, c1 (pairs with an odd tile)
constexpr int kXC = 2;   // WG1 -> WG2: P0 at the pair's final max m1 (stage 0's PE box; every pair)
constexpr int kXL0 = 3;  // WG1 -> WG2: row sums of the even tiles, at the end of an item
constexpr int kXL1 = 4;  // WG2 -> WG1: row sums of the odd tiles
constexpr int kExchanges = 5;

struct SmemLayout {
  static constexpr int q = 0;
  static constexpr int k = q + kTileBytes;
  static constexpr int m0 = k + kStages * kTileBytes;  // row statistics, 64 floats each
  static constexpr int c0 = m0 + 64 * 4;
  static constexpr int m1 = c0 + 64 * 4;
  static constexpr int c1 = m1 + 64 * 4;
  static constexpr int l_sums = c1 + 64 * 4;  // [item parity][even, odd][64]
  static constexpr int full = l_sums + 4 * 64 * 4;
  static constexpr int empty = full + kStages * kGroups * 8;
  static constexpr int exchange = empty + kStages * kGroups * 8;
  static constexpr int raw_full = exchange + kExchanges * 8;  // an fp8 cache's raw stage (narrow)
  static constexpr int raw_empty = raw_full + kGroups * 8;
  static constexpr int end = raw_empty + kGroups * 8;
  static constexpr int bytes = end + 1024;  // slack to align the base to 1024
};

struct HopperParams {
  CUtensorMap kv_map;  // [rows = P * S, 576] 16-bit, boxes of {64, box_rows}, 128B swizzle; an fp8
                       // cache: bytes, the same boxes, no swizzle
  DecodeParams p;
  int block_m;         // rows per tile of the plan (16, 32 or 64)
  int box_rows;        // keys per TMA box: min(page size, 64)
};

#if defined(MLA_SM90A_DEVICE)

// A build with -DMLA_DECODE_TRACE=1 stamps %globaltimer at these points of a CTA's run and stores
// six CTAs' stamps in the trace buffer when the kernel ends (decode_trace_store), for the combine
// to print; a stamp marked "first" is the CTA's first item's, one marked "last" its last item's.
#if defined(MLA_DECODE_TRACE) && MLA_DECODE_TRACE
enum TracePoint : int {
  kTraceEntry = 0,       // kernel entry (thread 0)
  kTraceWaited = 1,      // past the wait for prior grids
  kTraceWork = 2,        // the CTA's item range read
  kTraceItem = 3,        // first: stage 0's producer has its item and range
  kTraceGroup = 4,       // first: stage 0's producer has issued the first tile's groups 0 and 1
                         // (the first group's loads take the block table's row)
  kTraceIssued = 6,      // first: stage 0's producer has issued the item's first tile
  kTraceQ = 7,           // first: WG1 has Q in shared memory
  kTraceScores = 8,      // first: WG1's first S is done
  kTracePair = 9,        // first: WG1 has ended pair 0, 1, ... (up to kTracePairs; the narrow
                         // consumers: tile 0, 1, ...)
  kTracePairs = 12,
  kTraceSums = kTracePair + kTracePairs,  // last: WG1 has both warpgroups' row sums (narrow: its
                                          // rows' sums, and the rows staged for the stores)
  kTraceStoredL,         // last: WG1 has stored its half of O (narrow: all of it)
  kTraceStoredR,         // last: WG2 has stored its half of O
  kTraceEnd,             // every warp of the CTA done
  kTraceStamps
};
__shared__ unsigned long long decode_trace[kTraceStamps];
#define MLA_DECODE_STAMP(i) (void)(decode_trace[i] = globaltimer_ns())
#define MLA_DECODE_STAMP_FIRST(i) (void)(decode_trace[i] == 0 ? (decode_trace[i] = globaltimer_ns()) : 0ull)
#define MLA_DECODE_STAMP_PAIR(i) (void)((i) < kTracePairs ? (MLA_DECODE_STAMP_FIRST(kTracePair + (i)), 0) : 0)

static_assert(kTraceStamps == kDecodeTraceStamps && kTraceStamps + 3 <= kDecodeTraceWords,
              "a CTA's record holds its stamps, CTA and items");

// Thread 0 of every CTA: its entry, first S, row sums, end, SM and start links (work range, item,
// first group, first tile issued) to its words of the trace buffer; CTAs 0, 1, G/2, G/2 + 1,
// G - 2 and G - 1 also all their stamps, CTA and items to their records. The combine prints both.
__device__ void decode_trace_store(const DecodeParams& p, int begin, int end) {
  if (p.trace == nullptr || !p.has_schedule) return;  // unplanned calls have no combine
  const int g = int(gridDim.x), c = int(blockIdx.x);
  if (c < kDecodeTraceGridCtas) {
    unsigned long long* w = p.trace + kDecodeTraceGrid + kDecodeTraceCtaWords * c;
    unsigned smid;
    asm volatile("mov.u32 %0, %%smid;\n" : "=r"(smid));
    w[0] = decode_trace[kTraceEntry];
    w[1] = decode_trace[kTraceScores];
    w[2] = decode_trace[kTraceSums];
    w[3] = decode_trace[kTraceEnd];
    w[4] = smid;
    w[5] = decode_trace[kTraceWork];
    w[6] = decode_trace[kTraceItem];
    w[7] = decode_trace[kTraceGroup];
    w[8] = decode_trace[kTraceIssued];
  }
  const int slot = c <= 1 ? c : c == g / 2 ? 2 : c == g / 2 + 1 ? 3 : c == g - 2 ? 4 : c == g - 1 ? 5 : -1;
  if (slot < 0) return;
  unsigned long long* rec = p.trace + slot * kDecodeTraceWords;
  for (int i = 0; i < kTraceStamps; ++i) rec[i] = decode_trace[i];
  rec[kDecodeTraceWords - 3] = (unsigned long long)c;
  rec[kDecodeTraceWords - 2] = (unsigned long long)begin;
  rec[kDecodeTraceWords - 1] = (unsigned long long)(end - begin);
}
#else
#define MLA_DECODE_STAMP(i) ((void)0)
#define MLA_DECODE_STAMP_FIRST(i) ((void)0)
#define MLA_DECODE_STAMP_PAIR(i) ((void)0)
#endif

// The tensor-map row of the box_rows keys from `key`: their cache slot, or a wholly out-of-bounds
// row (zero-filled by TMA) for keys past kv_end and pages not in the pool.
__device__ __forceinline__ int box_row(const HopperParams& hp, int request, int key, int kv_end) {
  const int64_t slot = cache_slot(hp.p, request, key, kv_end);
  return slot < 0 ? -hp.box_rows : int(slot);
}

// Group g of the tile's keys [key0, key0 + 64) -> its boxes of the stage (box c at stage + c x
// kBoxBytes, rows of row_bytes: 128 for a 16-bit cache, 64 for a raw fp8 one), as 64 / box_rows
// row groups. row0 is the first row group's box_row, looked up by the caller before it waited for the
// stage: a block-table load on the path from a release to the reload costs ~450 cycles, about a
// third of the time from the release to the reload's landing. Smaller pages look up their other
// row groups here.
__device__ __forceinline__ void issue_group(const HopperParams& hp, int request, int key0, int kv_end,
                                            int row0, uint8_t* stage, int g, uint64_t* full,
                                            int row_bytes) {
  const int box_rows = hp.box_rows;
  const int first = group_first_box(g), count = group_boxes(g);
  mbar_arrive_expect_tx(full, uint32_t(count * kBlockN * row_bytes));
  for (int sub = 0; sub < 64; sub += box_rows) {
    const int row = sub == 0 ? row0 : box_row(hp, request, key0 + sub, kv_end);
    for (int c = first; c < first + count; ++c)
      tma_load_2d(stage + c * kBoxBytes + sub * row_bytes, &hp.kv_map, full, c * 64, row, kEvictNormal);
  }
}

// Whether other CTAs read the item's keys too (the request's rows span several row tiles: 128
// heads, or 64 with two queries): only there does an L2 prefetch pay, the second reader finding
// the tile in L2. A tile with one reader is read from DRAM once either way, and there the
// prefetch cost 13 % at 16 heads (B 128, kv 16k, docs/perf-notes.md).
__device__ __forceinline__ bool keys_shared(const HopperParams& hp, const ItemRange& r) {
  return row_tiles(r.g.q_len, hp.p.layout.num_heads, hp.block_m) > 1;
}

// The 64-key tile from key0 asked of L2, one bulk prefetch a page run.
__device__ __forceinline__ void prefetch_tile_l2(const HopperParams& hp, int request, int key0, int kv_end) {
  for (int sub = 0; sub < kBlockN; sub += hp.box_rows)
    prefetch_keys_l2(hp.p, request, key0 + sub, hp.box_rows, kv_end);
}

// The raw fp8 bytes of an fp8 cache's narrow tiles (64 per key: 64 values a box): one raw stage,
// box c (64 keys x 64 bytes) in the second half of Q box c, which the narrow consumers' Q (rows
// 0-15), P^T and row-max exchange (box 0 and 2 at 2 KB) leave free.
namespace raw {
constexpr int kOffset = 4096;
constexpr int kRowBytes = 64;
}  // namespace raw

// A producer thread: walks the CTA's items and loads their tiles, each group as soon as it is
// released. kRaw = false: the producer of one 16-bit stage, the tiles t with t % 2 == stage, and
// where other row tiles read the same keys the stage's next tile asked of L2 after each tile (where
// those row tiles run side by side, by row tile `stage` alone).
// kRaw = true: an fp8 cache's narrow tiles (thread 0), every tile into the raw stage, no L2
// prefetch: with it (the tiles one and two ahead) the 16-head rows were 0.2-1.8 % slower, four
// ahead 2-10 % (docs/perf-notes.md); the converter releasing each group as soon as it has read it
// is what keeps the bytes in flight.
template <bool kRaw>
__device__ __forceinline__ void run_producer(const HopperParams& hp, uint8_t* smem, int stage, int begin, int end,
                                             int lane_of_cta) {
  const DecodeParams& p = hp.p;
  constexpr int kStep = kRaw ? 1 : 2;  // tiles a stage
  constexpr int kRowBytes = kRaw ? raw::kRowBytes : 128;
  uint64_t* full = kRaw ? reinterpret_cast<uint64_t*>(smem + SmemLayout::raw_full)
                        : reinterpret_cast<uint64_t*>(smem + SmemLayout::full) + stage * kGroups;
  uint64_t* empty = kRaw ? reinterpret_cast<uint64_t*>(smem + SmemLayout::raw_empty)
                         : reinterpret_cast<uint64_t*>(smem + SmemLayout::empty) + stage * kGroups;
  uint8_t* tile = kRaw ? smem + SmemLayout::q + raw::kOffset : smem + SmemLayout::k + stage * kTileBytes;
  prefetch_tensor_map(&hp.kv_map);
  uint32_t phase = 0;
  for (int it = begin; it < end; ++it) {
    const WorkItem item = fetch_item(p, it, lane_of_cta);
    const ItemRange r = item_range(p.layout, item, hp.block_m);
    if (stage == 0) MLA_DECODE_STAMP_FIRST(kTraceItem);
    // Where the row tiles over the same keys run side by side (the plan's lanes, or the unplanned
    // grid's tiles_per_request CTAs), only row tile `stage` asks L2 for the stage's tiles: each
    // tile is asked once, also with four lanes (q 2). ncu (H100, 128 h B 128 kv 4k): L2 sectors
    // 90.3 M -> 63.7 M with one lane in two asking, the fabric between the L2's two partitions
    // 91 % -> 87 % busy, 268.2 -> 256.9 µs; once a tile: q 2 sectors 53.4 M -> 40.3 M, -0.5 %,
    // the unplanned grid -8 % (q 1) and -5 % (q 2); docs/perf-notes.md.
    const bool side_by_side = p.plan_lanes >= 2 || !p.has_schedule;
    const bool prefetch = !kRaw && keys_shared(hp, r) && (!side_by_side || item.row_tile == stage);
    for (int t = stage; t < r.num_tiles; t += kStep) {
      const int key0 = r.kv_begin + t * kBlockN;
      const int row0 = box_row(hp, item.request, key0, r.kv_end);
      for (int i = 0; i < kGroups; ++i) {
        const int g = group_order(stage, i);
        mbar_wait(&empty[g], phase ^ 1);
        issue_group(hp, item.request, key0, r.kv_end, row0, tile, g, &full[g], kRowBytes);
        if (stage == 0 && i < 2) MLA_DECODE_STAMP_FIRST(kTraceGroup + i);
      }
      if (stage == 0) MLA_DECODE_STAMP_FIRST(kTraceIssued);
      // The stage's next tile to L2, so that its load waits for L2 once the stage is released.
      // The CTA's first item: the stage's first tile lands first (kFirstTileWaitNs at most), so
      // that the DRAM, asked at once for every CTA's first tiles, is not also asked for their
      // prefetches before it has served them.
      if (kFirstTileWaitNs > 0 && prefetch && it == begin && t == stage)
        mbar_wait_at_most(&full[group_order(stage, kGroups - 1)], phase, kFirstTileTryNs, kFirstTileTries);
      if (prefetch) prefetch_tile_l2(hp, item.request, key0 + 2 * kBlockN, r.kv_end);
      phase ^= 1;
    }
  }
}

// Q rows [row0, row0 + valid_rows) of the item -> swizzled Q boxes; rows past valid_rows are
// zero. Thread t owns row t / kPerRow and its 16-byte chunks t % kPerRow + kPerRow j, so the row's
// source addresses are computed once; all its asynchronous copies are in flight at once, as one
// commit group (load_q also waits for it). The 64-row consumers: 256 threads, 4 a row (18 copies
// each); the narrow ones: 128 threads, 8 a row, 16 rows. Code size matters here: this runs once
// per item, from a cold instruction cache.
template <typename T, int kPerRow>
__device__ __forceinline__ void issue_q(const DecodeParams& p, const ItemRange& r, uint8_t* sq, int t) {
  constexpr int kChunks = kHeadDim / 8;  // 72 chunks of 8 values: 64 of q_nope, 8 of q_pe
  const int row = int(unsigned(t) / kPerRow), c0 = int(unsigned(t) % kPerRow);  // t >= 0
  const bool valid = row < r.valid_rows;
  // Rows past valid_rows are zero-filled, not read (row 0's address stands in).
  const QRow<T> q = q_row<T>(p, r.g.q_start, r.row0 + (valid ? row : 0));
#pragma unroll
  for (int j = 0; j < kChunks / kPerRow; ++j) {
    const int c = c0 + kPerRow * j;
    cp_async_16(sq + (c >> 3) * kBoxBytes + swizzled_offset(row, (c & 7) * 8), q.chunk(c), valid);
  }
  cp_async_commit();
}
template <typename T, int kPerRow>
__device__ __forceinline__ void load_q(const DecodeParams& p, const ItemRange& r, uint8_t* sq, int t) {
  issue_q<T, kPerRow>(p, r, sq, t);
  cp_async_wait<0>();
}

// Whether the consumers convert an fp8 query as they load it: a kernel for an fp8 cache, in bf16
// (an fp8 query and cache compute in bf16: dispatch).
template <typename T, bool kFp8>
__device__ __forceinline__ bool converts_fp8_query(const DecodeParams& p) {
  return kFp8 && std::is_same_v<T, __nv_bfloat16> && p.q_is_fp8;
}

// An fp8 query: Q's rows converted to T as they load, in issue_q's layout (the 64-row consumers:
// 256 threads, 4 a row; the narrow ones: 128 threads, 8 a row, 16 rows; rows past valid_rows
// zero); nine loads in flight before their conversions. The caller's fence and barrier make
// the stores visible to the tensor cores, as for issue_q's copies.
template <typename T, int kPerRow>
__device__ __forceinline__ void load_q_fp8(const DecodeParams& p, const ItemRange& r, uint8_t* sq, int t) {
  constexpr int kSteps = kHeadDim / 8 / kPerRow;  // chunks of 8 values a thread
  constexpr int kBlock = 9;                       // chunks in flight (one block: the code small)
  static_assert(kSteps % kBlock == 0);
  const int row = t / kPerRow, c0 = t % kPerRow;
  const bool valid = row < r.valid_rows;
  const QRow<uint8_t> q = q_row<uint8_t>(p, r.g.q_start, r.row0 + (valid ? row : 0));
#pragma unroll 1
  for (int j0 = 0; j0 < kSteps; j0 += kBlock) {
    uint2 bytes[kBlock];
#pragma unroll
    for (int j = 0; j < kBlock; ++j)
      bytes[j] = valid ? *reinterpret_cast<const uint2*>(q.chunk(c0 + kPerRow * (j0 + j))) : make_uint2(0, 0);
#pragma unroll
    for (int j = 0; j < kBlock; ++j) {
      const int c = c0 + kPerRow * (j0 + j);
      const uint4 v = make_uint4(fp8x2_to<T>(bytes[j].x & 0xffff), fp8x2_to<T>(bytes[j].x >> 16),
                                 fp8x2_to<T>(bytes[j].y & 0xffff), fp8x2_to<T>(bytes[j].y >> 16));
      *reinterpret_cast<uint4*>(sq + (c >> 3) * kBoxBytes + swizzled_offset(row, (c & 7) * 8)) = v;
    }
  }
}

// Writes this thread's 2 rows x 128 columns of O (columns col0 + 8n + 2(lane%4) + {0,1}),
// scaled by inv_l, to the output or to the item's partial slot. One row per pass of a loop that
// is not unrolled (row 1's values move into row 0's registers for the second pass, so o is
// clobbered), each output kind's stores once (store_row_pairs).
__device__ __forceinline__ void store_o(const DecodeParams& p, const ItemRange& r, const WorkItem& item,
                                        float (&o)[128], const int (&row_local)[2],
                                        const float (&inv_l)[2], int col0, int lane) {
  const int col = col0 + 2 * (lane & 3);
  const int kind = out_kind(p, item.slot >= 0);
#pragma unroll 1
  for (int j = 0; j < 2; ++j) {
    const int rl = j == 0 ? row_local[0] : row_local[1];
    const float inv = j == 0 ? inv_l[0] : inv_l[1];
    // Rows past valid_rows run the stores' shuffles and store nothing (their address is not used).
    const bool valid = rl < r.valid_rows;
    void* base = row_dst(p, item.slot, r, valid ? rl : 0).out;
    store_row_pairs<32>(
        p, kind, base, col, inv, valid, [&](int n) { return make_float2(o[4 * n], o[4 * n + 1]); },
        [&] {
#pragma unroll
          for (int i = 0; i < 31; ++i) {
            o[4 * i] = o[4 * i + 4];
            o[4 * i + 1] = o[4 * i + 5];
          }
        });
    // Row 1's values into row 0's registers (a rotation above moved only row 0's columns).
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      o[4 * n] = o[4 * n + 2];
      o[4 * n + 1] = o[4 * n + 3];
    }
  }
}

// What both consumer warpgroups share for one item: the rows this thread owns and their causal
// key limits.
struct RowState {
  int row_local[2];  // rows warp * 16 + lane / 4 and + 8 of the 64-row tile
  int key_limit[2];  // last key each row may see (-1: the row does not exist)
};

__device__ __forceinline__ RowState row_state(const DecodeParams& p, const ItemRange& r, int wt) {
  RowState rs;
  rs.row_local[0] = (wt >> 5) * 16 + ((wt & 31) >> 2);
  rs.row_local[1] = rs.row_local[0] + 8;
#pragma unroll
  for (int j = 0; j < 2; ++j)
    rs.key_limit[j] = rs.row_local[j] < r.valid_rows
                          ? row_last_key(r.g, r.row0 + rs.row_local[j], p.layout.num_heads)
                          : -1;
  return rs;
}

// Issues S (+)= Q K^T over groups [first, last) of the load order of the tile in `stage`, each
// group as soon as it lands (first == 0 starts S from zero), as one commit group; no wait.
template <typename T, int kStage>
__device__ __forceinline__ void issue_scores(uint32_t sq_addr, uint32_t tile_addr, uint64_t* full,
                                             uint32_t phase, float (&s)[32], int first, int last) {
  const uint64_t dq = k_major_desc(sq_addr), dk = k_major_desc(tile_addr);
#pragma unroll
  for (int i = 0; i < kGroups; ++i) {
    if (i < first || i >= last) continue;
    const int g = group_order(kStage, i);
    mbar_wait(&full[kStage * kGroups + g], phase);
#pragma unroll
    for (int kk = 0; kk < 4 * group_boxes(g); ++kk) {
      const uint32_t off = (group_first_box(g) + (kk >> 2)) * kBoxBytes + (kk & 3) * 32;
      wgmma_64x64<T>(desc_advance(dq, off), desc_advance(dk, off), s, i > 0 || kk > 0);
    }
  }
  wgmma_commit();
}

// S = Q K^T of the tile in `stage` (64 x 64 over the 576 dims), waited for.
template <typename T, int kStage>
__device__ __forceinline__ void tile_scores(uint32_t sq_addr, uint32_t tile_addr, uint64_t* full,
                                            uint32_t phase, float (&s)[32]) {
  wgmma_fence();
  issue_scores<T, kStage>(sq_addr, tile_addr, full, phase, s, 0, kGroups);
  wgmma_wait<0>();
  fence_operands(s);
}

// Masks S (the item's key range, each row's causal limit: -inf) and returns each row's max over
// the quad in the exp2 domain. S itself stays unscaled: exp_scores scales it inside one FMA
// (score_scale_log2 > 0, so the max of the scaled scores is the scaled max). A tile that both
// rows see whole (every tile but the item's last, and the causal edge's) only takes the max.
__device__ __forceinline__ void mask_scores(const DecodeParams& p, const ItemRange& r, const RowState& rs,
                                            int key0, int lane, float (&s)[32], float (&tile_max)[2]) {
  tile_max[0] = tile_max[1] = -INFINITY;
  const int last_key = key0 + kBlockN - 1;
  if (last_key < r.kv_end && last_key <= rs.key_limit[0] && last_key <= rs.key_limit[1]) {
#pragma unroll
    for (int i = 0; i < 32; ++i) tile_max[(i >> 1) & 1] = fmaxf(tile_max[(i >> 1) & 1], s[i]);
  } else {
    // Each row sees keys up to min(kv_end - 1, its causal limit); `last` counts from this
    // thread's first column (key0 + 2 (lane % 4)), so each element is one compare.
    int last[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) last[j] = min(r.kv_end - 1, rs.key_limit[j]) - (key0 + 2 * (lane & 3));
#pragma unroll
    for (int n = 0; n < 8; ++n) {
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int j = e >> 1;
        if (n * 8 + (e & 1) > last[j]) s[4 * n + e] = -INFINITY;
        tile_max[j] = fmaxf(tile_max[j], s[4 * n + e]);
      }
    }
  }
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    tile_max[j] = fmaxf(tile_max[j], __shfl_xor_sync(0xffffffffu, tile_max[j], 1));
    tile_max[j] = fmaxf(tile_max[j], __shfl_xor_sync(0xffffffffu, tile_max[j], 2));
    tile_max[j] *= p.score_scale_log2;
  }
}

// The row max used as the exponent's offset: m = -inf (no key seen yet) is taken as 0, so that
// exp2 arguments stay finite (and exp2(-inf - 0) = 0 for masked keys).
__device__ __forceinline__ float max_offset(float m) { return m == -INFINITY ? 0.0f : m; }

// P = exp2(scale S - m) rounded to T (S unscaled, m in the exp2 domain), packed in the
// accumulator layout; returns the row sums of the rounded values (this thread's part).
template <typename T>
__device__ __forceinline__ void exp_scores(const float (&s)[32], float scale, const float (&m)[2],
                                           uint32_t (&pk)[8][2], float (&sum)[2]) {
  float neg_m[2];
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    neg_m[j] = -max_offset(m[j]);
    sum[j] = 0.0f;
  }
#pragma unroll
  for (int n = 0; n < 8; ++n) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      pk[n][j] = pack2<T>(fast_exp2(fmaf(s[4 * n + 2 * j], scale, neg_m[j])),
                          fast_exp2(fmaf(s[4 * n + 2 * j + 1], scale, neg_m[j])));
      const float2 rounded = unpack2<T>(pk[n][j]);
      sum[j] += rounded.x + rounded.y;
    }
  }
}

// A row's running max (exp2 domain) after a tile whose max is tile_max. With a slack (kMaxSlack
// > 0), the tile's max replaces the running one only where it exceeds it by more than the slack:
// most tiles then keep the max, and the warps skip O's rescale (scale_o) and WG1 its P0 at m1.
// The offset may then lie below the true max by up to the slack, so P = exp2(s - m) <= 2^slack:
// 256 at a slack of 8, well within the compute dtype's range, and O / l and the LSE
// (m + log2 l) are unchanged but for rounding. Masked tiles (tile_max -inf) keep m; the first
// key seen (m -inf) always sets it.
__device__ __forceinline__ float next_max(float m, float tile_max) {
  if constexpr (kMaxSlack > 0.0f) return tile_max > m + kMaxSlack ? tile_max : m;
  return fmaxf(m, tile_max);
}

// The factor that moves sums taken at max m_old to max m_new.
__device__ __forceinline__ float rescale(float m_old, float m_new) {
  return fast_exp2(m_old - max_offset(m_new));
}

// Writes P (accumulator layout) into a swizzled box.
__device__ __forceinline__ void store_p(uint8_t* box, const uint32_t (&pk)[8][2], const RowState& rs, int lane) {
#pragma unroll
  for (int n = 0; n < 8; ++n) {
#pragma unroll
    for (int j = 0; j < 2; ++j)
      *reinterpret_cast<uint32_t*>(box + swizzled_offset(rs.row_local[j], n * 8 + 2 * (lane & 3))) = pk[n][j];
  }
}

// Zeroes rows [keys, 64) of the four boxes at `boxes` (one V half of a partial last tile): the
// cache may hold NaN there, and 0 * NaN would reach O. Run by one warpgroup (wt = 0..127),
// followed by a fence and that warpgroup's barrier. Not on the 64-row tiles with an fp8 cache:
// their converter writes a key past the item's end as zeros (its slot is -1), before the full
// barrier (the consumers' zeroing after it was redundant, and a write the race checker could not
// order against the converter's next fill, released by one lane a warp).
__device__ __forceinline__ void zero_tail_rows(uint8_t* boxes, int keys, int wt, int bar) {
  const int tail_bytes = (kBlockN - keys) * 128;  // per box, from row `keys` on
#pragma unroll 1
  for (int box = 0; box < 4; ++box) {
    uint8_t* tail = boxes + box * kBoxBytes + keys * 128;
    for (int off = wt * 16; off < tail_bytes; off += 128 * 16)
      *reinterpret_cast<uint4*>(tail + off) = make_uint4(0, 0, 0, 0);
  }
  fence_proxy_async();
  named_sync(bar, 128);
}

// O *= c per row. A warp whose rows all keep their max (c == 1: most tiles once the max has
// settled) skips the 128 multiplies, which change nothing then.
__device__ __forceinline__ void scale_o(float (&o)[128], const float (&c)[2]) {
  if (!__any_sync(0xffffffffu, c[0] != 1.0f || c[1] != 1.0f)) return;
#pragma unroll
  for (int i = 0; i < 128; ++i) o[i] *= c[(i >> 1) & 1];
}

// O_half += P V_half over one 64-key tile: P from registers (pk) or from a swizzled box (p_addr).
template <typename T>
__device__ __forceinline__ void pv_rs(const uint32_t (&pk)[8][2], uint32_t v_addr, float (&o)[128]) {
  const uint64_t dv = mn_major_desc(v_addr, kBoxBytes);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk) {
    const uint32_t a[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
    wgmma_64x256_rs<T>(a, desc_advance(dv, kk * 16 * 128), o);
  }
  wgmma_commit();
}
template <typename T>
__device__ __forceinline__ void pv_ss(uint32_t p_addr, uint32_t v_addr, float (&o)[128]) {
  const uint64_t dp = k_major_desc(p_addr), dv = mn_major_desc(v_addr, kBoxBytes);
  wgmma_fence();
#pragma unroll
  for (int kk = 0; kk < kBlockN / 16; ++kk)
    wgmma_64x256_ss<T>(desc_advance(dp, kk * 32), desc_advance(dv, kk * 16 * 128), o);
  wgmma_commit();
}

// Row sums over the quad, both warpgroups' sums added, LSE (written by WG1 only) and 1/l.
__device__ __forceinline__ void finish_rows(const DecodeParams& p, const ItemRange& r, const WorkItem& item,
                                            const RowState& rs, uint8_t* smem, bool left, int item_parity,
                                            uint32_t& sums_phase,
                                            float (&l)[2], const float (&m)[2], int lane,
                                            float (&inv_l)[2]) {
  // One pair of arrays per item parity: the next item's sums never overwrite ones still read.
  float* sums = reinterpret_cast<float*>(smem + SmemLayout::l_sums) + (item_parity & 1) * 128;
  float* mine = sums + (left ? 0 : 64);
  const float* other = sums + (left ? 64 : 0);
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    l[j] += __shfl_xor_sync(0xffffffffu, l[j], 1);
    l[j] += __shfl_xor_sync(0xffffffffu, l[j], 2);
    if ((lane & 3) == 0) mine[rs.row_local[j]] = l[j];
  }
  uint64_t* xbar = reinterpret_cast<uint64_t*>(smem + SmemLayout::exchange);
  mbar_arrive(&xbar[left ? kXL0 : kXL1]);
  mbar_wait(&xbar[left ? kXL1 : kXL0], sums_phase);
  sums_phase ^= 1;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    const float total = l[j] + other[rs.row_local[j]];
    const bool any = total > 0.0f;
    inv_l[j] = any ? p.out_scale / total : 0.0f;
    if (left && (lane & 3) == 0 && rs.row_local[j] < r.valid_rows) {
      float* lse = row_dst(p, item.slot, r, rs.row_local[j]).lse;
      if (lse != nullptr) *lse = row_lse(m[j], total);
    }
  }
}

// Shared-memory views both consumer warpgroups use.
struct ConsumerSmem {
  float* m0;  // WG1 -> WG2 row statistics of a pair
  float* c0;
  float* m1;  // WG2 -> WG1
  float* c1;
  uint64_t* full;
  uint64_t* empty;
  uint64_t* xbar;
  uint8_t* stage0;
  uint8_t* stage1;
  uint32_t sq_addr, st0, st1;

  __device__ explicit ConsumerSmem(uint8_t* smem)
      : m0(reinterpret_cast<float*>(smem + SmemLayout::m0)),
        c0(reinterpret_cast<float*>(smem + SmemLayout::c0)),
        m1(reinterpret_cast<float*>(smem + SmemLayout::m1)),
        c1(reinterpret_cast<float*>(smem + SmemLayout::c1)),
        full(reinterpret_cast<uint64_t*>(smem + SmemLayout::full)),
        empty(reinterpret_cast<uint64_t*>(smem + SmemLayout::empty)),
        xbar(reinterpret_cast<uint64_t*>(smem + SmemLayout::exchange)),
        stage0(smem + SmemLayout::k),
        stage1(smem + SmemLayout::k + kTileBytes),
        sq_addr(smem_u32(smem + SmemLayout::q)),
        st0(smem_u32(smem + SmemLayout::k)),
        st1(smem_u32(smem + SmemLayout::k + kTileBytes)) {}

  // Row statistics (and optionally P into stage `stage`'s PE box) to the other warpgroup through
  // exchange x: first this warpgroup's barrier `bar`, after which every warp's scores are done
  // with the PE box.
  __device__ __forceinline__ void publish(int x, int bar, const uint32_t (*pk)[8][2], int stage,
                                          float* m_out, float* c_out, const RowState& rs,
                                          const float (&m)[2], const float (&c)[2], int lane) {
    if (pk != nullptr) {
      named_sync(bar, 128);
      store_p((stage == 0 ? stage0 : stage1) + kPeBox * kBoxBytes, *pk, rs, lane);
      fence_proxy_async();
    }
    if (m_out != nullptr && (lane & 3) == 0) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        m_out[rs.row_local[j]] = m[j];
        c_out[rs.row_local[j]] = c[j];
      }
    }
    mbar_arrive(&xbar[x]);
  }

  // Releases groups g0 (and g1 >= 0) of `stage`: one arrival per warp.
  __device__ __forceinline__ void release(int stage, int g0, int g1, int lane) {
    if (lane == 0) {
      mbar_arrive(&empty[stage * kGroups + g0]);
      if (g1 >= 0) mbar_arrive(&empty[stage * kGroups + g1]);
    }
  }
};

// The pair of key tiles t (even, stage 0) and t + 1 (odd, stage 1). Each warpgroup enters with the
// scores of its tile computed, and issues the scores of its next tile (t + 2, t + 3) before the
// pair's last waits, so that the tensor cores always have the next S queued behind a P V:
//   WG1: softmax S0 -> A (m0, c0) | O_L = c0 O_L + P0 V0_L | wait it: release stage 0 L
//        | wait B (m1, c1, P1) -> C (P0 at m1) | O_L = c1 O_L + P1 V1_L | S0' on stage 0 L (released
//        by WG1 itself) | wait P1 V1_L: release stage 1 L, PE | S0' on stage 0 R, PE | wait S0'.
//   WG2: wait A | softmax S1 -> B | O_R = c0 c1 O_R + P1 V1_R | wait C: O_R += P0' V0_R
//        | wait P1 V1_R: release stage 1 R | wait P0' V0_R: release stage 0 R, PE
//        | S1' on stage 1 R, L, PE | wait S1'.
// No deadlock: before a warpgroup waits for a group the other one releases, it has released
// everything the other one waits for (each first waits on the groups it released itself).

// The pairs of one item, per warpgroup (see the exchange order above): O += P V over the item's
// tiles, with the rows' running max m and sum l. xb_phase is the parity of kXB (WG1: completes
// once per pair with an odd tile) or of kXA / kXC (WG2: each once per pair).
// WG1: O[:, 0:256] and the scores of even tiles.
template <typename T, bool kFp8>
__device__ __forceinline__ void left_pairs(const HopperParams& hp, const ItemRange& r, const RowState& rs,
                                           ConsumerSmem& sm, int wt, int lane, float (&o)[128],
                                           float (&m)[2], float (&l)[2], uint32_t& b_phase,
                                           uint32_t (&phase)[2]) {
  const DecodeParams& p = hp.p;
  float s[32];
  if (r.num_tiles > 0) tile_scores<T, 0>(sm.sq_addr, sm.st0, sm.full, phase[0], s);
  if (wt == 0) MLA_DECODE_STAMP_FIRST(kTraceScores);

  for (int t = 0; t < r.num_tiles; t += 2) {
    const bool has_odd = t + 1 < r.num_tiles;
    const bool has_next = t + 2 < r.num_tiles;
    const int key0 = r.kv_begin + t * kBlockN;
    float tile_max[2];
    mask_scores(p, r, rs, key0, lane, s, tile_max);
    float m0[2], c0[2], m1[2], c1[2] = {1.0f, 1.0f}, sum[2];
    uint32_t pk[8][2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      m0[j] = next_max(m[j], tile_max[j]);
      c0[j] = rescale(m[j], m0[j]);
    }
    exp_scores<T>(s, p.score_scale_log2, m0, pk, sum);
#pragma unroll
    for (int j = 0; j < 2; ++j) l[j] = l[j] * c0[j] + sum[j];
    sm.publish(kXA, kBarLeft, nullptr, 0, sm.m0, sm.c0, rs, m0, c0, lane);  // m0, c0 to WG2

    const int keys0 = r.kv_end - key0;
    if (!kFp8 && keys0 < kBlockN) {  // (an fp8 cache's converter wrote those rows as zeros)
      named_sync(kBarLeft, 128);  // every warp's part of S0 is done reading the rows zeroed here
      zero_tail_rows(sm.stage0 + group_first_box(kGroupL) * kBoxBytes, keys0, wt, kBarLeft);
    }
    scale_o(o, c0);
    pv_rs<T>(pk, sm.st0 + group_first_box(kGroupL) * kBoxBytes, o);

    wgmma_wait<0>();  // P0 V0_L
    fence_operands(o);
    fence_operands(pk);  // P0 V0_L read pk until here: its registers must not be reused before
    sm.release(0, kGroupL, -1, lane);

    // m1, c1 and P1 from WG2; then P0 at the pair's final max to WG2 (exp2(S0 - m1), rounded
    // once). The next pair's kXA / kXC arrivals wait for stage 0's next tile, which WG2
    // releases only after its waits on this pair's kXA and kXC; WG2's next kXB arrival
    // follows its wait on the next kXA.
    if (has_odd) {
      mbar_wait(&sm.xbar[kXB], b_phase);
      b_phase ^= 1;
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        c1[j] = sm.c1[rs.row_local[j]];
        m1[j] = sm.m1[rs.row_local[j]];
      }
      // P0 at m1: the P0 in pk (at m0) unless a row of the warp got a new max in the odd tile.
      if (__any_sync(0xffffffffu, c1[0] != 1.0f || c1[1] != 1.0f)) {
        float unused[2];
        exp_scores<T>(s, p.score_scale_log2, m1, pk, unused);
      }
    } else {
      m1[0] = m0[0];
      m1[1] = m0[1];
    }
    sm.publish(kXC, kBarLeft, &pk, 0, nullptr, nullptr, rs, m1, c1, lane);
    m[0] = m1[0];
    m[1] = m1[1];

    if (has_odd) {
#pragma unroll
      for (int j = 0; j < 2; ++j) l[j] *= c1[j];
      const int keys1 = r.kv_end - (key0 + kBlockN);
      if (!kFp8 && keys1 < kBlockN) zero_tail_rows(sm.stage1 + group_first_box(kGroupL) * kBoxBytes, keys1, wt, kBarLeft);
      mbar_wait(&sm.full[1 * kGroups + kGroupL], phase[1]);
      scale_o(o, c1);
      pv_ss<T>(sm.st1 + kPeBox * kBoxBytes, sm.st1 + group_first_box(kGroupL) * kBoxBytes, o);
    }
    if (has_next) {
      wgmma_fence();
      issue_scores<T, 0>(sm.sq_addr, sm.st0, sm.full, phase[0] ^ 1, s, 0, 1);  // group L
      if (has_odd) {
        wgmma_wait<1>();  // P1 V1_L
        fence_operands(o);
        sm.release(1, kGroupL, kGroupPe, lane);
      }
      issue_scores<T, 0>(sm.sq_addr, sm.st0, sm.full, phase[0] ^ 1, s, 1, kGroups);
      wgmma_wait<0>();
      fence_operands(o);
      fence_operands(s);
    } else {
      // Unconditional wait: ptxas must see every committed group waited for on every path, or
      // it waits at the loop's back edge itself and serialises every wgmma of the kernel.
      wgmma_wait<0>();
      fence_operands(o);
      if (has_odd) sm.release(1, kGroupL, kGroupPe, lane);
    }
    phase[0] ^= 1;
    if (has_odd) phase[1] ^= 1;
    if (wt == 0) MLA_DECODE_STAMP_PAIR(t / 2);
  }
}

// WG2: O[:, 256:512] and the scores of odd tiles.
template <typename T, bool kFp8>
__device__ __forceinline__ void right_pairs(const HopperParams& hp, const ItemRange& r, const RowState& rs,
                                            ConsumerSmem& sm, int wt, int lane, float (&o)[128],
                                            float (&m)[2], float (&l)[2], uint32_t& x_phase,
                                            uint32_t (&phase)[2]) {
  const DecodeParams& p = hp.p;
  float s[32];
  if (r.num_tiles > 1) tile_scores<T, 1>(sm.sq_addr, sm.st1, sm.full, phase[1], s);

  for (int t = 0; t < r.num_tiles; t += 2) {
    const bool has_odd = t + 1 < r.num_tiles;
    const bool has_next_odd = t + 3 < r.num_tiles;
    const int key0 = r.kv_begin + t * kBlockN;
    float tile_max[2] = {-INFINITY, -INFINITY};
    if (has_odd) mask_scores(p, r, rs, key0 + kBlockN, lane, s, tile_max);

    mbar_wait(&sm.xbar[kXA], x_phase);  // m0, c0
    float m0[2], c0[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      m0[j] = sm.m0[rs.row_local[j]];
      c0[j] = sm.c0[rs.row_local[j]];
    }
    uint32_t pk[8][2];
    if (has_odd) {
      float c1[2], sum[2], c01[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        m[j] = next_max(m0[j], tile_max[j]);
        c1[j] = rescale(m0[j], m[j]);
        c01[j] = c0[j] * c1[j];
      }
      exp_scores<T>(s, p.score_scale_log2, m, pk, sum);
      sm.publish(kXB, kBarRight, &pk, 1, sm.m1, sm.c1, rs, m, c1, lane);  // P1, m1, c1 to WG1
#pragma unroll
      for (int j = 0; j < 2; ++j) l[j] = l[j] * c01[j] + sum[j];
      const int keys1 = r.kv_end - (key0 + kBlockN);
      if (!kFp8 && keys1 < kBlockN) zero_tail_rows(sm.stage1 + group_first_box(kGroupR) * kBoxBytes, keys1, wt, kBarRight);
      scale_o(o, c01);
      pv_rs<T>(pk, sm.st1 + group_first_box(kGroupR) * kBoxBytes, o);
    } else {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        m[j] = m0[j];
        l[j] *= c0[j];
      }
      scale_o(o, c0);
    }

    // O_R += P0' V0_R with P0' = P0 at the pair's final max, from WG1.
    mbar_wait(&sm.xbar[kXC], x_phase);
    x_phase ^= 1;
    const int keys0 = r.kv_end - key0;
    if (!kFp8 && keys0 < kBlockN) zero_tail_rows(sm.stage0 + group_first_box(kGroupR) * kBoxBytes, keys0, wt, kBarRight);
    mbar_wait(&sm.full[0 * kGroups + kGroupR], phase[0]);
    pv_ss<T>(sm.st0 + kPeBox * kBoxBytes, sm.st0 + group_first_box(kGroupR) * kBoxBytes, o);
    if (has_odd) {
      wgmma_wait<1>();  // P1 V1_R
      fence_operands(o);
      fence_operands(pk);  // P1 V1_R read pk until here
      sm.release(1, kGroupR, -1, lane);
    }
    wgmma_wait<0>();  // P0' V0_R
    fence_operands(o);
    sm.release(0, kGroupR, kGroupPe, lane);
    if (has_next_odd) tile_scores<T, 1>(sm.sq_addr, sm.st1, sm.full, phase[1] ^ 1, s);
    phase[0] ^= 1;
    if (has_odd) phase[1] ^= 1;
  }
}

// Both consumer warpgroups, one item loop and one epilogue: the warpgroup (left: WG1) picks its
// pairs, and both run the same row sums and stores (one copy of that code, whose lines an SM
// fetches once per item for both warpgroups instead of once each). kFp8: an fp8 cache, whose
// kernel also takes an fp8 query (converted as it loads).
template <typename T, bool kFp8>
__device__ void run_consumer(const HopperParams& hp, uint8_t* smem, int begin, int end, int lane_of_cta,
                             bool left) {
  const DecodeParams& p = hp.p;
  const int wt = int(threadIdx.x) - (left ? 128 : 256);
  const int lane = wt & 31;
  ConsumerSmem sm(smem);
  uint32_t xb_phase = 0;
  uint32_t phase[2] = {0, 0};
  uint32_t sums_phase = 0;  // parity of the other warpgroup's row-sum exchange (once per item)
  const bool fp8_q = converts_fp8_query<T, kFp8>(p);

  // Each item's Q is issued one pass ahead, as soon as this warpgroup's pairs of the item before
  // are done, so that its load overlaps the row sums and stores. Pass k runs item k's pairs (none
  // in pass 0), issues item k + 1's Q, then stores item k: one call site each.
  const int ct = int(threadIdx.x) - 128;
  WorkItem item{};
  ItemRange r{};
  int it = end;  // the pass's item (end: none)
  for (int scan = begin;;) {
    RowState rs;
    float m[2] = {-INFINITY, -INFINITY};
    float l[2] = {0.0f, 0.0f};
    float o[128];
    if (it < end) {
      // An fp8 query is converted here, not with the copies below (its registers would be live
      // beside O's): as safe, this warpgroup's pairs of the item before being done.
      if (fp8_q && r.num_tiles > 0) load_q_fp8<T, 4>(p, r, smem + SmemLayout::q, ct);
      cp_async_wait<0>();
      fence_proxy_async();
      named_sync(kBarItem, 256);  // every thread's chunks of Q have landed
      if (left && wt == 0) MLA_DECODE_STAMP_FIRST(kTraceQ);
      rs = row_state(p, r, wt);
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] = 0.0f;
      if (left)
        left_pairs<T, kFp8>(hp, r, rs, sm, wt, lane, o, m, l, xb_phase, phase);
      else
        right_pairs<T, kFp8>(hp, r, rs, sm, wt, lane, o, m, l, xb_phase, phase);
      // Nothing reads Q after the pairs: this warpgroup's warps have waited for their last S (the
      // barrier), and the other warpgroup's last S was waited for before it published the pair
      // statistics this one has waited for (WG1 reads WG2's kXB after WG2's last odd tile's S;
      // WG2 reads WG1's kXA of the last pair, published after WG1's last S).
      if (left)  // (an id known at compile time at each call: ptxas counts the barriers it may use)
        named_sync(kBarLeft, 128);
      else
        named_sync(kBarRight, 128);
    }
    WorkItem next{};
    ItemRange next_r{};
    for (; scan < end; ++scan) {  // the next item with rows
      next = fetch_item(p, scan, lane_of_cta);
      next_r = item_range(p.layout, next, hp.block_m);
      if (next_r.valid_rows > 0) break;
    }
    if (scan < end && next_r.num_tiles > 0 && !fp8_q) issue_q<T, 4>(p, next_r, smem + SmemLayout::q, ct);
    if (it < end) {
      float inv_l[2];
      finish_rows(p, r, item, rs, smem, left, it, sums_phase, l, m, lane, inv_l);
      if (left && wt == 0) MLA_DECODE_STAMP(kTraceSums);
      store_o(p, r, item, o, rs.row_local, inv_l, left ? 0 : 256, lane);
      if (wt == 0) MLA_DECODE_STAMP(left ? kTraceStoredL : kTraceStoredR);
    }
    if (scan >= end) break;
    it = scan++;
    item = next;
    r = next_r;
  }
}

// ---- Narrow tiles (at most 16 query rows: 16 heads or fewer with one query) ------------------
// The 64-row tile above computes a 16-row tile as 64 rows, four times the tensor work. Here the
// keys (or the value dims) are M instead: S^T = K Q^T (m64n16k16, A = a key box as TMA writes it,
// B = Q's first 16 rows) and O^T = V^T P^T (eight m64n16 blocks over the 512 dims, A = the value
// box read MN-major, B = P^T in a 16-row box). One consumer warpgroup (WG1) runs every tile of
// the item, tile t from stage t % 2, so that the next tile loads while this one is computed (a
// first version gave each warpgroup one stage and waited for every reload: 1-12 % slower than the
// 64-row tile); the quarter of the tensor work fits one warpgroup. WG2 has nothing to do. A thread
// holds O^T[d][n] for d = 64 b + 16 (warp) + lane / 4 + 8 h and rows n = 8 j + 2 (lane % 4) + e,
// in o[8 b + 4 j + 2 h + e].
//
// Shared memory inside the Q region (Q uses the first 16 rows, 2 KB, of each of its 9 boxes):
// P^T at box 0 + 2 KB; the row-max exchange (4 warps x 16 rows) at box 2 + 2 KB; at the end of an
// item the warps' row sums, the rows' max and their destinations from box 8 + 128 (kSums), and the
// rows' output staged in the first 4 KB of boxes 0-7 (rows 2b and 2b + 1 of [16][512] fp32 in box
// b). The second half of each box stays free
// for an fp8 cache's raw stage (raw::kOffset), which the next item's tiles may fill meanwhile.
namespace narrow {
constexpr int kPBox = 2048;                  // offset of P^T inside box 0
constexpr int kMaxX = 2 * kBoxBytes + 2048;  // row-max exchange
// At the end of an item: [4 warps][16] row sums, [16] the rows' max, [16] the rows' destinations.
constexpr int kSums = 8 * kBoxBytes + 128;
constexpr int kRowMax = kSums + 64 * 4;
constexpr int kRowOut = kRowMax + 16 * 4;
static_assert(kMaxX + 64 * 4 <= 2 * kBoxBytes + raw::kOffset && kRowOut + 16 * 8 <= 8 * kBoxBytes + raw::kOffset &&
                  kRowOut % 8 == 0 &&
                  2 * kValueDim * 4 <= raw::kOffset,
              "the narrow consumers' shared memory stays clear of the raw stage");
__device__ __forceinline__ float* staged_row(uint8_t* sq, int rl) {
  return reinterpret_cast<float*>(sq + (rl >> 1) * kBoxBytes + (rl & 1) * kValueDim * 4);
}
// Of the 8 accumulators a thread holds of an m64n16 block (index i = 4 j + 2 h + e), the slot
// x = 2 j + e among its four query rows, and the tile row (the block's column) of slot x.
__device__ __forceinline__ int slot(int i) { return 2 * ((i >> 2) & 1) + (i & 1); }
__device__ __forceinline__ int row(int x, int lane) { return 8 * (x >> 1) + 2 * (lane & 3) + (x & 1); }
}  // namespace narrow

// kFp8: an fp8 cache, whose kernel also takes an fp8 query (converted as it loads).
template <typename T, bool kFp8>
__device__ __forceinline__ void run_narrow_consumer(const HopperParams& hp, uint8_t* smem) {
  const DecodeParams& p = hp.p;
  // The work range read here again (the producer's copy lives across its register change, and
  // ptxas kept a shared one in local memory).
  int begin, end, lane_of_cta;
  cta_work(p, hp.block_m, &begin, &end, &lane_of_cta);
  const int wt = int(threadIdx.x) - 128;
  const int lane = wt & 31, warp = wt >> 5;
  uint8_t* sq = smem + SmemLayout::q;
  uint8_t* pbox = sq + narrow::kPBox;
  float* max_x = reinterpret_cast<float*>(sq + narrow::kMaxX);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + SmemLayout::full);
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + SmemLayout::empty);
  const uint32_t sq_addr = smem_u32(sq), p_addr = smem_u32(pbox);
  const uint32_t st_base = smem_u32(smem + SmemLayout::k);
  uint32_t phases = 0;  // bit s: the parity of stage s's barriers
  const float scale = p.score_scale_log2;

  for (int it = begin; it < end; ++it) {
    const WorkItem item = fetch_item(p, it, lane_of_cta);
    const ItemRange r = item_range(p.layout, item, hp.block_m);
    if (r.valid_rows <= 0) continue;
    named_sync(kBarLeft, 128);  // the last item's staged rows are stored
    if (r.num_tiles > 0) {
      if (converts_fp8_query<T, kFp8>(p))
        load_q_fp8<T, 8>(p, r, sq, wt);
      else
        load_q<T, 8>(p, r, sq, wt);
    }
    fence_proxy_async();
    named_sync(kBarLeft, 128);
    if (wt == 0) MLA_DECODE_STAMP_FIRST(kTraceQ);
    // This thread's 4 rows rl = 8 j + 2 (lane % 4) + e (index 2 j + e) and their last keys.
    int limit[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const int rl = narrow::row(x, lane);
      limit[x] = rl < r.valid_rows
                     ? min(r.kv_end - 1, row_last_key(r.g, r.row0 + rl, p.layout.num_heads))
                     : -1;
    }
    float m[4], l[4], o[64];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      m[x] = -INFINITY;
      l[x] = 0.0f;
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.0f;

#pragma unroll 1
    for (int t = 0; t < r.num_tiles; ++t) {
      const int st = t & 1;
      const int key0 = r.kv_begin + t * kBlockN;
      const uint32_t st_addr = st_base + st * kTileBytes;
      uint8_t* stage = smem + SmemLayout::k + st * kTileBytes;
      // S^T = K Q^T over the 9 boxes, each group as it lands.
      float s[8];
      wgmma_fence();
#pragma unroll
      for (int i = 0; i < kGroups; ++i) {
        const int g = group_order(0, i);
        mbar_wait(&full[st * kGroups + g], (phases >> st) & 1);
#pragma unroll
        for (int kk = 0; kk < 4 * group_boxes(g); ++kk) {
          const uint32_t off = (group_first_box(g) + (kk >> 2)) * kBoxBytes + (kk & 3) * 32;
          wgmma_64x16<T>(k_major_desc(st_addr + off), k_major_desc(sq_addr + off), s, i > 0 || kk > 0);
        }
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(s);
      if (wt == 0) MLA_DECODE_STAMP_FIRST(kTraceScores);
      mbar_arrive(&empty[st * kGroups + kGroupPe]);  // the rope box: read by S^T only
      // Mask (keys past the item or a row's causal limit: -inf) and this thread's max per row.
      float tmax[4];
#pragma unroll
      for (int x = 0; x < 4; ++x) tmax[x] = -INFINITY;
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int x = narrow::slot(i), h = (i >> 1) & 1;
        const int key = key0 + 16 * warp + (lane >> 2) + 8 * h;
        if (key > limit[x]) s[i] = -INFINITY;
        tmax[x] = fmaxf(tmax[x], s[i]);
      }
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        tmax[x] = fmaxf(tmax[x], __shfl_xor_sync(0xffffffffu, tmax[x], 4));
        tmax[x] = fmaxf(tmax[x], __shfl_xor_sync(0xffffffffu, tmax[x], 8));
        tmax[x] = fmaxf(tmax[x], __shfl_xor_sync(0xffffffffu, tmax[x], 16));
        // (narrow::row(x, lane) without its lane mask, lane < 4 here)
        if (lane < 4) max_x[warp * 16 + 8 * (x >> 1) + 2 * lane + (x & 1)] = tmax[x];
      }
      named_sync(kBarLeft, 128);  // every warp's max is in; every warp is done with the stage's K
      float c[4], neg_m[4];
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int rl = narrow::row(x, lane);
        const float mx = fmaxf(fmaxf(max_x[rl], max_x[16 + rl]), fmaxf(max_x[32 + rl], max_x[48 + rl]));
        const float m_new = next_max(m[x], mx * scale);
        c[x] = rescale(m[x], m_new);
        m[x] = m_new;
        neg_m[x] = -max_offset(m_new);
        l[x] *= c[x];
      }
      // P = exp2(scale S - m), rounded to T; its sums; P^T into the P box.
#pragma unroll
      for (int i = 0; i < 8; ++i) {
        const int x = narrow::slot(i), h = (i >> 1) & 1;
        const T pv = from_float<T>(fast_exp2(fmaf(s[i], scale, neg_m[x])));
        l[x] += static_cast<float>(pv);
        const int rl = narrow::row(x, lane);
        *reinterpret_cast<T*>(pbox + swizzled_offset(rl, 16 * warp + (lane >> 2) + 8 * h)) = pv;
      }
      const int keys = r.kv_end - key0;
      if (keys < kBlockN) {  // V rows past the keys may hold NaN: zero them (0 * NaN would reach O)
        zero_tail_rows(stage + group_first_box(kGroupL) * kBoxBytes, keys, wt, kBarLeft);
        zero_tail_rows(stage + group_first_box(kGroupR) * kBoxBytes, keys, wt, kBarLeft);
      }
      fence_proxy_async();
      named_sync(kBarLeft, 128);  // P^T (and zeroed rows) visible to the tensor cores
      if (__any_sync(0xffffffffu, c[0] != 1.0f || c[1] != 1.0f || c[2] != 1.0f || c[3] != 1.0f)) {
#pragma unroll
        for (int i = 0; i < 64; ++i) o[i] *= c[narrow::slot(i)];
      }
      // O^T += V^T P^T: eight 64-dim blocks, four 16-key steps each; the L dims first, released
      // as soon as they are read.
      wgmma_fence();
#pragma unroll
      for (int b = 0; b < 8; ++b) {
#pragma unroll
        for (int kk = 0; kk < 4; ++kk)
          wgmma_64x16_mn<T>(mn_major_desc(st_addr + b * kBoxBytes + kk * 16 * 128, kBoxBytes),
                            k_major_desc(p_addr + kk * 32), o + 8 * b, true);
        if (b == 3) wgmma_commit();  // the L dims' group
      }
      wgmma_commit();
      wgmma_wait<1>();
      mbar_arrive(&empty[st * kGroups + kGroupL]);
      wgmma_wait<0>();
      fence_operands(o);
      mbar_arrive(&empty[st * kGroups + kGroupR]);
      phases ^= 1u << st;
      if (wt == 0) MLA_DECODE_STAMP_PAIR(t);  // the trace's "pairs" here: tiles
    }

    // Row sums: over the lanes of a row (lane / 4), then the four warps through shared memory.
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      l[x] += __shfl_xor_sync(0xffffffffu, l[x], 4);
      l[x] += __shfl_xor_sync(0xffffffffu, l[x], 8);
      l[x] += __shfl_xor_sync(0xffffffffu, l[x], 16);
    }
    float* sums = reinterpret_cast<float*>(sq + narrow::kSums);  // [4 warps][16]
    float* row_max = reinterpret_cast<float*>(sq + narrow::kRowMax);  // (every warp has m)
    void** row_out = reinterpret_cast<void**>(sq + narrow::kRowOut);
    named_sync(kBarLeft, 128);  // every warp is done with Q and the P box
    if (lane < 4) {
#pragma unroll
      for (int x = 0; x < 4; ++x) {
        const int rl = 8 * (x >> 1) + 2 * lane + (x & 1);  // narrow::row (lane < 4)
        sums[warp * 16 + rl] = l[x];
        if (warp == 0) row_max[rl] = m[x];
      }
    }
    named_sync(kBarLeft, 128);
    const auto row_total = [&](int rl) { return sums[rl] + sums[16 + rl] + sums[32 + rl] + sums[48 + rl]; };
    float inv[4];
#pragma unroll
    for (int x = 0; x < 4; ++x) {
      const float total = row_total(narrow::row(x, lane));
      inv[x] = total > 0.0f ? p.out_scale / total : 0.0f;
    }
    // Row wt's destination and LSE by thread wt: one copy of the address and log code, not one
    // for each of a thread's four rows and of the store loop's unrolled rows (it runs once per
    // item, from a cold instruction cache).
    if (wt < r.valid_rows) {
      const RowDst dst = row_dst(p, item.slot, r, wt);
      row_out[wt] = dst.out;
      if (dst.lse != nullptr) *dst.lse = row_lse(row_max[wt], row_total(wt));
    }
#pragma unroll
    for (int i = 0; i < 64; ++i) {
      const int x = narrow::slot(i), h = (i >> 1) & 1;
      const int d = 64 * (i >> 3) + 16 * warp + (lane >> 2) + 8 * h;
      const int rl = narrow::row(x, lane);
      narrow::staged_row(sq, rl)[d] = o[i] * inv[x];
    }
    named_sync(kBarLeft, 128);
    if (wt == 0) MLA_DECODE_STAMP(kTraceSums);
    // Row rl's 128 quads of columns: this thread's quad wt, one 16-byte shared load and one store
    // a row (store_out_quad), a few rows in flight.
    const int kind = out_kind(p, item.slot >= 0);
#pragma unroll 4
    for (int rl = 0; rl < r.valid_rows; ++rl) {
      const float4 v = reinterpret_cast<const float4*>(narrow::staged_row(sq, rl))[wt];
      store_out_quad(p, kind, row_out[rl], 4 * wt, v);
    }
    if (wt == 0) MLA_DECODE_STAMP(kTraceStoredL);
  }
}

// 16 fp8 values (key `key` of box c, values col .. col + 15 of the box) into box c of a 16-bit
// stage, converted, in TMA's layout.
template <typename T>
__device__ __forceinline__ void store_converted(uint8_t* stage, int c, int key, int col, const uint4& v) {
  uint4 lo, hi;
  fp8x16_to<T>(v, lo, hi);
  uint8_t* box = stage + c * kBoxBytes;
  *reinterpret_cast<uint4*>(box + swizzled_offset(key, col)) = lo;
  *reinterpret_cast<uint4*>(box + swizzled_offset(key, col + 8)) = hi;
}

// An fp8 cache: the converter walks the same tiles as the producer and the consumers and fills
// each 16-bit stage group by group, as TMA would have written a 16-bit cache (boxes of 64 keys x
// 64 values, 128-byte swizzle); the stage's full barrier counts the converter's arrivals (no
// bytes). Thread wt converts 16-byte chunks wt and wt + 128 of each box (key chunk / 4, values
// 16 (chunk % 4) ...): the same two keys in every box; a warp reads 8 keys' 64 bytes a box, and
// its eight lanes of a store phase write two keys' four chunk pairs, 32 distinct banks.
//   Narrow tiles (kWide false): WG2, from the raw stage, into the 16-bit stage t % 2 once the
//   consumer has released that group. Each raw group, once landed, is read into registers and
//   goes back to the producer before the wait for the 16-bit stage: the raw stage is what bounds
//   the bytes in flight. The fence orders these reads before the next TMA writes (another
//   proxy); without it the TMA overwrote rows not yet read.
//   64-row tiles (kWide true): the producer warpgroup, from global memory (no raw stage fits
//   beside Q and two 16-bit stages), with thread 0's L2 prefetch of the tiles one and two ahead;
//   a group's loads are in flight before the wait for its stage, in the consumers' release order.
// The converter's threads, a warpgroup (WG2 or WG0): the stages' full barriers count them.
constexpr int kConverterThreads = 128;

template <typename T, bool kWide>
__device__ void run_converter(const HopperParams& hp, uint8_t* smem, int begin, int end, int lane_of_cta) {
  const DecodeParams& p = hp.p;
  const int wt = int(threadIdx.x) - (kWide ? 0 : 256);
  const uint8_t* cache = static_cast<const uint8_t*>(p.kv_cache);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + SmemLayout::full);
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + SmemLayout::empty);
  uint64_t* raw_full = reinterpret_cast<uint64_t*>(smem + SmemLayout::raw_full);
  uint64_t* raw_empty = reinterpret_cast<uint64_t*>(smem + SmemLayout::raw_empty);
  const uint8_t* raw_stage = smem + SmemLayout::q + raw::kOffset;
  // phases bit s (0, 1): the parity of stage s's barriers; bit 2: the stage of the item's next
  // tile; bit 3: past the item's first tile. (One word, and the loop bounded by the keys rather
  // than the tile count: at 56 registers, fp16's 64-row instance spilled a tile counter.)
  uint32_t phases = 0, raw_phase = 0;
  for (int it = begin; it < end; ++it) {
    const WorkItem item = fetch_item(p, it, lane_of_cta);
    const ItemRange r = item_range(p.layout, item, hp.block_m);
    phases &= 3u;  // an item's first tile is stage 0's
    // (unsigned, so that the last step cannot overflow)
#pragma unroll 1
    for (uint32_t key = uint32_t(r.kv_begin); key < uint32_t(r.kv_end); key += kBlockN) {
      const int key0 = int(key);
      const int st = int(phases >> 2) & 1;
      uint8_t* stage = smem + SmemLayout::k + st * kTileBytes;
      int slot[2] = {0, 0};  // from global memory: this thread's two keys' cache slots (-1: zeros)
      if constexpr (kWide) {
        if (wt == 0) MLA_DECODE_STAMP_FIRST(kTraceItem);
#pragma unroll
        for (int k = 0; k < 2; ++k)
          slot[k] = int(cache_slot(p, item.request, key0 + (wt >> 2) + 32 * k, r.kv_end));
        if (wt == 0)
          for (int ahead = (phases & 8u) ? 2 : 1; ahead <= 2; ++ahead)
            prefetch_tile_l2(hp, item.request, key0 + ahead * kBlockN, r.kv_end);
      }
      // (kWide: the groups' order depends on the stage; one loop body keeps the code small)
#pragma unroll(kWide ? 1 : kGroups)
      for (int i = 0; i < kGroups; ++i) {
        const int g = group_order(kWide ? st : 0, i);
        const int first = group_first_box(g);
        uint4 v[8];  // a group's chunks (8 a thread)
        // A group's chunks (two a box) into registers, then the wait for the 16-bit stage.
        const int chunks = 2 * group_boxes(g);
        if constexpr (kWide) {
          if (wt == 0 && i < 2) MLA_DECODE_STAMP_FIRST(kTraceGroup + i);  // (the trace's "issued": converted)
          // Each key's row address once a group, the boxes immediate offsets (a slot is below
          // 2^31, the Hopper kernel's limit, and widened here; slot -1: slot 0's row, never read).
          const uint8_t* row[2];
#pragma unroll
          for (int k = 0; k < 2; ++k)
            row[k] = cache + int64_t(slot[k] >= 0 ? slot[k] : 0) * kHeadDim + first * 64 + (wt & 3) * 16;
#pragma unroll
          for (int j = 0; j < chunks; ++j)
            v[j] = slot[j & 1] >= 0 ? __ldg(reinterpret_cast<const uint4*>(row[j & 1] + (j >> 1) * 64))
                                    : make_uint4(0, 0, 0, 0);
        } else {
          mbar_wait(&raw_full[g], raw_phase);
#pragma unroll
          for (int j = 0; j < chunks; ++j) {
            const int chunk = wt + kConverterThreads * (j & 1);
            v[j] = *reinterpret_cast<const uint4*>(raw_stage + (first + (j >> 1)) * kBoxBytes +
                                                   (chunk >> 2) * raw::kRowBytes + (chunk & 3) * 16);
          }
          fence_proxy_async();
          mbar_arrive(&raw_empty[g]);
        }
        mbar_wait(&empty[st * kGroups + g], ((phases >> st) & 1) ^ 1);
#pragma unroll
        for (int j = 0; j < chunks; ++j) {
          const int chunk = wt + kConverterThreads * (j & 1);
          store_converted<T>(stage, first + (j >> 1), chunk >> 2, (chunk & 3) * 16, v[j]);
        }
        fence_proxy_async();  // the stores, before the consumers' wgmma reads them
        mbar_arrive(&full[st * kGroups + g]);
      }
      if (kWide && wt == 0) MLA_DECODE_STAMP_FIRST(kTraceIssued);
      if constexpr (!kWide) raw_phase ^= 1;
      phases = (phases ^ ((1u << st) | 4u)) | 8u;
    }
  }
}

// kNarrow: the row-tile class (tiles of at most 16 rows, run_narrow_consumer; else 32 or 64 rows,
// run_consumer), a template parameter like the portable kernel's kRowTiles: the two classes differ
// in their register split and their consumers' code. kFp8: an fp8 cache.
template <typename T, bool kNarrow, bool kFp8>
__global__ void __launch_bounds__(kHopperThreads, 1)
    mla_decode_hopper_kernel(const __grid_constant__ HopperParams hp) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  // Aligned by an offset from the __shared__ array (not through an integer), so that the compiler
  // still knows every pointer derived from it is shared memory and emits STS / LDS rather than
  // generic ST / LD (P exchange, row statistics, zeroed tails).
  uint8_t* smem = smem_raw + ((1024 - (smem_u32(smem_raw) & 1023)) & 1023);
  const DecodeParams& p = hp.p;

#if defined(MLA_DECODE_TRACE) && MLA_DECODE_TRACE
  if (threadIdx.x == 0) {
    for (int i = 1; i < kTraceStamps; ++i) decode_trace[i] = 0;
    MLA_DECODE_STAMP(kTraceEntry);
  }
#endif
  if (threadIdx.x == 0) {
    uint64_t* full = reinterpret_cast<uint64_t*>(smem + SmemLayout::full);
    uint64_t* empty = reinterpret_cast<uint64_t*>(smem + SmemLayout::empty);
    uint64_t* xbar = reinterpret_cast<uint64_t*>(smem + SmemLayout::exchange);
    for (int b = 0; b < kStages * kGroups; ++b) {
      // The converter's every thread, or the TMA bytes.
      mbar_init(&full[b], kFp8 ? kConverterThreads : 1);
      // One arrival per warp of the releasing warpgroup; the narrow consumers' every thread
      // arrives (no lane test between their wgmma waits: ptxas would serialise them).
      mbar_init(&empty[b], kNarrow ? 128 : 4);
    }
    for (int b = 0; b < kExchanges; ++b) mbar_init(&xbar[b], 128);  // every writer thread
    if constexpr (kFp8 && kNarrow) {
      // The raw stage's groups: their TMA bytes, and WG2's threads releasing them.
      for (int g = 0; g < kGroups; ++g) {
        mbar_init(reinterpret_cast<uint64_t*>(smem + SmemLayout::raw_full) + g, 1);
        mbar_init(reinterpret_cast<uint64_t*>(smem + SmemLayout::raw_empty) + g, 128);
      }
    }
    mbar_init_fence();
  }
  __syncthreads();
  wait_for_prior_grids();  // the plan (and everything before it in the stream) is done
  if (threadIdx.x == 0) MLA_DECODE_STAMP(kTraceWaited);
  allow_dependent_launch();
  int begin, end, lane;
  if constexpr (!kNarrow) cta_work(p, hp.block_m, &begin, &end, &lane);
  if (threadIdx.x == 0) MLA_DECODE_STAMP(kTraceWork);

  // The warpgroup, as a value ptxas can see is the same across each warp (a shuffle from lane 0):
  // the consumers' branch on it inside their item loop then is not a divergent path.
  const int wg = __shfl_sync(0xffffffffu, int(threadIdx.x) >> 7, 0);
  if (wg == 0) {
    // The narrow consumers need fewer registers; the producer takes 16 more (its loop then keeps
    // the work range in registers). Narrow: 128 x 56 + 256 x 224 = 64,512 of the CTA's 64,512
    // (168 a thread at launch); 64-row tiles: 128 x 40 + 256 x 232 = 64,512, with an fp8 cache
    // 56 / 224 (the converter holds a group's loads: 32 registers).
    setmaxnreg_dec<kNarrow || kFp8 ? 56 : 40>();
    if constexpr (kFp8 && !kNarrow) {
      run_converter<T, true>(hp, smem, begin, end, lane);  // every thread, from global memory
    } else if constexpr (kFp8) {
      if (threadIdx.x == 0) {
        cta_work(p, hp.block_m, &begin, &end, &lane);
        run_producer<true>(hp, smem, 0, begin, end, lane);
      }
    } else if (threadIdx.x == 0 || threadIdx.x == 32) {
      if constexpr (kNarrow) cta_work(p, hp.block_m, &begin, &end, &lane);  // see run_narrow_consumer
      run_producer<false>(hp, smem, threadIdx.x >> 5, begin, end, lane);
    }
  } else {
    setmaxnreg_inc<kNarrow || kFp8 ? 224 : 232>();
    if constexpr (kNarrow) {
      if (wg == 1) {
        run_narrow_consumer<T, kFp8>(hp, smem);
      } else if constexpr (kFp8) {
        cta_work(p, hp.block_m, &begin, &end, &lane);
        run_converter<T, false>(hp, smem, begin, end, lane);
      }  // else WG2 has nothing to do
    } else
      run_consumer<T, kFp8>(hp, smem, begin, end, lane, wg == 1);
  }
#if defined(MLA_DECODE_TRACE) && MLA_DECODE_TRACE
  __syncthreads();
  if (threadIdx.x == 0) {
    MLA_DECODE_STAMP(kTraceEnd);
    decode_trace_store(p, begin, end);
  }
#endif
}

#else  // not sm_90a: the kernel exists only so that the host code links; it is never launched.

template <typename T, bool kNarrow, bool kFp8>
__global__ void mla_decode_hopper_kernel(const __grid_constant__ HopperParams) {}

#endif

// cuTensorMapEncodeTiled from the driver, through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult query{};
    MLA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                    cudaEnableDefault, &query));
    MLA_CHECK(query == cudaDriverEntryPointSuccess && f != nullptr,
              "mla_decode: the CUDA driver has no cuTensorMapEncodeTiled (query result ", int(query), ")");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

}  // namespace

template <typename T>
void launch_hopper_decode_kernel(const DecodeParams& params, int block_m, int grid, cudaStream_t stream) {
  HopperParams hp{};
  hp.p = params;
  hp.block_m = block_m;
  const int page_size = 1 << params.page_shift;
  hp.box_rows = page_size < 64 ? page_size : 64;

  // An fp8 cache: its bytes in the same boxes, unswizzled (the converter reads them).
  const bool fp8 = params.kv_is_fp8 != 0;
  const cuuint64_t dims[2] = {cuuint64_t(kHeadDim), cuuint64_t(params.num_pages) * cuuint64_t(page_size)};
  const cuuint64_t strides[1] = {cuuint64_t(kHeadDim) * (fp8 ? 1 : 2)};
  const cuuint32_t box[2] = {64, cuuint32_t(hp.box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult rc = tensor_map_encoder()(
      &hp.kv_map, fp8 ? CU_TENSOR_MAP_DATA_TYPE_UINT8 : CU_TENSOR_MAP_DATA_TYPE_UINT16, 2,
      const_cast<void*>(params.kv_cache), dims, strides, box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE,
      fp8 ? CU_TENSOR_MAP_SWIZZLE_NONE : CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
      CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MLA_CHECK(rc == CUDA_SUCCESS, "mla_decode: cuTensorMapEncodeTiled failed for the kv_cache (error ",
            int(rc), ", ", params.num_pages, " pages of ", page_size, " tokens at ", params.kv_cache, ")");

  // mask_scores takes each row's max before scaling (right only for a positive scale), and a
  // masked score (-inf) times a zero scale would be NaN inside exp2's FMA.
  MLA_CHECK(params.score_scale_log2 > 0.0f && std::isfinite(params.score_scale_log2),
            "mla_decode: the Hopper decode kernel needs a finite score scale > 0, got ", params.score_scale_log2,
            " (log2 domain)");
  const DeviceInfo& info = current_device_info();
  MLA_CHECK(size_t(SmemLayout::bytes) <= info.max_smem_per_block_optin,
            "mla_decode: the Hopper decode kernel needs ", SmemLayout::bytes,
            " bytes of shared memory per block, but device ", info.device, " allows ",
            info.max_smem_per_block_optin);
  // Tiles of at most 16 rows: the narrow consumers (keys as M, a quarter of the tensor work).
  const auto launch = [&](auto narrow, auto fp8_cache) {
    constexpr auto kernel = mla_decode_hopper_kernel<T, decltype(narrow)::value, decltype(fp8_cache)::value>;
    opt_in_dynamic_smem<kernel>(SmemLayout::bytes);
    launch_dependent(kernel, dim3(grid), dim3(kHopperThreads), SmemLayout::bytes, stream, hp);
  };
  if (block_m <= 16) {
    if (fp8) launch(std::true_type{}, std::true_type{});
    else launch(std::true_type{}, std::false_type{});
  } else if (fp8) {
    launch(std::false_type{}, std::true_type{});
  } else {
    launch(std::false_type{}, std::false_type{});
  }
}

template void launch_hopper_decode_kernel<__nv_bfloat16>(const DecodeParams&, int, int, cudaStream_t);
template void launch_hopper_decode_kernel<__half>(const DecodeParams&, int, int, cudaStream_t);

}  // namespace mla::cuda::decode
