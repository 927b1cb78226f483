// mha_prefill: public entry — validation, then device dispatch.
//
// Everything that can be checked without reading tensor contents is checked here, for both
// devices. Checks that need host values (cu_q_lens, cu_kv_lens) are done by the CPU
// implementation.
#include "cpu/cpu_ops.hpp"
#include "mla/error.hpp"
#include "ops/dispatch.hpp"
#include "ops/validate_common.hpp"
#if defined(MLA_WITH_CUDA)
#include "cuda/cuda_ops.hpp"
#endif

namespace mla {
namespace {

constexpr int kQkHeadDim = 192;  // qk_nope_head_dim 128 + rope 64
constexpr int kVHeadDim = 128;

}  // namespace

void mha_prefill(const MhaPrefillArgs& args, Stream stream) {
  constexpr const char* op = "mha_prefill";

  // q [Tq, H, 192], k [Tk, H, 192], v [Tk, H, 128], one dtype.
  check::ndim(op, "q", args.q, 3);
  const int64_t num_q_tokens = args.q.shape[0];
  const int64_t num_heads = args.q.shape[1];
  MLA_CHECK(num_heads >= 1 && num_heads <= kMaxHeads, op, ": number of heads (q.shape[1]) must be in 1..",
            kMaxHeads, ", got ", num_heads);
  check::dim(op, "q", args.q, 2, kQkHeadDim, "qk_nope_head_dim 128 + rope 64");
  check::dtype_in(op, "q", args.q, {DType::kBF16, DType::kFP16, DType::kFP8E4M3});
  check::inner_contiguous(op, "q", args.q);
  check::ndim(op, "k", args.k, 3);
  const int64_t num_kv_tokens = args.k.shape[0];
  check::dim(op, "k", args.k, 1, num_heads, "heads, as q");
  check::dim(op, "k", args.k, 2, kQkHeadDim, "qk head dim, as q");
  check::dtype(op, "k", args.k, args.q.dtype);
  check::inner_contiguous(op, "k", args.k);
  check::ndim(op, "v", args.v, 3);
  check::dim(op, "v", args.v, 0, num_kv_tokens, "kv tokens, as k");
  check::dim(op, "v", args.v, 1, num_heads, "heads, as q");
  check::dim(op, "v", args.v, 2, kVHeadDim, "v head dim");
  check::dtype(op, "v", args.v, args.q.dtype);
  check::inner_contiguous(op, "v", args.v);

  // Ragged batch description.
  check::ndim(op, "cu_q_lens", args.cu_q_lens, 1);
  MLA_CHECK(args.cu_q_lens.shape[0] >= 1, op,
            ": cu_q_lens must have B + 1 >= 1 entries, got shape [0]");
  check::dtype(op, "cu_q_lens", args.cu_q_lens, DType::kInt32);
  check::contiguous(op, "cu_q_lens", args.cu_q_lens);
  const int64_t batch = args.cu_q_lens.shape[0] - 1;
  check::ndim(op, "cu_kv_lens", args.cu_kv_lens, 1);
  check::dim(op, "cu_kv_lens", args.cu_kv_lens, 0, batch + 1, "requests + 1, as cu_q_lens");
  check::dtype(op, "cu_kv_lens", args.cu_kv_lens, DType::kInt32);
  check::contiguous(op, "cu_kv_lens", args.cu_kv_lens);
  MLA_CHECK(args.max_q_len >= 0, op, ": max_q_len must be >= 0 (0 = derive), got ",
            args.max_q_len);
  MLA_CHECK(args.max_kv_len >= 0, op, ": max_kv_len must be >= 0 (0 = derive), got ",
            args.max_kv_len);
  detail::check_softmax_scale(op, args.softmax_scale);
  detail::check_scale(op, "q_scale", args.q_scale);
  detail::check_scale(op, "k_scale", args.k_scale);
  detail::check_scale(op, "v_scale", args.v_scale);

  // Outputs.
  detail::check_attention_outputs(
      op, "q", args.out, args.lse, num_q_tokens, num_heads, kVHeadDim, "v head dim",
      {{"q", &args.q}, {"k", &args.k}, {"v", &args.v}, {"cu_q_lens", &args.cu_q_lens},
       {"cu_kv_lens", &args.cu_kv_lens}});

  const Device device = detail::common_device(
      op, {{"q", &args.q}, {"k", &args.k}, {"v", &args.v}, {"cu_q_lens", &args.cu_q_lens},
           {"cu_kv_lens", &args.cu_kv_lens}, {"out", &args.out}, {"lse", &args.lse}});
  MLA_CHECK(batch > 0 || (num_q_tokens == 0 && num_kv_tokens == 0), op, ": q has ", num_q_tokens,
            " tokens and k has ", num_kv_tokens, " but cu_q_lens describes no request");
  if (batch == 0 || num_q_tokens == 0) return;  // nothing to compute: no bounds needed
  MLA_CHECK(device.type == DeviceType::kCPU || (args.max_q_len > 0 && args.max_kv_len > 0), op,
            ": max_q_len and max_kv_len must be given (> 0) on ", device_name(device),
            " (only the CPU derives them from the cumulative lengths), got ", args.max_q_len,
            " and ", args.max_kv_len);
  detail::run_on(op, device, [&] { cpu::mha_prefill(args); },
                 [&] {
#if defined(MLA_WITH_CUDA)
                   cuda::mha_prefill(args, stream);
#endif
                 });
  (void)stream;
}

}  // namespace mla
