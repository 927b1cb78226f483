// mla_decode on Hopper (sm_90a): TMA loads of the paged latent cache through an mbarrier
// pipeline, warpgroup MMA (wgmma) for Q K^T and P V, warp-specialised.
//
// Same work decomposition, schedule, partial-result slots and combine kernel as the portable
// kernel (decode_kernel.cuh): one CTA runs work items of (request, row tile of up to 64 rows,
// key range), persistent over its list when a schedule is given. Rows past the tile's valid rows
// are computed on zeros and never written.
//
// CTA = 3 warpgroups (384 threads):
//   WG0  producer: one thread walks the same items and key tiles as the consumers and issues, per
//        64-key tile, 9 TMA boxes of 64 keys x 64 dims (fewer keys per box for pages < 64)
//        into a 2-stage ring, each stage guarded by a full (TMA bytes) and an empty barrier.
//        Page ids come from the block table; keys past the item's range and pages that are not
//        in the pool get out-of-bounds coordinates, which TMA fills with zeros.
//   WG1  scores + left half: S = Q K^T (64 x 64, K = 576; 36 wgmma m64n64k16, both operands in
//        shared memory), mask, online softmax in registers (each thread owns 2 rows x 16 keys;
//        row reductions are quad shuffles), P to shared memory for WG2 and the per-row rescale
//        factor; then O[:, 0:256] = alpha O + P V[:, 0:256] (wgmma m64n256k16, P from registers).
//   WG2  right half: O[:, 256:512] = alpha O + P V[:, 256:512] (P and V from shared memory).
// WG2 lags WG1 by less than a tile, so its P V overlaps WG1's next Q K^T on the tensor cores.
//
// Shared memory (bytes): Q 73,728 | K/V 2 x 73,728 | P 8,192 | alpha, 1/l 512 | barriers, all
// 1024-byte aligned boxes in the 128-byte swizzle (src/cuda/common/hopper.cuh).
//
// Numerics match the portable kernel: fp32 scores in the exp2 domain, P rounded to the compute
// dtype before P V, row sums of the rounded values, natural-log LSE. Keys of the last tile past
// the item's range are masked out of S and zeroed in shared memory before P V, so NaN in unused
// cache slots never reaches the output.
#include "cuda/decode/decode_hopper.hpp"

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cudaTypedefs.h>

#include <climits>
#include <cstdint>

#include "cuda/common/hopper.cuh"
#include "cuda/common/warp_mma.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/decode/decode_device.cuh"

namespace mla::cuda::decode {
namespace {

using namespace mla::cuda::sm90;

constexpr int kHopperThreads = 384;
constexpr int kStages = 2;
constexpr int kBoxBytes = 64 * 128;               // 64 rows x 64 16-bit values
constexpr int kDimBoxes = kHeadDim / 64;          // 9 boxes per 576-wide tile
constexpr int kTileBytes = kDimBoxes * kBoxBytes;  // 73,728
constexpr uint64_t kEvictNormal = 0x1000000000000000ull;

// Named barriers (0 is __syncthreads). Both consumer warpgroups pass the same sequence of them
// (bar.sync on both sides): per item ITEM, ITEM, then per tile t [P_EMPTY if t > 0 (WG1 before
// writing P) / if t < last (WG2 after its P V)], P_FULL, and EPI at the end.
constexpr int kBarItem = 1;    // item start / Q ready
constexpr int kBarPFull = 2;   // WG1 -> WG2: P and alpha of a tile written
constexpr int kBarPEmpty = 3;  // WG2 -> WG1: WG2 is done with P and alpha
constexpr int kBarEpi = 4;     // WG1 -> WG2: 1/l of the item written

struct SmemLayout {
  static constexpr int q = 0;
  static constexpr int k = q + kTileBytes;
  static constexpr int p = k + kStages * kTileBytes;
  static constexpr int alpha = p + kBoxBytes;
  static constexpr int inv_l = alpha + 64 * 4;
  static constexpr int full = inv_l + 64 * 4;
  static constexpr int empty = full + kStages * 8;
  static constexpr int end = empty + kStages * 8;
  static constexpr int bytes = end + 1024;  // slack to align the base to 1024
};

struct HopperParams {
  CUtensorMap kv_map;  // [rows = P * S, 576] 16-bit, boxes of {64, box_rows}, 128B swizzle
  DecodeParams p;
  int block_m;         // rows per tile of the plan (16, 32 or 64)
  int box_rows;        // keys per TMA box: min(page size, 64)
};

#if defined(MLA_SM90A_DEVICE)

// The tile's keys [key0, key0 + 64) -> stage, as 64 / box_rows row groups of 9 boxes each.
__device__ __forceinline__ void issue_tile(const HopperParams& hp, int request, int key0,
                                           int kv_end, uint8_t* stage, uint64_t* full) {
  const DecodeParams& p = hp.p;
  const int box_rows = hp.box_rows;
  mbar_arrive_expect_tx(full, kTileBytes);
  for (int sub = 0; sub < 64; sub += box_rows) {
    const int key = key0 + sub;
    int row = -box_rows;  // wholly out of bounds: zero-filled
    if (key < kv_end) {
      const int block = key >> p.page_shift;
      const int page = p.block_table[int64_t(request) * p.block_table_stride_b +
                                     int64_t(block) * p.block_table_stride_j];
      if (page >= 0 && page < p.num_pages)
        row = (page << p.page_shift) | (key & ((1 << p.page_shift) - 1));
    }
#pragma unroll
    for (int c = 0; c < kDimBoxes; ++c)
      tma_load_2d(stage + c * kBoxBytes + sub * 128, &hp.kv_map, full, c * 64, row, kEvictNormal);
  }
}

// Q rows [row0, row0 + valid_rows) of the item -> swizzled Q boxes; rows past valid_rows are
// zero. Run by the 256 consumer threads (ct = 0..255).
template <typename T>
__device__ __forceinline__ void load_q(const DecodeParams& p, const ItemRange& r, uint8_t* sq, int ct) {
  const int num_heads = p.layout.num_heads;
  for (int idx = ct; idx < 64 * (kHeadDim / 8); idx += 256) {
    const int row = idx / (kHeadDim / 8);
    const int c = idx - row * (kHeadDim / 8);  // 16-byte chunk along the 576 dims
    uint4 v = make_uint4(0, 0, 0, 0);
    if (row < r.valid_rows) {
      const int rr = r.row0 + row;
      const int64_t token = r.g.q_start + rr / num_heads;
      const int head = rr % num_heads;
      const T* src = c < kValueDim / 8
                         ? static_cast<const T*>(p.q_nope) + token * p.q_nope_stride_t +
                               head * p.q_nope_stride_h + c * 8
                         : static_cast<const T*>(p.q_pe) + token * p.q_pe_stride_t +
                               head * p.q_pe_stride_h + (c - kValueDim / 8) * 8;
      v = __ldg(reinterpret_cast<const uint4*>(src));
    }
    const int box = c >> 3;
    *reinterpret_cast<uint4*>(sq + box * kBoxBytes + swizzled_offset(row, (c & 7) * 8)) = v;
  }
}

// Writes this thread's 2 rows x 128 columns of O (columns col0 + 8n + 2(lane%4) + {0,1}),
// scaled by inv_l, to the output or to the item's partial slot.
__device__ __forceinline__ void store_o(const DecodeParams& p, const ItemRange& r, const WorkItem& item,
                                        const float (&o)[128], const int (&row_local)[2],
                                        const float (&inv_l)[2], int col0, int lane) {
  const int num_heads = p.layout.num_heads;
#pragma unroll
  for (int j = 0; j < 2; ++j) {
    if (row_local[j] >= r.valid_rows) continue;
    if (item.slot < 0) {
      const int rr = r.row0 + row_local[j];
      void* base = out_row(p, r.g.q_start + rr / num_heads, rr % num_heads);
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        const int col = col0 + n * 8 + 2 * (lane & 3);
        store_out_pair(p, base, col, o[4 * n + 2 * j] * inv_l[j], o[4 * n + 2 * j + 1] * inv_l[j]);
      }
    } else {
      float* base = p.schedule.partial_out +
                    (int64_t(item.slot) * kMaxBlockM + row_local[j]) * kValueDim;
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        const int col = col0 + n * 8 + 2 * (lane & 3);
        *reinterpret_cast<float2*>(base + col) =
            make_float2(o[4 * n + 2 * j] * inv_l[j], o[4 * n + 2 * j + 1] * inv_l[j]);
      }
    }
  }
}

template <typename T>
__device__ void run_consumer_scores(const HopperParams& hp, uint8_t* smem, int begin, int end,
                                    int lane_of_cta) {
  const DecodeParams& p = hp.p;
  const int wt = threadIdx.x - 128;  // thread in WG1
  const int warp = wt >> 5, lane = wt & 31;
  const int num_heads = p.layout.num_heads;
  uint8_t* sq = smem + SmemLayout::q;
  uint8_t* sp = smem + SmemLayout::p;
  float* s_alpha = reinterpret_cast<float*>(smem + SmemLayout::alpha);
  float* s_inv_l = reinterpret_cast<float*>(smem + SmemLayout::inv_l);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + SmemLayout::full);
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + SmemLayout::empty);
  const uint32_t sq_addr = smem_u32(sq);
  const uint32_t sk_addr = smem_u32(smem + SmemLayout::k);

  int stage = 0;
  uint32_t phase = 0;
  int row_local[2];
  row_local[0] = warp * 16 + (lane >> 2);
  row_local[1] = row_local[0] + 8;

  for (int it = begin; it < end; ++it) {
    const WorkItem item = fetch_item(p, it, lane_of_cta);
    const ItemRange r = item_range(p.layout, item, hp.block_m);
    if (r.valid_rows <= 0) continue;
    named_sync(kBarItem, 256);  // WG2 is done with the previous item's shared state
    if (r.num_tiles > 0) load_q<T>(p, r, sq, wt);
    fence_proxy_async();
    named_sync(kBarItem, 256);  // Q visible to both warpgroups and to wgmma

    int key_limit[2];
#pragma unroll
    for (int j = 0; j < 2; ++j)
      key_limit[j] = row_local[j] < r.valid_rows
                         ? r.g.kv_len - r.g.q_len + (r.row0 + row_local[j]) / num_heads
                         : -1;
    float row_m[2] = {-INFINITY, -INFINITY};
    float row_l[2] = {0.0f, 0.0f};
    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;

    for (int t = 0; t < r.num_tiles; ++t) {
      const int key0 = r.kv_begin + t * kBlockN;
      const uint32_t tile = sk_addr + stage * kTileBytes;
      mbar_wait(&full[stage], phase);

      // S = Q K^T over the 576 dims: 9 boxes x 4 k-slices of 16.
      float s[32];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kHeadDim / 16; ++kk) {
        const uint32_t off = (kk >> 2) * kBoxBytes + (kk & 3) * 32;
        wgmma_64x64<T>(k_major_desc(sq_addr + off), k_major_desc(tile + off), s, kk > 0);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(s);

      // Mask (causal limit per row, the item's key range) and scale to the exp2 domain.
      float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int j = e >> 1;
          const int key = key0 + n * 8 + 2 * (lane & 3) + (e & 1);
          const bool seen = key < r.kv_end && key <= key_limit[j];
          s[4 * n + e] = seen ? s[4 * n + e] * p.score_scale_log2 : -INFINITY;
          tile_max[j] = fmaxf(tile_max[j], s[4 * n + e]);
        }
      }
      float alpha[2], m_use[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        tile_max[j] = fmaxf(tile_max[j], __shfl_xor_sync(0xffffffffu, tile_max[j], 1));
        tile_max[j] = fmaxf(tile_max[j], __shfl_xor_sync(0xffffffffu, tile_max[j], 2));
        const float m_new = fmaxf(row_m[j], tile_max[j]);
        m_use[j] = m_new == -INFINITY ? 0.0f : m_new;  // no key yet: keep exp2 arguments finite
        alpha[j] = fast_exp2(row_m[j] - m_use[j]);      // exp2(-inf) = 0 for the first keys
        row_m[j] = m_new;
        row_l[j] *= alpha[j];
      }
      // P = exp2(S - m) rounded to T; row sums of the rounded values.
      uint32_t pk[8][2];
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          pk[n][j] = pack2<T>(fast_exp2(s[4 * n + 2 * j] - m_use[j]),
                              fast_exp2(s[4 * n + 2 * j + 1] - m_use[j]));
          const float2 rounded = unpack2<T>(pk[n][j]);
          row_l[j] += rounded.x + rounded.y;
        }
      }

      // Keys of a partial last tile past the range: zero their V rows (the cache may hold NaN
      // there, and 0 * NaN would reach O).
      const int keys_in_tile = r.kv_end - key0;
      if (keys_in_tile < kBlockN) {
        uint8_t* kv = smem + SmemLayout::k + stage * kTileBytes;
        const int bytes = (kBlockN - keys_in_tile) * 128;
        for (int idx = wt; idx < (kValueDim / 64) * (bytes / 16); idx += 128) {
          const int box = idx / (bytes / 16);
          const int off = keys_in_tile * 128 + (idx - box * (bytes / 16)) * 16;
          *reinterpret_cast<uint4*>(kv + box * kBoxBytes + off) = make_uint4(0, 0, 0, 0);
        }
        fence_proxy_async();
      }

      // Publish P and alpha to WG2 once it is done with the previous tile's (within an item;
      // across items the item barrier orders them).
      if (t > 0) named_sync(kBarPEmpty, 256);
#pragma unroll
      for (int n = 0; n < 8; ++n) {
#pragma unroll
        for (int j = 0; j < 2; ++j)
          *reinterpret_cast<uint32_t*>(sp + swizzled_offset(row_local[j], n * 8 + 2 * (lane & 3))) =
              pk[n][j];
      }
      if ((lane & 3) == 0) {
        s_alpha[row_local[0]] = alpha[0];
        s_alpha[row_local[1]] = alpha[1];
      }
      fence_proxy_async();
      named_sync(kBarPFull, 256);  // also makes the zeroed rows visible to our own wgmma

      // O[:, 0:256] = alpha O + P V[:, 0:256].
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        const uint32_t a[4] = {pk[2 * kk][0], pk[2 * kk][1], pk[2 * kk + 1][0], pk[2 * kk + 1][1]};
        wgmma_64x256_rs<T>(a, mn_major_desc(tile + kk * 16 * 128, kBoxBytes), o);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(o);
      if (lane == 0) mbar_arrive(&empty[stage]);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }

    // Epilogue: row sums over the quad, LSE, 1/l for WG2, this half of the output.
    float inv_l[2];
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      row_l[j] += __shfl_xor_sync(0xffffffffu, row_l[j], 1);
      row_l[j] += __shfl_xor_sync(0xffffffffu, row_l[j], 2);
      const bool any = row_l[j] > 0.0f;
      inv_l[j] = any ? p.out_scale / row_l[j] : 0.0f;
      const float lse = any ? (row_m[j] + log2f(row_l[j])) * 0.69314718055994531f : -INFINITY;
      if ((lane & 3) == 0) {
        s_inv_l[row_local[j]] = inv_l[j];
        if (row_local[j] < r.valid_rows) {
          if (item.slot >= 0) {
            p.schedule.partial_lse[int64_t(item.slot) * kMaxBlockM + row_local[j]] = lse;
          } else if (p.lse != nullptr) {
            const int rr = r.row0 + row_local[j];
            p.lse[(r.g.q_start + rr / num_heads) * p.lse_stride_t + (rr % num_heads) * p.lse_stride_h] = lse;
          }
        }
      }
    }
    named_sync(kBarEpi, 256);
    store_o(p, r, item, o, row_local, inv_l, 0, lane);
  }
}

template <typename T>
__device__ void run_consumer_right(const HopperParams& hp, uint8_t* smem, int begin, int end,
                                   int lane_of_cta) {
  const DecodeParams& p = hp.p;
  const int wt = threadIdx.x - 256;  // thread in WG2
  const int warp = wt >> 5, lane = wt & 31;
  uint8_t* sq = smem + SmemLayout::q;
  const float* s_alpha = reinterpret_cast<const float*>(smem + SmemLayout::alpha);
  const float* s_inv_l = reinterpret_cast<const float*>(smem + SmemLayout::inv_l);
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + SmemLayout::full);
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + SmemLayout::empty);
  const uint32_t sp_addr = smem_u32(smem + SmemLayout::p);
  const uint32_t sk_addr = smem_u32(smem + SmemLayout::k);

  int stage = 0;
  uint32_t phase = 0;
  int row_local[2];
  row_local[0] = warp * 16 + (lane >> 2);
  row_local[1] = row_local[0] + 8;

  for (int it = begin; it < end; ++it) {
    const WorkItem item = fetch_item(p, it, lane_of_cta);
    const ItemRange r = item_range(p.layout, item, hp.block_m);
    if (r.valid_rows <= 0) continue;
    named_sync(kBarItem, 256);
    if (r.num_tiles > 0) load_q<T>(p, r, sq, wt + 128);
    fence_proxy_async();
    named_sync(kBarItem, 256);

    float o[128];
#pragma unroll
    for (int i = 0; i < 128; ++i) o[i] = 0.0f;
    for (int t = 0; t < r.num_tiles; ++t) {
      const uint32_t tile = sk_addr + stage * kTileBytes;
      mbar_wait(&full[stage], phase);
      named_sync(kBarPFull, 256);
      const float alpha[2] = {s_alpha[row_local[0]], s_alpha[row_local[1]]};
#pragma unroll
      for (int i = 0; i < 128; ++i) o[i] *= alpha[(i >> 1) & 1];
      wgmma_fence();
#pragma unroll
      for (int kk = 0; kk < kBlockN / 16; ++kk) {
        wgmma_64x256_ss<T>(k_major_desc(sp_addr + kk * 32),
                           mn_major_desc(tile + 4 * kBoxBytes + kk * 16 * 128, kBoxBytes), o);
      }
      wgmma_commit();
      wgmma_wait<0>();
      fence_operands(o);
      if (t + 1 < r.num_tiles) named_sync(kBarPEmpty, 256);
      if (lane == 0) mbar_arrive(&empty[stage]);
      if (++stage == kStages) {
        stage = 0;
        phase ^= 1;
      }
    }
    named_sync(kBarEpi, 256);
    const float inv_l[2] = {s_inv_l[row_local[0]], s_inv_l[row_local[1]]};
    store_o(p, r, item, o, row_local, inv_l, 256, lane);
  }
}

template <typename T>
__global__ void __launch_bounds__(kHopperThreads, 1)
    mla_decode_hopper_kernel(const __grid_constant__ HopperParams hp) {
  extern __shared__ __align__(1024) uint8_t smem_raw[];
  uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uintptr_t>(smem_raw) + 1023) & ~uintptr_t(1023));
  const DecodeParams& p = hp.p;

  int begin, end, lane;
  cta_work(p, hp.block_m, &begin, &end, &lane);

  uint64_t* full = reinterpret_cast<uint64_t*>(smem + SmemLayout::full);
  uint64_t* empty = reinterpret_cast<uint64_t*>(smem + SmemLayout::empty);
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbar_init(&full[s], 1);
      mbar_init(&empty[s], 8);  // one arrive per consumer warp
    }
    mbar_init_fence();
  }
  __syncthreads();

  const int wg = threadIdx.x >> 7;
  if (wg == 0) {
    setmaxnreg_dec<40>();
    if (threadIdx.x == 0) {
      prefetch_tensor_map(&hp.kv_map);
      int stage = 0;
      uint32_t phase = 0;
      for (int it = begin; it < end; ++it) {
        const WorkItem item = fetch_item(p, it, lane);
        const ItemRange r = item_range(p.layout, item, hp.block_m);
        for (int t = 0; t < r.num_tiles; ++t) {
          mbar_wait(&empty[stage], phase ^ 1);
          issue_tile(hp, item.request, r.kv_begin + t * kBlockN, r.kv_end,
                     smem + SmemLayout::k + stage * kTileBytes, &full[stage]);
          if (++stage == kStages) {
            stage = 0;
            phase ^= 1;
          }
        }
      }
    }
  } else if (wg == 1) {
    setmaxnreg_inc<232>();
    run_consumer_scores<T>(hp, smem, begin, end, lane);
  } else {
    setmaxnreg_inc<232>();
    run_consumer_right<T>(hp, smem, begin, end, lane);
  }
}

#else  // not sm_90a: the kernel exists only so that the host code links; it is never launched.

template <typename T>
__global__ void mla_decode_hopper_kernel(const __grid_constant__ HopperParams) {}

#endif

// cuTensorMapEncodeTiled from the driver, through the runtime (no link against libcuda).
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static PFN_cuTensorMapEncodeTiled_v12000 fn = [] {
    void* f = nullptr;
    cudaDriverEntryPointQueryResult query{};
    MLA_CUDA_CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &f, 12000,
                                                    cudaEnableDefault, &query));
    MLA_CHECK(query == cudaDriverEntryPointSuccess && f != nullptr,
              "mla_decode: the CUDA driver has no cuTensorMapEncodeTiled (query result ", int(query), ")");
    return reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(f);
  }();
  return fn;
}

}  // namespace

template <typename T>
void launch_hopper_decode_kernel(const DecodeParams& params, int block_m, int grid, cudaStream_t stream) {
  HopperParams hp{};
  hp.p = params;
  hp.block_m = block_m;
  const int page_size = 1 << params.page_shift;
  hp.box_rows = page_size < 64 ? page_size : 64;

  const cuuint64_t dims[2] = {cuuint64_t(kHeadDim), cuuint64_t(params.num_pages) * cuuint64_t(page_size)};
  const cuuint64_t strides[1] = {cuuint64_t(kHeadDim) * 2};
  const cuuint32_t box[2] = {64, cuuint32_t(hp.box_rows)};
  const cuuint32_t elem_strides[2] = {1, 1};
  const CUresult rc = tensor_map_encoder()(
      &hp.kv_map, CU_TENSOR_MAP_DATA_TYPE_UINT16, 2, const_cast<void*>(params.kv_cache), dims, strides,
      box, elem_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
      CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  MLA_CHECK(rc == CUDA_SUCCESS, "mla_decode: cuTensorMapEncodeTiled failed for the kv_cache (error ",
            int(rc), ", ", params.num_pages, " pages of ", page_size, " tokens at ", params.kv_cache, ")");

  const DeviceInfo& info = current_device_info();
  MLA_CHECK(size_t(SmemLayout::bytes) <= info.max_smem_per_block_optin,
            "mla_decode: the Hopper decode kernel needs ", SmemLayout::bytes,
            " bytes of shared memory per block, but device ", info.device, " allows ",
            info.max_smem_per_block_optin);
  opt_in_dynamic_smem<mla_decode_hopper_kernel<T>>(SmemLayout::bytes);
  mla_decode_hopper_kernel<T><<<grid, kHopperThreads, SmemLayout::bytes, stream>>>(hp);
  MLA_CUDA_CHECK_LAUNCH();
}

template void launch_hopper_decode_kernel<__nv_bfloat16>(const DecodeParams&, int, int, cudaStream_t);
template void launch_hopper_decode_kernel<__half>(const DecodeParams&, int, int, cudaStream_t);

}  // namespace mla::cuda::decode
