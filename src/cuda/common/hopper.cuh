// The thin layer over sm_90a features used by the Hopper kernels: warpgroup MMA (CuTe's GMMA
// atoms), shared-memory matrix descriptors for 128-byte swizzled tiles, named barriers, async-proxy
// fences and register reallocation. Everything else in the kernels is plain CUDA C++.
//
// Tiles: every operand tile lives in shared memory as boxes of 64 rows x 128 bytes (64 16-bit
// values), 1024-byte aligned, in the 128-byte swizzle that TMA writes (SWIZZLE_128B): the 16-byte
// chunk c of row r sits at r * 128 + ((c ^ (r % 8)) * 16). Such a box is at once
//   - a K-major operand (rows = M or N, the 64 values of a row along K): descriptor
//     k_major_desc(box + k * 32) for the k-th 16-wide slice (k = 0..3);
//   - an MN-major operand (rows = K, the 64 values of a row along N), N spanning consecutive
//     boxes: descriptor mn_major_desc(box + k * 16 * 128, box_stride) for keys [16k, 16k + 16).
#pragma once

#include <cstdint>
#include <utility>

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define MLA_SM90A_DEVICE 1
#endif

#include <cute/arch/mma_sm90_desc.hpp>
#include <cute/arch/mma_sm90_gmma.hpp>

namespace mla::cuda::sm90 {

namespace gmma = cute::SM90::GMMA;

__device__ __forceinline__ uint32_t smem_u32(const void* ptr) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(ptr));
}

// Descriptor of a K-major 128B-swizzled operand starting at shared address `addr`: 8-row groups
// 1024 bytes apart (the leading offset is unused in this mode).
__device__ __forceinline__ uint64_t k_major_desc(uint32_t addr) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>((addr & 0x3FFFF) >> 4);
  d.bitfield.leading_byte_offset_ = 1;
  d.bitfield.stride_byte_offset_ = 1024 >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = uint8_t(gmma::LayoutType::B128);
  return d.desc_;
}

// Descriptor of an MN-major 128B-swizzled operand: 64-wide MN blocks `mn_stride` bytes apart,
// 8-row K groups 1024 bytes apart.
__device__ __forceinline__ uint64_t mn_major_desc(uint32_t addr, uint32_t mn_stride) {
  cute::GmmaDescriptor d;
  d.bitfield.start_address_ = static_cast<uint16_t>((addr & 0x3FFFF) >> 4);
  d.bitfield.leading_byte_offset_ = static_cast<uint16_t>(mn_stride >> 4);
  d.bitfield.stride_byte_offset_ = 1024 >> 4;
  d.bitfield.base_offset_ = 0;
  d.bitfield.layout_type_ = uint8_t(gmma::LayoutType::B128);
  return d.desc_;
}

// The descriptor of the operand `bytes` (a multiple of 16) further on: only the start address
// field (bits 0-13, address / 16) changes, and shared addresses stay below 256 KB, so the sum
// never carries out of it. One 32-bit add instead of rebuilding the descriptor per wgmma.
__device__ __forceinline__ uint64_t desc_advance(uint64_t desc, uint32_t bytes) {
  const uint32_t lo = static_cast<uint32_t>(desc) + (bytes >> 4);
  return (desc & 0xFFFFFFFF00000000ull) | lo;
}

// Byte offset of 16-bit element (row, col) in a swizzled box of 64-value rows.
__device__ __forceinline__ uint32_t swizzled_offset(int row, int col) {
  return uint32_t(row) * 128u + ((uint32_t(col >> 3) ^ uint32_t(row & 7)) << 4) + uint32_t(col & 7) * 2u;
}

// ---- warpgroup MMA --------------------------------------------------------------------------
template <typename T> struct GmmaOps;
template <> struct GmmaOps<__nv_bfloat16> {
  using SS64 = gmma::MMA_64x64x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
  using RS256 = gmma::MMA_64x256x16_F32BF16BF16_RS<gmma::Major::K, gmma::Major::MN>;
  using SS256 = gmma::MMA_64x256x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::MN>;
  using SS16 = gmma::MMA_64x16x16_F32BF16BF16_SS<gmma::Major::K, gmma::Major::K>;
  using SS16MN = gmma::MMA_64x16x16_F32BF16BF16_SS<gmma::Major::MN, gmma::Major::K>;
};
template <> struct GmmaOps<__half> {
  using SS64 = cute::SM90::GMMA::MMA_64x64x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>;
  using RS256 = cute::SM90::GMMA::MMA_64x256x16_F32F16F16_RS<gmma::Major::K, gmma::Major::MN>;
  using SS256 = cute::SM90::GMMA::MMA_64x256x16_F32F16F16_SS<gmma::Major::K, gmma::Major::MN>;
  using SS16 = cute::SM90::GMMA::MMA_64x16x16_F32F16F16_SS<gmma::Major::K, gmma::Major::K>;
  using SS16MN = cute::SM90::GMMA::MMA_64x16x16_F32F16F16_SS<gmma::Major::MN, gmma::Major::K>;
};

template <typename Op, size_t... I>
__device__ __forceinline__ void gmma_ss(uint64_t da, uint64_t db, float* d, bool accumulate,
                                        std::index_sequence<I...>) {
  Op::fma(da, db, d[I]..., accumulate ? gmma::ScaleOut::One : gmma::ScaleOut::Zero);
}
template <typename Op, size_t... I>
__device__ __forceinline__ void gmma_rs(const uint32_t (&a)[4], uint64_t db, float* d,
                                        std::index_sequence<I...>) {
  Op::fma(a[0], a[1], a[2], a[3], db, d[I]..., gmma::ScaleOut::One);
}

// D[64x64] (+)= A[64x16] B[64x16]^T, both K-major in shared memory.
template <typename T>
__device__ __forceinline__ void wgmma_64x64(uint64_t da, uint64_t db, float (&d)[32], bool accumulate) {
  gmma_ss<typename GmmaOps<T>::SS64>(da, db, d, accumulate, std::make_index_sequence<32>{});
}
// D[64x256] += A[64x16] (registers, accumulator layout) B[16x256] (MN-major, shared memory).
template <typename T>
__device__ __forceinline__ void wgmma_64x256_rs(const uint32_t (&a)[4], uint64_t db, float (&d)[128]) {
  gmma_rs<typename GmmaOps<T>::RS256>(a, db, d, std::make_index_sequence<128>{});
}
// D[64x256] += A[64x16] (K-major, shared memory) B[16x256] (MN-major, shared memory).
template <typename T>
__device__ __forceinline__ void wgmma_64x256_ss(uint64_t da, uint64_t db, float (&d)[128]) {
  gmma_ss<typename GmmaOps<T>::SS256>(da, db, d, true, std::make_index_sequence<128>{});
}

// The narrow shapes, for tiles of at most 16 query rows with the keys (or the value dims) as M:
// D[64x16] (+)= A[64x16] B[16x16]^T, both K-major (S^T = K Q^T: A a key box, B the query box);
template <typename T>
__device__ __forceinline__ void wgmma_64x16(uint64_t da, uint64_t db, float (&d)[8], bool accumulate) {
  gmma_ss<typename GmmaOps<T>::SS16>(da, db, d, accumulate, std::make_index_sequence<8>{});
}
// D[64x16] (+)= A[64x16] B[16x16]^T with A MN-major (the 64 M values of each K row contiguous:
// O^T = V^T P^T, A a value box as TMA writes it, rows = keys) and B K-major (P, rows = queries).
// d: the block's 8 accumulators, d[0..7] (one of several blocks in a larger array).
template <typename T>
__device__ __forceinline__ void wgmma_64x16_mn(uint64_t da, uint64_t db, float* d, bool accumulate) {
  gmma_ss<typename GmmaOps<T>::SS16MN>(da, db, d, accumulate, std::make_index_sequence<8>{});
}
// In both, thread t of the warpgroup holds D[m][n] in d[4 j + 2 h + e] for m = 16 (t / 32) +
// (t % 32) / 4 + 8 h and n = 8 j + 2 (t % 4) + e (h, e, j in {0, 1}).

template <int N>
__device__ __forceinline__ void fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// Register operands (A fragments) of an RS wgmma: kept intact until this point.
template <int N, int M>
__device__ __forceinline__ void fence_operands(uint32_t (&d)[N][M]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int j = 0; j < M; ++j) asm volatile("" : "+r"(d[i][j])::"memory");
}

__device__ __forceinline__ void wgmma_fence() {
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void wgmma_commit() {
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
}

// ---- synchronisation ------------------------------------------------------------------------
// Named barrier `id` (1..15) over `threads` threads: sync waits, arrive does not.
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
// Orders this thread's ordinary shared-memory writes before later async-proxy reads (wgmma, TMA).
__device__ __forceinline__ void fence_proxy_async() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

template <int kRegs>
__device__ __forceinline__ void setmaxnreg_inc() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}
template <int kRegs>
__device__ __forceinline__ void setmaxnreg_dec() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegs));
}

// mbarrier helpers (CTA scope).
__device__ __forceinline__ void mbar_init(uint64_t* bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(smem_u32(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.shared::cta.b64 state, [%0];\n}\n" ::"r"(smem_u32(bar))
               : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("{\n.reg .b64 state;\nmbarrier.arrive.expect_tx.shared::cta.b64 state, [%0], %1;\n}\n" ::"r"(
                   smem_u32(bar)),
               "r"(bytes)
               : "memory");
}
// Waits until the phase with parity `parity` of the barrier has completed.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
      "@!done bra WAIT_%=;\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity)
      : "memory");
}

// Waits until that phase has completed, or for about tries x hint_ns nanoseconds at most (each try
// suspends the thread for up to hint_ns): a wait that may give up.
__device__ __forceinline__ void mbar_wait_at_most(uint64_t* bar, uint32_t parity, uint32_t hint_ns, int tries) {
  asm volatile(
      "{\n"
      ".reg .pred done;\n"
      ".reg .b32 left;\n"
      "mov.b32 left, %3;\n"
      "WAIT_%=:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1, %2;\n"
      "@done bra DONE_%=;\n"
      "sub.s32 left, left, 1;\n"
      "setp.gt.s32 done, left, 0;\n"
      "@done bra WAIT_%=;\n"
      "DONE_%=:\n"
      "}\n" ::"r"(smem_u32(bar)),
      "r"(parity), "r"(hint_ns), "r"(tries)
      : "memory");
}

// 2D TMA tile load into shared memory, completing on `bar` (coordinates: inner, outer).
__device__ __forceinline__ void tma_load_2d(void* smem_dst, const void* tensor_map, uint64_t* bar,
                                            int c0, int c1, uint64_t cache_hint) {
  asm volatile(
      "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
      " [%0], [%1, {%3, %4}], [%2], %5;\n" ::"r"(smem_u32(smem_dst)),
      "l"(reinterpret_cast<uint64_t>(tensor_map)), "r"(smem_u32(bar)), "r"(c0), "r"(c1),
      "l"(cache_hint)
      : "memory");
}
__device__ __forceinline__ void prefetch_tensor_map(const void* tensor_map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(tensor_map)) : "memory");
}

}  // namespace mla::cuda::sm90
