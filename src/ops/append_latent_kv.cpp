// append_latent_kv: public entry — validation, then device dispatch.
#include "cpu/cpu_ops.hpp"
#include "mla/error.hpp"
#include "ops/dispatch.hpp"
#include "ops/validate_common.hpp"
#if defined(MLA_WITH_CUDA)
#include "cuda/cuda_ops.hpp"
#endif

namespace mla {

void append_latent_kv(const AppendLatentKvArgs& args, Stream stream) {
  constexpr const char* op = "append_latent_kv";
  const std::initializer_list<DType> input_dtypes = {DType::kBF16, DType::kFP16, DType::kFP32};

  check::ndim(op, "k_nope", args.k_nope, 2);
  const int64_t num_tokens = args.k_nope.shape[0];
  check::dim(op, "k_nope", args.k_nope, 1, kKvLoraRank, "kv_lora_rank");
  check::dtype_in(op, "k_nope", args.k_nope, input_dtypes);
  check::inner_contiguous(op, "k_nope", args.k_nope);

  check::ndim(op, "k_pe", args.k_pe, 2);
  check::dim(op, "k_pe", args.k_pe, 0, num_tokens, "tokens, as k_nope");
  check::dim(op, "k_pe", args.k_pe, 1, kRopeDim, "rope dim");
  check::dtype(op, "k_pe", args.k_pe, args.k_nope.dtype);
  check::inner_contiguous(op, "k_pe", args.k_pe);

  check::ndim(op, "loc", args.loc, 1);
  check::dim(op, "loc", args.loc, 0, num_tokens, "tokens, as k_nope");
  check::dtype_in(op, "loc", args.loc, {DType::kInt32, DType::kInt64});
  check::inner_contiguous(op, "loc", args.loc);

  check::ndim(op, "kv_cache", args.kv_cache, 3);
  const int64_t page_size = args.kv_cache.shape[1];
  MLA_CHECK(detail::is_power_of_two(page_size) && page_size <= kMaxPageSize, op,
            ": kv_cache.shape[1] (page size) must be a power of two in 1..", kMaxPageSize, ", got ",
            page_size, " (", args.kv_cache.describe(), ")");
  check::dim(op, "kv_cache", args.kv_cache, 2, kLatentDim, "kv_lora_rank 512 + rope 64");
  check::dtype_in(op, "kv_cache", args.kv_cache, {DType::kBF16, DType::kFP16, DType::kFP8E4M3});
  check::contiguous(op, "kv_cache", args.kv_cache);

  detail::check_scale(op, "k_scale", args.k_scale);
  // The cache is written while the inputs are read (cache entries moved within the cache would
  // depend on the order of the writes).
  check::disjoint(op, "kv_cache", args.kv_cache,
                  {{"k_nope", &args.k_nope}, {"k_pe", &args.k_pe}, {"loc", &args.loc}});

  const Device device = detail::common_device(
      op, {{"k_nope", &args.k_nope}, {"k_pe", &args.k_pe}, {"loc", &args.loc},
           {"kv_cache", &args.kv_cache}});
  if (num_tokens == 0) return;
  detail::run_on(op, device, [&] { cpu::append_latent_kv(args); },
                 [&] {
#if defined(MLA_WITH_CUDA)
                   cuda::append_latent_kv(args, stream);
#endif
                 });
  (void)stream;
}

}  // namespace mla
