// cuda::mha_prefill: GPU-specific checks (launch bound, alignment), params, dispatch by input type.
// Shapes, dtypes and devices were validated by the public entry (src/ops/mha_prefill.cpp).
#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/cuda_ops.hpp"
#include "cuda/host_metadata.hpp"
#include "cuda/prefill/prefill_params.cuh"

namespace mla::cuda {
namespace {

constexpr const char* kOp = "mha_prefill";
constexpr double kLog2e = 1.4426950408889634074;
constexpr int64_t kMaxTokens = INT32_MAX - 64;


prefill::OutKind out_kind_of(DType dtype) {
  switch (dtype) {
    case DType::kBF16: return prefill::OutKind::kBF16;
    case DType::kFP16: return prefill::OutKind::kFP16;
    case DType::kFP32: return prefill::OutKind::kFP32;
    default: MLA_FAIL(kOp, ": out must be bf16, fp16 or fp32, got ", dtype_name(dtype));
  }
}

// MhaPrefillArgs::check_metadata: the cumulative lengths (contiguous: checked before) copied to
// the host and checked by the CPU path's checks.
void check_metadata_on_host(const MhaPrefillArgs& args, cudaStream_t stream) {
  require_not_capturing(kOp, "cu_q_lens and cu_kv_lens", stream);
  const int64_t n = args.cu_q_lens.shape[0];
  std::vector<int32_t> cu_q = copy_int32_to_host(args.cu_q_lens, 1, n, n, stream);
  std::vector<int32_t> cu_kv = copy_int32_to_host(args.cu_kv_lens, 1, n, n, stream);
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  MhaPrefillArgs host = args;
  host.cu_q_lens = host_int32_view(cu_q, {n});
  host.cu_kv_lens = host_int32_view(cu_kv, {n});
  cpu::check_prefill_metadata(host);
}

}  // namespace

void mha_prefill(const MhaPrefillArgs& args, Stream stream) {
  constexpr int kBlockM = 64;  // PrefillConfig::kBlockM
  const DeviceGuard guard(args.q.device);
  const int64_t num_q_tokens = args.q.shape[0];
  const int64_t num_heads = args.q.shape[1];
  const int64_t num_requests = args.cu_q_lens.shape[0] - 1;
  if (num_q_tokens == 0 || num_heads == 0 || num_requests <= 0) return;

  MLA_CHECK(args.max_q_len > 0, kOp, ": max_q_len must be given (> 0) for CUDA tensors: it bounds "
            "every q_len_b and sets the launch shape without a device-to-host copy; got ",
            args.max_q_len);
  MLA_CHECK(num_requests <= 65535, kOp, ": at most 65535 requests per call on the GPU, got ",
            num_requests, " (cu_q_lens ", args.cu_q_lens.describe(), ")");
  MLA_CHECK(num_heads <= 65535, kOp, ": at most 65535 heads on the GPU, got ", num_heads);
  // Row indices within a request are 32-bit with a tile of headroom.
  const int64_t num_kv_tokens = args.k.shape[0];
  MLA_CHECK(num_q_tokens <= kMaxTokens && num_kv_tokens <= kMaxTokens, kOp, ": at most ", kMaxTokens,
            " query and key tokens per call on the GPU, got ", num_q_tokens, " and ", num_kv_tokens);
  // The kernel copies 16-byte chunks: every token and head step must keep rows 16-byte aligned.
  for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"q", &args.q},
                                {"k", &args.k}, {"v", &args.v}, {"out", &args.out}})
    check::rows_aligned16(kOp, name, *t, "on the GPU");
  if (args.check_metadata) check_metadata_on_host(args, to_cuda(stream));

  prefill::MhaPrefillParams p{};
  p.q = args.q.data;
  p.k = args.k.data;
  p.v = args.v.data;
  p.out = args.out.data;
  p.lse = args.lse.empty() ? nullptr : static_cast<float*>(args.lse.data);
  p.cu_q_lens = static_cast<const int32_t*>(args.cu_q_lens.data);
  p.cu_kv_lens = static_cast<const int32_t*>(args.cu_kv_lens.data);
  p.q_token_stride = args.q.stride[0];
  p.q_head_stride = args.q.stride[1];
  p.k_token_stride = args.k.stride[0];
  p.k_head_stride = args.k.stride[1];
  p.v_token_stride = args.v.stride[0];
  p.v_head_stride = args.v.stride[1];
  p.out_token_stride = args.out.stride[0];
  p.out_head_stride = args.out.stride[1];
  p.lse_token_stride = args.lse.empty() ? 0 : args.lse.stride[0];
  p.lse_head_stride = args.lse.empty() ? 0 : args.lse.stride[1];
  p.num_q_tokens = int32_t(num_q_tokens);
  p.num_kv_tokens = int32_t(num_kv_tokens);
  p.num_heads = int32_t(num_heads);
  p.num_requests = int32_t(num_requests);
  p.causal = args.causal;
  // The scales of fp8 inputs apply to the scores (q, k) and the output (v); 16-bit inputs ignore them.
  const bool fp8 = args.q.dtype == DType::kFP8E4M3;
  const double score_scale = double(args.softmax_scale) * (fp8 ? double(args.q_scale) * args.k_scale : 1.0);
  p.score_scale_log2 = float(score_scale * kLog2e);
  p.v_scale = fp8 ? args.v_scale : 1.0f;
  p.out_kind = out_kind_of(args.out.dtype);

  const int64_t max_q_len = std::min<int64_t>(args.max_q_len, num_q_tokens);
  const int grid_m = int((max_q_len + kBlockM - 1) / kBlockM);
  const cudaStream_t s = to_cuda(stream);
  switch (args.q.dtype) {
    case DType::kBF16: prefill::launch_mha_prefill<__nv_bfloat16>(p, grid_m, s); break;
    case DType::kFP16: prefill::launch_mha_prefill<__half>(p, grid_m, s); break;
    case DType::kFP8E4M3: prefill::launch_mha_prefill<__nv_fp8_e4m3>(p, grid_m, s); break;
    default: MLA_FAIL(kOp, ": q must be bf16, fp16 or fp8_e4m3, got ", dtype_name(args.q.dtype));
  }
}

}  // namespace mla::cuda
