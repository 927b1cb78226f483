// mla_decode combine kernel: merges the pieces of each split unit (row tile whose keys were
// divided among several CTAs) by their LSE.
//
// For each row: lse = ln(sum_k exp(lse_k)), out = sum_k exp(lse_k - lse) * out_k, where out_k is
// piece k's normalised output (already scaled by k_scale). Pieces whose rows saw no key have
// lse_k = -inf and weigh nothing; a row with no key in any piece gets out 0 and lse -inf.
//
// Grid: a fixed kCtasPerPart x num_parts CTAs (one resident wave; graph-capturable, since the
// number of split units is only known on the device), walking the jobs with a grid stride. A
// job is kWarps / W rows, W warps per row, where W (1, 2, 4 or 8) follows the plan's largest
// piece count: warp j of a row sums pieces j, j + W, ... (4 pieces per step, so 16 independent
// 16-byte loads per lane are in flight), each lane owning 16 of the 512 columns, and the W
// partial sums meet in shared memory, where warp j sums and stores column groups j, j + W, ...
// The row's LSE takes one pass over the pieces' LSEs (running max and sum together). A request
// split over ~130 CTAs costs ~6 memory round trips; a large batch of units in two or three
// pieces gives each row one warp and two round trips.
//
// Version history: v1 one warp per row, one piece per step (latency-bound: ~45 us for one 32k
// request with 16 heads on an H200); v2 four warps per row, four pieces per step, two passes for
// the LSE, one CTA per (split unit, row pair) in a fixed grid of mostly idle CTAs; v3 W warps
// per row from the plan's largest piece count, one LSE pass, grid-stride over the rows; v4 the
// LSEs of up to 128 pieces in one round trip, and the row's warps share the final sum and the
// stores (code 32 -> 16 KB: this kernel runs once per decode call, from a cold instruction cache).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/decode/decode_launch.hpp"

namespace mla::cuda::decode {
namespace {

constexpr int kWarps = 8;
constexpr int kThreadsPerCta = kWarps * 32;
constexpr int kUnroll = 4;       // pieces per step of one warp
constexpr int kCtasPerPart = 4;  // combine CTAs per decode CTA: 4 x 256 threads fill an SM

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

// Sum over the split unit's pieces of exp(lse_k - lse) * out_k for columns 4 (lane + 32 i) of
// this warp's pieces j, j + stride, ... (stride: the row's warps)
__device__ __forceinline__ void sum_pieces(const float4* base, const float* lse_k, int n, int j,
                                           int stride, int lane, float lse, float4 (&acc)[4]) {
  constexpr int64_t kSlotStride4 = int64_t(kMaxBlockM) * kValueDim / 4;  // float4 per slot
  int k = j;
  for (; k + (kUnroll - 1) * stride < n; k += kUnroll * stride) {
    float w[kUnroll];
    float4 v[kUnroll][4];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int piece = k + u * stride;
      w[u] = lse_k[int64_t(piece) * kMaxBlockM];
#pragma unroll
      for (int i = 0; i < 4; ++i) v[u][i] = base[piece * kSlotStride4 + lane + 32 * i];
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const float wu = expf(w[u] - lse);  // 0 for an empty piece
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        acc[i].x += wu * v[u][i].x;
        acc[i].y += wu * v[u][i].y;
        acc[i].z += wu * v[u][i].z;
        acc[i].w += wu * v[u][i].w;
      }
    }
  }
  for (; k < n; k += stride) {
    const float wu = expf(lse_k[int64_t(k) * kMaxBlockM] - lse);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float4 v = base[k * kSlotStride4 + lane + 32 * i];
      acc[i].x += wu * v.x;
      acc[i].y += wu * v.y;
      acc[i].z += wu * v.z;
      acc[i].w += wu * v.w;
    }
  }
}

__device__ __forceinline__ void store_out4(const DecodeParams& p, void* row_base, int col,
                                           const float4& v) {
  switch (p.out_dtype) {
    case kOutBF16: {
      __nv_bfloat16* o = static_cast<__nv_bfloat16*>(row_base) + col;
      if (p.out_pair_ok) {
        reinterpret_cast<__nv_bfloat162*>(o)[0] = __floats2bfloat162_rn(v.x, v.y);
        reinterpret_cast<__nv_bfloat162*>(o)[1] = __floats2bfloat162_rn(v.z, v.w);
      } else {
        o[0] = __float2bfloat16_rn(v.x);
        o[1] = __float2bfloat16_rn(v.y);
        o[2] = __float2bfloat16_rn(v.z);
        o[3] = __float2bfloat16_rn(v.w);
      }
      break;
    }
    case kOutFP16: {
      __half* o = static_cast<__half*>(row_base) + col;
      if (p.out_pair_ok) {
        reinterpret_cast<__half2*>(o)[0] = __floats2half2_rn(v.x, v.y);
        reinterpret_cast<__half2*>(o)[1] = __floats2half2_rn(v.z, v.w);
      } else {
        o[0] = __float2half_rn(v.x);
        o[1] = __float2half_rn(v.y);
        o[2] = __float2half_rn(v.z);
        o[3] = __float2half_rn(v.w);
      }
      break;
    }
    default: {
      float* o = static_cast<float*>(row_base) + col;
      if (p.out_pair_ok) {
        reinterpret_cast<float2*>(o)[0] = make_float2(v.x, v.y);
        reinterpret_cast<float2*>(o)[1] = make_float2(v.z, v.w);
      } else {
        o[0] = v.x;
        o[1] = v.y;
        o[2] = v.z;
        o[3] = v.w;
      }
      break;
    }
  }
}

__global__ void __launch_bounds__(kThreadsPerCta)
    mla_decode_combine_kernel(const __grid_constant__ DecodeParams p) {
  __shared__ float4 partial[kWarps][32][4];  // per warp: its lanes' 16 columns
  wait_for_prior_grids();  // the decode kernel's partial results are written
  const ScheduleHeader& header = *p.schedule.header;
  const int block_m = header.block_m;
  const int rows = header.num_split_units * header.lanes * block_m;
  const int w = warps_per_row(header.max_pieces);
  const int rows_per_job = kWarps / w;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int j = warp % w;  // this warp's place among its row's warps
  const int num_heads = p.layout.num_heads;
  for (int job = int(blockIdx.x); job * rows_per_job < rows; job += int(gridDim.x)) {
    // Row gr: split unit x lane u = gr / block_m (unit u / lanes, row tile u % lanes with its
    // slots offset by the lane), row row_local of the tile.
    const int gr = job * rows_per_job + warp / w;
    const int u = gr / block_m, row_local = gr - u * block_m;
    bool valid = gr < rows;
    SplitUnit unit{};
    RequestGeometry g{};
    int r = 0;
    if (valid) {
      unit = p.schedule.split_units[u / header.lanes];
      if (header.lanes > 1) {
        const int tile_lane = u % header.lanes;
        unit.row_tile = tile_lane;
        unit.slot_begin += tile_lane * header.num_slots;
      }
      g = request_geometry(p.layout, unit.request);
      r = unit.row_tile * block_m + row_local;
      valid = r < g.q_len * num_heads;  // same for a row's warps
    }
    float4 acc[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float lse = -INFINITY;
    if (valid) {
      const int n = unit.num_pieces;
      const float* lse_k = p.schedule.partial_lse + int64_t(unit.slot_begin) * kMaxBlockM + row_local;
      float lse_max = -INFINITY, lse_sum = 0.0f;
      for (int k0 = 0; k0 < n; k0 += 4 * 32) {  // up to 128 pieces a round trip
        float v[4];
#pragma unroll
        for (int u = 0; u < 4; ++u) {
          const int k = k0 + lane + 32 * u;
          v[u] = k < n ? lse_k[int64_t(k) * kMaxBlockM] : -INFINITY;
        }
#pragma unroll
        for (int u = 0; u < 4; ++u) merge_lse(lse_max, lse_sum, v[u], 1.0f);
      }
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) {
        const float other_max = __shfl_xor_sync(0xffffffffu, lse_max, off);
        const float other_sum = __shfl_xor_sync(0xffffffffu, lse_sum, off);
        merge_lse(lse_max, lse_sum, other_max, other_sum);
      }
      if (lse_max != -INFINITY) {
        lse = lse_max + logf(lse_sum);
        const float4* base = reinterpret_cast<const float4*>(
            p.schedule.partial_out + (int64_t(unit.slot_begin) * kMaxBlockM + row_local) * kValueDim);
        sum_pieces(base, lse_k, n, j, w, lane, lse, acc);
      }
    }
    // The row's w warps meet in shared memory; warp j then sums and stores column groups j,
    // j + w, ... (a loop that is not unrolled: the stores are emitted once).
#pragma unroll
    for (int i = 0; i < 4; ++i) partial[warp][lane][i] = acc[i];
    __syncthreads();
    if (valid) {
      const int64_t token = g.q_start + r / num_heads;
      const int head = r % num_heads;
      const int64_t elem = p.out_dtype == kOutFP32 ? 4 : 2;
      void* row_base = static_cast<char*>(p.out) + (token * p.out_stride_t + head * p.out_stride_h) * elem;
      const int first = warp - j;
#pragma unroll 1
      for (int i = j; i < 4; i += w) {
        float4 sum = partial[first][lane][i];
#pragma unroll 1
        for (int other = 1; other < w; ++other) {
          const float4 v = partial[first + other][lane][i];
          sum.x += v.x;
          sum.y += v.y;
          sum.z += v.z;
          sum.w += v.w;
        }
        store_out4(p, row_base, 4 * (lane + 32 * i), sum);
      }
      if (p.lse != nullptr && j == 0 && lane == 0) p.lse[token * p.lse_stride_t + head * p.lse_stride_h] = lse;
    }
    __syncthreads();  // partial[] is free for the next job
  }
}

}  // namespace

void launch_combine_kernel(const DecodeParams& params, cudaStream_t stream) {
  const dim3 grid(unsigned(kCtasPerPart * params.schedule.num_parts));
  launch_dependent(mla_decode_combine_kernel, grid, dim3(kThreadsPerCta), 0, stream, params);
}

}  // namespace mla::cuda::decode
