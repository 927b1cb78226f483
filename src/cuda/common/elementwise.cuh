// Building blocks for the memory-bound element-wise kernels (append_latent_kv, rope_quantize,
// merge_states): element types per DType, conversions bit-exact with the CPU path, 16-byte
// vectorised chunk loads/stores with a scalar fallback, index loads, and the host-side launch
// helpers (alignment test, dtype dispatch, grid size; the device guard is in cuda_check.hpp).
//
// Conversions (identical to mla/dtype.hpp on the CPU):
//   float -> bf16  __float2bfloat16_rn        float -> fp16  __float2half_rn
//   float -> fp8   __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)  (±448 saturation)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "cuda/cuda_check.hpp"
#include "mla/tensor.hpp"

namespace mla::cuda {

// ---- element types ---------------------------------------------------------------------------
struct fp8_e4m3 {  // storage of one fp8 e4m3 value (__nv_fp8_storage_t)
  __nv_fp8_storage_t bits;
};

template <typename T>
__device__ __forceinline__ float to_float(T x);
template <>
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
template <>
__device__ __forceinline__ float to_float(float x) { return x; }
template <>
__device__ __forceinline__ float to_float(fp8_e4m3 x) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(x.bits, __NV_E4M3)));
}

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
template <>
__device__ __forceinline__ __half from_float(float x) { return __float2half_rn(x); }
template <>
__device__ __forceinline__ float from_float(float x) { return x; }
template <>
__device__ __forceinline__ fp8_e4m3 from_float(float x) {
  return fp8_e4m3{__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)};
}

template <typename T>
inline constexpr bool kIsFp8 = std::is_same_v<T, fp8_e4m3>;

// ---- chunk loads / stores --------------------------------------------------------------------
// N consecutive elements starting at p. With `vectorised`, p must be 16-byte aligned and
// N * sizeof(T) a multiple of 16: the chunk moves as N * sizeof(T) / 16 16-byte transactions.
// kReadOnly: through the read-only data cache (ld.global.nc), for memory no thread of the kernel
// writes; false for a kernel that may write what it reads (merge_states in place).
template <typename T, int N, bool kReadOnly = true>
__device__ __forceinline__ void load_chunk(const T* p, bool vectorised, float (&out)[N]) {
  if constexpr ((N * sizeof(T)) % 16 == 0) {
    if (vectorised) {
      constexpr int kPerVec = 16 / sizeof(T);
#pragma unroll
      for (int v = 0; v < N / kPerVec; ++v) {
        const uint4* src = reinterpret_cast<const uint4*>(p) + v;
        const uint4 raw = kReadOnly ? __ldg(src) : *src;
        T elems[kPerVec];
        memcpy(elems, &raw, sizeof(raw));  // type pun without aliasing UB; compiles to moves
#pragma unroll
        for (int k = 0; k < kPerVec; ++k) out[v * kPerVec + k] = to_float(elems[k]);
      }
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) out[k] = to_float(p[k]);
}

template <typename T, int N>
__device__ __forceinline__ void store_chunk(T* p, bool vectorised, const float (&in)[N]) {
  if constexpr ((N * sizeof(T)) % 16 == 0) {
    if (vectorised) {
      constexpr int kPerVec = 16 / sizeof(T);
#pragma unroll
      for (int v = 0; v < N / kPerVec; ++v) {
        T elems[kPerVec];
#pragma unroll
        for (int k = 0; k < kPerVec; ++k) elems[k] = from_float<T>(in[v * kPerVec + k]);
        uint4 raw;
        memcpy(&raw, elems, sizeof(raw));
        reinterpret_cast<uint4*>(p)[v] = raw;
      }
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < N; ++k) p[k] = from_float<T>(in[k]);
}

// Element i of a 1-D int32 or int64 index tensor with element stride `stride`.
__device__ __forceinline__ int64_t load_index(const void* p, bool is_int64, int64_t stride,
                                              int64_t i) {
  return is_int64 ? __ldg(static_cast<const long long*>(p) + i * stride)
                  : int64_t(__ldg(static_cast<const int*>(p) + i * stride));
}

// ---- host-side helpers -----------------------------------------------------------------------


// True when every row of `t` (the last dim) starts on a 16-byte boundary: the base pointer and
// every outer stride (of dims with extent > 1) are multiples of 16 bytes.
inline bool rows_aligned16(const TensorView& t) {
  if (t.empty()) return true;
  if (reinterpret_cast<uintptr_t>(t.data) % 16 != 0) return false;
  const int64_t elem = int64_t(dtype_size(t.dtype));
  for (int d = 0; d + 1 < t.ndim; ++d)
    if (t.shape[d] > 1 && (t.stride[d] * elem) % 16 != 0) return false;
  return true;
}

// Calls fn(T{}) with the storage type of `dtype`, from the closed list of float dtypes.
template <typename Fn>
void dispatch_float_dtype(const char* op, const char* arg, DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kBF16: fn(__nv_bfloat16{}); return;
    case DType::kFP16: fn(__half{}); return;
    case DType::kFP32: fn(float{}); return;
    case DType::kFP8E4M3: fn(fp8_e4m3{}); return;
    default: MLA_FAIL(op, ": ", arg, " has unsupported dtype ", dtype_name(dtype));
  }
}

// Blocks for a grid-stride loop over `work_items` items of `threads_per_item` threads: enough to
// fill the device several times over, never more than the work needs.
inline unsigned grid_blocks(int64_t work_items, int64_t threads_per_item, int block_threads) {
  const int64_t needed = (work_items * threads_per_item + block_threads - 1) / block_threads;
  const int64_t cap = int64_t(current_device_info().sm_count) * 16;
  return unsigned(std::max<int64_t>(1, std::min(needed, cap)));
}

}  // namespace mla::cuda
