// merge_states on the GPU: combine two partial attentions over disjoint key sets by their LSE,
//   lse = ln(e^lse_a + e^lse_b),  out = out_a * e^(lse_a - lse) + out_b * e^(lse_b - lse).
//
// Algorithm: one warp per (token, head) row, grid-stride over rows. Every lane reads the two
// LSEs and forms the weights exactly as the CPU path does (exp/log in double, weights rounded to
// float); then the lanes stream the Dv values in chunks of 8 (16-byte loads/stores when all rows
// are aligned and Dv * elem is a multiple of 16; element by element otherwise):
//   out = w_a * a + w_b * b  (each product rounded, no fma, as on the CPU).
// A side with lse -inf has weight exactly 0 and its values are never read, so NaN or garbage in
// an empty side cannot leak; both -inf gives out 0 and lse -inf. A side of weight 0 is not added
// at all, so merging with an empty side returns the other side's values bit for bit (-0 too).
//
// Aliasing: out may be out_a or out_b (each value is read and written by the same thread), and
// lse_out may be lse_a or lse_b: the lanes read both LSEs before a __syncwarp, after which lane 0
// writes lse_out. Partially overlapping tensors are not supported.
//
// Dtypes are runtime values here (out_a, out_b, out may each be bf16, fp16 or fp32): the kernel
// switches per chunk on a warp-uniform value instead of instantiating 27 variants.
//
// History: v1 (this version) — warp per row, 16-byte vector I/O, double-precision weights.
#include "cuda/common/elementwise.cuh"
#include "cuda/cuda_ops.hpp"

namespace mla::cuda {
namespace {

struct MergeParams {
  const void* out_a;           // [T, H, Dv] bf16/fp16/fp32
  int64_t out_a_stride_t, out_a_stride_h;
  DType out_a_dtype;
  const void* out_b;           // [T, H, Dv]
  int64_t out_b_stride_t, out_b_stride_h;
  DType out_b_dtype;
  void* out;                   // [T, H, Dv]
  int64_t out_stride_t, out_stride_h;
  DType out_dtype;
  const float* lse_a;          // [T, H] fp32
  int64_t lse_a_stride_t, lse_a_stride_h;
  const float* lse_b;          // [T, H] fp32
  int64_t lse_b_stride_t, lse_b_stride_h;
  float* lse_out;              // [T, H] fp32, or null
  int64_t lse_out_stride_t, lse_out_stride_h;
  int64_t num_tokens;          // T
  int64_t num_heads;           // H
  int64_t head_dim;            // Dv
  bool vectorised;             // rows 16-byte aligned and Dv * elem % 16 == 0 for all three
};

constexpr int kChunk = 8;

// Plain loads, not the read-only path: out may be out_a or out_b (in place).
__device__ __forceinline__ void load_values(const void* base, DType dtype, int64_t offset,
                                            int count, bool vectorised, float (&v)[kChunk]) {
  switch (dtype) {
    case DType::kBF16: {
      const auto* p = static_cast<const __nv_bfloat16*>(base) + offset;
      if (count == kChunk) load_chunk<__nv_bfloat16, kChunk, false>(p, vectorised, v);
      else for (int k = 0; k < count; ++k) v[k] = to_float(p[k]);
      return;
    }
    case DType::kFP16: {
      const auto* p = static_cast<const __half*>(base) + offset;
      if (count == kChunk) load_chunk<__half, kChunk, false>(p, vectorised, v);
      else for (int k = 0; k < count; ++k) v[k] = to_float(p[k]);
      return;
    }
    default: {
      const auto* p = static_cast<const float*>(base) + offset;
      if (count == kChunk) load_chunk<float, kChunk, false>(p, vectorised, v);
      else for (int k = 0; k < count; ++k) v[k] = p[k];
      return;
    }
  }
}

__device__ __forceinline__ void store_values(void* base, DType dtype, int64_t offset, int count,
                                             bool vectorised, const float (&v)[kChunk]) {
  switch (dtype) {
    case DType::kBF16: {
      auto* p = static_cast<__nv_bfloat16*>(base) + offset;
      if (count == kChunk) store_chunk<__nv_bfloat16, kChunk>(p, vectorised, v);
      else for (int k = 0; k < count; ++k) p[k] = from_float<__nv_bfloat16>(v[k]);
      return;
    }
    case DType::kFP16: {
      auto* p = static_cast<__half*>(base) + offset;
      if (count == kChunk) store_chunk<__half, kChunk>(p, vectorised, v);
      else for (int k = 0; k < count; ++k) p[k] = from_float<__half>(v[k]);
      return;
    }
    default: {
      auto* p = static_cast<float*>(base) + offset;
      if (count == kChunk) store_chunk<float, kChunk>(p, vectorised, v);
      else for (int k = 0; k < count; ++k) p[k] = v[k];
      return;
    }
  }
}

__global__ void __launch_bounds__(128) merge_states_kernel(const __grid_constant__ MergeParams p) {
  constexpr int kWarp = 32;
  const float neg_inf = __int_as_float(0xff800000);
  const int lane = threadIdx.x % kWarp;
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / kWarp);
  const int64_t num_rows = p.num_tokens * p.num_heads;
  for (int64_t row = blockIdx.x * int64_t(blockDim.x / kWarp) + threadIdx.x / kWarp;
       row < num_rows; row += warps) {
    const int64_t t = row / p.num_heads, h = row % p.num_heads;  // token, head
    const float lse_a = p.lse_a[t * p.lse_a_stride_t + h * p.lse_a_stride_h];
    const float lse_b = p.lse_b[t * p.lse_b_stride_t + h * p.lse_b_stride_h];
    const float lse_max = lse_a < lse_b ? lse_b : lse_a;
    float weight_a = 0, weight_b = 0, lse = neg_inf;
    if (lse_max != neg_inf) {
      const double ea = lse_a == neg_inf ? 0.0 : exp(double(lse_a) - double(lse_max));
      const double eb = lse_b == neg_inf ? 0.0 : exp(double(lse_b) - double(lse_max));
      const double sum = ea + eb;
      weight_a = float(ea / sum);
      weight_b = float(eb / sum);
      lse = float(double(lse_max) + log(sum));
    }
    const int64_t oa = t * p.out_a_stride_t + h * p.out_a_stride_h;
    const int64_t ob = t * p.out_b_stride_t + h * p.out_b_stride_h;
    const int64_t oo = t * p.out_stride_t + h * p.out_stride_h;
    for (int64_t d = int64_t(lane) * kChunk; d < p.head_dim; d += kWarp * kChunk) {
      const int count = p.head_dim - d < kChunk ? int(p.head_dim - d) : kChunk;
      float a[kChunk] = {}, b[kChunk] = {}, merged[kChunk];
      if (weight_a != 0) load_values(p.out_a, p.out_a_dtype, oa + d, count, p.vectorised, a);
      if (weight_b != 0) load_values(p.out_b, p.out_b_dtype, ob + d, count, p.vectorised, b);
#pragma unroll
      for (int k = 0; k < kChunk; ++k) {
        const float wa = weight_a == 0 ? 0.f : __fmul_rn(weight_a, a[k]);
        const float wb = weight_b == 0 ? 0.f : __fmul_rn(weight_b, b[k]);
        // A side of weight 0 adds nothing, not even +0: a -0 of the other side stays -0, so
        // merging with an empty side leaves every bit in place.
        merged[k] = weight_b == 0 ? wa : weight_a == 0 ? wb : __fadd_rn(wa, wb);
      }
      store_values(p.out, p.out_dtype, oo + d, count, p.vectorised, merged);
    }
    // Every lane has read lse_a / lse_b above; only now may lse_out (possibly one of them) change.
    __syncwarp();
    if (p.lse_out != nullptr && lane == 0)
      p.lse_out[t * p.lse_out_stride_t + h * p.lse_out_stride_h] = lse;
  }
}

}  // namespace

void merge_states(const MergeStatesArgs& args, Stream stream) {
  const DeviceGuard guard(args.out.device);
  MergeParams p{};
  p.out_a = args.out_a.data;
  p.out_a_stride_t = args.out_a.stride[0];
  p.out_a_stride_h = args.out_a.stride[1];
  p.out_a_dtype = args.out_a.dtype;
  p.out_b = args.out_b.data;
  p.out_b_stride_t = args.out_b.stride[0];
  p.out_b_stride_h = args.out_b.stride[1];
  p.out_b_dtype = args.out_b.dtype;
  p.out = args.out.data;
  p.out_stride_t = args.out.stride[0];
  p.out_stride_h = args.out.stride[1];
  p.out_dtype = args.out.dtype;
  p.lse_a = static_cast<const float*>(args.lse_a.data);
  p.lse_a_stride_t = args.lse_a.stride[0];
  p.lse_a_stride_h = args.lse_a.stride[1];
  p.lse_b = static_cast<const float*>(args.lse_b.data);
  p.lse_b_stride_t = args.lse_b.stride[0];
  p.lse_b_stride_h = args.lse_b.stride[1];
  if (!args.lse_out.empty()) {
    p.lse_out = static_cast<float*>(args.lse_out.data);
    p.lse_out_stride_t = args.lse_out.stride[0];
    p.lse_out_stride_h = args.lse_out.stride[1];
  }
  p.num_tokens = args.out_a.shape[0];
  p.num_heads = args.out_a.shape[1];
  p.head_dim = args.out_a.shape[2];
  auto chunk_aligned = [&](const TensorView& t) {
    return rows_aligned16(t) && (p.head_dim * int64_t(dtype_size(t.dtype))) % 16 == 0 &&
           (kChunk * int64_t(dtype_size(t.dtype))) % 16 == 0;
  };
  p.vectorised = chunk_aligned(args.out_a) && chunk_aligned(args.out_b) && chunk_aligned(args.out);
  const int64_t num_rows = p.num_tokens * p.num_heads;
  if (num_rows == 0) return;

  constexpr int kThreads = 128;  // 4 warps, one row each
  const unsigned blocks = grid_blocks(num_rows, 32, kThreads);
  merge_states_kernel<<<blocks, kThreads, 0, to_cuda(stream)>>>(p);
  MLA_CUDA_CHECK_LAUNCH();
}

}  // namespace mla::cuda
