// CPU merge_states: per (token, head) row, combine two partial softmax states by their LSE.
#include <cmath>
#include <limits>

#include "cpu/cpu_ops.hpp"
#include "cpu/parallel.hpp"

namespace mla::cpu {

void merge_states(const MergeStatesArgs& args) {
  const int64_t num_tokens = args.out_a.shape[0];
  const int64_t num_heads = args.out_a.shape[1];
  const int64_t head_dim = args.out_a.shape[2];
  const float neg_inf = -std::numeric_limits<float>::infinity();
  auto offset = [](const TensorView& t, int64_t i, int64_t h) {
    return i * t.stride[0] + h * t.stride[1];
  };
  parallel_for(num_tokens * num_heads, [&](int64_t row) {
    const int64_t i = row / num_heads, h = row % num_heads;
    const float lse_a = static_cast<const float*>(args.lse_a.data)[offset(args.lse_a, i, h)];
    const float lse_b = static_cast<const float*>(args.lse_b.data)[offset(args.lse_b, i, h)];
    const float lse_max = std::max(lse_a, lse_b);
    float weight_a = 0, weight_b = 0, lse = neg_inf;
    if (lse_max != neg_inf) {
      // Written so that a -inf side gets weight exactly 0 and never produces NaN.
      const double ea = lse_a == neg_inf ? 0.0 : std::exp(double(lse_a) - lse_max);
      const double eb = lse_b == neg_inf ? 0.0 : std::exp(double(lse_b) - lse_max);
      const double sum = ea + eb;
      weight_a = float(ea / sum);
      weight_b = float(eb / sum);
      lse = float(lse_max + std::log(sum));
    }
    const int64_t oa = offset(args.out_a, i, h), ob = offset(args.out_b, i, h);
    const int64_t oo = offset(args.out, i, h);
    for (int64_t d = 0; d < head_dim; ++d) {
      const float a = weight_a == 0 ? 0.f : weight_a * load_as_float(args.out_a.data, args.out_a.dtype, oa + d);
      const float b = weight_b == 0 ? 0.f : weight_b * load_as_float(args.out_b.data, args.out_b.dtype, ob + d);
      // A side of weight 0 adds nothing, not even +0 (a -0 of the other side stays -0).
      store_from_float(args.out.data, args.out.dtype, oo + d, weight_b == 0 ? a : weight_a == 0 ? b : a + b);
    }
    if (!args.lse_out.empty())
      static_cast<float*>(args.lse_out.data)[offset(args.lse_out, i, h)] = lse;
  });
}

}  // namespace mla::cpu
