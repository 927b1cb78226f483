// rope_quantize: public entry — validation, then device dispatch.
#include "cpu/cpu_ops.hpp"
#include "mla/error.hpp"
#include "ops/dispatch.hpp"
#include "ops/validate_common.hpp"
#if defined(MLA_WITH_CUDA)
#include "cuda/cuda_ops.hpp"
#endif

namespace mla {

void rope_quantize(const RopeQuantizeArgs& args, Stream stream) {
  constexpr const char* op = "rope_quantize";
  const std::initializer_list<DType> input_dtypes = {DType::kBF16, DType::kFP16, DType::kFP32};
  const std::initializer_list<DType> output_dtypes = {DType::kBF16, DType::kFP16, DType::kFP8E4M3};

  // Queries: q_nope [T, H, 512], q_pe [T, H, 64] -> q_out [T, H, 576].
  check::ndim(op, "q_nope", args.q_nope, 3);
  const int64_t num_tokens = args.q_nope.shape[0];
  const int64_t num_heads = args.q_nope.shape[1];
  MLA_CHECK(num_heads >= 1 && num_heads <= kMaxHeads, op, ": q_nope.shape[1] (heads) must be in 1..",
            kMaxHeads, ", got ", num_heads, " (", args.q_nope.describe(), ")");
  check::dim(op, "q_nope", args.q_nope, 2, kKvLoraRank, "kv_lora_rank");
  check::dtype_in(op, "q_nope", args.q_nope, input_dtypes);
  check::inner_contiguous(op, "q_nope", args.q_nope);
  const DType input_dtype = args.q_nope.dtype;

  check::ndim(op, "q_pe", args.q_pe, 3);
  check::dim(op, "q_pe", args.q_pe, 0, num_tokens, "tokens, as q_nope");
  check::dim(op, "q_pe", args.q_pe, 1, num_heads, "heads, as q_nope");
  check::dim(op, "q_pe", args.q_pe, 2, kRopeDim, "rope dim");
  check::dtype(op, "q_pe", args.q_pe, input_dtype);
  check::inner_contiguous(op, "q_pe", args.q_pe);

  check::ndim(op, "q_out", args.q_out, 3);
  check::dim(op, "q_out", args.q_out, 0, num_tokens, "tokens, as q_nope");
  check::dim(op, "q_out", args.q_out, 1, num_heads, "heads, as q_nope");
  check::dim(op, "q_out", args.q_out, 2, kLatentDim, "kv_lora_rank 512 + rope 64");
  check::dtype_in(op, "q_out", args.q_out, output_dtypes);
  check::inner_contiguous(op, "q_out", args.q_out);
  check::non_overlapping(op, "q_out", args.q_out);

  // Keys: all four k tensors are given together, or none of them. Each is [T, width], T as
  // q_nope, of one of `dtypes`, with a contiguous last dim.
  const auto check_key_tensor = [&](const char* name, const TensorView& t, int64_t width,
                                    const char* width_what, std::initializer_list<DType> dtypes) {
    check::ndim(op, name, t, 2);
    check::dim(op, name, t, 0, num_tokens, "tokens, as q_nope");
    check::dim(op, name, t, 1, width, width_what);
    if (dtypes.size() == 1)
      check::dtype(op, name, t, *dtypes.begin());
    else
      check::dtype_in(op, name, t, dtypes);
    check::inner_contiguous(op, name, t);
  };
  // An output is written by many threads at once: two of its elements in one place race.
  const auto check_key_output = [&](const char* name, const TensorView& t, int64_t width,
                                    const char* width_what, std::initializer_list<DType> dtypes) {
    check_key_tensor(name, t, width, width_what, dtypes);
    check::non_overlapping(op, name, t);
  };
  const bool with_k = !args.k_nope.empty();
  if (with_k) {
    check_key_tensor("k_nope", args.k_nope, kKvLoraRank, "kv_lora_rank", {input_dtype});
    MLA_CHECK(!args.k_pe.empty(), op, ": k_pe is required when k_nope is given");
    check_key_tensor("k_pe", args.k_pe, kRopeDim, "rope dim", {input_dtype});
    MLA_CHECK(!args.k_nope_out.empty(), op, ": k_nope_out is required when k_nope is given");
    check_key_output("k_nope_out", args.k_nope_out, kKvLoraRank, "kv_lora_rank", output_dtypes);
    MLA_CHECK(!args.k_pe_out.empty(), op, ": k_pe_out is required when k_nope is given");
    check_key_output("k_pe_out", args.k_pe_out, kRopeDim, "rope dim", {args.k_nope_out.dtype});
  } else {
    MLA_CHECK(args.k_pe.empty(), op, ": k_pe is given but k_nope is not (give both or neither)");
    MLA_CHECK(args.k_nope_out.empty(), op,
              ": k_nope_out is given but k_nope is not (the k outputs need k_nope and k_pe)");
    MLA_CHECK(args.k_pe_out.empty(), op,
              ": k_pe_out is given but k_nope is not (the k outputs need k_nope and k_pe)");
  }

  check::ndim(op, "cos_sin_cache", args.cos_sin_cache, 2);
  check::dim(op, "cos_sin_cache", args.cos_sin_cache, 1, kRopeDim, "32 cos then 32 sin");
  check::dtype(op, "cos_sin_cache", args.cos_sin_cache, DType::kFP32);
  check::inner_contiguous(op, "cos_sin_cache", args.cos_sin_cache);

  check::ndim(op, "positions", args.positions, 1);
  check::dim(op, "positions", args.positions, 0, num_tokens, "tokens, as q_nope");
  check::dtype_in(op, "positions", args.positions, {DType::kInt32, DType::kInt64});
  check::inner_contiguous(op, "positions", args.positions);

  MLA_CHECK(args.style == RopeStyle::kNeox || args.style == RopeStyle::kInterleaved, op,
            ": style must be kNeox or kInterleaved, got ", int(args.style));
  detail::check_scale(op, "q_scale", args.q_scale);
  detail::check_scale(op, "k_scale", args.k_scale);

  const Device device = detail::common_device(
      op, {{"q_nope", &args.q_nope}, {"q_pe", &args.q_pe}, {"k_nope", &args.k_nope},
           {"k_pe", &args.k_pe}, {"cos_sin_cache", &args.cos_sin_cache},
           {"positions", &args.positions}, {"q_out", &args.q_out},
           {"k_nope_out", &args.k_nope_out}, {"k_pe_out", &args.k_pe_out}});
  // Not in place: the GPU reads a pair's partner while other threads write.
  const check::NamedViews inputs = {
      {"q_nope", &args.q_nope}, {"q_pe", &args.q_pe}, {"k_nope", &args.k_nope},
      {"k_pe", &args.k_pe}, {"cos_sin_cache", &args.cos_sin_cache}, {"positions", &args.positions}};
  check::disjoint(op, "q_out", args.q_out, inputs);
  check::disjoint(op, "k_nope_out", args.k_nope_out, inputs);
  check::disjoint(op, "k_nope_out", args.k_nope_out, "q_out", args.q_out);
  check::disjoint(op, "k_pe_out", args.k_pe_out, inputs);
  check::disjoint(op, "k_pe_out", args.k_pe_out,
                  {{"q_out", &args.q_out}, {"k_nope_out", &args.k_nope_out}});
  if (num_tokens == 0) return;
  detail::run_on(op, device, [&] { cpu::rope_quantize(args); },
                 [&] {
#if defined(MLA_WITH_CUDA)
                   cuda::rope_quantize(args, stream);
#endif
                 });
  (void)stream;
}

}  // namespace mla
