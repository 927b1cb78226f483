// merge_states: public entry — validation, then device dispatch.
#include "cpu/cpu_ops.hpp"
#include "mla/error.hpp"
#include "ops/dispatch.hpp"
#if defined(MLA_WITH_CUDA)
#include "cuda/cuda_ops.hpp"
#endif

namespace mla {

void merge_states(const MergeStatesArgs& args, Stream stream) {
  constexpr const char* op = "merge_states";
  check::ndim(op, "out_a", args.out_a, 3);
  const int64_t num_tokens = args.out_a.shape[0];
  const int64_t num_heads = args.out_a.shape[1];
  const int64_t head_dim = args.out_a.shape[2];
  const std::initializer_list<DType> out_dtypes = {DType::kBF16, DType::kFP16, DType::kFP32};
  for (auto [name, t] : {std::pair{"out_a", &args.out_a}, {"out_b", &args.out_b}, {"out", &args.out}}) {
    check::ndim(op, name, *t, 3);
    check::dim(op, name, *t, 0, num_tokens, "tokens, as out_a");
    check::dim(op, name, *t, 1, num_heads, "heads, as out_a");
    check::dim(op, name, *t, 2, head_dim, "head dim, as out_a");
    check::dtype_in(op, name, *t, out_dtypes);
    check::inner_contiguous(op, name, *t);
  }
  check::non_overlapping(op, "out", args.out);
  for (auto [name, t] : {std::pair{"lse_a", &args.lse_a}, {"lse_b", &args.lse_b}, {"lse_out", &args.lse_out}}) {
    if (t == &args.lse_out && t->empty()) continue;
    check::ndim(op, name, *t, 2);
    check::dim(op, name, *t, 0, num_tokens, "tokens, as out_a");
    check::dim(op, name, *t, 1, num_heads, "heads, as out_a");
    check::dtype(op, name, *t, DType::kFP32);
  }
  if (!args.lse_out.empty()) check::non_overlapping(op, "lse_out", args.lse_out);
  // In place over a state is allowed (each element is read before its own result is written);
  // any other overlap of an output with an input, or of the outputs, is not.
  check::same_or_disjoint(op, "out", args.out, "out_a", args.out_a);
  check::same_or_disjoint(op, "out", args.out, "out_b", args.out_b);
  check::disjoint(op, "out", args.out, {{"lse_a", &args.lse_a}, {"lse_b", &args.lse_b}});
  if (!args.lse_out.empty()) {
    check::same_or_disjoint(op, "lse_out", args.lse_out, "lse_a", args.lse_a);
    check::same_or_disjoint(op, "lse_out", args.lse_out, "lse_b", args.lse_b);
    check::disjoint(op, "lse_out", args.lse_out,
                    {{"out_a", &args.out_a}, {"out_b", &args.out_b}, {"out", &args.out}});
  }
  const Device device = detail::common_device(
      op, {{"out_a", &args.out_a}, {"lse_a", &args.lse_a}, {"out_b", &args.out_b},
           {"lse_b", &args.lse_b}, {"out", &args.out}, {"lse_out", &args.lse_out}});
  if (num_tokens == 0 || num_heads == 0) return;
  detail::run_on(op, device, [&] { cpu::merge_states(args); },
                 [&] {
#if defined(MLA_WITH_CUDA)
                   cuda::merge_states(args, stream);
#endif
                 });
  (void)stream;
}

}  // namespace mla
