// rope_quantize on the GPU: q_out[t, h] = q_nope[t, h] | rope(q_pe[t, h]) (576 wide) and, with
// keys, k_nope_out[t] = k_nope[t], k_pe_out[t] = rope(k_pe[t]); each value converted to its
// output dtype (fp8: saturate(x / scale)).
//
// Algorithm: the op is two launches of one kernel over "rows" of 512 nope + 64 rope values:
// T * H query rows, then T key rows (H = 1). One thread per output chunk of 16 bytes (8 values
// for bf16/fp16 outputs, 16 for fp8), grid-stride over rows * chunks. A nope chunk is a converted
// copy. A rope chunk also loads its NeoX partner chunk (the other half, +-32 values; interleaved
// pairs lie inside the chunk) and the chunk's cos/sin values for the token's position, then
// rotates: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin.
//
// The products and sums use __fmul_rn / __fadd_rn / __fsub_rn, so nothing is contracted into an
// fma: the result is the same float as the CPU path computes (x1 * c - x2 * s), and so are the
// converted outputs. Loads and stores are 16 bytes when every row of every tensor is 16-byte
// aligned, element by element otherwise.
//
// Device-side index handling (no host sync, so no exception): a token whose position is outside
// [0, max_position) reads no input and no cos/sin row; its query rows and key row are written NaN,
// so that attention over them shows the bad position instead of running on stale values. (The
// CPU path throws, and so does this one with check_metadata: a host copy of the positions checked
// by the CPU path's check before the launch.)
//
// History: v1 — chunk-per-thread, 16-byte vector I/O, no fma contraction; a bad position's rows
// left untouched. v2 (this version) — a bad position's rows written NaN.
#include "cpu/cpu_ops.hpp"
#include "cuda/common/elementwise.cuh"
#include "cuda/cuda_ops.hpp"
#include "cuda/host_metadata.hpp"

namespace mla::cuda {
namespace {

constexpr int kHalfRope = kRopeDim / 2;  // 32 angles per position

// One launch: rows (t, h) for t < T, h < H. Strides are in elements.
struct RopeRowsParams {
  const void* nope_in;         // [T, H, 512] input dtype
  int64_t nope_in_stride_t, nope_in_stride_h;
  const void* pe_in;           // [T, H, 64] input dtype
  int64_t pe_in_stride_t, pe_in_stride_h;
  void* nope_out;              // [T, H, 512] output dtype
  int64_t nope_out_stride_t, nope_out_stride_h;
  void* pe_out;                // [T, H, 64] output dtype
  int64_t pe_out_stride_t, pe_out_stride_h;
  const float* cos_sin;        // [max_position, 64] fp32: 32 cos then 32 sin
  int64_t cos_sin_stride;
  int64_t max_position;
  const void* positions;       // [T] int32/int64
  int64_t positions_stride;
  bool positions_int64;
  int64_t num_tokens;          // T
  int num_heads;               // H (1 for the key launch)
  float scale;                 // fp8 output: stored = saturate(x / scale)
  bool neox;                   // NeoX pairs (i, i + 32), else interleaved (2i, 2i + 1)
  bool vectorised;             // every row 16-byte aligned
};

template <typename InT, typename OutT>
__global__ void __launch_bounds__(256) rope_quantize_kernel(const __grid_constant__ RopeRowsParams p) {
  constexpr int kChunk = 16 / sizeof(OutT);              // values per 16-byte output chunk
  constexpr int kNopeChunks = kKvLoraRank / kChunk;
  constexpr int kChunksPerRow = kLatentDim / kChunk;
  const int64_t total = p.num_tokens * p.num_heads * kChunksPerRow;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t row = i / kChunksPerRow;
    const int c = int(i % kChunksPerRow);  // chunk within the 576-wide row
    const int64_t t = row / p.num_heads;   // token
    const int64_t h = row % p.num_heads;   // head
    const int64_t pos = load_index(p.positions, p.positions_int64, p.positions_stride, t);
    const bool nope = c < kNopeChunks;
    const int e0 = (c - kNopeChunks) * kChunk;  // rope chunks: first rope element of the chunk
    OutT* dst = nope ? static_cast<OutT*>(p.nope_out) + t * p.nope_out_stride_t +
                           h * p.nope_out_stride_h + c * kChunk
                     : static_cast<OutT*>(p.pe_out) + t * p.pe_out_stride_t + h * p.pe_out_stride_h + e0;
    float values[kChunk];
    if (pos < 0 || pos >= p.max_position) {
#pragma unroll
      for (int k = 0; k < kChunk; ++k) values[k] = __int_as_float(0x7fffffff);  // NaN (fp8: NaN too)
    } else if (nope) {
      const InT* src = static_cast<const InT*>(p.nope_in) + t * p.nope_in_stride_t +
                       h * p.nope_in_stride_h + c * kChunk;
      load_chunk<InT, kChunk>(src, p.vectorised, values);
    } else {
      const InT* pe = static_cast<const InT*>(p.pe_in) + t * p.pe_in_stride_t + h * p.pe_in_stride_h;
      const float* cos = p.cos_sin + pos * p.cos_sin_stride;
      const float* sin = cos + kHalfRope;
      float own[kChunk];
      load_chunk<InT, kChunk>(pe + e0, p.vectorised, own);
      if (p.neox) {
        // Element e pairs with e +- 32 at angle e % 32; chunks never straddle the halves.
        const bool first_half = e0 < kHalfRope;
        float partner[kChunk];
        load_chunk<InT, kChunk>(pe + (first_half ? e0 + kHalfRope : e0 - kHalfRope), p.vectorised,
                                partner);
        const int a0 = first_half ? e0 : e0 - kHalfRope;  // first angle
#pragma unroll
        for (int k = 0; k < kChunk; ++k) {
          const float c_k = __ldg(cos + a0 + k), s_k = __ldg(sin + a0 + k);
          values[k] = first_half
              ? __fsub_rn(__fmul_rn(own[k], c_k), __fmul_rn(partner[k], s_k))   // x1' = x1 c - x2 s
              : __fadd_rn(__fmul_rn(own[k], c_k), __fmul_rn(partner[k], s_k));  // x2' = x2 c + x1 s
        }
      } else {
        // Element 2i pairs with 2i + 1 at angle i.
#pragma unroll
        for (int k = 0; k < kChunk; k += 2) {
          const int a = (e0 + k) / 2;
          const float c_a = __ldg(cos + a), s_a = __ldg(sin + a);
          const float x1 = own[k], x2 = own[k + 1];
          values[k] = __fsub_rn(__fmul_rn(x1, c_a), __fmul_rn(x2, s_a));
          values[k + 1] = __fadd_rn(__fmul_rn(x2, c_a), __fmul_rn(x1, s_a));
        }
      }
    }
    if constexpr (kIsFp8<OutT>) {  // NaN stays NaN
#pragma unroll
      for (int k = 0; k < kChunk; ++k) values[k] = values[k] / p.scale;
    }
    store_chunk<OutT, kChunk>(dst, p.vectorised, values);
  }
}

void launch_rows(const RopeRowsParams& p, DType in_dtype, DType out_dtype, Stream stream) {
  constexpr const char* op = "rope_quantize";
  constexpr int kThreads = 256;
  dispatch_float_dtype(op, "q_nope", in_dtype, [&](auto in_tag) {
    using InT = decltype(in_tag);
    if constexpr (kIsFp8<InT>) {
      MLA_FAIL(op, ": input dtype must be bf16, fp16 or fp32, got fp8e4m3");
    } else {
      dispatch_float_dtype(op, "output", out_dtype, [&](auto out_tag) {
        using OutT = decltype(out_tag);
        if constexpr (std::is_same_v<OutT, float>) {
          MLA_FAIL(op, ": output dtype must be bf16, fp16 or fp8e4m3, got fp32");
        } else {
          constexpr int kChunksPerRow = kLatentDim / (16 / sizeof(OutT));
          const unsigned blocks = grid_blocks(p.num_tokens * p.num_heads, kChunksPerRow, kThreads);
          rope_quantize_kernel<InT, OutT><<<blocks, kThreads, 0, to_cuda(stream)>>>(p);
          MLA_CUDA_CHECK_LAUNCH();
        }
      });
    }
  });
}

}  // namespace

void rope_quantize(const RopeQuantizeArgs& args, Stream stream) {
  const DeviceGuard guard(args.q_out.device);
  const int64_t num_tokens = args.q_nope.shape[0];
  if (num_tokens == 0) return;
  if (args.check_metadata)  // positions is contiguous (checked before)
    check_index_vector_on_host("rope_quantize", "positions", args, &RopeQuantizeArgs::positions, num_tokens,
                               to_cuda(stream), cpu::check_rope_positions);

  RopeRowsParams common{};
  common.cos_sin = static_cast<const float*>(args.cos_sin_cache.data);
  common.cos_sin_stride = args.cos_sin_cache.stride[0];
  common.max_position = args.cos_sin_cache.shape[0];
  common.positions = args.positions.data;
  common.positions_stride = args.positions.stride[0];
  common.positions_int64 = args.positions.dtype == DType::kInt64;
  common.num_tokens = num_tokens;
  common.neox = args.style == RopeStyle::kNeox;

  // Query rows: q_out's first 512 values are the nope part, the last 64 the rope part.
  RopeRowsParams q = common;
  const int64_t out_elem = int64_t(dtype_size(args.q_out.dtype));
  q.nope_in = args.q_nope.data;
  q.nope_in_stride_t = args.q_nope.stride[0];
  q.nope_in_stride_h = args.q_nope.stride[1];
  q.pe_in = args.q_pe.data;
  q.pe_in_stride_t = args.q_pe.stride[0];
  q.pe_in_stride_h = args.q_pe.stride[1];
  q.nope_out = args.q_out.data;
  q.nope_out_stride_t = args.q_out.stride[0];
  q.nope_out_stride_h = args.q_out.stride[1];
  q.pe_out = static_cast<char*>(args.q_out.data) + kKvLoraRank * out_elem;
  q.pe_out_stride_t = args.q_out.stride[0];
  q.pe_out_stride_h = args.q_out.stride[1];
  q.num_heads = int(args.q_nope.shape[1]);
  q.scale = args.q_scale;
  q.vectorised = rows_aligned16(args.q_nope) && rows_aligned16(args.q_pe) &&
                 rows_aligned16(args.q_out);
  if (q.num_heads > 0) launch_rows(q, args.q_nope.dtype, args.q_out.dtype, stream);

  if (args.k_nope.empty()) return;
  RopeRowsParams k = common;
  k.nope_in = args.k_nope.data;
  k.nope_in_stride_t = args.k_nope.stride[0];
  k.pe_in = args.k_pe.data;
  k.pe_in_stride_t = args.k_pe.stride[0];
  k.nope_out = args.k_nope_out.data;
  k.nope_out_stride_t = args.k_nope_out.stride[0];
  k.pe_out = args.k_pe_out.data;
  k.pe_out_stride_t = args.k_pe_out.stride[0];
  k.num_heads = 1;  // head strides stay 0
  k.scale = args.k_scale;
  k.vectorised = rows_aligned16(args.k_nope) && rows_aligned16(args.k_pe) &&
                 rows_aligned16(args.k_nope_out) && rows_aligned16(args.k_pe_out);
  launch_rows(k, args.k_nope.dtype, args.k_nope_out.dtype, stream);
}

}  // namespace mla::cuda
