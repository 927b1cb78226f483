// Plain data shared by the decode kernels (plan, main, combine) and their host launchers.
//
// Vocabulary:
//   row        one (query token, head) pair of a request; request b has rows r = i * H + h for
//              its local query i in [0, q_len_b) and head h in [0, H)
//   row tile   kBlockM consecutive rows of one request (kBlockM = 16, 32 or 64 by launch class)
//   key block  kBlockN = 64 consecutive keys of a request (the unit of split-KV work)
//   unit       one (request, row tile): all its visible keys, possibly split into pieces
//   item       one piece of a unit that one CTA runs: (request, row tile, key range, slot)
//   slot       workspace storage of one piece's partial output when its unit is split
#pragma once

#include <climits>
#include <cstdint>

#include "cuda/common/warp_mma.cuh"  // prefetch_l2

namespace mla::cuda::decode {

constexpr int kHeadDim = 576;   // latent cache entry: kv_lora_rank 512 + rope 64
constexpr int kValueDim = 512;  // value / output width
constexpr int kBlockN = 64;     // keys per shared-memory tile and per schedule block
constexpr int kThreads = 256;   // 8 warps per CTA
constexpr int kMaxBlockM = 64;  // the largest row tile; partial slots are sized for it

// Scheduling cost model, in key blocks: each item also pays a fixed cost (query load, output
// write) worth kOverheadBlocks blocks, and no CTA is given less than kMinBlocksPerPart blocks.
// A short request is spread as thin as one block a CTA: on the H200, a minimum of 4 left one
// 4k-key request (16 heads) on 17 CTAs of 4 serial tiles and took 30 us; with 1, 23 us.
// A fixed cost of 1 block is 5-13 % faster than 2 on some split rows (16 heads at B 16-32 kv
// 2-4k and 128 heads at batch 1 on the portable kernel); the rows where it was slower (kv 1k at
// B 16-64: units of 17 blocks against a payload of 9) are batches of equal units, which the plan
// now cuts into equal pieces when they fit on the CTAs (decode_schedule.cu); batches whose units
// differ by a block or more still take the cost line's cuts. 4 and 8 are slower still.
constexpr int kOverheadBlocks = 1;
constexpr int kMinBlocksPerPart = 1;
// A cut inside a unit's fixed cost would give the piece after it a negative key range: no cut
// falls strictly inside a cost of one block, and unit_span moves at most one cut to the unit's
// start, which would cover a cost of two (with payload 1 the first piece was then empty).
static_assert(kOverheadBlocks >= 1 && kOverheadBlocks <= 2,
              "unit_span snaps at most one cut inside the fixed cost of a unit");

constexpr int kScheduleMagic = 0x4d4c4144;  // "MLAD": the header was written by plan_decode

struct __align__(16) ScheduleHeader {  // three 16-byte words (load_header)
  int magic;            // kScheduleMagic
  int num_items;        // items written
  int num_split_units;  // units to combine
  int block_m;          // rows per tile the plan used
  int batch_size;       // B the plan used
  int num_heads;        // H the plan used
  int num_parts;        // CTAs of the decode kernel (the grid the plan was made for)
  int lanes;            // row tiles run side by side (see below); 1 = one unit per row tile
  int num_slots;        // partial-result slots of lane 0 (lane r uses slot + r * num_slots)
  int max_pieces;       // most pieces of one split unit (the combine kernel's shape)
  int split_keys;       // a deterministic plan's cuts (fixed_split.hpp); 0: the balanced plan
  int q_shape;          // the queries the plan used (schedule_q_shape)
};
static_assert(sizeof(ScheduleHeader) == 48, "load_header reads three 16-byte words");
// Lanes. When every request has several row tiles (more than 64 rows: 128 heads, or 16 heads with
// q_len >= 5), the plan cuts the key ranges of whole requests among num_parts / lanes virtual
// parts, and CTA v * lanes + r runs virtual part v's items for row tile r. The row tiles of one
// request then read the same pages at the same time, so the second read hits L2 instead of DRAM.
// Items and split units are stored once (row_tile 0); each kernel applies the lane.

struct __align__(16) WorkItem {
  int request;   // b
  int row_tile;  // rows [row_tile * block_m, ...) of request b
  int kv_begin;  // keys [kv_begin, kv_end) of request b (kv_begin a multiple of kBlockN)
  int kv_end;
  int slot;      // partial-result slot, or -1: the item covers its whole unit, write the output
  int part;      // the CTA that runs it
  // Request b's geometry as the plan read it (q_len < 0: not given; read kv_lens / cu_q_lens),
  // so that a CTA does not wait for a second load before it can start on the item.
  int q_start, q_len, kv_len;
  int pad[3];
};

struct __align__(16) SplitUnit {
  int request;     // b
  int row_tile;    // row tile of request b
  int slot_begin;  // slots [slot_begin, slot_begin + num_pieces) hold its pieces, in key order
  int num_pieces;  // >= 2
  int q_start, q_len, kv_len;  // request b's geometry as the plan read it (as in WorkItem)
  int pad;
};

// Device pointers into a planned workspace (all null when running without a schedule).
struct ScheduleView {
  const ScheduleHeader* header;
  const WorkItem* items;           // [max_items]
  const int* part_begin;           // [num_parts + 1]
  const SplitUnit* split_units;    // [max_split_units]
  float* partial_lse;              // [kMaxBlockM, lse_stride] natural-log LSE of each piece's rows:
                                   // row rl of slot s at rl * lse_stride + s, so that a row's pieces
                                   // (consecutive slots) are consecutive words for the combine
  void* partial_out;               // [max_slots, kMaxBlockM, 512] normalised output of each piece,
                                   // in the output's dtype (partial_elem_bytes)
  int num_parts;
  int split_keys;                  // > 0: a deterministic schedule's (the combine's order)
  int lse_stride;                  // the workspace's slots (max_slots)

  // Row rl's LSE of the piece in `slot`.
  __host__ __device__ float* lse_at(int slot, int rl) const {
    return partial_lse + int64_t(rl) * lse_stride + slot;
  }
};

// The batch layout, read on the device by the plan and by the decode kernels alike, so that both
// see the same request geometry (request_geometry() below).
struct BatchLayout {
  const int32_t* kv_lens;     // [B], element stride kv_lens_stride
  int64_t kv_lens_stride;
  const int32_t* cu_q_lens;   // [B + 1] or null (fixed q_len)
  int64_t cu_q_lens_stride;
  int q_len;                  // queries per request without cu_q_lens
  int max_q_len;              // clamp on a request's queries
  int num_tokens;             // T; query rows past it are never touched (-1: unknown, plan only)
  int max_kv_len;             // clamp on kv_lens (max_blocks * page size; INT32_MAX in the plan)
  int batch_size;             // B
  int num_heads;              // H
};

// The queries of a batch layout in one word, for the header's check: q_len without cu_q_lens,
// -max_q_len with them. A decode whose queries differ from its plan's would otherwise run the
// plan's query rows (items hold each request's q_start and q_len) and pass every other check.
__host__ __device__ inline int schedule_q_shape(const BatchLayout& layout) {
  return layout.cu_q_lens != nullptr ? -layout.max_q_len : layout.q_len;
}

struct RequestGeometry {
  int q_start;  // first query token of the request
  int q_len;    // its queries
  int kv_len;   // its keys
};

// Out-of-range metadata is clamped instead of read past: negative lengths count as 0, a request
// never has more than max_q_len queries or more than max_kv_len keys, and never reaches past
// token T.
// The clamps alone (each a min or max, so applying them twice changes nothing): for geometry the
// plan read and stored in a work item, with the decode call's limits.
__host__ __device__ inline RequestGeometry clamp_geometry(const BatchLayout& layout, RequestGeometry g) {
  if (g.q_start < 0) g.q_start = 0;
  if (g.q_len < 0) g.q_len = 0;
  if (g.q_len > layout.max_q_len) g.q_len = layout.max_q_len;
  if (layout.num_tokens >= 0) {
    if (g.q_start > layout.num_tokens) g.q_start = layout.num_tokens;
    if (g.q_len > layout.num_tokens - g.q_start) g.q_len = layout.num_tokens - g.q_start;
  }
  if (g.kv_len < 0) g.kv_len = 0;
  if (g.kv_len > layout.max_kv_len) g.kv_len = layout.max_kv_len;
  return g;
}

// What the decode and combine kernels take for a planned item or split unit: the geometry the
// plan read, with this call's clamps, so that both kernels see the same rows.
__host__ __device__ inline RequestGeometry planned_geometry(const BatchLayout& layout, int q_start,
                                                            int q_len, int kv_len) {
  return clamp_geometry(layout, RequestGeometry{q_start, q_len, kv_len});
}

__host__ __device__ inline RequestGeometry request_geometry(const BatchLayout& layout, int b) {
  RequestGeometry g;
  if (layout.cu_q_lens != nullptr) {
    const int begin = layout.cu_q_lens[int64_t(b) * layout.cu_q_lens_stride];
    const int end = layout.cu_q_lens[int64_t(b + 1) * layout.cu_q_lens_stride];
    g.q_start = begin < 0 ? 0 : begin;
    g.q_len = end - g.q_start;
  } else {
    g.q_start = b * layout.q_len;
    g.q_len = layout.q_len;
  }
  g.kv_len = layout.kv_lens[int64_t(b) * layout.kv_lens_stride];
  return clamp_geometry(layout, g);
}

// n / d for 32-bit unsigned n and a divisor d >= 1 known in advance, by a multiply: with
// magic = division_magic(d) = floor((2^32 - 1) / d), umulhi(n, magic) is floor(n / d) or one less
// (magic >= 2^32 / d - 1, so the estimate falls short of n / d by less than n / 2^32 < 1), and one
// comparison of the remainder corrects it. Four instructions instead of a division's ~15 (the
// plan's chain of dependent instructions).
__host__ __device__ inline uint32_t division_magic(uint32_t d) { return 0xffffffffu / d; }
__host__ __device__ inline uint32_t div_by_magic(uint32_t n, uint32_t d, uint32_t magic) {
#ifdef __CUDA_ARCH__
  uint32_t q = __umulhi(n, magic);
#else
  uint32_t q = uint32_t((uint64_t(n) * magic) >> 32);
#endif
  if (n - q * d >= d) ++q;
  return q;
}

// Key blocks of kBlockN that `keys` (>= 0) keys fill, without overflow up to INT_MAX keys.
__host__ __device__ inline int key_blocks(int keys) {
  return int((unsigned(keys) + kBlockN - 1) / kBlockN);
}

// Row tiles of block_m rows that q_len x num_heads query rows fill (0 for no queries). More
// than one for a request: other CTAs read the same keys (the plan's units and lanes; the Hopper
// kernel's L2 prefetch).
__host__ __device__ inline int row_tiles(int q_len, int num_heads, int block_m) {
  return (q_len * num_heads + block_m - 1) / block_m;
}

// The plan's lanes (below) for requests of up to max_q_len queries on num_parts CTAs: one lane a
// row tile when every request may have several (and they fit), else 1.
__host__ __device__ inline int plan_lanes(int max_q_len, int num_heads, int block_m, int num_parts) {
  const int tiles_max = row_tiles(max_q_len, num_heads, block_m);
  return tiles_max >= 2 && tiles_max <= num_parts ? tiles_max : 1;
}

// The causal limit of query row `row` (r = i * H + h) of a request: the last key it may see,
// kv_len - q_len + i (negative: none).
__host__ __device__ inline int row_last_key(const RequestGeometry& g, int row, int num_heads) {
  return g.kv_len - g.q_len + row / num_heads;
}

// Keys visible to any row of a row tile whose last row is row_end - 1 (row_end >= 1): its last
// row's causal limit + 1, clamped to [0, kv_len].
__host__ __device__ inline int tile_visible_keys(const RequestGeometry& g, int row_end,
                                                 int num_heads) {
  int visible = row_last_key(g, row_end - 1, num_heads) + 1;
  if (visible < 0) visible = 0;
  if (visible > g.kv_len) visible = g.kv_len;
  return visible;
}

// What one CTA does for a work item: its request, its valid rows and the key range it attends
// over (clamped to what the tile's last row may see). Shared by every decode kernel and by the
// producer and consumer roles inside one, so that they all walk the same tiles.
struct ItemRange {
  RequestGeometry g;
  int row0;        // first row of the tile
  int valid_rows;  // rows of the tile that exist (<= 0: nothing to do)
  int kv_begin, kv_end;
  int num_tiles;   // key tiles of kBlockN in [kv_begin, kv_end)
};

__host__ __device__ inline ItemRange item_range(const BatchLayout& layout, const WorkItem& item,
                                                int block_m) {
  ItemRange r;
  r.g = item.q_len >= 0 ? planned_geometry(layout, item.q_start, item.q_len, item.kv_len)
                        : request_geometry(layout, item.request);
  const int rows = r.g.q_len * layout.num_heads;
  r.row0 = item.row_tile * block_m;
  r.valid_rows = rows - r.row0 < block_m ? rows - r.row0 : block_m;
  if (r.valid_rows <= 0) {
    r.valid_rows = 0;
    r.kv_begin = r.kv_end = r.num_tiles = 0;
    return r;
  }
  const int visible = tile_visible_keys(r.g, r.row0 + r.valid_rows, layout.num_heads);
  // Clamped to [0, visible] at both ends, so that every role walks the same whole tiles of
  // real keys even from a workspace that another call has overwritten.
  r.kv_end = item.kv_end < visible ? item.kv_end : visible;
  if (r.kv_end < 0) r.kv_end = 0;
  r.kv_begin = item.kv_begin < r.kv_end ? item.kv_begin : r.kv_end;
  if (r.kv_begin < 0) r.kv_begin = 0;
  r.num_tiles = key_blocks(r.kv_end - r.kv_begin);
  return r;
}

// Everything the main and combine kernels read. Strides are in elements.
struct DecodeParams {
  // Queries: dims [0, 512) from q_nope, [512, 576) from q_pe (for a single 576-wide q tensor,
  // q_pe = q + 512 with the same strides).
  const void* q_nope;
  const void* q_pe;
  int64_t q_nope_stride_t, q_nope_stride_h;
  int64_t q_pe_stride_t, q_pe_stride_h;
  int q_is_fp8;       // queries are fp8 e4m3 (else the compute dtype)
  int q_vector_ok;    // 16-byte aligned rows: vector loads; else element loads

  // Paged latent cache [P, S, 576], contiguous.
  const void* kv_cache;
  int64_t num_pages;   // P
  int page_shift;      // log2(S)
  int kv_is_fp8;       // fp8 e4m3 cache (else the compute dtype)
  int kv_fp8_direct;   // the portable kernel with one stage: an fp8 tile goes through registers,
                       // converted on its way to shared memory (no raw stage), where a raw stage
                       // does not fit the block's shared memory
  const int32_t* block_table;  // [B, max_blocks]
  int64_t block_table_stride_b, block_table_stride_j;

  BatchLayout layout;

  float score_scale_log2;  // softmax_scale * q_scale * k_scale * log2(e): exp2 domain
  float out_scale;         // k_scale for an fp8 cache, else 1

  // Output [T, H, 512] and LSE [T, H] (optional).
  void* out;
  int64_t out_stride_t, out_stride_h;
  int out_dtype;      // OutDType
  int out_pair_ok;    // pairs of elements are naturally aligned: 2-element vector stores
  int out_quad_ok;    // so are groups of four (a 16-bit output's rows: 8-byte stores)
  float* lse;
  int64_t lse_stride_t, lse_stride_h;

  // Without a schedule: one CTA per (request, row tile), tiles_per_request tiles each.
  int tiles_per_request;
  int has_schedule;
  int plan_lanes;  // with a schedule: the lanes its plan should have (the header decides)
  ScheduleView schedule;
#if defined(MLA_DECODE_TRACE) && MLA_DECODE_TRACE
  unsigned long long* trace;  // trace builds: the decode trace buffer (common/trace.cuh)
#endif
};

enum OutDType : int { kOutBF16 = 0, kOutFP16 = 1, kOutFP32 = 2 };

// A piece's partial output is stored in the output's dtype (bf16, fp16 or fp32): the combine
// adds the pieces in fp32 and rounds once more to that dtype, so a split row carries at most one
// rounding of the output's precision more than an unsplit one, and the pieces' bytes (written by
// the decode kernel and read back by the combine, as many as the cache's at batch 1 with 128
// heads) halve for a 16-bit output.
__host__ __device__ inline int partial_elem_bytes(int out_dtype) { return out_dtype == kOutFP32 ? 4 : 2; }

// Parameters of the plan kernel.
struct PlanParams {
  BatchLayout layout;
  int block_m;           // rows per tile
  int num_parts;         // CTAs of the decode kernel
  // > 0: the deterministic plan (fixed_split.hpp), block_m the device's row-tile cap (64; 16 on
  // sm_86 / sm_89); 0: balanced
  int split_keys;
  int max_items, max_split_units, max_slots;
  ScheduleHeader* header;
  WorkItem* items;
  int* part_begin;
  SplitUnit* split_units;
};

// The plan's header in three 16-byte loads issued together (read field by field, each check of
// cta_work waited for its field's load behind the previous check's branch).
__device__ __forceinline__ ScheduleHeader load_header(const ScheduleHeader* header) {
  ScheduleHeader h;
  const int4* src = reinterpret_cast<const int4*>(header);
  int4* dst = reinterpret_cast<int4*>(&h);
#pragma unroll
  for (int i = 0; i < 3; ++i) dst[i] = src[i];
  return h;
}

// A planned item with its lane applied: row tile `lane`, slot offset by lane * num_slots.
__device__ __forceinline__ void apply_lane(WorkItem& w, const ScheduleHeader& h, int lane) {
  if (h.lanes > 1) {
    w.row_tile = lane;
    if (w.slot >= 0) w.slot += lane * h.num_slots;
  }
}

// Work item `it` of this CTA (see cta_work): the planned item with its lane applied, or the
// unplanned CTA's row tile with all its keys.
__device__ __forceinline__ WorkItem fetch_item(const DecodeParams& p, int it, int lane) {
  WorkItem w{};
  if (p.has_schedule) {
    const ScheduleHeader& h = *p.schedule.header;
    w = p.schedule.items[it];
    apply_lane(w, h, lane);
    return w;
  }
  w.q_len = -1;  // read the request's geometry from the layout
  w.request = int(blockIdx.x) / p.tiles_per_request;
  w.row_tile = int(blockIdx.x) % p.tiles_per_request;
  w.kv_begin = 0;
  w.kv_end = INT_MAX;
  w.slot = -1;
  return w;
}

// This CTA's work: items [*begin, *end) and the lane applied to each (fetch_item). With a
// schedule, the CTA's part of the plan; a plan for another batch shape (or another row-tile class
// or grid) would send the CTA past its work list, so it stops with a trap instead. Without one,
// the single row tile blockIdx.x names (item 0).
// With `first`: also item *begin (where *begin < *end), lane applied, loaded together with the
// bounds where items are numbered by place (else loaded after them), so that the CTA's
// first item does not wait for a second round trip after the bounds.
__device__ __forceinline__ void cta_work(const DecodeParams& p, int block_m, int* begin, int* end,
                                         int* lane, WorkItem* first = nullptr) {
  *begin = 0;
  *end = 1;
  *lane = 0;
  if (!p.has_schedule) {
    if (first != nullptr) *first = fetch_item(p, 0, 0);
    return;
  }
  // The part's bounds are loaded together with the header, for the lanes the plan should have
  // used (one round trip, not two; in bounds for any lanes, the grid being num_parts CTAs), and
  // again if the header says otherwise.
  const int guess = p.plan_lanes;
  const int v_guess = int(blockIdx.x) / guess;
  // Items are numbered by place: where every part has one item (a batch of equal requests cut
  // into equal pieces, batch 1 among them), part v's is item v. Loaded with the bounds (or asked
  // of L2, so that fetch_item's load of it is an L2 hit rather than a second miss after them).
  // Item v lies inside the workspace (max_items >= num_parts) whatever the plan.
  WorkItem w{};
  if (first != nullptr)
    w = p.schedule.items[v_guess];
  else
    prefetch_l2(p.schedule.items + v_guess, uint32_t(sizeof(WorkItem)));
  const int begin_guess = p.schedule.part_begin[v_guess];
  const int end_guess = p.schedule.part_begin[v_guess + 1];
  const ScheduleHeader h = load_header(p.schedule.header);
  if (h.magic != kScheduleMagic || h.block_m != block_m || h.batch_size != p.layout.batch_size ||
      h.num_heads != p.layout.num_heads || h.num_parts != int(gridDim.x) || h.lanes < 1 ||
      h.q_shape != schedule_q_shape(p.layout)) {
    __trap();
  }
  const int v = int(blockIdx.x) / h.lanes;
  *lane = int(blockIdx.x) - v * h.lanes;
  if (v >= h.num_parts / h.lanes) {
    *end = 0;
    return;
  }
  *begin = h.lanes == guess ? begin_guess : p.schedule.part_begin[v];
  *end = h.lanes == guess ? end_guess : p.schedule.part_begin[v + 1];
  if (first != nullptr && *begin < *end) {
    if (*begin != v_guess) w = p.schedule.items[*begin];
    apply_lane(w, h, *lane);
    *first = w;
  }
}

}  // namespace mla::cuda::decode
