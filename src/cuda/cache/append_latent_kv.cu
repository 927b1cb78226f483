// append_latent_kv on the GPU: scatter each token's latent (k_nope | k_pe, 576 values) into its
// slot of the paged pool, converting to the cache dtype (fp8: saturate(x / k_scale)).
//
// Algorithm: one thread per 16-byte chunk of a cache entry (8 values for a bf16/fp16 pool, 16 for
// fp8), so a token's 576 values are 72 (or 36) threads; a grid-stride loop covers T tokens. Each
// thread reads its token's slot, loads its chunk from k_nope or k_pe (16-byte loads when rows are
// aligned, else element by element), converts, and stores one 16-byte chunk of the entry.
//
// Device-side index handling (no host sync, so no exception): a token whose loc is negative
// (-1 = padding) or >= P * S is skipped and the pool is left untouched for it. The CPU path throws
// on loc < -1 or loc >= P * S instead, and so does this one with check_metadata (a host copy of
// loc checked by the CPU path's check before the launch). Two tokens naming the same slot race
// (the CPU keeps the later one); callers give distinct slots.
//
// History: v1 (this version) — chunk-per-thread scatter with 16-byte vector I/O.
#include "cpu/cpu_ops.hpp"
#include "cuda/common/elementwise.cuh"
#include "cuda/cuda_ops.hpp"
#include "cuda/host_metadata.hpp"

namespace mla::cuda {
namespace {

struct AppendParams {
  const void* k_nope;           // [T, 512] input dtype, row stride k_nope_stride
  int64_t k_nope_stride;
  const void* k_pe;             // [T, 64] input dtype, row stride k_pe_stride
  int64_t k_pe_stride;
  const void* loc;              // [T] int32/int64, element stride loc_stride
  int64_t loc_stride;
  bool loc_is_int64;
  void* kv_cache;               // [P, S, 576] cache dtype
  int64_t page_stride;          // kv_cache.stride[0]
  int64_t slot_stride;          // kv_cache.stride[1]
  int page_shift;               // log2(S)
  int64_t num_slots;            // P * S
  int64_t num_tokens;           // T
  float k_scale;                // fp8 pool: stored = saturate(x / k_scale)
  bool vectorised;              // every row 16-byte aligned
};

template <typename InT, typename CacheT>
__global__ void __launch_bounds__(256)
    append_latent_kv_kernel(const __grid_constant__ AppendParams p) {
  constexpr int kChunk = 16 / sizeof(CacheT);  // values per 16-byte cache chunk
  constexpr int kNopeChunks = kKvLoraRank / kChunk;
  constexpr int kChunksPerToken = kLatentDim / kChunk;
  const int64_t total = p.num_tokens * kChunksPerToken;
  for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < total;
       i += int64_t(gridDim.x) * blockDim.x) {
    const int64_t t = i / kChunksPerToken;  // token
    const int c = int(i % kChunksPerToken);  // chunk within the 576-wide entry
    const int64_t slot = load_index(p.loc, p.loc_is_int64, p.loc_stride, t);
    if (slot < 0 || slot >= p.num_slots) continue;

    const InT* src = c < kNopeChunks
        ? static_cast<const InT*>(p.k_nope) + t * p.k_nope_stride + c * kChunk
        : static_cast<const InT*>(p.k_pe) + t * p.k_pe_stride + (c - kNopeChunks) * kChunk;
    float values[kChunk];
    load_chunk<InT, kChunk>(src, p.vectorised, values);
    if constexpr (kIsFp8<CacheT>) {
#pragma unroll
      for (int k = 0; k < kChunk; ++k) values[k] = values[k] / p.k_scale;
    }
    const int64_t page = slot >> p.page_shift, offset = slot & ((int64_t(1) << p.page_shift) - 1);
    CacheT* dst = static_cast<CacheT*>(p.kv_cache) + page * p.page_stride +
                  offset * p.slot_stride + c * kChunk;
    store_chunk<CacheT, kChunk>(dst, p.vectorised, values);
  }
}

}  // namespace

void append_latent_kv(const AppendLatentKvArgs& args, Stream stream) {
  constexpr const char* op = "append_latent_kv";
  const DeviceGuard guard(args.kv_cache.device);
  const TensorView& cache = args.kv_cache;
  const int64_t page_size = cache.shape[1];
  int page_shift = 0;
  while ((int64_t(1) << page_shift) < page_size) ++page_shift;

  AppendParams p{};
  p.k_nope = args.k_nope.data;
  p.k_nope_stride = args.k_nope.stride[0];
  p.k_pe = args.k_pe.data;
  p.k_pe_stride = args.k_pe.stride[0];
  p.loc = args.loc.data;
  p.loc_stride = args.loc.stride[0];
  p.loc_is_int64 = args.loc.dtype == DType::kInt64;
  p.kv_cache = cache.data;
  p.page_stride = cache.stride[0];
  p.slot_stride = cache.stride[1];
  p.page_shift = page_shift;
  p.num_slots = cache.shape[0] * page_size;
  p.num_tokens = args.k_nope.shape[0];
  p.k_scale = args.k_scale;
  p.vectorised = rows_aligned16(args.k_nope) && rows_aligned16(args.k_pe) && rows_aligned16(cache);
  if (p.num_tokens == 0) return;
  if (args.check_metadata)  // loc is contiguous (checked before)
    check_index_vector_on_host(op, "loc", args, &AppendLatentKvArgs::loc, p.num_tokens, to_cuda(stream),
                               cpu::check_append_locs);

  constexpr int kThreads = 256;
  dispatch_float_dtype(op, "k_nope", args.k_nope.dtype, [&](auto in_tag) {
    using InT = decltype(in_tag);
    if constexpr (!kIsFp8<InT>) {
      dispatch_float_dtype(op, "kv_cache", cache.dtype, [&](auto cache_tag) {
        using CacheT = decltype(cache_tag);
        if constexpr (!std::is_same_v<CacheT, float>) {
          constexpr int kChunksPerToken = kLatentDim / (16 / sizeof(CacheT));
          const unsigned blocks = grid_blocks(p.num_tokens, kChunksPerToken, kThreads);
          append_latent_kv_kernel<InT, CacheT><<<blocks, kThreads, 0, to_cuda(stream)>>>(p);
          MLA_CUDA_CHECK_LAUNCH();
        } else {
          MLA_FAIL(op, ": kv_cache dtype must be bf16, fp16 or fp8e4m3, got fp32");
        }
      });
    } else {
      MLA_FAIL(op, ": k_nope dtype must be bf16, fp16 or fp32, got fp8e4m3");
    }
  });
}

}  // namespace mla::cuda
