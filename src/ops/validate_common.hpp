// Argument checks shared by the public op entries (src/ops/*.cpp).
#pragma once

#include <cmath>
#include <cstdint>
#include <string>

#include "mla/error.hpp"
#include "mla/tensor.hpp"

namespace mla::detail {

inline bool is_power_of_two(int64_t x) { return x > 0 && (x & (x - 1)) == 0; }

// A dequantisation scale: finite and > 0.
inline void check_scale(const char* op, const char* name, float value) {
  MLA_CHECK(std::isfinite(value) && value > 0, op, ": ", name, " must be finite and > 0, got ",
            value);
}

// The softmax scale of an attention op: required, finite and > 0.
inline void check_softmax_scale(const char* op, float softmax_scale) {
  MLA_CHECK(std::isfinite(softmax_scale) && softmax_scale > 0, op,
            ": softmax_scale is required and must be finite and > 0 (e.g. 1/sqrt(192)), got ",
            softmax_scale);
}

// The outputs of an attention op over num_tokens query tokens of num_heads heads (q_name: the
// query tensor the caller gave): out [T, H, out_dim] bf16/fp16/fp32 with a contiguous last dim,
// and lse [T, H] fp32 if given; neither overlaps the other or any of `inputs` (not given: skipped).
inline void check_attention_outputs(
    const char* op, const char* q_name, const TensorView& out, const TensorView& lse,
    int64_t num_tokens, int64_t num_heads, int64_t out_dim, const char* out_dim_what,
    check::NamedViews inputs) {
  const std::string tokens = std::string("tokens, as ") + q_name;
  const std::string heads = std::string("heads, as ") + q_name;
  check::ndim(op, "out", out, 3);
  check::dim(op, "out", out, 0, num_tokens, tokens.c_str());
  check::dim(op, "out", out, 1, num_heads, heads.c_str());
  check::dim(op, "out", out, 2, out_dim, out_dim_what);
  check::dtype_in(op, "out", out, {DType::kBF16, DType::kFP16, DType::kFP32});
  check::inner_contiguous(op, "out", out);
  check::non_overlapping(op, "out", out);
  if (!lse.empty()) {
    check::ndim(op, "lse", lse, 2);
    check::dim(op, "lse", lse, 0, num_tokens, tokens.c_str());
    check::dim(op, "lse", lse, 1, num_heads, heads.c_str());
    check::dtype(op, "lse", lse, DType::kFP32);
    check::non_overlapping(op, "lse", lse);
    check::disjoint(op, "lse", lse, "out", out);
    check::disjoint(op, "lse", lse, inputs);
  }
  check::disjoint(op, "out", out, inputs);
}

}  // namespace mla::detail
