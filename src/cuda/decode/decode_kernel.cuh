// mla_decode main kernel: absorbed (MQA) attention of a tile of query rows over a range of keys
// of the paged latent cache, with warp-level tensor cores (mma.sync m16n8k16, fp32 accumulate).
//
// Algorithm (one CTA = 8 warps, one work item at a time; persistent over its item list):
//   rows   kBlockM (16, 32 or 64) rows (token i, head h) of ONE request, flattened r = i * H + h;
//          all of them share every key (MQA), so each key tile is read once for all heads.
//   Q      (kBlockM, 576) in shared memory for the whole item.
//   loop over key tiles of kBlockN = 64 cache rows (cp.async, double buffered or, with less
//   shared memory, one stage; an fp8 cache is staged raw and converted to the compute dtype in
//   shared memory):
//     S = Q K^T          warp (wm, wn) computes rows [16 wm, +16) x keys [wn * 64/kWarpsN, ...)
//     mask               causal limit per row, key range of the item; scaled to the exp2 domain
//     online softmax     row max across the kWarpsN key slices through shared memory; P
//                        rounded to the compute dtype and written to shared memory
//     O += P V           warp (wm, wn) owns O rows [16 wm, +16) x columns [wn * 512/kWarpsN, ...);
//                        V is the first 512 columns of the same K tile (ldmatrix .trans)
//   epilogue: row sums across warps; normalise; write the output (and LSE) directly, or, for a
//   piece of a split unit, the normalised partial output (in the output's dtype) and its LSE into
//   the workspace.
//
// Warp layout by row-tile class (kRowTiles = kBlockM / 16, kWarpsM = kRowTiles, kWarpsN = 8 / it):
//   kBlockM 16: 1 x 8 warps, S slice 8 keys, O slice 16 x 64   (few heads: H * q_len <= 16)
//   kBlockM 32: 2 x 4 warps, S slice 16 keys, O slice 16 x 128
//   kBlockM 64: 4 x 2 warps, S slice 32 keys, O slice 16 x 256 (128 fp32 accumulators / thread)
// Warps whose 16 rows are all past the tile's valid rows skip their tensor-core work.
//
// Shared memory (bytes, kBlockM = 64, bf16): Q 73,728 | P 8,192 | row max/sum 1,024 | K 2 x
// 73,728 (fp8: K 73,728 + raw 2 x 36,864) = 230,400 (the sm_90 limit is 232,448). Where a block
// gets less (A100: 166,912; sm_86 / sm_89: 101,376), one stage of K (fp8: one raw tile besides
// the converted one): 156,672 / 115,712 / 95,232 bytes for 64 / 32 / 16 rows (fp8: 193,536 /
// 152,576 / 132,096); the next tile then loads after this one is computed (fp8: after it is
// converted). Where an fp8 raw stage does not fit either, its tiles go through registers into
// the one stage (the 16-bit sizes), their loads not overlapped. Rows of 576
// values (72 chunks of 16 bytes) are XOR-swizzled, chunk' = chunk ^ (row % 8), so that the 8
// row addresses of every ldmatrix fall in 8 distinct bank groups; P rows (8 chunks) likewise.
//
// Numerics: scores and softmax in fp32 (exp2 domain); P is rounded to the compute dtype (bf16 or
// fp16) before P V, and the row sum uses the rounded values, so the weights sum to 1 exactly.
// Keys past the item's range are zero-filled (never read), so NaN in unused pages cannot leak.
//
// Version history: v1 mma.sync + cp.async double buffering, split-KV via plan_decode + combine.
//   Measured on an H200 (docs/decode-kernel.md): 211 TFLOP/s for 64 requests x 128 heads x 4096
//   keys; 3.1-3.3 TB/s of bf16 cache for 128 requests x 16 heads x 4096 keys.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cuda/common/dependent_launch.cuh"
#include "cuda/common/warp_mma.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/cuda_ops.hpp"
#include "cuda/decode/decode_device.cuh"
#include "cuda/decode/decode_launch.hpp"
#include "cuda/decode/decode_params.cuh"

namespace mla::cuda::decode {

// kStages: key tiles in shared memory, 2 (the next tile loads while this one is computed) or 1
// (GPUs whose blocks get less shared memory than two stages need: A100, sm_86 / sm_89).
template <typename T, int kRowTiles, int kStages = 2>
struct DecodeTraits {
  static_assert(kRowTiles == 1 || kRowTiles == 2 || kRowTiles == 4);
  static_assert(kStages == 1 || kStages == 2);
  static constexpr int kBlockM = 16 * kRowTiles;
  static constexpr int kWarpsM = kRowTiles;                    // warps along rows
  static constexpr int kWarpsN = (kThreads / 32) / kRowTiles;  // warps along keys (S), columns (O)
  static constexpr int kKeysPerWarp = kBlockN / kWarpsN;       // 8, 16, 32
  static constexpr int kKeyFrags = kKeysPerWarp / 8;           // n8 fragments of S per warp
  static constexpr int kColsPerWarp = kValueDim / kWarpsN;     // 64, 128, 256
  static constexpr int kColFrags = kColsPerWarp / 8;           // n8 fragments of O per warp
  static constexpr int kChunks = kHeadDim / 8;                 // 72 chunks of 8 values per row

  struct Fp8Tiles {
    T k[kBlockN * kHeadDim];                // (64, 576) converted tile, swizzled
    uint8_t raw[kStages][kBlockN * kHeadDim];  // (64, 576) fp8 as loaded, one a stage
  };
  // The key tiles last, so that a block gets only the bytes its cache dtype uses of them (one
  // fp8 stage needs a converted tile besides the raw one: more than one 16-bit stage).
  struct SharedStorage {
    T q[kBlockM * kHeadDim];                // (kBlockM, 576), swizzled
    T p[kBlockM * kBlockN];                 // (kBlockM, 64), swizzled
    float row_max[kWarpsN][kBlockM];        // per key slice, this tile
    float row_sum[kWarpsN][kBlockM];        // per key slice, end of item
    union {
      T k[kStages][kBlockN * kHeadDim];     // (64, 576) a stage, swizzled
      Fp8Tiles fp8;
    } kv;
  };
  static_assert(offsetof(SharedStorage, kv) % 128 == 0, "tiles start on a 128-byte line");
  static_assert(offsetof(SharedStorage, kv) + kBlockN * kHeadDim * sizeof(T) ==
                    portable_one_stage_bytes(kBlockM),
                "the row-tile cap (decode_launch.hpp) follows this layout");
  // Shared memory a block takes for a 16-bit or an fp8 cache (fp8_direct: converted through
  // registers, one stage: no raw tile).
  static constexpr size_t smem_bytes(bool fp8, bool fp8_direct = false) {
    return offsetof(SharedStorage, kv) + (fp8 && !fp8_direct
                                              ? sizeof(Fp8Tiles)
                                              : size_t(kStages) * kBlockN * kHeadDim * sizeof(T));
  }
};

// Element offset of 16-byte chunk `chunk` of row `row` in a swizzled (rows, 576) tile.
__device__ __forceinline__ int qk_offset(int row, int chunk) {
  return (row * (kHeadDim / 8) + (chunk ^ (row & 7))) * 8;
}
// Element offset of chunk `chunk` of row `row` in the swizzled (rows, 64) P tile.
__device__ __forceinline__ int p_offset(int row, int chunk) {
  return (row * (kBlockN / 8) + (chunk ^ (row & 7))) * 8;
}

template <typename T>
__device__ __forceinline__ float load_scalar(const void* base, int64_t index, bool is_fp8) {
  if (is_fp8) {
    __nv_fp8_e4m3 v;
    v.__x = static_cast<const __nv_fp8_storage_t*>(base)[index];
    return float(v);
  }
  if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[index]);
  } else {
    return __half2float(static_cast<const __half*>(base)[index]);
  }
}

template <typename T, int kRowTiles, int kStages>
struct DecodeCta {
  using Traits = DecodeTraits<T, kRowTiles, kStages>;
  using Smem = typename Traits::SharedStorage;
  static constexpr int kBlockM = Traits::kBlockM;
  static constexpr int kWarpsM = Traits::kWarpsM;
  static constexpr int kWarpsN = Traits::kWarpsN;
  static constexpr int kKeysPerWarp = Traits::kKeysPerWarp;
  static constexpr int kKeyFrags = Traits::kKeyFrags;
  static constexpr int kColsPerWarp = Traits::kColsPerWarp;
  static constexpr int kColFrags = Traits::kColFrags;

  const DecodeParams& p;
  Smem& s;
  const int tid, lane, wm, wn;

  __device__ DecodeCta(const DecodeParams& params, Smem& smem)
      : p(params), s(smem), tid(threadIdx.x), lane(threadIdx.x & 31),
        wm((threadIdx.x >> 5) % kWarpsM), wn((threadIdx.x >> 5) / kWarpsM) {}

  // Q rows [row0, row0 + valid_rows) of the request starting at token q_start -> s.q; rows past
  // valid_rows are zero. Vector rows go through cp.async (committed with the first key tile).
  __device__ void load_q(int q_start, int row0, int valid_rows) {
    const int num_heads = p.layout.num_heads;
    if (p.q_vector_ok && !p.q_is_fp8) {
      // Thread tid owns row tid / kThreadsPerRow and its chunks tid % kThreadsPerRow + k j, so
      // the row's source addresses are computed once (this runs once per item, from a cold
      // instruction cache: code size matters).
      constexpr int kThreadsPerRow = kThreads / kBlockM;  // 4, 8, 16
      constexpr int kPerThread = (Traits::kChunks + kThreadsPerRow - 1) / kThreadsPerRow;
      const int row = tid / kThreadsPerRow, c0 = tid % kThreadsPerRow;
      const bool valid = row < valid_rows;
      // Rows past valid_rows are zero-filled, not read (row 0's address stands in).
      const QRow<T> q = q_row<T>(p, q_start, row0 + (valid ? row : 0));
#pragma unroll
      for (int j = 0; j < kPerThread; ++j) {
        const int c = c0 + kThreadsPerRow * j;
        if (Traits::kChunks % kThreadsPerRow != 0 && c >= Traits::kChunks) break;
        cp_async_16(s.q + qk_offset(row, c), q.chunk(c), valid);
      }
    } else if (p.q_vector_ok) {  // fp8 rows: 16 values per load, converted to T
      for (int idx = tid; idx < kBlockM * (kHeadDim / 16); idx += kThreads) {
        const int row = idx / (kHeadDim / 16);
        const int c16 = idx - row * (kHeadDim / 16);
        uint4 raw = make_uint4(0, 0, 0, 0);
        if (row < valid_rows) {
          // 16 one-byte values are two 8-value chunks: this load is chunk 2 * c16 onwards.
          const QRow<uint8_t> q = q_row<uint8_t>(p, q_start, row0 + row);
          raw = __ldg(reinterpret_cast<const uint4*>(q.chunk(2 * c16)));
        }
        uint4 lo, hi;
        fp8x16_to<T>(raw, lo, hi);
        *reinterpret_cast<uint4*>(s.q + qk_offset(row, 2 * c16)) = lo;
        *reinterpret_cast<uint4*>(s.q + qk_offset(row, 2 * c16 + 1)) = hi;
      }
    } else {  // unaligned rows: one element at a time
      for (int idx = tid; idx < kBlockM * kHeadDim; idx += kThreads) {
        const int row = idx / kHeadDim;
        const int d = idx - row * kHeadDim;
        float v = 0.0f;
        if (row < valid_rows) {
          const int r = row0 + row;
          const int64_t token = q_start + r / num_heads;
          const int head = r % num_heads;
          v = d < kValueDim
                  ? load_scalar<T>(p.q_nope, token * p.q_nope_stride_t + head * p.q_nope_stride_h + d,
                                   p.q_is_fp8)
                  : load_scalar<T>(p.q_pe,
                                   token * p.q_pe_stride_t + head * p.q_pe_stride_h + (d - kValueDim),
                                   p.q_is_fp8);
        }
        s.q[qk_offset(row, d / 8) + (d & 7)] = from_float<T>(v);
      }
    }
  }

  // Element offset of key `key`'s cache row, or -1 when the key is outside [0, kv_end) or its
  // page id is not a page of the pool (such rows are zero-filled, never read).
  __device__ __forceinline__ int64_t key_row(int request, int key, int kv_end) const {
    const int64_t slot = cache_slot(p, request, key, kv_end);
    return slot < 0 ? -1 : slot * kHeadDim;
  }

  // Keys [key0, key0 + 64) of `request` -> swizzled tile (16-bit cache): 8 threads per row.
  __device__ void load_k_tile(T* tile, int request, int key0, int kv_end) {
    const int sub = tid & 7;
#pragma unroll
    for (int pass = 0; pass < kBlockN / (kThreads / 8); ++pass) {
      const int row = (tid >> 3) + pass * (kThreads / 8);
      const int64_t offset = key_row(request, key0 + row, kv_end);
      const T* src = static_cast<const T*>(p.kv_cache) + (offset < 0 ? 0 : offset);
#pragma unroll
      for (int i = 0; i < Traits::kChunks / 8; ++i) {
        const int c = sub + 8 * i;
        cp_async_16(tile + qk_offset(row, c), src + (offset < 0 ? 0 : c * 8), offset >= 0);
      }
    }
  }

  // Keys [key0, key0 + 64) -> raw fp8 staging tile (row-major, unswizzled): 4 threads per row.
  __device__ void load_k_tile_fp8(uint8_t* raw, int request, int key0, int kv_end) {
    const int sub = tid & 3;
    const int row = tid >> 2;  // kThreads / 4 == kBlockN rows
    const int64_t offset = key_row(request, key0 + row, kv_end);
    const uint8_t* src = static_cast<const uint8_t*>(p.kv_cache) + (offset < 0 ? 0 : offset);
#pragma unroll
    for (int i = 0; i < kHeadDim / 16 / 4; ++i) {
      const int c = sub + 4 * i;
      cp_async_16(raw + row * kHeadDim + c * 16, src + (offset < 0 ? 0 : c * 16), offset >= 0);
    }
  }

  __device__ void convert_fp8_tile(const uint8_t* raw, T* tile) {
    for (int idx = tid; idx < kBlockN * (kHeadDim / 16); idx += kThreads) {
      const int row = idx / (kHeadDim / 16);
      const int c16 = idx - row * (kHeadDim / 16);
      const uint4 v = *reinterpret_cast<const uint4*>(raw + row * kHeadDim + c16 * 16);
      uint4 lo, hi;
      fp8x16_to<T>(v, lo, hi);
      *reinterpret_cast<uint4*>(tile + qk_offset(row, 2 * c16)) = lo;
      *reinterpret_cast<uint4*>(tile + qk_offset(row, 2 * c16 + 1)) = hi;
    }
  }

  // Keys [key0, key0 + 64) of an fp8 cache -> the compute dtype in `tile` (swizzled), through
  // registers: the loads of a thread's row are all in flight, then converted and stored. For one
  // stage without room for a raw tile (kv_fp8_direct); the load is not overlapped.
  __device__ void load_fp8_tile_direct(T* tile, int request, int key0, int kv_end) {
    const int sub = tid & 3;
    const int row = tid >> 2;  // kThreads / 4 == kBlockN rows
    const int64_t offset = key_row(request, key0 + row, kv_end);
    const uint8_t* src = static_cast<const uint8_t*>(p.kv_cache) + (offset < 0 ? 0 : offset);
    constexpr int kPerThread = kHeadDim / 16 / 4;  // 9 chunks of 16 fp8 values
    uint4 v[kPerThread];
#pragma unroll
    for (int i = 0; i < kPerThread; ++i)
      v[i] = offset >= 0 ? __ldg(reinterpret_cast<const uint4*>(src + (sub + 4 * i) * 16))
                         : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < kPerThread; ++i) {
      const int c = sub + 4 * i;
      uint4 lo, hi;
      fp8x16_to<T>(v[i], lo, hi);
      *reinterpret_cast<uint4*>(tile + qk_offset(row, 2 * c)) = lo;
      *reinterpret_cast<uint4*>(tile + qk_offset(row, 2 * c + 1)) = hi;
    }
  }

  __device__ void issue_tile(int stage, int request, int key0, int kv_end) {
    if (p.kv_is_fp8) load_k_tile_fp8(s.kv.fp8.raw[stage], request, key0, kv_end);
    else load_k_tile(s.kv.k[stage], request, key0, kv_end);
  }

  // sacc = Q[rows of wm] . K[keys of wn]^T over all 576 dims.
  __device__ void compute_scores(const T* tile, float (&sacc)[kKeyFrags][4]) const {
    const int q_row = wm * 16 + (lane & 15);
    const int key_base = wn * kKeysPerWarp;
#pragma unroll 4
    for (int kk = 0; kk < kHeadDim / 16; ++kk) {
      uint32_t a[4];
      ldmatrix_x4(a, s.q + qk_offset(q_row, 2 * kk + (lane >> 4)));
      if constexpr (kKeyFrags == 1) {
        uint32_t b[2];
        ldmatrix_x2(b, tile + qk_offset(key_base + (lane & 7), 2 * kk + ((lane >> 3) & 1)));
        mma_m16n8k16<T>(sacc[0], a, b);
      } else {
#pragma unroll
        for (int f = 0; f < kKeyFrags; f += 2) {
          uint32_t b[4];
          ldmatrix_x4(b, tile + qk_offset(key_base + f * 8 + (lane & 7) + ((lane >> 4) << 3),
                                          2 * kk + ((lane >> 3) & 1)));
          const uint32_t b0[2] = {b[0], b[1]};
          const uint32_t b1[2] = {b[2], b[3]};
          mma_m16n8k16<T>(sacc[f], a, b0);
          mma_m16n8k16<T>(sacc[f + 1], a, b1);
        }
      }
    }
  }

  // o[rows of wm, columns of wn] += P[rows of wm, 64 keys] . V[64 keys, columns of wn].
  __device__ void accumulate_pv(const T* tile, int keys_in_tile, float (&o)[kColFrags][4]) const {
    const int p_row = wm * 16 + (lane & 15);
    const int col_chunk0 = wn * (kColsPerWarp / 8);
#pragma unroll
    for (int ks = 0; ks < kBlockN / 16; ++ks) {
      if (ks * 16 >= keys_in_tile) break;  // the rest of the tile is past the item's keys
      uint32_t a[4];
      ldmatrix_x4(a, s.p + p_offset(p_row, 2 * ks + (lane >> 4)));
      const int v_row = ks * 16 + (lane & 7) + (((lane >> 3) & 1) << 3);
#pragma unroll
      for (int f = 0; f < kColFrags; f += 2) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, tile + qk_offset(v_row, col_chunk0 + f + (lane >> 4)));
        const uint32_t b0[2] = {b[0], b[1]};
        const uint32_t b1[2] = {b[2], b[3]};
        mma_m16n8k16<T>(o[f], a, b0);
        mma_m16n8k16<T>(o[f + 1], a, b1);
      }
    }
  }

  __device__ void run_item(const WorkItem& item) {
    const int num_heads = p.layout.num_heads;
    const ItemRange range = item_range(p.layout, item, kBlockM);
    if (range.valid_rows <= 0) return;  // uniform across the CTA
    const RequestGeometry& g = range.g;
    const int row0 = range.row0, valid_rows = range.valid_rows;
    const int kv_begin = range.kv_begin, kv_end = range.kv_end, num_tiles = range.num_tiles;

    // This thread's two rows (accumulator rows lane/4 and lane/4 + 8 of fragment wm) and the
    // last key each may see (-1: none).
    int row_local[2], key_limit[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      row_local[j] = wm * 16 + (lane >> 2) + 8 * j;
      key_limit[j] = row_local[j] < valid_rows
                         ? row_last_key(g, row0 + row_local[j], num_heads)
                         : -1;
    }
    const bool rows_live = wm * 16 < valid_rows;

    float row_m[2] = {-INFINITY, -INFINITY};  // running max of the scaled scores (exp2 domain)
    float row_l[2] = {0.0f, 0.0f};            // this thread's part of the running sum
    float o[kColFrags][4];
#pragma unroll
    for (int f = 0; f < kColFrags; ++f) o[f][0] = o[f][1] = o[f][2] = o[f][3] = 0.0f;

    // One stage, fp8 through registers: no raw stage, the tile converted on its way in.
    const bool direct = kStages == 1 && p.kv_is_fp8 && p.kv_fp8_direct;
    __syncthreads();  // the previous item is done with shared memory
    if (num_tiles > 0) {
      load_q(g.q_start, row0, valid_rows);
      if (!direct) issue_tile(0, item.request, kv_begin, kv_end);
      cp_async_commit();
      if (direct) load_fp8_tile_direct(s.kv.k[0], item.request, kv_begin, kv_end);
    }

    for (int t = 0; t < num_tiles; ++t) {
      const int key0 = kv_begin + t * kBlockN;
      const bool has_next = t + 1 < num_tiles;
      cp_async_wait<0>();
      __syncthreads();  // tile t (and Q) visible; every warp is done with tile t - 1
      if (kStages == 2 && has_next) {
        issue_tile((t + 1) & 1, item.request, key0 + kBlockN, kv_end);
        cp_async_commit();
      }
      const T* tile;
      if (direct) {
        tile = s.kv.k[0];
      } else if (p.kv_is_fp8) {
        convert_fp8_tile(s.kv.fp8.raw[t & (kStages - 1)], s.kv.fp8.k);
        __syncthreads();
        if (kStages == 1 && has_next) {  // the raw stage is converted: the next tile may load
          issue_tile(0, item.request, key0 + kBlockN, kv_end);
          cp_async_commit();
        }
        tile = s.kv.fp8.k;
      } else {
        tile = s.kv.k[t & (kStages - 1)];
      }

      // S = Q K^T for this warp's rows and key slice.
      float sacc[kKeyFrags][4];
#pragma unroll
      for (int f = 0; f < kKeyFrags; ++f) sacc[f][0] = sacc[f][1] = sacc[f][2] = sacc[f][3] = 0.0f;
      const int warp_key0 = key0 + wn * kKeysPerWarp;
      if (rows_live && warp_key0 < kv_end) compute_scores(tile, sacc);

      // Mask and scale; this slice's row maxima.
      float slice_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int f = 0; f < kKeyFrags; ++f) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int key = warp_key0 + f * 8 + 2 * (lane & 3) + (e & 1);
          const int j = e >> 1;
          const bool seen = key <= key_limit[j] && key < kv_end;
          sacc[f][e] = seen ? sacc[f][e] * p.score_scale_log2 : -INFINITY;
          slice_max[j] = fmaxf(slice_max[j], sacc[f][e]);
        }
      }
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        slice_max[j] = fmaxf(slice_max[j], __shfl_xor_sync(0xffffffffu, slice_max[j], 1));
        slice_max[j] = fmaxf(slice_max[j], __shfl_xor_sync(0xffffffffu, slice_max[j], 2));
        if ((lane & 3) == 0) s.row_max[wn][row_local[j]] = slice_max[j];
      }
      __syncthreads();  // row maxima of all key slices visible

      // Online softmax update: new max, rescale of the running sum and output.
      float m_use[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        float tile_max = s.row_max[0][row_local[j]];
#pragma unroll
        for (int n = 1; n < kWarpsN; ++n) tile_max = fmaxf(tile_max, s.row_max[n][row_local[j]]);
        const float m_new = fmaxf(row_m[j], tile_max);
        m_use[j] = m_new == -INFINITY ? 0.0f : m_new;  // no key yet: keep exp2 arguments finite
        const float alpha = fast_exp2(row_m[j] - m_use[j]);  // exp2(-inf) = 0 for the first keys
        row_m[j] = m_new;
        row_l[j] *= alpha;
#pragma unroll
        for (int f = 0; f < kColFrags; ++f) {
          o[f][2 * j] *= alpha;
          o[f][2 * j + 1] *= alpha;
        }
      }

      // P = exp2(S - m), rounded to T, into shared memory; row sums of the rounded values.
#pragma unroll
      for (int f = 0; f < kKeyFrags; ++f) {
        const int key_col = wn * kKeysPerWarp + f * 8 + 2 * (lane & 3);
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t packed = pack2<T>(fast_exp2(sacc[f][2 * j] - m_use[j]),
                                           fast_exp2(sacc[f][2 * j + 1] - m_use[j]));
          const float2 rounded = unpack2<T>(packed);
          row_l[j] += rounded.x + rounded.y;
          *reinterpret_cast<uint32_t*>(s.p + p_offset(row_local[j], key_col >> 3) + (key_col & 7)) =
              packed;
        }
      }
      __syncthreads();  // P visible

      if (rows_live) accumulate_pv(tile, kv_end - key0, o);
      if (kStages == 1 && (direct || !p.kv_is_fp8) && has_next) {
        __syncthreads();  // one stage: every warp is done with this tile before the next loads
        if (direct) {
          load_fp8_tile_direct(s.kv.k[0], item.request, key0 + kBlockN, kv_end);
        } else {
          issue_tile(0, item.request, key0 + kBlockN, kv_end);
          cp_async_commit();
        }
      }
    }

    // Row sums across the quad and the key slices.
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      row_l[j] += __shfl_xor_sync(0xffffffffu, row_l[j], 1);
      row_l[j] += __shfl_xor_sync(0xffffffffu, row_l[j], 2);
      if ((lane & 3) == 0) s.row_sum[wn][row_local[j]] = row_l[j];
    }
    __syncthreads();
    float inv_l[2], lse[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      float total = 0.0f;
#pragma unroll
      for (int n = 0; n < kWarpsN; ++n) total += s.row_sum[n][row_local[j]];
      const bool any = total > 0.0f;  // >= 1 whenever a key was seen (the max contributes 1)
      inv_l[j] = any ? p.out_scale / total : 0.0f;
      lse[j] = row_lse(row_m[j], total);
    }

    // One row per pass of a loop that is not unrolled (row 1's values move into row 0's
    // registers for the second pass), each output kind's stores once (store_row_pairs): the
    // final output and LSE, or for a piece of a split unit the normalised partial output
    // and its LSE, merged by the combine kernel.
    const int kind = out_kind(p, item.slot >= 0);
    const int col = wn * kColsPerWarp + 2 * (lane & 3);
#pragma unroll 1
    for (int j = 0; j < 2; ++j) {
      const int rl = j == 0 ? row_local[0] : row_local[1];
      const float inv = j == 0 ? inv_l[0] : inv_l[1];
      const float lse_j = j == 0 ? lse[0] : lse[1];
      // Rows past valid_rows run the stores' shuffles and store nothing.
      const bool valid = rl < valid_rows;
      const RowDst dst = row_dst(p, item.slot, range, valid ? rl : 0);
      store_row_pairs<kColFrags>(
          p, kind, dst.out, col, inv, valid, [&](int n) { return make_float2(o[n][0], o[n][1]); },
          [&] {
#pragma unroll
            for (int f = 0; f < kColFrags - 1; ++f) {
              o[f][0] = o[f + 1][0];
              o[f][1] = o[f + 1][1];
            }
          });
      if (valid && dst.lse != nullptr && wn == 0 && (lane & 3) == 0) *dst.lse = lse_j;
      // Row 1's values into row 0's registers (a rotation above moved only row 0's columns).
#pragma unroll
      for (int f = 0; f < kColFrags; ++f) {
        o[f][0] = o[f][2];
        o[f][1] = o[f][3];
      }
    }
  }
};

template <typename T, int kRowTiles, int kStages>
__global__ void __launch_bounds__(kThreads, 1) mla_decode_kernel(const __grid_constant__ DecodeParams p) {
  using Cta = DecodeCta<T, kRowTiles, kStages>;
  extern __shared__ __align__(128) unsigned char smem_bytes[];
  Cta cta(p, *reinterpret_cast<typename Cta::Smem*>(smem_bytes));
  wait_for_prior_grids();  // the plan (and everything before it in the stream) is done
  allow_dependent_launch();
  // The first item comes with the work range (one round trip fewer before the CTA's first loads:
  // 16 h B 1 kv 4k -2 to -2.6 % on an H100, docs/perf-notes.md); each next one is read after run_item,
  // so that no item is live across it.
  int begin, end, lane;
  WorkItem item;
  cta_work(p, Cta::kBlockM, &begin, &end, &lane, &item);
  for (int i = begin; i < end;) {
    cta.run_item(item);
    if (++i < end) item = fetch_item(p, i, lane);
  }
}

template <typename T, int kRowTiles, int kStages>
void launch_stages(const DecodeParams& params, int grid, size_t bytes, cudaStream_t stream) {
  using Traits = DecodeTraits<T, kRowTiles, kStages>;
  // The kernel's opt-in covers both cache dtypes (set once per device): all of SharedStorage,
  // or all the device allows where that is less (one fp8 stage of 64 rows on an A100).
  opt_in_dynamic_smem<mla_decode_kernel<T, kRowTiles, kStages>>(int(std::min(
      sizeof(typename Traits::SharedStorage), size_t(current_device_info().max_smem_per_block_optin))));
  launch_dependent(mla_decode_kernel<T, kRowTiles, kStages>, dim3(grid), dim3(kThreads), bytes,
                   stream, params);
}

// Host launcher (instantiated in decode_bf16.cu / decode_fp16.cu): two stages where the device
// allows a block their shared memory, else one, else (fp8 cache) one without the raw stage.
template <typename T, int kRowTiles>
void launch_decode_kernel(const DecodeParams& params, int grid, cudaStream_t stream) {
  const DeviceInfo& info = current_device_info();
  const size_t limit = decode_shared_memory_limit(size_t(info.max_smem_per_block_optin));
  const bool fp8 = params.kv_is_fp8 != 0;
  using One = DecodeTraits<T, kRowTiles, 1>;
  const size_t two = DecodeTraits<T, kRowTiles, 2>::smem_bytes(fp8);
  const size_t one = One::smem_bytes(fp8), one_direct = One::smem_bytes(fp8, /*fp8_direct=*/true);
  DecodeParams p = params;
  p.kv_fp8_direct = 0;
  if (two <= limit) {
    launch_stages<T, kRowTiles, 2>(p, grid, two, stream);
  } else if (one <= limit) {
    launch_stages<T, kRowTiles, 1>(p, grid, one, stream);
  } else {
    // An fp8 cache without its raw stage; a 16-bit cache has nothing smaller.
    MLA_CHECK(fp8 && one_direct <= limit, "mla_decode: the decode kernel for ", 16 * kRowTiles,
              "-row tiles needs ", one_direct, " bytes of shared memory per block (one stage; ",
              two, " with two), but device ", info.device, " allows ", limit);
    p.kv_fp8_direct = 1;
    launch_stages<T, kRowTiles, 1>(p, grid, one_direct, stream);
  }
}

}  // namespace mla::cuda::decode
