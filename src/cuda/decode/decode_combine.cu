// mla_decode combine kernel: merges the pieces of each split unit (row tile whose keys were
// divided among several CTAs) by their LSE.
//
// For each row: lse = ln(sum_k exp(lse_k)), out = sum_k exp(lse_k - lse) * out_k, where out_k is
// piece k's normalised output (already scaled by k_scale), stored by the decode kernel in the
// output's dtype (partial_elem_bytes) and summed here in fp32. Pieces whose rows saw no key have
// lse_k = -inf and weigh nothing; a row with no key in any piece gets out 0 and lse -inf.
//
// Grid: a fixed kCtasPerPart x num_parts CTAs (one resident wave; graph-capturable, since the
// number of split units is only known on the device), walking the jobs with a grid stride. A
// job is kWarps / W rows, W warps per row, where W (1, 2, 4 or 8) follows the plan's largest
// piece count: warp j of a row sums pieces j, j + W, ... (4 pieces per step, so 16 independent
// 16-byte loads per lane are in flight), each lane owning 16 of the 512 columns, and the W
// partial sums meet in shared memory, where warp j sums and stores column groups j, j + W, ...
// The row's LSE takes one pass over the pieces' LSEs (a lane's four a round trip: their max,
// then four independent exps; the warp's max, then its sums moved to it and added), with the
// warp's first step of pieces in flight alongside. What the plan wrote (header, split units with
// their request's geometry) is read before the wait for the decode kernel (the first job's), or
// while the previous job's pieces load (the next job's). After the wait, a large batch of units
// in two or three pieces gives each row one warp and one round trip; a request split over ~130
// CTAs, four.
//
// Version history: v1 one warp per row, one piece per step (latency-bound: ~45 us for one 32k
// request with 16 heads on an H200); v2 four warps per row, four pieces per step, two passes for
// the LSE, one CTA per (split unit, row pair) in a fixed grid of mostly idle CTAs; v3 W warps
// per row from the plan's largest piece count, one LSE pass, grid-stride over the rows; v4 the
// LSEs of up to 128 pieces in one round trip, and the row's warps share the final sum and the
// stores (code 32 -> 16 KB: this kernel runs once per decode call, from a cold instruction cache);
// v5 the header, split unit and request of the first job read before the wait (the next job's
// during this one), the first step's pieces loaded with the LSEs (three round trips fewer after
// the decode kernel ends), two CTAs an SM at up to 128 registers (126 at four CTAs an SM had
// left half the grid waiting for a second wave); v6 the row's LSE as a max, then independent
// exps (was a chain of running merges: four dependent levels instead of ~nine; batch 1 -1 to
// -3 %, code 23.6 -> 20.7 KB); v7 a deterministic plan's rows take W warps too, in groups of four
// consecutive pieces whose sums are added in key order (kOrdered, its own instantiation: the same
// bits for any W; they took one warp, 16 round trips for a batch-1 row of 64 pieces). On an H100
// (deterministic, split_keys 256, batch 1): 128 h kv 16k 38.9 -> 29.6 us, 16 h kv 4k 22.2 ->
// 20.4 us. Every plan taking that order cost the balanced batch-1 rows 2-7 %, so they keep theirs.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/trace.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/decode/decode_device.cuh"
#include "cuda/decode/decode_launch.hpp"

namespace mla::cuda::decode {
namespace {

constexpr int kWarps = 8;
constexpr int kThreadsPerCta = kWarps * 32;
constexpr int kUnroll = 4;       // pieces per step of one warp
// Combine CTAs per decode CTA: two of 256 threads at up to 128 registers a thread fill an SM's
// registers (a warp holds a step of four pieces, 64 values a lane, in flight).
constexpr int kCtasPerPart = 2;
constexpr int kMinCtasPerSm = 2;

// Warps per row for units of up to `max_pieces` pieces: enough for one step of kUnroll pieces
// each, a power of two up to kWarps.
__device__ __forceinline__ int warps_per_row(int max_pieces) {
  int w = 1;
  while (w < kWarps && w * kUnroll < max_pieces) w *= 2;
  return w;
}

// Running (max, sum of exp(x - max)) pairs: merges b into a. An empty pair has max -inf, sum 0.
__device__ __forceinline__ void merge_lse(float& max_a, float& sum_a, float max_b, float sum_b) {
  const float m = fmaxf(max_a, max_b);
  if (m == -INFINITY) return;  // both empty
  sum_a = sum_a * expf(max_a - m) + sum_b * expf(max_b - m);
  max_a = m;
}

// Four consecutive values of a partial row, as stored (Partial: float, __nv_bfloat16 or __half),
// and in fp32.
template <typename Partial>
struct Quad {  // 16-bit: four values in 8 bytes
  using Raw = uint2;
  __device__ static float4 to_float(Raw r) {
    const float2 a = unpack2<Partial>(r.x), b = unpack2<Partial>(r.y);
    return make_float4(a.x, a.y, b.x, b.y);
  }
};
template <>
struct Quad<float> {
  using Raw = float4;
  __device__ static float4 to_float(Raw r) { return r; }
};

// One step of a warp over its pieces k, k + stride, ..., k + (kUnroll - 1) stride of a split
// unit (stride: the row's warps): their LSEs and their columns 4 (lane + 32 i), all loads in
// flight at once (as stored: converted to fp32 in add_step); a piece past n reads as empty (LSE
// -inf, zeros).
template <typename Partial>
struct PieceStep {
  float lse[kUnroll];
  typename Quad<Partial>::Raw v[kUnroll][4];
};
template <typename Partial>
__device__ __forceinline__ void load_step(const typename Quad<Partial>::Raw* base, const float* lse_k,
                                          int n, int k, int stride, int lane, PieceStep<Partial>& st) {
  constexpr int64_t kSlotStride4 = int64_t(kMaxBlockM) * kValueDim / 4;  // quads per slot
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const int piece = k + u * stride;
    const bool in = piece < n;
    st.lse[u] = in ? lse_k[piece] : -INFINITY;
#pragma unroll
    for (int i = 0; i < 4; ++i)
      st.v[u][i] = in ? base[piece * kSlotStride4 + lane + 32 * i] : typename Quad<Partial>::Raw{};
  }
}
// acc += exp(lse_k - lse) * out_k over the step's pieces (weight 0 for an empty piece).
template <typename Partial>
__device__ __forceinline__ void add_step(const PieceStep<Partial>& st, float lse, float4 (&acc)[4]) {
#pragma unroll
  for (int u = 0; u < kUnroll; ++u) {
    const float wu = expf(st.lse[u] - lse);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = Quad<Partial>::to_float(st.v[u][i]);
      acc[i].x += wu * v.x;
      acc[i].y += wu * v.y;
      acc[i].z += wu * v.z;
      acc[i].w += wu * v.w;
    }
  }
}

__device__ __forceinline__ void add4(float4& a, const float4& b) {
  a.x += b.x;
  a.y += b.y;
  a.z += b.z;
  a.w += b.w;
}

// The row's LSE over its n pieces' LSEs (lse_k, consecutive words), the same in every lane: its max
// and the sum of exp(lse_k - max) (-inf and 0 when every piece is empty, NaN and NaN when one is
// NaN). A lane's four a round trip (up to 128 pieces), the round's max first, then four
// independent exps; then the warp's max, and each lane's sum moved to it and the sums added.
__device__ __forceinline__ void row_lse(const float* lse_k, int n, int lane, float& lse_max,
                                        float& lse_sum) {
  lse_max = -INFINITY;
  lse_sum = 0.0f;
  bool nan = false;
  for (int k0 = 0; k0 < n; k0 += 4 * 32) {
    float v[4];
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int k = k0 + lane + 32 * u;
      v[u] = k < n ? lse_k[k] : -INFINITY;
      nan |= v[u] != v[u];
    }
    const float m_r = fmaxf(fmaxf(v[0], v[1]), fmaxf(v[2], v[3]));
    float s_r = 0.0f;
    if (m_r != -INFINITY) {
#pragma unroll
      for (int u = 0; u < 4; ++u) s_r += expf(v[u] - m_r);
    }
    merge_lse(lse_max, lse_sum, m_r, s_r);
  }
  float row_max = lse_max;
#pragma unroll
  for (int off = 16; off > 0; off >>= 1)
    row_max = fmaxf(row_max, __shfl_xor_sync(0xffffffffu, row_max, off));
  // (a lane with no piece has max -inf and sum 0: 0 * exp(-inf) = 0)
  if (row_max != -INFINITY) lse_sum *= expf(lse_max - row_max);
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) lse_sum += __shfl_xor_sync(0xffffffffu, lse_sum, off);
  lse_max = row_max;
  // A NaN piece (row_lse of the decode kernels) makes the row NaN: the max above drops it.
  if (__any_sync(0xffffffffu, nan)) lse_max = lse_sum = __uint_as_float(0x7fffffffu);
}

// The row a warp combines in one job: its split unit (the lane's row tile and slots), request
// and row. Read from the plan's arrays, which the decode kernel does not write.
struct JobRow {
  SplitUnit unit;
  RequestGeometry g;
  int r;          // row of the request (query x head)
  int row_local;  // row of the row tile
  bool valid;
};
__device__ __forceinline__ JobRow job_row(const DecodeParams& p, int gr, int rows, int block_m, int lanes,
                                          int num_slots) {
  // Row gr: split unit x lane u = gr / block_m (unit u / lanes, row tile u % lanes with its
  // slots offset by the lane), row row_local of the tile.
  JobRow jr{};
  const int u = gr / block_m;
  jr.row_local = gr - u * block_m;
  jr.valid = gr < rows;
  if (jr.valid) {
    jr.unit = p.schedule.split_units[u / lanes];
    if (lanes > 1) {
      const int tile_lane = u % lanes;
      jr.unit.row_tile = tile_lane;
      jr.unit.slot_begin += tile_lane * num_slots;
    }
    jr.g = planned_geometry(p.layout, jr.unit.q_start, jr.unit.q_len, jr.unit.kv_len);
    jr.r = jr.unit.row_tile * block_m + jr.row_local;
    jr.valid = jr.r < jr.g.q_len * p.layout.num_heads;  // same for a row's warps
  }
  return jr;
}

// Partial: the pieces' stored dtype, the output's (partial_elem_bytes).
// kOrdered (a deterministic plan's, ScheduleHeader::split_keys > 0): a row's pieces are added in
// groups of four consecutive pieces, the groups' sums in key order, whatever the warps a row
// (w): the same bits for any w, so that the row's order of fp32 additions depends on its piece
// count alone while it takes w warps like a balanced plan's row. Otherwise warp j of a row adds
// pieces j, j + w, ... four a step, and the warps' sums meet at the end (an order that follows w,
// which follows the plan's largest piece count: one step less than kOrdered's per-group sums).
template <typename Partial, bool kOrdered>
__global__ void __launch_bounds__(kThreadsPerCta, kMinCtasPerSm)
    mla_decode_combine_kernel(const __grid_constant__ DecodeParams p) {
  __shared__ float4 partial[kWarps][32][4];  // per warp: its lanes' 16 columns
#if defined(MLA_DECODE_TRACE) && MLA_DECODE_TRACE
  // A trace build (trace.cuh): thread 0 of the first CTA prints the decode kernel's records (then
  // empties them), its own entry time (ns), its wait's return and its end.
  // Thread 0's first job: its row's LSE, the first step added, every step added, the row's warps
  // met, its stores issued.
  // Right after the wait, thread 0 times two loads through L2 before its job, one after the
  // other: a word of the plan's header (not written by the decode kernel; in L2, read by every
  // decode CTA) and its row's first LSE (just written by it). Both return times are printed
  // (probes), so a slow first round trip can be told apart: every load after the wait, or only
  // the decode kernel's lines. They delay thread 0's job by their round trips.
  const unsigned long long trace_entry = globaltimer_ns();
  unsigned long long trace_waited = 0, trace_job[5] = {0, 0, 0, 0, 0}, trace_probe[2] = {0, 0};
#define MLA_COMBINE_STAMP(i) \
  (threadIdx.x == 0 && job == first_job ? (void)(trace_job[i] = globaltimer_ns()) : (void)0)
#else
#define MLA_COMBINE_STAMP(i) ((void)0)
#endif
  // The plan's header and the first job's row are read before the wait: the plan finished before
  // the decode kernel's CTAs passed their own wait, and they allow this grid to start only after
  // that, so these reads overlap the decode kernel's tail instead of following it. Only what the
  // decode kernel writes (partial LSEs and outputs) is read after the wait; every CTA waits, so
  // that this grid completes only after the decode kernel has.
  const ScheduleHeader& header = *p.schedule.header;
  if (header.magic != kScheduleMagic || header.batch_size != p.layout.batch_size ||
      header.num_heads != p.layout.num_heads || header.lanes < 1 || header.block_m < 1 ||
      header.q_shape != schedule_q_shape(p.layout)) {
    // A plan for another batch shape: the decode kernel traps on it too. Nothing past the header
    // is read, so that no index it holds is followed.
    wait_for_prior_grids();
    __trap();
  }
  const int block_m = header.block_m, lanes = header.lanes, num_slots = header.num_slots;
  const int rows = header.num_split_units * lanes * block_m;
  // kOrdered: the order of the additions does not follow w. Otherwise a deterministic plan's
  // rows (launched with kOrdered; this is a backstop) take one warp whatever their pieces.
  const int w = kOrdered || header.split_keys == 0 ? warps_per_row(header.max_pieces) : 1;
  const int rows_per_job = kWarps / w;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = warp % w;  // this warp's place among its row's warps
  const int num_heads = p.layout.num_heads;
  const int first_job = int(blockIdx.x);
  JobRow jr = job_row(p, first_job * rows_per_job + warp / w, rows, block_m, lanes, num_slots);
  wait_for_prior_grids();  // the decode kernel's partial results are written
#if defined(MLA_DECODE_TRACE) && MLA_DECODE_TRACE
  trace_waited = globaltimer_ns();
  if (threadIdx.x == 0 && jr.valid) {
    // A word through L2, and the time once it is in: the stamp is taken on a branch on the
    // loaded value, so after the load has returned.
    auto load_returned_at = [](const void* ptr) {
      unsigned v;
      asm volatile("ld.global.cg.u32 %0, [%1];\n" : "=r"(v) : "l"(ptr));
      return v == 0x5a5a5a5au ? 1ull : globaltimer_ns();
    };
    trace_probe[0] = load_returned_at(&p.schedule.header->magic);
    trace_probe[1] = load_returned_at(p.schedule.lse_at(jr.unit.slot_begin, jr.row_local));
  }
#endif
  for (int job = first_job; job * rows_per_job < rows; job += int(gridDim.x)) {
    // The next job's row, read while this one's pieces load.
    const int next = job + int(gridDim.x);
    const JobRow jr_next = next * rows_per_job < rows
                               ? job_row(p, next * rows_per_job + warp / w, rows, block_m, lanes, num_slots)
                               : JobRow{};
    const bool valid = jr.valid;
    const RequestGeometry& g = jr.g;
    const int r = jr.r, row_local = jr.row_local;
    if constexpr (kOrdered) {
      // Groups of kUnroll consecutive pieces, each summed on its own (add_step on zeros), then the
      // groups' sums added in key order: the same fp32 operations whatever w. Warp j sums groups
      // j, j + w, ..., one a round; a round's w sums meet in shared memory, where warp j adds
      // column groups j, j + w, ... to the row's running sum. Rows of more than one round have
      // w = kWarps (warps_per_row), one row a job, so every warp of the CTA runs the same rounds.
      __shared__ float4 running[32][4];  // a row of several rounds: its sum of the rounds before
      const int n = valid ? jr.unit.num_pieces : 0;
      const int groups = (n + kUnroll - 1) / kUnroll;
      const int rounds = w == kWarps ? (groups + w - 1) / w : 1;
      float lse = -INFINITY;
      PieceStep<Partial> st;
      const float* lse_k = nullptr;
      const typename Quad<Partial>::Raw* base = nullptr;
      if (valid) {
        lse_k = p.schedule.lse_at(jr.unit.slot_begin, row_local);
        base = reinterpret_cast<const typename Quad<Partial>::Raw*>(
            static_cast<const Partial*>(p.schedule.partial_out) +
            (int64_t(jr.unit.slot_begin) * kMaxBlockM + row_local) * kValueDim);
        load_step(base, lse_k, n, kUnroll * j, 1, lane, st);  // in flight with the LSE loads
        float lse_max, lse_sum;
        row_lse(lse_k, n, lane, lse_max, lse_sum);
        if (lse_max != -INFINITY) lse = lse_max + logf(lse_sum);
        MLA_COMBINE_STAMP(0);
      }
      const int first = warp - j;
#pragma unroll 1
      for (int round = 0; round < rounds; ++round) {
        float4 acc[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        const int group = round * w + j;
        if (lse != -INFINITY && group < groups) {
          add_step(st, lse, acc);
          if (group + w < groups) load_step(base, lse_k, n, kUnroll * (group + w), 1, lane, st);
        }
#pragma unroll
        for (int i = 0; i < 4; ++i) partial[warp][lane][i] = acc[i];
        __syncthreads();
        if (valid) {
          const int in_round = min(w, groups - round * w);
          const bool last = round == rounds - 1;
          const int64_t token = g.q_start + r / num_heads;
          const int head = r % num_heads;
#pragma unroll 1
          for (int i = j; i < 4; i += w) {
            float4 sum = partial[first][lane][i];
            if (round > 0) {  // the running sum first: key order
              const float4 v = sum;
              sum = running[lane][i];
              add4(sum, v);
            }
#pragma unroll 1
            for (int other = 1; other < in_round; ++other) add4(sum, partial[first + other][lane][i]);
            if (last)
              store_out_quad(p, out_kind(p, false), out_row(p, token, head), 4 * (lane + 32 * i), sum);
            else
              running[lane][i] = sum;
          }
          if (last && p.lse != nullptr && j == 0 && lane == 0)
            p.lse[token * p.lse_stride_t + head * p.lse_stride_h] = lse;
        }
        __syncthreads();  // partial[] (and running[]) are free for the next round or job
      }
    } else {
      float4 acc[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
      float lse = -INFINITY;
      if (valid) {
        const int n = jr.unit.num_pieces;
        const float* lse_k = p.schedule.lse_at(jr.unit.slot_begin, row_local);
        const auto* base = reinterpret_cast<const typename Quad<Partial>::Raw*>(
            static_cast<const Partial*>(p.schedule.partial_out) +
            (int64_t(jr.unit.slot_begin) * kMaxBlockM + row_local) * kValueDim);
        // The warp's first step of pieces, in flight together with the LSE loads below: their
        // addresses do not depend on the row's LSE, only their weights do.
        PieceStep<Partial> st;
        load_step(base, lse_k, n, j, w, lane, st);
        float lse_max, lse_sum;
        row_lse(lse_k, n, lane, lse_max, lse_sum);
        if (lse_max != -INFINITY) {
          lse = lse_max + logf(lse_sum);
          MLA_COMBINE_STAMP(0);
#pragma unroll 1
          for (int k = j;;) {  // the step loaded, then the next one (add_step's code emitted once)
            add_step(st, lse, acc);
            if (k == j) MLA_COMBINE_STAMP(1);
            k += kUnroll * w;
            if (k >= n) break;
            load_step(base, lse_k, n, k, w, lane, st);
          }
          MLA_COMBINE_STAMP(2);
        }
      }
      // The row's w warps meet in shared memory; warp j then sums and stores column groups j,
      // j + w, ... (a loop that is not unrolled: the stores are emitted once).
#pragma unroll
      for (int i = 0; i < 4; ++i) partial[warp][lane][i] = acc[i];
      __syncthreads();
      MLA_COMBINE_STAMP(3);
      if (valid) {
        const int64_t token = g.q_start + r / num_heads;
        const int head = r % num_heads;
        void* row_base = out_row(p, token, head);
        const int first = warp - j;
#pragma unroll 1
        for (int i = j; i < 4; i += w) {
          float4 sum = partial[first][lane][i];
#pragma unroll 1
          for (int other = 1; other < w; ++other) add4(sum, partial[first + other][lane][i]);
          store_out_quad(p, out_kind(p, false), row_base, 4 * (lane + 32 * i), sum);
        }
        if (p.lse != nullptr && j == 0 && lane == 0) p.lse[token * p.lse_stride_t + head * p.lse_stride_h] = lse;
        MLA_COMBINE_STAMP(4);
      }
      __syncthreads();  // partial[] is free for the next job
    }
    jr = jr_next;
  }
#if defined(MLA_DECODE_TRACE) && MLA_DECODE_TRACE
  __syncthreads();
  if (threadIdx.x == 0 && blockIdx.x == 0) {
    const unsigned long long trace_end = globaltimer_ns();
    for (int c = 0; c < kDecodeTraceCtas && p.trace != nullptr; ++c) {
      unsigned long long* rec = p.trace + c * kDecodeTraceWords;
      if (rec[0] == 0) continue;  // no Hopper kernel ran before this combine, or not this CTA
      printf("DTRACE grid %d cta %llu items %llu/%llu t0 %llu |", int(gridDim.x) / 2, rec[kDecodeTraceWords - 3],
             rec[kDecodeTraceWords - 2], rec[kDecodeTraceWords - 1], rec[0]);
      for (int i = 1; i < kDecodeTraceStamps; ++i)
        printf(" %lld", rec[i] == 0 ? -1LL : (long long)(rec[i] - rec[0]));
      printf("\n");
      for (int i = 0; i < kDecodeTraceWords; ++i) rec[i] = 0;
    }
    for (int c = 0; c < kDecodeTraceGridCtas && p.trace != nullptr; ++c) {
      unsigned long long* w = p.trace + kDecodeTraceGrid + kDecodeTraceCtaWords * c;
      if (w[0] == 0) continue;
      printf("ETRACE %d %llu %llu %llu %llu %llu %llu %llu %llu %llu\n", c, w[0], w[1], w[2], w[3], w[4], w[5],
             w[6], w[7], w[8]);
      for (int i = 0; i < kDecodeTraceCtaWords; ++i) w[i] = 0;
    }
    auto rel = [&](unsigned long long t) { return t == 0 ? -1LL : (long long)(t - trace_entry); };
    printf("CTRACE grid %d cta 0 rows %d t0 %llu | %lld %lld %lld %lld %lld %lld %lld %lld %lld\n", int(gridDim.x),
           rows, trace_entry, rel(trace_waited), rel(trace_end), rel(trace_job[0]), rel(trace_job[1]),
           rel(trace_job[2]), rel(trace_job[3]), rel(trace_job[4]), rel(trace_probe[0]), rel(trace_probe[1]));
  }
#endif
#undef MLA_COMBINE_STAMP
}

// MlaDecodeArgs::zero_padding_rows: the query rows past cu_q_lens[B] (T * H rows of a batch
// padded to the query count it was captured for) written as rows that see no key, out 0 and lse
// -inf. Launched last in the call's chain as its dependent: it waits for the prior grids before
// it reads cu_q_lens[B] and stores, so its stores never race the attention's, also where bad
// lengths put a request's rows past cu_q_lens[B] (they end 0). One warp a (row, head), with a
// grid stride from cu_q_lens[B] * H (clamped to [0, T]); 16-byte stores where every row starts
// on a 16-byte boundary.
constexpr int kZeroThreads = 256;

__global__ void __launch_bounds__(kZeroThreads) mla_decode_zero_padding_rows_kernel(const __grid_constant__ DecodeParams p,
                                                                                     int vector_rows) {
  allow_dependent_launch();
  wait_for_prior_grids();
  const BatchLayout& l = p.layout;
  const int end = min(max(l.cu_q_lens[int64_t(l.batch_size) * l.cu_q_lens_stride], 0), l.num_tokens);
  const int64_t rows_end = int64_t(l.num_tokens) * l.num_heads;
  const int lane = int(threadIdx.x) % 32;
  const int64_t warps = int64_t(gridDim.x) * (kZeroThreads / 32);
  const int elem = partial_elem_bytes(p.out_dtype);
  for (int64_t r = int64_t(end) * l.num_heads + int64_t(blockIdx.x) * (kZeroThreads / 32) + threadIdx.x / 32;
       r < rows_end; r += warps) {
    const int64_t t = r / l.num_heads, h = r % l.num_heads;
    char* row = static_cast<char*>(p.out) + (t * p.out_stride_t + h * p.out_stride_h) * elem;
    if (vector_rows) {
      for (int i = lane; i < kValueDim * elem / 16; i += 32) reinterpret_cast<uint4*>(row)[i] = make_uint4(0, 0, 0, 0);
    } else if (elem == 4) {
      for (int i = lane; i < kValueDim; i += 32) reinterpret_cast<float*>(row)[i] = 0.0f;
    } else {
      for (int i = lane; i < kValueDim; i += 32) reinterpret_cast<unsigned short*>(row)[i] = 0;
    }
    if (p.lse != nullptr && lane == 0) p.lse[t * p.lse_stride_t + h * p.lse_stride_h] = -INFINITY;
  }
}

}  // namespace

namespace {
template <typename Partial>
void launch_combine(const DecodeParams& params, dim3 grid, cudaStream_t stream) {
  if (params.schedule.split_keys > 0)
    launch_dependent(mla_decode_combine_kernel<Partial, true>, grid, dim3(kThreadsPerCta), 0, stream, params);
  else
    launch_dependent(mla_decode_combine_kernel<Partial, false>, grid, dim3(kThreadsPerCta), 0, stream, params);
}
}  // namespace

void launch_combine_kernel(const DecodeParams& params, cudaStream_t stream) {
  const dim3 grid(unsigned(kCtasPerPart * params.schedule.num_parts));
  switch (params.out_dtype) {
    case kOutBF16:
      launch_combine<__nv_bfloat16>(params, grid, stream);
      break;
    case kOutFP16:
      launch_combine<__half>(params, grid, stream);
      break;
    default:
      launch_combine<float>(params, grid, stream);
      break;
  }
}

void launch_zero_padding_rows(const DecodeParams& params, cudaStream_t stream) {
  const int64_t elem = partial_elem_bytes(params.out_dtype);
  const int vector_rows = reinterpret_cast<uintptr_t>(params.out) % 16 == 0 &&
                          params.out_stride_t * elem % 16 == 0 && params.out_stride_h * elem % 16 == 0;
  // Enough warps for every row when none is in use, at most four CTAs an SM (a grid stride).
  const int64_t rows = int64_t(params.layout.num_tokens) * params.layout.num_heads;
  const int64_t warps_per_cta = kZeroThreads / 32;
  const int64_t ctas = std::min<int64_t>((rows + warps_per_cta - 1) / warps_per_cta,
                                         4 * int64_t(current_device_info().sm_count));
  launch_dependent(mla_decode_zero_padding_rows_kernel, dim3(unsigned(ctas)), dim3(kZeroThreads), 0, stream,
                   params, vector_rows);
}

}  // namespace mla::cuda::decode
