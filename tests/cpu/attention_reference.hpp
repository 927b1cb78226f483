// Float64 naive references for the attention ops, written straight from the formulas in
// mla/ops.hpp and independent of the library's implementations. They read host tensors through
// their views (any strides), so CPU and GPU tests can share them (GPU tests pass host copies).
// Inputs must be valid (the references do not validate); results are row-major and contiguous:
//   out [T, H, Dv], lse [T, H]; a row that sees no key has out 0 and lse -inf.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "mla/ops.hpp"

namespace mla::test {

struct NaiveAttention {
  std::vector<double> out;  // [T, H, Dv]
  std::vector<double> lse;  // [T, H]
};

// Element [i0, i1, ...] of a float tensor, as double.
inline double element(const TensorView& t, int64_t i0, int64_t i1 = 0, int64_t i2 = 0) {
  const int64_t offset =
      i0 * t.stride[0] + (t.ndim > 1 ? i1 * t.stride[1] : 0) + (t.ndim > 2 ? i2 * t.stride[2] : 0);
  return double(load_as_float(t.data, t.dtype, offset));
}

inline int64_t int_element(const TensorView& t, int64_t i0, int64_t i1 = 0) {
  const int64_t offset = i0 * t.stride[0] + (t.ndim > 1 ? i1 * t.stride[1] : 0);
  if (t.dtype == DType::kInt64) return static_cast<const int64_t*>(t.data)[offset];
  return static_cast<const int32_t*>(t.data)[offset];
}

// The logical contents of a 2-D or 3-D float tensor view (any strides), row-major, as float.
inline std::vector<float> gather_floats(const TensorView& t) {
  std::vector<float> values;
  values.reserve(size_t(t.numel()));
  const int64_t n0 = t.shape[0], n1 = t.ndim > 1 ? t.shape[1] : 1, n2 = t.ndim > 2 ? t.shape[2] : 1;
  for (int64_t i = 0; i < n0; ++i)
    for (int64_t j = 0; j < n1; ++j)
      for (int64_t k = 0; k < n2; ++k) values.push_back(float(element(t, i, j, k)));
  return values;
}

// Softmax-weighted sum of `values` (num_keys x dv, row-major) by `scores`, times value_scale,
// into out[0, dv) and lse; no keys gives out 0 and lse -inf.
inline void naive_softmax_row(const std::vector<double>& scores, const std::vector<double>& values,
                              int64_t dv, double value_scale, double* out, double& lse) {
  std::fill(out, out + dv, 0.0);
  if (scores.empty()) {
    lse = -std::numeric_limits<double>::infinity();
    return;
  }
  const double max_score = *std::max_element(scores.begin(), scores.end());
  double sum = 0;
  for (size_t j = 0; j < scores.size(); ++j) {
    const double p = std::exp(scores[j] - max_score);
    sum += p;
    for (int64_t c = 0; c < dv; ++c) out[c] += p * values[j * size_t(dv) + size_t(c)];
  }
  for (int64_t c = 0; c < dv; ++c) out[c] *= value_scale / sum;
  lse = max_score + std::log(sum);
}

// mla_decode: absorbed attention over the paged cache (uses q or q_nope/q_pe as given).
inline NaiveAttention naive_mla_decode(const MlaDecodeArgs& a) {
  const bool fused = !a.q.empty();
  const TensorView& q0 = fused ? a.q : a.q_nope;
  const int64_t num_tokens = q0.shape[0], num_heads = q0.shape[1];
  const int64_t batch = a.block_table.shape[0];
  const int64_t page_size = a.kv_cache.shape[1];
  const bool fp8_cache = a.kv_cache.dtype == DType::kFP8E4M3;
  const double score_scale = double(a.softmax_scale) *
                             (q0.dtype == DType::kFP8E4M3 ? double(a.q_scale) : 1.0) *
                             (fp8_cache ? double(a.k_scale) : 1.0);
  const double value_scale = fp8_cache ? double(a.k_scale) : 1.0;
  NaiveAttention result;
  result.out.assign(size_t(num_tokens * num_heads * kKvLoraRank), 0.0);
  result.lse.assign(size_t(num_tokens * num_heads), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t first = a.cu_q_lens.empty() ? b * a.q_len : int_element(a.cu_q_lens, b);
    const int64_t q_len = a.cu_q_lens.empty() ? a.q_len : int_element(a.cu_q_lens, b + 1) - first;
    const int64_t kv_len = int_element(a.kv_lens, b);
    if (q_len == 0) continue;
    // The request's keys (kv_len x 576) and values (kv_len x 512), dequantised.
    std::vector<double> keys, values;
    for (int64_t j = 0; j < kv_len; ++j) {
      const int64_t page = int_element(a.block_table, b, j / page_size);
      for (int64_t d = 0; d < kLatentDim; ++d) {
        const double x = element(a.kv_cache, page, j % page_size, d);
        keys.push_back(x);
        if (d < kKvLoraRank) values.push_back(x);
      }
    }
    for (int64_t i = 0; i < q_len; ++i) {
      const int64_t t = first + i;
      const int64_t seen = std::clamp<int64_t>(kv_len - q_len + i + 1, 0, kv_len);
      for (int64_t h = 0; h < num_heads; ++h) {
        std::vector<double> query(kLatentDim);
        for (int64_t d = 0; d < kLatentDim; ++d)
          query[size_t(d)] = fused ? element(a.q, t, h, d)
                             : d < kKvLoraRank ? element(a.q_nope, t, h, d)
                                               : element(a.q_pe, t, h, d - kKvLoraRank);
        std::vector<double> scores(static_cast<size_t>(seen));
        for (int64_t j = 0; j < seen; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < kLatentDim; ++d)
            dot += query[size_t(d)] * keys[size_t(j * kLatentDim + d)];
          scores[size_t(j)] = dot * score_scale;
        }
        const int64_t row = t * num_heads + h;
        naive_softmax_row(scores, values, kKvLoraRank, value_scale,
                          result.out.data() + row * kKvLoraRank, result.lse[size_t(row)]);
      }
    }
  }
  return result;
}

// mha_prefill: ragged per-head attention, causal bottom-right aligned or not.
inline NaiveAttention naive_mha_prefill(const MhaPrefillArgs& a) {
  const int64_t num_heads = a.q.shape[1], dqk = a.q.shape[2], dv = a.v.shape[2];
  const int64_t batch = a.cu_q_lens.shape[0] - 1;
  const bool fp8 = a.q.dtype == DType::kFP8E4M3;
  const double score_scale =
      double(a.softmax_scale) * (fp8 ? double(a.q_scale) * double(a.k_scale) : 1.0);
  const double value_scale = fp8 ? double(a.v_scale) : 1.0;
  const int64_t num_tokens = a.q.shape[0];
  NaiveAttention result;
  result.out.assign(size_t(num_tokens * num_heads * dv), 0.0);
  result.lse.assign(size_t(num_tokens * num_heads), 0.0);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t q_first = int_element(a.cu_q_lens, b);
    const int64_t q_len = int_element(a.cu_q_lens, b + 1) - q_first;
    const int64_t kv_first = int_element(a.cu_kv_lens, b);
    const int64_t kv_len = int_element(a.cu_kv_lens, b + 1) - kv_first;
    for (int64_t h = 0; h < num_heads; ++h) {
      std::vector<double> keys, values;  // kv_len x dqk, kv_len x dv
      for (int64_t j = 0; j < kv_len; ++j) {
        for (int64_t d = 0; d < dqk; ++d) keys.push_back(element(a.k, kv_first + j, h, d));
        for (int64_t d = 0; d < dv; ++d) values.push_back(element(a.v, kv_first + j, h, d));
      }
      for (int64_t i = 0; i < q_len; ++i) {
        const int64_t seen =
            a.causal ? std::clamp<int64_t>(kv_len - q_len + i + 1, 0, kv_len) : kv_len;
        std::vector<double> query(static_cast<size_t>(dqk)), scores(static_cast<size_t>(seen));
        for (int64_t d = 0; d < dqk; ++d) query[size_t(d)] = element(a.q, q_first + i, h, d);
        for (int64_t j = 0; j < seen; ++j) {
          double dot = 0;
          for (int64_t d = 0; d < dqk; ++d) dot += query[size_t(d)] * keys[size_t(j * dqk + d)];
          scores[size_t(j)] = dot * score_scale;
        }
        const int64_t row = (q_first + i) * num_heads + h;
        naive_softmax_row(scores, values, dv, value_scale, result.out.data() + row * dv,
                          result.lse[size_t(row)]);
      }
    }
  }
  return result;
}

// merge_states: combination of two partial attentions by their LSE.
inline NaiveAttention naive_merge_states(const MergeStatesArgs& a) {
  const int64_t num_tokens = a.out_a.shape[0], num_heads = a.out_a.shape[1], dv = a.out_a.shape[2];
  const double neg_inf = -std::numeric_limits<double>::infinity();
  NaiveAttention result;
  for (int64_t t = 0; t < num_tokens; ++t) {
    for (int64_t h = 0; h < num_heads; ++h) {
      const double lse_a = element(a.lse_a, t, h), lse_b = element(a.lse_b, t, h);
      const double lse_max = std::max(lse_a, lse_b);
      double wa = 0, wb = 0, lse = neg_inf;
      if (lse_max != neg_inf) {
        const double ea = lse_a == neg_inf ? 0.0 : std::exp(lse_a - lse_max);
        const double eb = lse_b == neg_inf ? 0.0 : std::exp(lse_b - lse_max);
        wa = ea / (ea + eb);
        wb = eb / (ea + eb);
        lse = lse_max + std::log(ea + eb);
      }
      for (int64_t c = 0; c < dv; ++c) {
        const double va = wa == 0 ? 0.0 : wa * element(a.out_a, t, h, c);
        const double vb = wb == 0 ? 0.0 : wb * element(a.out_b, t, h, c);
        result.out.push_back(va + vb);
      }
      result.lse.push_back(lse);
    }
  }
  return result;
}

}  // namespace mla::test
