// Device helpers shared by the decode kernels (the portable mma.sync kernel and the Hopper
// wgmma kernel): exp2, 16-bit packing, and output stores in the caller's dtype.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

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

// Address of output row (token, head), as bytes.
__device__ __forceinline__ void* out_row(const DecodeParams& p, int64_t token, int head) {
  const int64_t elem = p.out_dtype == kOutFP32 ? 4 : 2;
  return static_cast<char*>(p.out) + (token * p.out_stride_t + head * p.out_stride_h) * elem;
}

}  // namespace mla::cuda::decode
