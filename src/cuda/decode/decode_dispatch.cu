// cuda::mla_decode: builds the decode kernels' parameters from validated MlaDecodeArgs and
// dispatches on (compute dtype, row-tile class) — the only place that chooses an instantiation.
//
// Called by the public mla::mla_decode after it validated shapes, dtypes and devices; the checks
// here cover what only the GPU path requires (16-byte aligned cache, a 16-bit compute dtype that
// query and cache share, max_q_len with cu_q_lens, a schedule that matches the call).
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <atomic>
#include <climits>
#include <cstdint>
#include <string>
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "cuda/common/trace.cuh"
#include "cuda/cuda_check.hpp"
#include "cuda/cuda_ops.hpp"
#include "cuda/decode/decode_launch.hpp"
#include "cuda/host_metadata.hpp"
#if defined(MLA_HOPPER_DECODE)
#include "cuda/decode/decode_hopper.hpp"
#endif
#include "mla/schedule.hpp"

namespace mla::cuda {
namespace {

using namespace decode;

bool aligned(const void* ptr, size_t bytes) { return reinterpret_cast<uintptr_t>(ptr) % bytes == 0; }
bool is16(DType d) { return d == DType::kBF16 || d == DType::kFP16; }

template <typename T>
void launch_for_rows(int block_m, const DecodeParams& params, int grid, cudaStream_t stream) {
  switch (block_m) {
    case 16: launch_decode_kernel<T, 1>(params, grid, stream); break;
    case 32: launch_decode_kernel<T, 2>(params, grid, stream); break;
    case 64: launch_decode_kernel<T, 4>(params, grid, stream); break;
    default: MLA_FAIL("mla_decode: no decode kernel for row tiles of ", block_m, " rows");
  }
}

// The query as (nope, pe) pointers and strides, whether it is one 576-wide tensor or two.
struct QueryParts {
  const void* nope;
  const void* pe;
  int64_t nope_stride_t, nope_stride_h, pe_stride_t, pe_stride_h;
  DType dtype;
};
QueryParts query_parts(const MlaDecodeArgs& args) {
  QueryParts q{};
  if (args.q.empty()) {
    q = {args.q_nope.data, args.q_pe.data, args.q_nope.stride[0], args.q_nope.stride[1],
         args.q_pe.stride[0], args.q_pe.stride[1], args.q_nope.dtype};
  } else {
    const void* pe = static_cast<const char*>(args.q.data) + kKvLoraRank * dtype_size(args.q.dtype);
    q = {args.q.data, pe, args.q.stride[0], args.q.stride[1], args.q.stride[0], args.q.stride[1],
         args.q.dtype};
  }
  return q;
}

// Every query row starts on a 16-byte boundary: 16-byte vector loads.
bool query_rows_aligned(const QueryParts& q) {
  const int64_t vec = int64_t(16 / dtype_size(q.dtype));
  return aligned(q.nope, 16) && aligned(q.pe, 16) && q.nope_stride_t % vec == 0 &&
         q.nope_stride_h % vec == 0 && q.pe_stride_t % vec == 0 && q.pe_stride_h % vec == 0;
}

// The call's row tile: the device's widest in the deterministic mode (so that a request's tiles do
// not depend on the other requests' query counts), else the narrowest that holds a request's rows.
int call_block_m(const MlaDecodeArgs& args, int64_t num_heads) {
  const int cap = device_row_tile_cap();
  const int64_t max_q_len = args.cu_q_lens.empty() ? args.q_len : args.max_q_len;
  return args.deterministic ? cap : block_m_for_rows(max_q_len * num_heads, cap);
}

// The query's head count, read before mla_decode has checked its shape (1 where it has no second
// dimension).
int64_t query_heads(const MlaDecodeArgs& args) {
  const TensorView& q_main = args.q.empty() ? args.q_nope : args.q;
  return q_main.ndim >= 2 ? q_main.shape[1] : 1;
}

// Why the Hopper kernel does not apply to these arguments, or "" when it does.
std::string hopper_mismatch(const MlaDecodeArgs& args, const QueryParts& q) {
#if !defined(MLA_HOPPER_DECODE)
  (void)args;
  (void)q;
  return "this build has no Hopper kernel (it needs 90a in MLA_CUDA_ARCHS and the CuTe headers)";
#else
  const DeviceInfo& info = current_device_info();
  if (info.cc_major != 9)
    return "device " + std::to_string(info.device) + " is sm_" + std::to_string(info.cc_major) +
           std::to_string(info.cc_minor) + ", not sm_90";
  const DType kv = args.kv_cache.dtype;
  if (is16(q.dtype) && is16(kv) && q.dtype != kv)
    return std::string("the query (") + std::string(dtype_name(q.dtype)) + ") and kv_cache (" + std::string(dtype_name(kv)) +
           ") dtypes differ";
  // (mla_decode refuses an fp8 query with a 16-bit cache before; mla_decode_kernel_name does not)
  if (!is16(q.dtype) && is16(kv))
    return "the query is fp8e4m3 and the kv_cache " + std::string(dtype_name(kv)) + " (an fp8 query needs an fp8 cache)";
  const int64_t page_size = args.kv_cache.shape[1];
  if (page_size < 16) return "the page size " + std::to_string(page_size) + " is below 16";
  const int64_t rows = args.kv_cache.shape[0] * page_size;
  if (rows < 1 || rows > INT_MAX)
    return "the kv_cache has " + std::to_string(rows) + " token slots (needs 1 to 2^31 - 1)";
  if (!query_rows_aligned(q)) return "the query rows are not 16-byte aligned";
  return "";
#endif
}

// kAuto's choice. With `deterministic`, the Hopper kernel wherever it applies. Otherwise, from
// 17 query rows a request on, the Hopper kernel. At 16 rows or fewer (16 heads, one query; its
// narrow consumers) it streams the cache faster but starts slower, so it pays by the key tiles
// each SM streams. On an H200, against the portable kernel (16 heads, the same tiles as 1-8
// heads; docs/perf-notes.md), by 64-key tiles an SM: 1.9 (B 1 kv 16k) +14 %, 3.9 (B 32 kv 1k)
// +5 %, 7.75 (B 16 kv 4k, B 64 kv 1k) +2 to +3 %, 15.5 (B 32 kv 4k, B 128 kv 1k) -5 to -3 %,
// 31 (B 16 kv 16k, B 64 kv 4k) -9 to -10 %; below a batch of 16 it is slower at any length.
// The lengths are on the device, so the tiles are bounded by the block table's width: the
// Hopper kernel from a batch of 16 when that width allows 12 tiles an SM. A table as wide as
// the longest context an engine serves then picks it from a batch of 16 whatever the lengths
// (at most +5 %, at short ones).
//
// An fp8 cache takes the same rule from 17 rows on, with any query (H100, 128 heads: B 128 kv
// 4k -43 % with a bf16 or fp8 query, -48 % with an fp16 one; B 1 kv 16k -25 %). At 16 rows or
// fewer it halves the bytes a tile and the portable kernel's conversion pass costs more there,
// so the Hopper kernel wins from far fewer tiles: on an H100 (16 heads; docs/perf-notes.md) B 4
// kv 16k -17 %, B 8 kv 4k -10 %, B 16 kv 1k -11 %, B 32 kv 1k -10 %, B 16 and 64 at 7.75 tiles
// an SM -16 %, but batch 1 +5 to +6 % (kv 4k and 16k: one split request, the combine's share
// larger): from a batch of 4.
constexpr int64_t kHopperMinRows = 17;
constexpr int64_t kHopperFewRowsMinBatch = 16;
constexpr int64_t kHopperFewRowsMinTilesPerSm = 12;
constexpr int64_t kHopperFp8MinBatch = 4;

bool use_hopper(const MlaDecodeArgs& args, const QueryParts& q) {
  if (args.kernel == DecodeKernel::kPortable) return false;
  const std::string why = hopper_mismatch(args, q);
  MLA_CHECK(args.kernel != DecodeKernel::kHopper || why.empty(),
            "mla_decode: kernel = DecodeKernel::kHopper, but ", why);
  if (!why.empty()) return false;
  if (args.kernel == DecodeKernel::kHopper) return true;
  // kAuto from here on. Deterministic: one kernel whatever the batch size (64-row tiles, unsplit).
  if (args.deterministic) return true;
  const int64_t max_q_len = args.cu_q_lens.empty() ? args.q_len : args.max_q_len;
  if (max_q_len * query_heads(args) >= kHopperMinRows) return true;
  const int64_t batch = args.kv_lens.shape[0];
  if (args.kv_cache.dtype == DType::kFP8E4M3) return batch >= kHopperFp8MinBatch;
  const int64_t width_tiles = (args.block_table.shape[1] * args.kv_cache.shape[1] + kBlockN - 1) / kBlockN;
  return batch >= kHopperFewRowsMinBatch &&
         batch * width_tiles >= kHopperFewRowsMinTilesPerSm * current_device_info().sm_count;
}

// MlaDecodeArgs::check_metadata: the lengths and the block table copied to the host and checked
// by the CPU path's checks (kv_lens and cu_q_lens are contiguous, block_table inner-contiguous:
// checked before).
void check_metadata_on_host(const MlaDecodeArgs& args, int64_t num_tokens, cudaStream_t stream) {
  require_not_capturing("mla_decode", "the lengths and the block table", stream);
  const int64_t batch = args.block_table.shape[0];
  const int64_t max_blocks = args.block_table.shape[1];
  std::vector<int32_t> kv_lens = copy_int32_to_host(args.kv_lens, 1, batch, batch, stream);
  std::vector<int32_t> block_table =
      copy_int32_to_host(args.block_table, batch, max_blocks, args.block_table.stride[0], stream);
  std::vector<int32_t> cu_q_lens = args.cu_q_lens.empty()
                                       ? std::vector<int32_t>{}
                                       : copy_int32_to_host(args.cu_q_lens, 1, batch + 1, batch + 1, stream);
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  MlaDecodeArgs host = args;
  host.kv_lens = host_int32_view(kv_lens, {batch});
  host.block_table = host_int32_view(block_table, {batch, max_blocks});
  if (!cu_q_lens.empty()) host.cu_q_lens = host_int32_view(cu_q_lens, {batch + 1});
  cpu::check_decode_metadata(host, num_tokens);
}

}  // namespace

const char* mla_decode_kernel_name(const MlaDecodeArgs& args) {
  const DeviceGuard guard((args.q.empty() ? args.q_nope : args.q).device);  // the one checked
  return use_hopper(args, query_parts(args)) ? "sm90-wgmma" : "sm80-mma";
}

void mla_decode(const MlaDecodeArgs& args, Stream stream) {
  constexpr const char* op = "mla_decode";
  const DeviceGuard guard(args.kv_cache.device);  // device queries and launches on the tensors' device
  const bool split_q = args.q.empty();
  const TensorView& q_main = split_q ? args.q_nope : args.q;
  const int64_t num_tokens = q_main.shape[0];
  const int64_t num_heads = q_main.shape[1];
  const int64_t batch = args.kv_lens.shape[0];
  MLA_CHECK(num_tokens <= INT_MAX / 2 && batch <= INT_MAX / 2, op, ": ", num_tokens, " tokens and ",
            batch, " requests exceed the GPU kernel's 32-bit indexing");
  MLA_CHECK(num_heads >= 1 && num_heads <= kMaxHeads, op, ": the GPU kernel supports 1 to ", kMaxHeads,
            " heads, got ", num_heads);
  // A request's rows (q_len * H) are 32-bit in the kernels; T * H bounds them.
  MLA_CHECK(num_tokens * num_heads <= INT_MAX, op, ": ", num_tokens, " tokens x ", num_heads,
            " heads exceed the GPU kernel's 32-bit row indexing");
  if (args.check_metadata) check_metadata_on_host(args, num_tokens, to_cuda(stream));

  // Compute dtype: the 16-bit dtype of the query or the cache; fp8 operands are converted to it.
  const DType q_dtype = q_main.dtype;
  const DType kv_dtype = args.kv_cache.dtype;
  const DType compute = is16(q_dtype) ? q_dtype : is16(kv_dtype) ? kv_dtype : DType::kBF16;
  MLA_CHECK((q_dtype == compute || q_dtype == DType::kFP8E4M3) &&
                (kv_dtype == compute || kv_dtype == DType::kFP8E4M3),
            op, ": on the GPU the query (", dtype_name(q_dtype), ") and kv_cache (",
            dtype_name(kv_dtype), ") must share one 16-bit dtype (bf16 or fp16), either may be fp8");
  if (split_q) {
    MLA_CHECK(args.q_pe.dtype == q_dtype, op, ": q_pe dtype ", dtype_name(args.q_pe.dtype),
              " must match q_nope dtype ", dtype_name(q_dtype));
  }

  const int64_t page_size = args.kv_cache.shape[1];
  int page_shift = 0;
  while ((int64_t(1) << page_shift) < page_size) ++page_shift;
  MLA_CHECK(page_size >= 1 && page_size <= kMaxPageSize && (int64_t(1) << page_shift) == page_size,
            op, ": page size (kv_cache.shape[1]) must be a power of two in [1, ", kMaxPageSize,
            "], got ", page_size);
  MLA_CHECK(aligned(args.kv_cache.data, 16), op,
            ": kv_cache must be 16-byte aligned on the GPU, got address ", args.kv_cache.data);

  const bool has_cu = !args.cu_q_lens.empty();
  const int max_q_len = has_cu ? args.max_q_len : args.q_len;
  MLA_CHECK(max_q_len >= 1, op, has_cu ? ": max_q_len must be >= 1 on the GPU when cu_q_lens is given"
                                       : ": q_len must be >= 1", ", got ", max_q_len);
  if (num_tokens == 0 || batch == 0) return;

  DecodeParams p{};
#if defined(MLA_DECODE_TRACE) && MLA_DECODE_TRACE
  // Trace builds: one buffer for the process (common/trace.cuh), zeroed once.
  static unsigned long long* trace = [] {
    void* buf = nullptr;
    const size_t bytes = sizeof(unsigned long long) * kDecodeTraceBufferWords;
    MLA_CUDA_CHECK(cudaMalloc(&buf, bytes));
    MLA_CUDA_CHECK(cudaMemset(buf, 0, bytes));
    return static_cast<unsigned long long*>(buf);
  }();
  p.trace = trace;
#endif
  const QueryParts qp = query_parts(args);
  p.q_nope = qp.nope;
  p.q_pe = qp.pe;
  p.q_nope_stride_t = qp.nope_stride_t;
  p.q_nope_stride_h = qp.nope_stride_h;
  p.q_pe_stride_t = qp.pe_stride_t;
  p.q_pe_stride_h = qp.pe_stride_h;
  p.q_is_fp8 = q_dtype == DType::kFP8E4M3;
  p.q_vector_ok = query_rows_aligned(qp);
  const bool hopper = use_hopper(args, qp);

  p.kv_cache = args.kv_cache.data;
  p.num_pages = args.kv_cache.shape[0];
  p.page_shift = page_shift;
  p.kv_is_fp8 = kv_dtype == DType::kFP8E4M3;
  p.block_table = static_cast<const int32_t*>(args.block_table.data);
  p.block_table_stride_b = args.block_table.stride[0];
  p.block_table_stride_j = args.block_table.stride[1];

  BatchLayout& layout = p.layout;
  layout.kv_lens = static_cast<const int32_t*>(args.kv_lens.data);
  layout.kv_lens_stride = args.kv_lens.stride[0];
  layout.cu_q_lens = has_cu ? static_cast<const int32_t*>(args.cu_q_lens.data) : nullptr;
  layout.cu_q_lens_stride = has_cu ? args.cu_q_lens.stride[0] : 0;
  layout.q_len = has_cu ? 0 : args.q_len;
  layout.max_q_len = max_q_len;
  layout.num_tokens = int(num_tokens);
  const int64_t max_kv = args.block_table.shape[1] * page_size;
  layout.max_kv_len = max_kv > INT_MAX ? INT_MAX : int(max_kv);
  layout.batch_size = int(batch);
  layout.num_heads = int(num_heads);

  const bool fp8_cache = kv_dtype == DType::kFP8E4M3;
  const float score_scale = args.softmax_scale * (p.q_is_fp8 ? args.q_scale : 1.0f) *
                            (fp8_cache ? args.k_scale : 1.0f);
  p.score_scale_log2 = score_scale * 1.4426950408889634f;
  p.out_scale = fp8_cache ? args.k_scale : 1.0f;

  p.out = args.out.data;
  p.out_stride_t = args.out.stride[0];
  p.out_stride_h = args.out.stride[1];
  switch (args.out.dtype) {
    case DType::kBF16: p.out_dtype = kOutBF16; break;
    case DType::kFP16: p.out_dtype = kOutFP16; break;
    case DType::kFP32: p.out_dtype = kOutFP32; break;
    default: MLA_FAIL(op, ": out dtype must be bf16, fp16 or fp32, got ", dtype_name(args.out.dtype));
  }
  const size_t out_elem = dtype_size(args.out.dtype);
  // Every output row starts at a multiple of `elems` elements (and its base is that aligned).
  const auto rows_aligned = [&](int64_t elems) {
    return aligned(args.out.data, size_t(elems) * out_elem) && p.out_stride_t % elems == 0 &&
           p.out_stride_h % elems == 0;
  };
  p.out_pair_ok = rows_aligned(2);
  p.out_quad_ok = rows_aligned(4);
  if (!args.lse.empty()) {
    p.lse = static_cast<float*>(args.lse.data);
    p.lse_stride_t = args.lse.stride[0];
    p.lse_stride_h = args.lse.stride[1];
  }

  // Row tiles of at most the widest this device's portable kernel runs (64 on Hopper and A100,
  // 16 on sm_86 / sm_89; call_block_m).
  const int block_m = call_block_m(args, num_heads);
  const int64_t tiles_per_request = (int64_t(max_q_len) * num_heads + block_m - 1) / block_m;
  p.tiles_per_request = int(tiles_per_request);
  int grid = 0;
  if (args.schedule != nullptr) {
    const DecodeSchedule& s = *args.schedule;
    MLA_CHECK(s.workspace != nullptr, op, ": schedule has no workspace (make_decode_schedule)");
    MLA_CHECK(args.kv_lens.device.index == s.device, op, ": the schedule's workspace is on cuda:",
              s.device, " but the tensors are on ", device_name(args.kv_lens.device));
    MLA_CHECK(s.num_heads == num_heads, op, ": the schedule was made for ", s.num_heads,
              " heads but ", split_q ? "q_nope" : "q", " has ", num_heads);
    MLA_CHECK(batch <= s.max_batch, op, ": batch of ", batch,
              " requests exceeds the schedule's max_batch ", s.max_batch);
    MLA_CHECK(max_q_len <= s.max_q_len, op, ": max_q_len ", max_q_len,
              " exceeds the schedule's max_q_len ", s.max_q_len);
    // A deterministic plan cuts at most max_kv_len keys of a request (plan_decode clamps to it):
    // the block table must not hold more, or the keys past it would be left out.
    const int64_t table_keys = args.block_table.shape[1] * args.kv_cache.shape[1];
    MLA_CHECK(s.split_keys == 0 || table_keys <= s.max_kv_len, op, ": block_table holds up to ",
              table_keys, " keys a request (", args.block_table.shape[1], " pages of ",
              args.kv_cache.shape[1], ") but the deterministic schedule was made for max_kv_len ",
              s.max_kv_len, " (make_deterministic_decode_schedule)");
    char* ws = static_cast<char*>(s.workspace);
    p.has_schedule = 1;
    p.schedule.header = reinterpret_cast<const ScheduleHeader*>(ws + s.header_offset);
    p.schedule.items = reinterpret_cast<const WorkItem*>(ws + s.items_offset);
    p.schedule.part_begin = reinterpret_cast<const int*>(ws + s.part_begin_offset);
    p.schedule.split_units = reinterpret_cast<const SplitUnit*>(ws + s.split_units_offset);
    p.schedule.partial_lse = reinterpret_cast<float*>(ws + s.partial_lse_offset);
    p.schedule.lse_stride = s.max_slots;
    p.schedule.partial_out = ws + s.partial_out_offset;
    p.schedule.num_parts = s.num_parts;
    p.schedule.split_keys = s.split_keys;
    p.plan_lanes = plan_lanes(max_q_len, num_heads, block_m, s.num_parts);
    grid = s.num_parts;
  } else {
    const int64_t ctas = batch * tiles_per_request;
    MLA_CHECK(ctas <= INT_MAX, op, ": ", ctas, " thread blocks exceed the grid limit");
    grid = int(ctas);
  }

  const cudaStream_t cs = to_cuda(stream);
  if (hopper) {
#if defined(MLA_HOPPER_DECODE)
    if (compute == DType::kBF16) launch_hopper_decode_kernel<__nv_bfloat16>(p, block_m, grid, cs);
    else launch_hopper_decode_kernel<__half>(p, block_m, grid, cs);
#endif
  } else if (compute == DType::kBF16) {
    launch_for_rows<__nv_bfloat16>(block_m, p, grid, cs);
  } else {
    launch_for_rows<__half>(block_m, p, grid, cs);
  }
  if (p.has_schedule) launch_combine_kernel(p, cs);
  if (args.zero_padding_rows && has_cu) launch_zero_padding_rows(p, cs);
}

namespace {
std::atomic<size_t> g_shared_memory_limit{0};  // 0: the device's
}  // namespace

size_t decode_shared_memory_limit(size_t device_limit) {
  const size_t test_limit = g_shared_memory_limit.load(std::memory_order_relaxed);
  return test_limit > 0 && test_limit < device_limit ? test_limit : device_limit;
}
void set_decode_shared_memory_limit(size_t bytes) {
  g_shared_memory_limit.store(bytes, std::memory_order_relaxed);
}
}  // namespace mla::cuda

namespace mla::cuda::decode {
int device_row_tile_cap() {
  return widest_row_tile(
      decode_shared_memory_limit(size_t(current_device_info().max_smem_per_block_optin)));
}
}  // namespace mla::cuda::decode
