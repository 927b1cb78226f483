// Parameters of the mha_prefill kernel family (ragged non-absorbed attention, q/k 192, v 128).
// Plain data: filled by the dispatcher (mha_prefill.cu), passed as a __grid_constant__.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mla::cuda::prefill {

enum class OutKind : int32_t { kBF16, kFP16, kFP32 };

struct MhaPrefillParams {
  const void* q;              // [Tq, H, 192] input dtype, inner stride 1, rows 16-byte aligned
  const void* k;              // [Tk, H, 192] input dtype
  const void* v;              // [Tk, H, 128] input dtype
  void* out;                  // [Tq, H, 128] bf16/fp16/fp32 (out_kind)
  float* lse;                 // [Tq, H] fp32, or nullptr
  const int32_t* cu_q_lens;   // [B + 1] request b owns q rows [cu_q_lens[b], cu_q_lens[b+1])
  const int32_t* cu_kv_lens;  // [B + 1] request b owns kv rows [cu_kv_lens[b], cu_kv_lens[b+1])

  // Strides in elements.
  int64_t q_token_stride, q_head_stride;
  int64_t k_token_stride, k_head_stride;
  int64_t v_token_stride, v_head_stride;
  int64_t out_token_stride, out_head_stride;
  int64_t lse_token_stride, lse_head_stride;

  int32_t num_q_tokens;   // Tq: cu_q_lens are clamped to [0, Tq]
  int32_t num_kv_tokens;  // Tk: cu_kv_lens are clamped to [0, Tk]
  int32_t num_heads;      // H (grid y)
  int32_t num_requests;   // B (grid z)
  bool causal;            // bottom-right aligned: query i sees keys <= kv_len - q_len + i
  float score_scale_log2; // softmax_scale * q_scale * k_scale * log2(e)
  float v_scale;          // applied to the normalised output
  OutKind out_kind;
};

// One instantiation per input element type (__nv_bfloat16, __half, __nv_fp8_e4m3), each in its
// own .cu file. grid_m = ceil(min(max_q_len, Tq) / kBlockM).
template <typename In>
void launch_mha_prefill(const MhaPrefillParams& params, int grid_m, cudaStream_t stream);
extern template void launch_mha_prefill<__nv_bfloat16>(const MhaPrefillParams&, int, cudaStream_t);
extern template void launch_mha_prefill<__half>(const MhaPrefillParams&, int, cudaStream_t);
extern template void launch_mha_prefill<__nv_fp8_e4m3>(const MhaPrefillParams&, int, cudaStream_t);

}  // namespace mla::cuda::prefill
