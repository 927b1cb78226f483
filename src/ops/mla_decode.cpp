// mla_decode: public entry — validation, then device dispatch.
//
// Everything that can be checked without reading tensor contents is checked here, for both
// devices. Checks that need host values (cu_q_lens, kv_lens, page ids) are done by the CPU
// implementation; the GPU path relies on the planner for them.
#include "cpu/cpu_ops.hpp"
#include "mla/error.hpp"
#include "mla/schedule.hpp"
#include "ops/dispatch.hpp"
#include "ops/validate_common.hpp"
#if defined(MLA_WITH_CUDA)
#include "cuda/cuda_ops.hpp"
#endif

namespace mla {

void mla_decode(const MlaDecodeArgs& args, Stream stream) {
  constexpr const char* op = "mla_decode";

  // kv_cache [P, S, 576]
  check::ndim(op, "kv_cache", args.kv_cache, 3);
  check::dtype_in(op, "kv_cache", args.kv_cache, {DType::kBF16, DType::kFP16, DType::kFP8E4M3});
  check::dim(op, "kv_cache", args.kv_cache, 2, kLatentDim, "kv_lora_rank 512 + rope 64");
  const int64_t page_size = args.kv_cache.shape[1];
  MLA_CHECK(detail::is_power_of_two(page_size) && page_size <= kMaxPageSize, op,
            ": page size kv_cache.shape[1] must be a power of two in 1..", kMaxPageSize, ", got ",
            page_size, " (", args.kv_cache.describe(), ")");
  check::contiguous(op, "kv_cache", args.kv_cache);
  const DType cache_dtype = args.kv_cache.dtype;

  // Queries: q [T, H, 576], or q_nope [T, H, 512] with q_pe [T, H, 64].
  const bool fused_q = !args.q.empty();
  const bool split_q = !args.q_nope.empty() || !args.q_pe.empty();
  MLA_CHECK(!(fused_q && split_q), op,
            ": give either q or q_nope/q_pe, not both (q is ", args.q.describe(), ", q_nope is ",
            args.q_nope.describe(), ")");
  MLA_CHECK(fused_q || split_q, op, ": q is required (or q_nope and q_pe), none was given");
  const char* q_name = fused_q ? "q" : "q_nope";
  const TensorView& q_first = fused_q ? args.q : args.q_nope;
  check::ndim(op, q_name, q_first, 3);
  const int64_t num_tokens = q_first.shape[0];
  const int64_t num_heads = q_first.shape[1];
  MLA_CHECK(num_heads >= 1 && num_heads <= kMaxHeads, op, ": number of heads (", q_name,
            ".shape[1]) must be in 1..", kMaxHeads, ", got ", num_heads);
  const std::initializer_list<DType> q_dtypes = {DType::kBF16, DType::kFP16, DType::kFP8E4M3};
  if (fused_q) {
    check::dim(op, "q", args.q, 2, kLatentDim, "absorbed q_nope 512 + q_pe 64");
    check::dtype_in(op, "q", args.q, q_dtypes);
    check::inner_contiguous(op, "q", args.q);
  } else {
    check::dim(op, "q_nope", args.q_nope, 2, kKvLoraRank, "absorbed q_nope");
    check::dtype_in(op, "q_nope", args.q_nope, q_dtypes);
    check::inner_contiguous(op, "q_nope", args.q_nope);
    check::ndim(op, "q_pe", args.q_pe, 3);
    check::dim(op, "q_pe", args.q_pe, 0, num_tokens, "tokens, as q_nope");
    check::dim(op, "q_pe", args.q_pe, 1, num_heads, "heads, as q_nope");
    check::dim(op, "q_pe", args.q_pe, 2, kRopeDim, "rope dim");
    check::dtype(op, "q_pe", args.q_pe, args.q_nope.dtype);
    check::inner_contiguous(op, "q_pe", args.q_pe);
  }
  const DType q_dtype = q_first.dtype;
  if (q_dtype == DType::kFP8E4M3) {
    MLA_CHECK(cache_dtype == DType::kFP8E4M3, op, ": ", q_name,
              " is fp8e4m3, which needs an fp8e4m3 kv_cache, but kv_cache is ",
              dtype_name(cache_dtype));
  } else if (cache_dtype != DType::kFP8E4M3) {
    MLA_CHECK(q_dtype == cache_dtype, op, ": ", q_name, " must have the kv_cache dtype ",
              dtype_name(cache_dtype), ", got ", dtype_name(q_dtype));
  }

  // Batch description.
  check::ndim(op, "block_table", args.block_table, 2);
  check::dtype(op, "block_table", args.block_table, DType::kInt32);
  check::inner_contiguous(op, "block_table", args.block_table);
  const int64_t batch = args.block_table.shape[0];
  check::ndim(op, "kv_lens", args.kv_lens, 1);
  check::dim(op, "kv_lens", args.kv_lens, 0, batch, "requests, as block_table.shape[0]");
  MLA_CHECK(args.block_table.shape[1] <= kMaxKeysPerRequest / page_size, op, ": block_table has ",
            args.block_table.shape[1], " pages a request of ", page_size, " tokens = ",
            args.block_table.shape[1] * page_size, " keys; at most ", kMaxKeysPerRequest,
            " keys a request are supported");
  check::dtype(op, "kv_lens", args.kv_lens, DType::kInt32);
  check::contiguous(op, "kv_lens", args.kv_lens);
  MLA_CHECK(args.max_q_len >= 0, op, ": max_q_len must be >= 0 (0 = derive), got ",
            args.max_q_len);
  if (!args.cu_q_lens.empty()) {
    check::ndim(op, "cu_q_lens", args.cu_q_lens, 1);
    check::dim(op, "cu_q_lens", args.cu_q_lens, 0, batch + 1,
               "requests + 1, as block_table.shape[0] + 1");
    check::dtype(op, "cu_q_lens", args.cu_q_lens, DType::kInt32);
    check::contiguous(op, "cu_q_lens", args.cu_q_lens);
  } else {
    MLA_CHECK(args.q_len >= 1, op, ": q_len must be >= 1 when cu_q_lens is not given, got ",
              args.q_len);
    MLA_CHECK(num_tokens == batch * args.q_len, op, ": ", q_name, " has ", num_tokens,
              " tokens but block_table has ", batch, " requests x q_len ", args.q_len, " = ",
              batch * args.q_len);
    MLA_CHECK(args.max_q_len == 0 || args.max_q_len >= args.q_len, op, ": max_q_len ",
              args.max_q_len, " is smaller than q_len ", args.q_len);
  }
  detail::check_softmax_scale(op, args.softmax_scale);
  detail::check_scale(op, "q_scale", args.q_scale);
  detail::check_scale(op, "k_scale", args.k_scale);

  // Outputs.
  detail::check_attention_outputs(
      op, q_name, args.out, args.lse, num_tokens, num_heads, kKvLoraRank, "kv_lora_rank",
      {{"q", &args.q}, {"q_nope", &args.q_nope}, {"q_pe", &args.q_pe}, {"kv_cache", &args.kv_cache},
       {"block_table", &args.block_table}, {"kv_lens", &args.kv_lens},
       {"cu_q_lens", &args.cu_q_lens}});

  const Device device = detail::common_device(
      op, {{"q", &args.q}, {"q_nope", &args.q_nope}, {"q_pe", &args.q_pe},
           {"kv_cache", &args.kv_cache}, {"block_table", &args.block_table},
           {"kv_lens", &args.kv_lens}, {"cu_q_lens", &args.cu_q_lens}, {"out", &args.out},
           {"lse", &args.lse}});
  MLA_CHECK(batch > 0 || num_tokens == 0, op, ": ", q_name, " has ", num_tokens,
            " tokens but block_table has no requests");
  MLA_CHECK(!args.deterministic || args.schedule == nullptr || args.schedule->split_keys > 0, op,
            ": deterministic = true takes no balanced schedule (its cuts depend on the whole "
            "batch): pass schedule = nullptr (every request unsplit) or a schedule made by "
            "make_deterministic_decode_schedule");
  MLA_CHECK(args.deterministic || args.schedule == nullptr || args.schedule->split_keys == 0, op,
            ": the schedule was made by make_deterministic_decode_schedule (split_keys ",
            args.schedule == nullptr ? 0 : args.schedule->split_keys,
            "), which plans the tiles of deterministic = true; set deterministic = true or "
            "use a schedule from make_decode_schedule");
  if (batch == 0 || num_tokens == 0) return;  // nothing to compute: no bound needed
  MLA_CHECK(device.type == DeviceType::kCPU || args.cu_q_lens.empty() || args.max_q_len > 0, op,
            ": max_q_len must be given (> 0) with cu_q_lens on ", device_name(device),
            " (only the CPU derives it from cu_q_lens)");
  detail::run_on(op, device, [&] { cpu::mla_decode(args); },
                 [&] {
#if defined(MLA_WITH_CUDA)
                   cuda::mla_decode(args, stream);
#endif
                 });
  (void)stream;
}

const char* mla_decode_kernel_name(const MlaDecodeArgs& args) {
  const TensorView& q = args.q.empty() ? args.q_nope : args.q;
  if (q.device.type == DeviceType::kCPU) return "cpu";
#if defined(MLA_WITH_CUDA)
  return cuda::mla_decode_kernel_name(args);
#else
  MLA_FAIL("mla_decode: this build of mla has no CUDA support, got ", device_name(q.device));
#endif
}

}  // namespace mla
