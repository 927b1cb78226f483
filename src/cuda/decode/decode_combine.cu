// mla_decode combine kernel: merges the pieces of each split unit (row tile whose keys were
// divided among several CTAs) by their LSE.
//
// For each row: lse = ln(sum_k exp(lse_k)), out = sum_k exp(lse_k - lse) * out_k, where out_k is
// piece k's normalised output (already scaled by k_scale). Pieces whose rows saw no key have
// lse_k = -inf and weigh nothing; a row with no key in any piece gets out 0 and lse -inf.
//
// Grid: (num_parts, ceil(block_m / 2)): x = split unit x lane (CTAs past the planned count exit at once,
// so the grid is fixed and graph-capturable), y = pair of rows. Each row gets 4 warps; warp j of
// a row sums pieces j, j + 4, ... (4 pieces per step, so 16 independent 16-byte loads per lane
// are in flight), each lane owning 16 of the 512 columns; the 4 partial sums meet in shared
// memory. A long request split over ~130 CTAs thus costs ~8 memory round trips, not ~130.
//
// Version history: v1 one warp per row, one piece per step (latency-bound: ~45 us for one 32k
// request with 16 heads on an H200); v2 four warps per row, four pieces per step.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cmath>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/decode/decode_launch.hpp"

namespace mla::cuda::decode {
namespace {

constexpr int kWarpsPerRow = 4;
constexpr int kRowsPerCta = 2;
constexpr int kThreadsPerCta = kWarpsPerRow * kRowsPerCta * 32;
constexpr int kUnroll = 4;  // pieces per step of one warp

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
  __shared__ float4 partial[kThreadsPerCta / 32][32][4];  // per warp: its lanes' 16 columns
  wait_for_prior_grids();  // the decode kernel's partial results are written
  const ScheduleHeader& header = *p.schedule.header;
  // Job x: split unit x / lanes, row tile (lane) x % lanes, its slots offset by the lane.
  if (int(blockIdx.x) >= header.num_split_units * header.lanes) return;
  SplitUnit unit = p.schedule.split_units[int(blockIdx.x) / header.lanes];
  if (header.lanes > 1) {
    const int lane = int(blockIdx.x) % header.lanes;
    unit.row_tile = lane;
    unit.slot_begin += lane * header.num_slots;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int row_in_cta = warp / kWarpsPerRow, j = warp % kWarpsPerRow;
  const int block_m = header.block_m;
  const int row_local = int(blockIdx.y) * kRowsPerCta + row_in_cta;
  const int num_heads = p.layout.num_heads;
  const RequestGeometry g = request_geometry(p.layout, unit.request);
  const int r = unit.row_tile * block_m + row_local;
  const bool valid = row_local < block_m && r < g.q_len * num_heads;  // same for a row's 4 warps

  float4 acc[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) acc[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
  float lse = -INFINITY;
  const int n = unit.num_pieces;
  const float* lse_k = p.schedule.partial_lse + int64_t(unit.slot_begin) * kMaxBlockM + row_local;
  if (valid) {
    float lse_max = -INFINITY;
    for (int k = lane; k < n; k += 32) lse_max = fmaxf(lse_max, lse_k[int64_t(k) * kMaxBlockM]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) lse_max = fmaxf(lse_max, __shfl_xor_sync(0xffffffffu, lse_max, off));
    if (lse_max != -INFINITY) {
      float sum = 0.0f;
      for (int k = lane; k < n; k += 32) sum += expf(lse_k[int64_t(k) * kMaxBlockM] - lse_max);
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, off);
      lse = lse_max + logf(sum);
      const float4* base = reinterpret_cast<const float4*>(
          p.schedule.partial_out + (int64_t(unit.slot_begin) * kMaxBlockM + row_local) * kValueDim);
      constexpr int64_t kSlotStride4 = int64_t(kMaxBlockM) * kValueDim / 4;  // float4 per slot
      int k = j;
      for (; k + (kUnroll - 1) * kWarpsPerRow < n; k += kUnroll * kWarpsPerRow) {
        float w[kUnroll];
        float4 v[kUnroll][4];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          const int piece = k + u * kWarpsPerRow;
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
      for (; k < n; k += kWarpsPerRow) {
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
  }
#pragma unroll
  for (int i = 0; i < 4; ++i) partial[warp][lane][i] = acc[i];
  __syncthreads();
  if (!valid || j != 0) return;
#pragma unroll
  for (int i = 0; i < 4; ++i) {
#pragma unroll
    for (int other = 1; other < kWarpsPerRow; ++other) {
      const float4 v = partial[warp + other][lane][i];
      acc[i].x += v.x;
      acc[i].y += v.y;
      acc[i].z += v.z;
      acc[i].w += v.w;
    }
  }
  const int64_t token = g.q_start + r / num_heads;
  const int head = r % num_heads;
  const int64_t elem = p.out_dtype == kOutFP32 ? 4 : 2;
  void* row_base = static_cast<char*>(p.out) + (token * p.out_stride_t + head * p.out_stride_h) * elem;
#pragma unroll
  for (int i = 0; i < 4; ++i) store_out4(p, row_base, 4 * (lane + 32 * i), acc[i]);
  if (p.lse != nullptr && lane == 0) p.lse[token * p.lse_stride_t + head * p.lse_stride_h] = lse;
}

}  // namespace

void launch_combine_kernel(const DecodeParams& params, int block_m, cudaStream_t stream) {
  const dim3 grid(unsigned(params.schedule.num_parts), unsigned((block_m + kRowsPerCta - 1) / kRowsPerCta));
  launch_dependent(mla_decode_combine_kernel, grid, dim3(kThreadsPerCta), 0, stream, params);
}

}  // namespace mla::cuda::decode
