// Thin wrappers over the SM80+ warp-level tensor-core and async-copy instructions, shared by the
// mma.sync attention kernels (the fallback path for every GPU from sm_80 up).
//
//   mma_m16n8k16<T>   D[16x8] += A[16x16] * B[16x8], A row-major, B column-major, fp32 accumulate
//   ldmatrix_x4(_trans) four 8x8 b16 matrices from shared memory into a warp's fragments
//   cp_async_16       16-byte global -> shared copy (cp.async.cg), optionally zero-filled
//   prefetch_l2       asks L2 to fetch a byte range ahead of its use, without waiting
//
// Fragment layouts follow the PTX ISA "Matrix Fragments for mma.m16n8k16" tables: for the
// accumulator, lane l holds rows (l/4) and (l/4 + 8), columns 2*(l%4) and 2*(l%4)+1.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>

namespace mla::cuda {

template <typename T>
struct MmaType;
template <>
struct MmaType<__nv_bfloat16> {
  static constexpr const char* name = "bf16";
};
template <>
struct MmaType<__half> {
  static constexpr const char* name = "f16";
};

// D += A * B with A: 4 x b32 registers (8 b16), B: 2 x b32, C/D: 4 floats.
template <typename T>
__device__ __forceinline__ void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4],
                                             const uint32_t (&b)[2]) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
}

__device__ __forceinline__ uint32_t smem_addr(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Each lane passes the address of one 16-byte row: lanes 8i..8i+7 address the rows of matrix i.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem_row)));
}
__device__ __forceinline__ void ldmatrix_x2_trans(uint32_t (&r)[2], const void* smem_row) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];\n"
               : "=r"(r[0]), "=r"(r[1])
               : "r"(smem_addr(smem_row)));
}

// 16-byte async copy; when `valid` is false the destination is filled with zeros and the source
// is not read (src must still be a valid-looking address; pass any in-bounds pointer).
__device__ __forceinline__ void cp_async_16(void* smem_dst, const void* gmem_src, bool valid = true) {
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(smem_dst)),
               "l"(gmem_src), "r"(src_bytes));
}
// Asks L2 to fetch [ptr, ptr + bytes) without waiting for it: one bulk prefetch on sm_90 (ptr
// 16-byte aligned, bytes a multiple of 16), one prefetch per 128-byte line before.
__device__ __forceinline__ void prefetch_l2(const void* ptr, uint32_t bytes) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(ptr), "r"(bytes) : "memory");
#else
  for (uint32_t off = 0; off < bytes; off += 128)
    asm volatile("prefetch.global.L2 [%0];\n" ::"l"(static_cast<const char*>(ptr) + off));
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

// Packs two floats into one b32 register of two b16 values (low = first).
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&v);
  }
}

}  // namespace mla::cuda
