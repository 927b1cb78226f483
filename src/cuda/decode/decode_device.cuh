// Device helpers shared by the decode kernels (the portable mma.sync kernel and the Hopper
// wgmma kernel): exp2, 16-bit packing, output stores in the caller's dtype, and the L2 prefetch
// of cache rows ahead of their loads. The fp8 conversion is in cuda/common/fp8.cuh.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/fp8.cuh"
#include "cuda/common/warp_mma.cuh"
#include "cuda/decode/decode_params.cuh"

namespace mla::cuda::decode {

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat1622float2(*reinterpret_cast<__nv_bfloat162*>(&v));
  } else {
    return __half22float2(*reinterpret_cast<__half2*>(&v));
  }
}

template <typename T>
__device__ __forceinline__ T from_float(float v) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) return __float2bfloat16_rn(v);
  else return __float2half_rn(v);
}

// Writes out[col], out[col + 1] of one output row in the output dtype.
__device__ __forceinline__ void store_out_pair(const DecodeParams& p, void* row_base, int col,
                                               float v0, float v1) {
  switch (p.out_dtype) {
    case kOutBF16: {
      __nv_bfloat16* o = static_cast<__nv_bfloat16*>(row_base) + col;
      if (p.out_pair_ok) {
        *reinterpret_cast<__nv_bfloat162*>(o) = __floats2bfloat162_rn(v0, v1);
      } else {
        o[0] = __float2bfloat16_rn(v0);
        o[1] = __float2bfloat16_rn(v1);
      }
      break;
    }
    case kOutFP16: {
      __half* o = static_cast<__half*>(row_base) + col;
      if (p.out_pair_ok) {
        *reinterpret_cast<__half2*>(o) = __floats2half2_rn(v0, v1);
      } else {
        o[0] = __float2half_rn(v0);
        o[1] = __float2half_rn(v1);
      }
      break;
    }
    default: {
      float* o = static_cast<float*>(row_base) + col;
      if (p.out_pair_ok) {
        *reinterpret_cast<float2*>(o) = make_float2(v0, v1);
      } else {
        o[0] = v0;
        o[1] = v1;
      }
      break;
    }
  }
}

// How a decode kernel stores a row of its output or of a partial slot (which holds the output's
// dtype, partial_elem_bytes): 0 fp32 pairs, 1 / 2 bf16 / fp16 a whole 32-byte sector a quad
// (store_quad_sector), 3 element by element in the output dtype (an output whose rows are not
// aligned for those stores).
__device__ __forceinline__ int out_kind(const DecodeParams& p, bool partial) {
  if (!partial && !(p.out_dtype == kOutFP32 ? p.out_pair_ok : p.out_quad_ok)) return 3;
  return p.out_dtype == kOutBF16 ? 1 : p.out_dtype == kOutFP16 ? 2 : 0;
}

// Values col .. col + 3 of an output or partial row (col a multiple of 4) stored as `kind`
// (out_kind): one 8-byte store of a 16-bit row, two of an fp32 one, else element by element.
__device__ __forceinline__ void store_out_quad(const DecodeParams& p, int kind, void* row_base, int col,
                                               const float4& v) {
  if (kind == 1 || kind == 2) {
    const uint2 q = kind == 1 ? make_uint2(pack2<__nv_bfloat16>(v.x, v.y), pack2<__nv_bfloat16>(v.z, v.w))
                              : make_uint2(pack2<__half>(v.x, v.y), pack2<__half>(v.z, v.w));
    *reinterpret_cast<uint2*>(static_cast<uint16_t*>(row_base) + col) = q;
  } else if (kind == 0) {
    float2* dst = reinterpret_cast<float2*>(static_cast<float*>(row_base) + col);
    dst[0] = make_float2(v.x, v.y);
    dst[1] = make_float2(v.z, v.w);
  } else {
    store_out_pair(p, row_base, col, v.x, v.y);
    store_out_pair(p, row_base, col + 2, v.z, v.w);
  }
}

// Pairs n and n + 1 of a 16-bit row (packed pa, pb; columns col + 8 n, col + 8 n + 8, where col
// is the quad's first column + 2 (lane % 4), the first column a multiple of 4: 0 or 256 in the
// Hopper kernel, a multiple of 64 in the portable one) as one 8-byte store a lane: the quad's 16
// values are 32 contiguous bytes, one whole sector in one instruction instead of two half
// sectors. Even lanes keep their pair of n and take their odd neighbour's; odd lanes store both
// pairs of n + 1.
// Called by the whole warp (the shuffle takes every lane: in a divergent branch ptxas would
// serialise the kernel's wgmma), storing where `valid`.
__device__ __forceinline__ void store_quad_sector(uint16_t* dst, int col, int n, uint32_t pa, uint32_t pb,
                                                  bool valid) {
  const bool odd = (col >> 1) & 1;
  const uint32_t other = __shfl_xor_sync(0xffffffffu, odd ? pa : pb, 1);
  if (valid)
    *reinterpret_cast<uint2*>(dst + col + 8 * n + (odd ? 6 : 0)) = odd ? make_uint2(other, pb) : make_uint2(pa, other);
}

// Stores kPairs pairs of one row, pair n = get(n) * scale at columns col + 8 n, n + 1, as `kind`
// (out_kind), where `valid` (the whole warp calls it: kinds 1 and 2 shuffle within quads). Each
// kind's stores are emitted once, and kind 3 walks the pairs in a loop that is
// not unrolled (`get` may then be asked for pair 0 only, after `rotate` moved pair n + 1 into
// pair n): this code runs once per item from a cold instruction cache, so its size matters.
template <int kPairs, typename Get, typename Rotate>
__device__ __forceinline__ void store_row_pairs(const DecodeParams& p, int kind, void* base, int col,
                                                float scale, bool valid, Get get, Rotate rotate) {
  if (kind == 0) {
    float* dst = static_cast<float*>(base) + col;
#pragma unroll
    for (int n = 0; n < kPairs; ++n) {
      const float2 v = get(n);
      if (valid) *reinterpret_cast<float2*>(dst + n * 8) = make_float2(v.x * scale, v.y * scale);
    }
  } else if (kind == 1 || kind == 2) {
    static_assert(kPairs % 2 == 0, "16-bit rows are stored two pairs a step");
    uint16_t* dst = static_cast<uint16_t*>(base);
    const bool bf16 = kind == 1;  // one loop for both (code size): a select of two conversions
#pragma unroll
    for (int n = 0; n < kPairs; n += 2) {
      const float2 a = get(n), b = get(n + 1);
      const float ax = a.x * scale, ay = a.y * scale, bx = b.x * scale, by = b.y * scale;
      store_quad_sector(dst, col, n, bf16 ? pack2<__nv_bfloat16>(ax, ay) : pack2<__half>(ax, ay),
                        bf16 ? pack2<__nv_bfloat16>(bx, by) : pack2<__half>(bx, by), valid);
    }
  } else if (valid) {
#pragma unroll 1
    for (int n = 0; n < kPairs; ++n) {
      const float2 v = get(0);
      store_out_pair(p, base, col + n * 8, v.x * scale, v.y * scale);
      rotate();
    }
  }
}

// The q_nope and q_pe rows of flattened query row r (token r / H, head r % H) of the request
// whose first token is q_start; chunk(c) is the source of 16-byte chunk c of the row's 576
// values (chunks 0..63 from q_nope, 64..71 from q_pe).
template <typename T>
struct QRow {
  const T* nope;
  const T* pe;
  __device__ __forceinline__ const T* chunk(int c) const {
    return c < kValueDim / 8 ? nope + c * 8 : pe + (c - kValueDim / 8) * 8;
  }
};
template <typename T>
__device__ __forceinline__ QRow<T> q_row(const DecodeParams& p, int64_t q_start, int r) {
  const int num_heads = p.layout.num_heads;
  const int64_t token = q_start + r / num_heads;
  const int head = r % num_heads;
  return {static_cast<const T*>(p.q_nope) + token * p.q_nope_stride_t + head * p.q_nope_stride_h,
          static_cast<const T*>(p.q_pe) + token * p.q_pe_stride_t + head * p.q_pe_stride_h};
}

// Cache slot (page * page_size + offset in the page) of key `key` of `request`, or -1 when the
// key is at or past kv_end or its page id is not a page of the pool (such keys are read as
// zeros, or skipped).
__device__ __forceinline__ int64_t cache_slot(const DecodeParams& p, int request, int key, int kv_end) {
  if (key >= kv_end) return -1;
  const int page = p.block_table[int64_t(request) * p.block_table_stride_b +
                                 int64_t(key >> p.page_shift) * p.block_table_stride_j];
  if (page < 0 || page >= p.num_pages) return -1;
  return (int64_t(page) << p.page_shift) | (key & ((1 << p.page_shift) - 1));
}

// Asks L2 for the cache rows of keys [key, key + count) of `request`, which must lie in one page
// (its rows are contiguous); keys at or past kv_end and pages outside the pool are skipped. The
// loads of those keys a tile or two later then wait for L2 rather than for memory, and each SM
// keeps more bytes in flight than its shared-memory stages hold.
__device__ __forceinline__ void prefetch_keys_l2(const DecodeParams& p, int request, int key, int count,
                                                 int kv_end) {
  const int64_t slot = cache_slot(p, request, key, kv_end);
  if (slot < 0) return;
  if (count > kv_end - key) count = kv_end - key;
  const int64_t row_bytes = p.kv_is_fp8 ? kHeadDim : kHeadDim * 2;
  prefetch_l2(static_cast<const char*>(p.kv_cache) + slot * row_bytes, uint32_t(count * row_bytes));
}

// Address of output row (token, head), as bytes.
__device__ __forceinline__ void* out_row(const DecodeParams& p, int64_t token, int head) {
  const int64_t elem = p.out_dtype == kOutFP32 ? 4 : 2;
  return static_cast<char*>(p.out) + (token * p.out_stride_t + head * p.out_stride_h) * elem;
}

// Natural-log LSE of a row from its max m (exp2 domain) and its sum of exp2(s - m): -inf for a
// row that saw no key (sum 0), NaN for a NaN sum (a NaN in the row's query or in a key it sees:
// the row's output is NaN too, and the combine keeps both NaN, as the CPU implementation does).
__device__ __forceinline__ float row_lse(float m, float sum) {
  return sum > 0.0f ? (m + log2f(sum)) * 0.69314718055994531f : sum == 0.0f ? -INFINITY : sum;
}

// Where row rl of an item's tile goes: for a piece of a split unit (slot >= 0) its normalised
// row (in the output's dtype) and LSE in the workspace, else the output row and the caller's LSE
// (null when none was asked for).
struct RowDst {
  void* out;
  float* lse;
};
__device__ __forceinline__ RowDst row_dst(const DecodeParams& p, int slot, const ItemRange& r, int rl) {
  if (slot >= 0) {
    const int64_t slot_row = int64_t(slot) * kMaxBlockM + rl;
    return {static_cast<char*>(p.schedule.partial_out) + slot_row * kValueDim * partial_elem_bytes(p.out_dtype),
            p.schedule.lse_at(slot, rl)};
  }
  const int row = r.row0 + rl;
  const int64_t token = r.g.q_start + row / p.layout.num_heads;
  const int head = row % p.layout.num_heads;
  float* lse = p.lse != nullptr ? p.lse + token * p.lse_stride_t + head * p.lse_stride_h : nullptr;
  return {out_row(p, token, head), lse};
}

}  // namespace mla::cuda::decode
