// mha_prefill kernel: ragged non-absorbed attention with mma.sync tensor cores (FlashAttention-2
// style), for sm_80 and up.
//
// Algorithm (one CTA = 64 query rows of one head of one request, 4 warps x 16 rows):
//   1. The Q tile (64 x 192) is staged in shared memory, then kept in registers as mma A
//      fragments for the whole key loop.
//   2. Key/value tiles of 64 rows (64 x 192 and 64 x 128) stream through double-buffered shared
//      memory with cp.async; tile n + 1 is in flight while tile n is computed.
//   3. S = Q K^T (mma m16n8k16, fp32 accumulate, K via ldmatrix), scaled by
//      softmax_scale * q_scale * k_scale * log2(e), masked (kv_len, causal bottom-right), then the
//      online softmax in fp32 rescales the running output, and O += P V (P rounded to the compute
//      type, V via ldmatrix.trans).
//   4. Epilogue: out = O / l * v_scale, lse = ln(sum exp(score)); rows that see no key get 0 and
//      -inf.
// Key tiles past the causal limit of the tile's last row are never loaded. fp8 e4m3 inputs are
// copied raw (cp.async) into a staging area and converted to fp16 in shared memory, which is
// exact (every e4m3 value is an fp16 value), so one kernel body serves every input type.
//
// Version history:
//   v1  64 x 64 tiles, 4 warps, Q in registers, padded (conflict-free) shared rows, 2 CTAs/SM.
//       H200, bf16, one 8192-token request, 128 heads: causal 11.3 ms (243 TFLOP/s), non-causal
//       22.3 ms (247 TFLOP/s), cudaEvent over 5 calls (test MhaPrefillGpu.Timing8kTokens128Heads).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "cuda/common/fp8.cuh"
#include "cuda/common/warp_mma.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/prefill/prefill_params.cuh"

namespace mla::cuda::prefill {

struct PrefillConfig {
  static constexpr int kHeadDimQK = 192;
  static constexpr int kHeadDimV = 128;
  static constexpr int kBlockM = 64;  // query rows per CTA
  static constexpr int kBlockN = 64;  // keys per tile
  static constexpr int kWarps = 4;    // each warp owns 16 query rows
  static constexpr int kThreads = kWarps * 32;
  // Shared rows are padded by 16 bytes so that the 8 rows one ldmatrix reads start 4 banks apart.
  static constexpr int kQKRowElems = kHeadDimQK + 8;  // 200 (400 bytes)
  static constexpr int kVRowElems = kHeadDimV + 8;    // 136 (272 bytes)
  static constexpr int kQKSteps = kHeadDimQK / 16;     // k-steps of S = Q K^T
  static constexpr int kVTiles = kHeadDimV / 8;        // n-tiles of O
  static constexpr int kSTiles = kBlockN / 8;          // n-tiles of S
};

// Shared memory of one CTA. `Elem` is the 16-bit compute type.
// For fp8 inputs, q doubles as the staging area of raw fp8 K/V tiles once Q is in registers.
template <typename Elem>
struct PrefillSharedStorage {
  using C = PrefillConfig;
  alignas(16) Elem q[C::kBlockM * C::kQKRowElems];     // (kBlockM, 192) row-major, padded
  alignas(16) Elem k[2][C::kBlockN * C::kQKRowElems];  // 2 stages of (kBlockN, 192)
  alignas(16) Elem v[2][C::kBlockN * C::kVRowElems];   // 2 stages of (kBlockN, 128)
};
static_assert(PrefillConfig::kBlockN * (PrefillConfig::kHeadDimQK + PrefillConfig::kHeadDimV) <=
                  int(sizeof(PrefillSharedStorage<__half>::q)),
              "the raw fp8 K/V staging area must fit in the Q tile");

// Input element type -> 16-bit type the tensor cores compute in.
template <typename In>
struct ComputeTypeOf {
  using type = In;
};
template <>
struct ComputeTypeOf<__nv_fp8_e4m3> {
  using type = __half;  // exact for every e4m3 value
};

__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));  // ex2(-inf) = +0
  return y;
}

// Copies rows [0, rows_valid) of a (kRows, kRowBytes) global tile into shared memory with row
// pitch kSmemRowBytes, zero-filling rows [rows_valid, kRows). Row 0 must be readable.
template <int kRows, int kRowBytes, int kSmemRowBytes>
__device__ __forceinline__ void copy_tile_async(void* smem, const void* gmem, int64_t gmem_row_bytes,
                                                int rows_valid) {
  constexpr int kChunksPerRow = kRowBytes / 16;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kRowBytes % 16 == 0 && kChunks % PrefillConfig::kThreads == 0);
  auto* s = static_cast<char*>(smem);
  const auto* g = static_cast<const char*>(gmem);
#pragma unroll
  for (int it = 0; it < kChunks / PrefillConfig::kThreads; ++it) {
    const int i = int(threadIdx.x) + it * PrefillConfig::kThreads;
    const int r = i / kChunksPerRow, c = i % kChunksPerRow;
    const bool valid = r < rows_valid;
    const char* src = valid ? g + r * gmem_row_bytes + c * 16 : g;
    cp_async_16(s + r * kSmemRowBytes + c * 16, src, valid);
  }
}

// Converts a dense raw fp8 (kRows, kCols) tile in shared memory into a padded fp16 tile.
template <int kRows, int kCols, int kDstRowElems>
__device__ __forceinline__ void convert_fp8_tile(__half* dst, const uint8_t* raw) {
  constexpr int kChunksPerRow = kCols / 16;
  constexpr int kChunks = kRows * kChunksPerRow;
  static_assert(kChunks % PrefillConfig::kThreads == 0);
#pragma unroll
  for (int it = 0; it < kChunks / PrefillConfig::kThreads; ++it) {
    const int i = int(threadIdx.x) + it * PrefillConfig::kThreads;
    const int r = i / kChunksPerRow, c = i % kChunksPerRow;
    uint4 lo, hi;
    fp8x16_to<__half>(*reinterpret_cast<const uint4*>(raw + r * kCols + c * 16), lo, hi);
    auto* d = reinterpret_cast<uint4*>(dst + r * kDstRowElems + c * 16);
    d[0] = lo;
    d[1] = hi;
  }
}

// Loads the fp8 Q tile from global memory, converting to fp16 into the padded shared tile.
__device__ __forceinline__ void load_q_fp8(__half* sQ, const uint8_t* gQ, int64_t row_bytes,
                                           int rows_valid) {
  using C = PrefillConfig;
  constexpr int kChunksPerRow = C::kHeadDimQK / 16;
  constexpr int kChunks = C::kBlockM * kChunksPerRow;
  static_assert(kChunks % C::kThreads == 0);
#pragma unroll
  for (int it = 0; it < kChunks / C::kThreads; ++it) {
    const int i = int(threadIdx.x) + it * C::kThreads;
    const int r = i / kChunksPerRow, c = i % kChunksPerRow;
    uint4 raw = make_uint4(0, 0, 0, 0);
    if (r < rows_valid) raw = __ldg(reinterpret_cast<const uint4*>(gQ + r * row_bytes + c * 16));
    uint4 lo, hi;
    fp8x16_to<__half>(raw, lo, hi);
    auto* d = reinterpret_cast<uint4*>(sQ + r * C::kQKRowElems + c * 16);
    d[0] = lo;
    d[1] = hi;
  }
}

// Writes 2 adjacent output elements.
__device__ __forceinline__ void store_out2(void* out, int64_t offset, OutKind kind, float a, float b) {
  switch (kind) {
    case OutKind::kBF16:
      *reinterpret_cast<__nv_bfloat162*>(static_cast<__nv_bfloat16*>(out) + offset) =
          __floats2bfloat162_rn(a, b);
      break;
    case OutKind::kFP16:
      *reinterpret_cast<__half2*>(static_cast<__half*>(out) + offset) = __floats2half2_rn(a, b);
      break;
    case OutKind::kFP32:
      *reinterpret_cast<float2*>(static_cast<float*>(out) + offset) = make_float2(a, b);
      break;
  }
}
__device__ __forceinline__ void store_out1(void* out, int64_t offset, OutKind kind, float a) {
  switch (kind) {
    case OutKind::kBF16: static_cast<__nv_bfloat16*>(out)[offset] = __float2bfloat16_rn(a); break;
    case OutKind::kFP16: static_cast<__half*>(out)[offset] = __float2half_rn(a); break;
    case OutKind::kFP32: static_cast<float*>(out)[offset] = a; break;
  }
}

// Query rows past grid_m * kBlockM exist only when max_q_len was smaller than a request's q_len;
// they are filled with NaN (output and lse) so that the mistake cannot pass unnoticed.
__device__ inline void poison_uncovered_rows(const MhaPrefillParams& p, int q_begin, int first_row,
                                      int q_len, int h) {
  const float nan = __int_as_float(0x7fffffff);
  for (int r = first_row; r < q_len; ++r) {
    const int64_t base = int64_t(q_begin + r) * p.out_token_stride + int64_t(h) * p.out_head_stride;
    for (int d = threadIdx.x; d < PrefillConfig::kHeadDimV; d += PrefillConfig::kThreads)
      store_out1(p.out, base + d, p.out_kind, nan);
    if (p.lse && threadIdx.x == 0)
      p.lse[int64_t(q_begin + r) * p.lse_token_stride + int64_t(h) * p.lse_head_stride] = nan;
  }
}

// grid (ceil(max_q_len / kBlockM), H, B); block kThreads; dynamic smem sizeof(SharedStorage).
template <typename In>
__global__ void __launch_bounds__(PrefillConfig::kThreads, 2)
    mha_prefill_kernel(const __grid_constant__ MhaPrefillParams p) {
  using C = PrefillConfig;
  using Elem = typename ComputeTypeOf<In>::type;
  constexpr bool kFp8 = std::is_same_v<In, __nv_fp8_e4m3>;
  constexpr float kNegInf = -__builtin_huge_valf();
  extern __shared__ __align__(16) unsigned char smem_raw[];
  auto& smem = *reinterpret_cast<PrefillSharedStorage<Elem>*>(smem_raw);

  // m_block: query tile within the request, largest first (causal tiles there are the longest).
  const int m_block = int(gridDim.x) - 1 - int(blockIdx.x);
  const int h = blockIdx.y;  // head
  const int b = blockIdx.z;  // request
  // The offsets are device data nobody checked: clamped to the tensors' rows, so a bad value
  // reads and writes within them (a request whose end precedes its start has no rows).
  const int q_begin = min(max(p.cu_q_lens[b], 0), p.num_q_tokens);
  const int q_len = min(max(p.cu_q_lens[b + 1], q_begin), p.num_q_tokens) - q_begin;
  const int kv_begin = min(max(p.cu_kv_lens[b], 0), p.num_kv_tokens);
  const int kv_len = min(max(p.cu_kv_lens[b + 1], kv_begin), p.num_kv_tokens) - kv_begin;
  if (blockIdx.x == 0 && q_len > int(gridDim.x) * C::kBlockM)
    poison_uncovered_rows(p, q_begin, int(gridDim.x) * C::kBlockM, q_len, h);
  const int row0 = m_block * C::kBlockM;  // first query row of this tile, within the request
  if (row0 >= q_len) return;
  const int rows = min(C::kBlockM, q_len - row0);
  const int diag = kv_len - q_len;  // causal: row i sees keys j <= diag + i
  // Keys [0, key_end) are seen by at least one row of this tile.
  const int key_end = p.causal ? max(0, min(kv_len, diag + row0 + rows)) : kv_len;
  const int num_key_tiles = (key_end + C::kBlockN - 1) / C::kBlockN;

  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warp_row0 = row0 + warp * 16;  // first query row of this warp

  const In* gQ = static_cast<const In*>(p.q) + int64_t(q_begin + row0) * p.q_token_stride +
                 int64_t(h) * p.q_head_stride;
  const In* gK = static_cast<const In*>(p.k) + int64_t(kv_begin) * p.k_token_stride +
                 int64_t(h) * p.k_head_stride;
  const In* gV = static_cast<const In*>(p.v) + int64_t(kv_begin) * p.v_token_stride +
                 int64_t(h) * p.v_head_stride;
  const int64_t q_row_bytes = p.q_token_stride * int64_t(sizeof(In));
  const int64_t k_row_bytes = p.k_token_stride * int64_t(sizeof(In));
  const int64_t v_row_bytes = p.v_token_stride * int64_t(sizeof(In));
  auto* staging = reinterpret_cast<uint8_t*>(smem.q);  // fp8 only: raw K then raw V tile

  // Issues the copies of key tile `t` (K and V) into stage `buf` (16-bit) or the staging area.
  auto load_kv_tile = [&](int t, int buf) {
    const int key0 = t * C::kBlockN;
    const int keys = min(C::kBlockN, kv_len - key0);
    if constexpr (kFp8) {
      (void)buf;
      copy_tile_async<C::kBlockN, C::kHeadDimQK, C::kHeadDimQK>(staging, gK + key0 * p.k_token_stride,
                                                                k_row_bytes, keys);
      copy_tile_async<C::kBlockN, C::kHeadDimV, C::kHeadDimV>(
          staging + C::kBlockN * C::kHeadDimQK, gV + key0 * p.v_token_stride, v_row_bytes, keys);
    } else {
      copy_tile_async<C::kBlockN, C::kHeadDimQK * 2, C::kQKRowElems * 2>(
          smem.k[buf], gK + key0 * p.k_token_stride, k_row_bytes, keys);
      copy_tile_async<C::kBlockN, C::kHeadDimV * 2, C::kVRowElems * 2>(
          smem.v[buf], gV + key0 * p.v_token_stride, v_row_bytes, keys);
    }
    cp_async_commit();
  };

  float o[C::kVTiles][4];  // (16 rows, 128) accumulator of this warp; n-tile j = columns 8j..8j+7
#pragma unroll
  for (int j = 0; j < C::kVTiles; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  // Per thread: rows lane/4 and lane/4 + 8 of the warp. Max in log2 units of the scaled score.
  float row_max[2] = {kNegInf, kNegInf};
  float row_sum[2] = {0.f, 0.f};  // partial over this thread's columns until the epilogue

  if (num_key_tiles > 0) {
    // ---- prologue: Q to shared memory, then to registers; first K/V tile in flight.
    if constexpr (kFp8) {
      load_q_fp8(smem.q, reinterpret_cast<const uint8_t*>(gQ), q_row_bytes, rows);
      __syncthreads();
    } else {
      copy_tile_async<C::kBlockM, C::kHeadDimQK * 2, C::kQKRowElems * 2>(smem.q, gQ, q_row_bytes, rows);
      load_kv_tile(0, 0);
      cp_async_wait<0>();
      __syncthreads();
    }
    uint32_t q_frag[C::kQKSteps][4];  // A fragments of the warp's (16, 192) Q rows
#pragma unroll
    for (int kk = 0; kk < C::kQKSteps; ++kk)
      ldmatrix_x4(q_frag[kk], smem.q + (warp * 16 + lane % 8 + ((lane / 8) % 2) * 8) * C::kQKRowElems +
                                  kk * 16 + (lane / 16) * 8);
    if constexpr (kFp8) {
      __syncthreads();  // the Q tile becomes the staging area
      load_kv_tile(0, 0);
    }

    // ---- main loop over key tiles
    for (int t = 0; t < num_key_tiles; ++t) {
      const int buf = t & 1;
      if constexpr (kFp8) {
        cp_async_wait<0>();
        __syncthreads();  // raw tile t visible; every warp is done with tile t - 1
        convert_fp8_tile<C::kBlockN, C::kHeadDimQK, C::kQKRowElems>(smem.k[buf], staging);
        convert_fp8_tile<C::kBlockN, C::kHeadDimV, C::kVRowElems>(smem.v[buf],
                                                                  staging + C::kBlockN * C::kHeadDimQK);
        __syncthreads();  // converted tile visible; staging free
        if (t + 1 < num_key_tiles) load_kv_tile(t + 1, buf ^ 1);
      } else {
        if (t > 0) {
          cp_async_wait<0>();
          __syncthreads();  // tile t visible; every warp is done with tile t - 1 (stage buf ^ 1)
        }
        if (t + 1 < num_key_tiles) load_kv_tile(t + 1, buf ^ 1);
      }
      const Elem* sK = smem.k[buf];
      const Elem* sV = smem.v[buf];

      // S = Q K^T for the warp's 16 rows x 64 keys.
      float s[C::kSTiles][4];
#pragma unroll
      for (int j = 0; j < C::kSTiles; ++j) s[j][0] = s[j][1] = s[j][2] = s[j][3] = 0.f;
#pragma unroll
      for (int kk = 0; kk < C::kQKSteps; ++kk) {
#pragma unroll
        for (int np = 0; np < C::kSTiles / 2; ++np) {
          uint32_t kb[4];  // B fragments of n-tiles 2np, 2np + 1
          ldmatrix_x4(kb, sK + (np * 16 + (lane / 16) * 8 + lane % 8) * C::kQKRowElems + kk * 16 +
                              ((lane / 8) % 2) * 8);
          const uint32_t b0[2] = {kb[0], kb[1]}, b1[2] = {kb[2], kb[3]};
          mma_m16n8k16<Elem>(s[2 * np], q_frag[kk], b0);
          mma_m16n8k16<Elem>(s[2 * np + 1], q_frag[kk], b1);
        }
      }

      // Scale to log2 units, then mask keys past kv_len or past the causal limit.
      const int key0 = t * C::kBlockN;
#pragma unroll
      for (int j = 0; j < C::kSTiles; ++j)
#pragma unroll
        for (int e = 0; e < 4; ++e) s[j][e] *= p.score_scale_log2;
      const bool need_mask =
          key0 + C::kBlockN > kv_len || (p.causal && key0 + C::kBlockN - 1 > diag + warp_row0);
      if (need_mask) {
#pragma unroll
        for (int j = 0; j < C::kSTiles; ++j)
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int key = key0 + j * 8 + 2 * (lane % 4) + (e & 1);
            const int row = warp_row0 + lane / 4 + (e >> 1) * 8;
            const int limit = p.causal ? min(kv_len, diag + row + 1) : kv_len;
            if (key >= limit) s[j][e] = kNegInf;
          }
      }

      // Online softmax: new running max, rescale O and the running sum, P = exp2(S - max).
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[r];
#pragma unroll
        for (int j = 0; j < C::kSTiles; ++j) mx = fmaxf(mx, fmaxf(s[j][2 * r], s[j][2 * r + 1]));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float ref = mx == kNegInf ? 0.f : mx;  // a row with no key yet stays at 0 / -inf
        const float correction = fast_exp2(row_max[r] - ref);
        row_max[r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int j = 0; j < C::kSTiles; ++j) {
          s[j][2 * r] = fast_exp2(s[j][2 * r] - ref);
          s[j][2 * r + 1] = fast_exp2(s[j][2 * r + 1] - ref);
          sum += s[j][2 * r] + s[j][2 * r + 1];
        }
        row_sum[r] = row_sum[r] * correction + sum;
#pragma unroll
        for (int j = 0; j < C::kVTiles; ++j) {
          o[j][2 * r] *= correction;
          o[j][2 * r + 1] *= correction;
        }
      }

      // O += P V: the S accumulators of n-tiles 2u, 2u + 1 are the A fragment of k-step u.
#pragma unroll
      for (int u = 0; u < C::kBlockN / 16; ++u) {
        const uint32_t pa[4] = {pack2<Elem>(s[2 * u][0], s[2 * u][1]), pack2<Elem>(s[2 * u][2], s[2 * u][3]),
                                pack2<Elem>(s[2 * u + 1][0], s[2 * u + 1][1]),
                                pack2<Elem>(s[2 * u + 1][2], s[2 * u + 1][3])};
#pragma unroll
        for (int dp = 0; dp < C::kVTiles / 2; ++dp) {
          uint32_t vb[4];  // B fragments of output n-tiles 2dp, 2dp + 1
          ldmatrix_x4_trans(vb, sV + (u * 16 + lane % 8 + ((lane / 8) % 2) * 8) * C::kVRowElems +
                                    dp * 16 + (lane / 16) * 8);
          const uint32_t b0[2] = {vb[0], vb[1]}, b1[2] = {vb[2], vb[3]};
          mma_m16n8k16<Elem>(o[2 * dp], pa, b0);
          mma_m16n8k16<Elem>(o[2 * dp + 1], pa, b1);
        }
      }
    }
  }

  // ---- epilogue: normalise, scale by v_scale, store; lse in natural log.
  constexpr float kLn2 = 0.69314718055994530942f;
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float l = row_sum[r];
    l += __shfl_xor_sync(0xffffffffu, l, 1);
    l += __shfl_xor_sync(0xffffffffu, l, 2);
    const int row = warp_row0 + lane / 4 + r * 8;
    if (row >= q_len) continue;
    const bool has_keys = l > 0.f;
    const float inv = has_keys ? p.v_scale / l : 0.f;
    const int64_t out_base =
        int64_t(q_begin + row) * p.out_token_stride + int64_t(h) * p.out_head_stride + 2 * (lane % 4);
#pragma unroll
    for (int j = 0; j < C::kVTiles; ++j)
      store_out2(p.out, out_base + j * 8, p.out_kind, o[j][2 * r] * inv, o[j][2 * r + 1] * inv);
    if (p.lse && lane % 4 == 0)
      p.lse[int64_t(q_begin + row) * p.lse_token_stride + int64_t(h) * p.lse_head_stride] =
          has_keys ? (row_max[r] + __log2f(l)) * kLn2 : kNegInf;
  }
}

template <typename In>
void launch_mha_prefill(const MhaPrefillParams& params, int grid_m, cudaStream_t stream) {
  using C = PrefillConfig;
  constexpr size_t kSmem = sizeof(PrefillSharedStorage<typename ComputeTypeOf<In>::type>);
  const DeviceInfo& device = current_device_info();
  MLA_CHECK(device.max_smem_per_block_optin >= kSmem, "mha_prefill: the kernel needs ", kSmem,
            " bytes of shared memory per block, device ", device.device, " allows ",
            device.max_smem_per_block_optin);
  auto* kernel = &mha_prefill_kernel<In>;
  MLA_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(kSmem)));
  const dim3 grid(unsigned(grid_m), unsigned(params.num_heads), unsigned(params.num_requests));
  kernel<<<grid, C::kThreads, kSmem, stream>>>(params);
  MLA_CUDA_CHECK_LAUNCH();
}

}  // namespace mla::cuda::prefill
