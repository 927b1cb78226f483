// fp8 e4m3 -> 16-bit conversion shared by the decode and prefill kernels.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/warp_mma.cuh"

namespace mla::cuda {

// Two halves (one word) -> two values of T, packed.
template <typename T>
__device__ __forceinline__ uint32_t from_half2(uint32_t h) {
  if constexpr (std::is_same_v<T, __half>) {
    return h;
  } else {
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    return pack2<T>(f.x, f.y);
  }
}

// Two fp8 e4m3 values (low byte first) -> two values of T, packed. Exact: every e4m3 value is
// representable in bf16 and in fp16.
template <typename T>
__device__ __forceinline__ uint32_t fp8x2_to(uint32_t two) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(two), __NV_E4M3);
  return from_half2<T>(uint32_t(h.x) | (uint32_t(h.y) << 16));
}

// 16 fp8 values -> 16 values of T in two 16-byte chunks. On sm_89 and newer each word's upper pair
// is converted from the word's upper half as it stands (F2FP ... R.H1) rather than after a shift:
// one instruction fewer a word.
template <typename T>
__device__ __forceinline__ void fp8x16_to(const uint4& raw, uint4& lo, uint4& hi) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
  const auto four = [](uint32_t w, uint32_t& a, uint32_t& b) {
    asm("{\n .reg .b16 lo, hi;\n mov.b32 {lo, hi}, %2;\n cvt.rn.f16x2.e4m3x2 %0, lo;\n cvt.rn.f16x2.e4m3x2 %1, hi;\n}\n"
        : "=r"(a), "=r"(b)
        : "r"(w));
    a = from_half2<T>(a);
    b = from_half2<T>(b);
  };
  four(raw.x, lo.x, lo.y);
  four(raw.y, lo.z, lo.w);
  four(raw.z, hi.x, hi.y);
  four(raw.w, hi.z, hi.w);
#else
  lo.x = fp8x2_to<T>(raw.x & 0xffff);
  lo.y = fp8x2_to<T>(raw.x >> 16);
  lo.z = fp8x2_to<T>(raw.y & 0xffff);
  lo.w = fp8x2_to<T>(raw.y >> 16);
  hi.x = fp8x2_to<T>(raw.z & 0xffff);
  hi.y = fp8x2_to<T>(raw.z >> 16);
  hi.z = fp8x2_to<T>(raw.w & 0xffff);
  hi.w = fp8x2_to<T>(raw.w >> 16);
#endif
}

}  // namespace mla::cuda
